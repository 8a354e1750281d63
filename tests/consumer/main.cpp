// Links mha::mha from the install tree and checks one result.
#include <mha/mha.h>

#include <iostream>

int main() {
  mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(16, 4));
  auto x = torch::randn({2, 5, 16});
  auto [out, weights] = attn(x);
  const bool ok = out.sizes() == torch::IntArrayRef({2, 5, 16}) &&
                  weights.sizes() == torch::IntArrayRef({2, 5, 5}) &&
                  torch::allclose(weights.sum(-1), torch::ones({2, 5}));
  std::cout << (ok ? "consumer: ok" : "consumer: wrong result") << '\n';
  return ok ? 0 : 1;
}
