// Internal: lets mha's own parallel loops call BLAS from several threads at
// once, each call running on its calling thread. Not installed.
//
// Why: the blocked attention core (src/attention.cpp) runs its query blocks
// on ATen's intra-op threads, each block's two GEMMs and softmax on one core
// with its scores in that core's cache. Debian's OpenBLAS (the pthreads
// build) would run every one of those GEMMs on its own thread pool instead:
// concurrent calls then take turns on the pool, and at (N, L, E, H) =
// (1, 4096, 512, 8) the loop ran 2-3x slower than with one BLAS thread per
// call (measured here: LibTorch 1.13.1, OpenBLAS 0.3.21, 2 cores).
#pragma once

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

}  // namespace mha::detail
