// Tests of mha::RotaryScaling, rotary_frequencies and rotary_embedding_at
// against numbers recorded from Hugging Face transformers itself
// (tests/fixtures/rope_fixtures.*, written by scripts/make_rope_fixtures.py:
// inv_freq, cos, sin and attention_scaling of GPTNeoXRotaryEmbedding for
// every rope_type of transformers 5.x, all and half of head_dim rotated).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fixture_helpers.h"
#include "mha/positions.h"
#include "test_helpers.h"

namespace {

// ------------------------------------------------ transformers' numbers ---

/// The rope fixtures' index (tests/fixtures/rope_fixtures.json).
const nlohmann::json& rope_index() {
  static const nlohmann::json json = [] {
    std::ifstream in(fixtures::path("rope_fixtures.json"));
    TORCH_CHECK(in.is_open(), "cannot open rope_fixtures.json");
    return nlohmann::json::parse(in);
  }();
  return json;
}

/// RotaryScaling from a rope_parameters dict, key by key as the field
/// names; a key it does not know fails the test.
mha::RotaryScaling scaling_from(const nlohmann::json& params,
                                int64_t max_position_embeddings) {
  mha::RotaryScaling s;
  s.max_position_embeddings = max_position_embeddings;
  for (const auto& [key, value] : params.items()) {
    if (key == "rope_type") {
      s.rope_type = value.get<std::string>();
    } else if (key == "factor") {
      s.factor = value.get<double>();
    } else if (key == "original_max_position_embeddings") {
      s.original_max_position_embeddings = value.get<int64_t>();
    } else if (key == "low_freq_factor") {
      s.low_freq_factor = value.get<double>();
    } else if (key == "high_freq_factor") {
      s.high_freq_factor = value.get<double>();
    } else if (key == "beta_fast") {
      s.beta_fast = value.get<double>();
    } else if (key == "beta_slow") {
      s.beta_slow = value.get<double>();
    } else if (key == "attention_factor") {
      s.attention_factor = value.get<double>();
    } else if (key == "short_factor") {
      s.short_factor = value.get<std::vector<double>>();
    } else if (key == "long_factor") {
      s.long_factor = value.get<std::vector<double>>();
    } else if (key == "mscale") {
      s.mscale = value.get<double>();
    } else if (key == "mscale_all_dim") {
      s.mscale_all_dim = value.get<double>();
    } else if (key == "truncate") {
      s.truncate = value.get<bool>();
    } else if (key != "rope_theta" && key != "partial_rotary_factor") {
      ADD_FAILURE() << "rope_parameters key without a field: " << key;
    }
  }
  return s;
}

/// Hugging Face's apply_rotary_pos_emb on x (N, H, T, D) with cos and sin
/// (N, T, R) as its rotary module returns them: the first R features
/// become x·cos + rotate_half(x)·sin, the others pass.
torch::Tensor hf_apply_rotary(const torch::Tensor& x, const torch::Tensor& cos,
                              const torch::Tensor& sin) {
  const int64_t R = cos.size(-1), D = x.size(-1);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // (N, 1, T, R)
  auto rot = x.narrow(-1, 0, R);
  auto half =
      torch::cat({-rot.narrow(-1, R / 2, R / 2), rot.narrow(-1, 0, R / 2)},
                 -1);  // rotate_half
  return torch::cat({rot * c + half * s, x.narrow(-1, R, D - R)}, -1);
}

struct RopeCase {
  std::string name;
  int64_t head_dim = 0, rotary_dim = 0;
  double theta = 0.0;
  mha::RotaryScaling scaling;
  torch::Tensor positions, inv_freq, cos, sin;
  double attention_scaling = 1.0;
};

std::vector<RopeCase> rope_cases() {
  const auto tensors =
      mha::read_state_dict(fixtures::path("rope_fixtures.safetensors"));
  std::vector<RopeCase> cases;
  for (const auto& c : rope_index().at("cases")) {
    RopeCase rc;
    rc.name = c.at("name").get<std::string>();
    rc.head_dim = c.at("head_dim").get<int64_t>();
    rc.rotary_dim = c.at("rotary_dim").get<int64_t>();
    const auto& params = c.at("rope_parameters");
    rc.theta = params.at("rope_theta").get<double>();
    rc.scaling =
        scaling_from(params, c.at("max_position_embeddings").get<int64_t>());
    rc.positions = tensors[rc.name + ".positions"];
    rc.inv_freq = tensors[rc.name + ".inv_freq"];
    rc.cos = tensors[rc.name + ".cos"];
    rc.sin = tensors[rc.name + ".sin"];
    rc.attention_scaling =
        tensors[rc.name + ".attention_scaling"].item<double>();
    cases.push_back(rc);
  }
  return cases;
}

TEST(RopeFixtures, EveryRopeTypeAndPartialRotaryIsRecorded) {
  std::vector<std::string> types;
  int partial = 0;
  for (const auto& rc : rope_cases()) {
    types.push_back(rc.scaling.rope_type);
    partial += rc.rotary_dim < rc.head_dim;
  }
  for (const char* type :
       {"default", "linear", "dynamic", "yarn", "longrope", "llama3"}) {
    EXPECT_NE(std::find(types.begin(), types.end(), type), types.end()) << type;
  }
  EXPECT_GT(partial, 0);
}

// inv_freq and the attention factor of rotary_frequencies against the
// module's buffers after the call (relative 1e-5: transformers computes in
// float32), and rotary_embedding_at against apply_rotary_pos_emb with
// transformers' cos and sin.
bool is_large(const RopeCase& rc) {
  return rc.name.find("_large") != std::string::npos;
}

TEST(RopeFixtures, FrequenciesAndRotationMatchTransformers) {
  torch::manual_seed(0);
  for (const auto& rc : rope_cases()) {
    SCOPED_TRACE(rc.name);
    const int64_t seq_len = rc.positions.max().item<int64_t>() + 1;
    const auto freq =
        mha::rotary_frequencies(rc.rotary_dim, rc.theta, rc.scaling, seq_len);
    expect_close(freq.inv_freq, rc.inv_freq.to(torch::kFloat64), 0.0, 1e-5,
                 "inv_freq");
    EXPECT_NEAR(freq.attention_factor, rc.attention_scaling,
                1e-6 * rc.attention_scaling);
    if (is_large(rc)) {
      continue;  // below: HF's float32 angles drift there
    }
    auto x = torch::randn({2, 3, rc.positions.size(1), rc.head_dim},
                          torch::kFloat64);  // (N, H, T, D)
    auto expected = hf_apply_rotary(x, rc.cos.to(torch::kFloat64),
                                    rc.sin.to(torch::kFloat64));
    for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
      auto y = mha::rotary_embedding_at(x.to(dtype), rc.positions, rc.theta,
                                        mha::RotaryPairing::kHalf,
                                        rc.rotary_dim, rc.scaling);
      expect_hf_close(y, expected,
                      std::string("rotated ") + c10::toString(dtype));
    }
  }
}

// At positions 4000..7011 transformers' float32 angles drift from the
// formula; mha's rotation (angles in float64) must be at least as close to
// a float64 evaluation written out here (w_i = theta^(-2i/R) / factor for
// "default" and "linear") as transformers' own cos and sin are, in float64
// and float32.
TEST(RopeFixtures, LargePositionsAtLeastAsCloseToFloat64AsTransformers) {
  torch::manual_seed(0);
  int checked = 0;
  for (const auto& rc : rope_cases()) {
    if (!is_large(rc)) {
      continue;
    }
    SCOPED_TRACE(rc.name);
    ++checked;
    const int64_t R = rc.rotary_dim;
    auto w = torch::empty({R / 2}, torch::kFloat64);
    for (int64_t i = 0; i < R / 2; ++i) {
      w[i] = std::pow(rc.theta,
                      -2.0 * static_cast<double>(i) / static_cast<double>(R)) /
             (rc.scaling.rope_type == "linear" ? rc.scaling.factor : 1.0);
    }
    auto angles = rc.positions.to(torch::kFloat64).unsqueeze(-1) * w;
    auto both = torch::cat({angles, angles}, -1);  // (N, T, R), as HF's
    auto x = torch::randn({2, 3, rc.positions.size(1), rc.head_dim},
                          torch::kFloat64);
    auto exact = hf_apply_rotary(x, both.cos(), both.sin());
    auto hf = hf_apply_rotary(x, rc.cos.to(torch::kFloat64),
                              rc.sin.to(torch::kFloat64));
    const double hf_error = (hf - exact).abs().max().item<double>();
    for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
      auto y =
          mha::rotary_embedding_at(x.to(dtype), rc.positions, rc.theta,
                                   mha::RotaryPairing::kHalf, R, rc.scaling);
      const double error =
          (y.to(torch::kFloat64) - exact).abs().max().item<double>();
      EXPECT_LE(error, hf_error) << c10::toString(dtype);
      if (dtype == torch::kFloat64) {
        EXPECT_LT(error, 1e-9);
      }
    }
    EXPECT_GT(hf_error, 1e-5);  // the drift this case is about
  }
  EXPECT_EQ(checked, 2);
}

}  // namespace
