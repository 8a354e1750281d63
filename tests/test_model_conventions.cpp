// Tests of the conventions of real model families (issue 20, item 1) in
// MultiHeadAttention: partial rotary (rotary_dim), rotary scaling
// (mha::RotaryScaling), per-token positions in forward and forward_cached,
// and forward_cached's key padding mask (left-padded batched decoding).
// The reference: float64 attention written out here with loops (rotation,
// scores, masks, softmax) from the module's own weights; the rotary
// frequencies themselves are checked against transformers in
// test_rope_scaling.cpp.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "mha/positions.h"
#include "test_helpers.h"

namespace {

// ------------------------------------------- float64 references by hand ---

/// x (N, H, T, D) float64 with its first R features rotated by hand:
/// row t of batch n at angle positions[n][t] · inv_freq[i], pairs (i, i +
/// R/2) or (2i, 2i + 1), cos and sin times `factor`.
torch::Tensor rotate_by_hand(const torch::Tensor& x,
                             const torch::Tensor& positions,
                             const torch::Tensor& inv_freq, double factor,
                             mha::RotaryPairing pairing) {
  auto y = x.clone();
  auto xa = x.accessor<double, 4>();
  auto ya = y.accessor<double, 4>();
  auto pa = positions.accessor<int64_t, 2>();
  auto wa = inv_freq.accessor<double, 1>();
  const int64_t half = inv_freq.size(0);
  for (int64_t n = 0; n < x.size(0); ++n) {
    for (int64_t h = 0; h < x.size(1); ++h) {
      for (int64_t t = 0; t < x.size(2); ++t) {
        for (int64_t i = 0; i < half; ++i) {
          const double angle = static_cast<double>(pa[n][t]) * wa[i];
          const double c = std::cos(angle) * factor;
          const double s = std::sin(angle) * factor;
          const bool halves = pairing == mha::RotaryPairing::kHalf;
          const int64_t ia = halves ? i : 2 * i;
          const int64_t ib = halves ? i + half : 2 * i + 1;
          const double a = xa[n][h][t][ia], b = xa[n][h][t][ib];
          ya[n][h][t][ia] = a * c - b * s;
          ya[n][h][t][ib] = a * s + b * c;
        }
      }
    }
  }
  return y;
}

/// The module's float64 projections of x (N, T, E): q, k, v (N, H, T, D)
/// (packed in_proj_weight only).
std::vector<torch::Tensor> project_by_hand(const mha::MultiHeadAttention& m,
                                           const torch::Tensor& x) {
  const int64_t H = m->options.num_heads(), D = m->head_dim;
  auto w = m->in_proj_weight.detach().to(torch::kFloat64).chunk(3, 0);
  auto b = m->in_proj_bias.detach().to(torch::kFloat64).chunk(3, 0);
  std::vector<torch::Tensor> out;
  for (int i = 0; i < 3; ++i) {
    auto p = torch::matmul(x.to(torch::kFloat64), w[i].t()) + b[i];
    out.push_back(p.view({x.size(0), x.size(1), H, D}).transpose(1, 2));
  }
  return out;
}

/// Attention written out with loops: query i of batch n (position
/// q_positions[n][i], token index i + offset) and key j (k_positions[n][j],
/// token index j). Blocked: padding[n][j]; causal j > i + offset; window w
/// when k - q <= -w (or >= w without causal). ALiBi / T5 bias by position
/// difference. Fully blocked rows give 0. Returns out_proj(...) (N, L, E)
/// in float64.
torch::Tensor attend_by_hand(const mha::MultiHeadAttention& m,
                             const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v,
                             const torch::Tensor& q_positions,
                             const torch::Tensor& k_positions,
                             const torch::Tensor& padding, bool causal,
                             int64_t offset) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2),
                D = q.size(3);
  const auto& o = m->options;
  const double scale = o.scale().value_or(1.0 / std::sqrt(double(D)));
  auto slopes = mha::alibi_slopes(H, torch::kFloat64);
  torch::Tensor t5;
  if (o.position_bias() == mha::PositionBias::kRelative) {
    t5 = m->relative_attention_bias->weight.detach().to(torch::kFloat64);
  }
  auto out = torch::zeros({N, H, L, D}, torch::kFloat64);
  auto qa = q.accessor<double, 4>(), ka = k.accessor<double, 4>(),
       va = v.accessor<double, 4>(), oa = out.accessor<double, 4>();
  auto qp = q_positions.accessor<int64_t, 2>();
  auto kp = k_positions.accessor<int64_t, 2>();
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = 0; i < L; ++i) {
        std::vector<double> score(S, -kInf);
        double best = -kInf;
        for (int64_t j = 0; j < S; ++j) {
          const int64_t rel = kp[n][j] - qp[n][i];
          bool blocked = (padding.defined() && padding[n][j].item<bool>()) ||
                         (causal && j > i + offset);
          if (o.window().has_value()) {
            const int64_t w = *o.window();
            blocked = blocked || rel <= -w || (!causal && rel >= w);
          }
          if (blocked) {
            continue;
          }
          double sc = 0.0;
          for (int64_t d = 0; d < D; ++d) {
            sc += qa[n][h][i][d] * ka[n][h][j][d];
          }
          sc *= scale;
          if (o.position_bias() == mha::PositionBias::kAlibi) {
            sc -= slopes[h].item<double>() * std::abs(double(rel));
          } else if (t5.defined()) {
            auto bucket = mha::relative_position_bucket(
                torch::tensor({rel}), o.relative_bidirectional(),
                o.relative_num_buckets(), o.relative_max_distance());
            sc += t5[bucket[0].item<int64_t>()][h].item<double>();
          }
          score[j] = sc;
          best = std::max(best, sc);
        }
        if (best == -kInf) {
          continue;  // fully masked: 0
        }
        double total = 0.0;
        for (auto& sc : score) {
          sc = std::exp(sc - best);  // exp(-inf) = 0
          total += sc;
        }
        for (int64_t j = 0; j < S; ++j) {
          for (int64_t d = 0; d < D; ++d) {
            oa[n][h][i][d] += score[j] / total * va[n][h][j][d];
          }
        }
      }
    }
  }
  auto merged = out.transpose(1, 2).reshape({N, L, H * D});
  auto w = m->out_proj->weight.detach().to(torch::kFloat64);
  auto b = m->out_proj->bias.detach().to(torch::kFloat64);
  return torch::matmul(merged, w.t()) + b;
}

/// The module's rotary frequencies for a call whose largest position is
/// seq_len - 1 (rotary_frequencies is checked against transformers above).
mha::RotaryFrequencies frequencies_of(const mha::MultiHeadAttention& m,
                                      int64_t seq_len) {
  return mha::rotary_frequencies(m->options.rotary_dim().value_or(m->head_dim),
                                 m->options.rotary_theta(),
                                 m->options.rotary_scaling(), seq_len);
}

/// forward's reference: self-attention of x (N, L, E) at positions (N, L).
torch::Tensor forward_by_hand(const mha::MultiHeadAttention& m,
                              const torch::Tensor& x,
                              const torch::Tensor& positions,
                              const torch::Tensor& padding, bool causal) {
  auto qkv = project_by_hand(m, x);
  if (m->options.rotary()) {
    const auto f = frequencies_of(m, positions.max().item<int64_t>() + 1);
    for (int i = 0; i < 2; ++i) {
      qkv[i] = rotate_by_hand(qkv[i], positions, f.inv_freq, f.attention_factor,
                              m->options.rotary_pairing());
    }
  }
  return attend_by_hand(m, qkv[0], qkv[1], qkv[2], positions, positions,
                        padding, causal, 0);
}

/// Module variants with every rule that reads positions.
std::vector<std::pair<std::string, mha::MultiHeadAttentionOptions>>
position_variants() {
  const int64_t E = 16, H = 2;  // head_dim 8
  auto base = mha::MultiHeadAttentionOptions(E, H);
  mha::RotaryScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 4;
  mha::RotaryScaling llama3;
  llama3.rope_type = "llama3";
  llama3.factor = 8.0;
  llama3.original_max_position_embeddings = 8;
  return {
      {"rotary", base.rotary(true)},
      {"gptj_partial_interleaved",
       mha::MultiHeadAttentionOptions(E, H)
           .rotary(true)
           .rotary_dim(4)
           .rotary_pairing(mha::RotaryPairing::kInterleaved)},
      {"neox_partial_half_yarn", mha::MultiHeadAttentionOptions(E, H)
                                     .rotary(true)
                                     .rotary_dim(4)
                                     .rotary_scaling(yarn)},
      {"llama3",
       mha::MultiHeadAttentionOptions(E, H).rotary(true).rotary_scaling(
           llama3)},
      {"alibi", mha::MultiHeadAttentionOptions(E, H).position_bias(
                    mha::PositionBias::kAlibi)},
      {"t5_decoder", mha::MultiHeadAttentionOptions(E, H)
                         .position_bias(mha::PositionBias::kRelative)
                         .relative_bidirectional(false)
                         .relative_num_buckets(8)
                         .relative_max_distance(10)
                         .scale(1.0)},
      {"rotary_window",
       mha::MultiHeadAttentionOptions(E, H).rotary(true).window(3)},
  };
}

class ModelConventionsTest : public SeededTest {};

// forward with positions (N, L): a left-padded row (pads at position 0,
// masked, as transformers' generate) and a row starting at 5, causal and
// not, against the loops above; outputs at 1e-5 + 1e-4 |ref| in float32.
TEST_F(ModelConventionsTest, ForwardAtPositionsMatchesLoops) {
  const int64_t N = 2, L = 6, E = 16;
  auto positions =
      torch::tensor({0, 0, 0, 1, 2, 3, 5, 6, 7, 8, 9, 10}, torch::kLong)
          .view({N, L});
  auto padding = torch::zeros({N, L}, torch::kBool);
  padding[0].narrow(0, 0, 2).fill_(true);
  for (const auto& [name, options] : position_variants()) {
    for (bool causal : {true, false}) {
      SCOPED_TRACE(name + (causal ? " causal" : " bidirectional"));
      mha::MultiHeadAttention m(options);
      m->eval();
      auto x = torch::randn({N, L, E});
      auto out =
          std::get<0>(m->forward(x, {}, {}, padding, /*need_weights=*/false, {},
                                 true, causal, positions));
      expect_hf_close(out, forward_by_hand(m, x, positions, padding, causal),
                      "output");
      // Positions (L) broadcast over the batch.
      auto row = positions[1];
      auto out_row =
          std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, causal, row));
      expect_hf_close(
          out_row,
          forward_by_hand(m, x, row.unsqueeze(0).expand({N, L}), {}, causal),
          "output, positions (L)");
    }
  }
}

// Default positions are 0..L-1: giving them explicitly changes nothing.
TEST_F(ModelConventionsTest, ExplicitDefaultPositionsChangeNothing) {
  auto x = torch::randn({2, 7, 16});
  auto positions = torch::arange(7);
  for (const auto& [name, options] : position_variants()) {
    SCOPED_TRACE(name);
    mha::MultiHeadAttention m(options);
    auto [a, wa] = m->forward(x, {}, {}, {}, true, {}, true, true);
    auto [b, wb] = m->forward(x, {}, {}, {}, true, {}, true, true, positions);
    expect_close(b, a, 1e-6, 1e-5, "output");
    expect_close(wb, wa, 1e-6, 1e-5, "weights");
    // (N, L) positions that are not contiguous (a transposed view).
    auto strided = torch::arange(7).unsqueeze(1).expand({7, 2}).t();
    auto c =
        std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true, strided));
    expect_close(c, a, 1e-6, 1e-5, "output, strided positions");
  }
}

// ----------------------------------------------------- cached decoding ---

/// Decodes x (N, L, E) through one cache: a prompt of `prompt` tokens, then
/// one token per call, each call given its positions and (when defined)
/// the padding of every token so far. Returns the outputs concatenated
/// (N, L, E).
torch::Tensor decode(mha::MultiHeadAttention& m, const torch::Tensor& x,
                     const torch::Tensor& positions,
                     const torch::Tensor& padding, int64_t prompt) {
  const int64_t N = x.size(0), L = x.size(1);
  auto cache = m->make_kv_cache(N, L);
  std::vector<torch::Tensor> outs;
  for (int64_t start = 0; start < L;) {
    const int64_t T = start == 0 ? prompt : 1;
    auto pos =
        positions.defined() ? positions.narrow(1, start, T) : torch::Tensor();
    auto pad =
        padding.defined() ? padding.narrow(1, 0, start + T) : torch::Tensor();
    outs.push_back(std::get<0>(
        m->forward_cached(x.narrow(1, start, T), cache, /*is_causal=*/true,
                          /*need_weights=*/false, true, pad, pos)));
    start += T;
  }
  return torch::cat(outs, 1);
}

// forward_cached with positions equals forward with the same positions
// (rows of the whole sequence), for every rule that reads positions: the
// cache keeps keys rotated at their positions and records the positions
// for ALiBi, T5 and the window.
TEST_F(ModelConventionsTest, ForwardCachedAtPositionsEqualsForward) {
  const int64_t N = 2, L = 7, E = 16;
  auto positions =
      torch::tensor({3, 4, 5, 6, 7, 8, 9, 0, 2, 4, 6, 8, 10, 12}, torch::kLong)
          .view({N, L});
  torch::NoGradGuard no_grad;
  for (const auto& [name, options] : position_variants()) {
    SCOPED_TRACE(name);
    mha::MultiHeadAttention m(options);
    auto x = torch::randn({N, L, E});
    auto whole = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true,
                                        /*is_causal=*/true, positions));
    expect_hf_close(decode(m, x, positions, {}, 3), whole, "decoded");
    expect_hf_close(whole, forward_by_hand(m, x, positions, {}, true),
                    "forward");
  }
}

// A left-padded batch (prompts of 5, 3 and 1 tokens; HF's attention_mask
// with position_ids = cumsum(mask) - 1, pads at 0) decoded through ONE
// cache equals each sequence decoded alone without padding, step by step;
// the padded query rows are finite (out_proj.bias).
TEST_F(ModelConventionsTest, LeftPaddedBatchEqualsEachSequenceAlone) {
  const int64_t N = 3, P = 5, steps = 4, E = 16;
  const std::vector<int64_t> lengths = {5, 3, 1};
  auto keep = torch::ones({N, P + steps}, torch::kLong);
  for (int64_t n = 0; n < N; ++n) {
    keep[n].narrow(0, 0, P - lengths[n]).zero_();
  }
  auto positions = (keep.cumsum(1) - 1).masked_fill(keep.eq(0), 0);
  auto padding = keep.eq(0);
  torch::NoGradGuard no_grad;
  for (const auto& [name, options] : position_variants()) {
    SCOPED_TRACE(name);
    mha::MultiHeadAttention m(options);
    auto x = torch::randn({N, P + steps, E});
    auto batched = decode(m, x, positions, padding, P);  // (N, P+steps, E)
    EXPECT_TRUE(torch::isfinite(batched).all().item<bool>());
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pads = P - lengths[n];
      auto alone =
          decode(m, x[n].narrow(0, pads, lengths[n] + steps).unsqueeze(0), {},
                 {}, lengths[n]);  // (1, length+steps, E)
      expect_hf_close(batched[n].narrow(0, pads, lengths[n] + steps), alone[0],
                      "sequence " + std::to_string(n));
      for (int64_t t = 0; t < pads; ++t) {
        expect_close(batched[n][t], m->out_proj->bias, 1e-6, 0.0, "pad row");
      }
    }
  }
}

// "dynamic" and "longrope" read the largest position of each call: in
// cached decoding each step's query and keys are rotated with the
// frequencies of that step (1 + its largest position), the cached keys
// keep theirs, as transformers' DynamicCache. Checked against the loops,
// across max_position_embeddings (8) and original_max_position_embeddings.
TEST_F(ModelConventionsTest, SequenceLengthScalingsFollowEachCall) {
  const int64_t N = 2, L = 12, E = 16, prompt = 4;
  mha::RotaryScaling dynamic;
  dynamic.rope_type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.max_position_embeddings = 8;
  mha::RotaryScaling longrope;
  longrope.rope_type = "longrope";
  longrope.factor = 4.0;
  longrope.original_max_position_embeddings = 8;
  longrope.short_factor = {1.0, 1.5, 2.0, 3.0};
  longrope.long_factor = {1.0, 2.0, 4.0, 8.0};
  auto positions = torch::arange(L).unsqueeze(0).expand({N, L}).contiguous();
  positions[1] += 1;  // row 1 one ahead: the batch's largest position counts
  torch::NoGradGuard no_grad;
  for (const auto& scaling : {dynamic, longrope}) {
    SCOPED_TRACE(scaling.rope_type);
    mha::MultiHeadAttention m(
        mha::MultiHeadAttentionOptions(E, 2).rotary(true).rotary_scaling(
            scaling));
    auto x = torch::randn({N, L, E}, torch::kFloat64);
    m->to(torch::kFloat64);
    auto decoded = decode(m, x, positions, {}, prompt);
    // The loops: keys and queries of each call rotated with that call's
    // frequencies.
    auto qkv = project_by_hand(m, x);
    for (int64_t start = 0; start < L;) {
      const int64_t T = start == 0 ? prompt : 1;
      auto pos = positions.narrow(1, start, T);
      const auto f = frequencies_of(m, pos.max().item<int64_t>() + 1);
      for (int i = 0; i < 2; ++i) {
        qkv[i]
            .narrow(2, start, T)
            .copy_(rotate_by_hand(qkv[i].narrow(2, start, T).contiguous(), pos,
                                  f.inv_freq, f.attention_factor,
                                  mha::RotaryPairing::kHalf));
      }
      start += T;
    }
    auto expected = attend_by_hand(m, qkv[0], qkv[1], qkv[2], positions,
                                   positions, {}, true, 0);
    expect_close(decoded, expected, 1e-10, 1e-9, "decoded");
    // The scaled frequencies are really in use beyond 8.
    auto early = frequencies_of(m, 8).inv_freq;
    auto late = frequencies_of(m, L + 1).inv_freq;
    EXPECT_GT((early - late).abs().max().item<double>(), 1e-3);
  }
}

// The example of docs/decoding.md (the left-padded batch),
// copied verbatim: shapes, and the padded rows of the shorter prompt.
TEST_F(ModelConventionsTest, ReadmeExampleRuns) {
  // Two prompts of 3 and 1 tokens, left-padded to 3 (HF: attention_mask
  // [[1,1,1],[0,0,1]], position_ids = cumsum(mask) - 1 with pads at 0).
  mha::RotaryScaling llama3;
  llama3.rope_type = "llama3";
  llama3.factor = 8.0;
  llama3.original_max_position_embeddings = 8192;
  mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(64, 8)
                                   .rotary(true)
                                   .rotary_theta(500000.0)
                                   .num_kv_heads(2)
                                   .rotary_scaling(llama3));
  attn->eval();
  torch::NoGradGuard no_grad;
  auto keep = torch::tensor({1, 1, 1, 0, 0, 1}).view({2, 3});  // (N, P)
  auto positions = (keep.cumsum(1) - 1).masked_fill(keep.eq(0), 0);
  auto cache = attn->make_kv_cache(/*batch_size=*/2, /*capacity=*/64);
  auto prompt = torch::randn({2, 3, 64});
  auto [y, unused] = attn->forward_cached(prompt, cache, /*is_causal=*/true,
                                          /*need_weights=*/false, true,
                                          /*key_padding_mask=*/keep.eq(0),
                                          positions);  // (2, 3, 64)
  // One new token per sequence at the next position; no new padding.
  auto padding =
      torch::cat({keep.eq(0), torch::zeros({2, 1}, torch::kBool)}, 1);
  auto next_positions = positions.select(1, 2).unsqueeze(1) + 1;  // (2, 1)
  auto [z, unused2] = attn->forward_cached(torch::randn({2, 1, 64}), cache,
                                           true, false, true, padding,
                                           next_positions);  // (2, 1, 64)
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 3, 64}));
  EXPECT_EQ(z.sizes(), torch::IntArrayRef({2, 1, 64}));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  expect_close(y[1][0], attn->out_proj->bias, 1e-6, 0.0, "pad row 0");
  expect_close(y[1][1], attn->out_proj->bias, 1e-6, 0.0, "pad row 1");
  EXPECT_EQ(cache.size(), 4);
  (void)unused;
  (void)unused2;
}

// ---------------------------------------------------------- plumbing ---

TEST_F(ModelConventionsTest, KVCacheRecordsPositions) {
  mha::KVCache cache(2, 1, 6, 4);
  auto kv = torch::randn({2, 1, 2, 4});
  cache.append(kv, kv);
  EXPECT_TRUE(cache.positions_are_indices());
  EXPECT_TRUE(torch::equal(cache.positions(),
                           torch::tensor({0, 1, 0, 1}).view({2, 2})));
  cache.append(kv, kv, torch::tensor({7, 8, 3, 4}).view({2, 2}));
  EXPECT_FALSE(cache.positions_are_indices());
  EXPECT_TRUE(torch::equal(
      cache.positions(), torch::tensor({0, 1, 7, 8, 0, 1, 3, 4}).view({2, 4})));
  EXPECT_THROW_MSG(cache.append(kv, kv, torch::zeros({2, 3}, torch::kLong)),
                   "positions must be int64 (N, T) = (2, 2)");
  cache.clear();
  EXPECT_TRUE(cache.positions_are_indices());
  EXPECT_EQ(cache.positions().size(1), 0);
}

TEST_F(ModelConventionsTest, PrintsAndKeepsTheOptions) {
  mha::RotaryScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  yarn.original_max_position_embeddings = 16;
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(16, 2)
                                .rotary(true)
                                .rotary_dim(4)
                                .rotary_scaling(yarn));
  std::ostringstream printed;
  m->pretty_print(printed);
  EXPECT_EQ(printed.str(),
            "mha::MultiHeadAttention(embed_dim=16, num_heads=2, rotary=true, "
            "rotary_dim=4, rotary_scaling=yarn(factor=4))");
  auto copy =
      std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(m->clone());
  ASSERT_TRUE(copy);
  EXPECT_EQ(copy->options.rotary_dim(), c10::optional<int64_t>(4));
  EXPECT_EQ(copy->options.rotary_scaling().rope_type, "yarn");
  // positions is forward's argument 8: AnyModule passes it.
  torch::nn::AnyModule any(m);
  auto x = torch::randn({1, 3, 16});
  auto pos = torch::tensor({4, 5, 6});
  auto out = std::get<0>(any.forward<std::tuple<torch::Tensor, torch::Tensor>>(
      x, torch::Tensor(), torch::Tensor(), torch::Tensor(), true,
      torch::Tensor(), true, false, pos));
  EXPECT_TRUE(torch::equal(
      out, std::get<0>(m->forward(x, {}, {}, {}, true, {}, true, false, pos))));
}

TEST(ModelConventionsErrors, NameTheArgument) {
  using Options = mha::MultiHeadAttentionOptions;
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(Options(16, 2).rotary(true).rotary_dim(3)),
      "rotary_dim must be even with 2 <= rotary_dim <= head_dim "
      "= 8, but got 3");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(Options(16, 2).rotary(true).rotary_dim(10)),
      "head_dim = 8, but got 10");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(Options(16, 2).rotary_dim(4)),
                   "rotary_dim and rotary_scaling need rotary(true), but got "
                   "rotary_dim=4");
  mha::RotaryScaling unknown;
  unknown.rope_type = "ntk";
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          Options(16, 2).rotary(true).rotary_scaling(unknown)),
      "rotary_scaling.rope_type must be one of \"default\", \"linear\", "
      "\"dynamic\", \"yarn\", \"longrope\", \"llama3\", but got \"ntk\"");
  mha::RotaryScaling longrope;
  longrope.rope_type = "longrope";
  longrope.original_max_position_embeddings = 16;
  longrope.short_factor = {1.0, 1.0};
  longrope.long_factor = {1.0, 1.0, 1.0, 1.0};
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          Options(16, 2).rotary(true).rotary_scaling(longrope)),
      "short_factor and long_factor must have rotary_dim / 2 = 4 entries, but "
      "have 2 and 4");
  mha::RotaryScaling yarn;
  yarn.rope_type = "yarn";
  yarn.factor = 4.0;
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(Options(16, 2).rotary(true).rotary_scaling(yarn)),
      "needs original_max_position_embeddings or max_position_embeddings > 0");
  mha::RotaryScaling linear;
  linear.rope_type = "linear";
  linear.factor = 2.0;
  linear.attention_factor = 1.5;
  EXPECT_THROW_MSG(mha::MultiHeadAttention(
                       Options(16, 2).rotary(true).rotary_scaling(linear)),
                   "is read by rope_type \"yarn\" and \"longrope\" only");

  mha::MultiHeadAttention m(Options(16, 2).rotary(true));
  auto x = torch::randn({2, 5, 16});
  EXPECT_THROW_MSG(m->forward(x, {}, {}, {}, true, {}, true, false,
                              torch::arange(5).to(torch::kInt)),
                   "positions must be int64, but got dtype Int");
  EXPECT_THROW_MSG(m->forward(x, {}, {}, {}, true, {}, true, false,
                              torch::zeros({2, 4}, torch::kLong)),
                   "positions must be (N, L) = (2, 5) or (L) = (5) for query's "
                   "N and L (the new tokens), but got [2, 4]");
  EXPECT_THROW_MSG(m->forward(x, x.clone(), x.clone(), {}, true, {}, true,
                              false, torch::arange(5)),
                   "positions is for self-attention");
  auto cache = m->make_kv_cache(2, 8);
  m->forward_cached(x.narrow(1, 0, 3), cache);
  EXPECT_THROW_MSG(
      m->forward_cached(x.narrow(1, 0, 1), cache, true, false, true,
                        torch::zeros({2, 3}, torch::kBool)),
      "key_padding_mask must be (N, cache length + T) = (2, 4) over the "
      "cached and the new tokens, but got [2, 3]");
  EXPECT_THROW_MSG(
      m->forward_cached(x.narrow(1, 0, 1), cache, true, false, true, {},
                        torch::zeros({2, 2}, torch::kLong)),
      "MultiHeadAttention::forward_cached: positions must be (N, L) = (2, 1)");
  EXPECT_THROW_MSG(
      m->forward_cached(x.narrow(1, 0, 1), cache, true, false, true,
                        torch::zeros({2, 4}, torch::kLong)),
      "key_padding_mask must be bool (true = blocked) or floating");
}

}  // namespace
