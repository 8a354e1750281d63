// Tests of mha::MultiHeadAttention: parity with torch::nn::MultiheadAttention
// (outputs, weights, gradients of inputs and parameters), the cases where
// LibTorch's module is wrong (checked against a float64 reference), masks,
// dropout, errors and module plumbing.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <limits>
#include <sstream>

#include "mha/mha.h"
#include "mha/parity.h"
#include "test_helpers.h"

// Outside the anonymous namespace: tests after its end derive from it.
class MultiHeadAttentionTest : public SeededTest {};

namespace {

/// Copies parameters by name between two mha modules of the same shapes.
void copy_parameters(const torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) {
    p.value().copy_(source[p.key()]);
  }
}

/// One configuration of the parity test against torch::nn.
struct ParityConfig {
  std::string name;
  int64_t E = 8, H = 2, N = 3, L = 4, S = 6;
  c10::optional<int64_t> kdim, vdim;
  bool self_attention = false;
  bool bias = true, add_bias_kv = false, add_zero_attn = false;
  bool batch_first = true;
  bool padding = false;     // bool key_padding_mask
  bool float_attn = false;  // float (L, S) attn_mask
  bool causal = false;      // is_causal (torch::nn gets a float mask)
  bool need_weights = true;
  bool average = true;
  torch::ScalarType dtype = torch::kFloat32;
};

std::ostream& operator<<(std::ostream& os, const ParityConfig& c) {
  return os << c.name;
}

class MultiHeadAttentionParityTest
    : public ::testing::TestWithParam<ParityConfig> {
 protected:
  void SetUp() override { torch::manual_seed(0); }
};

torch::Tensor leaf(const torch::Tensor& t) {
  return t.detach().clone().requires_grad_(true);
}

/// Runs mha and torch::nn on the same weights and inputs and compares the
/// output, the weights and every gradient.
TEST_P(MultiHeadAttentionParityTest, MatchesTorchNn) {
  const auto& c = GetParam();
  const int64_t S = c.self_attention ? c.L : c.S;
  const auto kdim = c.kdim.value_or(c.E), vdim = c.vdim.value_or(c.E);
  const double tol = c.dtype == torch::kFloat64 ? 1e-12 : 2e-5;

  mha::MultiHeadAttention ours(mha::MultiHeadAttentionOptions(c.E, c.H)
                                   .bias(c.bias)
                                   .add_bias_kv(c.add_bias_kv)
                                   .add_zero_attn(c.add_zero_attn)
                                   .kdim(c.kdim)
                                   .vdim(c.vdim)
                                   .batch_first(c.batch_first));
  torch::nn::MultiheadAttention ref(
      torch::nn::MultiheadAttentionOptions(c.E, c.H)
          .bias(c.bias)
          .add_bias_kv(c.add_bias_kv)
          .add_zero_attn(c.add_zero_attn)
          .kdim(kdim)
          .vdim(vdim));
  ours->to(c.dtype);
  ref->to(c.dtype);
  {
    torch::NoGradGuard no_grad;  // non-zero biases, so that none can hide
    for (auto& p : ref->named_parameters()) {
      if (p.key().find("bias") != std::string::npos) {
        p.value().uniform_(-0.5, 0.5);
      }
    }
  }
  mha::copy_weights(ref, ours);

  auto opt = torch::TensorOptions().dtype(c.dtype);
  auto query = torch::randn({c.N, c.L, c.E}, opt);  // (N, L, E)
  auto key = c.self_attention ? query : torch::randn({c.N, S, kdim}, opt);
  auto value = c.self_attention ? query : torch::randn({c.N, S, vdim}, opt);
  torch::Tensor padding, attn;
  if (c.padding) {
    padding = torch::zeros({c.N, S}, torch::kBool);
    padding.select(1, S - 1).fill_(true);
    padding[0].narrow(0, 1, S - 1).fill_(true);
  }
  if (c.float_attn) {
    attn = torch::randn({c.L, S}, opt);
  }
  torch::Tensor ref_attn = attn;
  if (c.causal) {
    auto causal =
        torch::zeros({c.L, S}, opt)
            .masked_fill(torch::ones({c.L, S}, torch::kBool).triu(1), -kInf);
    ref_attn = attn.defined() ? attn + causal : causal;
  }

  auto layout = [&](const torch::Tensor& t) {  // canonical → mha's layout
    return c.batch_first ? t : t.transpose(0, 1);
  };
  auto q1 = leaf(query), k1 = leaf(key), v1 = leaf(value);
  auto [out, w] =
      ours->forward(layout(q1), c.self_attention ? torch::Tensor() : layout(k1),
                    c.self_attention ? torch::Tensor() : layout(v1), padding,
                    c.need_weights, attn, c.average, c.causal);
  out = layout(out);
  auto q2 = leaf(query), k2 = leaf(key), v2 = leaf(value);
  auto [ref_out, ref_w] = ref->forward(
      q2.transpose(0, 1), (c.self_attention ? q2 : k2).transpose(0, 1),
      (c.self_attention ? q2 : v2).transpose(0, 1), padding, c.need_weights,
      ref_attn, c.average);
  ref_out = ref_out.transpose(0, 1);

  expect_close(out, ref_out, tol, tol, "output");
  if (c.need_weights) {
    expect_close(w, ref_w, tol, tol, "weights");
  } else {
    EXPECT_FALSE(w.defined());
  }
  auto g = torch::randn_like(out);
  auto loss = (out * g).sum() + (c.need_weights ? w.pow(2).sum() : 0 * g.sum());
  auto ref_loss =
      (ref_out * g).sum() + (c.need_weights ? ref_w.pow(2).sum() : 0 * g.sum());
  loss.backward();
  ref_loss.backward();
  expect_close(q1.grad(), q2.grad(), tol, tol, "grad query");
  if (!c.self_attention) {
    expect_close(k1.grad(), k2.grad(), tol, tol, "grad key");
    expect_close(v1.grad(), v2.grad(), tol, tol, "grad value");
  }
  auto ref_params = ref->named_parameters();
  for (const auto& p : ours->named_parameters()) {
    const auto* r = ref_params.find(p.key());
    ASSERT_NE(r, nullptr) << p.key();
    expect_close(p.value().grad(), r->grad(), tol, tol, "grad " + p.key());
  }
}

std::vector<ParityConfig> parity_configs() {
  std::vector<ParityConfig> configs;
  auto both = [&](ParityConfig c) {
    for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
      c.dtype = dtype;
      auto named = c;
      named.name += dtype == torch::kFloat32 ? "_f32" : "_f64";
      configs.push_back(named);
    }
  };
  ParityConfig c;
  c.name = "Cross";
  both(c);
  c = {}, c.name = "Self", c.self_attention = true;
  both(c);
  c = {}, c.name = "SameKdimVdim", c.kdim = 5, c.vdim = 5;
  both(c);
  c = {}, c.name = "NoBias", c.bias = false;
  both(c);
  c = {}, c.name = "AddBiasKv", c.add_bias_kv = true, c.padding = true;
  both(c);
  c = {}, c.name = "AddZeroAttn", c.add_zero_attn = true, c.float_attn = true;
  both(c);
  c = {}, c.name = "SeqFirst", c.batch_first = false;
  both(c);
  c = {}, c.name = "PaddingAndFloatMask", c.padding = true, c.float_attn = true;
  both(c);
  c = {}, c.name = "CausalSelf", c.self_attention = true, c.causal = true;
  both(c);
  c = {}, c.name = "CausalWithMaskLneS", c.causal = true, c.float_attn = true;
  both(c);
  c = {}, c.name = "PerHeadWeights", c.average = false, c.H = 4;
  both(c);
  c = {}, c.name = "NoWeights", c.need_weights = false, c.padding = true;
  both(c);
  c = {}, c.name = "OneHeadL1", c.H = 1, c.L = 1, c.N = 1;
  both(c);
  return configs;
}

INSTANTIATE_TEST_SUITE_P(
    Configs, MultiHeadAttentionParityTest,
    ::testing::ValuesIn(parity_configs()),
    [](const ::testing::TestParamInfo<ParityConfig>& param_info) {
      return param_info.param.name;
    });

// --- Where torch::nn is wrong: assert the difference, check float64. ---

/// mha's output and weights against the library's float64 reference.
void expect_matches_float64(mha::MultiHeadAttention& m,
                            const mha::parity::Inputs& in,
                            const torch::Tensor& out, const torch::Tensor& w,
                            double tol) {
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : m->named_parameters()) {
    params[p.key()] = p.value().detach().to(torch::kFloat64);
  }
  mha::parity::Inputs in64 = in;
  in64.query = in.query.to(torch::kFloat64);
  in64.key = in.key.to(torch::kFloat64);
  in64.value = in.value.to(torch::kFloat64);
  auto [out64, w64] =
      mha::parity::reference_attention(m->options, params, in64);
  expect_close(out, out64, tol, tol, "output vs float64");
  expect_close(w, w64.mean(1), tol, tol, "weights vs float64");
}

TEST_F(MultiHeadAttentionTest, BoolAttnMaskBlocksWhereTorchNnAddsIt) {
  mha::MultiHeadAttention ours(8, 2);
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  mha::copy_weights(ours, ref);
  auto q = torch::randn({2, 4, 8}), k = torch::randn({2, 5, 8}),
       v = torch::randn({2, 5, 8});
  auto blocked = torch::rand({4, 5}).lt(0.4);
  blocked.select(1, 0).fill_(false);
  auto as_float = torch::zeros({4, 5}).masked_fill(blocked, -kInf);
  auto [out, w] = ours(q, k, v, torch::Tensor(), true, blocked);
  auto [out_f, w_f] = ours(q, k, v, torch::Tensor(), true, as_float);
  expect_close(out, out_f, 1e-6, 0, "bool mask = its -inf float mask");
  EXPECT_EQ(w.masked_select(blocked.unsqueeze(0).expand({2, 4, 5}))
                .abs()
                .max()
                .item<float>(),
            0.0f);
  auto [ref_out_f, ref_w_f] =
      ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
          torch::Tensor(), true, as_float);
  expect_close(out, ref_out_f.transpose(0, 1), 2e-5, 0, "torch::nn float");
  // The LibTorch quirk: the same bool mask is added as 0/1, blocking nothing.
  auto [ref_out_b, ref_w_b] =
      ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
          torch::Tensor(), true, blocked);
  EXPECT_GT((ref_w_b - w).abs().max().item<float>(), 1e-3)
      << "torch::nn now honours bool attn_mask: update the parity notes";
  expect_matches_float64(ours, {q, k, v, {}, blocked, false}, out, w, 2e-5);
}

TEST_F(MultiHeadAttentionTest, ThreeDimAttnMaskWorksWhereTorchNnThrows) {
  mha::MultiHeadAttention ours(8, 2);
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  mha::copy_weights(ours, ref);
  auto q = torch::randn({3, 4, 8}), k = torch::randn({3, 6, 8}),
       v = torch::randn({3, 6, 8});
  auto mask = torch::randn({3 * 2, 4, 6});  // (N*H, L, S), float
  auto [out, w] =
      ours(q, k, v, torch::Tensor(), true, mask, false);  // w (N, H, L, S)
  // Batch n, head h uses mask[n*H + h]: a 2-D mask on batch n alone agrees.
  auto [out_n, w_n] =
      ours(q[2], k[2], v[2], torch::Tensor(), true, mask[2 * 2 + 1], false);
  expect_close(w[2][1], w_n[1], 1e-6, 0, "head 1 of batch 2");
  EXPECT_ANY_THROW(ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                       torch::Tensor(), true, mask));
  auto [out_avg, w_avg] = ours(q, k, v, torch::Tensor(), true, mask);
  expect_matches_float64(ours, {q, k, v, {}, mask, false}, out_avg, w_avg,
                         2e-5);
}

TEST_F(MultiHeadAttentionTest, KdimDifferentFromVdimWorksWhereTorchNnAsserts) {
  auto options = mha::MultiHeadAttentionOptions(8, 2).kdim(5).vdim(3);
  mha::MultiHeadAttention ours(options);
  torch::nn::MultiheadAttention ref(
      torch::nn::MultiheadAttentionOptions(8, 2).kdim(5).vdim(3));
  mha::copy_weights(ours, ref);
  auto q = torch::randn({2, 4, 8}), k = torch::randn({2, 6, 5}),
       v = torch::randn({2, 6, 3});
  auto [out, w] = ours(q, k, v);
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 4, 8}));
  EXPECT_ANY_THROW(
      ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)));
  expect_matches_float64(ours, {q, k, v, {}, {}, false}, out, w, 2e-5);
}

TEST_F(MultiHeadAttentionTest, FloatPaddingMaskWithMinusInfWorks) {
  mha::MultiHeadAttention ours(8, 2);
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  mha::copy_weights(ours, ref);
  auto q = torch::randn({2, 4, 8}), kv = torch::randn({2, 5, 8});
  auto blocked = torch::tensor(
      {{false, false, false, true, true}, {false, true, false, false, true}});
  auto as_float = torch::zeros({2, 5}).masked_fill(blocked, -kInf);
  auto [out_b, w_b] = ours(q, kv, kv, blocked);
  auto [out_f, w_f] = ours(q, kv, kv, as_float);
  expect_close(out_f, out_b, 1e-6, 0, "float -inf padding = bool padding");
  // The LibTorch quirk: a float key_padding_mask has no effect (1.13) or is
  // rejected when it holds -inf (newer headers).
  auto qt = q.transpose(0, 1), kvt = kv.transpose(0, 1);
  try {
    auto [ref_out, ref_w] = ref(qt, kvt, kvt, as_float);
    auto [unmasked_out, unmasked_w] = ref(qt, kvt, kvt);
    EXPECT_TRUE(torch::allclose(ref_w, unmasked_w))
        << "torch::nn now honours a float key_padding_mask: update the notes";
    EXPECT_GT((ref_w - w_f).abs().max().item<float>(), 1e-3);
  } catch (const c10::Error&) {
    SUCCEED() << "torch::nn rejected the float key_padding_mask";
  }
  expect_matches_float64(ours, {q, kv, kv, as_float, {}, false}, out_f, w_f,
                         2e-5);
}

TEST_F(MultiHeadAttentionTest, FullyMaskedRowGivesOutProjBiasWhereTorchNnNaN) {
  mha::MultiHeadAttention ours(8, 2);
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  {
    torch::NoGradGuard no_grad;
    ours->out_proj->bias.uniform_(-1, 1);
  }
  mha::copy_weights(ours, ref);
  auto q = torch::randn({2, 3, 8}).requires_grad_(true);
  auto kv = torch::randn({2, 4, 8}).requires_grad_(true);
  auto padding = torch::zeros({2, 4}, torch::kBool);
  padding[1].fill_(true);  // batch 1: every key blocked
  for (bool need_weights : {true, false}) {
    SCOPED_TRACE(need_weights ? "need_weights" : "no weights");
    auto [out, w] = ours(q, kv, kv, padding, need_weights);
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
    expect_close(out[1], ours->out_proj->bias.expand({3, 8}), 1e-6, 0,
                 "fully masked batch = out_proj.bias");
    if (need_weights) {
      EXPECT_EQ(w[1].abs().max().item<float>(), 0.0f);
      expect_close(w[0].sum(-1), torch::ones({3}), 1e-6);
    }
    q.mutable_grad() = torch::Tensor();
    kv.mutable_grad() = torch::Tensor();
    (out.sum() + (need_weights ? w.sum() : out.sum() * 0)).backward();
    EXPECT_TRUE(torch::isfinite(q.grad()).all().item<bool>());
    EXPECT_TRUE(torch::isfinite(kv.grad()).all().item<bool>());
    EXPECT_EQ(q.grad()[1].abs().max().item<float>(), 0.0f)
        << "a fully masked row contributes no gradient to its query";
    for (const auto& p : ours->parameters()) {
      EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
      p.mutable_grad() = torch::Tensor();
    }
  }
  auto [ref_out, ref_w] =
      ref(q.transpose(0, 1), kv.transpose(0, 1), kv.transpose(0, 1), padding);
  EXPECT_TRUE(torch::isnan(ref_out.transpose(0, 1)[1]).all().item<bool>())
      << "torch::nn no longer gives NaN: update the parity notes";
}

TEST_F(MultiHeadAttentionTest, FullyMaskedRowThroughAttnMaskAndCausal) {
  mha::MultiHeadAttention m(8, 2);
  auto x = torch::randn({1, 3, 8});
  auto mask = torch::zeros({3, 3});
  mask[2].fill_(-kInf);  // query 2 sees nothing
  auto [out, w] = m(x, torch::Tensor(), torch::Tensor(), torch::Tensor(), true,
                    mask, true, /*is_causal=*/true);
  EXPECT_EQ(w[0][2].abs().max().item<float>(), 0.0f);
  expect_close(w[0][0], torch::tensor({1.0f, 0.0f, 0.0f}), 1e-6);
  expect_close(out[0][2], m->out_proj->bias, 1e-6);
}

TEST_F(MultiHeadAttentionTest, LowestFiniteMaskIsOrdinarySoftmax) {
  mha::MultiHeadAttention m(8, 2);
  auto x = torch::randn({1, 3, 8});
  auto mask = torch::zeros({3, 3});
  mask[1].fill_(std::numeric_limits<float>::lowest());
  auto [out, w] =
      m(x, torch::Tensor(), torch::Tensor(), torch::Tensor(), true, mask);
  expect_close(w[0][1], torch::full({3}, 1.0f / 3), 1e-6, 0, "uniform row");
}

TEST_F(MultiHeadAttentionTest, IsCausalEqualsExplicitCausalMask) {
  mha::MultiHeadAttention m(8, 2);
  auto q = torch::randn({2, 3, 8}), kv = torch::randn({2, 5, 8});
  auto [out, w] = m(q, kv, kv, torch::Tensor(), true, torch::Tensor(), false,
                    /*is_causal=*/true);
  auto [out2, w2] =
      m(q, kv, kv, torch::Tensor(), true, mha::causal_mask(3, 5), false);
  EXPECT_TRUE(torch::allclose(out, out2));
  EXPECT_TRUE(torch::allclose(w, w2));
  // Top-left alignment: query 0 sees key 0 only.
  expect_close(w[0][0][0].sum(-1), torch::tensor(1.0f), 1e-6);
  EXPECT_EQ(w.select(2, 0).narrow(-1, 1, 4).abs().max().item<float>(), 0.0f);
}

TEST_F(MultiHeadAttentionTest, SelfAttentionPathsAgree) {
  mha::MultiHeadAttention m(8, 2);
  auto x = torch::randn({2, 4, 8});
  auto [fused, w1] = m(x);                           // one packed GEMM
  auto [same, w2] = m(x, x, x);                      // same tensors: packed
  auto [separate, w3] = m(x, x.clone(), x.clone());  // three GEMMs
  auto kv = x.clone();
  auto [kv_shared, w4] = m(x, kv, kv);  // key is value: two GEMMs
  expect_close(fused, same, 1e-6);
  expect_close(fused, separate, 1e-6);
  expect_close(fused, kv_shared, 1e-6);
}

TEST_F(MultiHeadAttentionTest, UnbatchedAndSeqFirstShapes) {
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(8, 2));
  auto q = torch::randn({4, 8}), kv = torch::randn({6, 8});
  auto padding = torch::tensor({false, false, false, false, true, true});
  auto [out, w] = m(q, kv, kv, padding, true, torch::zeros({2, 4, 6}), false);
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({4, 8}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 4, 6}));
  auto [out_b, w_b] = m(q.unsqueeze(0), kv.unsqueeze(0), kv.unsqueeze(0),
                        padding.unsqueeze(0), true, torch::Tensor(), false);
  expect_close(out, out_b[0], 1e-6, 0, "unbatched = batch of one");
  expect_close(w, w_b[0], 1e-6);

  mha::MultiHeadAttention seq(
      mha::MultiHeadAttentionOptions(8, 2).batch_first(false));
  copy_parameters(*m, *seq);
  auto qb = torch::randn({3, 4, 8}), kvb = torch::randn({3, 6, 8});
  auto [out_bf, w_bf] = m(qb, kvb, kvb);
  auto [out_sf, w_sf] =
      seq(qb.transpose(0, 1), kvb.transpose(0, 1), kvb.transpose(0, 1));
  EXPECT_EQ(out_sf.sizes(), torch::IntArrayRef({4, 3, 8}));  // (L, N, E)
  expect_close(out_sf.transpose(0, 1), out_bf, 1e-6);
  expect_close(w_sf, w_bf, 1e-6, 0, "weights are (N, L, S) in both layouts");
}

// The projections run on whatever layout the input arrives in (contiguous
// seq-first, a transposed view, a strided slice that is neither): all give
// torch::nn's output and input gradients, with and without bias.
TEST_F(MultiHeadAttentionTest, ProjectionsAgreeAcrossInputLayouts) {
  const int64_t L = 5, N = 3, E = 8;
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    mha::MultiHeadAttention seq(
        mha::MultiHeadAttentionOptions(E, 2).batch_first(false).bias(bias));
    torch::nn::MultiheadAttention ref(
        torch::nn::MultiheadAttentionOptions(E, 2).bias(bias));
    mha::copy_weights(seq, ref);
    auto wide = torch::randn({L, N, 2 * E});
    auto x_strided = wide.narrow(2, 1, E);  // rows of stride 2E: a slice
    ASSERT_FALSE(x_strided.is_contiguous());
    ASSERT_FALSE(x_strided.transpose(0, 1).is_contiguous());
    auto x_seq = x_strided.contiguous();                // (L, N, E)
    auto x_batch = x_seq.transpose(0, 1).contiguous();  // (N, L, E)
    auto x_seq_view = x_batch.transpose(0, 1);          // a view
    auto [expected, w_ref] = ref(x_seq, x_seq, x_seq);
    auto grad = torch::randn({L, N, E});
    std::vector<torch::Tensor> inputs = {x_seq, x_seq_view, x_strided};
    for (auto& x : inputs) {
      auto xg = x.detach().requires_grad_();
      auto [out, w] = seq(xg, xg, xg);
      expect_close(out, expected, 2e-6, 0, "output vs torch::nn");
      (out * grad).sum().backward();
      auto xr = x_seq.detach().clone().requires_grad_();
      (std::get<0>(ref(xr, xr, xr)) * grad).sum().backward();
      expect_close(xg.grad(), xr.grad(), 2e-6, 0, "input grad vs torch::nn");
    }
  }
}

TEST_F(MultiHeadAttentionTest, DropoutOnlyInTraining) {
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(16, 4).dropout(0.5));
  auto x = torch::randn({4, 32, 16});
  m->eval();
  auto [a, wa] = m(x);
  auto [b, wb] = m(x);
  EXPECT_TRUE(torch::equal(a, b)) << "eval mode is deterministic";
  mha::MultiHeadAttention no_dropout(mha::MultiHeadAttentionOptions(16, 4));
  no_dropout->eval();
  copy_parameters(*m, *no_dropout);
  expect_close(a, std::get<0>(no_dropout(x)), 1e-6, 0, "eval = no dropout");
  m->train();
  auto [c, wc] = m(x, torch::Tensor(), torch::Tensor(), torch::Tensor(), true,
                   torch::Tensor(), false);
  auto [d, wd] = m(x);
  EXPECT_FALSE(torch::allclose(c, d)) << "train mode draws new masks";
  // Inverted dropout: about half the weights are zeroed, survivors doubled,
  // so a row's expected sum stays 1. 4*4*32 rows of 32 weights.
  const double zero_fraction =
      wc.eq(0).to(torch::kFloat64).mean().item<double>();
  EXPECT_NEAR(zero_fraction, 0.5, 0.02);
  EXPECT_NEAR(wc.sum(-1).mean().item<double>(), 1.0, 0.03);
}

// --- Errors: c10::Error naming the argument, what it got, what it expects.

TEST_F(MultiHeadAttentionTest, BadOptionsThrow) {
  EXPECT_THROW_MSG(mha::MultiHeadAttention(10, 3),
                   "embed_dim (10) must be divisible by num_heads (3)");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(8, 0),
                   "num_heads must be > 0, but got 0");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(8, -2),
                   "num_heads must be > 0, but got -2");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(
                       mha::MultiHeadAttentionOptions(8, 2).dropout(1.0)),
                   "dropout must be in [0, 1), but got 1");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(
                       mha::MultiHeadAttentionOptions(8, 2).dropout(-0.1)),
                   "dropout must be in [0, 1), but got -0.1");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2).kdim(0)),
      "kdim and vdim must be > 0, but got kdim=0");
}

TEST_F(MultiHeadAttentionTest, BadInputsThrow) {
  mha::MultiHeadAttention m(8, 2);
  auto q = torch::randn({4, 5, 8}), kv = torch::randn({4, 7, 8});
  EXPECT_THROW_MSG(m(torch::randn({4, 5, 6})),
                   "query must have embed_dim = 8 features in its last dim, "
                   "but got [4, 5, 6]");
  EXPECT_THROW_MSG(m(q, torch::randn({4, 7, 6}), kv),
                   "key must have kdim = 8 features in its last dim, but got "
                   "[4, 7, 6]");
  EXPECT_THROW_MSG(m(q, kv, torch::randn({4, 7, 3})),
                   "value must have vdim = 8 features in its last dim, but got "
                   "[4, 7, 3]");
  EXPECT_THROW_MSG(m(q, torch::randn({3, 7, 8}), torch::randn({3, 7, 8})),
                   "key and value must have query's batch size N = 4");
  EXPECT_THROW_MSG(m(q, kv, torch::randn({4, 6, 8})),
                   "value must have key's length S = 7, but got key [4, 7, 8] "
                   "and value [4, 6, 8]");
  EXPECT_THROW_MSG(m(q, kv, torch::Tensor()), "got key without value");
  EXPECT_THROW_MSG(m(torch::randn({2, 4, 5, 8})),
                   "query must be (N, L, E) batched or (L, E) unbatched, but "
                   "got [2, 4, 5, 8]");
  EXPECT_THROW_MSG(m(q, kv.to(torch::kFloat64), kv.to(torch::kFloat64)),
                   "key and value must have query's dtype Float");
  EXPECT_THROW_MSG(m(q.to(torch::kFloat64)),
                   "query must have the parameters' dtype Float, but got dtype "
                   "Double");
}

TEST_F(MultiHeadAttentionTest, BadMasksThrow) {
  mha::MultiHeadAttention m(8, 2);
  auto q = torch::randn({4, 5, 8}), kv = torch::randn({4, 7, 8});
  EXPECT_THROW_MSG(m(q, kv, kv, torch::zeros({4, 9}, torch::kBool)),
                   "key_padding_mask must be (N, S) = (4, 7), but got [4, 9]");
  EXPECT_THROW_MSG(m(q, kv, kv, torch::zeros({7}, torch::kBool)),
                   "key_padding_mask must be (N, S) = (4, 7), but got [7]");
  EXPECT_THROW_MSG(m(q, kv, kv, torch::Tensor(), true, torch::zeros({5, 6})),
                   "attn_mask must be (L, S) = (5, 7) or (N*num_heads, L, S) = "
                   "(8, 5, 7), but got [5, 6]");
  EXPECT_THROW_MSG(m(q, kv, kv, torch::Tensor(), true, torch::zeros({4, 5, 7})),
                   "(N*num_heads, L, S) = (8, 5, 7), but got [4, 5, 7]");
  EXPECT_THROW_MSG(m(q, kv, kv, torch::zeros({4, 7}, torch::kLong)),
                   "key_padding_mask must be bool (true = blocked) or floating "
                   "(added to the scores), but got dtype Long");
  EXPECT_THROW_MSG(
      m(q, kv, kv, torch::Tensor(), true, torch::zeros({5, 7}, torch::kByte)),
      "attn_mask must be bool (true = blocked) or floating (added "
      "to the scores), but got dtype Byte");
  EXPECT_THROW_MSG(
      m(q, kv, kv, torch::Tensor(), true,
        torch::zeros({5, 7}, torch::kFloat64)),
      "attn_mask is floating, so it must have the query's dtype Float, but got "
      "dtype Double");
  auto on_meta = torch::zeros(
      {4, 7}, torch::TensorOptions().dtype(torch::kBool).device(torch::kMeta));
  EXPECT_THROW_MSG(m(q, kv, kv, on_meta),
                   "key_padding_mask must be on the query's device cpu, but "
                   "got device meta");
}

// --- Module plumbing: names, init, clone, dtype, printing, AnyModule. ---

std::vector<std::string> keys_of(const torch::nn::Module& m) {
  std::vector<std::string> keys;
  for (const auto& p : m.named_parameters()) {
    keys.push_back(p.key());
  }
  return keys;
}

TEST_F(MultiHeadAttentionTest, ParameterNamesArePyTorchs) {
  // The keys and order of Python's nn.MultiheadAttention(...).state_dict().
  using Keys = std::vector<std::string>;
  EXPECT_EQ(keys_of(*mha::MultiHeadAttention(8, 2)),
            (Keys{"in_proj_weight", "in_proj_bias", "out_proj.weight",
                  "out_proj.bias"}));
  EXPECT_EQ(keys_of(*mha::MultiHeadAttention(
                mha::MultiHeadAttentionOptions(8, 2).kdim(4).vdim(6))),
            (Keys{"q_proj_weight", "k_proj_weight", "v_proj_weight",
                  "in_proj_bias", "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(keys_of(*mha::MultiHeadAttention(
                mha::MultiHeadAttentionOptions(8, 2).add_bias_kv(true))),
            (Keys{"in_proj_weight", "in_proj_bias", "bias_k", "bias_v",
                  "out_proj.weight", "out_proj.bias"}));
  EXPECT_EQ(keys_of(*mha::MultiHeadAttention(
                mha::MultiHeadAttentionOptions(8, 2).bias(false))),
            (Keys{"in_proj_weight", "out_proj.weight"}));
  auto m = mha::MultiHeadAttention(
      mha::MultiHeadAttentionOptions(8, 2).kdim(4).vdim(6));
  EXPECT_EQ(m->k_proj_weight.sizes(), torch::IntArrayRef({8, 4}));
  EXPECT_EQ(m->v_proj_weight.sizes(), torch::IntArrayRef({8, 6}));
}

TEST_F(MultiHeadAttentionTest, InitialisationIsPyTorchs) {
  mha::MultiHeadAttention m(
      mha::MultiHeadAttentionOptions(64, 4).add_bias_kv(true));
  EXPECT_EQ(m->in_proj_bias.abs().max().item<float>(), 0.0f);
  EXPECT_EQ(m->out_proj->bias.abs().max().item<float>(), 0.0f);
  // xavier_uniform on (3E, E): bound sqrt(6 / (E + 3E)).
  const double bound = std::sqrt(6.0 / (64 + 3 * 64));
  EXPECT_LE(m->in_proj_weight.abs().max().item<double>(), bound);
  EXPECT_GT(m->in_proj_weight.abs().max().item<double>(), 0.9 * bound);
  // nn.Linear's default: kaiming_uniform(a=sqrt(5)) → bound 1/sqrt(fan_in).
  EXPECT_LE(m->out_proj->weight.abs().max().item<double>(),
            1 / std::sqrt(64.0));
  EXPECT_GT(m->bias_k.abs().max().item<float>(), 0.0f);  // xavier_normal
}

TEST_F(MultiHeadAttentionTest, CloneIsDeepAndEqual) {
  mha::MultiHeadAttention m(
      mha::MultiHeadAttentionOptions(8, 2).add_bias_kv(true));
  auto copy =
      std::dynamic_pointer_cast<mha::MultiHeadAttentionImpl>(m->clone());
  ASSERT_NE(copy, nullptr);
  auto x = torch::randn({2, 3, 8});
  expect_close(std::get<0>(copy->forward(x)), std::get<0>(m(x)), 0);
  {
    torch::NoGradGuard no_grad;
    copy->in_proj_weight.add_(1.0);
  }
  EXPECT_FALSE(torch::allclose(copy->in_proj_weight, m->in_proj_weight));
  EXPECT_EQ(keys_of(*copy), keys_of(*m));
}

TEST_F(MultiHeadAttentionTest, ToFloat64) {
  mha::MultiHeadAttention m(8, 2);
  auto x = torch::randn({2, 3, 8});
  auto [out32, w32] = m(x);
  m->to(torch::kFloat64);
  for (const auto& p : m->parameters()) {
    EXPECT_EQ(p.scalar_type(), torch::kFloat64);
  }
  auto [out64, w64] = m(x.to(torch::kFloat64));
  EXPECT_EQ(out64.scalar_type(), torch::kFloat64);
  expect_close(out64, out32, 1e-5);
}

TEST_F(MultiHeadAttentionTest, PrettyPrint) {
  std::ostringstream plain, full;
  mha::MultiHeadAttention(8, 2)->pretty_print(plain);
  EXPECT_EQ(plain.str(), "mha::MultiHeadAttention(embed_dim=8, num_heads=2)");
  mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2)
                              .dropout(0.1)
                              .bias(false)
                              .add_bias_kv(true)
                              .add_zero_attn(true)
                              .kdim(4)
                              .vdim(6)
                              .batch_first(false))
      ->pretty_print(full);
  EXPECT_EQ(full.str(),
            "mha::MultiHeadAttention(embed_dim=8, num_heads=2, dropout=0.1, "
            "bias=false, add_bias_kv=true, add_zero_attn=true, kdim=4, vdim=6, "
            "batch_first=false)");
}

// The softmax scale option (T5: 1.0) against attention written out by hand
// from the module's own parameters: out_proj(softmax(Q Kᵀ · scale) V).
TEST_F(MultiHeadAttentionTest, ScaleOptionMatchesHandWrittenAttention) {
  const int64_t N = 2, L = 4, S = 5, E = 8, H = 2, D = E / H;
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  auto query = torch::randn({N, L, E}, f64);
  auto key = torch::randn({N, S, E}, f64);
  auto value = torch::randn({N, S, E}, f64);
  auto causal = mha::causal_mask(L, S);
  for (const c10::optional<double>& scale :
       {c10::optional<double>(), c10::optional<double>(1.0),
        c10::optional<double>(0.3)}) {
    SCOPED_TRACE(scale ? std::to_string(*scale) : "default");
    mha::MultiHeadAttention m(
        mha::MultiHeadAttentionOptions(E, H).scale(scale));
    m->to(torch::kFloat64);
    m->eval();
    auto w = m->in_proj_weight;
    auto b = m->in_proj_bias;
    auto heads = [&](const torch::Tensor& x, int64_t part) {  // (N, H, T, D)
      auto y = torch::matmul(x, w.narrow(0, part * E, E).t()) +
               b.narrow(0, part * E, E);
      return y.view({N, -1, H, D}).transpose(1, 2);
    };
    const double s = scale.value_or(1.0 / std::sqrt(static_cast<double>(D)));
    auto scores =
        torch::matmul(heads(query, 0), heads(key, 1).transpose(2, 3)) *
        s;  // (N, H, L, S)
    scores =
        scores.masked_fill(causal, -std::numeric_limits<double>::infinity());
    auto weights = torch::softmax(scores, -1);
    auto merged = torch::matmul(weights, heads(value, 2))
                      .transpose(1, 2)
                      .reshape({N, L, E});
    auto expected =
        torch::matmul(merged, m->out_proj->weight.t()) + m->out_proj->bias;
    auto [out, avg] =
        m->forward(query, key, value, {}, /*need_weights=*/true, causal);
    expect_close(out, expected, 1e-12, 1e-12, "output");
    expect_close(avg, weights.mean(1), 1e-12, 1e-12, "weights");
    auto [fast, none] = m->forward(query, key, value, {},
                                   /*need_weights=*/false, causal);
    expect_close(fast, expected, 1e-12, 1e-12, "output without weights");
  }
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(8, 2).scale(std::nan(""))),
      "MultiHeadAttention: scale must be finite, but got nan");
  std::ostringstream printed;
  mha::MultiHeadAttention(mha::MultiHeadAttentionOptions(8, 2).scale(1.0))
      ->pretty_print(printed);
  EXPECT_EQ(printed.str(),
            "mha::MultiHeadAttention(embed_dim=8, num_heads=2, scale=1)");
}

TEST_F(MultiHeadAttentionTest, AnyModuleWithDefaultsLeftOut) {
  mha::MultiHeadAttention m(8, 2);
  torch::nn::AnyModule any(m);
  auto x = torch::randn({2, 3, 8});
  auto [out, w] = any.forward<std::tuple<torch::Tensor, torch::Tensor>>(x);
  auto [expected_out, expected_w] = m(x);
  EXPECT_TRUE(torch::equal(out, expected_out));
  EXPECT_TRUE(torch::equal(w, expected_w));  // need_weights defaults to true
  auto kv = torch::randn({2, 5, 8});
  auto padding = torch::zeros({2, 5}, torch::kBool);
  padding[0][4] = true;
  auto [out2, w2] =
      any.forward<std::tuple<torch::Tensor, torch::Tensor>>(x, kv, kv, padding);
  EXPECT_TRUE(torch::equal(out2, std::get<0>(m(x, kv, kv, padding))));
  EXPECT_EQ(w2[0].select(-1, 4).abs().max().item<float>(), 0.0f);
}

}  // namespace

// ------------------------------------------ grouped-query attention ---
// num_kv_heads < num_heads against a float64 reference written out here
// with each key/value head repeated for its query heads (repeat_interleave,
// as repeat_kv in Llama): outputs, weights and every gradient, on the
// blocked path (weights kept or recomputed, 1 and 2 threads) and with
// masks, causal, cross-attention and the appended key positions.
namespace {

struct GqaReference {
  torch::Tensor output, weights;  // (N, L, E), (N, H, L, S')
};

/// The module's computation by hand in float64, batch_first inputs.
GqaReference gqa_reference(const mha::MultiHeadAttentionImpl& m,
                           const torch::Tensor& query, const torch::Tensor& key,
                           const torch::Tensor& value,
                           const torch::Tensor& padding,  // bool (N, S) or {}
                           bool is_causal) {
  auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
  const int64_t E = m.options.embed_dim(), H = m.options.num_heads();
  const int64_t Hkv = m.num_kv_heads(), D = E / H, Ekv = Hkv * D;
  const int64_t N = query.size(0), L = query.size(1), S = key.size(1);
  auto b = f64(m.in_proj_bias);
  // Rows of in_proj_weight when packed (num_kv_heads == num_heads).
  const bool packed = m.packed_in_proj();
  auto wq = packed ? m.in_proj_weight.narrow(0, 0, E) : m.q_proj_weight;
  auto wk = packed ? m.in_proj_weight.narrow(0, E, E) : m.k_proj_weight;
  auto wv = packed ? m.in_proj_weight.narrow(0, 2 * E, E) : m.v_proj_weight;
  auto q = torch::matmul(f64(query), f64(wq).t()) + b.narrow(0, 0, E);
  auto k = torch::matmul(f64(key), f64(wk).t()) + b.narrow(0, E, Ekv);
  auto v = torch::matmul(f64(value), f64(wv).t()) + b.narrow(0, E + Ekv, Ekv);
  if (m.options.add_bias_kv()) {
    k = torch::cat({k, f64(m.bias_k).expand({N, 1, Ekv})}, 1);
    v = torch::cat({v, f64(m.bias_v).expand({N, 1, Ekv})}, 1);
  }
  auto heads = [&](const torch::Tensor& t, int64_t h) {
    return t.view({N, t.size(1), h, D}).transpose(1, 2);  // (N, h, T, D)
  };
  auto qh = heads(q, H);
  auto kh_kv = heads(k, Hkv);
  if (m.options.rotary()) {  // rotary_embedding: checked by hand elsewhere
    qh = mha::rotary_embedding(qh, 0, m.options.rotary_theta(),
                               m.options.rotary_pairing());
    kh_kv = mha::rotary_embedding(kh_kv, 0, m.options.rotary_theta(),
                                  m.options.rotary_pairing());
  }
  auto kh = kh_kv.repeat_interleave(H / Hkv, /*dim=*/1);
  auto vh = heads(v, Hkv).repeat_interleave(H / Hkv, /*dim=*/1);
  if (m.options.add_zero_attn()) {
    kh = torch::cat({kh, torch::zeros({N, H, 1, D}, kh.options())}, 2);
    vh = torch::cat({vh, torch::zeros({N, H, 1, D}, vh.options())}, 2);
  }
  const int64_t S2 = kh.size(2);  // S + appended positions
  auto scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(double(D));
  auto blocked = torch::zeros({N, 1, L, S2}, torch::kBool);
  if (padding.defined()) {
    blocked.narrow(3, 0, S).logical_or_(padding.view({N, 1, 1, S}));
  }
  if (is_causal) {
    blocked.narrow(3, 0, S).logical_or_(
        torch::ones({L, S}, torch::kBool).triu(1).view({1, 1, L, S}));
  }
  scores = scores.masked_fill(blocked, -kInf);
  auto weights = torch::softmax(scores, -1);  // (N, H, L, S')
  auto attended = torch::matmul(weights, vh).transpose(1, 2).reshape({N, L, E});
  auto output = torch::matmul(attended, f64(m.out_proj->weight).t()) +
                f64(m.out_proj->bias);
  return {output, weights};
}

}  // namespace

TEST_F(MultiHeadAttentionTest, GroupedQueryAndRotaryEqualReferenceByHand) {
  const int64_t E = 16, H = 4, N = 2;
  struct Case {
    int64_t num_kv_heads, L, S;
    bool cross, causal, padding, bias_kv, zero_attn, rotary = false;
    mha::RotaryPairing pairing = mha::RotaryPairing::kHalf;
  };
  const Case cases[] = {
      {2, 7, 7, false, false, false, false, false},
      {1, 7, 7, false, true, true, false, false},  // multi-query, causal
      {2, 5, 9, true, false, true, false, false},  // cross, L != S
      {2, 9, 6, true, true, false, true, true},    // appended positions
      {4, 6, 6, false, true, true, false, false},  // = num_heads: packed
      // rotary position embedding, with and without grouped heads
      {4, 8, 8, false, true, true, false, false, true},
      {2, 8, 8, false, true, false, false, false, true,
       mha::RotaryPairing::kInterleaved},
      {1, 5, 9, true, false, true, false, false, true},
  };
  for (int threads : {1, 2}) {
    const IntraOpThreads set_threads(threads);
    for (const auto& c : cases) {
      for (bool average : {true, false}) {
        SCOPED_TRACE(
            "num_kv_heads=" + std::to_string(c.num_kv_heads) +
            ", L=" + std::to_string(c.L) + ", S=" + std::to_string(c.S) +
            (c.causal ? ", causal" : "") + (c.padding ? ", padding" : "") +
            (c.bias_kv ? ", bias_kv" : "") + (c.rotary ? ", rotary" : "") +
            ", threads " + std::to_string(threads) +
            (average ? ", averaged" : ", per head"));
        mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(E, H)
                                      .num_kv_heads(c.num_kv_heads)
                                      .add_bias_kv(c.bias_kv)
                                      .add_zero_attn(c.zero_attn)
                                      .rotary(c.rotary)
                                      .rotary_pairing(c.pairing)
                                      .rotary_theta(c.rotary ? 500.0 : 1e4));
        {
          torch::NoGradGuard no_grad;
          m->in_proj_bias.uniform_(-0.5, 0.5);
          m->out_proj->bias.uniform_(-0.5, 0.5);
        }
        auto query = torch::randn({N, c.L, E}).requires_grad_();
        auto key = c.cross ? torch::randn({N, c.S, E}).requires_grad_() : query;
        auto value =
            c.cross ? torch::randn({N, c.S, E}).requires_grad_() : query;
        torch::Tensor padding;
        if (c.padding) {
          padding = torch::zeros({N, c.S}, torch::kBool);
          padding[0][c.S - 1] = true;
          padding[1][1] = true;  // not key 0: no fully masked causal row
        }
        auto [out, weights] =
            m(query, c.cross ? key : torch::Tensor(),
              c.cross ? value : torch::Tensor(), padding,
              /*need_weights=*/true, torch::Tensor(), average, c.causal);
        auto ref = gqa_reference(*m, query, key, value, padding, c.causal);
        expect_close(out, ref.output, 1e-5, 1e-5, "output");
        expect_close(weights, average ? ref.weights.mean(1) : ref.weights, 1e-5,
                     1e-5, "weights");
        // Gradients of the inputs and every parameter, through the output
        // and the weights.
        auto g_out = torch::randn(out.sizes());
        auto g_w = torch::randn(weights.sizes());
        auto loss = (out * g_out).sum() + (weights * g_w).sum();
        auto ref_w = average ? ref.weights.mean(1) : ref.weights;
        auto ref_loss = (ref.output * g_out.to(torch::kFloat64)).sum() +
                        (ref_w * g_w.to(torch::kFloat64)).sum();
        std::vector<torch::Tensor> wrt{query};
        std::vector<std::string> names{"query"};
        if (c.cross) {
          wrt.insert(wrt.end(), {key, value});
          names.insert(names.end(), {"key", "value"});
        }
        for (const auto& p : m->named_parameters()) {
          wrt.push_back(p.value());
          names.push_back(p.key());
        }
        auto grads = torch::autograd::grad({loss}, wrt);
        auto ref_grads = torch::autograd::grad({ref_loss}, wrt);
        for (size_t i = 0; i < wrt.size(); ++i) {
          expect_close(grads[i], ref_grads[i], 1e-4, 1e-4,
                       "gradient of " + names[i]);
        }
      }
    }
  }
}

TEST_F(MultiHeadAttentionTest, GroupedQueryAttentionParametersAndErrors) {
  mha::MultiHeadAttention m(
      mha::MultiHeadAttentionOptions(16, 4).num_kv_heads(2).add_bias_kv(true));
  EXPECT_FALSE(m->in_proj_weight.defined());
  EXPECT_EQ(m->q_proj_weight.sizes(), (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(m->k_proj_weight.sizes(), (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(m->v_proj_weight.sizes(), (std::vector<int64_t>{8, 16}));
  EXPECT_EQ(m->in_proj_bias.sizes(), (std::vector<int64_t>{32}));
  EXPECT_EQ(m->bias_k.sizes(), (std::vector<int64_t>{1, 1, 8}));
  EXPECT_EQ(m->num_kv_heads(), 2);
  std::ostringstream printed;
  printed << *m;
  EXPECT_NE(printed.str().find("num_kv_heads=2"), std::string::npos)
      << printed.str();
  // The default keeps PyTorch's packed layout.
  mha::MultiHeadAttention plain(16, 4);
  EXPECT_EQ(plain->num_kv_heads(), 4);
  EXPECT_TRUE(plain->in_proj_weight.defined());
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(16, 4).num_kv_heads(3)),
      "num_kv_heads must be > 0 and divide num_heads (4), but got 3");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(16, 4).num_kv_heads(0)),
      "num_kv_heads must be > 0 and divide num_heads (4), but got 0");
  EXPECT_THROW_MSG(mha::MultiHeadAttention(
                       mha::MultiHeadAttentionOptions(12, 4).rotary(true)),
                   "rotary needs an even head_dim, but got embed_dim / "
                   "num_heads = 3");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(16, 4).rotary(true).add_bias_kv(true)),
      "rotary cannot be combined with add_bias_kv or "
      "add_zero_attn");
  EXPECT_THROW_MSG(
      mha::MultiHeadAttention(
          mha::MultiHeadAttentionOptions(16, 4).rotary(true).rotary_theta(
              -1.0)),
      "rotary_theta must be finite and > 0, but got -1");
  {
    std::ostringstream rotary_printed;
    rotary_printed << *mha::MultiHeadAttention(
        mha::MultiHeadAttentionOptions(16, 4).rotary(true).rotary_pairing(
            mha::RotaryPairing::kInterleaved));
    EXPECT_NE(
        rotary_printed.str().find("rotary=true, rotary_pairing=interleaved"),
        std::string::npos)
        << rotary_printed.str();
  }
  // Features are checked against kdim as before.
  EXPECT_THROW_MSG(m(torch::randn({2, 5, 16}), torch::randn({2, 5, 8}),
                     torch::randn({2, 5, 16})),
                   "key must have kdim = 16");
}
