// Internal: lets mha's own parallel loops call BLAS from several threads at
// once, each call running on its calling thread. Not installed.
//
// Why: the blocked attention core (src/blocked_attention.cpp) runs its query
// blocks on ATen's intra-op threads, each block's two GEMMs and softmax on one
// core with its scores in that core's cache. Debian's OpenBLAS (the pthreads
// build) would run every one of those GEMMs on its own thread pool instead:
// concurrent calls then take turns on the pool, and at (N, L, E, H) =
// (1, 4096, 512, 8) the loop ran 2-3x slower than with one BLAS thread per
// call (measured here: LibTorch 1.13.1, OpenBLAS 0.3.21, 2 cores).
//
// The tools (mha-bench, mha-train) also come here for OpenBLAS's thread
// count and the build and kernel names they print: every OpenBLAS symbol is
// looked up in this one file (by name, so nothing links against OpenBLAS).
#pragma once

#include <optional>
#include <string>

namespace mha::detail {

/// While an instance lives, the process's BLAS runs each call on the
/// calling thread. The setting is process-wide: another thread's BLAS calls
/// in that time also run on one thread (slower, never wrong). Instances may
/// overlap, on any threads; the last one to end restores the thread count
/// the first one found.
class SingleThreadedBlas {
 public:
  /// True when the loaded BLAS is one this class controls: OpenBLAS, found
  /// at run time by its symbols, in its pthreads build (thread count set to
  /// 1 and restored) or its sequential build (nothing to do). Other
  /// libraries (MKL, BLIS, OpenBLAS's OpenMP build, the reference BLAS)
  /// give false, and callers keep BLAS's own threads.
  static bool available();

  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;
};

/// OpenBLAS's current thread count (openblas_get_num_threads), or 0 when
/// OpenBLAS is not loaded.
int openblas_threads();

/// Sets OpenBLAS's thread count (openblas_set_num_threads) for the whole
/// process. Returns false, doing nothing, when OpenBLAS is not loaded.
bool set_openblas_threads(int threads);

/// What the tools print as the BLAS they found, when OpenBLAS is loaded.
struct OpenBlasInfo {
  int num_threads = 0;  ///< openblas_get_num_threads()
  std::string config;   ///< openblas_get_config(), e.g. "OpenBLAS 0.3.21 ..."
};
/// OpenBLAS's thread count and build string; nullopt when OpenBLAS is not
/// loaded (no openblas_get_num_threads). `config` is "" when the library
/// lacks openblas_get_config.
std::optional<OpenBlasInfo> openblas_info();

/// The kernel set OpenBLAS chose ("SkylakeX", "Haswell", "Prescott", ...,
/// from openblas_get_corename), or "" when OpenBLAS is not loaded.
std::string openblas_core();

}  // namespace mha::detail
