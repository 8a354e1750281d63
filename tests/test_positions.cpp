// Tests of mha::rotary_embedding against rotations written out element by
// element, its relative-position property, and its errors.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "mha/positions.h"
#include "test_helpers.h"

namespace {

/// The rotation by hand: a loop over rows and feature pairs in double.
torch::Tensor rotate_by_hand(const torch::Tensor& x, int64_t offset,
                             double theta, mha::RotaryPairing pairing) {
  auto flat = x.to(torch::kFloat64).reshape({-1, x.size(-2), x.size(-1)});
  auto out = flat.clone();
  const int64_t T = x.size(-2), D = x.size(-1);
  auto in_a = flat.accessor<double, 3>();
  auto out_a = out.accessor<double, 3>();
  for (int64_t m = 0; m < flat.size(0); ++m) {
    for (int64_t t = 0; t < T; ++t) {
      const double position = static_cast<double>(offset + t);
      for (int64_t i = 0; i < D / 2; ++i) {
        const double angle =
            position * std::pow(theta, -2.0 * static_cast<double>(i) /
                                           static_cast<double>(D));
        const bool half = pairing == mha::RotaryPairing::kHalf;
        const int64_t ia = half ? i : 2 * i, ib = half ? i + D / 2 : 2 * i + 1;
        const double a = in_a[m][t][ia], b = in_a[m][t][ib];
        out_a[m][t][ia] = a * std::cos(angle) - b * std::sin(angle);
        out_a[m][t][ib] = a * std::sin(angle) + b * std::cos(angle);
      }
    }
  }
  return out.view(x.sizes());
}

class RotaryEmbeddingTest : public SeededTest {};

TEST_F(RotaryEmbeddingTest, EqualsRotationByHand) {
  for (auto pairing :
       {mha::RotaryPairing::kHalf, mha::RotaryPairing::kInterleaved}) {
    for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
      for (int64_t offset : {0, 5, 1000}) {
        for (double theta : {10000.0, 500000.0}) {
          SCOPED_TRACE(std::string(pairing == mha::RotaryPairing::kHalf
                                       ? "half"
                                       : "interleaved") +
                       ", " + c10::toString(dtype) +
                       ", offset=" + std::to_string(offset) +
                       ", theta=" + std::to_string(theta));
          auto x = torch::randn({2, 3, 7, 8}, dtype);  // (N, H, T, D)
          auto y = mha::rotary_embedding(x, offset, theta, pairing);
          EXPECT_EQ(y.scalar_type(), dtype);
          const double tol = dtype == torch::kFloat64 ? 1e-12 : 2e-5;
          expect_close(y, rotate_by_hand(x, offset, theta, pairing), tol, tol);
          // 2-D input, rows are positions.
          auto x2 = torch::randn({4, 6}, dtype);
          expect_close(mha::rotary_embedding(x2, offset, theta, pairing),
                       rotate_by_hand(x2, offset, theta, pairing), tol, tol,
                       "2-D");
        }
      }
    }
  }
}

// Position 0 is the identity; a rotation keeps each pair's norm.
TEST_F(RotaryEmbeddingTest, PositionZeroIsIdentityAndNormsAreKept) {
  auto x = torch::randn({1, 5, 16}, torch::kFloat64);
  auto y = mha::rotary_embedding(x);
  expect_close(y.select(1, 0), x.select(1, 0), 0.0, 0.0, "row 0");
  expect_close(y.norm(2, -1), x.norm(2, -1), 1e-12, 1e-12, "row norms");
}

// The point of RoPE: q·k after rotation depends on the positions only
// through their difference.
TEST_F(RotaryEmbeddingTest, ScoresDependOnRelativePositionOnly) {
  for (auto pairing :
       {mha::RotaryPairing::kHalf, mha::RotaryPairing::kInterleaved}) {
    auto q = torch::randn({1, 16}, torch::kFloat64);
    auto k = torch::randn({1, 16}, torch::kFloat64);
    auto score = [&](int64_t m, int64_t n) {
      return (mha::rotary_embedding(q, m, 10000.0, pairing) *
              mha::rotary_embedding(k, n, 10000.0, pairing))
          .sum()
          .item<double>();
    };
    EXPECT_NEAR(score(3, 1), score(103, 101), 1e-10);
    EXPECT_NEAR(score(0, 7), score(40, 47), 1e-10);
    EXPECT_GT(std::abs(score(3, 1) - score(1, 3)), 1e-6) << "not symmetric";
  }
}

// The two pairings are the same rotation on permuted features: interleaved
// (2i, 2i+1) is half-split (i, i + D/2) after moving even features first.
TEST_F(RotaryEmbeddingTest, PairingsAreAFeaturePermutationApart) {
  const int64_t D = 12;
  auto x = torch::randn({3, 5, D}, torch::kFloat64);
  auto to_half = torch::cat(
      {torch::arange(0, D, 2), torch::arange(1, D, 2)});  // even, then odd
  auto interleaved =
      mha::rotary_embedding(x, 2, 10000.0, mha::RotaryPairing::kInterleaved);
  auto half = mha::rotary_embedding(x.index_select(-1, to_half), 2, 10000.0,
                                    mha::RotaryPairing::kHalf);
  expect_close(interleaved.index_select(-1, to_half), half, 1e-12, 1e-12);
}

TEST_F(RotaryEmbeddingTest, GradientIsTheInverseRotation) {
  // y = R x with R a rotation per feature pair, so dL/dx = Rᵀ dL/dy, the
  // rotation by the opposite angle.
  auto x = torch::randn({2, 4, 6}, torch::kFloat64).requires_grad_();
  auto g = torch::randn({2, 4, 6}, torch::kFloat64);
  (mha::rotary_embedding(x, 3) * g).sum().backward();
  // Rᵀ g by the hand loop: rotating the swapped pair (b, a) by +angle and
  // swapping back rotates (a, b) by -angle.
  auto swap = torch::cat({torch::arange(3, 6), torch::arange(0, 3)});
  auto expected = rotate_by_hand(g.index_select(-1, swap), 3, 10000.0,
                                 mha::RotaryPairing::kHalf)
                      .index_select(-1, swap);
  expect_close(x.grad(), expected, 1e-12, 1e-12);
}

TEST_F(RotaryEmbeddingTest, BadArgumentsThrow) {
  EXPECT_THROW_MSG(mha::rotary_embedding(torch::randn({4, 5})),
                   "x's last dim D (features per head) must be even");
  EXPECT_THROW_MSG(mha::rotary_embedding(torch::randn({4})),
                   "at least 2 dims, but got [4]");
  EXPECT_THROW_MSG(mha::rotary_embedding(torch::ones({2, 4}, torch::kLong)),
                   "x must be floating, but got dtype Long");
  EXPECT_THROW_MSG(mha::rotary_embedding(torch::randn({2, 4}), -1),
                   "position_offset must be >= 0, but got -1");
  EXPECT_THROW_MSG(mha::rotary_embedding(torch::randn({2, 4}), 0, 0.0),
                   "theta must be finite and > 0, but got 0");
}

}  // namespace
