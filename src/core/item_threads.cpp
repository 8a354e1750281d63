// Where the blocked path's work items run (attention_core.h: ItemThreads,
// for_each_item, item_threads): in order on the calling thread, spread over
// ATen's intra-op threads with BLAS held to one thread each, or on
// OpenBLAS's own threads where the items make no BLAS call; the per-thread
// OpenMP setting that keeps oneDNN's products on one thread; and each
// thread's scratch kept between calls.
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "core/blas_gemm.h"
#include "core/blas_threads.h"
#include "core/blocked_attention.h"

namespace mha::detail {

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
// at::parallel_for is inline: with ATen's OpenMP backend it runs in parallel
// only in a translation unit compiled with OpenMP (CMakeLists.txt does that
// where the compiler has it).
constexpr bool kParallelFor = false;
#else
constexpr bool kParallelFor = true;
#endif

// oneDNN's products run on the caller's OpenMP team unless called inside a
// parallel region: mha holds them to one thread only where ATen's loop is
// an OpenMP parallel region and this file can set OpenMP's thread count.
#if AT_PARALLEL_OPENMP && defined(_OPENMP)
constexpr bool kOneDnnHeldToOneThread = true;
#else
constexpr bool kOneDnnHeldToOneThread = false;
#endif

/// While it lives, the calling thread's OpenMP thread count is 1 (its
/// OpenMP parallel regions, ATen's loops among them, and oneDNN's calls run
/// on this thread alone); the count it found is restored after. Does
/// nothing inside a parallel region, or without OpenMP.
class OneOmpThread {
 public:
  OneOmpThread() {
#ifdef _OPENMP
    // ATen sets a thread's OpenMP count at its first parallel call there
    // (at::internal::lazy_init_num_threads); get_num_threads makes that
    // happen now, not later over the 1 set here.
    at::get_num_threads();
    if (!omp_in_parallel()) {
      saved_ = omp_get_max_threads();
      if (saved_ > 1) {
        omp_set_num_threads(1);
      }
    }
#endif
  }
  ~OneOmpThread() {
#ifdef _OPENMP
    if (saved_ > 1) {
      omp_set_num_threads(saved_);
    }
#endif
  }
  OneOmpThread(const OneOmpThread&) = delete;
  OneOmpThread& operator=(const OneOmpThread&) = delete;

 private:
  int saved_ = 0;
};

bool onednn_products_available() {
  return kOneDnnHeldToOneThread && onednn_gemm_available();
}

namespace {

/// The threads a loop on OpenBLAS's threads can have now: ATen's count (the
/// caller's choice of cores) capped by OpenBLAS's.
int openblas_loop_threads() {
  return std::min(at::get_num_threads(), openblas_pool_threads());
}

}  // namespace

int openblas_item_threads() {
  const int threads = openblas_loop_threads();
  return onednn_products_available() && threads >= 2 ? threads : 0;
}

namespace {

// Live SpreadEveryCall instances of each kind (ItemThreads' values).
std::atomic<int> spread_every_call[3] = {0, 0, 0};

/// True on this process while a loop runs on OpenBLAS's threads: a second
/// one would wait for the first's workers (and spin meanwhile).
std::atomic<bool> openblas_loop_running{false};

#ifdef _OPENMP
bool in_openmp_region() { return omp_in_parallel() != 0; }
#else
bool in_openmp_region() { return false; }
#endif

}  // namespace

SpreadEveryCall::SpreadEveryCall(ItemThreads over) : over_(over) {
  TORCH_INTERNAL_ASSERT(over != ItemThreads::kCaller,
                        "SpreadEveryCall: kAten or kOpenBlas");
  ++spread_every_call[static_cast<int>(over)];
}
SpreadEveryCall::~SpreadEveryCall() {
  --spread_every_call[static_cast<int>(over_)];
}

bool spread_items(int64_t scores, int64_t keys) {
  if (spread_every_call[static_cast<int>(ItemThreads::kAten)].load() > 0) {
    return true;
  }
  if (scores <= kSpreadScores) {
    return false;
  }
  return keys > kInOrderKeys || !openblas_workers_spin();
}

ItemThreads item_threads(int64_t scores, int64_t keys, bool onednn) {
  const bool pool = onednn && openblas_item_threads() >= 2;
  if (pool &&
      spread_every_call[static_cast<int>(ItemThreads::kOpenBlas)].load() > 0) {
    return ItemThreads::kOpenBlas;
  }
  if (spread_every_call[static_cast<int>(ItemThreads::kAten)].load() == 0 &&
      pool && scores >= kOpenBlasScores) {
    return ItemThreads::kOpenBlas;
  }
  return spread_items(scores, keys) ? ItemThreads::kAten : ItemThreads::kCaller;
}

namespace {

/// One thread's kept scratch: a byte buffer (undefined while there is
/// none), and whether a for_each_item on the thread holds it now.
struct KeptScratch {
  torch::Tensor bytes;
  bool in_use = false;
};

/// Guards every KeptScratch and the list of them.
std::mutex& kept_scratch_mutex() {
  static std::mutex mutex;
  return mutex;
}

/// Every live thread's KeptScratch (those of ended threads expire).
std::vector<std::weak_ptr<KeptScratch>>& kept_scratch_list() {
  static std::vector<std::weak_ptr<KeptScratch>> list;
  return list;
}

/// The calling thread's KeptScratch, listed at its first use; freed with
/// the thread.
const std::shared_ptr<KeptScratch>& this_thread_scratch() {
  thread_local const std::shared_ptr<KeptScratch> kept = [] {
    auto created = std::make_shared<KeptScratch>();
    const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
    auto& list = kept_scratch_list();
    list.erase(std::remove_if(list.begin(), list.end(),
                              [](const auto& k) { return k.expired(); }),
               list.end());
    list.push_back(created);
    return created;
  }();
  return kept;
}

/// One thread's scratch for one for_each_item call: `elements` of `options`.
/// On the CPU, up to kKeptScratchBytes, a view of the thread's kept buffer
/// (grown to fit) unless another call on this thread holds it; otherwise a
/// new tensor.
class ScratchLease {
 public:
  ScratchLease(int64_t elements, const torch::TensorOptions& options) {
    const auto bytes =
        elements * static_cast<int64_t>(options.dtype().itemsize());
    if (options.device().is_cpu() && bytes > 0 && bytes <= kKeptScratchBytes) {
      const auto& kept = this_thread_scratch();
      torch::Tensor buffer;
      {
        const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
        if (!kept->in_use) {
          kept->in_use = true;
          held_ = kept;
          buffer = kept->bytes;
          if (buffer.defined() && buffer.numel() < bytes) {
            kept->bytes = torch::Tensor();
            buffer = torch::Tensor();  // freed before the larger one
          }
        }
      }
      if (held_) {
        if (!buffer.defined()) {
          try {
            // A normal tensor even in inference mode: later calls write it
            // outside that mode too.
            const c10::InferenceMode normal(/*enabled=*/false);
            buffer = at::empty({bytes}, torch::TensorOptions(torch::kUInt8));
          } catch (...) {
            release_hold();  // the destructor does not run
            throw;
          }
          const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
          kept->bytes = buffer;
        }
        tensor_ = buffer.narrow(0, 0, bytes)
                      .view(c10::typeMetaToScalarType(options.dtype()));
        return;
      }
    }
    tensor_ = at::empty({elements}, options);
  }
  ~ScratchLease() { release_hold(); }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;

  torch::Tensor& tensor() { return tensor_; }

 private:
  void release_hold() {
    if (held_) {
      const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
      held_->in_use = false;
      held_.reset();
    }
  }

  std::shared_ptr<KeptScratch> held_;  // the kept buffer, while held
  torch::Tensor tensor_;
};

}  // namespace

int64_t kept_scratch_bytes() {
  const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
  int64_t bytes = 0;
  for (const auto& weak : kept_scratch_list()) {
    if (const auto kept = weak.lock(); kept && kept->bytes.defined()) {
      bytes += kept->bytes.numel();
    }
  }
  return bytes;
}

int64_t release_kept_scratch() {
  const std::lock_guard<std::mutex> lock(kept_scratch_mutex());
  int64_t bytes = 0;
  for (const auto& weak : kept_scratch_list()) {
    const auto kept = weak.lock();
    if (kept && !kept->in_use && kept->bytes.defined()) {
      bytes += kept->bytes.numel();
      kept->bytes = torch::Tensor();
    }
  }
  return bytes;
}

namespace {

/// Runs the items on OpenBLAS's threads (for_each_item's kOpenBlas) and
/// returns how many threads did, or 0, running nothing, where that cannot
/// be done now.
int64_t items_on_openblas_threads(
    int64_t items, int64_t scratch_elements,
    const torch::TensorOptions& options,
    const std::function<void(int64_t, torch::Tensor&)>& body) {
  const int threads = openblas_loop_threads();
  if (threads < 2 || items < 2 || at::in_parallel_region() ||
      in_openmp_region() || openblas_loop_running.exchange(true)) {
    return 0;
  }
  struct Running {
    ~Running() { openblas_loop_running = false; }
  } running;
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller_state;
  run_on_openblas_threads(threads, [&](int) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    const OneOmpThread one_thread;
    ScratchLease scratch(scratch_elements, options);
    try {
      for (int64_t item = next++; item < items; item = next++) {
        body(item, scratch.tensor());
      }
    } catch (...) {
      next = items;  // the other threads take no further item
      throw;
    }
  });
  return threads;
}

}  // namespace

namespace {
thread_local ItemThreads last_threads = ItemThreads::kCaller;
}  // namespace

ItemThreads last_item_threads() { return last_threads; }

int64_t for_each_item(int64_t items, int64_t scratch_elements,
                      const torch::TensorOptions& options,
                      const std::function<void(int64_t, torch::Tensor&)>& body,
                      ItemThreads where, bool one_omp_thread) {
  last_threads = ItemThreads::kCaller;
  if (where == ItemThreads::kOpenBlas) {
    const auto used =
        items_on_openblas_threads(items, scratch_elements, options, body);
    if (used > 0) {
      last_threads = ItemThreads::kOpenBlas;
      return used;
    }
    // In order instead; the products are oneDNN's.
    one_omp_thread = true;
  }
  const int64_t threads = at::get_num_threads();
  const bool parallel = where == ItemThreads::kAten && kParallelFor &&
                        threads > 1 && items >= threads &&
                        !at::in_parallel_region() &&
                        SingleThreadedBlas::available();
  if (!parallel) {
    std::optional<OneOmpThread> one_thread;
    if (one_omp_thread) {
      one_thread.emplace();
    }
    ScratchLease scratch(scratch_elements, options);
    for (int64_t item = 0; item < items; ++item) {
      body(item, scratch.tensor());
    }
    last_threads = ItemThreads::kCaller;
    return 1;
  }
  SingleThreadedBlas single_threaded_blas;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, threads, /*grain_size=*/1,
                   [&](int64_t begin, int64_t end) {
                     at::ThreadLocalStateGuard state_guard(caller_state);
                     ScratchLease scratch(scratch_elements, options);
                     for (int64_t t = begin; t < end; ++t) {
                       for (int64_t item = t; item < items; item += threads) {
                         body(item, scratch.tensor());
                       }
                     }
                   });
  last_threads = ItemThreads::kAten;
  return threads;
}

}  // namespace mha::detail
