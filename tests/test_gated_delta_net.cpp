// mha::GatedDeltaNet (Qwen3-Next's linear attention) against a plain loop
// over the delta rule written here from the paper and transformers'
// Qwen3NextGatedDeltaNet, in float64 (transformers' kernels compute in
// float32): the chunked form == the recurrent form == the loop, gradients
// equal the loop's and a central difference; and transformers 5.x's own
// module through mha::hf::load_gated_delta_net (tests/fixtures/hf/
// qwen3_next_linear): a padded batch and four decoding steps.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "core/delta_rule.h"
#include "family_gradients.h"
#include "fixture_helpers.h"
#include "mha/gated_delta_net.h"
#include "mha/hf.h"
#include "mha/state_dict.h"
#include "test_helpers.h"

namespace gated_delta_net_tests {

using mha::GatedDeltaNet;
using mha::GatedDeltaNetOptions;

GatedDeltaNetOptions small() {
  return GatedDeltaNetOptions(12)
      .num_key_heads(2)
      .num_value_heads(4)
      .key_head_dim(3)
      .value_head_dim(5)
      .conv_kernel_dim(3)
      .chunk_size(4);
}

GatedDeltaNet make(uint64_t seed) {
  GatedDeltaNet m(small());
  m->to(torch::kFloat64);
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) {
    p.normal_(0.0, 0.4);
  }
  return m;
}

/// The layer token by token: x (N, L, E) float64, padded tokens zeroed.
torch::Tensor reference(const mha::GatedDeltaNetImpl& m, torch::Tensor x,
                        const torch::Tensor& kpm) {
  const auto& o = m.options;
  const int64_t N = x.size(0), L = x.size(1), Hk = o.num_key_heads();
  const int64_t Hv = o.num_value_heads(), G = Hv / Hk;
  const int64_t dk = o.key_head_dim(), dv = o.value_head_dim();
  const int64_t K = o.conv_kernel_dim();
  if (kpm.defined()) {
    x = x.masked_fill(kpm.unsqueeze(-1), 0.0);
  }
  auto qkvz = torch::matmul(x, m.in_proj_qkvz->weight.t())
                  .view({N, L, Hk, 2 * dk + 2 * G * dv});
  auto ba = torch::matmul(x, m.in_proj_ba->weight.t()).view({N, L, Hk, 2 * G});
  auto mixed = torch::cat({qkvz.narrow(3, 0, dk).reshape({N, L, -1}),
                           qkvz.narrow(3, dk, dk).reshape({N, L, -1}),
                           qkvz.narrow(3, 2 * dk, G * dv).reshape({N, L, -1})},
                          2);  // (N, L, channels)
  auto z = qkvz.narrow(3, 2 * dk + G * dv, G * dv).reshape({N, L, Hv, dv});
  auto b = ba.narrow(3, 0, G).reshape({N, L, Hv});
  auto a = ba.narrow(3, G, G).reshape({N, L, Hv});
  // Causal depthwise convolution: out[t] = Σ_j w[j] · in[t - (K - 1) + j].
  auto w = m.conv1d->weight.squeeze(1);  // (channels, K)
  std::vector<torch::Tensor> conv;
  for (int64_t t = 0; t < L; ++t) {
    auto acc = torch::zeros_like(mixed.select(1, 0));
    for (int64_t j = 0; j < K; ++j) {
      const int64_t s = t - (K - 1) + j;
      if (s >= 0) {
        acc = acc + mixed.select(1, s) * w.select(1, j);
      }
    }
    conv.push_back(torch::silu(acc));
  }
  auto c = torch::stack(conv, 1);  // (N, L, channels)
  auto q = c.narrow(2, 0, Hk * dk).view({N, L, Hk, dk});
  auto k = c.narrow(2, Hk * dk, Hk * dk).view({N, L, Hk, dk});
  auto v = c.narrow(2, 2 * Hk * dk, Hv * dv).view({N, L, Hv, dv});
  q = q.repeat_interleave(G, 2);
  k = k.repeat_interleave(G, 2);
  auto l2 = [](const torch::Tensor& t) {
    return t / torch::sqrt((t * t).sum(-1, true) + 1e-6);
  };
  q = l2(q) / std::sqrt(double(dk));
  k = l2(k);
  auto beta = torch::sigmoid(b);
  auto g = -m.A_log.exp() * torch::softplus(a + m.dt_bias);  // (N, L, Hv)
  auto S = torch::zeros({N, Hv, dk, dv}, x.options());
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < L; ++t) {
    S = S * g.select(1, t).exp().view({N, Hv, 1, 1});
    auto k_t = k.select(1, t);                      // (N, Hv, dk)
    auto memory = (S * k_t.unsqueeze(-1)).sum(-2);  // (N, Hv, dv)
    auto delta = (v.select(1, t) - memory) * beta.select(1, t).unsqueeze(-1);
    S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2);
    out.push_back((S * q.select(1, t).unsqueeze(-1)).sum(-2));
  }
  auto o_t = torch::stack(out, 1);  // (N, L, Hv, dv)
  auto normed = o_t / torch::sqrt(o_t.pow(2).mean(-1, true) + o.norm_eps());
  auto gated = m.norm->weight * normed * torch::silu(z);
  return torch::matmul(gated.reshape({N, L, Hv * dv}), m.out_proj->weight.t());
}

TEST(GatedDeltaNet, ChunkedEqualsTheLoopWithGradients) {
  auto m = make(1);
  auto x = torch::randn({2, 10, 12}, torch::kFloat64).requires_grad_(true);
  auto kpm = torch::zeros({2, 10}, torch::kBool);
  kpm[1].narrow(0, 7, 3).fill_(true);
  auto R = torch::randn({2, 10, 12}, torch::kFloat64);
  family_tests::expect_same_gradients(
      m, x, R, [&] { return m->forward(x, kpm); },  // chunks 4 + 4 + 2
      [&] { return reference(*m, x, kpm); }, 1e-12, 1e-12, "");
  // A central difference on one A_log entry and one dt_bias entry.
  torch::NoGradGuard no_grad;
  for (auto* p : {&m->A_log, &m->dt_bias}) {
    const double h = 1e-6;
    const double before = (*p)[1].item<double>();
    (*p)[1].fill_(before + h);
    const double up = (m->forward(x, kpm) * R).sum().item<double>();
    (*p)[1].fill_(before - h);
    const double down = (m->forward(x, kpm) * R).sum().item<double>();
    (*p)[1].fill_(before);
    const auto name = p == &m->A_log ? "A_log" : "dt_bias";
    const double analytic =
        m->named_parameters()[name].grad()[1].item<double>();
    EXPECT_NEAR((up - down) / (2 * h), analytic,
                1e-6 * (1 + std::abs(analytic)))
        << name;
  }
}

TEST(GatedDeltaNet, RecurrentAndChunkedDecodingEqualForward) {
  auto m = make(2);
  torch::NoGradGuard no_grad;
  auto x = torch::randn({2, 11, 12}, torch::kFloat64);
  auto whole = m->forward(x);
  auto state = m->make_state(2);
  const auto state_sizes = state.recurrent.sizes().vec();
  std::vector<torch::Tensor> parts;
  parts.push_back(m->forward_cached(x.narrow(1, 0, 6), state));  // chunked
  for (int64_t t = 6; t < 9; ++t) {
    parts.push_back(m->forward_cached(x.narrow(1, t, 1), state));  // recurrent
  }
  parts.push_back(m->forward_cached(x.narrow(1, 9, 2), state));  // chunked
  EXPECT_TRUE(torch::allclose(torch::cat(parts, 1), whole, 1e-12, 1e-12))
      << (torch::cat(parts, 1) - whole).abs().max().item<double>();
  EXPECT_EQ(state.tokens, 11);
  EXPECT_EQ(state.recurrent.sizes().vec(), state_sizes);  // constant size
  EXPECT_EQ(state.conv.size(2), 2);                       // K - 1 inputs
  // Chunk sizes do not change the result.
  auto other = make(2);
  other->options.chunk_size(3);
  EXPECT_TRUE(torch::allclose(other->forward(x), whole, 1e-12, 1e-12));
}

/// The delta rule token by token (core/delta_rule.h's equations): q, k
/// (B, L, dk), v (B, L, dv), g, beta (B, L), S (B, dk, dv).
std::pair<torch::Tensor, torch::Tensor> delta_rule_loop(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& g, const torch::Tensor& beta, torch::Tensor S) {
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < q.size(1); ++t) {
    S = S * g.select(1, t).exp().view({-1, 1, 1});
    const auto k_t = k.select(1, t);
    const auto memory = (S * k_t.unsqueeze(-1)).sum(1);  // Sᵀ k (B, dv)
    const auto delta =
        (v.select(1, t) - memory) * beta.select(1, t).unsqueeze(-1);
    S = S + k_t.unsqueeze(-1) * delta.unsqueeze(1);
    out.push_back((S * q.select(1, t).unsqueeze(-1)).sum(1));
  }
  return {torch::stack(out, 1), S};
}

TEST(GatedDeltaNet, KernelEqualsTheLoopWithStateGradients) {
  // The CPU walk against the loop, from a nonzero starting state, for
  // chunks of 1, 4 (a partial last chunk) and longer than the sequence;
  // the gradients of every input, the starting state's included, through
  // the output and the final state.
  torch::manual_seed(11);
  const int64_t B = 3, L = 10, dk = 3, dv = 5;
  auto leaf = [](torch::Tensor t) { return t.requires_grad_(true); };
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  auto q = leaf(torch::randn({B, L, dk}, opts));
  auto k = leaf(torch::nn::functional::normalize(
                    torch::randn({B, L, dk}, opts),
                    torch::nn::functional::NormalizeFuncOptions().dim(-1))
                    .detach());
  auto v = leaf(torch::randn({B, L, dv}, opts));
  auto g = leaf(-torch::rand({B, L}, opts));
  auto beta = leaf(torch::rand({B, L}, opts));
  auto S0 = leaf(torch::randn({B, dk, dv}, opts));
  const auto Ro = torch::randn({B, L, dv}, opts);
  const auto Rs = torch::randn({B, dk, dv}, opts);
  const std::vector<torch::Tensor> inputs{q, k, v, g, beta, S0};
  auto gradients = [&](const std::pair<torch::Tensor, torch::Tensor>& r) {
    return torch::autograd::grad({(r.first * Ro).sum() + (r.second * Rs).sum()},
                                 inputs);
  };
  const auto ref = delta_rule_loop(q, k, v, g, beta, S0);
  const auto ref_grads = gradients(ref);
  for (int64_t chunk : {1, 4, 16}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const auto got = mha::detail::gated_delta_rule(q, k, v, g, beta, S0, chunk);
    EXPECT_TRUE(torch::allclose(got.first, ref.first, 1e-12, 1e-12));
    EXPECT_TRUE(torch::allclose(got.second, ref.second, 1e-12, 1e-12));
    const auto got_grads = gradients(got);
    for (size_t i = 0; i < inputs.size(); ++i) {
      EXPECT_TRUE(torch::allclose(got_grads[i], ref_grads[i], 1e-12, 1e-12))
          << "input " << i << ": max abs "
          << (got_grads[i] - ref_grads[i]).abs().max().item<double>();
    }
  }
  // float32 within its rounding, and the final state too, without
  // gradients (no chunk states kept).
  torch::NoGradGuard no_grad;
  const auto f32 = mha::detail::gated_delta_rule(
      q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32),
      g.to(torch::kFloat32), beta.to(torch::kFloat32), S0.to(torch::kFloat32),
      4);
  EXPECT_TRUE(
      torch::allclose(f32.first.to(torch::kFloat64), ref.first, 1e-4, 1e-5));
  EXPECT_TRUE(
      torch::allclose(f32.second.to(torch::kFloat64), ref.second, 1e-4, 1e-5));
  EXPECT_FALSE(f32.first.requires_grad());
}

TEST(GatedDeltaNet, ConvolutionEqualsConv1dWithGradients) {
  // The channels-last convolution against torch::conv1d over [context; x]
  // then SiLU, in float64: output and the gradients of x, the context and
  // the weights; T below and above K - 1.
  torch::manual_seed(12);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  const int64_t N = 2, ch = 70, K = 4;  // 70: a partial block of channels
  for (int64_t T : {1, 9}) {
    SCOPED_TRACE("T " + std::to_string(T));
    auto x = torch::randn({N, T, ch}, opts).requires_grad_(true);
    auto ctx = torch::randn({N, K - 1, ch}, opts).requires_grad_(true);
    auto w = torch::randn({ch, K}, opts).requires_grad_(true);
    const auto R = torch::randn({N, T, ch}, opts);
    const auto got = mha::detail::causal_conv_silu(x, ctx, w);
    namespace F = torch::nn::functional;
    const auto ref =
        torch::silu(F::conv1d(torch::cat({ctx, x}, 1).transpose(1, 2),
                              w.unsqueeze(1),
                              F::Conv1dFuncOptions().groups(ch)))
            .transpose(1, 2);
    EXPECT_TRUE(torch::allclose(got, ref, 1e-12, 1e-12));
    const std::vector<torch::Tensor> inputs{x, ctx, w};
    const auto g_got = torch::autograd::grad({(got * R).sum()}, inputs);
    const auto g_ref = torch::autograd::grad({(ref * R).sum()}, inputs);
    for (size_t i = 0; i < g_got.size(); ++i) {
      EXPECT_TRUE(torch::allclose(g_got[i], g_ref[i], 1e-12, 1e-12))
          << "input " << i;
    }
  }
}

TEST(GatedDeltaNet, BFloat16FollowsFloat32) {
  // A bfloat16 module (its convolution through torch::conv1d, the delta
  // rule in float32) against the same weights in float32: within
  // bfloat16's rounding of the inputs, weights and output.
  auto m = make(13);
  m->to(torch::kFloat32);
  auto half = std::dynamic_pointer_cast<mha::GatedDeltaNetImpl>(m->clone());
  half->to(torch::kBFloat16);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({2, 9, 12}).to(torch::kBFloat16);
  const auto ref = m->forward(x.to(torch::kFloat32));
  const auto got = half->forward(x);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(torch::allclose(got.to(torch::kFloat32), ref, 0.05, 0.05))
      << "max abs "
      << (got.to(torch::kFloat32) - ref).abs().max().item<float>();
}

TEST(GatedDeltaNet, LongInputsRunInSegmentsWithTheSameResult) {
  // forward walks inputs longer than 8192 tokens in segments carrying the
  // state; forward_cached from a fresh state takes them in one call.
  auto m = make(14);
  torch::NoGradGuard no_grad;
  const auto x = torch::randn({1, 8192 + 37, 12}, torch::kFloat64);
  auto state = m->make_state(1);
  const auto whole = m->forward_cached(x, state);
  EXPECT_TRUE(torch::allclose(m->forward(x), whole, 1e-10, 1e-12));
}

TEST(GatedDeltaNet, SeqFirstEqualsBatchFirst) {
  auto m = make(5);
  GatedDeltaNet seq_first(small().batch_first(false));
  seq_first->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  for (const auto& p : m->named_parameters()) {
    seq_first->named_parameters()[p.key()].copy_(p.value());
  }
  auto x = torch::randn({2, 8, 12}, torch::kFloat64);  // 8: whole chunks
  EXPECT_TRUE(
      torch::allclose(seq_first->forward(x.transpose(0, 1)).transpose(0, 1),
                      m->forward(x), 1e-12, 1e-12));
}

TEST(GatedDeltaNet, BadInputsNameTheArgument) {
  EXPECT_THROW_MSG(GatedDeltaNet(small().num_value_heads(3)),
                   "num_value_heads");
  auto m = make(3);
  EXPECT_THROW_MSG(m->forward(torch::randn({2, 3, 11}, torch::kFloat64)),
                   "x must be");
  EXPECT_THROW_MSG(m->forward(torch::randn({2, 3, 12}, torch::kFloat64),
                              torch::zeros({2, 4}, torch::kBool)),
                   "key_padding_mask");
  auto state = m->make_state(1);
  EXPECT_THROW_MSG(
      m->forward_cached(torch::randn({2, 1, 12}, torch::kFloat64), state),
      "state must be");
  EXPECT_THROW_MSG(
      mha::hf::load_gated_delta_net(fixtures::path("hf/qwen3_next"), 1),
      "full_attention");
}

// transformers 5.x's Qwen3NextGatedDeltaNet (its torch fallback kernels,
// float32): a right-padded batch and a prompt + three decoding steps
// through its cache, float32 1e-5 + 1e-4 |ref|.
TEST(GatedDeltaNet, LoadedCheckpointMatchesTransformers) {
  const auto dir = fixtures::path("hf/qwen3_next_linear");
  auto m = mha::hf::load_gated_delta_net(dir, 0);
  auto ref_tensors = mha::read_state_dict(dir + "/reference.safetensors");
  torch::NoGradGuard no_grad;
  auto close = [](const torch::Tensor& got, const torch::Tensor& want,
                  const std::string& what) {
    const auto err = (got - want).abs();
    EXPECT_TRUE(err.le(1e-5 + 1e-4 * want.abs()).all().item<bool>())
        << what << ": max abs " << err.max().item<double>();
    std::cout << "[ gdn      ] " << what << ": max abs "
              << err.max().item<double>() << "\n";
  };
  const auto keep = ref_tensors["attention_mask"] != 0;
  auto out = m->forward(ref_tensors["hidden_states"], ~keep);
  const auto rows = keep.unsqueeze(-1).expand_as(out);
  close(out.masked_select(rows), ref_tensors["output"].masked_select(rows),
        "padded batch");
  auto state = m->make_state(2);
  for (int k = 0; k < 4; ++k) {
    const auto step = "step" + std::to_string(k);
    close(m->forward_cached(ref_tensors[step + ".hidden_states"], state),
          ref_tensors[step + ".output"], step);
  }
}

// transformers 5.x's Qwen3NextGatedDeltaNet: the gradients of its input and
// of every parameter (same names).
TEST(GatedDeltaNet, GradientsMatchTransformers) {
  const auto dir = fixtures::path("hf/qwen3_next_linear");
  auto m = mha::hf::load_gated_delta_net(dir, 0);
  family_tests::expect_gradients_match(
      dir, m, [&](const torch::Tensor& x) { return m->forward(x); },
      [](const std::string& ours) { return ours; });
}

}  // namespace gated_delta_net_tests
