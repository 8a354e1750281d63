// mha::MultiHeadLatentAttention (DeepSeek-V2/V3's MLA) against a float64
// reference written here from transformers' DeepseekV3Attention (outputs
// and every gradient), its latent cache (the absorbed path equal to the
// naive one, decoding equal to forward, kv_lora_rank + qk_rope_head_dim
// numbers per token), and transformers 5.x's own modules through
// mha::hf::load_latent_attention (tests/fixtures/hf/deepseek_v*).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "family_gradients.h"
#include "fixture_helpers.h"
#include "mha/hf.h"
#include "mha/latent_attention.h"
#include "mha/parity.h"
#include "mha/state_dict.h"
#include "test_helpers.h"

namespace latent_attention_tests {

using mha::LatentPath;
using mha::MultiHeadLatentAttention;
using mha::MultiHeadLatentAttentionOptions;

constexpr double kInf = std::numeric_limits<double>::infinity();

MultiHeadLatentAttentionOptions small(int64_t q_lora_rank) {
  return MultiHeadLatentAttentionOptions(16, 4)
      .q_lora_rank(q_lora_rank)
      .kv_lora_rank(10)
      .qk_nope_head_dim(8)
      .qk_rope_head_dim(4)
      .v_head_dim(6);
}

MultiHeadLatentAttention make(const MultiHeadLatentAttentionOptions& o,
                              uint64_t seed) {
  MultiHeadLatentAttention m(o);
  m->to(torch::kFloat64);
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    p.normal_(0.0, 0.3);
  }
  return m;
}

torch::Tensor rms(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return w * x * torch::rsqrt(x.pow(2).mean(-1, true) + eps);
}

torch::Tensor linear(const torch::nn::Linear& l, const torch::Tensor& x) {
  auto y = torch::matmul(x, l->weight.t());
  return l->bias.defined() ? y + l->bias : y;
}

/// DeepseekV3Attention written plainly: x (N, L, E), key_padding (N, L)
/// bool or undefined, causal, positions 0..L-1.
torch::Tensor reference(const mha::MultiHeadLatentAttentionImpl& m,
                        const torch::Tensor& x, const torch::Tensor& kpm) {
  const auto& o = m.options;
  const int64_t N = x.size(0), L = x.size(1), H = o.num_heads();
  const int64_t r = o.kv_lora_rank(), dn = o.qk_nope_head_dim();
  const int64_t dr = o.qk_rope_head_dim(), dv = o.v_head_dim();
  auto q = m.q_proj
               ? linear(m.q_proj, x)
               : linear(m.q_b_proj, rms(linear(m.q_a_proj, x),
                                        m.q_a_layernorm->weight, o.norm_eps()));
  q = q.view({N, L, H, dn + dr}).transpose(1, 2);
  auto ckv = linear(m.kv_a_proj_with_mqa, x);
  auto c = rms(ckv.narrow(2, 0, r), m.kv_a_layernorm->weight, o.norm_eps());
  auto kv = linear(m.kv_b_proj, c).view({N, L, H, dn + dv}).transpose(1, 2);
  auto rotate = [&](const torch::Tensor& t) {  // interleaved pairs
    auto pos = torch::arange(L, t.options()).view({L, 1});
    auto freq = torch::pow(o.rotary_theta(),
                           -torch::arange(0, dr, 2, t.options()) / dr);
    auto angle = pos * freq;  // (L, dr / 2)
    auto a = t.slice(-1, 0, dr, 2), b = t.slice(-1, 1, dr, 2);
    auto ra = a * angle.cos() - b * angle.sin();
    auto rb = a * angle.sin() + b * angle.cos();
    return torch::stack({ra, rb}, -1).flatten(-2);
  };
  auto q_full =
      torch::cat({q.narrow(3, 0, dn), rotate(q.narrow(3, dn, dr))}, 3);
  auto k_rot = rotate(ckv.narrow(2, r, dr)).unsqueeze(1).expand({N, H, L, dr});
  auto k = torch::cat({kv.narrow(3, 0, dn), k_rot}, 3);
  auto scores = torch::matmul(q_full, k.transpose(-2, -1)) * m.softmax_scale();
  auto blocked = torch::ones({L, L}, x.options().dtype(torch::kBool)).triu(1);
  auto b4 = blocked.view({1, 1, L, L});
  if (kpm.defined()) {
    b4 = b4.logical_or(kpm.view({N, 1, 1, L}));
  }
  auto w = torch::softmax(scores.masked_fill(b4, -kInf), -1);
  auto out = torch::matmul(w, kv.narrow(3, dn, dv));
  return linear(m.o_proj, out.transpose(1, 2).reshape({N, L, H * dv}));
}

TEST(LatentAttention, ForwardAndGradientsEqualReference) {
  for (int64_t q_lora : {0, 12}) {
    auto m = make(small(q_lora).bias(q_lora > 0), 1);
    auto x = torch::randn({2, 7, 16}, torch::kFloat64).requires_grad_(true);
    auto kpm = torch::zeros({2, 7}, torch::kBool);
    kpm[1].narrow(0, 5, 2).fill_(true);  // right padding, no empty row
    auto R = torch::randn({2, 7, 16}, torch::kFloat64);
    family_tests::expect_same_gradients(
        m, x, R, [&] { return m->forward(x, kpm); },
        [&] { return reference(*m, x, kpm); }, 1e-10, 1e-12,
        "q_lora_rank " + std::to_string(q_lora) + ": ");
  }
}

TEST(LatentAttention, ParameterNamesAreTransformers) {
  std::vector<std::string> names;
  for (const auto& p :
       MultiHeadLatentAttention(small(12).bias(true))->named_parameters()) {
    names.push_back(p.key());
  }
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "q_a_proj.weight", "q_a_proj.bias", "q_a_layernorm.weight",
                "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
                "kv_a_proj_with_mqa.bias", "kv_a_layernorm.weight",
                "kv_b_proj.weight", "o_proj.weight", "o_proj.bias"}));
}

// A left-padded batch decoded through one latent cache: prompt, then
// single tokens; naive and absorbed paths equal (float64 1e-12), both
// equal to forward over the whole sequence, and the cache holds
// kv_lora_rank + qk_rope_head_dim numbers per token, nothing per head.
TEST(LatentAttention, AbsorbedEqualsNaiveAndDecodingEqualsForward) {
  auto m = make(small(12), 2);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({2, 8, 16}, torch::kFloat64);
  auto whole = m->forward(x);
  auto naive = m->make_cache(2, 8), absorbed = m->make_cache(2, 8);
  EXPECT_EQ(naive.numbers_per_token(), 10 + 4);
  std::vector<torch::Tensor> parts;
  for (auto [t0, T] :
       {std::pair<int64_t, int64_t>{0, 5}, {5, 1}, {6, 1}, {7, 1}}) {
    auto step = x.narrow(1, t0, T);
    auto a = m->forward_cached(step, naive, true, {}, {}, LatentPath::kNaive);
    auto b =
        m->forward_cached(step, absorbed, true, {}, {}, LatentPath::kAbsorbed);
    EXPECT_TRUE(torch::allclose(a, b, 1e-12, 1e-12))
        << "step at " << t0 << ": " << (a - b).abs().max().item<double>();
    parts.push_back(b);
  }
  EXPECT_TRUE(torch::allclose(torch::cat(parts, 1), whole, 1e-10, 1e-12));
  EXPECT_EQ(absorbed.latent().numel() + absorbed.rotary_key().numel(),
            2 * 8 * (10 + 4));
  // Left padding: keys blocked by key_padding_mask, positions from 0 at
  // the first token, as HF's generate.
  auto kpm = torch::zeros({2, 8}, torch::kBool);
  kpm[1].narrow(0, 0, 2).fill_(true);
  auto pos = torch::tensor({0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 0, 1, 2, 3, 4, 5})
                 .view({2, 8});
  auto padded = m->make_cache(2, 8), padded2 = m->make_cache(2, 8);
  auto a = m->forward_cached(x, padded, true, kpm, pos, LatentPath::kNaive);
  auto b = m->forward_cached(x, padded2, true, kpm, pos, LatentPath::kAbsorbed);
  EXPECT_TRUE(torch::allclose(a, b, 1e-12, 1e-12));
  // Sequence 1 alone, without its pads.
  auto alone = m->forward(x[1].narrow(0, 2, 6).unsqueeze(0));
  EXPECT_TRUE(torch::allclose(a[1].narrow(0, 2, 6), alone[0], 1e-10, 1e-12));
}

TEST(LatentAttention, SeqFirstEqualsBatchFirst) {
  auto m = make(small(12), 4);
  auto seq_first = make(small(12).batch_first(false), 4);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({2, 5, 16}, torch::kFloat64);
  auto want = m->forward(x);
  EXPECT_TRUE(
      torch::allclose(seq_first->forward(x.transpose(0, 1)).transpose(0, 1),
                      want, 1e-12, 1e-12));
  auto cache = seq_first->make_cache(2, 5);
  auto cached = seq_first->forward_cached(x.transpose(0, 1), cache);
  EXPECT_TRUE(torch::allclose(cached.transpose(0, 1), want, 1e-10, 1e-12));
}

TEST(LatentAttention, AutoPathAndErrors) {
  // V3's ranks and head sizes (the choice does not depend on E or H).
  MultiHeadLatentAttention v3(MultiHeadLatentAttentionOptions(64, 16));
  EXPECT_EQ(v3->auto_path(1, 16384), LatentPath::kAbsorbed);
  EXPECT_EQ(v3->auto_path(2048, 2048), LatentPath::kNaive);
  auto cache = v3->make_cache(1, 4);
  EXPECT_EQ(cache.numbers_per_token(), 576);  // DeepSeek-V3's latent cache
  EXPECT_THROW_MSG(MultiHeadLatentAttention(small(0).qk_rope_head_dim(3)),
                   "qk_rope_head_dim");
  EXPECT_THROW_MSG(MultiHeadLatentAttention(small(-1)), "q_lora_rank");
  auto m = make(small(0), 3);
  EXPECT_THROW_MSG(m->forward(torch::randn({2, 3, 15}, torch::kFloat64)),
                   "x must be");
  EXPECT_THROW_MSG(m->forward(torch::randn({2, 3, 16}, torch::kFloat64),
                              torch::zeros({2, 4}, torch::kBool)),
                   "key_padding_mask");
  auto full = m->make_cache(2, 2);
  torch::NoGradGuard no_grad;
  EXPECT_THROW_MSG(
      m->forward_cached(torch::randn({2, 3, 16}, torch::kFloat64), full),
      "room");
}

// transformers 5.x's DeepseekV3Attention (query latent, yarn with
// mscale_all_dim) and DeepseekV2Attention (q_proj), loaded from their
// checkpoints: the recorded output of a right-padded batch, float32 1e-5 +
// 1e-4 |ref|; naive and absorbed decoding of the same tokens agree.
TEST(LatentAttention, LoadedCheckpointsMatchTransformers) {
  for (const std::string name : {"deepseek_v3", "deepseek_v2"}) {
    const auto dir = fixtures::path("hf/" + name);
    const auto ref =
        mha::parity::read_reference(dir + "/reference.safetensors");
    auto m = mha::hf::load_latent_attention(dir, 0);
    const auto x = ref.tensors["hidden_states"];
    const auto want = ref.tensors["output"];
    const auto keep = ref.tensors["attention_mask"] != 0;  // (N, L)
    torch::NoGradGuard no_grad;
    auto got = m->forward(x, ~keep, true, ref.tensors["position_ids"]);
    // Padded query rows are HF's garbage: compare the kept ones.
    auto rows = keep.unsqueeze(-1).expand_as(got);
    auto err = (got - want).abs().masked_select(rows);
    auto bound = (1e-5 + 1e-4 * want.abs()).masked_select(rows);
    EXPECT_TRUE(err.le(bound).all().item<bool>())
        << name << ": max abs " << err.max().item<double>();
    std::cout << "[ mla      ] " << name << ": output max abs "
              << err.max().item<double>() << "\n";
    auto cache = m->make_cache(x.size(0), x.size(1));
    auto cached =
        m->forward_cached(x, cache, true, ~keep, {}, LatentPath::kAbsorbed);
    EXPECT_TRUE(torch::allclose(cached.masked_select(rows),
                                got.masked_select(rows), 1e-5, 1e-4));
  }
  const auto v3 =
      mha::hf::load_latent_attention(fixtures::path("hf/deepseek_v3"), 0);
  EXPECT_EQ(v3->options.q_lora_rank(), 12);
  EXPECT_EQ(v3->options.rotary_scaling().rope_type, "yarn");
  // yarn's mscale² (mscale_all_dim 1, factor 4) in the scale.
  const double m = 0.1 * std::log(4.0) + 1.0;
  EXPECT_NEAR(v3->softmax_scale(), m * m / std::sqrt(12.0), 1e-12);
}

// transformers 5.x's DeepseekV3Attention: the gradients of its input and of
// every parameter (same names).
TEST(LatentAttention, GradientsMatchTransformers) {
  const auto dir = fixtures::path("hf/deepseek_v3");
  auto m = mha::hf::load_latent_attention(dir, 0);
  family_tests::expect_gradients_match(
      dir, m, [&](const torch::Tensor& x) { return m->forward(x); },
      [](const std::string& ours) { return ours; });
}

// DeepseekV2Attention (a plain q_proj, V2's scale): the same.
TEST(LatentAttention, V2GradientsMatchTransformers) {
  const auto dir = fixtures::path("hf/deepseek_v2");
  auto m = mha::hf::load_latent_attention(dir, 0);
  family_tests::expect_gradients_match(
      dir, m, [&](const torch::Tensor& x) { return m->forward(x); },
      [](const std::string& ours) { return ours; });
}

}  // namespace latent_attention_tests
