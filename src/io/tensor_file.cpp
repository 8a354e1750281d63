// Internal, the bottom layer of state-dict I/O: the helpers shared by the
// safetensors and PyTorch formats (declared in tensor_file.h). Depends on
// LibTorch only.
//
// Glossary: "where" is the prefix of a message, naming the file (and the
// format); a "shape" is a tensor's sizes, each >= 0.
#include "io/tensor_file.h"

#include <algorithm>
#include <cstdint>
#include <fstream>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace mha::detail {
namespace {

const DtypeName kDtypes[] = {
    {torch::kFloat64, "float64", "F64", "DoubleStorage"},
    {torch::kFloat32, "float32", "F32", "FloatStorage"},
    {torch::kFloat16, "float16", "F16", "HalfStorage"},
    {torch::kBFloat16, "bfloat16", "BF16", "BFloat16Storage"},
    {torch::kInt64, "int64", "I64", "LongStorage"},
    {torch::kInt32, "int32", "I32", "IntStorage"},
    {torch::kInt16, "int16", "I16", "ShortStorage"},
    {torch::kInt8, "int8", "I8", "CharStorage"},
    {torch::kUInt8, "uint8", "U8", "ByteStorage"},
    {torch::kBool, "bool", "BOOL", "BoolStorage"},
};

}  // namespace

const DtypeName* find_dtype(torch::ScalarType dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) {
      return &d;
    }
  }
  return nullptr;
}

const DtypeName* find_safetensors_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.safetensors) {
      return &d;
    }
  }
  return nullptr;
}

const DtypeName* find_storage_type(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.storage) {
      return &d;
    }
  }
  return nullptr;
}

std::string supported_dtypes() {
  std::string list;
  for (const auto& d : kDtypes) {
    list += list.empty() ? "" : ", ";
    list += d.torch_name;
  }
  return list;
}

uint64_t element_size(const DtypeName& d) {
  return static_cast<uint64_t>(c10::elementSize(d.dtype));
}

bool checked_mul(uint64_t a, uint64_t b, uint64_t* out) {
  if (a != 0 && b > std::numeric_limits<uint64_t>::max() / a) {
    return false;
  }
  *out = a * b;
  return true;
}

bool checked_add(uint64_t a, uint64_t b, uint64_t* out) {
  if (b > std::numeric_limits<uint64_t>::max() - a) {
    return false;
  }
  *out = a + b;
  return true;
}

bool checked_numel(const std::vector<int64_t>& shape, uint64_t* numel) {
  uint64_t n = 1;
  for (const int64_t s : shape) {
    if (!checked_mul(n, static_cast<uint64_t>(s), &n)) {
      return false;
    }
  }
  if (n > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return false;
  }
  *numel = n;
  return true;
}

std::string printable(const std::string& text) {
  static const char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < text.size() && i < 80; ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out.push_back(static_cast<char>(c));
    } else {
      out += "\\x";
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
  }
  if (text.size() > 80) {
    out += "...";
  }
  return out;
}

std::string file_label(const std::string& path) {
  return "state dict file '" + path + "'";
}

void read_exact(std::ifstream& in, uint64_t offset, void* dst, uint64_t n,
                const std::string& where, const char* what) {
  if (n == 0) {
    return;
  }
  in.clear();
  in.seekg(static_cast<std::streamoff>(offset));
  in.read(static_cast<char*>(dst), static_cast<std::streamsize>(n));
  TORCH_CHECK(in.good() && static_cast<uint64_t>(in.gcount()) == n, where,
              ": cannot read ", what, " (", n, " bytes at offset ", offset,
              ")");
}

MemoryBudget::MemoryBudget(uint64_t file_size, std::string where)
    : where_(std::move(where)), file_size_(file_size) {
  constexpr uint64_t kBaseBytes = uint64_t{32} << 20;
  constexpr uint64_t kBytesPerFileByte = 4;
  uint64_t scaled = 0;
  if (!checked_mul(file_size, kBytesPerFileByte, &scaled) ||
      !checked_add(scaled, kBaseBytes, &limit_)) {
    limit_ = std::numeric_limits<uint64_t>::max();
  }
}

bool MemoryBudget::try_charge(uint64_t bytes) {
  if (bytes > limit_ - used_) {
    return false;
  }
  used_ += bytes;
  return true;
}

void MemoryBudget::charge(uint64_t bytes, const std::string& what) {
  if (!try_charge(bytes)) {
    refuse(what);
  }
}

void MemoryBudget::refuse(const std::string& what) const {
  TORCH_CHECK(false, where_, ": ", exceeded(what));
}

void MemoryBudget::release(uint64_t bytes) { used_ -= std::min(bytes, used_); }

std::string MemoryBudget::exceeded(const std::string& what) const {
  return what + " brings the memory this load holds past its budget of " +
         std::to_string(limit_) + " bytes (32 MiB + 4 times the file's " +
         std::to_string(file_size_) + " bytes); refused (a hostile file?)";
}

torch::Tensor tensor_from_bytes(const DtypeName& d,
                                const std::vector<int64_t>& shape,
                                const std::function<void(void*)>& fill) {
  const bool is_bool = d.dtype == torch::kBool;
  torch::Tensor t =
      torch::empty(shape, torch::dtype(is_bool ? torch::kUInt8 : d.dtype));
  if (t.numel() > 0) {
    fill(t.data_ptr());
  }
  return is_bool ? t.ne(0) : t;
}

}  // namespace mha::detail
