// Internal, the safetensors layer of state-dict I/O: reading and writing the
// format of https://github.com/huggingface/safetensors (described in
// include/mha/state_dict.h). Depends on tensor_file.h. Not installed.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <map>
#include <string>

#include "io/tensor_file.h"

namespace mha::detail {

/// Reads every tensor of the safetensors file `path` (open as `in`, of
/// `file_size` bytes), in the order of their data offsets, after checking
/// the whole header against the file. With `keep`, only the data of the
/// tensors whose name it accepts is read (mha::hf: one layer); with
/// `metadata`, the header's __metadata__ strings are stored there.
StateDict read_safetensors(
    const std::string& path, std::ifstream& in, uint64_t file_size,
    const std::function<bool(const std::string&)>& keep = {},
    std::map<std::string, std::string>* metadata = nullptr);

/// Writes `entries` as safetensors to `file`.
void write_safetensors(const TensorEntries& entries, const std::string& file,
                       const std::string& where);

}  // namespace mha::detail
