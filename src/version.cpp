// What mha/version.h reports about the build (the version gates themselves
// live in src/compat.h).
#include "mha/version.h"

#include "compat.h"

namespace mha {

const char* torch_version() { return TORCH_VERSION; }

bool has_fused_sdpa() { return MHA_HAS_FUSED_SDPA != 0; }

}  // namespace mha
