// OpenBLAS's thread control and self-description, found at run time by
// symbol name among the loaded libraries (dlsym): SingleThreadedBlas for
// mha's parallel loops, and the thread count, build string and kernel name
// that the tools set and print.
#include "blas_threads.h"

#include <dlfcn.h>

#include <mutex>

namespace mha::detail {

namespace {

/// OpenBLAS's thread control, looked up once among the loaded libraries.
struct OpenBlas {
  void (*set_num_threads)(int) = nullptr;
  int (*get_num_threads)() = nullptr;
  int (*get_parallel)() = nullptr;    // 0 sequential, 1 pthreads, 2 OpenMP
  char* (*get_config)() = nullptr;    // build string
  char* (*get_corename)() = nullptr;  // kernel set

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

std::mutex users_mutex;
int users = 0;          // live SingleThreadedBlas instances
int saved_threads = 0;  // OpenBLAS's thread count before the first of them

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

std::string openblas_core() {
  const auto& blas = OpenBlas::instance();
  return blas.get_corename != nullptr ? std::string(blas.get_corename())
                                      : std::string();
}

SingleThreadedBlas::SingleThreadedBlas() {
  const auto& blas = OpenBlas::instance();
  if (!blas.pthreads()) {
    return;
  }
  std::lock_guard<std::mutex> lock(users_mutex);
  if (users++ == 0) {
    saved_threads = blas.get_num_threads();
    if (saved_threads != 1) {
      blas.set_num_threads(1);
    }
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  const auto& blas = OpenBlas::instance();
  if (!blas.pthreads()) {
    return;
  }
  std::lock_guard<std::mutex> lock(users_mutex);
  if (--users == 0 && saved_threads != 1) {
    blas.set_num_threads(saved_threads);
  }
}

}  // namespace mha::detail
