// Internal: lets mha's own parallel loops call BLAS from several threads at
// once, each call running on its calling thread. Not installed.
//
// Why: the blocked attention core (src/core/blocked_attention.cpp) runs its
// query blocks on ATen's intra-op threads, each block's two GEMMs and softmax
// on one core with its scores in that core's cache. Debian's OpenBLAS (the
// pthreads build) would run every one of those GEMMs on its own thread pool
// instead: concurrent calls then take turns on the pool, and at (N, L, E, H) =
// (1, 4096, 512, 8) the loop ran 2-3x slower than with one BLAS thread per
// call (measured here: LibTorch 1.13.1, OpenBLAS 0.3.21, 2 cores).
//
// It also runs loops that make no BLAS call on OpenBLAS's own threads
// (run_on_openblas_threads), so that its idle workers do their work
// instead of holding the cores beside them.
//
// The tools (mha-bench, mha-train) also come here for OpenBLAS's thread
// count and the build and kernel names they print: every OpenBLAS symbol is
// looked up in this one file (by name, so nothing links against OpenBLAS).
#pragma once

#include <functional>
#include <optional>
#include <string>

namespace mha::detail {

/// While an instance lives, the process's BLAS runs each call on the
/// calling thread. The setting is process-wide, so mha keeps its own calls
/// on other threads out of that time (BlasCallGuard): they wait, and every
/// GEMM of an mha call runs with the same BLAS thread count whether or not
/// other threads call mha at the same time. OpenBLAS's pthreads build
/// rounds some float32 GEMMs differently on 1 and 2 threads (measured here:
/// tests/test_threads.cpp), so without that wait a call's result would
/// depend on what other threads did. BLAS calls that are not mha's (the
/// caller's own torch ops) are not held back: in that time they run on one
/// thread (slower, never wrong). Instances may overlap on one thread and on
/// several; the last one to end restores the thread count the first one
/// found. Create and destroy an instance on the same thread.
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

/// Held by each public entry point of mha that runs BLAS (the attention
/// function, the modules' forward functions): while any thread's guard is
/// live, no SingleThreadedBlas starts, and the other way round; guards of
/// one kind share the time. Once one kind waits, no more guards of the
/// other kind start until it has had its turn, so neither starves. Nested
/// guards on one thread, and a guard inside a live SingleThreadedBlas of the
/// same thread, cost nothing and never wait; so does a guard on a thread
/// running inside ATen's parallel region (its pool must stay free for the loop
/// that holds the single-thread setting). Does nothing unless
/// SingleThreadedBlas controls the loaded BLAS (OpenBLAS's pthreads build).
class BlasCallGuard {
 public:
  BlasCallGuard();
  ~BlasCallGuard();
  BlasCallGuard(const BlasCallGuard&) = delete;
  BlasCallGuard& operator=(const BlasCallGuard&) = delete;

 private:
  bool held_ = false;
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

/// An OpenBLAS release number, as openblas_get_config() begins
/// ("OpenBLAS 0.3.34 ..." -> {0, 3, 34}).
struct OpenBlasVersion {
  int major = 0;
  int minor = 0;
  int patch = 0;
};

/// The release number at the start of an openblas_get_config() string, or
/// nullopt when `config` does not begin with "OpenBLAS " and three
/// dot-separated numbers.
std::optional<OpenBlasVersion> parse_openblas_version(
    const std::string& config);

/// Whether a pthreads OpenBLAS of `version` keeps its idle workers spinning
/// on the cores after a call on its own threads (x86-64, 0.3.27 or later)
/// rather than giving the cores away with sched_yield (before 0.3.27).
/// Source: OpenMathLib/OpenBLAS commit 07b1c0bc1, "Stop using sched_yield on
/// non-Windows x86_64" (common.h's YIELDING, used by the idle loop in
/// driver/others/blas_server.c), first released in v0.3.27. A worker sleeps
/// only after OPENBLAS_THREAD_TIMEOUT, read when the library loads.
bool spinning_workers(const OpenBlasVersion& version, bool x86_64);

/// spinning_workers() for the loaded BLAS: true only for OpenBLAS's pthreads
/// build whose version says so, on an x86-64 build of mha (looked up once),
/// while it runs more than one thread (with one, say OPENBLAS_NUM_THREADS=1,
/// it has no worker, and mha keeps spreading its large calls over ATen's
/// threads).
bool openblas_workers_spin();

/// How many threads run_on_openblas_threads can use now: OpenBLAS's thread
/// count (openblas_get_num_threads) where the loaded BLAS is OpenBLAS's
/// pthreads build and has gotoblas_pthread; 0 otherwise (its OpenMP and
/// sequential builds, other libraries, no BLAS found).
int openblas_pool_threads();

/// Runs task(t) for t = 0 .. threads - 1 through OpenBLAS's
/// gotoblas_pthread (driver/others/blas_server.c in OpenMathLib/OpenBLAS,
/// exported by its pthreads build since GotoBLAS, not in its documented
/// API): t = 0 on the calling thread, the others on OpenBLAS's own worker
/// threads, and returns when every task has ended. An exception a task
/// throws is caught on its thread; the first is rethrown here after all
/// have ended. Needs 2 <= threads <= a count openblas_pool_threads()
/// returned (OpenBLAS keeps the workers it has made when its count is
/// lowered later).
///
/// A task must not call BLAS: on a worker, OpenBLAS would queue that call's
/// share to the workers, among them the one running the call, and wait for
/// it forever. Another thread's BLAS call meanwhile waits for the workers
/// to be free (OpenBLAS queues its calls this way anyway).
///
/// Why: after a call on its threads, OpenBLAS 0.3.27 and later keep their
/// idle workers spinning on the cores for tens of milliseconds
/// (openblas_workers_spin), and a loop on ATen's threads then shares the
/// cores with them. Run on the workers themselves, it has the cores to
/// itself (docs/speed.md at 5cc4c3b, "The blocked path's items on OpenBLAS's
/// threads").
void run_on_openblas_threads(int threads, const std::function<void(int)>& task);

/// The kernel set OpenBLAS chose ("SkylakeX", "Haswell", "Prescott", ...,
/// from openblas_get_corename), or "" when OpenBLAS is not loaded.
std::string openblas_core();

}  // namespace mha::detail
