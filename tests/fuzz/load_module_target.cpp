// libFuzzer target: mha::load_state_dict (both formats, picked by content)
// into a small mha::MultiHeadAttention(embed_dim=4, num_heads=2), strict and
// not; after a load, one forward pass must run. A refusal is a c10::Error;
// anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_input.h"
#include "mha/mha.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha_fuzz::setup();
  const std::string path = mha_fuzz::input_file("load_module", data, size);
  static mha::MultiHeadAttention attention(4, 2);
  const bool strict = size % 2 == 0;
  try {
    mha::load_state_dict(*attention, path, strict);
    torch::NoGradGuard no_grad;
    const auto x = torch::ones({1, 3, 4});
    attention->forward(x, x, x);
    ++mha_fuzz::loaded();
  } catch (const c10::Error&) {
  }
  return 0;
}
