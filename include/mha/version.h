// The LibTorch version mha was built against, and the test that mha (and
// code built with it) uses to branch on the LibTorch version.
#pragma once

#include <torch/version.h>

/// True when the LibTorch headers in use are version major.minor or newer,
/// e.g. `#if MHA_TORCH_VERSION_AT_LEAST(2, 1)`. Reads TORCH_VERSION_MAJOR
/// and TORCH_VERSION_MINOR of <torch/version.h>.
#define MHA_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||              \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace mha {

/// The LibTorch version the mha library was compiled against, as its
/// headers state it (TORCH_VERSION), e.g. "1.13.0" for Debian 12's 1.13.1.
const char* torch_version();

/// True when attention calls that ask for no weights and no position limits
/// or biases beyond is_causal may run on LibTorch's fused
/// `at::scaled_dot_product_attention`: mha was compiled against LibTorch
/// >= 2.5, the first whose kernel gives fully masked rows 0 (as DESIGN.md
/// requires) rather than NaN. Otherwise mha's own paths compute every call.
bool has_fused_sdpa();

}  // namespace mha
