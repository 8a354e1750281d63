// Tests of linear-cost attention (mha/linear_attention.h and
// MultiHeadAttention's attention_kind kLinear, kPerformer, kLinformer)
// against float64 references written straight from the papers' equations
// in their dense O(L·S) form: linear attention's eq. 4-6 with the causal
// mask (Katharopoulos et al., 2020), FAVOR+'s kernel estimate (Choromanski
// et al., 2021) against exp(q·k / sqrt(D)), Linformer's eq. 7 (Wang et al.,
// 2020) against softmax attention; decoding with the constant-size state
// against the causal forward; the state dict; the errors.
//
// Glossary: N batch, L query length, S key length, E embed_dim, H heads,
// Hkv key/value heads, D head_dim, F features, m random features.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/linear_attention_core.h"
#include "fixture_helpers.h"
#include "mha/linear_attention.h"
#include "mha/multi_head_attention.h"
#include "mha/positions.h"
#include "mha/state_dict.h"
#include "mha/transformer.h"
#include "mha/weights.h"
#include "test_helpers.h"

namespace {

using mha::AttentionKind;

class LinearAttentionTest : public SeededTest {};
class LinearAttentionModuleTest : public SeededTest {};
class LinearAttentionDecodingTest : public SeededTest {};
class LinearAttentionPerformerTest : public SeededTest {};
class LinearAttentionLinformerTest : public SeededTest {};

const auto kDouble = torch::TensorOptions().dtype(torch::kFloat64);

/// Linear attention in its dense form (Katharopoulos et al., eq. 4 with
/// sim(q, k) = φ(q)ᵀφ(k)): A = φ(Q) φ(K)ᵀ (..., L, S), times key_weight
/// (broadcastable to (..., L, S)) when given, causal: A_ij = 0 for j > i;
/// out = A V / rowsum(A), 0 where the row sum is 0.
torch::Tensor dense_linear(const torch::Tensor& phi_q,
                           const torch::Tensor& phi_k, const torch::Tensor& v,
                           bool causal, const torch::Tensor& key_weight = {}) {
  auto a = torch::matmul(phi_q, phi_k.transpose(-2, -1));  // (..., L, S)
  if (key_weight.defined()) {
    a = a * key_weight;
  }
  if (causal) {
    a = a.masked_fill(
        torch::ones({a.size(-2), a.size(-1)}, torch::kBool).triu(1), 0.0);
  }
  auto den = a.sum(-1, true);
  return torch::where(den == 0, torch::zeros_like(den),
                      torch::matmul(a, v) / den);
}

/// softmax(Q Kᵀ · scale + mask) V in float64, the plain formula.
torch::Tensor dense_softmax(const torch::Tensor& q, const torch::Tensor& k,
                            const torch::Tensor& v, double scale,
                            bool causal = false) {
  auto s = torch::matmul(q, k.transpose(-2, -1)) * scale;  // (..., L, S)
  if (causal) {
    s = s.masked_fill(
        torch::ones({s.size(-2), s.size(-1)}, torch::kBool).triu(1), -kInf);
  }
  return torch::matmul(torch::softmax(s, -1), v);
}

/// The FAVOR+ attention estimate in float64, computed stably from the
/// exponents (Choromanski et al., lemma 1): log A_ij = logsumexp_f(
/// a_q[i, f] + a_k[j, f]) with a(x) = w_fᵀ x - |x|²/2 - log(m)/2 of x
/// scaled by `root`; out = softmax_j(log A_ij, blocked -inf) V.
/// blocked: bool broadcastable to (..., L, S), true = blocked; or undefined.
torch::Tensor dense_favor(const torch::Tensor& q, const torch::Tensor& k,
                          const torch::Tensor& v, const torch::Tensor& w,
                          double root, bool causal,
                          const torch::Tensor& blocked = {}) {
  const auto exponents = [&](const torch::Tensor& x) {
    auto xs = x * root;
    return torch::matmul(xs, w.t()) - xs.square().sum(-1, true) / 2 -
           0.5 * std::log(static_cast<double>(w.size(0)));  // (..., T, m)
  };
  auto aq = exponents(q).unsqueeze(-2);        // (..., L, 1, m)
  auto ak = exponents(k).unsqueeze(-3);        // (..., 1, S, m)
  auto log_a = torch::logsumexp(aq + ak, -1);  // (..., L, S)
  if (causal) {
    log_a = log_a.masked_fill(
        torch::ones({log_a.size(-2), log_a.size(-1)}, torch::kBool).triu(1),
        -kInf);
  }
  if (blocked.defined()) {
    log_a = log_a.masked_fill(blocked, -kInf);
  }
  return torch::matmul(torch::softmax(log_a, -1), v);
}

/// A module's projections of batch-first (N, L, E) inputs, split in heads,
/// from its parameters (packed in_proj_weight, bias).
struct Heads {
  torch::Tensor q, k, v;  // (N, H, L, D), (N, Hkv, S, D), (N, Hkv, S, D)
};
Heads project_heads(const mha::MultiHeadAttention& m, const torch::Tensor& x,
                    const torch::Tensor& kv_input = {}) {
  const auto E = m->options.embed_dim();
  const auto H = m->options.num_heads();
  const auto Hkv = m->num_kv_heads();
  const auto D = m->head_dim;
  const auto& kin = kv_input.defined() ? kv_input : x;
  torch::Tensor wq, wk, wv, bq, bk, bv;
  if (m->packed_in_proj()) {
    wq = m->in_proj_weight.narrow(0, 0, E);
    wk = m->in_proj_weight.narrow(0, E, E);
    wv = m->in_proj_weight.narrow(0, 2 * E, E);
  } else {
    wq = m->q_proj_weight;
    wk = m->k_proj_weight;
    wv = m->v_proj_weight;
  }
  const auto Ekv = Hkv * D;
  bq = m->in_proj_bias.narrow(0, 0, E);
  bk = m->in_proj_bias.narrow(0, E, Ekv);
  bv = m->in_proj_bias.narrow(0, E + Ekv, Ekv);
  const auto split = [](const torch::Tensor& t, int64_t heads) {
    return t.view({t.size(0), t.size(1), heads, -1}).transpose(1, 2);
  };
  return {split(torch::matmul(x, wq.t()) + bq, H),
          split(torch::matmul(kin, wk.t()) + bk, Hkv),
          split(torch::matmul(kin, wv.t()) + bv, Hkv)};
}

/// out_proj of heads (N, H, L, D): (N, L, E).
torch::Tensor merge_and_project(const mha::MultiHeadAttention& m,
                                const torch::Tensor& heads) {
  auto merged = heads.transpose(1, 2).reshape(
      {heads.size(0), heads.size(2), -1});  // (N, L, E)
  return torch::matmul(merged, m->out_proj->weight.t()) + m->out_proj->bias;
}

/// k or v (N, Hkv, S, D) repeated to the H query heads.
torch::Tensor to_query_heads(const torch::Tensor& x, int64_t H) {
  return x.repeat_interleave(H / x.size(1), 1);
}

/// Random biases so that the references check them too.
void randomize_biases(mha::MultiHeadAttention& m) {
  torch::NoGradGuard no_grad;
  m->in_proj_bias.normal_(0, 0.2);
  m->out_proj->bias.normal_(0, 0.2);
}

mha::MultiHeadAttention make(const mha::MultiHeadAttentionOptions& options,
                             torch::ScalarType dtype = torch::kFloat64) {
  mha::MultiHeadAttention m(options);
  m->to(dtype);
  randomize_biases(m);
  m->eval();
  return m;
}

// ---------------------------------------------------------------------------
// mha::linear_attention

// Non-causal: φ(Q)(φ(K)ᵀV) / (φ(Q)·Σφ(K)) equals the dense form, with
// L != S, Dv != D and broadcast leading dims.
TEST_F(LinearAttentionTest, NonCausalEqualsDenseForm) {
  auto q = torch::randn({2, 3, 37, 8}, kDouble);
  auto k = torch::randn({2, 3, 29, 8}, kDouble);
  auto v = torch::randn({2, 3, 29, 5}, kDouble);
  auto out = mha::linear_attention(q, k, v);
  expect_close(
      out,
      dense_linear(mha::elu_feature_map(q), mha::elu_feature_map(k), v, false),
      1e-12, 0, "non-causal");
  // Key and value shared over the heads (broadcast leading dims).
  auto k1 = k.narrow(1, 0, 1), v1 = v.narrow(1, 0, 1);
  expect_close(mha::linear_attention(q, k1, v1),
               dense_linear(mha::elu_feature_map(q), mha::elu_feature_map(k1),
                            v1, false),
               1e-12, 0, "broadcast");
}

// Causal: the blockwise prefix sums equal the masked dense form, for
// lengths below, at and across block boundaries, L != S both ways, and a
// feature map of more features (F = 80).
TEST_F(LinearAttentionTest, CausalPrefixSumsEqualMaskedDenseForm) {
  const std::vector<std::pair<int64_t, int64_t>> lengths = {
      {1, 1}, {63, 63}, {64, 64}, {65, 65}, {200, 200}, {150, 90}, {70, 130}};
  for (const auto& [L, S] : lengths) {
    SCOPED_TRACE("L=" + std::to_string(L) + " S=" + std::to_string(S));
    auto q = torch::randn({2, 2, L, 8}, kDouble);
    auto k = torch::randn({2, 2, S, 8}, kDouble);
    auto v = torch::randn({2, 2, S, 6}, kDouble);
    auto expected =
        dense_linear(mha::elu_feature_map(q), mha::elu_feature_map(k), v, true);
    expect_close(mha::linear_attention(q, k, v, /*is_causal=*/true), expected,
                 1e-11, 0, "float64");
    // float32 against the float64 reference.
    expect_close(
        mha::linear_attention(q.to(torch::kFloat32), k.to(torch::kFloat32),
                              v.to(torch::kFloat32), true),
        expected, 1e-5, 1e-4, "float32");
  }
  // A wider feature map: [relu(x), relu(-x)] + 0.1, repeated to F = 80.
  mha::FeatureMap wide = [](const torch::Tensor& x) {
    auto f = torch::cat({torch::relu(x), torch::relu(-x)}, -1) + 0.1;
    return torch::cat({f, f, f, f, f}, -1);  // (..., T, 10 D) = 80
  };
  auto q = torch::randn({1, 3, 300, 8}, kDouble);
  auto k = torch::randn({1, 3, 300, 8}, kDouble);
  auto v = torch::randn({1, 3, 300, 8}, kDouble);
  expect_close(mha::linear_attention(q, k, v, true, wide),
               dense_linear(wide(q), wide(k), v, true), 1e-11, 0, "F=80");
  expect_close(mha::linear_attention(q, k, v, false, wide),
               dense_linear(wide(q), wide(k), v, false), 1e-11, 0,
               "F=80 non-causal");
}

// Gradients of query, key and value through the blocked causal form equal
// those of the dense form.
TEST_F(LinearAttentionTest, GradientsEqualDenseForm) {
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    auto q = torch::randn({2, 2, 150, 8}, kDouble).requires_grad_();
    auto k = torch::randn({2, 2, 150, 8}, kDouble).requires_grad_();
    auto v = torch::randn({2, 2, 150, 4}, kDouble).requires_grad_();
    auto g = torch::randn({2, 2, 150, 4}, kDouble);
    auto grads = torch::autograd::grad(
        {(mha::linear_attention(q, k, v, causal) * g).sum()}, {q, k, v});
    auto expected = torch::autograd::grad(
        {(dense_linear(mha::elu_feature_map(q), mha::elu_feature_map(k), v,
                       causal) *
          g)
             .sum()},
        {q, k, v});
    for (size_t i = 0; i < 3; ++i) {
      expect_close(grads[i], expected[i], 1e-10, 0,
                   "gradient " + std::to_string(i));
    }
  }
}

// A causal query row that sees no key (S = 0, or rows past a shorter key
// sequence seeing zero-feature keys) gets 0, never NaN; its gradient too.
TEST_F(LinearAttentionTest, RowsWithoutKeysGiveZero) {
  auto q = torch::randn({1, 4, 8}, kDouble).requires_grad_();
  auto k = torch::randn({1, 0, 8}, kDouble);
  auto v = torch::randn({1, 0, 3}, kDouble);
  for (bool causal : {false, true}) {
    auto out = mha::linear_attention(q, k, v, causal);
    EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 4, 3}));
    EXPECT_TRUE(torch::equal(out, torch::zeros_like(out)));
  }
  // A feature map that is 0 on some keys: rows whose keys are all 0 get 0.
  mha::FeatureMap relu = [](const torch::Tensor& x) { return torch::relu(x); };
  auto kk = -torch::rand({1, 6, 8}, kDouble);  // relu(k) = 0 everywhere
  auto vv = torch::randn({1, 6, 3}, kDouble);
  auto out = mha::linear_attention(q, kk, vv, true, relu);
  EXPECT_TRUE(torch::equal(out, torch::zeros_like(out)));
  auto grad = torch::autograd::grad({out.sum()}, {q})[0];
  EXPECT_TRUE(torch::isfinite(grad).all().item<bool>());
}

TEST_F(LinearAttentionTest, ErrorsNameTheArgument) {
  auto q = torch::randn({2, 5, 8});
  auto k = torch::randn({2, 7, 8});
  auto v = torch::randn({2, 7, 4});
  EXPECT_THROW_MSG(mha::linear_attention(torch::randn({8}), k, v),
                   "need at least 2 dims, but got query [8]");
  EXPECT_THROW_MSG(mha::linear_attention(q, torch::randn({2, 7, 6}), v),
                   "key must have query's D = 8 features in its last dim, but "
                   "got query [2, 5, 8] and key [2, 7, 6]");
  EXPECT_THROW_MSG(mha::linear_attention(q, k, torch::randn({2, 6, 4})),
                   "value must have key's length S = 7, but got key [2, 7, 8] "
                   "and value [2, 6, 4]");
  EXPECT_THROW_MSG(mha::linear_attention(q, k.to(torch::kFloat64), v),
                   "must share one floating dtype, but got Float, Double, "
                   "Float");
  EXPECT_THROW_MSG(mha::linear_attention(q, torch::randn({3, 7, 8}),
                                         torch::randn({3, 7, 4})),
                   "the leading dims of query, key and value must broadcast, "
                   "but got query [2, 5, 8], key [3, 7, 8]");
  mha::FeatureMap bad = [](const torch::Tensor& x) { return x.sum(-2); };
  EXPECT_THROW_MSG(
      mha::linear_attention(q, k, v, false, bad),
      "feature_map must map query (..., T, D) to (..., T, F) of "
      "its dtype and device, but mapped [2, 5, 8] Float to [2, 8]");
}

// ---------------------------------------------------------------------------
// FAVOR+

// Orthogonal random features: blocks of head_dim mutually orthogonal rows
// (the last block truncated), norms of Gaussian vectors (not all equal),
// the same features for the same seed on any dtype, other ones for another.
TEST_F(LinearAttentionPerformerTest, OrthogonalRandomFeatures) {
  const int64_t m = 40, d = 16;
  auto w = mha::orthogonal_random_features(m, d, /*seed=*/7, kDouble);
  ASSERT_EQ(w.sizes(), (std::vector<int64_t>{m, d}));
  for (int64_t start = 0; start < m; start += d) {
    auto block = w.narrow(0, start, std::min(d, m - start));
    auto unit = block / block.norm(2, {1}, true);
    auto gram = torch::matmul(unit, unit.t());
    expect_close(gram, torch::eye(block.size(0), kDouble), 1e-12, 0,
                 "block at " + std::to_string(start));
  }
  auto norms = w.norm(2, {1});
  EXPECT_GT((norms.max() - norms.min()).item<double>(), 0.5);
  EXPECT_TRUE(
      torch::equal(w, mha::orthogonal_random_features(m, d, 7, kDouble)));
  EXPECT_TRUE(torch::allclose(
      mha::orthogonal_random_features(m, d, 7).to(torch::kFloat64), w, 1e-6,
      1e-6));
  EXPECT_EQ(mha::orthogonal_random_features(m, d, 7).scalar_type(),
            torch::kFloat32);
  EXPECT_FALSE(
      torch::allclose(w, mha::orthogonal_random_features(m, d, 8, kDouble)));
  EXPECT_THROW_MSG(mha::orthogonal_random_features(0, d, 0),
                   "nb_features and dim must be >= 1, but got nb_features=0");
}

// The kernel estimate is unbiased (Choromanski et al., lemma 1): the mean
// over 2000 seeds of φ(q)ᵀφ(k) equals exp(q·k / sqrt(D)) within 4
// standard errors of the mean (estimated from the same samples) for every
// pair. The check can fail: rows of fixed norm sqrt(D) instead of Gaussian
// norms (a common "regularized" variant) give a biased estimate, which it
// rejects (here by more than 20 standard errors).
TEST_F(LinearAttentionPerformerTest, KernelEstimateIsUnbiased) {
  const int64_t D = 16, m = 32, seeds = 2000;
  const double root = std::pow(static_cast<double>(D), -0.25);
  auto q = torch::randn({6, D}, kDouble) * 0.7;
  auto k = torch::randn({5, D}, kDouble) * 0.7;
  auto exact = torch::exp(torch::matmul(q, k.t()) / std::sqrt(D));  // (6, 5)
  const auto deviation_in_errors = [&](bool fixed_norms) {
    std::vector<torch::Tensor> samples;
    for (int64_t seed = 0; seed < seeds; ++seed) {
      auto w = mha::orthogonal_random_features(m, D, seed, kDouble);
      if (fixed_norms) {
        w = w / w.norm(2, {1}, true) * std::sqrt(static_cast<double>(D));
      }
      samples.push_back(torch::matmul(mha::favor_features(q * root, w),
                                      mha::favor_features(k * root, w).t()));
    }
    auto all = torch::stack(samples);  // (seeds, 6, 5)
    auto standard_error = all.std(0) / std::sqrt(static_cast<double>(seeds));
    return ((all.mean(0) - exact).abs() / standard_error).max().item<double>();
  };
  EXPECT_LT(deviation_in_errors(false), 4.0);
  EXPECT_GT(deviation_in_errors(true), 20.0);
}

// The attention estimate converges to softmax attention as m grows: the
// mean error over 16 seeds falls at each step m = 16, 64, 256, 1024 (to
// below 0.7 of the step before; 1/sqrt(m) gives 0.5) and is below 0.015
// at m = 1024; the ratio's bias (the error of the mean over seeds) is
// below 0.005 there.
TEST_F(LinearAttentionPerformerTest, EstimateConvergesWithFeatures) {
  const int64_t D = 16, seeds = 16;
  const double root = std::pow(static_cast<double>(D), -0.25);
  auto q = torch::randn({2, 40, D}, kDouble) * 0.5;
  auto k = torch::randn({2, 40, D}, kDouble) * 0.5;
  auto v = torch::randn({2, 40, D}, kDouble);
  auto exact = dense_softmax(q, k, v, 1.0 / std::sqrt(D));
  double previous = 0, bias = 0;
  for (int64_t m : {16, 64, 256, 1024}) {
    double error = 0;
    torch::Tensor sum;
    for (int64_t seed = 0; seed < seeds; ++seed) {
      auto w = mha::orthogonal_random_features(m, D, seed, kDouble);
      auto phi = [w](const torch::Tensor& x) {
        return mha::favor_features(x, w);
      };
      auto out = mha::linear_attention(q * root, k * root, v, false, phi);
      error += (out - exact).abs().mean().item<double>() / seeds;
      sum = sum.defined() ? sum + out : out;
    }
    SCOPED_TRACE("m=" + std::to_string(m));
    if (previous > 0) {
      EXPECT_LT(error, 0.7 * previous);
    }
    previous = error;
    bias = (sum / seeds - exact).abs().mean().item<double>();
  }
  EXPECT_LT(previous, 0.015);
  EXPECT_LT(bias, 0.005);
}

// The module's kPerformer equals the dense FAVOR+ estimate from its own
// random_features and projections (float64), causal and not, with grouped
// heads, a key padding mask and a non-default scale; float32 against it.
TEST_F(LinearAttentionPerformerTest, ModuleEqualsDenseEstimate) {
  const int64_t N = 2, L = 90, E = 32, H = 4;
  for (int64_t Hkv : {4, 2}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("Hkv=" + std::to_string(Hkv) +
                   (causal ? " causal" : " non-causal"));
      auto options = mha::MultiHeadAttentionOptions(E, H)
                         .attention_kind(AttentionKind::kPerformer)
                         .nb_features(24)
                         .feature_seed(3)
                         .scale(0.2);
      if (Hkv != H) {
        options.num_kv_heads(Hkv);
      }
      auto m = make(options);
      auto x = torch::randn({N, L, E}, kDouble);
      auto pad = torch::zeros({N, L}, torch::kBool);
      pad.index_put_({1, torch::indexing::Slice(70, L)}, true);
      auto out = std::get<0>(
          m->forward(x, {}, {}, pad, /*need_weights=*/false, {}, true, causal));
      auto h = project_heads(m, x);
      auto heads = dense_favor(h.q, to_query_heads(h.k, H),
                               to_query_heads(h.v, H), m->random_features,
                               std::sqrt(0.2), causal, pad.view({N, 1, 1, L}));
      auto expected = merge_and_project(m, heads);
      expect_close(out, expected, 1e-10, 0, "float64");
      auto m32 = mha::MultiHeadAttention(options);
      m32->to(torch::kFloat32);
      {
        torch::NoGradGuard no_grad;
        for (auto& p : m32->named_parameters()) {
          p.value().copy_(m->named_parameters()[p.key()]);
        }
      }
      auto out32 = std::get<0>(m32->forward(x.to(torch::kFloat32), {}, {}, pad,
                                            false, {}, true, causal));
      expect_close(out32, expected, 1e-4, 1e-4, "float32");
    }
  }
}

// Past 16 blocks of 64 rows the causal form runs group after group of
// blocks, the sums carried between them: values and gradients across the
// group boundary (L = 1100: groups of 1024 and 76 rows) equal the
// dense forms, for plain features (linear attention) and log features
// (the Performer module, with a padded tail).
TEST_F(LinearAttentionPerformerTest, CausalFormAcrossGroupsOfBlocks) {
  const int64_t L = 1100;
  auto q = torch::randn({1, 2, L, 4}, kDouble).requires_grad_();
  auto k = torch::randn({1, 2, L, 4}, kDouble).requires_grad_();
  auto v = torch::randn({1, 2, L, 3}, kDouble).requires_grad_();
  auto g = torch::randn({1, 2, L, 3}, kDouble);
  auto out = mha::linear_attention(q, k, v, /*is_causal=*/true);
  auto expected =
      dense_linear(mha::elu_feature_map(q), mha::elu_feature_map(k), v, true);
  expect_close(out, expected, 1e-11, 0, "linear, L=1100");
  auto grads = torch::autograd::grad({(out * g).sum()}, {q, k, v});
  auto expected_grads =
      torch::autograd::grad({(expected * g).sum()}, {q, k, v});
  for (size_t i = 0; i < 3; ++i) {
    expect_close(grads[i], expected_grads[i], 1e-10, 0,
                 "linear gradient " + std::to_string(i));
  }

  const int64_t N = 2, E = 8, H = 2;
  auto m = make(mha::MultiHeadAttentionOptions(E, H)
                    .attention_kind(AttentionKind::kPerformer)
                    .nb_features(6)
                    .feature_seed(5));
  auto x = torch::randn({N, L, E}, kDouble);
  auto pad = torch::zeros({N, L}, torch::kBool);
  pad.index_put_({1, torch::indexing::Slice(1050, L)}, true);
  auto performer = std::get<0>(
      m->forward(x, {}, {}, pad, /*need_weights=*/false, {}, true, true));
  auto h = project_heads(m, x);
  auto heads = dense_favor(
      h.q, to_query_heads(h.k, H), to_query_heads(h.v, H), m->random_features,
      std::sqrt(1.0 / std::sqrt(static_cast<double>(E / H))), true,
      pad.view({N, 1, 1, L}));
  expect_close(performer, merge_and_project(m, heads), 1e-10, 0,
               "performer, L=1100");
}

// The CPU's walk (causal_products, one head per thread) and the ATen form
// (every block's sums as batched tensors) are two computations of one
// thing: equal in float64 in values, the sums after and the gradients
// (of the features, the values and the starting sums, from a loss of the
// rows and the sums after), with
// plain and log features, starting sums or none, a partial last block,
// keys shared by two query heads, one row and blocks longer than T.
TEST_F(LinearAttentionPerformerTest, WalkEqualsBatchedForm) {
  using mha::detail::Features;
  using mha::detail::LinearSums;
  for (const int64_t T : {150, 1, 40}) {
    for (const bool log : {false, true}) {
      for (const bool with_sums : {false, true}) {
        const auto what = "T=" + std::to_string(T) + (log ? " log" : " plain") +
                          (with_sums ? " with sums" : "");
        // Queries (2, 2, G = 2, T, F), keys (2, 2, 1, T, F).
        auto x_q = torch::randn({2, 2, 2, T, 5}, kDouble) * 2;
        auto x_k = torch::randn({2, 2, 1, T, 5}, kDouble) * 2;
        auto v = torch::randn({2, 2, 1, T, 4}, kDouble).requires_grad_();
        auto q = (log ? x_q : mha::elu_feature_map(x_q)).requires_grad_();
        auto k = (log ? x_k : mha::elu_feature_map(x_k)).requires_grad_();
        LinearSums sums;
        if (with_sums) {
          auto before = torch::randn({2, 2, 1, 7, 5}, kDouble) * 2;
          sums = mha::detail::add_keys(
              {}, {log ? before : mha::elu_feature_map(before), log},
              torch::randn({2, 2, 1, 7, 4}, kDouble));
          // Leaves: the gradients of the starting sums are compared too.
          sums.kv = sums.kv.detach().requires_grad_();
          sums.k = sums.k.detach().requires_grad_();
        }
        const int64_t block = T == 40 ? 64 : 16;
        LinearSums walk_sums, aten_sums;
        auto walk = mha::detail::causal_linear_attention(
            {q, log}, {k, log}, v, sums, block, &walk_sums);
        auto aten = mha::detail::causal_linear_attention_aten(
            {q, log}, {k, log}, v, sums, block, &aten_sums);
        expect_close(walk, aten, 1e-12, 1e-12, what);
        expect_close(walk_sums.kv, aten_sums.kv, 1e-12, 1e-12, what + " kv");
        expect_close(walk_sums.k, aten_sums.k, 1e-12, 1e-12, what + " k");
        if (log) {
          expect_close(walk_sums.offset, aten_sums.offset, 0, 0,
                       what + " offset");
        }
        // A loss of the rows and of the sums after (as the segment before
        // another one when training by segments).
        auto g = torch::randn_like(walk);
        auto g_kv = torch::randn_like(walk_sums.kv);
        auto g_k = torch::randn_like(walk_sums.k);
        const auto loss = [&](const torch::Tensor& out, const LinearSums& s) {
          return (out * g).sum() + (s.kv * g_kv).sum() + (s.k * g_k).sum();
        };
        std::vector<torch::Tensor> inputs{q, k, v};
        if (with_sums) {
          inputs.insert(inputs.end(), {sums.kv, sums.k});
        }
        auto walk_grads =
            torch::autograd::grad({loss(walk, walk_sums)}, inputs);
        auto aten_grads =
            torch::autograd::grad({loss(aten, aten_sums)}, inputs);
        for (size_t i = 0; i < inputs.size(); ++i) {
          expect_close(walk_grads[i], aten_grads[i], 1e-12, 1e-11,
                       what + " gradient " + std::to_string(i));
        }
      }
    }
  }
}

// The walk's backward gives first derivatives only: create_graph through it
// is an error that says so, not a silently missing second derivative.
TEST_F(LinearAttentionTest, SecondDerivativeOfCausalFormIsAnError) {
  auto q = torch::randn({1, 2, 10, 4}, kDouble).requires_grad_();
  auto k = torch::randn({1, 2, 10, 4}, kDouble);
  auto v = torch::randn({1, 2, 10, 3}, kDouble);
  auto out = mha::linear_attention(q, k, v, /*is_causal=*/true);
  EXPECT_THROW_MSG(torch::autograd::grad({out.sum()}, {q}, {},
                                         /*retain_graph=*/true,
                                         /*create_graph=*/true),
                   "first derivatives only");
  // Without create_graph: the gradient, as the dense form's.
  auto grad = torch::autograd::grad({out.sum()}, {q})[0];
  auto dense_q = q.detach().requires_grad_();
  auto dense = dense_linear(mha::elu_feature_map(dense_q),
                            mha::elu_feature_map(k), v, true);
  expect_close(grad, torch::autograd::grad({dense.sum()}, {dense_q})[0], 1e-11,
               0, "first derivative");
}

// Inputs of large norm keep FAVOR+ in range. With the heads' norms ~ 90
// (scores q·k / sqrt(D) up to ~4400) the exponents (about -|k|²/2)
// underflow exp in float32, so the plain features (favor_features through
// linear_attention) give no answer, but the module shifts each feature's
// exponents by constants that cancel and matches the float64 estimate
// computed in log space, non-causal and decoding token by token. The
// causal forward shifts per block of rows, which holds while the scores in
// a block stay within ~170 of each other in float32: checked at norms ~ 18
// (scores up to ~180).
TEST_F(LinearAttentionPerformerTest, LargeInputsStayInRange) {
  const int64_t N = 1, L = 150, E = 16, H = 1;
  auto options = mha::MultiHeadAttentionOptions(E, H)
                     .attention_kind(AttentionKind::kPerformer)
                     .nb_features(32);
  const double root = std::pow(16.0, -0.25);
  auto x = torch::randn({N, L, E});
  for (double factor : {40.0, 8.0}) {
    SCOPED_TRACE("projections x" + std::to_string(factor));
    auto m = make(options, torch::kFloat32);
    auto m64 = make(options);
    {
      torch::NoGradGuard no_grad;
      m->in_proj_weight.mul_(factor);
      for (auto& p : m64->named_parameters()) {
        p.value().copy_(m->named_parameters()[p.key()]);
      }
    }
    auto h = project_heads(m, x);
    auto w = m->random_features;
    if (factor == 40.0) {
      EXPECT_EQ(mha::favor_features(h.k * root, w).max().item<float>(), 0.0f)
          << "the check needs underflow";
      auto plain = mha::linear_attention(
          h.q * root, h.k * root, h.v, false,
          [w](const torch::Tensor& t) { return mha::favor_features(t, w); });
      EXPECT_EQ(plain.abs().max().item<float>(), 0.0f);
    }
    auto h64 = project_heads(m64, x.to(torch::kFloat64));
    torch::NoGradGuard no_grad;
    for (bool causal : {false, true}) {
      auto expected = merge_and_project(
          m64,
          dense_favor(h64.q, h64.k, h64.v,
                      m64->random_features.to(torch::kFloat64), root, causal));
      if (!causal || factor == 8.0) {
        auto out =
            std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, causal));
        ASSERT_TRUE(torch::isfinite(out).all().item<bool>());
        expect_close(out, expected, 2e-3, 2e-3,
                     causal ? "causal" : "non-causal");
      }
      if (causal) {
        auto cache = m->make_kv_cache(N, L);
        for (int64_t t = 0; t < L; ++t) {
          auto step = std::get<0>(m->forward_cached(x.narrow(1, t, 1), cache));
          expect_close(step, expected.narrow(1, t, 1), 2e-3, 2e-3,
                       "step " + std::to_string(t));
        }
      }
    }
  }
}

// The features are a buffer: in the state dict (saved and loaded with the
// file), kept by clone() and to(); redraw_features draws others (and
// records the seed), the same seed the same ones.
TEST_F(LinearAttentionPerformerTest, FeaturesAreSavedAndRedrawnOnRequest) {
  auto options = mha::MultiHeadAttentionOptions(16, 2)
                     .attention_kind(AttentionKind::kPerformer)
                     .feature_seed(11);
  mha::MultiHeadAttention m(options);
  m->eval();
  const int64_t expected_m = std::llround(8 * std::log(8.0));  // 17
  ASSERT_EQ(m->random_features.sizes(), (std::vector<int64_t>{expected_m, 8}));
  EXPECT_TRUE(torch::equal(m->random_features,
                           mha::orthogonal_random_features(expected_m, 8, 11)));
  auto buffers = m->named_buffers();
  ASSERT_TRUE(buffers.contains("random_features"));
  auto x = torch::randn({2, 9, 16});
  auto out = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));

  const auto dir = fixtures::temp_dir("linear");
  for (const char* name : {"p.safetensors", "p.pt"}) {
    const auto path = dir + "/" + name;
    mha::save_state_dict(*m, path);
    mha::MultiHeadAttention loaded(
        mha::MultiHeadAttentionOptions(options).feature_seed(99));
    loaded->eval();
    EXPECT_FALSE(torch::equal(loaded->random_features, m->random_features));
    mha::load_state_dict(*loaded, path);
    EXPECT_TRUE(torch::equal(loaded->random_features, m->random_features));
    EXPECT_TRUE(torch::equal(
        std::get<0>(loaded->forward(x, {}, {}, {}, false, {}, true, true)),
        out))
        << name;
  }

  auto copy =
      std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(m->clone());
  EXPECT_TRUE(torch::equal(copy->random_features, m->random_features));
  m->redraw_features(12);
  EXPECT_EQ(m->options.feature_seed(), 12u);
  EXPECT_FALSE(torch::equal(copy->random_features, m->random_features));
  EXPECT_FALSE(torch::allclose(
      std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true)), out));
  m->redraw_features(11);
  EXPECT_TRUE(torch::equal(copy->random_features, m->random_features));
  m->to(torch::kFloat64);
  EXPECT_EQ(m->random_features.scalar_type(), torch::kFloat64);
  EXPECT_EQ(m->named_buffers()["random_features"].scalar_type(),
            torch::kFloat64);
  mha::MultiHeadAttention softmax(16, 2);
  EXPECT_THROW_MSG(softmax->redraw_features(1),
                   "attention_kind must be kPerformer, but is kSoftmax");
}

// ---------------------------------------------------------------------------
// The module: kLinear

// kLinear equals the dense form on the module's own projections, causal
// and not, with grouped heads, a bool and a float key padding mask (key j
// times exp(mask_j)), cross-attention, and both layouts.
TEST_F(LinearAttentionModuleTest, LinearEqualsDenseForm) {
  const int64_t N = 2, L = 70, S = 70, E = 24, H = 4;
  for (int64_t Hkv : {4, 2}) {
    for (bool causal : {false, true}) {
      SCOPED_TRACE("Hkv=" + std::to_string(Hkv) +
                   (causal ? " causal" : " non-causal"));
      auto options = mha::MultiHeadAttentionOptions(E, H).attention_kind(
          AttentionKind::kLinear);
      if (Hkv != H) {
        options.num_kv_heads(Hkv);
      }
      auto m = make(options);
      auto x = torch::randn({N, L, E}, kDouble);
      auto h = project_heads(m, x);
      const auto reference = [&](const torch::Tensor& key_weight) {
        auto phi_k = mha::elu_feature_map(to_query_heads(h.k, H));
        return merge_and_project(
            m, dense_linear(mha::elu_feature_map(h.q), phi_k,
                            to_query_heads(h.v, H), causal, key_weight));
      };
      auto out =
          std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, causal));
      expect_close(out, reference({}), 1e-11, 0, "no mask");

      auto pad = torch::zeros({N, S}, torch::kBool);
      pad.index_put_({0, torch::indexing::Slice(50, S)}, true);
      pad.index_put_({1, 3}, true);
      auto keep = (~pad).to(torch::kFloat64).view({N, 1, 1, S});
      out = std::get<0>(m->forward(x, {}, {}, pad, false, {}, true, causal));
      expect_close(out, reference(keep), 1e-11, 0, "bool padding");

      auto additive = torch::randn({N, S}, kDouble) * 0.5;
      additive.index_put_({0, 5}, -kInf);
      out =
          std::get<0>(m->forward(x, {}, {}, additive, false, {}, true, causal));
      expect_close(out, reference(torch::exp(additive).view({N, 1, 1, S})),
                   1e-11, 0, "float padding");
    }
  }
  // Cross-attention (S != L), seq-first layout, unbatched.
  auto options = mha::MultiHeadAttentionOptions(E, H)
                     .attention_kind(AttentionKind::kLinear)
                     .batch_first(false);
  auto m = make(options);
  auto query = torch::randn({N, 11, E}, kDouble);
  auto memory = torch::randn({N, 23, E}, kDouble);
  auto h = project_heads(m, query, memory);
  auto expected =
      merge_and_project(m, dense_linear(mha::elu_feature_map(h.q),
                                        mha::elu_feature_map(h.k), h.v, false));
  auto out =
      std::get<0>(m->forward(query.transpose(0, 1), memory.transpose(0, 1),
                             memory.transpose(0, 1), {}, false));
  expect_close(out, expected.transpose(0, 1), 1e-11, 0, "seq-first cross");
  auto single =
      std::get<0>(m->forward(query[1], memory[1], memory[1], {}, false));
  expect_close(single, expected[1], 1e-11, 0, "unbatched");
}

// A custom feature map, and rotary heads: the feature map sees the rotated
// heads (rotary_embedding at positions 0..L-1).
TEST_F(LinearAttentionModuleTest, FeatureMapAndRotary) {
  const int64_t N = 2, L = 80, E = 16, H = 2;
  mha::FeatureMap squared = [](const torch::Tensor& x) {
    return torch::cat({x.square(), torch::ones_like(x.narrow(-1, 0, 1))}, -1);
  };
  auto m = make(mha::MultiHeadAttentionOptions(E, H)
                    .attention_kind(AttentionKind::kLinear)
                    .feature_map(squared)
                    .rotary(true));
  auto x = torch::randn({N, L, E}, kDouble);
  auto h = project_heads(m, x);
  auto q = mha::rotary_embedding(h.q), k = mha::rotary_embedding(h.k);
  for (bool causal : {false, true}) {
    auto out = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, causal));
    expect_close(
        out,
        merge_and_project(m, dense_linear(squared(q), squared(k), h.v, causal)),
        1e-11, 0, causal ? "causal" : "non-causal");
  }
  std::ostringstream text;
  m->pretty_print(text);
  EXPECT_EQ(text.str(),
            "mha::MultiHeadAttention(embed_dim=16, num_heads=2, rotary=true, "
            "attention_kind=linear, feature_map=custom)");
}

// Gradients of the input and every parameter through the module equal the
// dense reference's (float64, causal, padded).
TEST_F(LinearAttentionModuleTest, GradientsEqualDenseForm) {
  const int64_t N = 2, L = 100, E = 16, H = 2;
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    SCOPED_TRACE(mha::to_string(kind));
    auto m = make(mha::MultiHeadAttentionOptions(E, H).attention_kind(kind));
    auto x = torch::randn({N, L, E}, kDouble).requires_grad_();
    // Padded keys 3..12 of sequence 1: no query row sees only padding (the
    // references' gradients there would be NaN; the module's are 0).
    auto pad = torch::zeros({N, L}, torch::kBool);
    pad.index_put_({1, torch::indexing::Slice(3, 13)}, true);
    auto g = torch::randn({N, L, E}, kDouble);
    auto out = std::get<0>(m->forward(x, {}, {}, pad, false, {}, true, true));
    std::vector<torch::Tensor> inputs = {x};
    for (auto& p : m->parameters()) {
      inputs.push_back(p);
    }
    auto grads = torch::autograd::grad({(out * g).sum()}, inputs);
    auto h = project_heads(m, x);
    torch::Tensor heads;
    if (kind == AttentionKind::kLinear) {
      heads = dense_linear(mha::elu_feature_map(h.q), mha::elu_feature_map(h.k),
                           h.v, true,
                           (~pad).to(torch::kFloat64).view({N, 1, 1, L}));
    } else {
      heads = dense_favor(h.q, h.k, h.v, m->random_features,
                          std::pow(8.0, -0.25), true, pad.view({N, 1, 1, L}));
    }
    auto expected_grads = torch::autograd::grad(
        {(merge_and_project(m, heads) * g).sum()}, inputs);
    for (size_t i = 0; i < grads.size(); ++i) {
      expect_close(grads[i], expected_grads[i], 1e-9, 0,
                   "gradient " + std::to_string(i));
    }
  }
}

// Every key padded: the attention result is 0, the output out_proj.bias,
// never NaN, with finite gradients.
TEST_F(LinearAttentionModuleTest, FullyPaddedRowsGiveBias) {
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    for (bool causal : {false, true}) {
      auto m = make(mha::MultiHeadAttentionOptions(8, 2).attention_kind(kind),
                    torch::kFloat32);
      auto x = torch::randn({2, 6, 8}).requires_grad_();
      auto pad = torch::zeros({2, 6}, torch::kBool);
      pad[1].fill_(true);
      auto out =
          std::get<0>(m->forward(x, {}, {}, pad, false, {}, true, causal));
      expect_close(out[1], m->out_proj->bias.expand({6, 8}), 1e-6, 0,
                   mha::to_string(kind));
      auto grad = torch::autograd::grad({out.sum()}, {x})[0];
      EXPECT_TRUE(torch::isfinite(grad).all().item<bool>());
    }
  }
}

// The errors name the option: need_weights (forward's default true),
// attn_mask, options no linear kind takes, options of another kind.
TEST_F(LinearAttentionModuleTest, ErrorsNameTheOption) {
  auto linear = mha::MultiHeadAttentionOptions(8, 2).attention_kind(
      AttentionKind::kLinear);
  mha::MultiHeadAttention m(linear);
  auto x = torch::randn({2, 5, 8});
  EXPECT_THROW_MSG(m(x),
                   "need_weights=true is not supported with attention_kind "
                   "kLinear, which never forms the attention weights; pass "
                   "need_weights=false");
  EXPECT_THROW_MSG(
      m->forward(x, {}, {}, {}, false, torch::zeros({5, 5}, torch::kBool)),
      "attn_mask is not supported with attention_kind kLinear, which forms no "
      "(L, S) scores to mask, but got attn_mask [5, 5]; use is_causal");
  EXPECT_THROW_MSG(
      m->forward(x, {}, {}, torch::zeros({2, 4}, torch::kBool), false),
      "key_padding_mask must be (N, S) = (2, 5), but got [2, 4]");
  torch::nn::MultiheadAttention reference(8, 2);
  EXPECT_THROW_MSG(mha::copy_weights(m, reference),
                   "copy_weights: option attention_kind must be kSoftmax, the "
                   "attention of torch::nn::MultiheadAttention, but mha's "
                   "module has linear");
  const auto throws = [](const mha::MultiHeadAttentionOptions& o,
                         const std::string& expected) {
    EXPECT_THROW_MSG(mha::MultiHeadAttention{o}, expected);
  };
  throws(mha::MultiHeadAttentionOptions(linear).dropout(0.1),
         "dropout must be 0 with attention_kind kLinear, which never forms "
         "the attention weights dropout acts on, but got 0.1");
  throws(mha::MultiHeadAttentionOptions(linear).window(4),
         "the option window is not supported with attention_kind kLinear");
  throws(mha::MultiHeadAttentionOptions(linear).add_bias_kv(true),
         "the option add_bias_kv is not supported with attention_kind kLinear");
  throws(mha::MultiHeadAttentionOptions(linear).position_bias(
             mha::PositionBias::kAlibi),
         "the option position_bias is not supported");
  throws(mha::MultiHeadAttentionOptions(linear).score_mod(
             [](const torch::Tensor& score, const torch::Tensor&,
                const torch::Tensor&, const torch::Tensor&,
                const torch::Tensor&) { return score; }),
         "the option score_mod is not supported with attention_kind kLinear");
  EXPECT_THROW_MSG(
      m->forward(x, {}, {}, {}, false, {}, true, true, {},
                 mha::create_block_mask(mha::noop_mask(), 1, 1, 5, 5)),
      "block_mask is not supported with attention_kind kLinear, kPerformer "
      "or kLinformer");
  throws(mha::MultiHeadAttentionOptions(linear).scale(1.0),
         "scale has no meaning with attention_kind kLinear");
  throws(mha::MultiHeadAttentionOptions(linear).nb_features(8),
         "the option nb_features does not apply to attention_kind kLinear");
  throws(mha::MultiHeadAttentionOptions(8, 2).max_length(8),
         "the option max_length does not apply to attention_kind kSoftmax");
  throws(mha::MultiHeadAttentionOptions(8, 2).feature_map(mha::elu_feature_map),
         "the option feature_map does not apply to attention_kind kSoftmax");
  throws(mha::MultiHeadAttentionOptions(8, 2)
             .attention_kind(AttentionKind::kPerformer)
             .nb_features(-1),
         "nb_features must be >= 0, but got -1");
  throws(mha::MultiHeadAttentionOptions(8, 2).attention_kind(
             AttentionKind::kLinformer),
         "attention_kind kLinformer needs projected_length >= 1 and "
         "max_length >= 1, but got projected_length=0, max_length=0");
  throws(mha::MultiHeadAttentionOptions(8, 2)
             .attention_kind(AttentionKind::kLinformer)
             .projected_length(4)
             .max_length(8)
             .rotary(true),
         "rotary is not supported with attention_kind kLinformer");
}

// Through the layers: an encoder layer whose self_attn is replaced by a
// kLinear one trains (gradients reach every parameter), and
// TransformerEncoder's copies keep the kind.
TEST_F(LinearAttentionModuleTest, EncoderLayerWithLinearSelfAttention) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(16, 2).dim_feedforward(32).dropout(
          0.0));
  layer->self_attn = layer->replace_module(
      "self_attn", mha::MultiHeadAttention(
                       mha::MultiHeadAttentionOptions(16, 2).attention_kind(
                           AttentionKind::kPerformer)));
  mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(layer, 2));
  for (size_t i = 0; i < 2; ++i) {
    auto copy = encoder->layers[i]->as<mha::TransformerEncoderLayerImpl>();
    EXPECT_EQ(copy->self_attn->options.attention_kind(),
              AttentionKind::kPerformer);
    EXPECT_TRUE(copy->self_attn->random_features.defined());
  }
  auto x = torch::randn({2, 7, 16});
  auto pad = torch::zeros({2, 7}, torch::kBool);
  pad.index_put_({1, 6}, true);
  auto y = encoder->forward(x, {}, pad, /*is_causal=*/true);
  y.sum().backward();
  for (auto& p : encoder->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
  }
}

// ---------------------------------------------------------------------------
// Decoding with the constant-size state

// A 5-token prompt, 6 single tokens, then a 3-token chunk through
// forward_cached equal the rows of the causal forward over the whole
// sequence so far (float32, float64; grouped heads, rotary, seq-first);
// the state's buffers keep their size and storage, key() holds nothing.
TEST_F(LinearAttentionDecodingTest, StepsEqualCausalForward) {
  const int64_t N = 2, E = 16, H = 4;
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
      for (int variant = 0; variant < 3; ++variant) {
        SCOPED_TRACE(std::string(mha::to_string(kind)) + " " +
                     c10::toString(dtype) + " variant " +
                     std::to_string(variant));
        auto options =
            mha::MultiHeadAttentionOptions(E, H).attention_kind(kind);
        if (variant == 1) {
          options.num_kv_heads(2).rotary(true);
        } else if (variant == 2) {
          options.batch_first(false);
        }
        auto m = make(options, dtype);
        torch::NoGradGuard no_grad;
        auto tokens = torch::randn({N, 14, E}, torch::TensorOptions(dtype));
        const auto layout = [&](const torch::Tensor& t) {
          return options.batch_first() ? t : t.transpose(0, 1);
        };
        auto cache = m->make_kv_cache(N, /*capacity=*/20);
        ASSERT_TRUE(cache.is_recurrent());
        EXPECT_EQ(cache.key().size(2), 0);
        const auto state_sizes = cache.kv_state().sizes().vec();
        const auto* state_data = cache.kv_state().data_ptr();
        const double tol = dtype == torch::kFloat64 ? 1e-11 : 2e-5;
        int64_t P = 0;
        for (int64_t T : {5, 1, 1, 1, 1, 1, 1, 3}) {
          auto step = layout(tokens.narrow(1, P, T));
          auto out = std::get<0>(m->forward_cached(step, cache));
          auto full =
              std::get<0>(m->forward(layout(tokens.narrow(1, 0, P + T)), {}, {},
                                     {}, false, {}, true, /*is_causal=*/true));
          const int64_t dim = options.batch_first() ? 1 : 0;
          expect_close(out, full.narrow(dim, P, T), tol, tol,
                       "step at " + std::to_string(P));
          P += T;
          EXPECT_EQ(cache.size(), P);
          EXPECT_EQ(cache.kv_state().sizes().vec(), state_sizes);
          EXPECT_EQ(cache.kv_state().data_ptr(), state_data);
          EXPECT_EQ(cache.key().size(2), 0);
        }
        const int64_t F = kind == AttentionKind::kLinear
                              ? 4
                              : std::llround(4 * std::log(4.0));
        EXPECT_EQ(state_sizes,
                  (std::vector<int64_t>{N, options.num_kv_heads().value_or(H),
                                        F, 4}));
        cache.clear();
        EXPECT_EQ(cache.size(), 0);
        EXPECT_TRUE(torch::equal(cache.kv_state(),
                                 torch::zeros_like(cache.kv_state())));
      }
    }
  }
}

// Left padding through the state (HF's generate: attention_mask over every
// token so far, positions = cumsum - 1): padded tokens never enter the
// sums, and the steps equal the causal forward with the same mask; a
// non-causal step sees every token so far.
TEST_F(LinearAttentionDecodingTest, PaddingAndNonCausalSteps) {
  const int64_t N = 2, E = 16, H = 2;
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    SCOPED_TRACE(mha::to_string(kind));
    auto m = make(mha::MultiHeadAttentionOptions(E, H).attention_kind(kind));
    torch::NoGradGuard no_grad;
    auto tokens = torch::randn({N, 9, E}, kDouble);
    auto pad = torch::zeros({N, 9}, torch::kBool);
    pad.index_put_({1, torch::indexing::Slice(0, 3)}, true);  // left pads
    auto cache = m->make_kv_cache(N, 9);
    int64_t P = 0;
    for (int64_t T : {4, 1, 1, 3}) {
      auto out =
          std::get<0>(m->forward_cached(tokens.narrow(1, P, T), cache, true,
                                        false, true, pad.narrow(1, 0, P + T)));
      auto full = std::get<0>(m->forward(tokens.narrow(1, 0, P + T), {}, {},
                                         pad.narrow(1, 0, P + T), false, {},
                                         true, true));
      expect_close(out, full.narrow(1, P, T), 1e-11, 0,
                   "step at " + std::to_string(P));
      P += T;
    }
    // Non-causal: a 3-token step after a 4-token prompt sees all 7 tokens.
    auto plain = m->make_kv_cache(N, 7);
    m->forward_cached(tokens.narrow(1, 0, 4), plain);
    auto out = std::get<0>(
        m->forward_cached(tokens.narrow(1, 4, 3), plain, /*is_causal=*/false));
    auto full = std::get<0>(
        m->forward(tokens.narrow(1, 0, 7), {}, {}, {}, false, {}, true, false));
    expect_close(out, full.narrow(1, 4, 3), 1e-11, 0, "non-causal step");
  }
}

// With gradient mode, a step's output is differentiable in its query (and
// the parameters); the state holds no graph.
TEST_F(LinearAttentionDecodingTest, GradientsReachTheStep) {
  auto m = make(mha::MultiHeadAttentionOptions(8, 2).attention_kind(
                    AttentionKind::kPerformer),
                torch::kFloat32);
  auto cache = m->make_kv_cache(1, 8);
  auto prompt = torch::randn({1, 3, 8});
  m->forward_cached(prompt, cache);
  auto step = torch::randn({1, 1, 8}).requires_grad_();
  auto out = std::get<0>(m->forward_cached(step, cache));
  out.sum().backward();
  ASSERT_TRUE(step.grad().defined());
  EXPECT_GT(step.grad().abs().sum().item<float>(), 0);
  EXPECT_FALSE(cache.kv_state().requires_grad());
}

TEST_F(LinearAttentionDecodingTest, ErrorsNameTheCache) {
  auto m = make(mha::MultiHeadAttentionOptions(8, 2).attention_kind(
                    AttentionKind::kLinear),
                torch::kFloat32);
  auto x = torch::randn({1, 2, 8});
  mha::KVCache keys_and_values(1, 2, 8, 4);
  EXPECT_THROW_MSG(m->forward_cached(x, keys_and_values),
                   "attention_kind kLinear decodes with a recurrent cache");
  auto small = m->make_kv_cache(1, 3);
  m->forward_cached(x, small);
  EXPECT_THROW_MSG(m->forward_cached(x, small),
                   "cache has room for 1 more positions (capacity 3, 2 held), "
                   "but query has 2");
  auto other = mha::KVCache::recurrent(1, 2, 8, 5, 4);
  EXPECT_THROW_MSG(m->forward_cached(x, other),
                   "cache must hold (N, num_kv_heads, features, head_dim) = "
                   "(1, 2, 4, 4), but holds (1, 2, 5, 4)");
  EXPECT_THROW_MSG(m->forward_cached(x, small, true, /*need_weights=*/true),
                   "need_weights=true is not supported");
  EXPECT_THROW_MSG(
      small.append(torch::zeros({1, 2, 1, 4}), torch::zeros({1, 2, 1, 4})),
      "KVCache::append: this cache holds the constant-size state");
  auto softmax = make(mha::MultiHeadAttentionOptions(8, 2), torch::kFloat32);
  EXPECT_FALSE(softmax->make_kv_cache(1, 4).is_recurrent());
  EXPECT_THROW_MSG(mha::KVCache::recurrent(1, 2, 8, 0, 4),
                   "feature_dim must be >= 1, but got 0");
}

// ---------------------------------------------------------------------------
// Linformer

mha::MultiHeadAttentionOptions linformer(int64_t E, int64_t H, int64_t k,
                                         int64_t n) {
  return mha::MultiHeadAttentionOptions(E, H)
      .attention_kind(AttentionKind::kLinformer)
      .projected_length(k)
      .max_length(n);
}

// With k = n = S and E = F = I, Linformer is softmax attention: outputs and
// weights (averaged and per head) equal the kSoftmax module's on the same
// parameters, shared or separate projections.
TEST_F(LinearAttentionLinformerTest, IdentityProjectionsEqualSoftmax) {
  const int64_t N = 2, L = 12, E = 16, H = 2;
  for (bool share : {true, false}) {
    SCOPED_TRACE(share ? "shared" : "separate");
    auto m = make(linformer(E, H, L, L).share_kv_projection(share));
    auto softmax = make(mha::MultiHeadAttentionOptions(E, H));
    {
      torch::NoGradGuard no_grad;
      m->proj_k.copy_(torch::eye(L, kDouble));
      if (!share) {
        m->proj_v.copy_(torch::eye(L, kDouble));
      }
      for (auto& p : softmax->named_parameters()) {
        p.value().copy_(m->named_parameters()[p.key()]);
      }
    }
    auto x = torch::randn({N, L, E}, kDouble);
    for (bool average : {true, false}) {
      auto [out, weights] = m->forward(x, {}, {}, {}, true, {}, average);
      auto [expected, expected_weights] =
          softmax->forward(x, {}, {}, {}, true, {}, average);
      expect_close(out, expected, 1e-12, 0, "output");
      expect_close(weights, expected_weights, 1e-12, 0, "weights");
    }
    // A random projection is not the identity: the check can fail.
    torch::NoGradGuard no_grad;
    m->proj_k.normal_();
    EXPECT_FALSE(torch::allclose(
        std::get<0>(m->forward(x, {}, {}, {}, false)),
        std::get<0>(softmax->forward(x, {}, {}, {}, false)), 1e-6, 1e-6));
  }
}

// The paper's eq. 7 on the module's projections: a sequence of S < n keys
// uses the first S columns of E and F; padded keys and values are zeroed
// before the projection (so their values change nothing); weights (N, L, k).
TEST_F(LinearAttentionLinformerTest, ShortAndPaddedSequencesEqualEquation) {
  const int64_t N = 2, L = 9, S = 13, E = 16, H = 2, k = 5, n = 20;
  auto m = make(linformer(E, H, k, n).share_kv_projection(false));
  auto query = torch::randn({N, L, E}, kDouble);
  auto memory = torch::randn({N, S, E}, kDouble);
  auto pad = torch::zeros({N, S}, torch::kBool);
  pad.index_put_({1, torch::indexing::Slice(10, S)}, true);
  auto [out, weights] = m(query, memory, memory, pad, true);
  ASSERT_EQ(weights.sizes(), (std::vector<int64_t>{N, L, k}));
  auto h = project_heads(m, query, memory);
  auto keep = (~pad).to(torch::kFloat64).view({N, 1, S, 1});
  auto pk = torch::matmul(m->proj_k.narrow(1, 0, S), h.k * keep);
  auto pv = torch::matmul(m->proj_v.narrow(1, 0, S), h.v * keep);
  auto expected =
      merge_and_project(m, dense_softmax(h.q, pk, pv, 1 / std::sqrt(8.0)));
  expect_close(out, expected, 1e-12, 0, "output");
  // Other values at the padded positions: the same output.
  auto changed = memory.clone();
  changed.index_put_({1, torch::indexing::Slice(10, S)}, 100.0);
  expect_close(std::get<0>(m(query, changed, changed, pad, false)), out, 1e-12,
               0, "padded values");
  auto names = m->named_parameters().keys();
  EXPECT_NE(std::find(names.begin(), names.end(), "proj_k"), names.end());
  EXPECT_NE(std::find(names.begin(), names.end(), "proj_v"), names.end());
  std::ostringstream text;
  m->pretty_print(text);
  EXPECT_EQ(text.str(),
            "mha::MultiHeadAttention(embed_dim=16, num_heads=2, "
            "attention_kind=linformer, projected_length=5, max_length=20, "
            "share_kv_projection=false)");
}

TEST_F(LinearAttentionLinformerTest, NonCausalOnly) {
  auto m = make(linformer(16, 2, 4, 10), torch::kFloat32);
  auto x = torch::randn({2, 6, 16});
  EXPECT_THROW_MSG(
      m->forward(x, {}, {}, {}, false, {}, true, /*is_causal=*/true),
      "is_causal is not supported with attention_kind "
      "kLinformer: its projection along the sequence mixes every "
      "key position, later ones included");
  EXPECT_THROW_MSG(m->make_kv_cache(2, 8),
                   "attention_kind kLinformer cannot decode token by token");
  mha::KVCache cache(2, 2, 8, 8);
  EXPECT_THROW_MSG(m->forward_cached(x, cache),
                   "attention_kind kLinformer cannot decode token by token");
  EXPECT_THROW_MSG(m->forward(torch::randn({2, 11, 16}), {}, {}, {}, false),
                   "the key length S = 11 exceeds max_length n = 10");
  EXPECT_THROW_MSG(m->forward(x, {}, {}, torch::zeros({2, 6}), false),
                   "key_padding_mask must be bool (true = padding) with "
                   "attention_kind kLinformer");
  EXPECT_EQ(m->named_parameters().size(), 5u);  // in_proj x2, out_proj x2, E
}

// ---------------------------------------------------------------------------
// Inference by segments: without autograd the module runs causal
// self-attention a segment of rows at a time (projections included) and
// makes other calls' features a segment at a time, the sums carried
// (linear_attention_by_segments). Forced to 64-row segments on L = 150 (a
// partial last segment), the results equal the whole sequence's (autograd
// on: all at once), causal and not, self- and cross-attention, padding,
// grouped heads, rotary positions, InferenceMode, decoding on from the state
// a segmented prompt left; a counting feature map shows the segments.

TEST_F(LinearAttentionModuleTest, InferenceBySegmentsEqualsWhole) {
  const int64_t N = 2, E = 16, H = 4, L = 150, S = 130;
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
      SCOPED_TRACE(std::string(mha::to_string(kind)) + " " +
                   c10::toString(dtype));
      const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
      int calls = 0;
      auto options = mha::MultiHeadAttentionOptions(E, H)
                         .attention_kind(kind)
                         .num_kv_heads(2)
                         .rotary(true);
      if (kind == AttentionKind::kLinear) {
        options.feature_map([&calls](const torch::Tensor& x) {
          ++calls;
          return mha::elu_feature_map(x);
        });
      }
      auto m = make(options, dtype);
      const auto opts = torch::TensorOptions(dtype);
      auto x = torch::randn({N, L, E}, opts);
      auto memory = torch::randn({N, S, E}, opts);
      auto pad = torch::zeros({N, L}, torch::kBool);
      pad.index_put_({1, torch::indexing::Slice(100, L)}, true);
      auto pad_s = torch::zeros({N, S}, torch::kBool);
      pad_s.index_put_({0, torch::indexing::Slice(0, 70)}, true);
      // Positions restarting at 0 (packed documents) for rotary.
      const auto positions =
          torch::arange(L, torch::kLong).remainder(37).expand({N, L});
      const auto run = [&](bool segments, const torch::Tensor& key,
                           const torch::Tensor& padding, bool causal,
                           const torch::Tensor& at = {}) {
        if (!segments) {  // autograd on: the whole sequence's features
          return std::get<0>(
              m->forward(x, key, key, padding, false, {}, true, causal, at));
        }
        torch::NoGradGuard no_grad;
        mha::detail::SegmentRowsForTests rows(64);
        return std::get<0>(
            m->forward(x, key, key, padding, false, {}, true, causal, at));
      };
      for (bool causal : {true, false}) {
        SCOPED_TRACE(causal ? "causal" : "non-causal");
        calls = 0;
        auto segmented = run(true, {}, pad, causal);
        if (kind == AttentionKind::kLinear) {
          EXPECT_EQ(calls, 6);  // 3 segments of queries and of keys
        }
        expect_close(segmented, run(false, {}, pad, causal).detach(), tol, tol,
                     "self-attention");
      }
      const auto with_positions = run(false, {}, pad, true, positions).detach();
      expect_close(run(true, {}, pad, true, positions), with_positions, tol,
                   tol, "positions");
      {
        // Grad mode off too. On the heap: GCC 16 reports a false
        // -Wmaybe-uninitialized inside LibTorch 2.14's InferenceMode when
        // it is a local.
        const auto inference = std::make_unique<c10::InferenceMode>();
        mha::detail::SegmentRowsForTests rows(64);
        calls = 0;
        auto out = std::get<0>(
            m->forward(x, {}, {}, pad, false, {}, true, true, positions));
        if (kind == AttentionKind::kLinear) {
          EXPECT_EQ(calls, 6);
        }
        expect_close(out, with_positions, tol, tol, "InferenceMode");
      }
      // Cross-attention (non-causal), S != L, padded memory.
      expect_close(run(true, memory, pad_s, false),
                   run(false, memory, pad_s, false).detach(), tol, tol,
                   "cross-attention");
      // A prompt of L tokens in segments, then steps from its state.
      torch::NoGradGuard no_grad;
      auto tokens = torch::randn({N, L + 3, E}, opts);
      auto whole = m->make_kv_cache(N, L + 3);
      auto segmented = m->make_kv_cache(N, L + 3);
      {
        torch::AutoGradMode grad(true);
        m->forward_cached(tokens.narrow(1, 0, L), whole);
      }
      {
        mha::detail::SegmentRowsForTests rows(64);
        m->forward_cached(tokens.narrow(1, 0, L), segmented);
      }
      expect_close(segmented.kv_state(), whole.kv_state(), tol, tol,
                   "state after the prompt");
      for (int64_t t = L; t < L + 3; ++t) {
        expect_close(
            std::get<0>(m->forward_cached(tokens.narrow(1, t, 1), segmented)),
            std::get<0>(m->forward_cached(tokens.narrow(1, t, 1), whole)), tol,
            tol, "step at " + std::to_string(t));
      }
    }
  }
}

// Training by segments (autograd on, L longer than a segment): the forward
// keeps each segment's starting sums, the backward recomputes segment by
// segment. With forced 64-row segments at L = 150, the output and every
// gradient (input, parameters) equal those of the whole sequence at once,
// with padding, grouped heads, rotary positions that restart, a batch-first
// and a sequence-first input; the backward works after the module's holder
// is gone, a parameter changed in place before it is an error (and so are
// the Performer's features redrawn), and so is create_graph.
TEST_F(LinearAttentionModuleTest, TrainingBySegmentsEqualsWhole) {
  const int64_t N = 2, E = 16, H = 4, L = 150;
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
      SCOPED_TRACE(std::string(mha::to_string(kind)) + " " +
                   c10::toString(dtype));
      const double tol = dtype == torch::kFloat64 ? 1e-12 : 1e-5;
      auto m = make(mha::MultiHeadAttentionOptions(E, H)
                        .attention_kind(kind)
                        .num_kv_heads(2)
                        .rotary(true),
                    dtype);
      const auto opts = torch::TensorOptions(dtype);
      auto x = torch::randn({N, L, E}, opts);
      auto g = torch::randn({N, L, E}, opts);
      auto pad = torch::zeros({N, L}, torch::kBool);
      pad.index_put_({1, torch::indexing::Slice(100, L)}, true);
      const auto positions =
          torch::arange(L, torch::kLong).remainder(37).expand({N, L});
      auto parameters = m->parameters();
      // The output and the gradients of x and of every parameter.
      const auto run = [&](mha::MultiHeadAttention& module, bool segments) {
        std::unique_ptr<mha::detail::SegmentRowsForTests> rows;
        if (segments) {
          rows = std::make_unique<mha::detail::SegmentRowsForTests>(64);
        }
        auto xg = x.clone().requires_grad_();
        auto out = std::get<0>(
            module->forward(xg, {}, {}, pad, false, {}, true, true, positions));
        rows.reset();  // the backward takes the rows the forward kept
        std::vector<torch::Tensor> inputs{xg};
        inputs.insert(inputs.end(), parameters.begin(), parameters.end());
        auto grads = torch::autograd::grad({(out * g).sum()}, inputs);
        grads.insert(grads.begin(), out.detach());
        return grads;
      };
      const auto whole = run(m, false);
      const auto segmented = run(m, true);
      ASSERT_EQ(segmented.size(), whole.size());
      for (size_t i = 0; i < whole.size(); ++i) {
        expect_close(segmented[i], whole[i], tol, tol,
                     i == 0 ? "output" : "gradient " + std::to_string(i - 1));
      }
      {
        // The segments ran: the output's gradient function is theirs.
        mha::detail::SegmentRowsForTests rows(64);
        auto out = std::get<0>(m->forward(x.clone().requires_grad_(), {}, {},
                                          {}, false, {}, true, true));
        EXPECT_NE(out.grad_fn()->name().find("CausalSegmentsFunction"),
                  std::string::npos)
            << out.grad_fn()->name();
        EXPECT_THROW_MSG(torch::autograd::grad({out.sum()}, {parameters[0]}, {},
                                               /*retain_graph=*/true,
                                               /*create_graph=*/true),
                         "first derivatives only");
        {
          torch::NoGradGuard no_grad;
          parameters[0].mul_(1.0);  // a new version
        }
        EXPECT_THROW_MSG(out.sum().backward(), "modified by an inplace");
      }
      // Sequence-first, and the holder gone before the backward.
      auto copy = make(mha::MultiHeadAttentionOptions(E, H)
                           .attention_kind(kind)
                           .num_kv_heads(2)
                           .rotary(true)
                           .batch_first(false),
                       dtype);
      {
        torch::NoGradGuard no_grad;
        auto from = m->named_parameters();
        for (auto& p : copy->named_parameters()) {
          p.value().copy_(from[p.key()]);
        }
        if (m->random_features.defined()) {
          copy->random_features.copy_(m->random_features);
        }
      }
      torch::Tensor out, xg = x.transpose(0, 1).clone().requires_grad_();
      {
        mha::detail::SegmentRowsForTests rows(64);
        auto held = copy;
        copy = nullptr;
        out = std::get<0>(
            held->forward(xg, {}, {}, pad, false, {}, true, true, positions));
      }
      (out * g.transpose(0, 1)).sum().backward();
      expect_close(out.transpose(0, 1).detach(), whole[0], tol, tol,
                   "sequence-first output");
      expect_close(xg.grad().transpose(0, 1), whole[1], tol, tol,
                   "sequence-first input gradient");
      if (kind == AttentionKind::kPerformer) {
        // Features redrawn between the forward and the backward: an error,
        // not the gradient of other features.
        mha::detail::SegmentRowsForTests rows(64);
        auto y = std::get<0>(m->forward(x.clone().requires_grad_(), {}, {}, {},
                                        false, {}, true, true));
        m->redraw_features(99);
        EXPECT_THROW_MSG(y.sum().backward(), "modified by an inplace");
      }
    }
  }
}

// mha::linear_attention by segments equals its whole form: causal (S > L:
// later keys never seen) and not, broadcast leading dims.
TEST_F(LinearAttentionTest, InferenceBySegmentsEqualsWhole) {
  auto q = torch::randn({2, 3, 150, 8}, kDouble);
  auto k = torch::randn({1, 3, 170, 8}, kDouble);
  auto v = torch::randn({2, 1, 170, 5}, kDouble);
  for (bool causal : {true, false}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    auto whole = mha::linear_attention(q, k, v, causal);
    torch::NoGradGuard no_grad;
    mha::detail::SegmentRowsForTests rows(64);
    int calls = 0;
    auto segmented = mha::linear_attention(q, k, v, causal,
                                           [&calls](const torch::Tensor& x) {
                                             ++calls;
                                             return mha::elu_feature_map(x);
                                           });
    EXPECT_EQ(calls, 6);  // 3 segments of queries and of keys
    expect_close(segmented, whole, 1e-12, 1e-12, "output");
  }
}

// ---------------------------------------------------------------------------
// CUDA: the same results as on the CPU (skipped without a GPU).

TEST_F(LinearAttentionModuleTest, MatchesCpu_CUDA) {
  if (!torch::cuda::is_available()) {
    GTEST_SKIP() << "no CUDA device";
  }
  for (auto kind : {AttentionKind::kLinear, AttentionKind::kPerformer}) {
    SCOPED_TRACE(mha::to_string(kind));
    auto m = make(mha::MultiHeadAttentionOptions(32, 4).attention_kind(kind),
                  torch::kFloat32);
    auto x = torch::randn({2, 300, 32}).requires_grad_();
    auto cpu = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));
    auto grad = torch::autograd::grad({cpu.sum()}, {x})[0];
    auto gpu = std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(
        m->clone(torch::kCUDA));
    auto xg = x.detach().to(torch::kCUDA).requires_grad_();
    auto out = std::get<0>(gpu->forward(xg, {}, {}, {}, false, {}, true, true));
    auto grad_gpu = torch::autograd::grad({out.sum()}, {xg})[0];
    expect_close(out.cpu(), cpu, 1e-4, 1e-4, "output");
    expect_close(grad_gpu.cpu(), grad, 1e-3, 1e-3, "gradient");
    torch::NoGradGuard no_grad;
    auto cache = gpu->make_kv_cache(2, 300);
    auto first = std::get<0>(gpu->forward_cached(xg.narrow(1, 0, 299), cache));
    auto last = std::get<0>(gpu->forward_cached(xg.narrow(1, 299, 1), cache));
    expect_close(last.cpu(), cpu.narrow(1, 299, 1), 1e-4, 1e-4, "decoding");
  }
}

}  // namespace
