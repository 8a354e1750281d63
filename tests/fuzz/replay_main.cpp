// Replays a fuzzing corpus through the libFuzzer targets of tests/fuzz in
// the normal build (no clang needed): `mha_fuzz_replay TARGET PATH...` runs
// TARGET's LLVMFuzzerTestOneInput (compiled here under the name
// mha_fuzz_TARGET) on every file of each PATH (a file or a directory) and
// exits 0 when every input returned, printing how many ran and how many
// loaded without refusal.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "fuzz_input.h"

extern "C" int mha_fuzz_safetensors(const uint8_t* data, size_t size);
extern "C" int mha_fuzz_pickle(const uint8_t* data, size_t size);
extern "C" int mha_fuzz_zip(const uint8_t* data, size_t size);
extern "C" int mha_fuzz_load_module(const uint8_t* data, size_t size);

namespace {

using Target = int (*)(const uint8_t*, size_t);

struct NamedTarget {
  const char* name;
  Target run;
};

const NamedTarget kTargets[] = {
    {"safetensors", mha_fuzz_safetensors},
    {"pickle", mha_fuzz_pickle},
    {"zip", mha_fuzz_zip},
    {"load_module", mha_fuzz_load_module},
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr,
                 "usage: %s TARGET PATH...  (TARGET: safetensors, pickle, "
                 "zip, load_module)\n",
                 argv[0]);
    return 2;
  }
  Target run = nullptr;
  for (const auto& target : kTargets) {
    if (std::strcmp(argv[1], target.name) == 0) {
      run = target.run;
    }
  }
  if (run == nullptr) {
    std::fprintf(stderr, "%s: unknown target '%s'\n", argv[0], argv[1]);
    return 2;
  }
  std::vector<std::filesystem::path> files;
  for (int i = 2; i < argc; ++i) {
    const std::filesystem::path path(argv[i]);
    if (std::filesystem::is_directory(path)) {
      for (const auto& entry : std::filesystem::directory_iterator(path)) {
        if (entry.is_regular_file()) {
          files.push_back(entry.path());
        }
      }
    } else {
      files.push_back(path);
    }
  }
  std::sort(files.begin(), files.end());
  if (files.empty()) {
    std::fprintf(stderr, "%s: no inputs found\n", argv[0]);
    return 1;
  }
  for (const auto& file : files) {
    std::ifstream in(file, std::ios::binary);
    const std::string bytes(std::istreambuf_iterator<char>(in), {});
    run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size());
  }
  std::printf("%s: replayed %zu inputs, none crashed; loaded %d\n", argv[1],
              files.size(), mha_fuzz::loaded());
  return 0;
}
