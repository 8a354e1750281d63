// libFuzzer target: the zip layer (src/io/zip_archive.cpp, with LibTorch's
// PyTorchStreamReader under it) on any bytes: opens the archive and reads
// the records a state dict has. A refusal is a c10::Error; anything else is
// a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_input.h"
#include "io/zip_archive.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha_fuzz::setup();
  const std::string path = mha_fuzz::input_file("zip", data, size);
  try {
    mha::detail::ZipArchiveReader archive(path, "fuzz");
    for (const char* name : {"data.pkl", "byteorder", "data/0", "data/1",
                             "data/2", "version", "DATA/0"}) {
      if (archive.has_record(name)) {
        archive.record(name);
      }
    }
    ++mha_fuzz::loaded();
  } catch (const c10::Error&) {
  }
  return 0;
}
