// Internal, the PyTorch-file layer of state-dict I/O (declared in
// pytorch_format.h): joins the pickle layer (pickle.h) and the zip layer
// (zip_archive.h), each storage the pickle names read from its record, all
// within one MemoryBudget (tensor_file.h) of the file. Depends on those two
// and tensor_file.h.
#include "io/pytorch_format.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>

#include "io/pickle.h"
#include "io/tensor_file.h"
#include "io/zip_archive.h"

namespace mha::detail {

StateDict read_pytorch(const std::string& path) {
  const std::string where = file_label(path) + " (PyTorch zip)";
  ZipArchiveReader archive(path, where);
  // Held throughout: the zip reader's index, a record being read (at most
  // the largest stated; each storage is charged by the pickle reader before
  // it is read, and copied out of its record), data.pkl.
  MemoryBudget budget(archive.size(), where);
  budget.charge(archive.index_bytes(), "the zip archive's index");
  budget.charge(archive.largest_record(), "the zip archive's largest record");
  auto [pickle, pickle_size] = archive.record("data.pkl");
  budget.charge(pickle_size, "the record data.pkl");

  StorageLoader load_storage = [&](const std::string& key,
                                   const DtypeName& dtype, uint64_t numel) {
    const std::string name = "data/" + key;
    TORCH_CHECK(archive.has_record(name), where,
                ": data.pkl refers to the storage record '", name,
                "', which the archive lacks");
    const auto record = archive.record(name);
    const void* data = std::get<0>(record).get();
    const size_t size = std::get<1>(record);
    uint64_t nbytes = 0;
    TORCH_CHECK(
        checked_mul(numel, element_size(dtype), &nbytes) && nbytes == size,
        where, ": storage record '", name, "' holds ", size,
        " bytes, but data.pkl declares ", numel, " ", dtype.torch_name,
        " elements (", numel, " x ", element_size(dtype), " bytes)");
    return tensor_from_bytes(dtype, {static_cast<int64_t>(numel)},
                             [&](void* dst) { std::memcpy(dst, data, size); });
  };
  return unpickle_state_dict(static_cast<const char*>(pickle.get()),
                             pickle_size, where, load_storage, budget);
}

void write_pytorch(const TensorEntries& entries, const std::string& file,
                   const std::string& where) {
  write_zip_archive(file, where, pickle_state_dict(entries), entries);
}

}  // namespace mha::detail
