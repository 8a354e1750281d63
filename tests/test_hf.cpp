// Tests of include/mha/hf.h and the recorded references of
// include/mha/parity.h: every case of tests/fixtures/hf (tiny random
// transformers models written by scripts/make_hf_fixtures.py, with one
// layer's recorded input, output and per-head weights) loaded through
// mha::hf and compared at |mha - HF| <= 1e-5 + 1e-4 |HF| in float32; the
// options read from config.json; the error messages for unsupported
// options and missing or mis-shaped tensors.
//
// Glossary: N batch, L tokens, E hidden size, H heads.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "fixture_helpers.h"
#include "mha/hf.h"
#include "mha/parity.h"
#include "mha/state_dict.h"
#include "test_helpers.h"

namespace {

namespace fs = std::filesystem;

std::string case_dir(const std::string& name) {
  return fixtures::path("hf/" + name);
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class HfFixtureTest : public ::testing::TestWithParam<std::string> {};

// Each fixture: mha::hf::load_attention on the checkpoint, run on the
// recorded hidden_states (mask, causality from the family), equals HF's
// attention output and per-head weights.
TEST_P(HfFixtureTest, MatchesTransformers) {
  const std::string file = case_dir(GetParam()) + "/reference.safetensors";
  const auto check = mha::parity::check_reference(file);
  EXPECT_DOUBLE_EQ(check.tolerance.atol, 1e-5);
  EXPECT_DOUBLE_EQ(check.tolerance.rtol, 1e-4);
  ASSERT_EQ(check.parts.size(), 2u) << "output and weights";
  for (const auto& part : check.parts) {
    EXPECT_TRUE(part.within)
        << GetParam() << " " << part.what << ": max abs " << part.max_abs
        << ", max rel " << part.max_rel << "; worst " << check.worst;
  }
  EXPECT_TRUE(check.within) << check.worst;
  std::cout << "[ hf       ] " << GetParam() << ": output max abs "
            << check.parts[0].max_abs << ", weights max abs "
            << check.parts[1].max_abs << " (" << check.note << ")\n";
}

// The fixtures catch a wrong convention: without the causal mask, or with
// GPT-J's interleaved pairs instead of Llama's halves, the output is far
// outside the tolerance.
TEST(HfTest, FixturesCatchWrongConventions) {
  const auto ref = mha::parity::read_reference(case_dir("llama_4x") +
                                               "/reference.safetensors");
  const auto x = ref.tensors["hidden_states"];  // (N, L, E)
  const auto expected = ref.tensors["output"];  // (N, L, E)
  torch::NoGradGuard no_grad;
  auto module = mha::parity::reference_module(ref);
  auto error = [&](bool causal) {
    auto out = std::get<0>(module->forward(x, {}, {}, {}, false, {}, true,
                                           /*is_causal=*/causal));
    return (out - expected).abs().max().item<double>();
  };
  EXPECT_LT(error(true), 1e-4);
  EXPECT_GT(error(false), 1e-2);
  auto options = module->options;
  options.rotary_pairing(mha::RotaryPairing::kInterleaved);
  mha::MultiHeadAttention interleaved(options);
  interleaved->eval();
  for (const auto& item : module->named_parameters()) {
    interleaved->named_parameters()[item.key()].copy_(item.value());
  }
  module = interleaved;
  EXPECT_GT(error(true), 1e-3);
}

INSTANTIATE_TEST_SUITE_P(Families, HfFixtureTest,
                         ::testing::Values("llama", "llama_4x", "llama_sharded",
                                           "mistral", "qwen2", "qwen2_window",
                                           "falcon_mqa", "falcon_new", "bloom",
                                           "gpt2", "bert", "t5_encoder",
                                           "t5_decoder", "gptj", "gpt_neox",
                                           "gpt_neox_4x"));

// Every rope_type of transformers 5.x through config.json (rope_parameters;
// llama_4x_llama3 a 4.x rope_scaling), at position_ids with left padding.
INSTANTIATE_TEST_SUITE_P(
    RopeTypes, HfFixtureTest,
    ::testing::Values("llama_rope_linear", "llama_rope_dynamic",
                      "llama_rope_yarn", "llama_rope_yarn_attention_factor",
                      "llama_rope_llama3", "llama_rope_longrope",
                      "llama_4x_llama3"));

// The rotary fixtures catch a convention left out: the same checkpoint
// without its rotary scaling (rope cases) or rotating every feature instead
// of the first rotary_dim (GPT-J, GPT-NeoX) is outside the tolerance.
TEST(HfTest, RotaryFixturesCatchMissingScalingOrPartialRotary) {
  for (const std::string name :
       {"llama_rope_linear", "llama_rope_dynamic", "llama_rope_yarn",
        "llama_rope_yarn_attention_factor", "llama_rope_llama3",
        "llama_rope_longrope", "llama_4x_llama3"}) {
    const auto check = mha::parity::check_reference(
        case_dir(name) + "/reference.safetensors", torch::kCPU,
        [](mha::MultiHeadAttentionImpl& m) {
          EXPECT_NE(m.options.rotary_scaling().rope_type, "default");
          m.options.rotary_scaling(mha::RotaryScaling{});
        });
    EXPECT_FALSE(check.within) << name << " passes without rotary_scaling";
  }
  for (const std::string name : {"gptj", "gpt_neox", "gpt_neox_4x"}) {
    const auto check = mha::parity::check_reference(
        case_dir(name) + "/reference.safetensors", torch::kCPU,
        [](mha::MultiHeadAttentionImpl& m) {
          EXPECT_EQ(m.options.rotary_dim(), c10::optional<int64_t>(4));
          m.options.rotary_dim(c10::nullopt);
        });
    EXPECT_FALSE(check.within) << name << " passes rotating all of head_dim";
  }
}

// The left-padded batch of llama_cache (sequence 1 has two pads before its
// 3-token prompt), a prompt step then three one-token steps, decoded through
// ONE KVCache with key_padding_mask and position_ids: equal to HF's
// DynamicCache steps (check_reference), and to each sequence decoded alone
// through its own cache at default positions, step by step.
TEST(HfTest, LeftPaddedBatchThroughOneCacheEqualsHfAndEachSequence) {
  const std::string file = case_dir("llama_cache") + "/reference.safetensors";
  const auto check = mha::parity::check_reference(file);
  ASSERT_EQ(check.parts.size(), 8u) << "output and weights of 4 steps";
  for (const auto& part : check.parts) {
    EXPECT_TRUE(part.within) << part.what << ": max abs " << part.max_abs
                             << "; worst " << check.worst;
    std::cout << "[ hf cache ] " << part.what << ": max abs " << part.max_abs
              << "\n";
  }
  EXPECT_EQ(check.skipped_rows, 2) << "the two pads of step 0";

  const auto ref = mha::parity::read_reference(file);
  auto module = mha::parity::reference_module(ref);
  const auto keep = ref.tensors["attention_mask"] != 0;  // (N, S)
  const int64_t N = keep.size(0);
  const int64_t S = keep.size(1);
  ASSERT_EQ(N, 2);
  ASSERT_EQ(S, 8);
  torch::NoGradGuard no_grad;
  auto at = [&](int64_t k, const char* what) {
    return ref.tensors["step" + std::to_string(k) + "." + what];
  };
  // mha's batched steps, as check_reference runs them.
  std::vector<torch::Tensor> batched_out, batched_weights;
  auto cache = module->make_kv_cache(N, S);
  for (int64_t k = 0, P = 0; k < 4; ++k) {
    const auto x = at(k, "hidden_states");  // (N, T, E)
    const int64_t T = x.size(1);
    auto [out, weights] = module->forward_cached(
        x, cache, /*is_causal=*/true, /*need_weights=*/true,
        /*average_attn_weights=*/false, ~keep.narrow(1, 0, P + T),
        at(k, "position_ids"));  // (N, T, E), (N, H, T, P + T)
    batched_out.push_back(out);
    batched_weights.push_back(weights);
    P += T;
  }
  for (int64_t b = 0; b < N; ++b) {
    auto alone = module->make_kv_cache(1, S);
    for (int64_t k = 0, P = 0; k < 4; ++k) {
      const int64_t T = at(k, "hidden_states").size(1);
      const auto rows = keep[b].narrow(0, P, T).nonzero().squeeze(1);  // (Tb)
      const auto cols = keep[b].narrow(0, 0, P + T).nonzero().squeeze(1);
      const auto x =
          at(k, "hidden_states")[b].index_select(0, rows).unsqueeze(0);
      auto [out, weights] = module->forward_cached(
          x, alone, /*is_causal=*/true, /*need_weights=*/true,
          /*average_attn_weights=*/false);  // (1, Tb, E), (1, H, Tb, Sb)
      const std::string what =
          "sequence " + std::to_string(b) + " step " + std::to_string(k);
      const auto hf_out = at(k, "output")[b].index_select(0, rows);
      const auto hf_weights =
          at(k, "weights")[b].index_select(1, rows).index_select(2, cols);
      expect_hf_close(out[0], hf_out, what + " output vs HF");
      expect_hf_close(weights[0], hf_weights, what + " weights vs HF");
      const auto mine = batched_out[k][b].index_select(0, rows);
      EXPECT_TRUE(torch::allclose(out[0], mine, 1e-5, 1e-6))
          << what << ": batched vs alone, max abs "
          << (out[0] - mine).abs().max().item<double>();
      const auto mine_weights =
          batched_weights[k][b].index_select(1, rows);  // (H, Tb, P + T)
      EXPECT_TRUE(torch::allclose(
          weights[0], mine_weights.index_select(2, cols), 1e-5, 1e-6))
          << what << ": batched vs alone weights";
      // The batched pads get exactly no attention.
      const auto pads =
          (~keep[b].narrow(0, 0, P + T)).nonzero().squeeze(1);  // (pads)
      EXPECT_TRUE(mine_weights.index_select(2, pads).eq(0).all().item<bool>())
          << what;
      P += T;
    }
  }
}

TEST(HfTest, OptionsFromConfig) {
  const auto llama = mha::hf::attention_options(case_dir("llama"), 1);
  EXPECT_EQ(llama.embed_dim(), 32);
  EXPECT_EQ(llama.num_heads(), 4);
  EXPECT_EQ(llama.num_kv_heads(), c10::optional<int64_t>(2));
  EXPECT_TRUE(llama.rotary());
  EXPECT_EQ(llama.rotary_pairing(), mha::RotaryPairing::kHalf);
  EXPECT_DOUBLE_EQ(llama.rotary_theta(), 10000.0);
  EXPECT_FALSE(llama.bias());
  EXPECT_TRUE(llama.batch_first());

  const auto mistral = mha::hf::attention_options(case_dir("mistral"));
  EXPECT_EQ(mistral.window(), c10::optional<int64_t>(3));
  // Qwen2: the window from max_window_layers (1) on.
  EXPECT_FALSE(mha::hf::attention_options(case_dir("qwen2"), 0).window());
  EXPECT_EQ(mha::hf::attention_options(case_dir("qwen2"), 1).window(),
            c10::optional<int64_t>(3));
  EXPECT_TRUE(mha::hf::attention_options(case_dir("qwen2")).bias());

  const auto bloom = mha::hf::attention_options(case_dir("bloom"));
  EXPECT_EQ(bloom.position_bias(), mha::PositionBias::kAlibi);
  EXPECT_FALSE(bloom.rotary());

  // GPT-2's layer 1 with scale_attn_by_inverse_layer_idx: 1/sqrt(8)/2.
  const auto gpt2 = mha::hf::attention_options(case_dir("gpt2"), 1);
  ASSERT_TRUE(gpt2.scale().has_value());
  EXPECT_DOUBLE_EQ(*gpt2.scale(), 1.0 / std::sqrt(8.0) / 2.0);
  EXPECT_FALSE(mha::hf::attention_options(case_dir("gpt2"), 0).scale());

  const auto falcon = mha::hf::attention_options(case_dir("falcon_mqa"));
  EXPECT_EQ(falcon.num_kv_heads(), c10::optional<int64_t>(1));
  EXPECT_FALSE(falcon.bias());

  const auto t5 = mha::hf::attention_options(case_dir("t5_encoder"), 1);
  EXPECT_EQ(t5.position_bias(), mha::PositionBias::kRelative);
  EXPECT_EQ(t5.relative_num_buckets(), 8);
  EXPECT_EQ(t5.relative_max_distance(), 16);
  EXPECT_TRUE(t5.relative_bidirectional());
  EXPECT_EQ(t5.scale(), c10::optional<double>(1.0));
  EXPECT_FALSE(mha::hf::attention_options(case_dir("t5_encoder"), 1, "decoder")
                   .relative_bidirectional());

  const auto config = read_text(case_dir("t5_encoder") + "/config.json");
  EXPECT_FALSE(mha::hf::causal_attention(config));
  EXPECT_TRUE(mha::hf::causal_attention(config, "decoder"));
  EXPECT_TRUE(
      mha::hf::causal_attention(read_text(case_dir("bloom") + "/config.json")));
}

// rotary_dim and rotary_scaling as config.json says, both generations.
TEST(HfTest, RotaryOptionsFromConfig) {
  const auto yarn = mha::hf::attention_options(case_dir("llama_rope_yarn"));
  EXPECT_EQ(yarn.rotary_scaling().rope_type, "yarn");
  EXPECT_DOUBLE_EQ(yarn.rotary_scaling().factor, 4.0);
  EXPECT_EQ(yarn.rotary_scaling().original_max_position_embeddings, 4);
  EXPECT_EQ(yarn.rotary_scaling().max_position_embeddings, 16);
  EXPECT_FALSE(yarn.rotary_scaling().attention_factor.has_value());
  const auto yarn_af =
      mha::hf::attention_options(case_dir("llama_rope_yarn_attention_factor"));
  EXPECT_EQ(yarn_af.rotary_scaling().attention_factor,
            std::optional<double>(1.3));
  EXPECT_DOUBLE_EQ(yarn_af.rotary_scaling().beta_fast, 16.0);
  EXPECT_DOUBLE_EQ(yarn_af.rotary_scaling().beta_slow, 2.0);
  // longrope without a factor: max_position_embeddings / original = 16 / 4.
  const auto longrope =
      mha::hf::attention_options(case_dir("llama_rope_longrope"));
  EXPECT_EQ(longrope.rotary_scaling().rope_type, "longrope");
  EXPECT_DOUBLE_EQ(longrope.rotary_scaling().factor, 4.0);
  EXPECT_EQ(longrope.rotary_scaling().short_factor,
            std::vector<double>({1.0, 1.5, 2.0, 3.0}));
  EXPECT_EQ(longrope.rotary_scaling().long_factor,
            std::vector<double>({2.0, 3.0, 4.0, 6.0}));
  // 4.x rope_scaling + rope_theta.
  const auto llama3 = mha::hf::attention_options(case_dir("llama_4x_llama3"));
  EXPECT_EQ(llama3.rotary_scaling().rope_type, "llama3");
  EXPECT_DOUBLE_EQ(llama3.rotary_scaling().factor, 8.0);
  EXPECT_DOUBLE_EQ(llama3.rotary_theta(), 500000.0);
  EXPECT_EQ(llama3.rotary_scaling().original_max_position_embeddings, 4);
  EXPECT_EQ(
      mha::hf::attention_options(case_dir("llama")).rotary_scaling().rope_type,
      "default");
  // GPT-J: rotary_dim, interleaved; GPT-NeoX 5.x partial_rotary_factor and
  // 4.x rotary_pct + rotary_emb_base: 0.5 * head_dim 8 = 4, halves.
  const auto gptj = mha::hf::attention_options(case_dir("gptj"));
  EXPECT_EQ(gptj.rotary_dim(), c10::optional<int64_t>(4));
  EXPECT_EQ(gptj.rotary_pairing(), mha::RotaryPairing::kInterleaved);
  for (const std::string name : {"gpt_neox", "gpt_neox_4x"}) {
    const auto neox = mha::hf::attention_options(case_dir(name));
    EXPECT_EQ(neox.rotary_dim(), c10::optional<int64_t>(4)) << name;
    EXPECT_EQ(neox.rotary_pairing(), mha::RotaryPairing::kHalf) << name;
    EXPECT_DOUBLE_EQ(neox.rotary_theta(), 5000.0) << name;
    EXPECT_TRUE(neox.bias()) << name;
  }

  using mha::hf::attention_options_from_config;
  // Phi-3 writes original_max_position_embeddings at the top level; it
  // wins over the rope dict's (transformers' standardize_rope_params).
  const auto phi3 = attention_options_from_config(R"({"model_type": "llama",
      "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
      "max_position_embeddings": 128, "original_max_position_embeddings": 32,
      "rope_scaling": {"type": "longrope", "short_factor": [1, 1, 1, 1],
                       "long_factor": [1, 2, 3, 4],
                       "original_max_position_embeddings": 8}})");
  EXPECT_EQ(phi3.rotary_scaling().rope_type, "longrope");
  EXPECT_EQ(phi3.rotary_scaling().original_max_position_embeddings, 32);
  EXPECT_DOUBLE_EQ(phi3.rotary_scaling().factor, 4.0);  // 128 / 32
  // yarn without original_max_position_embeddings: O = M, factor as given.
  const auto yarn_m = attention_options_from_config(R"({"model_type": "llama",
      "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 1,
      "max_position_embeddings": 64,
      "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "mscale": 0.707,
                       "mscale_all_dim": 0.707, "truncate": false}})");
  EXPECT_EQ(yarn_m.rotary_scaling().original_max_position_embeddings, 0);
  EXPECT_EQ(yarn_m.rotary_scaling().max_position_embeddings, 64);
  EXPECT_DOUBLE_EQ(yarn_m.rotary_scaling().factor, 2.0);
  EXPECT_EQ(yarn_m.rotary_scaling().mscale, std::optional<double>(0.707));
  EXPECT_FALSE(yarn_m.rotary_scaling().truncate);
  // GPTJConfig's default rotary_dim is 64 when the key is absent.
  EXPECT_EQ(attention_options_from_config(R"({"model_type": "gptj",
      "n_embd": 256, "n_head": 2, "n_layer": 1})")
                .rotary_dim(),
            c10::optional<int64_t>(64));
}

// The checkpoint's dtype and eval mode; the layer's weights as stored
// (Llama: q_proj etc. of "model.layers.1.self_attn").
TEST(HfTest, LoadAttentionMapsWeights) {
  const auto attn = mha::hf::load_attention(case_dir("llama"), 1);
  EXPECT_FALSE(attn->is_training());
  EXPECT_EQ(attn->q_proj_weight.scalar_type(), torch::kFloat32);
  const auto all =
      mha::read_state_dict(case_dir("llama") + "/model.safetensors");
  EXPECT_TRUE(
      attn->q_proj_weight.equal(all["model.layers.1.self_attn.q_proj.weight"]));
  EXPECT_TRUE(
      attn->k_proj_weight.equal(all["model.layers.1.self_attn.k_proj.weight"]));
  EXPECT_TRUE(attn->out_proj->weight.equal(
      all["model.layers.1.self_attn.o_proj.weight"]));
  // A half-precision checkpoint gives a half-precision module.
  const std::string dir = fixtures::temp_dir("hf-half");
  fs::copy_file(case_dir("llama") + "/config.json", dir + "/config.json");
  torch::OrderedDict<std::string, torch::Tensor> half;
  for (const auto& item : all) {
    half.insert(item.key(), item.value().to(torch::kBFloat16));
  }
  mha::write_state_dict(half, dir + "/model.safetensors");
  const auto attn16 = mha::hf::load_attention(dir, 1);
  EXPECT_EQ(attn16->q_proj_weight.scalar_type(), torch::kBFloat16);
  EXPECT_TRUE(attn16->v_proj_weight.equal(
      half["model.layers.1.self_attn.v_proj.weight"]));
}

// BERT's whole layer: attention, residual + LayerNorm, GELU feed-forward,
// residual + LayerNorm, equal to BertLayer's output on the recorded input.
TEST(HfTest, BertEncoderLayerMatchesTransformers) {
  const auto ref =
      mha::parity::read_reference(case_dir("bert") + "/reference.safetensors");
  auto layer = mha::hf::load_encoder_layer(case_dir("bert"), 0);
  EXPECT_FALSE(layer->is_training());
  const auto keep = ref.tensors["attention_mask"] != 0;  // (N, L)
  torch::NoGradGuard no_grad;
  const auto out =
      layer->forward(ref.tensors["hidden_states"], {}, ~keep);  // (N, L, E)
  const auto expected = ref.tensors["layer_output"];
  const auto rows = keep.unsqueeze(-1).expand_as(expected);
  const auto diff = (out - expected).abs().masked_select(rows);
  const auto bound = (1e-5 + 1e-4 * expected.abs()).masked_select(rows);
  EXPECT_TRUE((diff <= bound).all().item<bool>())
      << "max abs " << diff.max().item<double>();
  EXPECT_THROW_MSG(mha::hf::load_encoder_layer(case_dir("llama"), 0),
                   "model_type 'llama' is not supported by load_encoder_layer");
}

TEST(HfTest, UnsupportedConfigValuesNameKeyAndValue) {
  using mha::hf::attention_options_from_config;
  EXPECT_THROW_MSG(attention_options_from_config(R"({"model_type": "gemma"})"),
                   "model_type 'gemma' is not supported");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "falcon", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "alibi": true})"),
                   "alibi true is not supported");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "bert", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "position_embedding_type": "relative_key"})"),
                   "position_embedding_type 'relative_key' is not supported");
  // A head_dim other than E / H is the module's head_dim (Qwen3, gpt-oss).
  EXPECT_EQ(attention_options_from_config(
                R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "head_dim": 16})")
                .head_dim(),
            c10::optional<int64_t>(16));
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "rope_scaling": {"rope_type": "mrope"}})"),
                   "config.json: rope_scaling.rope_type 'mrope' is not "
                   "supported (expected default, linear, dynamic, yarn, "
                   "longrope or llama3)");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "rope_parameters": {"rope_type": "yarn", "factor": 2,
                                  "ntk_alpha": 3}})"),
                   "config.json: rope_parameters.ntk_alpha 3 is not supported "
                   "(mha reads rope_type");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "max_position_embeddings": 16,
              "rope_parameters": {"rope_type": "longrope",
                                  "short_factor": [1, 2], "long_factor": [1, 2],
                                  "original_max_position_embeddings": 4}})"),
                   "short_factor and long_factor must have rotary_dim / 2 = 4 "
                   "entries, but have 2 and 2");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "rope_scaling": {"rope_type": "linear", "factor": "2"}})"),
                   "rope_scaling: factor must be a number, got \"2\"");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "gpt_neox", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 1,
              "rotary_pct": 0.375})"),
                   "config.json: rotary_pct 0.375 (3 of head_dim 8 features "
                   "rotated) is not supported");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "gptj", "n_embd": 32, "n_head": 4,
              "n_layer": 1, "rotary_dim": 16})"),
                   "config.json: rotary_dim 16 (16 of head_dim 8 features "
                   "rotated) is not supported");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "llama", "hidden_size": 32,
              "num_attention_heads": 4, "num_hidden_layers": 2})",
                       /*layer=*/2),
                   "layer 2 out of range");
  EXPECT_THROW_MSG(attention_options_from_config(
                       R"({"model_type": "t5", "d_model": 32, "num_heads": 4,
              "d_kv": 16, "num_layers": 1})"),
                   "d_kv 16 is not supported");
  EXPECT_THROW_MSG(attention_options_from_config("{not json"),
                   "config.json: not valid JSON");
  EXPECT_THROW_MSG(mha::hf::attention_options("/nonexistent-model-dir"),
                   "cannot open '/nonexistent-model-dir/config.json'");
}

// A checkpoint lacking a tensor of the layer, or holding one of the wrong
// shape: the message names the file and the tensor.
TEST(HfTest, MissingOrMisshapedTensorNamesFileAndKey) {
  const auto all =
      mha::read_state_dict(case_dir("llama") + "/model.safetensors");
  const std::string key = "model.layers.1.self_attn.k_proj.weight";
  const std::string missing = fixtures::temp_dir("hf-missing");
  const std::string misshaped = fixtures::temp_dir("hf-misshaped");
  torch::OrderedDict<std::string, torch::Tensor> without, wrong;
  for (const auto& item : all) {
    if (item.key() != key) {
      without.insert(item.key(), item.value());
      wrong.insert(item.key(), item.value());
    } else {
      wrong.insert(item.key(), item.value().narrow(0, 0, 8));
    }
  }
  for (const auto& dir : {missing, misshaped}) {
    fs::copy_file(case_dir("llama") + "/config.json", dir + "/config.json");
  }
  mha::write_state_dict(without, missing + "/model.safetensors");
  mha::write_state_dict(wrong, misshaped + "/model.safetensors");
  EXPECT_THROW_MSG(mha::hf::load_attention(missing, 1),
                   missing +
                       "/model.safetensors: no tensor "
                       "'layers.1.self_attn.k_proj.weight' (nor '" +
                       key + "')");
  EXPECT_THROW_MSG(mha::hf::load_attention(misshaped, 1),
                   misshaped + "/model.safetensors: tensor '" + key +
                       "' has shape [8, 32], but the config expects [16, 32]");
  // In memory (a reference file's tensors): the source is named.
  EXPECT_THROW_MSG(
      mha::hf::attention_from_tensors(
          read_text(case_dir("llama") + "/config.json"), without, 1, "encoder",
          "ref.safetensors"),
      "ref.safetensors: no tensor 'layers.1.self_attn.k_proj.weight'");
  // No checkpoint at all.
  const std::string empty = fixtures::temp_dir("hf-empty");
  fs::copy_file(case_dir("llama") + "/config.json", empty + "/config.json");
  EXPECT_THROW_MSG(mha::hf::load_attention(empty, 1),
                   "holds no model.safetensors");
}

// Reference files that embed the layer's tensors and config (as
// record_reference.py writes them, no model_dir) check as the model
// directory does: GPT-2 (names with "transformer."), T5's decoder (block 0's
// relative_attention_bias inside).
TEST(HfTest, SelfContainedReferenceFile) {
  for (const std::string name : {"gpt2", "t5_decoder"}) {
    const std::string file = case_dir(name) + "/recorded.safetensors";
    const auto ref = mha::parity::read_reference(file);
    EXPECT_EQ(ref.metadata.count("model_dir"), 0u);
    EXPECT_EQ(ref.metadata.count("config"), 1u);
    const auto check = mha::parity::check_reference(file);
    EXPECT_TRUE(check.within) << name << ": " << check.worst;
    EXPECT_EQ(check.parts.size(), 2u);
  }
  // The format needs its metadata: a plain safetensors file is refused.
  const std::string dir = fixtures::temp_dir("hf-plain");
  mha::write_state_dict(
      mha::read_state_dict(case_dir("qwen2") + "/reference.safetensors"),
      dir + "/plain.safetensors");
  EXPECT_THROW_MSG(mha::parity::read_reference(dir + "/plain.safetensors"),
                   "__metadata__ format must be 'mha-attention-reference'");
}

}  // namespace
