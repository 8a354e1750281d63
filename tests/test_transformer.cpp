// Tests of mha::LayerNorm, mha::TransformerEncoderLayer and
// mha::TransformerEncoder against torch::nn's modules (where they have the
// option) and a reference written here from plain ops.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fixture_helpers.h"
#include "mha/state_dict.h"
#include "mha/transformer.h"
#include "mha/weights.h"
#include "test_helpers.h"

namespace {

class TransformerEncoderLayerTest : public SeededTest {};
class TransformerEncoderTest : public SeededTest {};

std::vector<std::string> parameter_names(const torch::nn::Module& m) {
  std::vector<std::string> names;
  for (const auto& p : m.named_parameters()) {
    names.push_back(p.key());
  }
  return names;
}

/// Layer norm over the last dim, written out: biased variance.
torch::Tensor reference_layer_norm(const torch::Tensor& x,
                                   const torch::Tensor& weight,
                                   const torch::Tensor& bias, double eps) {
  auto mean = x.mean(-1, /*keepdim=*/true);
  auto var = (x - mean).pow(2).mean(-1, /*keepdim=*/true);
  auto y = (x - mean) / torch::sqrt(var + eps) * weight;
  return bias.defined() ? y + bias : y;
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                     const torch::Tensor& b) {
  auto y = torch::matmul(x, w.t());
  return b.defined() ? y + b : y;
}

/// Self-attention from plain ops, per head, batch-first (N, L, E).
/// `blocked` is a bool (N, L, L) mask (true = blocked) or undefined; a fully
/// blocked row attends to nothing.
torch::Tensor reference_attention(const mha::MultiHeadAttentionImpl& m,
                                  const torch::Tensor& x,
                                  const torch::Tensor& additive,
                                  const torch::Tensor& blocked) {
  const auto E = m.options.embed_dim();
  const auto H = m.options.num_heads();
  const auto D = E / H;
  const auto& w = m.in_proj_weight;
  const auto& b = m.in_proj_bias;
  auto part = [&](int i) {
    return linear(x, w.narrow(0, i * E, E),
                  b.defined() ? b.narrow(0, i * E, E) : b);
  };
  auto q = part(0), k = part(1), v = part(2);  // (N, L, E)
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < H; ++h) {
    auto qh = q.narrow(-1, h * D, D), kh = k.narrow(-1, h * D, D),
         vh = v.narrow(-1, h * D, D);
    auto scores = torch::matmul(qh, kh.transpose(-2, -1)) / std::sqrt(D);
    if (additive.defined()) {
      scores = scores + additive;
    }
    if (blocked.defined()) {
      scores = scores.masked_fill(blocked, -kInf);
    }
    auto weights = torch::softmax(scores, -1);
    if (blocked.defined()) {
      weights = weights.masked_fill(blocked.all(-1, true), 0.0);
    }
    heads.push_back(torch::matmul(weights, vh));
  }
  return linear(torch::cat(heads, -1), m.out_proj->weight, m.out_proj->bias);
}

/// The encoder layer from plain ops (batch-first input).
torch::Tensor reference_layer(
    const mha::TransformerEncoderLayerImpl& layer, const torch::Tensor& x,
    const torch::Tensor& additive, const torch::Tensor& blocked,
    const std::function<torch::Tensor(const torch::Tensor&)>& activation) {
  const double eps = layer.options.layer_norm_eps();
  auto norm1 = [&](const torch::Tensor& t) {
    return reference_layer_norm(t, layer.norm1->weight, layer.norm1->bias, eps);
  };
  auto norm2 = [&](const torch::Tensor& t) {
    return reference_layer_norm(t, layer.norm2->weight, layer.norm2->bias, eps);
  };
  auto sa = [&](const torch::Tensor& t) {
    return reference_attention(*layer.self_attn, t, additive, blocked);
  };
  auto ff = [&](const torch::Tensor& t) {
    return linear(
        activation(linear(t, layer.linear1->weight, layer.linear1->bias)),
        layer.linear2->weight, layer.linear2->bias);
  };
  if (layer.options.norm_first()) {
    auto y = x + sa(norm1(x));
    return y + ff(norm2(y));
  }
  auto y = norm1(x + sa(x));
  return norm2(y + ff(y));
}

torch::Tensor relu(const torch::Tensor& t) { return torch::relu(t); }
torch::Tensor gelu(const torch::Tensor& t) {
  return 0.5 * t * (1.0 + torch::erf(t / std::sqrt(2.0)));
}

// ------------------------------------------------------------- LayerNorm ---

TEST(LayerNormTest, MatchesFormulaWithAndWithoutBias) {
  torch::manual_seed(0);
  for (bool bias : {true, false}) {
    mha::LayerNorm norm(mha::LayerNormOptions(6).eps(1e-3).bias(bias));
    {
      torch::NoGradGuard no_grad;
      norm->weight.uniform_(0.5, 1.5);
      if (bias) {
        norm->bias.uniform_(-1, 1);
      }
    }
    EXPECT_EQ(norm->named_parameters().size(), bias ? 2u : 1u);
    auto x = torch::randn({3, 4, 6});
    expect_close(norm(x),
                 reference_layer_norm(x, norm->weight, norm->bias, 1e-3), 1e-5,
                 0.0, bias ? "bias" : "no bias");
  }
  mha::LayerNorm norm(mha::LayerNormOptions(6));
  EXPECT_THROW_MSG(norm(torch::randn({2, 5})),
                   "LayerNorm: input must be (..., 6), but got [2, 5]");
  EXPECT_THROW_MSG(mha::LayerNorm(mha::LayerNormOptions(0)),
                   "normalized_size must be > 0, but got 0");
}

// ----------------------------------------------- TransformerEncoderLayer ---

TEST_F(TransformerEncoderLayerTest, ParameterNamesArePyTorchs) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16));
  const std::vector<std::string> expected = {"self_attn.in_proj_weight",
                                             "self_attn.in_proj_bias",
                                             "self_attn.out_proj.weight",
                                             "self_attn.out_proj.bias",
                                             "linear1.weight",
                                             "linear1.bias",
                                             "linear2.weight",
                                             "linear2.bias",
                                             "norm1.weight",
                                             "norm1.bias",
                                             "norm2.weight",
                                             "norm2.bias"};
  EXPECT_EQ(parameter_names(*layer), expected);
  // torch::nn's layer lists the same names in the same order.
  torch::nn::TransformerEncoderLayer ref(
      torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16));
  EXPECT_EQ(parameter_names(*ref), expected);

  mha::TransformerEncoderLayer no_bias(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).bias(
          false));
  const std::vector<std::string> expected_no_bias = {
      "self_attn.in_proj_weight",
      "self_attn.out_proj.weight",
      "linear1.weight",
      "linear2.weight",
      "norm1.weight",
      "norm2.weight"};
  EXPECT_EQ(parameter_names(*no_bias), expected_no_bias);
}

/// torch::nn's layer is post-norm and seq-first; its float masks behave as
/// ours (its bool attn_mask would be added as 0/1, a LibTorch quirk).
TEST_F(TransformerEncoderLayerTest, MatchesTorchNnForwardAndBackward) {
  const int64_t N = 3, L = 5, E = 8, H = 2, F = 16;
  for (bool use_gelu : {false, true}) {
    for (bool batch_first : {false, true}) {
      SCOPED_TRACE(std::string(use_gelu ? "gelu" : "relu") +
                   (batch_first ? ", batch_first" : ", seq-first"));
      auto ref_options = torch::nn::TransformerEncoderLayerOptions(E, H)
                             .dim_feedforward(F)
                             .dropout(0.0);
      auto options = mha::TransformerEncoderLayerOptions(E, H)
                         .dim_feedforward(F)
                         .dropout(0.0)
                         .batch_first(batch_first);
      if (use_gelu) {
        ref_options.activation(torch::kGELU);
        options.activation(torch::kGELU);
      }
      torch::nn::TransformerEncoderLayer ref(ref_options);
      mha::TransformerEncoderLayer layer(options);
      mha::copy_weights(ref, layer);

      auto src = torch::randn({L, N, E});  // seq-first
      auto src_mask = torch::randn({L, L});
      src_mask.index_put_({0, 3}, -kInf);
      auto padding = torch::zeros({N, L}, torch::kBool);
      padding.index_put_({1, torch::indexing::Slice(3)}, true);

      auto src_ref = src.clone().requires_grad_();
      auto src_ours = src.clone().requires_grad_();
      auto out_ref = ref(src_ref, src_mask, padding);
      auto out = layer(batch_first ? src_ours.transpose(0, 1) : src_ours,
                       src_mask, padding);
      if (batch_first) {
        out = out.transpose(0, 1);
      }
      expect_close(out, out_ref, 2e-6, 1e-5, "output");
      auto grad = torch::randn_like(out);
      (out_ref * grad).sum().backward();
      (out * grad).sum().backward();
      expect_close(src_ours.grad(), src_ref.grad(), 1e-5, 1e-4, "src grad");
      auto ref_params = ref->named_parameters();
      for (const auto& p : layer->named_parameters()) {
        expect_close(p.value().grad(), ref_params[p.key()].grad(), 1e-5, 1e-4,
                     p.key() + " grad");
      }
    }
  }
}

TEST_F(TransformerEncoderLayerTest, MatchesPlainOpsForEveryOption) {
  const int64_t N = 2, L = 6, E = 12, H = 3;
  auto padding = torch::zeros({N, L}, torch::kBool);
  padding.index_put_({0, torch::indexing::Slice(4)}, true);
  auto blocked = padding.view({N, 1, L}).expand({N, L, L});
  auto additive = torch::randn({L, L}, torch::kFloat64);
  for (bool norm_first : {false, true}) {
    for (bool bias : {true, false}) {
      for (bool use_gelu : {false, true}) {
        SCOPED_TRACE(std::string(norm_first ? "pre-norm" : "post-norm") +
                     (bias ? "" : ", bias=false") +
                     (use_gelu ? ", gelu" : ", relu"));
        auto options = mha::TransformerEncoderLayerOptions(E, H)
                           .dim_feedforward(20)
                           .dropout(0.0)
                           .layer_norm_eps(1e-3)
                           .norm_first(norm_first)
                           .bias(bias);
        if (use_gelu) {
          options.activation(torch::kGELU);
        }
        mha::TransformerEncoderLayer layer(options);
        layer->to(torch::kFloat64);
        {
          torch::NoGradGuard no_grad;
          for (auto& p : layer->parameters()) {
            p.uniform_(-0.5, 0.5);  // biases and norms away from 0 and 1
          }
        }
        auto x = torch::randn({N, L, E}, torch::kFloat64);
        auto expected = reference_layer(*layer, x, additive, blocked,
                                        use_gelu ? gelu : relu);
        expect_close(layer(x, additive, padding), expected, 1e-12, 0.0,
                     "output");
      }
    }
  }
}

TEST_F(TransformerEncoderLayerTest, CallableActivation) {
  auto options =
      mha::TransformerEncoderLayerOptions(8, 2)
          .dim_feedforward(16)
          .dropout(0.0)
          .activation([](const torch::Tensor& t) { return torch::tanh(t); });
  mha::TransformerEncoderLayer layer(options);
  auto x = torch::randn({2, 3, 8});
  auto expected =
      reference_layer(*layer, x, torch::Tensor(), torch::Tensor(),
                      [](const torch::Tensor& t) { return torch::tanh(t); });
  expect_close(layer(x), expected, 1e-5, 0.0, "tanh activation");
}

TEST_F(TransformerEncoderLayerTest, IsCausalEqualsExplicitMaskAndUnbatched) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(
          0.0));
  auto x = torch::randn({2, 5, 8});
  auto causal = torch::ones({5, 5}, torch::kBool).triu(1);
  expect_close(layer(x, torch::Tensor(), torch::Tensor(), /*is_causal=*/true),
               layer(x, causal), 1e-6, 0.0, "is_causal");
  // Unbatched (L, E) equals the batch of one.
  expect_close(layer(x[1]), layer(x).select(0, 1), 1e-6, 0.0, "unbatched");
}

TEST_F(TransformerEncoderLayerTest, PaddingNeverLeaksAndNeverGivesNaN) {
  const int64_t N = 3, L = 6, E = 8;
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(E, 2).dim_feedforward(16).dropout(
          0.0));
  auto padding = torch::zeros({N, L}, torch::kBool);
  padding.index_put_({0, torch::indexing::Slice(2)}, true);  // keeps 2
  padding.index_put_({1, 0}, true);                          // a hole
  padding.index_put_({2}, true);  // every position padded
  auto x = torch::randn({N, L, E}, torch::requires_grad());
  auto out = layer(x, torch::Tensor(), padding);
  EXPECT_FALSE(torch::isnan(out).any().item<bool>());
  out.sum().backward();
  EXPECT_FALSE(torch::isnan(x.grad()).any().item<bool>());

  // Changing padded inputs (even to huge values) changes nothing elsewhere.
  auto y = x.detach().clone();
  y.index_put_({padding}, 1e6);
  auto out_changed = layer(y, torch::Tensor(), padding);
  auto kept = padding.logical_not();
  kept.index_put_({2}, false);  // sequence 2 has no real position
  expect_close(out_changed.index({kept}), out.detach().index({kept}), 1e-5, 0.0,
               "non-padded positions");
}

TEST_F(TransformerEncoderLayerTest, DropoutOnlyInTraining) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(
          0.5));
  auto x = torch::randn({2, 4, 8});
  layer->eval();
  auto a = layer(x), b = layer(x);
  expect_close(a, b, 0.0, 0.0, "eval is deterministic");
  layer->train();
  EXPECT_GT((layer(x) - a).abs().max().item<double>(), 1e-3)
      << "training mode applies dropout";
}

TEST_F(TransformerEncoderLayerTest, ClearErrors) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16));
  EXPECT_THROW_MSG(layer(torch::randn({2, 3, 6})),
                   "src must be (N, L, d_model) batched or (L, d_model) "
                   "unbatched with d_model = 8, but got [2, 3, 6]");
  EXPECT_THROW_MSG(layer(torch::randn({2, 3, 8}), torch::zeros({3, 4})),
                   "src_mask must be (L, L) = (3, 3) or (N*nhead, L, L) = (4, "
                   "3, 3), but got [3, 4]");
  EXPECT_THROW_MSG(
      layer(torch::randn({2, 3, 8}), torch::Tensor(),
            torch::zeros({3, 2}, torch::kBool)),
      "src_key_padding_mask must be (N, L) = (2, 3), but got [3, 2]");
  EXPECT_THROW_MSG(
      layer(torch::randn({2, 3, 8}), torch::Tensor(),
            torch::zeros({2, 3}, torch::kLong)),
      "key_padding_mask must be bool (true = blocked) or floating");
  EXPECT_THROW_MSG(
      layer(torch::randn({2, 3, 8}, torch::kFloat64)),
      "must have the parameters' dtype Float, but got dtype Double");
  EXPECT_THROW_MSG(
      mha::TransformerEncoderLayer(mha::TransformerEncoderLayerOptions(8, 3)),
      "d_model (8) must be divisible by nhead (3)");
  EXPECT_THROW_MSG(mha::TransformerEncoderLayer(
                       mha::TransformerEncoderLayerOptions(8, 2).dropout(1.0)),
                   "dropout must be in [0, 1), but got 1");
  EXPECT_THROW_MSG(
      mha::TransformerEncoderLayer(
          mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(0)),
      "dim_feedforward must be > 0, but got 0");
  EXPECT_THROW_MSG(
      mha::TransformerEncoderLayer(
          mha::TransformerEncoderLayerOptions(8, 2).layer_norm_eps(0.0)),
      "layer_norm_eps must be > 0, but got 0");
}

TEST_F(TransformerEncoderLayerTest, CopyWeightsChecksOptions) {
  torch::nn::TransformerEncoderLayer ref(
      torch::nn::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16));
  mha::TransformerEncoderLayer wide(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(32));
  EXPECT_THROW_MSG(mha::copy_weights(ref, wide),
                   "option dim_feedforward differs: source has 16, "
                   "destination has 32");
  mha::TransformerEncoderLayer no_bias(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).bias(
          false));
  EXPECT_THROW_MSG(mha::copy_weights(no_bias, ref),
                   "option bias differs: source has 0, destination has 1");

  // The other direction copies every value.
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16));
  mha::copy_weights(layer, ref);
  auto ours = layer->named_parameters();
  for (const auto& p : ref->named_parameters()) {
    expect_close(p.value(), ours[p.key()], 0.0, 0.0, p.key());
  }
}

// ---------------------------------------------------- TransformerEncoder ---

TEST_F(TransformerEncoderTest, DeepCopiesLayersAndAppliesNorm) {
  const int64_t E = 8;
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(E, 2).dim_feedforward(16).dropout(
          0.0));
  mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(layer, 3).norm(
      torch::nn::AnyModule(mha::LayerNorm(mha::LayerNormOptions(E)))));
  auto names = parameter_names(*encoder);
  EXPECT_EQ(names.size(), 3u * 12u + 2u);
  EXPECT_EQ(names.front(), "layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(names.back(), "norm.bias");

  // Same initial values, separate storage.
  auto first = encoder->layers[0]->as<mha::TransformerEncoderLayerImpl>();
  auto second = encoder->layers[1]->as<mha::TransformerEncoderLayerImpl>();
  expect_close(first->linear1->weight, layer->linear1->weight, 0.0, 0.0,
               "copy of the layer");
  {
    torch::NoGradGuard no_grad;
    first->linear1->weight.add_(1.0);
    encoder->named_parameters()["norm.weight"].uniform_(0.5, 1.5);
  }
  expect_close(second->linear1->weight, layer->linear1->weight, 0.0, 0.0,
               "layers do not share storage");

  // forward = the layers in order, then the norm.
  auto x = torch::randn({2, 5, E});
  auto padding = torch::zeros({2, 5}, torch::kBool);
  padding.index_put_({1, 4}, true);
  auto expected = x;
  for (const auto& m : *encoder->layers) {
    expected = m->as<mha::TransformerEncoderLayerImpl>()->forward(
        expected, torch::Tensor(), padding, true);
  }
  expected = encoder->norm.forward(expected);
  expect_close(encoder(x, torch::Tensor(), padding, /*is_causal=*/true),
               expected, 0.0, 0.0, "encoder forward");

  // clone() is deep too.
  auto copy =
      std::dynamic_pointer_cast<mha::TransformerEncoderImpl>(encoder->clone());
  ASSERT_TRUE(copy);
  expect_close(copy->forward(x, torch::Tensor(), padding, true), expected, 0.0,
               0.0, "clone");
  {
    torch::NoGradGuard no_grad;
    copy->named_parameters()["layers.2.linear2.bias"].add_(1.0);
  }
  expect_close(encoder(x, torch::Tensor(), padding, true), expected, 0.0, 0.0,
               "clone is independent");
}

TEST_F(TransformerEncoderTest, WithoutNormAndErrors) {
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16).dropout(
          0.0));
  mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(layer, 2));
  EXPECT_EQ(parameter_names(*encoder).size(), 24u);
  auto x = torch::randn({2, 3, 8});
  auto l0 = encoder->layers[0]->as<mha::TransformerEncoderLayerImpl>();
  auto l1 = encoder->layers[1]->as<mha::TransformerEncoderLayerImpl>();
  expect_close(encoder(x), l1->forward(l0->forward(x)), 0.0, 0.0, "stack");
  EXPECT_THROW_MSG(
      mha::TransformerEncoder(mha::TransformerEncoderOptions(layer, 0)),
      "num_layers must be >= 1, but got 0");
  EXPECT_THROW_MSG(encoder(torch::randn({2, 3, 4})),
                   "d_model = 8, but got [2, 3, 4]");
}

// ------------------------------------------ weights trained in Python ---
// Fixtures from scripts/make_fixtures.py (PyTorch 2.6): state dicts in every
// format, inputs with padding, outputs and input gradients.

mha::TransformerEncoderLayerOptions layer_options(const nlohmann::json& o) {
  auto options =
      mha::TransformerEncoderLayerOptions(o.at("d_model"), o.at("nhead"))
          .dim_feedforward(o.at("dim_feedforward"))
          .dropout(o.at("dropout"))
          .layer_norm_eps(o.at("layer_norm_eps"))
          .batch_first(o.at("batch_first"))
          .norm_first(o.at("norm_first"))
          .bias(o.at("bias"));
  if (o.at("activation") == "gelu") {
    options.activation(torch::kGELU);
  }
  return options;
}

/// Loads `file` into `module`, runs it on the fixture's input and compares
/// output and input gradient with Python's to 1e-5.
template <typename Holder>
void check_fixture(Holder& module, const nlohmann::json& fixture,
                   const std::string& file) {
  SCOPED_TRACE(fixture.at("name").get<std::string>() + " from " + file);
  module->eval();
  auto result = mha::load_state_dict(*module, file);
  EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
  auto data = fixtures::data(fixture);
  auto src = data["src"].clone().requires_grad_();
  auto out = module(src, torch::Tensor(), data["src_key_padding_mask"]);
  expect_close(out, data["output"], 1e-5, 0.0, "output");
  (out * data["output_grad"]).sum().backward();
  expect_close(src.grad(), data["grad_src"], 1e-5, 0.0, "grad src");
}

TEST(TransformerFixtureTest, EncoderLayersTrainedInPythonMatch) {
  const auto found = fixtures::of_module("TransformerEncoderLayer");
  ASSERT_GE(found.size(), 5u);
  for (const auto& fixture : found) {
    for (const auto& file : fixtures::state_dict_files(fixture)) {
      mha::TransformerEncoderLayer layer(layer_options(fixture.at("options")));
      check_fixture(layer, fixture, file);
    }
  }
}

TEST(TransformerFixtureTest, EncoderWithFinalNormTrainedInPythonMatches) {
  const auto found = fixtures::of_module("TransformerEncoder");
  ASSERT_FALSE(found.empty());
  for (const auto& fixture : found) {
    const auto& o = fixture.at("options");
    for (const auto& file : fixtures::state_dict_files(fixture)) {
      auto options = mha::TransformerEncoderOptions(
          mha::TransformerEncoderLayer(layer_options(o.at("layer"))),
          o.at("num_layers"));
      if (o.at("norm")) {
        options.norm(torch::nn::AnyModule(
            mha::LayerNorm(mha::LayerNormOptions(o.at("layer").at("d_model"))
                               .eps(o.at("norm_eps")))));
      }
      mha::TransformerEncoder encoder(options);
      check_fixture(encoder, fixture, file);
    }
  }
}

/// C++ -> Python: weights set in C++ and saved with save_state_dict give
/// Python's nn.TransformerEncoderLayer the outputs they give mha.
TEST(TransformerFixtureTest, CppWeightsGiveTheSameOutputsInPython) {
  std::string tried;
  const auto python = fixtures::python_with_torch(&tried);
  if (python.empty()) {
    GTEST_SKIP() << "no Python with torch found (tried " << tried
                 << "); scripts/setup.sh installs python3-torch";
  }
  torch::manual_seed(0);
  // Options every PyTorch since 1.12 has (bias=false needs 2.1).
  auto options = mha::TransformerEncoderLayerOptions(8, 2)
                     .dim_feedforward(16)
                     .dropout(0.0)
                     .activation(torch::kGELU)
                     .layer_norm_eps(1e-3)
                     .norm_first(true);
  mha::TransformerEncoderLayer layer(options);
  layer->eval();
  {
    torch::NoGradGuard no_grad;
    for (auto& p : layer->parameters()) {
      p.uniform_(-0.5, 0.5);
    }
  }
  const auto dir = fixtures::temp_dir("encoder-to-python");
  mha::save_state_dict(*layer, dir + "/layer.pt");
  auto src = torch::randn({2, 5, 8});
  auto padding = torch::zeros({2, 5}, torch::kBool);
  padding.index_put_({1, torch::indexing::Slice(3)}, true);
  torch::OrderedDict<std::string, torch::Tensor> input;
  input.insert("src", src);
  input.insert("src_key_padding_mask", padding);
  mha::write_state_dict(input, dir + "/input.safetensors");
  std::ofstream(dir + "/options.json") << nlohmann::json{
      {"d_model", 8},           {"nhead", 2},
      {"dim_feedforward", 16},  {"activation", "gelu"},
      {"layer_norm_eps", 1e-3}, {"batch_first", true},
      {"norm_first", true}}.dump();
  const auto command =
      "'" + python + "' '" MHA_PYTHON_ENCODER_SCRIPT "' '" + dir + "'";
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  auto output = mha::read_state_dict(dir + "/output.safetensors")["output"];
  expect_close(output, layer(src, torch::Tensor(), padding), 1e-5, 0.0,
               "Python's output");
}

}  // namespace
