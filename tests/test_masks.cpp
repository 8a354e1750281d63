// Tests of mha/masks.h: causal_mask, from_keep_mask, check_mask, merge_masks.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <initializer_list>
#include <limits>
#include <vector>

#include "mha/masks.h"
#include "test_helpers.h"

namespace {

class MasksTest : public SeededTest {};

/// A bool tensor from nested 0/1 rows.
torch::Tensor bools(std::initializer_list<std::initializer_list<int>> rows) {
  std::vector<torch::Tensor> parts;
  for (const auto& row : rows) {
    parts.push_back(torch::tensor(std::vector<int>(row)).to(torch::kBool));
  }
  return torch::stack(parts);
}

void expect_equal(const torch::Tensor& actual, const torch::Tensor& expected) {
  ASSERT_EQ(actual.scalar_type(), expected.scalar_type());
  ASSERT_EQ(actual.sizes(), expected.sizes());
  EXPECT_TRUE(torch::equal(actual, expected)) << "actual:\n"
                                              << actual << "\nexpected:\n"
                                              << expected;
}

// ----------------------------------------------------------- causal_mask ---

TEST_F(MasksTest, CausalMaskSquare) {
  expect_equal(mha::causal_mask(3, 3), bools({{0, 1, 1},  //
                                              {0, 0, 1},
                                              {0, 0, 0}}));
}

TEST_F(MasksTest, CausalMaskIsTopLeftForLNotS) {
  expect_equal(mha::causal_mask(3, 5), bools({{0, 1, 1, 1, 1},  //
                                              {0, 0, 1, 1, 1},
                                              {0, 0, 0, 1, 1}}));
  expect_equal(mha::causal_mask(4, 2), bools({{0, 1},  //
                                              {0, 0},
                                              {0, 0},
                                              {0, 0}}));
}

TEST_F(MasksTest, CausalMaskEmpty) {
  auto mask = mha::causal_mask(0, 0);
  EXPECT_EQ(mask.scalar_type(), torch::kBool);
  EXPECT_EQ(mask.sizes(), torch::IntArrayRef({0, 0}));
  auto no_keys = mha::causal_mask(2, 0);
  EXPECT_EQ(no_keys.sizes(), torch::IntArrayRef({2, 0}));
}

TEST_F(MasksTest, CausalMaskIgnoresDtypeUsesDevice) {
  auto mask =
      mha::causal_mask(2, 3, torch::TensorOptions().dtype(torch::kFloat64));
  expect_equal(mask, bools({{0, 1, 1}, {0, 0, 1}}));
  EXPECT_EQ(mask.device(), torch::Device(torch::kCPU));
  // The device is taken from the options (the meta device holds no data but
  // has one, so this runs without an accelerator).
  auto meta = mha::causal_mask(
      2, 3, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta));
  EXPECT_EQ(meta.device().type(), torch::kMeta);
  EXPECT_EQ(meta.scalar_type(), torch::kBool);
  EXPECT_EQ(meta.sizes(), torch::IntArrayRef({2, 3}));
}

TEST_F(MasksTest, GenerateSquareSubsequentMaskAsPythonsAndLibTorchs) {
  const double inf = std::numeric_limits<double>::infinity();
  for (int64_t L : {0, 1, 4}) {
    auto mask = mha::generate_square_subsequent_mask(L);
    EXPECT_EQ(mask.scalar_type(), torch::kFloat32);
    ASSERT_EQ(mask.sizes(), torch::IntArrayRef({L, L}));
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        EXPECT_EQ(mask[i][j].item<double>(), j > i ? -inf : 0.0)
            << "i=" << i << " j=" << j;
      }
    }
    EXPECT_TRUE(torch::equal(
        mask, torch::nn::TransformerImpl::generate_square_subsequent_mask(L)));
  }
  auto f64 = mha::generate_square_subsequent_mask(3, torch::kFloat64);
  EXPECT_EQ(f64.scalar_type(), torch::kFloat64);
  EXPECT_TRUE(torch::equal(f64.isinf(), mha::causal_mask(3, 3)));
  EXPECT_THROW_MSG(
      mha::generate_square_subsequent_mask(-1),
      "generate_square_subsequent_mask: L must be >= 0, but got -1");
  EXPECT_THROW_MSG(mha::generate_square_subsequent_mask(2, torch::kLong),
                   "the dtype must be floating, but got Long");
}

TEST_F(MasksTest, CausalMaskRejectsNegativeSizes) {
  EXPECT_THROW_MSG(mha::causal_mask(-1, 3),
                   "causal_mask: L and S must be >= 0, but got L=-1, S=3");
  EXPECT_THROW_MSG(mha::causal_mask(2, -4), "but got L=2, S=-4");
}

// -------------------------------------------------------- from_keep_mask ---

TEST_F(MasksTest, FromKeepMaskInvertsEveryDtype) {
  auto expected = bools({{0, 0, 1}, {1, 0, 1}});
  auto keep_bool = bools({{1, 1, 0}, {0, 1, 0}});
  expect_equal(mha::from_keep_mask(keep_bool), expected);
  expect_equal(mha::from_keep_mask(keep_bool.to(torch::kLong)), expected);
  expect_equal(mha::from_keep_mask(keep_bool.to(torch::kUInt8)), expected);
  expect_equal(mha::from_keep_mask(keep_bool.to(torch::kFloat32)), expected);
  expect_equal(mha::from_keep_mask(torch::tensor({1, 1, 0})),
               torch::tensor({0, 0, 1}).to(torch::kBool));
}

TEST_F(MasksTest, FromKeepMaskRejectsValuesOtherThanZeroOne) {
  EXPECT_THROW_MSG(mha::from_keep_mask(torch::tensor({1, 2, 0})),
                   "from_keep_mask: keep must hold only 0 (blocked) and 1 "
                   "(keep), but got other values (dtype Long, shape [3])");
  EXPECT_THROW_MSG(mha::from_keep_mask(torch::tensor({0.0, 0.5})),
                   "keep must hold only 0 (blocked) and 1 (keep)");
}

// ------------------------------------------------------------ check_mask ---

TEST_F(MasksTest, CheckMaskRejectsIntegerMasks) {
  const torch::Device cpu(torch::kCPU);
  EXPECT_THROW_MSG(
      mha::check_mask(torch::ones({2, 2}, torch::kLong), "my_mask",
                      torch::kFloat32, cpu),
      "my_mask must be bool (true = blocked) or floating (added to the "
      "scores), but got dtype Long");
  EXPECT_THROW_MSG(mha::check_mask(torch::ones({2, 2}, torch::kUInt8),
                                   "key_padding_mask", torch::kFloat32, cpu),
                   "key_padding_mask must be bool");
}

TEST_F(MasksTest, CheckMaskRejectsWrongFloatDtypeAndDevice) {
  const torch::Device cpu(torch::kCPU);
  EXPECT_THROW_MSG(
      mha::check_mask(torch::zeros({2, 2}, torch::kFloat64), "src_mask",
                      torch::kFloat32, cpu),
      "src_mask is floating, so it must have the query's dtype Float, but got "
      "dtype Double");
  EXPECT_THROW_MSG(
      mha::check_mask(
          torch::zeros(
              {2, 2},
              torch::TensorOptions().dtype(torch::kBool).device(torch::kMeta)),
          "attn_mask", torch::kFloat32, cpu),
      "attn_mask must be on the query's device cpu, but got device meta");
}

TEST_F(MasksTest, CheckMaskAcceptsUsableMasks) {
  const torch::Device cpu(torch::kCPU);
  EXPECT_NO_THROW(mha::check_mask({}, "m", torch::kFloat32, cpu));
  EXPECT_NO_THROW(mha::check_mask(torch::zeros({2}, torch::kBool), "m",
                                  torch::kFloat32, cpu));
  EXPECT_NO_THROW(mha::check_mask(torch::zeros({2}, torch::kFloat64), "m",
                                  torch::kFloat64, cpu));
}

// ----------------------------------------------------------- merge_masks ---

TEST_F(MasksTest, MergeMasksBoolAndFloatIsUnion) {
  auto blocked = bools({{0, 1, 0}, {0, 0, 0}});
  auto bias =
      torch::tensor({{0.5, 1.0, -kInf}, {2.0, -1.0, 0.0}}, torch::kFloat64);
  auto merged = mha::merge_masks({blocked, bias}, torch::kFloat64);
  expect_equal(merged, torch::tensor({{0.5, -kInf, -kInf}, {2.0, -1.0, 0.0}},
                                     torch::kFloat64));
  // Order does not matter.
  expect_equal(mha::merge_masks({bias, blocked}, torch::kFloat64), merged);
}

TEST_F(MasksTest, MergeMasksBroadcastsN11SWithLS) {
  const int64_t N = 2, L = 3, S = 4;
  auto pad = torch::zeros({N, 1, 1, S}, torch::kBool);
  pad[0][0][0][3] = true;
  pad[1][0][0][0] = true;
  auto bias = torch::arange(L * S, torch::kFloat32).reshape({L, S});
  auto merged = mha::merge_masks({pad, bias}, torch::kFloat32);
  ASSERT_EQ(merged.sizes(), torch::IntArrayRef({N, 1, L, S}));
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) {
        const bool is_blocked = (n == 0 && j == 3) || (n == 1 && j == 0);
        const float expected = is_blocked
                                   ? -std::numeric_limits<float>::infinity()
                                   : static_cast<float>(i * S + j);
        EXPECT_EQ(merged[n][0][i][j].item<float>(), expected)
            << "n=" << n << " i=" << i << " j=" << j;
      }
    }
  }
  // Two bool masks broadcast into their union.
  auto causal = mha::causal_mask(L, S);
  auto both = mha::merge_masks({pad, causal}, torch::kFloat32);
  ASSERT_EQ(both.sizes(), torch::IntArrayRef({N, 1, L, S}));
  auto expected_blocked = pad.logical_or(causal);
  expect_equal(both,
               torch::zeros({N, 1, L, S}).masked_fill(expected_blocked, -kInf));
}

TEST_F(MasksTest, MergeMasksAllUndefinedIsUndefined) {
  EXPECT_FALSE(mha::merge_masks({}, torch::kFloat32).defined());
  EXPECT_FALSE(
      mha::merge_masks({torch::Tensor(), torch::Tensor()}, torch::kFloat32)
          .defined());
}

TEST_F(MasksTest, MergeMasksFloatOnlyReturnsValues) {
  auto bias = torch::randn({3, 4});
  expect_equal(mha::merge_masks({torch::Tensor(), bias}, torch::kFloat32),
               bias);
  // Two floating masks are added, broadcasting.
  auto row = torch::randn({1, 4});
  auto sum = mha::merge_masks({bias, row}, torch::kFloat32);
  expect_close(sum, bias + row, 0.0, 0.0, "float + float");
}

TEST_F(MasksTest, MergeMasksBoolOnlyBecomesZeroNegInf) {
  auto blocked = bools({{1, 0}, {0, 1}});
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    auto merged = mha::merge_masks({blocked, torch::Tensor()}, dtype);
    expect_equal(merged, torch::tensor({{-kInf, 0.0}, {0.0, -kInf}}).to(dtype));
  }
}

TEST_F(MasksTest, MergeMasksRejectsOtherFloatDtype) {
  EXPECT_THROW_MSG(mha::merge_masks({torch::zeros({2, 2}, torch::kFloat64)},
                                    torch::kFloat32),
                   "merge_masks: expected bool or Float masks, but got Double");
}

}  // namespace
