// libFuzzer target: the pickle reader (src/io/pickle_reader.cpp) on any bytes
// as data.pkl. Each storage it asks for is a tensor of zeros of up to 1 MiB
// (a record of a file under 1 MiB, the bound) and a refusal beyond. A
// refusal is a c10::Error; anything else is a finding.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_input.h"
#include "io/pickle.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  mha_fuzz::setup();
  using mha::detail::DtypeName;
  const mha::detail::StorageLoader load_storage =
      [](const std::string& key, const DtypeName& dtype, uint64_t numel) {
        uint64_t nbytes = 0;
        TORCH_CHECK(mha::detail::checked_mul(
                        numel, mha::detail::element_size(dtype), &nbytes) &&
                        nbytes <= (uint64_t{1} << 20),
                    "fuzz: storage '", key, "' of ", numel,
                    " elements is over 1 MiB");
        return torch::zeros({static_cast<int64_t>(numel)},
                            torch::dtype(dtype.dtype));
      };
  try {
    mha::detail::unpickle_state_dict(reinterpret_cast<const char*>(data), size,
                                     "fuzz", load_storage);
    ++mha_fuzz::loaded();
  } catch (const c10::Error&) {
  }
  return 0;
}
