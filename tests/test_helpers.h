// Shared helpers of the test suites.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <limits>
#include <optional>
#include <string>

#include "core/attention_core.h"  // SpreadEveryCall

/// +inf, as float64 (masks, expected errors).
constexpr double kInf = std::numeric_limits<double>::infinity();

/// Asserts that `statement` throws c10::Error whose message contains
/// `substring` (fmt's EXPECT_THROW_MSG idea: the error text is API).
#define EXPECT_THROW_MSG(statement, substring)                            \
  do {                                                                    \
    try {                                                                 \
      statement;                                                          \
      ADD_FAILURE() << "expected c10::Error containing \"" << (substring) \
                    << "\", but nothing was thrown";                      \
    } catch (const c10::Error& e) {                                       \
      const std::string message = e.what_without_backtrace();             \
      EXPECT_NE(message.find(substring), std::string::npos)               \
          << "message: " << message                                       \
          << "\nexpected to contain: " << (substring);                    \
    }                                                                     \
  } while (0)

/// Seeds torch's generator before each test.
class SeededTest : public ::testing::Test {
 protected:
  void SetUp() override { torch::manual_seed(0); }
};

/// Asserts allclose with a readable message.
inline void expect_close(const torch::Tensor& actual,
                         const torch::Tensor& expected, double atol,
                         double rtol = 0.0, const std::string& what = "") {
  ASSERT_TRUE(actual.defined()) << what << ": actual is undefined";
  ASSERT_TRUE(expected.defined()) << what << ": expected is undefined";
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  auto a = actual.detach().to(torch::kFloat64);
  auto e = expected.detach().to(torch::kFloat64);
  EXPECT_TRUE(torch::allclose(a, e, rtol, atol))
      << what << ": max abs diff " << (a - e).abs().max().item<double>();
}

/// Sets ATen's intra-op thread count (at::set_num_threads) for a scope;
/// with more than one, the blocked attention core spreads calls of every
/// size over ATen's threads, or over OpenBLAS's where `over` says so and
/// it can (SpreadEveryCall), so that the tests' small inputs cover its
/// parallel loops.
class IntraOpThreads {
 public:
  explicit IntraOpThreads(int threads, mha::detail::ItemThreads over =
                                           mha::detail::ItemThreads::kAten)
      : saved_(at::get_num_threads()) {
    at::set_num_threads(threads);
    if (threads > 1) {
      spread_.emplace(over);
    }
  }
  ~IntraOpThreads() { at::set_num_threads(saved_); }
  IntraOpThreads(const IntraOpThreads&) = delete;
  IntraOpThreads& operator=(const IntraOpThreads&) = delete;

 private:
  int saved_;
  std::optional<mha::detail::SpreadEveryCall> spread_;
};

/// |actual - expected| <= 1e-5 + 1e-4 |expected| everywhere (the issue's
/// float32 tolerance against Hugging Face).
inline void expect_hf_close(const torch::Tensor& actual,
                            const torch::Tensor& expected,
                            const std::string& what) {
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  auto a = actual.detach().to(torch::kFloat64);
  auto e = expected.detach().to(torch::kFloat64);
  auto excess = (a - e).abs() - (1e-5 + 1e-4 * e.abs());
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max abs diff " << (a - e).abs().max().item<double>();
}
