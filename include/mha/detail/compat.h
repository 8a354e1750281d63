// The one place where mha branches on the LibTorch version.
//
// Every `TORCH_VERSION_MAJOR/MINOR` test in the project lives in this header,
// each with a note of what differs and since which version.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#define MHA_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||              \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace mha::detail {

/// The LibTorch version the library was compiled against, e.g. "1.13.0".
inline const char* torch_version() { return TORCH_VERSION; }

}  // namespace mha::detail
