// State dicts on disk: the module API of include/mha/state_dict.h (formats
// and sources there), the top layer of state-dict I/O. It picks the format
// by content or extension and hands the file to safetensors.h or
// pytorch_format.h; below those lie pickle.h, zip_archive.h and tensor_file.h.
//
// Glossary: an "entry" is one (name, tensor) pair of a state dict; a "record"
// is one file inside a PyTorch zip archive; a "storage" is the flat buffer
// (numel elements of one dtype) that a PyTorch tensor views through an
// offset, sizes and strides. Every size read from a file is checked before it
// is used: against the file size, the record size or the storage size, with
// overflow-checked arithmetic.
#include "mha/state_dict.h"

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "io/pytorch_format.h"
#include "io/safetensors.h"
#include "io/tensor_file.h"

namespace mha {
namespace {

using detail::StateDict;

// --------------------------------------------------------------------------
// Modules.

/// Python's state_dict order: own parameters, own buffers, then children.
void collect(const torch::nn::Module& module, const std::string& prefix,
             bool detach, StateDict& out) {
  for (const auto& item : module.named_parameters(/*recurse=*/false)) {
    if (item.value().defined()) {
      out.insert(prefix + item.key(),
                 detach ? item.value().detach() : item.value());
    }
  }
  for (const auto& item : module.named_buffers(/*recurse=*/false)) {
    if (item.value().defined()) {
      out.insert(prefix + item.key(),
                 detach ? item.value().detach() : item.value());
    }
  }
  for (const auto& child : module.named_children()) {
    collect(*child.value(), prefix + child.key() + ".", detach, out);
  }
}

std::string join(const std::vector<std::string>& items,
                 const std::string& separator) {
  std::string out;
  for (const auto& item : items) {
    out += out.empty() ? "" : separator;
    out += item;
  }
  return out;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

torch::OrderedDict<std::string, torch::Tensor> state_dict(
    const torch::nn::Module& module) {
  StateDict out;
  collect(module, "", /*detach=*/true, out);
  return out;
}

torch::OrderedDict<std::string, torch::Tensor> read_state_dict(
    const std::string& path) {
  const std::string where = detail::file_label(path);
  std::error_code error;
  TORCH_CHECK(std::filesystem::exists(path, error), where, ": no such file");
  TORCH_CHECK(std::filesystem::is_regular_file(path, error), where,
              ": not a regular file");
  const uint64_t file_size = std::filesystem::file_size(path, error);
  TORCH_CHECK(!error, where, ": cannot get the file size: ", error.message());
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.is_open(), where, ": cannot open the file for reading");
  TORCH_CHECK(file_size >= 8, where, ": the file has ", file_size,
              " bytes, too short for a safetensors or PyTorch file");
  unsigned char magic[9] = {};
  detail::read_exact(in, 0, magic, std::min<uint64_t>(file_size, 9), where,
                     "the first bytes");
  if (magic[0] == 'P' && magic[1] == 'K') {
    in.close();
    return detail::read_pytorch(path);
  }
  if (file_size > 8 && magic[8] == '{') {
    return detail::read_safetensors(path, in, file_size);
  }
  TORCH_CHECK(magic[0] != 0x80, where,
              ": a legacy (non-zip) PyTorch file, as torch.save writes with "
              "_use_new_zipfile_serialization=False, is not supported; "
              "re-save it with a plain torch.save(state_dict, path)");
  TORCH_CHECK(false, where,
              ": unrecognized format: expected a safetensors file (8-byte "
              "header length, then '{') or a PyTorch zip file (starting "
              "with 'PK'); the file starts with '",
              detail::printable(std::string(reinterpret_cast<char*>(magic), 8)),
              "'");
}

void write_state_dict(
    const torch::OrderedDict<std::string, torch::Tensor>& tensors,
    const std::string& path) {
  const std::string where = detail::file_label(path);
  // Everything is checked and copied to contiguous CPU memory first, so
  // that the writers below cannot fail halfway on a bad tensor.
  detail::TensorEntries entries;
  for (const auto& item : tensors) {
    const torch::Tensor& t = item.value();
    TORCH_CHECK(t.defined(), where, ": tensor '", item.key(), "' is undefined");
    TORCH_CHECK(t.layout() == torch::kStrided && !t.is_quantized(), where,
                ": tensor '", item.key(), "' has layout ", t.layout(),
                "; only dense (strided) tensors can be saved");
    TORCH_CHECK(detail::find_dtype(t.scalar_type()) != nullptr, where,
                ": tensor '", item.key(), "' has dtype ", t.scalar_type(),
                "; supported: ", detail::supported_dtypes());
    entries.emplace_back(item.key(), t.detach().to(torch::kCPU).contiguous());
  }
  const bool safetensors = ends_with(path, ".safetensors");
  const std::string temporary = path + ".tmp";
  try {
    if (safetensors) {
      detail::write_safetensors(entries, temporary, where);
    } else {
      detail::write_pytorch(entries, temporary, where);
    }
    std::error_code error;
    std::filesystem::rename(temporary, path, error);
    TORCH_CHECK(!error, where, ": cannot rename '", temporary, "' to '", path,
                "': ", error.message());
  } catch (...) {
    std::error_code ignored;
    std::filesystem::remove(temporary, ignored);
    throw;
  }
}

LoadResult load_state_dict(torch::nn::Module& module, const std::string& path,
                           bool strict) {
  const StateDict file = read_state_dict(path);
  StateDict target;
  collect(module, "", /*detach=*/false, target);

  LoadResult result;
  std::vector<std::string> mismatches;
  for (const auto& item : target) {
    const torch::Tensor* value = file.find(item.key());
    if (value == nullptr) {
      result.missing_keys.push_back(item.key());
    } else if (value->sizes() != item.value().sizes()) {
      mismatches.push_back(item.key() + ": file " + c10::str(value->sizes()) +
                           ", module " + c10::str(item.value().sizes()));
    }
  }
  for (const auto& item : file) {
    if (!target.contains(item.key())) {
      result.unexpected_keys.push_back(item.key());
    }
  }

  const bool key_errors = strict && (!result.missing_keys.empty() ||
                                     !result.unexpected_keys.empty());
  if (key_errors || !mismatches.empty()) {
    std::string message =
        "load_state_dict: " + detail::file_label(path) +
        " does not fit the module (strict=" + (strict ? "true" : "false") +
        "); nothing loaded:";
    if (key_errors && !result.missing_keys.empty()) {
      message += "\n  missing keys (in the module, not in the file): " +
                 join(result.missing_keys, ", ");
    }
    if (key_errors && !result.unexpected_keys.empty()) {
      message += "\n  unexpected keys (in the file, not in the module): " +
                 join(result.unexpected_keys, ", ");
    }
    if (!mismatches.empty()) {
      message += "\n  shape mismatches: " + join(mismatches, "; ");
    }
    TORCH_CHECK(false, message);
  }

  torch::NoGradGuard no_grad;
  for (auto& item : target) {
    if (const torch::Tensor* value = file.find(item.key())) {
      item.value().copy_(*value);
    }
  }
  return result;
}

void save_state_dict(const torch::nn::Module& module, const std::string& path) {
  write_state_dict(state_dict(module), path);
}

}  // namespace mha
