// Internal, the bottom layer of state-dict I/O: what the safetensors and
// PyTorch formats share (the dtype table, overflow-checked arithmetic,
// printable text, exact reads, tensors from raw bytes, the memory budget of
// one load). Depends on LibTorch only. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

// Both formats store little-endian data, copied here as it is.
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "mha's state-dict I/O assumes a little-endian machine"
#endif

namespace mha::detail {

/// A state dict: (name, tensor) entries in order.
using StateDict = torch::OrderedDict<std::string, torch::Tensor>;

/// The entries a writer gets: checked, contiguous CPU tensors, in order.
using TensorEntries = std::vector<std::pair<std::string, torch::Tensor>>;

/// One supported dtype under the names the two formats give it.
struct DtypeName {
  torch::ScalarType dtype;
  const char* torch_name;   // for messages: "float32"
  const char* safetensors;  // safetensors "dtype" field: "F32"
  const char* storage;      // PyTorch storage class torch.<storage>
};

/// The entry of `dtype`, nullptr when it is not supported.
const DtypeName* find_dtype(torch::ScalarType dtype);

/// The entry whose safetensors name is `name` ("F32"), or nullptr.
const DtypeName* find_safetensors_dtype(const std::string& name);

/// The entry whose PyTorch storage class is `name` ("FloatStorage"), or
/// nullptr.
const DtypeName* find_storage_type(const std::string& name);

/// The supported dtypes for messages: "float64, float32, ...".
std::string supported_dtypes();

/// The bytes of one element of `d`.
uint64_t element_size(const DtypeName& d);

/// a * b, false on overflow.
bool checked_mul(uint64_t a, uint64_t b, uint64_t* out);

/// a + b, false on overflow.
bool checked_add(uint64_t a, uint64_t b, uint64_t* out);

/// The number of elements of `shape` (entries >= 0), false on overflow past
/// int64.
bool checked_numel(const std::vector<int64_t>& shape, uint64_t* numel);

/// Untrusted text made safe to print: at most 80 characters, with control
/// and non-ASCII bytes written as \xNN.
std::string printable(const std::string& text);

/// The prefix of every message about the file `path`.
std::string file_label(const std::string& path);

/// Reads exactly `n` bytes at `offset` of `in` into `dst`.
void read_exact(std::ifstream& in, uint64_t offset, void* dst, uint64_t n,
                const std::string& where, const char* what);

/// A tensor read from `n` raw little-endian bytes. Bool data is read as
/// bytes and compared with 0, so that a byte other than 0 or 1 cannot make
/// an invalid bool.
torch::Tensor tensor_from_bytes(const DtypeName& d,
                                const std::vector<int64_t>& shape,
                                const std::function<void(void*)>& fill);

/// What one tensor of a loaded state dict holds beyond its data, for the
/// memory budget: LibTorch's TensorImpl and StorageImpl with their
/// allocations and the dict's entry (item, index node and bucket), rounded
/// up (measured: 360 to 442 bytes with LibTorch 1.13, glibc 2.36).
constexpr uint64_t kTensorOverheadBytes = 512;

/// What one entry of a loaded state dict holds beyond its tensor and the two
/// copies of its name (torch::OrderedDict's item and index node, a bucket,
/// the vector of items up to 3 times while it doubles), for the memory
/// budget (measured: 118 bytes with a name of 7 characters).
constexpr uint64_t kDictEntryBytes = 256;

/// The memory one load of a state-dict file may hold: 32 MiB + 4 times the
/// file's size. Each reader charges what it allocates from the file's
/// contents before it allocates it (the header, records, storages, tensor
/// copies, its own working memory) and releases what it frees; a charge past
/// the budget refuses the file. What is not charged (fixed costs, malloc's
/// own overhead beyond the charged estimates) stays within the other 32 MiB
/// of the documented bound, 64 MiB + 4 times the file's size
/// (docs/reliability.md).
class MemoryBudget {
 public:
  /// The budget of a file of `file_size` bytes; `where` names it.
  MemoryBudget(uint64_t file_size, std::string where);

  /// Adds `bytes` to the memory held; false (and nothing added) when that
  /// would exceed the budget.
  [[nodiscard]] bool try_charge(uint64_t bytes);
  /// try_charge, refusing the file (refuse(what)) when it fails.
  void charge(uint64_t bytes, const std::string& what);
  /// Throws the c10::Error of a failed charge: "<where>: <what> brings the
  /// memory ...".
  [[noreturn]] void refuse(const std::string& what) const;
  /// Takes `bytes` (charged before) off the memory held.
  void release(uint64_t bytes);

  /// "<what> brings the memory this load holds past ..." (without `where`):
  /// the message of a failed charge.
  std::string exceeded(const std::string& what) const;
  const std::string& where() const { return where_; }
  uint64_t used() const { return used_; }
  uint64_t limit() const { return limit_; }

 private:
  std::string where_;
  uint64_t file_size_;
  uint64_t limit_;
  uint64_t used_ = 0;
};

}  // namespace mha::detail
