// mha's own version, the LibTorch version mha was built against, and the
// test that mha (and code built with it) uses to branch on the LibTorch
// version.
#pragma once

#include <torch/version.h>

// mha's version, semantic versioning (https://semver.org): the one place it
// is written; CMakeLists.txt reads it from here for the package, pkg-config
// and CPack. CHANGELOG.md says what each version added.
#define MHA_VERSION_MAJOR 0
#define MHA_VERSION_MINOR 2
#define MHA_VERSION_PATCH 0
/// major * 10000 + minor * 100 + patch (fmt's FMT_VERSION convention), for
/// `#if MHA_VERSION >= 200`.
#define MHA_VERSION \
  (MHA_VERSION_MAJOR * 10000 + MHA_VERSION_MINOR * 100 + MHA_VERSION_PATCH)

/// True when the LibTorch headers in use are version major.minor or newer,
/// e.g. `#if MHA_TORCH_VERSION_AT_LEAST(2, 1)`. Reads TORCH_VERSION_MAJOR
/// and TORCH_VERSION_MINOR of <torch/version.h>.
#define MHA_TORCH_VERSION_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||              \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace mha {

/// mha's version as the library was compiled, "major.minor.patch", e.g.
/// "0.2.0" (the MHA_VERSION_* macros of the headers a program was compiled
/// with may differ if it links another build).
const char* version();

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
