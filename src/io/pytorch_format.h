// Internal, the PyTorch-file layer of state-dict I/O: a state dict as the
// zip file of Python's torch.save, its pickle (pickle.h) in its archive
// (zip_archive.h). Depends on those two and tensor_file.h. Not installed.
#pragma once

#include <string>

#include "io/tensor_file.h"

namespace mha::detail {

/// Reads every tensor of the PyTorch zip file `path`, in the dict's order.
StateDict read_pytorch(const std::string& path);

/// Writes `entries` to `file` as a PyTorch zip file that Python's
/// torch.load reads as a collections.OrderedDict.
void write_pytorch(const TensorEntries& entries, const std::string& file,
                   const std::string& where);

}  // namespace mha::detail
