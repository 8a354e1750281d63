// Tests of the position rules of attention beyond plain causal masks: the
// attention core's diagonal offset, sliding window and per-diagonal bias
// (src/core/attention_core.h), ALiBi and T5's buckets (mha/positions.h), and
// MultiHeadAttention's window / position_bias options, each against dense
// references written out here with loops and plain ops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "core/attention_core.h"
#include "mha/multi_head_attention.h"
#include "mha/positions.h"
#include "test_helpers.h"

namespace {

using mha::detail::KeyPositions;
using mha::detail::WeightsMode;

/// The rules as an additive float64 (L, S) mask, entry by entry: query i at
/// key position i + diagonal; causal blocks j > i + diagonal; a window w
/// blocks |i + diagonal - j| >= w.
torch::Tensor limits_by_hand(int64_t L, int64_t S, bool causal,
                             int64_t diagonal, int64_t window) {
  auto mask = torch::zeros({L, S}, torch::kFloat64);
  auto a = mask.accessor<double, 2>();
  for (int64_t i = 0; i < L; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      const int64_t position = i + diagonal;
      const bool blocked = (causal && j > position) ||
                           (window > 0 && std::abs(position - j) >= window);
      a[i][j] = blocked ? -kInf : 0.0;
    }
  }
  return mask;
}

/// relative_bias (Hb, L + S - 1) as (Hb, L, S), entry by entry.
torch::Tensor bias_by_hand(const torch::Tensor& relative_bias, int64_t L,
                           int64_t S) {
  auto dense = torch::zeros({relative_bias.size(0), L, S}, torch::kFloat64);
  auto rb = relative_bias.to(torch::kFloat64);
  for (int64_t h = 0; h < rb.size(0); ++h) {
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) {
        dense[h][i][j] = rb[h][j - i + L - 1];
      }
    }
  }
  return dense;
}

/// softmax(q kᵀ scale + mask) v in float64 with plain ops; rows with
/// nothing visible give 0. q (N, H, L, D); k, v (N, H, S, D); mask
/// broadcastable to (N, H, L, S). Differentiable.
std::pair<torch::Tensor, torch::Tensor> attend(const torch::Tensor& q,
                                               const torch::Tensor& k,
                                               const torch::Tensor& v,
                                               const torch::Tensor& mask,
                                               double scale) {
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale + mask;
  auto empty = scores.eq(-kInf).all(-1, /*keepdim=*/true);
  auto weights = torch::softmax(scores.masked_fill(empty, 0.0), -1)
                     .masked_fill(empty, 0.0);
  return {torch::matmul(weights, v), weights};
}

class KeyPositionsTest : public SeededTest {};

// The blocked and explicit paths of the core against the dense reference,
// forward and every gradient (query, key, value and the bias), over
// diagonals (top-left, bottom-right, others), windows, causal or not,
// shared or per-head bias, grouped key/value heads, blocks of 1..16 rows,
// weights kept or recomputed, on 1 and 2 threads.
TEST_F(KeyPositionsTest, CorePathsMatchDenseReference) {
  const int64_t N = 2, H = 4, D = 6;
  struct PathCase {
    int64_t L, S;
    bool causal;
    int64_t diagonal, window;
  };
  std::vector<PathCase> cases = {
      {7, 7, true, 0, 3},   {5, 12, true, 7, 0},  {5, 12, true, 7, 4},
      {12, 5, true, -7, 0}, {9, 9, false, 0, 2},  {6, 10, false, 4, 3},
      {8, 8, true, 0, 1},   {4, 9, false, -3, 0}, {6, 6, true, 2, 0},
      {6, 6, true, -2, 2},
  };
  for (int threads : {1, 2}) {
    const IntraOpThreads set_threads(threads);
    for (const auto& c : cases) {
      for (int bias_kind = 0; bias_kind < 3; ++bias_kind) {  // none/1/H
        for (int64_t Hkv : {H, int64_t{2}}) {
          for (auto mode : {WeightsMode::kNone, WeightsMode::kPerHead,
                            WeightsMode::kAverage}) {
            const std::string trace =
                "L=" + std::to_string(c.L) + " S=" + std::to_string(c.S) +
                (c.causal ? " causal" : "") +
                " diagonal=" + std::to_string(c.diagonal) +
                " window=" + std::to_string(c.window) +
                " bias=" + std::to_string(bias_kind) +
                " Hkv=" + std::to_string(Hkv) +
                " mode=" + std::to_string(static_cast<int>(mode)) +
                " threads=" + std::to_string(threads);
            SCOPED_TRACE(trace);
            auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
            auto q = torch::randn({N, H, c.L, D}, f64);
            auto k = torch::randn({N, Hkv, c.S, D}, f64);
            auto v = torch::randn({N, Hkv, c.S, D + 1}, f64);
            torch::Tensor rb;
            if (bias_kind > 0) {
              rb = torch::randn({bias_kind == 1 ? 1 : H, c.L + c.S - 1}, f64);
            }
            auto g_out = torch::randn({N, H, c.L, D + 1}, f64);
            auto g_w = mode == WeightsMode::kAverage
                           ? torch::randn({N, c.L, c.S}, f64)
                           : torch::randn({N, H, c.L, c.S}, f64);
            // Reference on repeated key/value heads.
            auto qr = q.clone().requires_grad_();
            auto kr = k.clone().requires_grad_();
            auto vr = v.clone().requires_grad_();
            auto rbr = rb.defined() ? rb.clone().requires_grad_() : rb;
            auto mask = limits_by_hand(c.L, c.S, c.causal, c.diagonal,
                                       c.window);  // (L, S)
            auto full_mask = mask.expand({N, H, c.L, c.S});
            if (rbr.defined()) {
              // bias_by_hand is not differentiable: the gather below is
              // checked against it, then carries the gradient.
              auto idx = (torch::arange(c.S).unsqueeze(0) -
                          torch::arange(c.L).unsqueeze(1) + (c.L - 1));
              auto gathered =
                  rbr.index_select(1, idx.flatten()).view({-1, c.L, c.S});
              ASSERT_TRUE(
                  torch::equal(gathered.detach(), bias_by_hand(rb, c.L, c.S)));
              full_mask = full_mask + gathered.unsqueeze(0);
            }
            const auto group = H / Hkv;
            auto kx = kr.repeat_interleave(group, 1);
            auto vx = vr.repeat_interleave(group, 1);
            auto [ref_out, ref_w] = attend(qr, kx, vx, full_mask, 0.4);
            auto ref_weights =
                mode == WeightsMode::kAverage ? ref_w.mean(1) : ref_w;
            auto ref_loss = (ref_out * g_out).sum();
            if (mode != WeightsMode::kNone) {
              ref_loss = ref_loss + (ref_weights * g_w).sum();
            }
            ref_loss.backward();

            KeyPositions positions(c.causal);
            positions.diagonal = c.diagonal;
            positions.window = c.window;
            // 0, 4: one block of all heads (recomputed, kept); 1, 2:
            // blocks of 2 and 3 rows; 3: explicit.
            for (int path = 0; path < 5; ++path) {
              SCOPED_TRACE("path " + std::to_string(path));
              auto qg = q.clone().requires_grad_();
              auto kg = k.clone().requires_grad_();
              auto vg = v.clone().requires_grad_();
              positions.relative_bias =
                  rb.defined() ? rb.clone().requires_grad_() : rb;
              mha::detail::AttentionResult r;
              if (path == 3) {
                if (Hkv != H) {
                  continue;  // the explicit path takes repeated heads
                }
                r = mha::detail::explicit_attention(qg, kg, vg, {}, positions,
                                                    0.0, 0.4, mode);
              } else {
                const int64_t block =
                    path == 0 || path == 4 ? 0 : (path == 1 ? 2 : 3);
                r = mha::detail::blocked_attention(
                    qg, kg, vg, {}, positions, 0.4, mode, block,
                    path == 2 || path == 4 ? mha::detail::KeptWeights::kAlways
                                           : mha::detail::KeptWeights::kNever);
              }
              auto loss = (r.output * g_out).sum();
              if (mode != WeightsMode::kNone) {
                ASSERT_TRUE(r.weights.defined());
                expect_close(r.weights, ref_weights, 1e-12, 1e-12, "weights");
                loss = loss + (r.weights * g_w).sum();
              }
              loss.backward();
              expect_close(r.output, ref_out, 1e-12, 1e-12, "output");
              expect_close(qg.grad(), qr.grad(), 1e-12, 1e-12, "query grad");
              expect_close(kg.grad(), kr.grad(), 1e-12, 1e-12, "key grad");
              expect_close(vg.grad(), vr.grad(), 1e-12, 1e-12, "value grad");
              if (rb.defined()) {
                expect_close(positions.relative_bias.grad(), rbr.grad(), 1e-11,
                             1e-11, "bias grad");
              }
            }
          }
        }
      }
    }
  }
}

// float32 through the fused softmax (bias and limits inside the kernel)
// against the float64 reference.
TEST_F(KeyPositionsTest, Float32BlockedPathMatchesReference) {
  // L <= 32: the default is one block of all heads (kOneBlockRows).
  const int64_t L = 30, S = 50, H = 2, D = 16;
  for (bool causal : {false, true}) {
    for (int64_t window : {0, 9}) {
      SCOPED_TRACE(std::string(causal ? "causal" : "") +
                   " window=" + std::to_string(window));
      auto q = torch::randn({1, H, L, D}), k = torch::randn({1, H, S, D}),
           v = torch::randn({1, H, S, D});
      auto rb = torch::randn({H, L + S - 1});
      KeyPositions positions(causal);
      positions.diagonal = S - L;
      positions.window = window;
      positions.relative_bias = rb;
      auto mask =
          limits_by_hand(L, S, causal, S - L, window) + bias_by_hand(rb, L, S);
      auto [out, w] = attend(q.to(torch::kFloat64), k.to(torch::kFloat64),
                             v.to(torch::kFloat64), mask, 0.25);
      // Blocks of 16 rows, and the default: one block of all heads.
      for (int64_t block : {16, 0}) {
        auto r = mha::detail::blocked_attention(q, k, v, {}, positions, 0.25,
                                                WeightsMode::kPerHead, block);
        expect_close(r.output, out, 2e-5, 2e-5, "output");
        expect_close(r.weights, w, 2e-6, 2e-5, "weights");
      }
    }
  }
}

// ALiBi's slopes: the paper's geometric sequence for 8 heads, and for 12
// heads the 8-head slopes followed by every other 16-head slope.
TEST(AlibiTest, SlopesFollowThePaper) {
  auto s8 = mha::alibi_slopes(8, torch::kFloat64);
  for (int64_t h = 0; h < 8; ++h) {
    EXPECT_DOUBLE_EQ(s8[h].item<double>(), std::pow(0.5, h + 1));
  }
  auto s12 = mha::alibi_slopes(12, torch::kFloat64);
  ASSERT_EQ(s12.size(0), 12);
  for (int64_t h = 0; h < 8; ++h) {
    EXPECT_DOUBLE_EQ(s12[h].item<double>(), std::pow(0.5, h + 1));
  }
  for (int64_t h = 8; h < 12; ++h) {  // 2^(-0.5), 2^(-1.5), ... of 16 heads
    EXPECT_DOUBLE_EQ(
        s12[h].item<double>(),
        std::pow(2.0, -0.5 * static_cast<double>(2 * (h - 8) + 1)));
  }
  EXPECT_EQ(mha::alibi_slopes(3).scalar_type(), torch::kFloat32);
  EXPECT_NEAR(mha::alibi_slopes(1)[0].item<double>(), 1.0 / 256, 1e-12);
  EXPECT_THROW_MSG(mha::alibi_slopes(0), "num_heads must be >= 1");
}

TEST(AlibiTest, BiasIsMinusSlopeTimesDistance) {
  auto slopes = mha::alibi_slopes(4, torch::kFloat64);
  for (int64_t offset : {0, 3}) {
    auto bias = mha::alibi_bias(4, 3, 6, offset, torch::kFloat64);
    ASSERT_EQ(bias.sizes(), (torch::IntArrayRef{4, 3, 6}));
    for (int64_t h = 0; h < 4; ++h) {
      for (int64_t i = 0; i < 3; ++i) {
        for (int64_t j = 0; j < 6; ++j) {
          EXPECT_DOUBLE_EQ(bias[h][i][j].item<double>(),
                           -slopes[h].item<double>() *
                               static_cast<double>(std::abs(i + offset - j)));
        }
      }
    }
  }
}

/// T5's bucket rule written out for one relative position (float32 log
/// buckets as T5's code).
int64_t bucket_by_hand(int64_t relative, bool bidirectional, int64_t buckets,
                       int64_t max_distance) {
  int64_t result = 0;
  int64_t n = buckets;
  int64_t distance = 0;
  if (bidirectional) {
    n /= 2;
    if (relative > 0) {
      result += n;
    }
    distance = std::abs(relative);
  } else {
    distance = relative < 0 ? -relative : 0;
  }
  const int64_t max_exact = n / 2;
  if (distance < max_exact) {
    return result + distance;
  }
  const float ratio =
      static_cast<float>(distance) / static_cast<float>(max_exact);
  const float scaled =
      std::log(ratio) /
      static_cast<float>(std::log(static_cast<double>(max_distance) /
                                  static_cast<double>(max_exact))) *
      static_cast<float>(n - max_exact);
  return result +
         std::min<int64_t>(max_exact + static_cast<int64_t>(scaled), n - 1);
}

TEST(RelativePositionBucketTest, MatchesT5Rule) {
  auto relative = torch::arange(-300, 301);
  for (bool bidirectional : {true, false}) {
    for (auto [buckets, max_distance] :
         {std::pair<int64_t, int64_t>{32, 128}, {8, 20}}) {
      auto b = mha::relative_position_bucket(relative, bidirectional, buckets,
                                             max_distance);
      ASSERT_EQ(b.scalar_type(), torch::kLong);
      for (int64_t r = -300; r <= 300; ++r) {
        EXPECT_EQ(b[r + 300].item<int64_t>(),
                  bucket_by_hand(r, bidirectional, buckets, max_distance))
            << "relative " << r << ", bidirectional " << bidirectional;
      }
    }
  }
  // A few values by the rule's words: 32 buckets bidirectional, 16 a side,
  // 8 exact distances; keys after the query in buckets 16..31.
  auto b = mha::relative_position_bucket(
      torch::tensor({0, -3, 3, -7, -8, -1000, 1000}));
  EXPECT_TRUE(torch::equal(b, torch::tensor({0, 3, 19, 7, 8, 15, 31})));
  EXPECT_THROW_MSG(mha::relative_position_bucket(torch::zeros({2})),
                   "must be an integer tensor");
  EXPECT_THROW_MSG(
      mha::relative_position_bucket(torch::zeros({2}, torch::kLong), true, 2),
      "num_buckets must be >= 4");
  EXPECT_THROW_MSG(mha::relative_position_bucket(
                       torch::zeros({2}, torch::kLong), true, 32, 8),
                   "max_distance must exceed");
}

// ------------------------------------------------------------- the module ---

/// MultiHeadAttention from plain ops with the module's (packed) parameters:
/// self-attention of x (N, L, E) with additive `bias` broadcastable to
/// (N, H, L, L). Differentiable.
torch::Tensor module_by_hand(mha::MultiHeadAttentionImpl& m,
                             const torch::Tensor& x,
                             const torch::Tensor& bias) {
  const int64_t N = x.size(0), L = x.size(1), E = m.options.embed_dim();
  const int64_t H = m.options.num_heads(), D = E / H;
  auto qkv = torch::matmul(x, m.in_proj_weight.t()) + m.in_proj_bias;
  auto split = [&](int64_t part) {
    return qkv.narrow(2, part * E, E).view({N, L, H, D}).transpose(1, 2);
  };
  auto [out, w] = attend(split(0), split(1), split(2), bias,
                         1.0 / std::sqrt(static_cast<double>(D)));
  auto merged = out.transpose(1, 2).reshape({N, L, E});
  return torch::matmul(merged, m.out_proj->weight.t()) + m.out_proj->bias;
}

// window, ALiBi and T5's relative bias in the module, alone and together,
// causal or not, with a key padding mask: outputs and the gradients of the
// input and of every parameter (the T5 table included) equal the hand-built
// module with the dense (H, L, L) bias and banded mask.
TEST_F(KeyPositionsTest, ModuleOptionsMatchDenseReference) {
  const int64_t N = 2, L = 11, E = 16, H = 4;
  for (auto kind : {mha::PositionBias::kNone, mha::PositionBias::kAlibi,
                    mha::PositionBias::kRelative}) {
    for (int64_t window : {0, 4}) {
      for (bool causal : {false, true}) {
        SCOPED_TRACE("bias " + std::to_string(static_cast<int>(kind)) +
                     " window=" + std::to_string(window) +
                     (causal ? " causal" : ""));
        auto options = mha::MultiHeadAttentionOptions(E, H)
                           .position_bias(kind)
                           .relative_num_buckets(8)
                           .relative_max_distance(6)
                           .relative_bidirectional(!causal);
        if (window > 0) {
          options.window(window);
        }
        mha::MultiHeadAttention m(options);
        m->to(torch::kFloat64);
        {
          torch::NoGradGuard no_grad;
          m->in_proj_bias.normal_();
          m->out_proj->bias.normal_();
        }
        auto x = torch::randn({N, L, E}, torch::kFloat64);
        auto g = torch::randn({N, L, E}, torch::kFloat64);
        // The dense bias: limits, then the position bias entry by entry.
        auto dense = limits_by_hand(L, L, causal, 0, window)
                         .unsqueeze(0)
                         .repeat({H, 1, 1});  // (H, L, L)
        if (kind == mha::PositionBias::kAlibi) {
          dense = dense + mha::alibi_bias(H, L, L, 0, torch::kFloat64);
        }
        torch::Tensor table;
        if (kind == mha::PositionBias::kRelative) {
          table = m->relative_attention_bias->weight;  // (buckets, H)
          std::vector<torch::Tensor> rows;
          for (int64_t i = 0; i < L; ++i) {
            auto relative = torch::arange(L) - i;  // key - query
            auto b = mha::relative_position_bucket(relative, !causal, 8, 6);
            rows.push_back(table.index_select(0, b).t());  // (H, L)
          }
          dense = dense + torch::stack(rows, 1);  // (H, L, L)
        }
        // Batch 1's last two keys padded: the masks combine with the rules.
        auto padding = torch::zeros({N, L}, torch::kBool);
        padding[1].narrow(0, L - 2, 2).fill_(true);
        auto padding_bias = torch::zeros({N, 1, 1, L}, torch::kFloat64)
                                .masked_fill(padding.view({N, 1, 1, L}), -kInf);
        auto xr = x.clone().requires_grad_();
        auto ref = module_by_hand(*m, xr, dense.unsqueeze(0) + padding_bias);
        (ref * g).sum().backward();
        std::vector<torch::Tensor> ref_grads;
        for (const auto& p : m->parameters()) {
          ref_grads.push_back(p.grad().clone());
          p.mutable_grad().zero_();
        }
        auto xg = x.clone().requires_grad_();
        auto out = std::get<0>(m->forward(
            xg, {}, {}, padding, /*need_weights=*/false, {}, true, causal));
        (out * g).sum().backward();
        expect_close(out, ref, 1e-12, 1e-12, "output");
        expect_close(xg.grad(), xr.grad(), 1e-12, 1e-12, "input grad");
        auto params = m->named_parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          expect_close(params[i].value().grad(), ref_grads[i], 1e-11, 1e-11,
                       params[i].key() + " grad");
        }
      }
    }
  }
}

TEST(KeyPositionsModuleTest, OptionErrorsNameTheArgument) {
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2).window(0)),
      "window must be >= 1, but got 0");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(8, 2).window(3).add_bias_kv(true)),
      "cannot be combined with add_bias_kv");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2)
                                  .position_bias(mha::PositionBias::kAlibi)
                                  .add_zero_attn(true)),
      "cannot be combined with add_bias_kv or add_zero_attn");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2)
                                  .position_bias(mha::PositionBias::kRelative)
                                  .relative_num_buckets(2)),
      "relative_num_buckets must be >= 4");
  mha::MultiHeadAttention relative(
      mha::MultiHeadAttentionOptions(8, 2)
          .position_bias(mha::PositionBias::kRelative)
          .window(5));
  EXPECT_EQ(relative->relative_attention_bias->weight.sizes(),
            (torch::IntArrayRef{32, 2}));
  std::ostringstream printed;
  relative->pretty_print(printed);
  EXPECT_EQ(printed.str(),
            "mha::MultiHeadAttention(embed_dim=8, num_heads=2, window=5, "
            "position_bias=relative(buckets=32, max_distance=128))");
  auto keys = relative->named_parameters().keys();
  EXPECT_NE(
      std::find(keys.begin(), keys.end(), "relative_attention_bias.weight"),
      keys.end());
}

}  // namespace
