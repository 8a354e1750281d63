// The attention options of 2025's model families on MultiHeadAttention
// (head_dim, qk_norm, attention_sinks, output_gate) against a float64
// reference written here from transformers 5.x's modules (Qwen3Attention,
// Gemma3Attention, Olmo2Attention, Llama4TextAttention, GptOssAttention,
// Qwen3NextAttention): outputs, weights and every gradient; forward_cached
// against forward; the differentiable logsumexp they rest on.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "family_gradients.h"
#include "fixture_helpers.h"
#include "mha/flex_attention.h"
#include "mha/hf.h"
#include "mha/multi_head_attention.h"
#include "mha/parity.h"
#include "mha/positions.h"
#include "mha/state_dict.h"
#include "test_helpers.h"

namespace model_families_tests {

using mha::MultiHeadAttention;
using mha::MultiHeadAttentionOptions;
using mha::QKNorm;

constexpr double kInf = std::numeric_limits<double>::infinity();

/// Parameters redrawn N(0, 0.3) (sinks and norm weights included), float64.
void spread(MultiHeadAttention& m, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  m->to(torch::kFloat64);
  for (auto& p : m->parameters()) {
    p.normal_(0.0, 0.3);
  }
}

/// x / sqrt(mean(x²) over dims + eps) · (w or 1 + w).
torch::Tensor rms(const torch::Tensor& x, at::IntArrayRef dims,
                  const torch::Tensor& w, const MultiHeadAttentionOptions& o) {
  auto y = x * torch::rsqrt(x.pow(2).mean(dims, true) + o.qk_norm_eps());
  if (!w.defined()) {
    return y;
  }
  return y * (o.qk_norm_unit_offset() ? w + 1.0 : w);
}

/// The family's attention written plainly: x (N, L, E), key_padding (N, L)
/// bool (true = padding) or undefined, causal. Returns (output, per-head
/// weights).
std::pair<torch::Tensor, torch::Tensor> reference(
    const mha::MultiHeadAttentionImpl& m, const torch::Tensor& x,
    const torch::Tensor& key_padding, bool causal) {
  const auto& o = m.options;
  const int64_t N = x.size(0), L = x.size(1), H = o.num_heads();
  const int64_t Hkv = m.num_kv_heads(), D = m.head_dim;
  const int64_t Eq = H * D * (o.output_gate() ? 2 : 1), Ekv = Hkv * D;
  const auto& b = m.in_proj_bias;
  auto lin = [&](const torch::Tensor& w_or_packed, int64_t row0, int64_t rows) {
    const auto w = m.packed_in_proj() ? m.in_proj_weight.narrow(0, row0, rows)
                                      : w_or_packed;
    auto y = torch::matmul(x, w.t());
    return b.defined() ? y + b.narrow(0, row0, rows) : y;
  };
  auto q = lin(m.q_proj_weight, 0, Eq);    // (N, L, Eq)
  auto k = lin(m.k_proj_weight, Eq, Ekv);  // (N, L, Ekv)
  auto v = lin(m.v_proj_weight, Eq + Ekv, Ekv);
  torch::Tensor gate;
  if (o.output_gate()) {  // per head [query_h | gate_h]
    auto per_head = q.view({N, L, H, 2 * D});
    gate = per_head.narrow(3, D, D).reshape({N, L, H * D});
    q = per_head.narrow(3, 0, D).reshape({N, L, H * D});
  }
  if (o.qk_norm() == QKNorm::kFull) {  // OLMo 2: the whole projection
    q = rms(q, {-1}, (m.q_norm ? m.q_norm->weight : torch::Tensor()), o);
    k = rms(k, {-1}, (m.k_norm ? m.k_norm->weight : torch::Tensor()), o);
  }
  q = q.view({N, L, H, D}).transpose(1, 2);  // (N, H, L, D)
  k = k.view({N, L, Hkv, D}).transpose(1, 2);
  v = v.view({N, L, Hkv, D}).transpose(1, 2);
  if (o.qk_norm() == QKNorm::kPerHead) {  // Qwen3, Gemma 3
    q = rms(q, {-1}, (m.q_norm ? m.q_norm->weight : torch::Tensor()), o);
    k = rms(k, {-1}, (m.k_norm ? m.k_norm->weight : torch::Tensor()), o);
  }
  if (o.rotary()) {
    q = mha::rotary_embedding(q, 0, o.rotary_theta());
    k = mha::rotary_embedding(k, 0, o.rotary_theta());
  }
  if (o.qk_norm() == QKNorm::kL2) {  // Llama 4, after rotary
    q = rms(q, {-1}, {}, o);
    k = rms(k, {-1}, {}, o);
  }
  if (o.attn_temperature_tuning().has_value()) {  // Llama 4's NoPE layers
    const auto& tuning = *o.attn_temperature_tuning();
    for (int64_t i = 0; i < L; ++i) {
      const double s = std::log1p(std::floor((i + 1.0) / tuning.floor_scale)) *
                           tuning.attn_scale +
                       1.0;
      q.select(2, i).mul_(s);
    }
  }
  k = k.repeat_interleave(H / Hkv, 1);
  v = v.repeat_interleave(H / Hkv, 1);
  const double scale = o.scale().value_or(1.0 / std::sqrt(double(D)));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;  // (N,H,L,L)
  auto blocked = torch::zeros({N, 1, L, L}, x.options().dtype(torch::kBool));
  if (causal) {
    blocked =
        blocked.logical_or(torch::ones({L, L}, blocked.options()).triu(1));
  }
  if (key_padding.defined()) {
    blocked = blocked.logical_or(key_padding.view({N, 1, 1, L}));
  }
  if (o.attention_chunk_size().has_value()) {  // Llama 4's chunks
    const int64_t c = *o.attention_chunk_size();
    auto other_chunk = torch::zeros({L, L}, blocked.options());
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < L; ++j) {
        other_chunk[i][j] = i / c != j / c;
      }
    }
    blocked = blocked.logical_or(other_chunk);
  }
  scores = scores.masked_fill(blocked, -kInf);
  torch::Tensor w;
  if (o.attention_sinks()) {  // GptOssAttention: the sink's column joins
    auto sink = m.sinks.view({1, H, 1, 1}).expand({N, H, L, 1});
    w = torch::softmax(torch::cat({scores, sink}, -1), -1).narrow(3, 0, L);
  } else {
    w = torch::softmax(scores, -1);
  }
  auto out = torch::matmul(w, v).transpose(1, 2).reshape({N, L, H * D});
  if (gate.defined()) {
    out = out * torch::sigmoid(gate);
  }
  out = torch::matmul(out, m.out_proj->weight.t());
  if (m.out_proj->bias.defined()) {
    out = out + m.out_proj->bias;
  }
  return {out, w};
}

/// Output, per-head weights and every gradient of the module against the
/// reference (loss: sum(output · R)), float64.
void expect_matches_reference(const MultiHeadAttentionOptions& options,
                              bool padding, bool causal) {
  MultiHeadAttention m(options);
  spread(m, 3);
  const int64_t N = 2, L = 7, E = options.embed_dim();
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto x = torch::randn({N, L, E}, f64).requires_grad_(true);
  torch::Tensor kpm;
  if (padding) {  // row 1: its last two tokens are padding
    kpm = torch::zeros({N, L}, torch::kBool);
    kpm[1].narrow(0, L - 2, 2).fill_(true);
  }
  auto R = torch::randn({N, L, E}, f64);
  torch::Tensor w, ref_w;
  family_tests::expect_same_gradients(
      m, x, R,
      [&] {
        auto [out, weights] =
            m->forward(x, {}, {}, kpm, /*need_weights=*/true, {},
                       /*average_attn_weights=*/false, causal);
        w = weights;
        return out;
      },
      [&] {
        auto [out, weights] = reference(*m, x, kpm, causal);
        ref_w = weights;
        return out;
      },
      1e-10, 1e-12, "");
  EXPECT_TRUE(torch::allclose(w, ref_w, 1e-10, 1e-12));
  // Averaged weights: the per-head ones' mean.
  auto [out2, w_avg] = m->forward(x, {}, {}, kpm, true, {}, true, causal);
  EXPECT_TRUE(torch::allclose(w_avg, ref_w.mean(1), 1e-10, 1e-12));
}

TEST(ModelFamilies, Qwen3HeadDimAndPerHeadNorm) {
  // Qwen3: head_dim != E / H, per-head RMSNorm before rotary, grouped heads.
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .head_dim(6)
                               .num_kv_heads(2)
                               .bias(false)
                               .rotary(true)
                               .qk_norm(QKNorm::kPerHead),
                           /*padding=*/true, /*causal=*/true);
}

TEST(ModelFamilies, Gemma3UnitOffsetNorm) {
  expect_matches_reference(MultiHeadAttentionOptions(16, 2)
                               .head_dim(8)
                               .num_kv_heads(1)
                               .bias(false)
                               .rotary(true)
                               .scale(0.2)
                               .qk_norm(QKNorm::kPerHead)
                               .qk_norm_unit_offset(true),
                           true, true);
}

TEST(ModelFamilies, Olmo2FullProjectionNorm) {
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .bias(false)
                               .rotary(true)
                               .qk_norm(QKNorm::kFull)
                               .qk_norm_eps(1e-5),
                           true, true);
}

TEST(ModelFamilies, Llama4L2NormAfterRotary) {
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .num_kv_heads(2)
                               .bias(false)
                               .rotary(true)
                               .qk_norm(QKNorm::kL2),
                           false, true);
}

TEST(ModelFamilies, Llama4ChunksAndTemperatureTuning) {
  mha::AttnTemperatureTuning tuning;
  tuning.floor_scale = 2.0;
  tuning.attn_scale = 0.5;
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .num_kv_heads(2)
                               .bias(false)
                               .rotary(true)
                               .rotary_pairing(mha::RotaryPairing::kHalf)
                               .qk_norm(QKNorm::kL2)
                               .attention_chunk_size(3),
                           // (padding would leave row 6, alone in its chunk,
                           // fully masked: 0 here, NaN in the reference)
                           /*padding=*/false, true);
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .num_kv_heads(2)
                               .bias(false)
                               .attn_temperature_tuning(tuning),
                           true, true);
}

TEST(ModelFamilies, GptOssSinks) {
  // Sinks with biases, grouped heads, padding; and without causality.
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .head_dim(8)
                               .num_kv_heads(2)
                               .rotary(true)
                               .attention_sinks(true),
                           true, true);
  expect_matches_reference(
      MultiHeadAttentionOptions(16, 4).attention_sinks(true), true, false);
}

TEST(ModelFamilies, Qwen3NextOutputGate) {
  expect_matches_reference(MultiHeadAttentionOptions(16, 4)
                               .head_dim(6)
                               .num_kv_heads(2)
                               .bias(false)
                               .rotary(true)
                               .qk_norm(QKNorm::kPerHead)
                               .qk_norm_unit_offset(true)
                               .output_gate(true),
                           true, true);
}

TEST(ModelFamilies, ParameterNamesAndShapes) {
  MultiHeadAttention m(MultiHeadAttentionOptions(16, 4)
                           .head_dim(6)
                           .num_kv_heads(2)
                           .qk_norm(QKNorm::kPerHead)
                           .attention_sinks(true)
                           .output_gate(true));
  auto p = m->named_parameters();
  EXPECT_EQ(p["q_proj_weight"].sizes(), (std::vector<int64_t>{48, 16}));
  EXPECT_EQ(p["k_proj_weight"].sizes(), (std::vector<int64_t>{12, 16}));
  EXPECT_EQ(p["in_proj_bias"].sizes(), (std::vector<int64_t>{72}));
  EXPECT_EQ(p["out_proj.weight"].sizes(), (std::vector<int64_t>{16, 24}));
  EXPECT_EQ(p["q_norm.weight"].sizes(), (std::vector<int64_t>{6}));
  EXPECT_EQ(p["k_norm.weight"].sizes(), (std::vector<int64_t>{6}));
  EXPECT_EQ(p["sinks"].sizes(), (std::vector<int64_t>{4}));
  EXPECT_TRUE(torch::equal(p["q_norm.weight"], torch::ones({6})));
  EXPECT_TRUE(torch::equal(p["sinks"], torch::zeros({4})));
  // A clone keeps the values.
  spread(m, 5);
  auto copy =
      std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(m->clone());
  EXPECT_TRUE(torch::equal(copy->named_parameters()["sinks"], m->sinks));
  EXPECT_TRUE(torch::equal(copy->named_parameters()["k_norm.weight"],
                           m->k_norm->weight));
}

TEST(ModelFamilies, CachedDecodingEqualsForward) {
  for (auto options :
       {MultiHeadAttentionOptions(16, 4)
            .head_dim(6)
            .num_kv_heads(2)
            .rotary(true)
            .qk_norm(QKNorm::kPerHead)
            .attention_sinks(true)
            .output_gate(true),
        MultiHeadAttentionOptions(16, 4).rotary(true).qk_norm(QKNorm::kFull),
        MultiHeadAttentionOptions(16, 4)
            .rotary(true)
            .qk_norm(QKNorm::kL2)
            .attention_chunk_size(4),
        MultiHeadAttentionOptions(16, 4).attn_temperature_tuning(
            mha::AttnTemperatureTuning{2.0, 0.5})}) {
    MultiHeadAttention m(options);
    spread(m, 7);
    auto x = torch::randn({2, 6, 16}, torch::kFloat64);
    auto [whole, w] = m->forward(x, {}, {}, {}, false, {}, true, true);
    torch::NoGradGuard no_grad;
    auto cache = m->make_kv_cache(2, 6);
    auto [first, w1] = m->forward_cached(x.narrow(1, 0, 3), cache);
    std::vector<torch::Tensor> parts{first};
    for (int64_t t = 3; t < 6; ++t) {
      parts.push_back(std::get<0>(m->forward_cached(x.narrow(1, t, 1), cache)));
    }
    EXPECT_TRUE(torch::allclose(torch::cat(parts, 1), whole, 1e-10, 1e-12));
  }
}

TEST(ModelFamilies, Float32AndBFloat16RunThrough) {
  MultiHeadAttention m(MultiHeadAttentionOptions(16, 4)
                           .head_dim(6)
                           .num_kv_heads(2)
                           .qk_norm(QKNorm::kPerHead)
                           .attention_sinks(true)
                           .output_gate(true));
  spread(m, 9);
  auto x = torch::randn({2, 5, 16}, torch::kFloat64);
  auto want = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));
  for (auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    auto copy =
        std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(m->clone());
    copy->to(dtype);
    auto got = std::get<0>(copy->forward(x.to(dtype), {}, {}, {}, false, {},
                                         true, true))
                   .to(torch::kFloat64);
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 5e-2;
    EXPECT_TRUE(torch::allclose(got, want, tol, tol))
        << dtype << ": " << (got - want).abs().max().item<double>();
  }
}

TEST(ModelFamilies, SeqFirstEqualsBatchFirst) {
  auto options = MultiHeadAttentionOptions(16, 4)
                     .head_dim(6)
                     .num_kv_heads(2)
                     .rotary(true)
                     .qk_norm(QKNorm::kPerHead)
                     .attention_sinks(true)
                     .output_gate(true);
  MultiHeadAttention m(options);
  spread(m, 12);
  MultiHeadAttention seq_first(options.batch_first(false));
  seq_first->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  for (const auto& p : m->named_parameters()) {
    seq_first->named_parameters()[p.key()].copy_(p.value());
  }
  auto x = torch::randn({2, 5, 16}, torch::kFloat64);
  auto want = std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));
  auto got = std::get<0>(
      seq_first->forward(x.transpose(0, 1), {}, {}, {}, false, {}, true, true));
  EXPECT_TRUE(torch::allclose(got.transpose(0, 1), want, 1e-12, 1e-12));
}

TEST(ModelFamilies, BadOptionsNameTheOption) {
  EXPECT_THROW_MSG(
      MultiHeadAttention(MultiHeadAttentionOptions(16, 4).head_dim(0)),
      "head_dim");
  EXPECT_THROW_MSG(
      MultiHeadAttention(MultiHeadAttentionOptions(16, 4).qk_norm_eps(-1.0)),
      "qk_norm_eps");
  EXPECT_THROW_MSG(
      MultiHeadAttention(
          MultiHeadAttentionOptions(16, 4).attention_chunk_size(0)),
      "attention_chunk_size");
  EXPECT_THROW_MSG(MultiHeadAttention(
                       MultiHeadAttentionOptions(16, 4).attn_temperature_tuning(
                           mha::AttnTemperatureTuning{0.0, 0.1})),
                   "floor_scale");
  EXPECT_THROW_MSG(
      MultiHeadAttention(
          MultiHeadAttentionOptions(16, 4).attention_sinks(true).add_bias_kv(
              true)),
      "attention_sinks");
  EXPECT_THROW_MSG(
      MultiHeadAttention(
          MultiHeadAttentionOptions(16, 4).head_dim(8).attention_kind(
              mha::AttentionKind::kLinear)),
      "head_dim");
  // E not divisible by H is fine with head_dim.
  MultiHeadAttention odd(MultiHeadAttentionOptions(10, 4).head_dim(4));
  EXPECT_EQ(std::get<0>(odd->forward(torch::randn({1, 3, 10}))).sizes(),
            (std::vector<int64_t>{1, 3, 10}));
  MultiHeadAttention normed(
      MultiHeadAttentionOptions(16, 4).qk_norm(QKNorm::kPerHead));
  EXPECT_THROW_MSG(normed->project_key_value(torch::randn({1, 3, 16}),
                                             torch::randn({1, 3, 16})),
                   "qk_norm");
}

TEST(FlexLogsumexp, GradientEqualsAutogradOfLogsumexp) {
  // loss = Σ out · R + Σ lse · G over the rows that see a key; a row that
  // sees none (row 0 of head 1, blocked by the mask_mod) has lse -inf and
  // no gradient. Blocked CPU path, float64, against torch's logsumexp.
  torch::manual_seed(11);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t B = 2, H = 2, L = 9, S = 11, D = 4;
  auto q = torch::randn({B, H, L, D}, f64).requires_grad_(true);
  auto k = torch::randn({B, H, S, D}, f64).requires_grad_(true);
  auto v = torch::randn({B, H, S, D}, f64).requires_grad_(true);
  mha::MaskMod mask = [](const torch::Tensor&, const torch::Tensor& h,
                         const torch::Tensor& qi, const torch::Tensor& kv) {
    return (kv <= qi + 1).logical_and((h == 0).logical_or(qi > 0));
  };
  auto block_mask = mha::create_block_mask(mask, c10::nullopt, H, L, S, 4);
  auto [out, lse] = mha::flex_attention(q, k, v, {}, block_mask, c10::nullopt,
                                        false, /*return_lse=*/true);
  auto R = torch::randn_like(out), G = torch::randn({B, H, L}, f64);
  auto seen = lse.isfinite();
  auto loss = (out * R).sum() + (lse.masked_fill(~seen, 0.0) * G).sum();
  auto got = torch::autograd::grad({loss}, {q, k, v});
  EXPECT_TRUE(torch::equal(seen.logical_not(),
                           torch::zeros_like(seen).index_put_(
                               {torch::indexing::Slice(), 1, 0}, true)));

  auto allowed = torch::zeros({1, H, L, S}, torch::kBool);
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t i = 0; i < L; ++i) {
      for (int64_t j = 0; j < S; ++j) {
        allowed[0][h][i][j] = j <= i + 1 && (h == 0 || i > 0);
      }
    }
  }
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(D));
  scores = scores.masked_fill(~allowed, -kInf);
  auto empty = (~allowed).all(-1, true);
  auto finite = scores.masked_fill(empty, 0.0);
  auto ref_lse = finite.logsumexp(-1).masked_fill(empty.squeeze(-1), -kInf);
  auto ref_out =
      torch::matmul(torch::softmax(finite, -1), v).masked_fill(empty, 0.0);
  EXPECT_TRUE(torch::allclose(lse, ref_lse, 1e-12, 1e-12));
  auto ref_loss =
      (ref_out * R).sum() + (ref_lse.masked_fill(~seen, 0.0) * G).sum();
  auto want = torch::autograd::grad({ref_loss}, {q, k, v});
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_TRUE(torch::allclose(got[i], want[i], 1e-10, 1e-12))
        << "input " << i << ": "
        << (got[i] - want[i]).abs().max().item<double>();
  }
}

// transformers 5.x's Qwen3Attention: the gradients of its input and of
// every parameter (q/k/v/o projections and both norms).
TEST(FamilyFixtures, Qwen3GradientsMatchTransformers) {
  const auto dir = fixtures::path("hf/qwen3");
  auto m = mha::hf::load_attention(dir, 0);
  family_tests::expect_gradients_match(
      dir, m,
      [&](const torch::Tensor& x) {
        return std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));
      },
      [](const std::string& ours) -> std::string {
        if (ours == "q_proj_weight") return "q_proj.weight";
        if (ours == "k_proj_weight") return "k_proj.weight";
        if (ours == "v_proj_weight") return "v_proj.weight";
        if (ours == "out_proj.weight") return "o_proj.weight";
        return ours;  // q_norm.weight, k_norm.weight
      });
}

// transformers 5.x's own modules (tests/fixtures/hf, written by
// scripts/make_hf_fixtures.py families): mha::hf::load_attention on each
// checkpoint equals the family's attention output and per-head weights,
// padded batch and cached decoding (a left-padded batch, prompt then three
// one-token steps), within float32 1e-5 + 1e-4 |ref|.
class FamilyFixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyFixtureTest, MatchesTransformers) {
  const std::string file =
      fixtures::path("hf/" + GetParam()) + "/reference.safetensors";
  const auto check = mha::parity::check_reference(file);
  EXPECT_DOUBLE_EQ(check.tolerance.atol, 1e-5);
  EXPECT_DOUBLE_EQ(check.tolerance.rtol, 1e-4);
  ASSERT_GE(check.parts.size(), 2u) << "output and weights";
  for (const auto& part : check.parts) {
    EXPECT_TRUE(part.within) << GetParam() << " " << part.what << ": max abs "
                             << part.max_abs << "; worst " << check.worst;
  }
  std::cout << "[ family   ] " << GetParam() << ": output max abs "
            << check.parts[0].max_abs << " (" << check.note << ")\n";
}

INSTANTIATE_TEST_SUITE_P(Families2025, FamilyFixtureTest,
                         ::testing::Values("qwen3", "qwen3_window",
                                           "qwen3_cache", "olmo2", "gpt_oss",
                                           "gpt_oss_full", "gpt_oss_cache",
                                           "gemma3", "gemma3_global",
                                           "qwen3_next", "llama4_chunked",
                                           "llama4_nope"));

// The options each family loads with, and that the fixtures catch one left
// out: Qwen3 and OLMo 2 without their norms' weights, gpt-oss without its
// sinks, Llama 4 without its chunks or its temperature tuning, Qwen3-Next's
// norms without the unit offset are outside the tolerance.
TEST(FamilyFixtures, OptionsAndWhatTheyCatch) {
  const auto qwen3 = mha::hf::attention_options(fixtures::path("hf/qwen3"), 0);
  EXPECT_EQ(qwen3.head_dim(), c10::optional<int64_t>(12));
  EXPECT_EQ(qwen3.qk_norm(), QKNorm::kPerHead);
  EXPECT_FALSE(qwen3.window().has_value());
  EXPECT_EQ(
      mha::hf::attention_options(fixtures::path("hf/qwen3_window"), 1).window(),
      c10::optional<int64_t>(3));
  const auto oss = mha::hf::attention_options(fixtures::path("hf/gpt_oss"), 0);
  EXPECT_TRUE(oss.attention_sinks());
  EXPECT_TRUE(oss.bias());
  EXPECT_EQ(oss.window(), c10::optional<int64_t>(3));
  EXPECT_EQ(mha::hf::attention_options(fixtures::path("hf/olmo2"), 0).qk_norm(),
            QKNorm::kFull);
  const auto gemma = mha::hf::attention_options(fixtures::path("hf/gemma3"), 0);
  EXPECT_TRUE(gemma.qk_norm_unit_offset());
  EXPECT_DOUBLE_EQ(*gemma.scale(), 1.0 / std::sqrt(20.0));
  EXPECT_EQ(gemma.window(), c10::optional<int64_t>(3));
  const auto next =
      mha::hf::attention_options(fixtures::path("hf/qwen3_next"), 1);
  EXPECT_TRUE(next.output_gate());
  EXPECT_EQ(next.rotary_dim(), c10::optional<int64_t>(4));
  EXPECT_THROW_MSG(
      mha::hf::attention_options(fixtures::path("hf/qwen3_next"), 0),
      "linear_attention");
  const auto chunked =
      mha::hf::attention_options(fixtures::path("hf/llama4_chunked"), 0);
  EXPECT_EQ(chunked.attention_chunk_size(), c10::optional<int64_t>(3));
  EXPECT_EQ(chunked.qk_norm(), QKNorm::kL2);
  EXPECT_EQ(chunked.rotary_pairing(), mha::RotaryPairing::kInterleaved);
  const auto nope =
      mha::hf::attention_options(fixtures::path("hf/llama4_nope"), 3);
  EXPECT_FALSE(nope.rotary());
  ASSERT_TRUE(nope.attn_temperature_tuning().has_value());
  EXPECT_DOUBLE_EQ(nope.attn_temperature_tuning()->floor_scale, 2.0);
  EXPECT_FALSE(nope.attention_chunk_size().has_value());

  auto fails_with = [](const std::string& name,
                       std::function<void(mha::MultiHeadAttentionImpl&)> edit) {
    const auto check = mha::parity::check_reference(
        fixtures::path("hf/" + name) + "/reference.safetensors", torch::kCPU,
        std::move(edit));
    EXPECT_FALSE(check.within) << name << " passes with the option changed";
  };
  fails_with("qwen3", [](mha::MultiHeadAttentionImpl& m) {
    torch::NoGradGuard no_grad;
    m.q_norm->weight.fill_(1.0);
    m.k_norm->weight.fill_(1.0);
  });
  fails_with("gpt_oss", [](mha::MultiHeadAttentionImpl& m) {
    torch::NoGradGuard no_grad;
    m.sinks.fill_(-1e4);  // no sink: a plain softmax
  });
  fails_with("llama4_chunked", [](mha::MultiHeadAttentionImpl& m) {
    m.options.attention_chunk_size(c10::nullopt);
  });
  fails_with("llama4_nope", [](mha::MultiHeadAttentionImpl& m) {
    m.options.attn_temperature_tuning(c10::nullopt);
  });
  fails_with("qwen3_next", [](mha::MultiHeadAttentionImpl& m) {
    m.options.qk_norm_unit_offset(false);
  });
  fails_with("olmo2", [](mha::MultiHeadAttentionImpl& m) {
    torch::NoGradGuard no_grad;
    m.k_norm->weight.fill_(1.0);
  });
}

/// transformers' name of an mha MultiHeadAttention parameter of a 2025
/// family (the packed q/k/v bias as its three parts).
std::string transformers_name(const std::string& ours) {
  if (ours == "q_proj_weight") return "q_proj.weight";
  if (ours == "k_proj_weight") return "k_proj.weight";
  if (ours == "v_proj_weight") return "v_proj.weight";
  if (ours == "in_proj_bias") return "q_proj.bias+k_proj.bias+v_proj.bias";
  if (ours.rfind("out_proj.", 0) == 0) return "o_proj." + ours.substr(9);
  return ours;  // q_norm.weight, k_norm.weight, sinks
}

// OLMo 2 (norms over the whole projections), gpt-oss's full layer
// (biases, sinks), Qwen3-Next's full layer (output gate, (1 + weight)
// norms), Gemma 3's global layer and Llama 4's NoPE layer (temperature
// tuning): the gradients of the input and every parameter against
// transformers' Olmo2Attention, GptOssAttention, Qwen3NextAttention,
// Gemma3Attention and Llama4TextAttention.
TEST(FamilyFixtures, MoreFamiliesGradientsMatchTransformers) {
  const std::vector<std::pair<std::string, int64_t>> cases{{"olmo2", 0},
                                                           {"gpt_oss_full", 1},
                                                           {"qwen3_next", 1},
                                                           {"gemma3_global", 1},
                                                           {"llama4_nope", 3}};
  for (const auto& [name, layer] : cases) {
    SCOPED_TRACE(name);
    const auto dir = fixtures::path("hf/" + name);
    auto m = mha::hf::load_attention(dir, layer);
    family_tests::expect_gradients_match(
        dir, m,
        [&](const torch::Tensor& x) {
          return std::get<0>(m->forward(x, {}, {}, {}, false, {}, true, true));
        },
        transformers_name);
  }
}

TEST(FamilyFixtures, ModuleLoadersNameTheModelTypeAndLayer) {
  // load_latent_attention and load_gated_delta_net refuse another family,
  // a layer out of range and a layer of the other kind by name.
  EXPECT_THROW_MSG(
      mha::hf::load_gated_delta_net(fixtures::path("hf/deepseek_v3"), 0),
      "model_type 'deepseek_v3' has no Gated DeltaNet layers (supported: "
      "qwen3_next)");
  EXPECT_THROW_MSG(
      mha::hf::load_latent_attention(fixtures::path("hf/qwen3"), 0),
      "model_type 'qwen3' has no Multi-head Latent Attention (supported: "
      "deepseek_v2, deepseek_v3)");
  EXPECT_THROW_MSG(
      mha::hf::load_latent_attention(fixtures::path("hf/deepseek_v3"), 9),
      "layer 9 out of range: the model has 1 layers");
  EXPECT_THROW_MSG(
      mha::hf::load_gated_delta_net(fixtures::path("hf/qwen3_next_linear"), 1),
      "layer_types[1] is 'full_attention', not a Gated DeltaNet layer");
}

TEST(FamilyFixtures, ParityRowsForLatentAttentionAndGatedDeltaNet) {
  // mha-parity --reference runs DeepSeek's MLA and Qwen3-Next's Gated
  // DeltaNet as their own modules: the recorded forward (and the Gated
  // DeltaNet's four decoding steps) pass at 1e-5 + 1e-4 |ref|, and a
  // planted fault in the output projection fails them.
  for (const std::string name :
       {"deepseek_v3", "deepseek_v2", "qwen3_next_linear"}) {
    SCOPED_TRACE(name);
    const auto file = fixtures::path("hf/" + name) + "/reference.safetensors";
    const auto check = mha::parity::check_reference(file);
    EXPECT_TRUE(check.within) << check.worst;
    const bool steps = name == "qwen3_next_linear";
    ASSERT_EQ(check.parts.size(), steps ? 5u : 1u);
    EXPECT_EQ(check.parts[0].what, "output");
    EXPECT_EQ(check.skipped_rows, 2);  // the padded forward's two rows
    EXPECT_NE(check.note.find(steps ? "Gated DeltaNet" : "Latent"),
              std::string::npos)
        << check.note;
    const auto faulty = mha::parity::check_reference(
        file, torch::kCPU, {}, [&](torch::nn::Module& m) {
          auto params = m.named_parameters();
          auto* w = params.find(steps ? "out_proj.weight" : "o_proj.weight");
          ASSERT_NE(w, nullptr);
          w->index_put_({0, 0}, (*w)[0][0] + 0.1);
        });
    EXPECT_FALSE(faulty.within);
  }
}

}  // namespace model_families_tests
