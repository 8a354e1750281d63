// Links mha::mha from the install tree and checks one result.
#include <mha/mha.h>

#include <iostream>
#include <string>

int main() {
  mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(16, 4));
  auto x = torch::randn({2, 5, 16});
  auto [out, weights] = attn(x);
  const bool ok = out.sizes() == torch::IntArrayRef({2, 5, 16}) &&
                  weights.sizes() == torch::IntArrayRef({2, 5, 5}) &&
                  torch::allclose(weights.sum(-1), torch::ones({2, 5}));
  // The library's version is the one its headers state.
  const std::string header_version = std::to_string(MHA_VERSION_MAJOR) + "." +
                                     std::to_string(MHA_VERSION_MINOR) + "." +
                                     std::to_string(MHA_VERSION_PATCH);
  const bool version_ok = header_version == mha::version();
  std::cout << (ok ? "consumer: ok" : "consumer: wrong result") << ", mha "
            << mha::version()
            << (version_ok ? "" : " (headers say " + header_version + ")")
            << '\n';
  return ok && version_ok ? 0 : 1;
}
