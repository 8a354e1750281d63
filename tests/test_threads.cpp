// Tests of one module called from several threads at once (issue 22,
// item 5): a MultiHeadAttention in eval mode under NoGradGuard, called from
// 8 threads concurrently, gives results bit-identical to serial calls, with
// ATen's intra-op threads at 1 (BLAS keeps its own threads) and at 2 (the
// blocked core's parallel loop, which sets the process's OpenBLAS to one
// thread while it runs, and mha's calls on other threads wait for it:
// blas_threads.h; these calls are small, so the loop runs only where the
// test asks for it with SpreadEveryCall), OpenBLAS at 1 and 2 threads. Its own
// executable, so that scripts/tsan.sh can build it with ThreadSanitizer without
// the rest.
//
// Glossary: N batch, L query length, S key length, E embed_dim.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "core/attention_core.h"  // SpreadEveryCall
#include "core/blas_threads.h"
#include "mha/multi_head_attention.h"

namespace {

/// One call's arguments.
struct Call {
  std::string what;
  torch::Tensor x;     // (N, L, E)
  torch::Tensor mask;  // key_padding_mask (N, L) or {}
  bool need_weights = false;
  bool causal = false;
};

std::vector<Call> calls(torch::ScalarType dtype) {
  std::vector<Call> out;
  int64_t i = 0;
  for (int64_t L : {1, 7, 64, 300}) {
    for (bool need_weights : {false, true}) {
      for (bool causal : {false, true}) {
        Call c;
        c.what = "L " + std::to_string(L) + (need_weights ? " weights" : "") +
                 (causal ? " causal" : "");
        c.x = torch::randn({2, L, 32}).to(dtype);
        if (++i % 3 == 0) {
          c.mask = torch::rand({2, L}).gt(0.7);
        }
        c.need_weights = need_weights;
        c.causal = causal;
        out.push_back(c);
      }
    }
  }
  return out;
}

std::pair<torch::Tensor, torch::Tensor> run(mha::MultiHeadAttention& m,
                                            const Call& c) {
  auto [out, w] =
      m->forward(c.x, {}, {}, c.mask, c.need_weights, {}, true, c.causal);
  return {out, w};
}

/// How a run is set up: ATen's intra-op threads, OpenBLAS's threads (0:
/// as found), and whether the blocked core spreads calls of every size over
/// the intra-op threads (SpreadEveryCall; by default these small calls run
/// in order on the calling thread).
struct Setting {
  int intra_op_threads;
  int openblas_threads;
  bool spread_every_call;
};

// GoogleTest prints a parameter without a printer as its bytes, padding
// included (indeterminate); this prints the fields.
void PrintTo(const Setting& s, std::ostream* os) {
  *os << "intra_op " << s.intra_op_threads << ", blas " << s.openblas_threads
      << (s.spread_every_call ? ", spread" : "");
}

void check_threads_match_serial(const Setting& setting,
                                torch::ScalarType dtype) {
  const int intra_op_threads = setting.intra_op_threads;
  at::set_num_threads(intra_op_threads);
  std::optional<mha::detail::SpreadEveryCall> spread;
  if (setting.spread_every_call) {
    spread.emplace();
  }
  torch::manual_seed(0);
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(32, 4));
  m->to(dtype);
  m->eval();
  const auto inputs = calls(dtype);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> serial;
  {
    torch::NoGradGuard no_grad;
    for (const auto& c : inputs) {
      serial.push_back(run(m, c));
    }
  }
  constexpr int kThreads = 8;
  constexpr int kRounds = 2;
  std::atomic<int> mismatches{0};
  std::vector<std::string> first_mismatch(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      torch::NoGradGuard no_grad;  // grad mode is per thread
      const auto n = static_cast<int>(inputs.size());
      for (int round = 0; round < kRounds; ++round) {
        for (int j = 0; j < n; ++j) {
          const auto index = (j + t * 5 + round) % n;  // different orders
          auto [out, w] = run(m, inputs[index]);
          const auto& [out0, w0] = serial[index];
          const bool same =
              torch::equal(out, out0) && (!w0.defined() || torch::equal(w, w0));
          if (!same) {
            ++mismatches;
            if (first_mismatch[t].find(inputs[index].what + ";") ==
                std::string::npos) {
              first_mismatch[t] += inputs[index].what + "; ";
            }
          }
        }
      }
    });
  }
  for (auto& thread : threads) {
    thread.join();
  }
  std::string where;
  for (const auto& w : first_mismatch) {
    where += w.empty() ? "" : "[" + w + "] ";
  }
  EXPECT_EQ(mismatches.load(), 0) << "per thread: " << where;
}

class ThreadsTest : public ::testing::TestWithParam<Setting> {
 protected:
  void SetUp() override {
    saved_ = at::get_num_threads();
    saved_blas_ = mha::detail::openblas_threads();
  }
  void TearDown() override {
    at::set_num_threads(saved_);
    if (saved_blas_ > 0) {
      mha::detail::set_openblas_threads(saved_blas_);
    }
  }
  int saved_ = 1;
  int saved_blas_ = 0;
};

// intra_op 1: the blocked core runs its blocks in order, BLAS keeps its own
// threads. intra_op 2 and OpenBLAS at 2 without "_spread": float32 calls of
// at least 2^15 scores (L = 64 and 300) run their blocks on OpenBLAS's own
// threads, one such loop in the process at a time, the others meanwhile in
// order (the same bits). intra_op 2, "_spread": the blocked core runs its
// parallel loop over ATen's threads (otherwise the smaller calls run in
// order), which sets
// the process's OpenBLAS (pthreads build) to one thread while it runs
// (blas_threads.h). OpenBLAS's float32 GEMM rounds differently on 1 and 2
// threads at these sizes (measured: calls with L >= 64 differed in the
// last bits when another thread's loop changed the count under a call's
// projections), so mha's calls wait for such a loop to end
// (BlasCallGuard): bit-identical in every setting, OpenBLAS at 1 thread or
// at 2.
TEST_P(ThreadsTest, EightThreadsMatchSerialCalls) {
  const auto& setting = GetParam();
  if (setting.openblas_threads > 0 &&
      !mha::detail::set_openblas_threads(setting.openblas_threads)) {
    GTEST_SKIP() << "OpenBLAS is not loaded";
  }
  RecordProperty("blas_control",
                 mha::detail::SingleThreadedBlas::available() ? "yes" : "no");
  for (auto dtype : {torch::kFloat32, torch::kFloat64, torch::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    check_threads_match_serial(setting, dtype);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Settings, ThreadsTest,
    ::testing::Values(Setting{1, 0, false}, Setting{2, 1, true},
                      Setting{2, 2, true}, Setting{2, 2, false}),
    [](const auto& param_info) {
      const auto& s = param_info.param;
      return "intra_op_" + std::to_string(s.intra_op_threads) + "_blas_" +
             (s.openblas_threads > 0 ? std::to_string(s.openblas_threads)
                                     : std::string("default")) +
             (s.spread_every_call ? "_spread" : "");
    });

// The two kinds of BLAS scope take turns across threads (blas_threads.h):
// an mha call's guard waits while another thread's single-threaded loop
// runs and the other way round; on one thread they nest without waiting.
TEST(BlasTurns, CallsAndSingleThreadedLoopsTakeTurns) {
  const int saved = mha::detail::openblas_threads();
  if (!mha::detail::set_openblas_threads(2) ||
      mha::detail::openblas_threads() != 2) {
    GTEST_SKIP() << "not OpenBLAS's pthreads build: nothing to take turns on";
  }
  using mha::detail::BlasCallGuard;
  using mha::detail::SingleThreadedBlas;
  constexpr auto kPause = std::chrono::milliseconds(100);
  {  // a call waits for another thread's loop
    auto loop = std::make_unique<SingleThreadedBlas>();
    EXPECT_EQ(mha::detail::openblas_threads(), 1);
    std::atomic<int> seen{-1};
    std::thread call([&] {
      const BlasCallGuard guard;
      seen = mha::detail::openblas_threads();
    });
    std::this_thread::sleep_for(kPause);
    EXPECT_EQ(seen.load(), -1) << "the call ran during the loop";
    loop.reset();
    call.join();
    EXPECT_EQ(seen.load(), 2) << "the call ran on a changed thread count";
  }
  {  // a loop waits for another thread's call
    auto guard = std::make_unique<BlasCallGuard>();
    std::atomic<int> seen{-1};
    std::thread loop([&] {
      const SingleThreadedBlas single;
      seen = mha::detail::openblas_threads();
    });
    std::this_thread::sleep_for(kPause);
    EXPECT_EQ(seen.load(), -1) << "the loop started during the call";
    EXPECT_EQ(mha::detail::openblas_threads(), 2);
    guard.reset();
    loop.join();
    EXPECT_EQ(seen.load(), 1);
  }
  {  // on one thread: a guard inside a loop and a loop inside a guard
    const SingleThreadedBlas single;
    const BlasCallGuard inner;
    EXPECT_EQ(mha::detail::openblas_threads(), 1);
  }
  {
    const BlasCallGuard guard;
    {
      const SingleThreadedBlas single;
      EXPECT_EQ(mha::detail::openblas_threads(), 1);
    }
    EXPECT_EQ(mha::detail::openblas_threads(), 2);
  }
  EXPECT_EQ(mha::detail::openblas_threads(), 2);
  mha::detail::set_openblas_threads(saved);
}

}  // namespace
