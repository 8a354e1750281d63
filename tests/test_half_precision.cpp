// bfloat16 and float16 on the CPU: calls that took the materialised explicit
// path run on the blocked core in float32 (attention_core.h:
// half_through_float32_applies), outputs and gradients returned in the
// input's dtype. Each variant against the float64 reference and against
// LibTorch's own math in the same dtype (the rule of FlashAttention's tests:
// at most k times the reference implementation's error at that dtype; here
// k = 2, plus one rounding of the result to the dtype).
//
// Glossary: N batch, H heads, Hkv key/value heads, L query length, S key
// length, E features.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/attention_core.h"  // last_attention_path
#include "mha/mha.h"
#include "test_helpers.h"

// A named namespace: the unity build joins the test files' anonymous ones.
namespace half_precision_tests {

constexpr double kInf = std::numeric_limits<double>::infinity();

class HalfPrecision : public SeededTest {};

/// Largest |a - ref| over the elements, in float64.
double max_error(const torch::Tensor& a, const torch::Tensor& ref) {
  return (a.detach().to(torch::kFloat64) - ref.detach().to(torch::kFloat64))
      .abs()
      .max()
      .item<double>();
}

/// One rounding to `dtype` of values of magnitude up to `scale`: the error
/// a result correct in float32 still has once stored in the dtype.
double rounding(torch::ScalarType dtype, double scale) {
  return (dtype == torch::kBFloat16 ? std::ldexp(1.0, -8)
                                    : std::ldexp(1.0, -11)) *
         scale;
}

/// The math of scaled_dot_product_attention (attention.h) on q (N, H, L,
/// E), k and v (N, Hkv, S, E) in their own dtype: LibTorch's products and
/// softmax as torch::nn computes them. `mask` additive (L, S) or undefined.
torch::Tensor math_attention(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const torch::Tensor& mask,
                             double scale) {
  auto kk = k, vv = v;
  if (k.size(1) != q.size(1)) {
    kk = k.repeat_interleave(q.size(1) / k.size(1), 1);
    vv = v.repeat_interleave(q.size(1) / k.size(1), 1);
  }
  auto s = torch::matmul(q, kk.transpose(-2, -1)) * scale;
  if (mask.defined()) {
    s = s + mask.to(s.scalar_type());
  }
  return torch::matmul(torch::softmax(s, -1), vv);
}

struct Case {
  std::string name;
  int64_t H = 4, Hkv = 4, L = 150, S = 150;
  bool causal = false;
  bool float_mask = false;
};

// Plain, causal, an additive mask, grouped heads and L != S (through
// flex_attention, which takes them without mods), each in
// bfloat16 and float16: the output and the gradients of query, key and
// value within 2x LibTorch's own error in the dtype (plus one rounding),
// and on the blocked path.
TEST_F(HalfPrecision, CoreVariantsWithinTwiceLibTorchsError) {
  const std::vector<Case> cases{
      {"plain"},
      {"causal", 4, 4, 150, 150, true},
      {"float mask", 4, 4, 150, 150, false, true},
      {"grouped heads, L != S (flex_attention)", 4, 2, 70, 150},
  };
  for (const auto dtype : {torch::kBFloat16, torch::kHalf}) {
    for (const auto& c : cases) {
      SCOPED_TRACE(c.name + ", " + c10::toString(dtype));
      const int64_t N = 2, E = 32;
      auto q64 = torch::randn({N, c.H, c.L, E}, torch::kFloat64);
      auto k64 = torch::randn({N, c.Hkv, c.S, E}, torch::kFloat64);
      auto v64 = torch::randn({N, c.Hkv, c.S, E}, torch::kFloat64);
      // Inputs rounded to the dtype once: every contender sees them.
      q64 = q64.to(dtype).to(torch::kFloat64);
      k64 = k64.to(dtype).to(torch::kFloat64);
      v64 = v64.to(dtype).to(torch::kFloat64);
      torch::Tensor mask64;
      if (c.float_mask) {
        mask64 = torch::randn({c.L, c.S}, torch::kFloat64)
                     .to(dtype)
                     .to(torch::kFloat64);
      }
      if (c.causal) {
        auto blocked = torch::ones({c.L, c.S}, torch::kBool).triu(1);
        mask64 = torch::zeros({c.L, c.S}, torch::kFloat64)
                     .masked_fill(blocked, -kInf);
      }
      const double scale = 1.0 / std::sqrt(static_cast<double>(E));
      auto leaves = [&](torch::ScalarType t) {
        return std::vector<torch::Tensor>{q64.to(t).requires_grad_(),
                                          k64.to(t).requires_grad_(),
                                          v64.to(t).requires_grad_()};
      };
      const auto grad_out = torch::randn({N, c.H, c.L, E}, torch::kFloat64)
                                .to(dtype)
                                .to(torch::kFloat64);
      auto run = [&](const std::vector<torch::Tensor>& in,
                     const torch::Tensor& out) {
        auto grads =
            torch::autograd::grad({out}, in, {grad_out.to(out.scalar_type())});
        return std::vector<torch::Tensor>{out.detach(), grads[0], grads[1],
                                          grads[2]};
      };
      // The reference, float64.
      const auto in64 = leaves(torch::kFloat64);
      const auto ref =
          run(in64, math_attention(in64[0], in64[1], in64[2], mask64, scale));
      // LibTorch's math in the dtype, where it has the products (LibTorch
      // 1.13 has no float16 matmul on the CPU: then the bound is the
      // rounding alone).
      std::vector<torch::Tensor> theirs;
      try {
        const auto in_torch = leaves(dtype);
        theirs = run(in_torch, math_attention(in_torch[0], in_torch[1],
                                              in_torch[2], mask64, scale));
      } catch (const c10::Error&) {
        EXPECT_EQ(dtype, torch::kHalf) << "LibTorch lacks only float16";
      }
      // mha in the dtype.
      const auto in_mha = leaves(dtype);
      torch::Tensor attn_mask = c.float_mask ? mask64.to(dtype) : mask64;
      if (c.causal) {
        attn_mask = torch::Tensor();
      }
      auto mine_out =
          c.Hkv != c.H
              ? std::get<0>(mha::flex_attention(in_mha[0], in_mha[1], in_mha[2],
                                                {}, {}, c10::nullopt,
                                                /*enable_gqa=*/true))
              : std::get<0>(mha::scaled_dot_product_attention(
                    in_mha[0], in_mha[1], in_mha[2], attn_mask, 0.0, c.causal));
      if (!mha::has_fused_sdpa()) {
        // (LibTorch 2.x's fused kernel takes such calls natively.)
        EXPECT_STREQ(mha::detail::to_string(mha::detail::last_attention_path()),
                     "blocked");
      }
      const auto mine = run(in_mha, mine_out);
      const char* names[] = {"output", "dq", "dk", "dv"};
      for (size_t i = 0; i < mine.size(); ++i) {
        EXPECT_EQ(mine[i].scalar_type(), dtype) << names[i];
        const double scale_of = ref[i].abs().max().item<double>();
        const double theirs_error =
            theirs.empty() ? 0.0 : max_error(theirs[i], ref[i]);
        const double my_error = max_error(mine[i], ref[i]);
        EXPECT_LE(my_error, 2.0 * theirs_error + rounding(dtype, scale_of))
            << names[i] << ": mha " << my_error << ", LibTorch "
            << theirs_error;
      }
    }
  }
}

// FlexAttention in bfloat16: eager and fused mods see float32 scores, on
// the blocked core; lse is float32.
TEST_F(HalfPrecision, FlexModsInBFloat16) {
  const int64_t N = 1, H = 2, L = 200, E = 16;
  const auto q64 = torch::randn({N, H, L, E}, torch::kFloat64)
                       .to(torch::kBFloat16)
                       .to(torch::kFloat64);
  const auto k64 = torch::randn({N, H, L, E}, torch::kFloat64)
                       .to(torch::kBFloat16)
                       .to(torch::kFloat64);
  const auto v64 = torch::randn({N, H, L, E}, torch::kFloat64)
                       .to(torch::kBFloat16)
                       .to(torch::kFloat64);
  namespace fused = mha::fused;
  const mha::ScoreMod eager = [](const torch::Tensor& s, const torch::Tensor&,
                                 const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&) {
    EXPECT_NE(s.scalar_type(), torch::kBFloat16) << "scores in float32";
    return 5.0 * torch::tanh(s / 5.0);
  };
  const auto fused_mod = mha::fused_score_mod(
      [](auto s, auto, auto, auto, auto) { return 5 * fused::tanh(s / 5); });
  const auto mask = mha::create_block_mask(
      mha::fused_mask_mod([](auto, auto, auto q, auto kv) { return q >= kv; }),
      c10::nullopt, c10::nullopt, L, L, 64);
  const auto ref = std::get<0>(mha::flex_attention(q64, k64, v64, eager, mask));
  for (const auto& mod : {eager, fused_mod}) {
    auto q = q64.to(torch::kBFloat16).requires_grad_();
    auto [out, lse] = mha::flex_attention(q, k64.to(torch::kBFloat16),
                                          v64.to(torch::kBFloat16), mod, mask,
                                          c10::nullopt, false, true);
    EXPECT_STREQ(mha::detail::to_string(mha::detail::last_attention_path()),
                 "blocked");
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
    EXPECT_EQ(lse.scalar_type(), torch::kFloat32);
    // float32 inside: the output within one bfloat16 rounding of it.
    EXPECT_LE(max_error(out, ref), rounding(torch::kBFloat16, 2.0));
    out.sum().backward();
    EXPECT_EQ(q.grad().scalar_type(), torch::kBFloat16);
    EXPECT_TRUE(q.grad().isfinite().all().item<bool>());
  }
}

// The module with bfloat16 parameters, end to end, beside torch::nn's in
// bfloat16, both against the float64 module.
TEST_F(HalfPrecision, ModuleInBFloat16AgainstTorchNn) {
  const int64_t E = 64, H = 4, N = 2, L = 96;
  mha::MultiHeadAttention ours(mha::MultiHeadAttentionOptions(E, H));
  torch::nn::MultiheadAttention theirs(
      torch::nn::MultiheadAttentionOptions(E, H));
  {
    torch::NoGradGuard no_grad;
    theirs->in_proj_weight.copy_(ours->in_proj_weight);
    theirs->in_proj_bias.copy_(ours->in_proj_bias);
    theirs->out_proj->weight.copy_(ours->out_proj->weight);
    theirs->out_proj->bias.copy_(ours->out_proj->bias);
  }
  const auto x64 = torch::randn({L, N, E}, torch::kFloat64)
                       .to(torch::kBFloat16)
                       .to(torch::kFloat64);
  ours->to(torch::kFloat64);
  const auto ref = std::get<0>(ours->forward(x64, x64, x64));
  ours->to(torch::kBFloat16);
  theirs->to(torch::kBFloat16);
  const auto x = x64.to(torch::kBFloat16);
  const auto mine = std::get<0>(ours->forward(x, x, x));
  const auto nn = std::get<0>(theirs->forward(x, x, x));
  EXPECT_EQ(mine.scalar_type(), torch::kBFloat16);
  const double scale_of = ref.abs().max().item<double>();
  EXPECT_LE(max_error(mine, ref),
            2.0 * max_error(nn, ref) + rounding(torch::kBFloat16, scale_of))
      << "mha " << max_error(mine, ref) << ", torch::nn " << max_error(nn, ref);
}

// An encoder layer with bfloat16 parameters, forward and backward, beside
// torch::nn's in bfloat16, both against the float64 layer.
TEST_F(HalfPrecision, EncoderLayerInBFloat16AgainstTorchNn) {
  const int64_t E = 32, H = 4, N = 2, L = 80;
  auto options = torch::nn::TransformerEncoderLayerOptions(E, H)
                     .dim_feedforward(64)
                     .dropout(0.0);
  torch::nn::TransformerEncoderLayer theirs(options);
  mha::TransformerEncoderLayer ours(mha::TransformerEncoderLayerOptions(E, H)
                                        .dim_feedforward(64)
                                        .dropout(0.0)
                                        .batch_first(false));
  mha::copy_weights(theirs, ours);
  const auto src64 = torch::randn({L, N, E}, torch::kFloat64)
                         .to(torch::kBFloat16)
                         .to(torch::kFloat64);
  // Causal, additive: -inf above the diagonal.
  const auto mask = torch::zeros({L, L}).masked_fill(
      torch::ones({L, L}, torch::kBool).triu(1), -kInf);
  ours->to(torch::kFloat64);
  auto in64 = src64.clone().requires_grad_();
  const auto ref = ours(in64, mask.to(torch::kFloat64));
  ref.sum().backward();
  ours->to(torch::kBFloat16);
  theirs->to(torch::kBFloat16);
  auto in_ours = src64.to(torch::kBFloat16).requires_grad_();
  auto in_theirs = src64.to(torch::kBFloat16).requires_grad_();
  const auto mine = ours(in_ours, mask.to(torch::kBFloat16));
  const auto nn = theirs(in_theirs, mask.to(torch::kBFloat16));
  mine.sum().backward();
  nn.sum().backward();
  EXPECT_EQ(mine.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(in_ours.grad().scalar_type(), torch::kBFloat16);
  const double out_scale = ref.abs().max().item<double>();
  EXPECT_LE(max_error(mine, ref),
            2.0 * max_error(nn, ref) + rounding(torch::kBFloat16, out_scale))
      << "output: mha " << max_error(mine, ref) << ", torch::nn "
      << max_error(nn, ref);
  const double grad_scale = in64.grad().abs().max().item<double>();
  EXPECT_LE(max_error(in_ours.grad(), in64.grad()),
            2.0 * max_error(in_theirs.grad(), in64.grad()) +
                rounding(torch::kBFloat16, grad_scale))
      << "input gradient: mha " << max_error(in_ours.grad(), in64.grad())
      << ", torch::nn " << max_error(in_theirs.grad(), in64.grad());
}

}  // namespace half_precision_tests
