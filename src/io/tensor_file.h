// Internal, the bottom layer of state-dict I/O: what the safetensors and
// PyTorch formats share (the dtype table, overflow-checked arithmetic,
// printable text, exact reads, tensors from raw bytes). Depends on LibTorch
// only. Not installed.
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

}  // namespace mha::detail
