// What mha/version.h reports: mha's version and facts about the build (the
// version gates themselves live in src/compat.h).
#include "mha/version.h"

#include "compat.h"

#define MHA_STRINGIFY_(x) #x
#define MHA_STRINGIFY(x) MHA_STRINGIFY_(x)

namespace mha {

const char* version() {
  return MHA_STRINGIFY(MHA_VERSION_MAJOR) "." MHA_STRINGIFY(
      MHA_VERSION_MINOR) "." MHA_STRINGIFY(MHA_VERSION_PATCH);
}

const char* torch_version() { return TORCH_VERSION; }

bool has_fused_sdpa() { return MHA_HAS_FUSED_SDPA != 0; }

}  // namespace mha
