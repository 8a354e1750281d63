// libFuzzer target: the safetensors reader (src/io/safetensors.cpp) on any
// bytes. A refusal is a c10::Error; anything else (a crash, a sanitizer
// report, another exception) is a finding.
#include <cstddef>
#include <cstdint>
#include <fstream>

#include "fuzz_input.h"
#include "io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha_fuzz::setup();
  const std::string path = mha_fuzz::input_file("safetensors", data, size);
  std::ifstream in(path, std::ios::binary);
  try {
    if (size >= 8) {
      mha::detail::read_safetensors(path, in, size);
      ++mha_fuzz::loaded();
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
