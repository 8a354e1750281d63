// OpenBLAS's thread control and self-description, found at run time by
// symbol name among the loaded libraries (dlsym): SingleThreadedBlas for
// mha's parallel loops, its worker threads for loops that make no BLAS call
// (run_on_openblas_threads), and the thread count, build string and kernel
// name that the tools set and print.
#include "core/blas_threads.h"

#include <ATen/Parallel.h>
#include <dlfcn.h>

#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <tuple>
#include <vector>

namespace mha::detail {

namespace {

/// OpenBLAS's thread control, looked up once among the loaded libraries.
struct OpenBlas {
  void (*set_num_threads)(int) = nullptr;
  int (*get_num_threads)() = nullptr;
  int (*get_parallel)() = nullptr;    // 0 sequential, 1 pthreads, 2 OpenMP
  char* (*get_config)() = nullptr;    // build string
  char* (*get_corename)() = nullptr;  // kernel set
  // gotoblas_pthread(numthreads, function, args, stride): function(args +
  // t * stride) for each t, t = 0 on the caller (its `function` is a void*
  // in OpenBLAS's source; a function pointer is passed the same way).
  int (*pthread_tasks)(int, void (*)(void*), void*, int) = nullptr;

  static const OpenBlas& instance() {
    static const OpenBlas api = [] {
      OpenBlas a;
      // dlsym returns void*; POSIX guarantees the cast to a function pointer.
      a.set_num_threads = reinterpret_cast<void (*)(int)>(
          dlsym(RTLD_DEFAULT, "openblas_set_num_threads"));
      a.get_num_threads = reinterpret_cast<int (*)()>(
          dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
      a.get_parallel = reinterpret_cast<int (*)()>(
          dlsym(RTLD_DEFAULT, "openblas_get_parallel"));
      a.get_config = reinterpret_cast<char* (*)()>(
          dlsym(RTLD_DEFAULT, "openblas_get_config"));
      a.get_corename = reinterpret_cast<char* (*)()>(
          dlsym(RTLD_DEFAULT, "openblas_get_corename"));
      a.pthread_tasks =
          reinterpret_cast<int (*)(int, void (*)(void*), void*, int)>(
              dlsym(RTLD_DEFAULT, "gotoblas_pthread"));
      return a;
    }();
    return api;
  }

  bool found() const {
    return set_num_threads && get_num_threads && get_parallel;
  }
  bool pthreads() const { return found() && get_parallel() == 1; }
  bool sequential() const { return found() && get_parallel() == 0; }
};

/// Which kind of scope holds BLAS now: mha's calls at BLAS's own thread
/// count (BlasCallGuard) or single-threaded loops (SingleThreadedBlas).
/// Scopes of one kind overlap freely; the two kinds take turns.
class BlasTurns {
 public:
  enum Kind { kOwnThreads = 0, kSingle = 1, kFree = 2 };

  static BlasTurns& instance() {
    static BlasTurns turns;
    return turns;
  }

  void enter(Kind kind) {
    std::unique_lock<std::mutex> lock(mutex_);
    ++waiting_[kind];
    changed_.wait(lock, [&] { return may_enter(kind); });
    --waiting_[kind];
    if (holders_ == 0 && kind == kSingle) {
      const auto& blas = OpenBlas::instance();
      saved_threads_ = blas.get_num_threads();
      if (saved_threads_ != 1) {
        blas.set_num_threads(1);
      }
    }
    turn_ = kind;
    ++holders_;
  }

  void leave() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--holders_ > 0) {
      return;
    }
    if (turn_ == kSingle && saved_threads_ != 1) {
      OpenBlas::instance().set_num_threads(saved_threads_);
    }
    // The other kind goes next if it waits; the turn stays reserved for it
    // until its waiters are in.
    const auto other = turn_ == kSingle ? kOwnThreads : kSingle;
    turn_ = waiting_[other] > 0 ? other : waiting_[turn_] > 0 ? turn_ : kFree;
    changed_.notify_all();
  }

 private:
  bool may_enter(Kind kind) const {
    const auto other = kind == kSingle ? kOwnThreads : kSingle;
    return turn_ == kFree ||
           (turn_ == kind && (holders_ == 0 || waiting_[other] == 0));
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  Kind turn_ = kFree;
  int holders_ = 0;
  int waiting_[2] = {0, 0};
  int saved_threads_ = 0;  // OpenBLAS's count before the single turn began
};

/// One task of run_on_openblas_threads, and what it threw.
struct PoolTask {
  const std::function<void(int)>* task = nullptr;
  int t = 0;
  std::exception_ptr error;
};

/// What OpenBLAS calls on each thread: no exception may cross into its C.
void run_pool_task(void* arg) {
  auto* pool_task = static_cast<PoolTask*>(arg);
  try {
    (*pool_task->task)(pool_task->t);
  } catch (...) {
    pool_task->error = std::current_exception();
  }
}

// This thread's live scopes of each kind (nested ones cost nothing).
thread_local int own_thread_guards = 0;
thread_local int single_scopes = 0;

}  // namespace

bool SingleThreadedBlas::available() {
  const auto& blas = OpenBlas::instance();
  return blas.pthreads() || blas.sequential();
}

int openblas_threads() {
  const auto& blas = OpenBlas::instance();
  return blas.found() ? blas.get_num_threads() : 0;
}

bool set_openblas_threads(int threads) {
  const auto& blas = OpenBlas::instance();
  if (blas.set_num_threads == nullptr) {
    return false;
  }
  blas.set_num_threads(threads);
  return true;
}

std::optional<OpenBlasInfo> openblas_info() {
  const auto& blas = OpenBlas::instance();
  if (blas.get_num_threads == nullptr) {
    return std::nullopt;
  }
  OpenBlasInfo info;
  info.num_threads = blas.get_num_threads();
  if (blas.get_config != nullptr) {
    info.config = blas.get_config();
  }
  return info;
}

std::optional<OpenBlasVersion> parse_openblas_version(
    const std::string& config) {
  OpenBlasVersion v;
  char after = 0;
  // The patch number may be followed by ".dev", a space or nothing.
  const int read = std::sscanf(config.c_str(), "OpenBLAS %d.%d.%d%c", &v.major,
                               &v.minor, &v.patch, &after);
  if (read < 3 || v.major < 0 || v.minor < 0 || v.patch < 0 ||
      (read == 4 && after != ' ' && after != '.' && after != '-')) {
    return std::nullopt;
  }
  return v;
}

bool spinning_workers(const OpenBlasVersion& version, bool x86_64) {
  const auto number = [](const OpenBlasVersion& v) {
    return std::tuple(v.major, v.minor, v.patch);
  };
  return x86_64 && number(version) >= number(OpenBlasVersion{0, 3, 27});
}

bool openblas_workers_spin() {
  static const bool spinning_build = [] {
#if defined(__x86_64__) || defined(_M_X64)
    constexpr bool kX86_64 = true;
#else
    constexpr bool kX86_64 = false;
#endif
    const auto& blas = OpenBlas::instance();
    if (!blas.pthreads() || blas.get_config == nullptr) {
      return false;
    }
    const auto version = parse_openblas_version(blas.get_config());
    return version && spinning_workers(*version, kX86_64);
  }();
  // With one thread OpenBLAS runs every call on the caller: no worker.
  return spinning_build && OpenBlas::instance().get_num_threads() > 1;
}

int openblas_pool_threads() {
  const auto& blas = OpenBlas::instance();
  return blas.pthreads() && blas.pthread_tasks != nullptr
             ? blas.get_num_threads()
             : 0;
}

void run_on_openblas_threads(int threads,
                             const std::function<void(int)>& task) {
  // Not checked against openblas_pool_threads() again: another thread's
  // SingleThreadedBlas may have set the count to 1 since the caller read
  // it, and OpenBLAS keeps the workers it has made.
  TORCH_INTERNAL_ASSERT(threads >= 2 && OpenBlas::instance().pthread_tasks,
                        "run_on_openblas_threads: ", threads, " threads");
  std::vector<PoolTask> tasks(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    tasks[static_cast<size_t>(t)].task = &task;
    tasks[static_cast<size_t>(t)].t = t;
  }
  OpenBlas::instance().pthread_tasks(threads, &run_pool_task, tasks.data(),
                                     static_cast<int>(sizeof(PoolTask)));
  for (const auto& done : tasks) {
    if (done.error) {
      std::rethrow_exception(done.error);
    }
  }
}

std::string openblas_core() {
  const auto& blas = OpenBlas::instance();
  return blas.get_corename != nullptr ? std::string(blas.get_corename())
                                      : std::string();
}

SingleThreadedBlas::SingleThreadedBlas() {
  if (!OpenBlas::instance().pthreads() || single_scopes++ > 0) {
    return;
  }
  auto& turns = BlasTurns::instance();
  if (own_thread_guards > 0) {
    turns.leave();  // this thread's guard steps aside for the loop
  }
  turns.enter(BlasTurns::kSingle);
}

SingleThreadedBlas::~SingleThreadedBlas() {
  if (!OpenBlas::instance().pthreads() || --single_scopes > 0) {
    return;
  }
  auto& turns = BlasTurns::instance();
  turns.leave();
  if (own_thread_guards > 0) {
    turns.enter(BlasTurns::kOwnThreads);
  }
}

BlasCallGuard::BlasCallGuard() {
  if (!OpenBlas::instance().pthreads() || single_scopes > 0 ||
      at::in_parallel_region()) {
    return;
  }
  held_ = true;
  if (own_thread_guards++ == 0) {
    BlasTurns::instance().enter(BlasTurns::kOwnThreads);
  }
}

BlasCallGuard::~BlasCallGuard() {
  if (held_ && --own_thread_guards == 0) {
    BlasTurns::instance().leave();
  }
}

}  // namespace mha::detail
