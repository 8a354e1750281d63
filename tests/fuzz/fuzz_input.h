// Shared by the libFuzzer targets of tests/fuzz: the readers under test take
// a path, so each input is written to one scratch file per process and
// target first.
#pragma once

#include <c10/util/Logging.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

namespace mha_fuzz {

/// Called first by every target: c10::Error's backtrace (symbolized on each
/// throw) would make refusals, the common case, cost most of the fuzzing
/// time, and its text is not what the targets test.
inline void setup() {
  static const bool done = [] {
    c10::SetStackTraceFetcher([] { return std::string(); });
    return true;
  }();
  (void)done;
}

/// Writes `data` to this process's scratch file for `target` (under the
/// system's temporary directory, removed at exit) and returns its path.
inline std::string input_file(const char* target, const uint8_t* data,
                              size_t size) {
  struct Scratch {
    std::string path;
    ~Scratch() {
      std::error_code ignored;
      std::filesystem::remove(path, ignored);
    }
  };
  static Scratch scratch{
      (std::filesystem::temp_directory_path() /
       ("mha-fuzz-" + std::string(target) + "-" + std::to_string(::getpid())))
          .string()};
  std::ofstream out(scratch.path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data),
            static_cast<std::streamsize>(size));
  out.close();
  return scratch.path;
}

/// The number of inputs a target loaded without refusal in this process
/// (the replay prints it, so that a corpus that no longer loads shows).
inline int& loaded() {
  static int count = 0;
  return count;
}

}  // namespace mha_fuzz
