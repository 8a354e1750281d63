// TransformerDecoderLayer, TransformerDecoder, Transformer and cached
// decoding, against Python PyTorch 2.14's and 1.13's numbers
// (tests/fixtures/decoder/ and decoder-1.13/, from
// scripts/make_decoder_fixtures.py), LibTorch's torch::nn modules and the
// modules' own full forward.
//
// Glossary: N batch, T target length, S source (memory) length, E d_model,
// H nhead, F dim_feedforward.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixture_helpers.h"
#include "mha/mha.h"
#include "test_helpers.h"

namespace {

using torch::indexing::Slice;

// ------------------------------------------------------------- fixtures ---

/// The fixture directories: Python PyTorch 2.14's and 1.13's
/// (scripts/make_decoder_fixtures.py).
const std::vector<std::string> kFixtureDirs = {"decoder", "decoder-1.13"};

/// One fixture and the directory its files are in.
struct DecoderFixture {
  std::string dir;
  nlohmann::json json;
  std::string file(const std::string& key) const {
    return fixtures::path(dir + "/" + json.at(key).get<std::string>());
  }
};

mha::TransformerDecoderLayerOptions decoder_layer_options(
    const nlohmann::json& o) {
  auto options =
      mha::TransformerDecoderLayerOptions(o.at("d_model"), o.at("nhead"))
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

mha::TransformerOptions transformer_options(const nlohmann::json& o) {
  auto options = mha::TransformerOptions(o.at("d_model"), o.at("nhead"))
                     .num_encoder_layers(o.at("num_encoder_layers"))
                     .num_decoder_layers(o.at("num_decoder_layers"))
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

/// The fixture's tensor `name`, or an undefined tensor.
torch::Tensor get(const torch::OrderedDict<std::string, torch::Tensor>& data,
                  const std::string& name) {
  const auto* found = data.find(name);
  return found ? *found : torch::Tensor();
}

/// Loads the fixture's state dict (every file) into `module`, runs
/// `call(inputs)` and compares output, input and parameter gradients with
/// Python's: 1e-5 (float32) or 1e-10 (float64), absolute and relative.
template <typename Holder, typename Call>
void check_fixture(Holder& module, const DecoderFixture& f,
                   const std::vector<std::string>& inputs, Call&& call) {
  const auto& fixture = f.json;
  const bool f64 = fixture.at("dtype") == "float64";
  const double tol = f64 ? 1e-10 : 1e-5;
  if (f64) {
    module->to(torch::kFloat64);
  }
  module->eval();
  auto data = mha::read_state_dict(f.file("data"));
  for (const auto& [format, file] : fixture.at("state_dict").items()) {
    SCOPED_TRACE(f.dir + "/" + fixture.at("name").get<std::string>() +
                 " from " + format);
    auto result = mha::load_state_dict(
        *module,
        fixtures::path(f.dir + "/" + file.template get<std::string>()));
    EXPECT_TRUE(result.missing_keys.empty() && result.unexpected_keys.empty());
    module->zero_grad();
    std::vector<torch::Tensor> leaves;
    for (const auto& name : inputs) {
      leaves.push_back(data[name].clone().requires_grad_());
    }
    auto out = call(leaves, data);
    expect_close(out, data["output"], tol, tol, "output");
    (out * data["output_grad"]).sum().backward();
    for (size_t i = 0; i < inputs.size(); ++i) {
      expect_close(leaves[i].grad(), data["grad_" + inputs[i]], tol, tol,
                   "grad " + inputs[i]);
    }
    size_t checked = 0;
    for (const auto& p : module->named_parameters()) {
      expect_close(p.value().grad(), data["grad." + p.key()], tol, tol,
                   "grad " + p.key());
      ++checked;
    }
    EXPECT_EQ(checked, module->parameters().size());
  }
}

/// Every fixture of one module kind, from both PyTorch versions.
std::vector<DecoderFixture> decoder_fixtures(const std::string& module) {
  std::vector<DecoderFixture> found;
  for (const auto& dir : kFixtureDirs) {
    std::ifstream in(fixtures::path(dir + "/decoder.json"));
    TORCH_CHECK(in.is_open(), "cannot open ", dir, "/decoder.json");
    const auto index = nlohmann::json::parse(in);
    for (const auto& f : index.at("fixtures")) {
      if (f.at("module") == module) {
        found.push_back({dir, f});
      }
    }
  }
  return found;
}

TEST(DecoderFixtureTest, DecoderLayersFromPythonMatch) {
  const auto all = decoder_fixtures("TransformerDecoderLayer");
  ASSERT_GE(all.size(), 9u);
  for (const auto& fixture : all) {
    mha::TransformerDecoderLayer layer(
        decoder_layer_options(fixture.json.at("options")));
    const bool causal = fixture.json.at("forward").at("tgt_is_causal");
    check_fixture(layer, fixture, {"tgt", "memory"},
                  [&](const std::vector<torch::Tensor>& x, auto& data) {
                    return layer(x[0], x[1], get(data, "tgt_mask"),
                                 get(data, "memory_mask"),
                                 get(data, "tgt_key_padding_mask"),
                                 get(data, "memory_key_padding_mask"), causal);
                  });
  }
}

TEST(DecoderFixtureTest, DecoderWithFinalNormFromPythonMatches) {
  const auto all = decoder_fixtures("TransformerDecoder");
  ASSERT_GE(all.size(), 2u);
  for (const auto& fixture : all) {
    const auto& o = fixture.json.at("options");
    auto options = mha::TransformerDecoderOptions(
        mha::TransformerDecoderLayer(decoder_layer_options(o.at("layer"))),
        o.at("num_layers"));
    if (o.at("norm")) {
      options.norm(torch::nn::AnyModule(
          mha::LayerNorm(mha::LayerNormOptions(o.at("layer").at("d_model"))
                             .eps(o.at("layer").at("layer_norm_eps")))));
    }
    mha::TransformerDecoder decoder(options);
    check_fixture(decoder, fixture, {"tgt", "memory"},
                  [&](const std::vector<torch::Tensor>& x, auto& data) {
                    return decoder(x[0], x[1], get(data, "tgt_mask"),
                                   get(data, "memory_mask"),
                                   get(data, "tgt_key_padding_mask"),
                                   get(data, "memory_key_padding_mask"), true);
                  });
  }
}

TEST(DecoderFixtureTest, TransformersFromPythonMatch) {
  const auto all = decoder_fixtures("Transformer");
  ASSERT_GE(all.size(), 5u);
  for (const auto& fixture : all) {
    mha::Transformer model(transformer_options(fixture.json.at("options")));
    // Python's state-dict keys, in Python's order.
    std::vector<std::string> keys;
    for (const auto& item : model->named_parameters()) {
      keys.push_back(item.key());
    }
    EXPECT_EQ(keys, fixture.json.at("keys").get<std::vector<std::string>>());
    const bool causal = fixture.json.at("forward").at("tgt_is_causal");
    check_fixture(model, fixture, {"src", "tgt"},
                  [&](const std::vector<torch::Tensor>& x, auto& data) {
                    return model(
                        x[0], x[1], get(data, "src_mask"),
                        get(data, "tgt_mask"), get(data, "memory_mask"),
                        get(data, "src_key_padding_mask"),
                        get(data, "tgt_key_padding_mask"),
                        get(data, "memory_key_padding_mask"), false, causal);
                  });
  }
}

// ----------------------------------------------------- against torch::nn ---

class TransformerDecoderLayerTest : public SeededTest {};

/// torch::nn's decoder layer is post-norm and seq-first; float masks and
/// bool key padding masks mean the same there.
TEST_F(TransformerDecoderLayerTest, MatchesTorchNnForwardAndBackward) {
  const int64_t N = 3, T = 5, S = 4, E = 8, H = 2, F = 16;
  for (bool use_gelu : {false, true}) {
    for (bool batch_first : {false, true}) {
      SCOPED_TRACE(std::string(use_gelu ? "gelu" : "relu") +
                   (batch_first ? ", batch_first" : ", seq-first"));
      auto ref_options = torch::nn::TransformerDecoderLayerOptions(E, H)
                             .dim_feedforward(F)
                             .dropout(0.0);
      auto options = mha::TransformerDecoderLayerOptions(E, H)
                         .dim_feedforward(F)
                         .dropout(0.0)
                         .batch_first(batch_first);
      if (use_gelu) {
        ref_options.activation(torch::kGELU);
        options.activation(torch::kGELU);
      }
      torch::nn::TransformerDecoderLayer ref(ref_options);
      mha::TransformerDecoderLayer layer(options);
      {
        torch::NoGradGuard no_grad;
        auto ref_params = ref->named_parameters();
        for (auto& p : layer->named_parameters()) {
          p.value().copy_(ref_params[p.key()] +
                          0.1 * torch::randn_like(p.value()));
          ref_params[p.key()].copy_(p.value());
        }
      }
      auto tgt = torch::randn({T, N, E});  // seq-first
      auto memory = torch::randn({S, N, E});
      auto tgt_mask = mha::generate_square_subsequent_mask(T);
      auto memory_mask = torch::randn({T, S});
      memory_mask.index_put_({0, 3}, -kInf);
      auto tgt_padding = torch::zeros({N, T}, torch::kBool);
      tgt_padding.index_put_({1, Slice(3)}, true);
      auto memory_padding = torch::zeros({N, S}, torch::kBool);
      memory_padding.index_put_({2, Slice(2)}, true);

      auto tgt_ref = tgt.clone().requires_grad_();
      auto memory_ref = memory.clone().requires_grad_();
      auto tgt_ours = tgt.clone().requires_grad_();
      auto memory_ours = memory.clone().requires_grad_();
      auto out_ref = ref(tgt_ref, memory_ref, tgt_mask, memory_mask,
                         tgt_padding, memory_padding);
      auto bf = [&](const torch::Tensor& x) {
        return batch_first ? x.transpose(0, 1) : x;
      };
      auto out = bf(layer(bf(tgt_ours), bf(memory_ours), tgt_mask, memory_mask,
                          tgt_padding, memory_padding));
      expect_close(out, out_ref, 2e-6, 1e-5, "output");
      auto grad = torch::randn_like(out);
      (out_ref * grad).sum().backward();
      (out * grad).sum().backward();
      expect_close(tgt_ours.grad(), tgt_ref.grad(), 1e-5, 1e-4, "tgt grad");
      expect_close(memory_ours.grad(), memory_ref.grad(), 1e-5, 1e-4,
                   "memory grad");
      auto ref_params = ref->named_parameters();
      for (const auto& p : layer->named_parameters()) {
        expect_close(p.value().grad(), ref_params[p.key()].grad(), 1e-5, 1e-4,
                     p.key() + " grad");
      }
    }
  }
}

TEST_F(TransformerDecoderLayerTest, ParameterNamesArePyTorchs) {
  mha::TransformerDecoderLayer layer(
      mha::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16));
  torch::nn::TransformerDecoderLayer ref(
      torch::nn::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16));
  EXPECT_EQ(layer->named_parameters().keys(), ref->named_parameters().keys());
  mha::TransformerDecoderLayer no_bias(
      mha::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16).bias(
          false));
  for (const auto& key : no_bias->named_parameters().keys()) {
    EXPECT_EQ(key.find("bias"), std::string::npos) << key;
  }
  EXPECT_EQ(no_bias->named_parameters().size(), 9u);  // 2·2 attn + 2 + 3
}

TEST_F(TransformerDecoderLayerTest, CausalFlagsUnbatchedAndDropout) {
  mha::TransformerDecoderLayer layer(
      mha::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16));
  layer->eval();
  auto tgt = torch::randn({2, 5, 8});
  auto memory = torch::randn({2, 7, 8});
  // tgt_is_causal equals the explicit mask; memory_is_causal blocks j > i.
  expect_close(layer->forward(tgt, memory, {}, {}, {}, {}, true),
               layer->forward(tgt, memory, mha::causal_mask(5, 5)), 0.0, 0.0,
               "tgt_is_causal");
  expect_close(layer->forward(tgt, memory, {}, {}, {}, {}, false, true),
               layer->forward(tgt, memory, {}, mha::causal_mask(5, 7)), 0.0,
               0.0, "memory_is_causal");
  expect_close(layer->forward(tgt[1], memory[1], {}, {}, {}, {}, true),
               layer->forward(tgt, memory, {}, {}, {}, {}, true)[1], 1e-6, 0.0,
               "unbatched");
  layer->train();
  auto a = layer(tgt, memory);
  auto b = layer(tgt, memory);
  EXPECT_FALSE(torch::allclose(a, b)) << "dropout in training mode";
}

TEST_F(TransformerDecoderLayerTest, ClearErrors) {
  mha::TransformerDecoderLayer layer(mha::TransformerDecoderLayerOptions(8, 2));
  auto tgt = torch::randn({2, 5, 8});
  auto memory = torch::randn({2, 7, 8});
  auto message = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message([&] {
              layer(tgt, torch::randn({3, 7, 8}));
            })
                .find("memory must have tgt's dims and batch size, but got "
                      "tgt [2, 5, 8] and memory [3, 7, 8]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              layer(tgt, torch::randn({2, 7, 6}));
            })
                .find("memory must be (N, S, d_model) batched or (S, d_model) "
                      "unbatched with d_model = 8, but got [2, 7, 6]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              layer->forward(tgt, memory, torch::zeros({5, 7}));
            })
                .find("tgt_mask must be (T, T) = (5, 5) or (N*nhead, T, T) = "
                      "(4, 5, 5), but got [5, 7]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              layer->forward(tgt, memory, {}, torch::zeros({5, 5}));
            })
                .find("memory_mask must be (T, S) = (5, 7) or (N*nhead, T, S) "
                      "= (4, 5, 7), but got [5, 5]"),
            std::string::npos);
  EXPECT_NE(
      message([&] {
        layer->forward(tgt, memory, {}, {}, {},
                       torch::zeros({2, 5}, torch::kBool));
      })
          .find("memory_key_padding_mask must be (N, S) = (2, 7), but got "
                "[2, 5]"),
      std::string::npos);
  EXPECT_NE(
      message([&] {
        mha::TransformerDecoderLayer(mha::TransformerDecoderLayerOptions(8, 3));
      }).find("d_model (8) must be divisible by nhead (3)"),
      std::string::npos);
}

// -------------------------------------------------------- cached decoding ---

TEST(ProjectedKeyValueTest, ForwardProjectedEqualsCrossAttention) {
  torch::manual_seed(1);
  struct Case {
    const char* name;
    mha::MultiHeadAttentionOptions options;
    bool unbatched;
    torch::Dtype dtype;
  };
  const std::vector<Case> cases = {
      {"packed", mha::MultiHeadAttentionOptions(8, 2), false, torch::kFloat32},
      {"kdim/vdim seq-first",
       mha::MultiHeadAttentionOptions(8, 2).kdim(6).vdim(5).batch_first(false),
       false, torch::kFloat64},
      {"grouped, no bias",
       mha::MultiHeadAttentionOptions(8, 4).num_kv_heads(2).bias(false), false,
       torch::kFloat64},
      {"unbatched", mha::MultiHeadAttentionOptions(8, 2), true,
       torch::kFloat64},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    mha::MultiHeadAttention attn(c.options);
    attn->to(c.dtype);
    const int64_t N = 3, T = 4, S = 6;
    const auto kd = attn->kdim(), vd = attn->vdim();
    auto shape = [&](int64_t len, int64_t f) -> std::vector<int64_t> {
      if (c.unbatched) return {len, f};
      return c.options.batch_first() ? std::vector<int64_t>{N, len, f}
                                     : std::vector<int64_t>{len, N, f};
    };
    auto query = torch::randn(shape(T, 8), c.dtype).requires_grad_();
    auto key = torch::randn(shape(S, kd), c.dtype).requires_grad_();
    auto value = torch::randn(shape(S, vd), c.dtype).requires_grad_();
    auto padding = c.unbatched
                       ? torch::tensor({0, 0, 1, 0, 0, 1}).to(torch::kBool)
                       : torch::zeros({N, S}, torch::kBool);
    if (!c.unbatched) {
      padding.index_put_({0, Slice(4)}, true);
      padding.index_put_({2}, true);  // a fully padded sequence: rows 0
    }
    auto [expected, expected_w] =
        attn->forward(query, key, value, padding, true, {}, false);
    auto projected = attn->project_key_value(key, value);
    auto [out, w] = attn->forward_projected(query, projected, padding, true,
                                            /*average_attn_weights=*/false);
    const double tol = c.dtype == torch::kFloat64 ? 1e-12 : 1e-6;
    expect_close(out, expected, tol, 0.0, "output");
    expect_close(w, expected_w, tol, 0.0, "weights");
    EXPECT_FALSE(out.isnan().any().item<bool>());
    // The float form of the same mask, and gradients through the projection.
    auto additive =
        torch::zeros(padding.sizes(), c.dtype).masked_fill(padding, -kInf);
    auto out_f =
        std::get<0>(attn->forward_projected(query, projected, additive));
    expect_close(out_f, expected, tol, 0.0, "float mask");
    auto g = torch::randn_like(out);
    auto grads_ref =
        torch::autograd::grad({(expected * g).sum()}, {query, key, value});
    auto grads =
        torch::autograd::grad({(out_f * g).sum()}, {query, key, value});
    for (size_t i = 0; i < 3; ++i) {
      expect_close(grads[i], grads_ref[i], tol, 0.0, "grad");
    }
  }
}

TEST(ProjectedKeyValueTest, RejectsPositionOptionsAndMismatches) {
  auto message = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  auto kv = torch::randn({2, 6, 8});
  mha::MultiHeadAttention rotary(
      mha::MultiHeadAttentionOptions(8, 2).rotary(true));
  EXPECT_NE(message([&] {
              rotary->project_key_value(kv, kv);
            }).find("project_key_value: the option rotary is not supported"),
            std::string::npos);
  mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(8, 2));
  auto projected = attn->project_key_value(kv, kv);
  EXPECT_EQ(projected.key.sizes(), (std::vector<int64_t>{2, 2, 6, 4}));
  EXPECT_NE(message([&] {
              attn->forward_projected(torch::randn({3, 1, 8}), projected);
            })
                .find("key_value must hold key and value (N, num_kv_heads, S, "
                      "head_dim) = (3, 2, S, 4), but got key [2, 2, 6, 4]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              attn->forward_projected(torch::randn({2, 1, 8}), projected,
                                      torch::zeros({2, 5}, torch::kBool));
            }).find("key_padding_mask must be (N, S) = (2, 6), but got [2, 5]"),
            std::string::npos);
  EXPECT_NE(message([&] {
              attn->project_key_value(kv, torch::randn({2, 5, 8}));
            }).find("value must have key's batch size and length"),
            std::string::npos);
}

/// Decoding one token at a time (and a prompt of several) through the cache
/// gives the full forward's rows: layers, stacks with a final norm, both
/// layouts, pre- and post-norm, with a memory padding mask.
TEST(DecoderCacheTest, StepByStepEqualsFullForward) {
  torch::manual_seed(2);
  for (bool batch_first : {true, false}) {
    for (bool norm_first : {false, true}) {
      SCOPED_TRACE(std::string(batch_first ? "batch_first" : "seq-first") +
                   (norm_first ? ", pre-norm" : ", post-norm"));
      const int64_t N = 2, T = 6, S = 5, E = 16;
      auto layer =
          mha::TransformerDecoderLayer(mha::TransformerDecoderLayerOptions(E, 4)
                                           .dim_feedforward(32)
                                           .batch_first(batch_first)
                                           .norm_first(norm_first));
      mha::TransformerDecoder decoder(
          mha::TransformerDecoderOptions(layer, 3).norm(
              torch::nn::AnyModule(mha::LayerNorm(mha::LayerNormOptions(E)))));
      decoder->eval();
      {
        torch::NoGradGuard no_grad;
        for (auto& p : decoder->parameters()) {
          p.add_(0.1 * torch::randn_like(p));
        }
      }
      const int64_t time_dim = batch_first ? 1 : 0;
      auto seq = [&](int64_t len) {
        return batch_first ? torch::randn({N, len, E})
                           : torch::randn({len, N, E});
      };
      auto tgt = seq(T);
      auto memory = seq(S);
      auto padding = torch::zeros({N, S}, torch::kBool);
      padding.index_put_({1, Slice(3)}, true);
      auto full = decoder->forward(tgt, memory, {}, {}, {}, padding, true);

      torch::NoGradGuard no_grad;
      auto cache = decoder->make_cache(memory, T, padding);
      std::vector<torch::Tensor> steps;
      steps.push_back(
          decoder->forward_cached(tgt.narrow(time_dim, 0, 2), cache));
      for (int64_t t = 2; t < T; ++t) {
        steps.push_back(
            decoder->forward_cached(tgt.narrow(time_dim, t, 1), cache));
      }
      EXPECT_EQ(cache.size(), T);
      expect_close(torch::cat(steps, time_dim), full, 2e-6, 1e-5, "cached");
    }
  }
}

TEST(DecoderCacheTest, TransformerGreedyDecodingAndGradients) {
  torch::manual_seed(3);
  mha::Transformer model(mha::TransformerOptions(16, 4)
                             .num_encoder_layers(2)
                             .num_decoder_layers(2)
                             .dim_feedforward(32)
                             .dropout(0.0));
  model->to(torch::kFloat64);
  auto src = torch::randn({2, 7, 16}, torch::kFloat64);
  auto tgt = torch::randn({2, 4, 16}, torch::kFloat64);
  auto src_padding = torch::zeros({2, 7}, torch::kBool);
  src_padding.index_put_({0, Slice(5)}, true);
  auto full =
      model->forward(src, tgt, {}, {}, {}, src_padding, {}, src_padding, false,
                     /*tgt_is_causal=*/true);
  auto memory = model->encode(src, {}, src_padding);
  auto cache = model->make_cache(memory, 4, src_padding);
  // With autograd on, the cached path differentiates too.
  auto tgt_leaf = tgt.clone().requires_grad_();
  auto out =
      torch::cat({model->forward_cached(tgt_leaf.narrow(1, 0, 3), cache),
                  model->forward_cached(tgt_leaf.narrow(1, 3, 1), cache)},
                 1);
  expect_close(out, full, 1e-12, 0.0, "cached Transformer");
  auto tgt_ref = tgt.clone().requires_grad_();
  auto ref = model->forward(src, tgt_ref, {}, {}, {}, src_padding, {},
                            src_padding, false, true);
  auto g = torch::randn_like(ref);
  (ref * g).sum().backward();
  (out * g).sum().backward();
  // The last step's gradient does not reach earlier tokens through the
  // cache's copies (as MultiHeadAttention::forward_cached); the first call
  // covers its own three tokens fully only for their own rows.
  expect_close(tgt_leaf.grad().narrow(1, 3, 1), tgt_ref.grad().narrow(1, 3, 1),
               1e-12, 0.0, "grad of the last token");
  auto message = [&](auto&& call) -> std::string {
    try {
      call();
    } catch (const c10::Error& e) {
      return e.what_without_backtrace();
    }
    return "no error";
  };
  EXPECT_NE(message([&] {
              model->forward_cached(tgt.narrow(1, 0, 1), cache);
            }).find("cache has room for 0 more positions"),
            std::string::npos);
  EXPECT_NE(message([&] {
              model(src, tgt.narrow(0, 0, 1));
            }).find("src and tgt must have the same dims and batch size"),
            std::string::npos);
}

// ------------------------------------------------------------ Transformer ---

TEST(TransformerTest, PythonDefaultsNamesAndStaticMask) {
  mha::TransformerOptions defaults;
  EXPECT_EQ(defaults.d_model(), 512);
  EXPECT_EQ(defaults.nhead(), 8);
  EXPECT_EQ(defaults.num_encoder_layers(), 6);
  EXPECT_EQ(defaults.num_decoder_layers(), 6);
  EXPECT_EQ(defaults.dim_feedforward(), 2048);
  EXPECT_DOUBLE_EQ(defaults.dropout(), 0.1);
  EXPECT_DOUBLE_EQ(defaults.layer_norm_eps(), 1e-5);
  mha::Transformer small(
      mha::TransformerOptions(8, 2, 1, 2).dim_feedforward(16));
  auto keys = small->named_parameters().keys();
  EXPECT_EQ(keys.front(), "encoder.layers.0.self_attn.in_proj_weight");
  EXPECT_EQ(keys.back(), "decoder.norm.bias");
  EXPECT_NE(std::find(keys.begin(), keys.end(),
                      "decoder.layers.1.multihead_attn.out_proj.weight"),
            keys.end());
  EXPECT_EQ(
      std::find(keys.begin(), keys.end(), "encoder.layers.1.norm1.weight"),
      keys.end());
  // xavier_uniform for every matrix: |w| <= sqrt(6 / (fan_in + fan_out)).
  const auto w = small->named_parameters()["decoder.layers.0.linear1.weight"];
  EXPECT_LE(w.abs().max().item<double>(), std::sqrt(6.0 / (8 + 16)));
  expect_close(mha::TransformerImpl::generate_square_subsequent_mask(3),
               mha::generate_square_subsequent_mask(3), 0.0, 0.0, "mask");
}

TEST(TransformerTest, CustomEncoderAndDecoder) {
  torch::manual_seed(4);
  mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(
      mha::TransformerEncoderLayer(
          mha::TransformerEncoderLayerOptions(8, 2).dim_feedforward(16)),
      1));
  mha::TransformerDecoder decoder(mha::TransformerDecoderOptions(
      mha::TransformerDecoderLayer(
          mha::TransformerDecoderLayerOptions(8, 2).dim_feedforward(16)),
      1));
  mha::Transformer model(mha::TransformerOptions(8, 2)
                             .custom_encoder(torch::nn::AnyModule(encoder))
                             .custom_decoder(torch::nn::AnyModule(decoder)));
  model->eval();
  auto src = torch::randn({2, 5, 8});
  auto tgt = torch::randn({2, 3, 8});
  // The model holds deep copies (re-initialised xavier_uniform, as Python's).
  auto* enc = model->encoder.ptr()->as<mha::TransformerEncoderImpl>();
  auto* dec = model->decoder.ptr()->as<mha::TransformerDecoderImpl>();
  ASSERT_NE(enc, nullptr);
  ASSERT_NE(dec, nullptr);
  EXPECT_NE(enc, encoder.get());
  expect_close(model(src, tgt), dec->forward(tgt, enc->forward(src)), 0.0, 0.0,
               "custom modules");
  EXPECT_EQ(model->named_parameters().keys().front(),
            "encoder.layers.0.self_attn.in_proj_weight");
}

}  // namespace
