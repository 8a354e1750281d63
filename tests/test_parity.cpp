// Tests of the parity library behind mha-parity.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <regex>
#include <set>

#include "mha/mha.h"
#include "mha/parity.h"
#include "test_helpers.h"

namespace {

using mha::parity::Case;
using mha::parity::MaskKind;
using mha::parity::Status;

class ParityTest : public SeededTest {};

TEST_F(ParityTest, DefaultMatrixHasThirtyNamedCasesThatPass) {
  auto cases = mha::parity::default_cases();
  ASSERT_GE(cases.size(), 30u);
  std::set<std::string> names;
  int ref_diffs = 0, encoder_rows = 0, decoder_rows = 0, transformer_rows = 0;
  for (const auto& c : cases) {
    encoder_rows += c.encoder_layer ? 1 : 0;
    decoder_rows += c.decoder_layer ? 1 : 0;
    transformer_rows += c.transformer ? 1 : 0;
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate " << c.name;
    auto r = mha::parity::run_case(c, torch::kCPU, 0);
    EXPECT_NE(r.status, Status::kFail) << c.name << ": " << r.note;
    EXPECT_TRUE(r.float64.used) << c.name;
    if (r.status == Status::kRefDiff) {
      ++ref_diffs;
      EXPECT_FALSE(r.note.empty()) << c.name << " must say why";
      // torch::nn ran too, and really differs (or threw) on this row.
      EXPECT_TRUE(r.torch_nn.used) << c.name;
      EXPECT_FALSE(r.torch_nn.within) << c.name;
    } else if (r.note.rfind("float64 only", 0) == 0) {
      // Options torch::nn's layers lack (norm_first, bias=false), and
      // FlexAttention's score_mod.
      EXPECT_TRUE(c.encoder_layer || c.decoder_layer || c.transformer ||
                  !c.flex.empty())
          << c.name;
      EXPECT_FALSE(r.torch_nn.used) << c.name;
    } else {
      EXPECT_TRUE(r.torch_nn.used) << c.name;
    }
  }
  EXPECT_GT(ref_diffs, 0);
  EXPECT_GE(encoder_rows, 10);
  EXPECT_GE(decoder_rows, 10);
  EXPECT_GE(transformer_rows, 6);
}

TEST_F(ParityTest, PlantedFaultInDecoderLayerFails) {
  Case c;
  c.name = "planted-decoder";
  c.decoder_layer = true;
  c.is_causal = true;
  c.key_padding_mask = MaskKind::kBool;
  auto clean = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(clean.status, Status::kPass) << clean.note;
  EXPECT_TRUE(clean.torch_nn.used);
  // A fault in the cross-attention (the tampered module) is caught by both.
  c.tamper = [](mha::MultiHeadAttentionImpl& m) {
    m.in_proj_weight[9][0].add_(1e-2);  // a key row: memory's projection
  };
  auto r = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(r.status, Status::kFail);
  EXPECT_FALSE(r.torch_nn.within);
  EXPECT_FALSE(r.float64.within);
  c.norm_first = true;  // float64 alone catches it too
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kFail);
  // The same fault in the second decoder layer of a whole Transformer.
  c.decoder_layer = false;
  c.transformer = true;
  c.norm_first = false;
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kFail);
  c.tamper = nullptr;
  auto whole = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(whole.status, Status::kPass) << whole.note;
  EXPECT_TRUE(whole.torch_nn.used);
}

TEST_F(ParityTest, PlantedFaultInEncoderLayerFails) {
  Case c;
  c.name = "planted-encoder";
  c.encoder_layer = true;
  c.key_padding_mask = MaskKind::kBool;
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kPass);
  c.tamper = [](mha::MultiHeadAttentionImpl& m) {
    m.in_proj_weight[1][0].add_(1e-2);
  };
  auto r = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(r.status, Status::kFail);
  EXPECT_FALSE(r.torch_nn.within);
  EXPECT_FALSE(r.float64.within);
  // A row checked against float64 alone catches it too.
  c.norm_first = true;
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kFail);
  c.tamper = nullptr;
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kPass);
}

TEST_F(ParityTest, PlantedWeightFaultFails) {
  Case c;
  c.name = "planted";
  c.tamper = [](mha::MultiHeadAttentionImpl& m) {
    m.in_proj_weight[3][2].add_(1e-2);  // one weight of the mha copy
  };
  auto r = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(r.status, Status::kFail);
  EXPECT_FALSE(r.torch_nn.within);
  EXPECT_FALSE(r.float64.within);
  // The same case without the fault passes.
  c.tamper = nullptr;
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kPass);
}

TEST_F(ParityTest, PlantedFaultOnRefDiffRowFails) {
  Case c;
  c.name = "planted-ref-diff";
  c.attn_mask = MaskKind::kBool;  // torch::nn is not the reference here
  c.tamper = [](mha::MultiHeadAttentionImpl& m) {
    m.out_proj->bias[0].add_(1e-3);
  };
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kFail);
}

TEST_F(ParityTest, ReferenceMatchesHandComputedSingleHead) {
  // E = 1, H = 1, identity projections: weights = softmax(q k / 1).
  auto options = mha::MultiHeadAttentionOptions(1, 1).bias(false);
  std::map<std::string, torch::Tensor> params = {
      {"in_proj_weight", torch::ones({3, 1}, torch::kFloat64)},
      {"out_proj.weight", torch::ones({1, 1}, torch::kFloat64)}};
  mha::parity::Inputs in;
  in.query = torch::tensor({1.0, 2.0}, torch::kFloat64).view({1, 2, 1});
  in.key = torch::tensor({0.0, 1.0}, torch::kFloat64).view({1, 2, 1});
  in.value = torch::tensor({10.0, 20.0}, torch::kFloat64).view({1, 2, 1});
  in.key_padding_mask = torch::tensor({{false, false}});
  in.attn_mask = torch::tensor({{false, true}, {true, true}});
  auto [out, w] = mha::parity::reference_attention(options, params, in);
  // Query 0 sees key 0 only; query 1 sees nothing: weights 0, output 0.
  expect_close(w.view({2, 2}),
               torch::tensor({{1.0, 0.0}, {0.0, 0.0}}, torch::kFloat64), 0);
  expect_close(out.view({2}), torch::tensor({10.0, 0.0}, torch::kFloat64), 0);
  // No masks: softmax([1*0, 1*1]) for query 0.
  in.attn_mask = torch::Tensor();
  auto [out2, w2] = mha::parity::reference_attention(options, params, in);
  const double e = std::exp(1.0);
  expect_close(w2[0][0][0],
               torch::tensor({1 / (1 + e), e / (1 + e)}, torch::kFloat64),
               1e-15);
}

TEST_F(ParityTest, HalfTypesBoundedByTorchNnOwnError) {
  // bfloat16 runs on CPU too, so the half-type rule is checked without a GPU.
  Case c;
  c.name = "bf16";
  c.dtype = torch::kBFloat16;
  c.attn_mask = MaskKind::kFloat;
  auto r = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(r.status, Status::kPass) << r.note;
  EXPECT_NE(r.note.find("2x torch::nn's error"), std::string::npos) << r.note;
  // bfloat16 error is real but far below the float32-derived table.
  EXPECT_GT(r.float64.max_abs, 1e-4);
  c.tamper = [](mha::MultiHeadAttentionImpl& m) {
    m.out_proj->bias[0].add_(0.25);
  };
  EXPECT_EQ(mha::parity::run_case(c, torch::kCPU, 0).status, Status::kFail);
  // torch::nn's padding path fails for half types: a known difference.
  c.tamper = nullptr;
  c.key_padding_mask = MaskKind::kBool;
  auto padded = mha::parity::run_case(c, torch::kCPU, 0);
  EXPECT_EQ(padded.status, Status::kRefDiff) << padded.note;
}

TEST_F(ParityTest, InvalidCaseThrows) {
  Case c;
  c.name = "bad";
  c.unbatched = true;
  c.batch = 2;
  EXPECT_THROW_MSG(mha::parity::run_case(c, torch::kCPU, 0),
                   "unbatched needs batch = 1, but got 2");
}

TEST_F(ParityTest, Tolerances) {
  EXPECT_LT(mha::parity::tolerance_for(torch::kFloat64).atol,
            mha::parity::tolerance_for(torch::kFloat32).atol);
  EXPECT_THROW_MSG(mha::parity::tolerance_for(torch::kLong),
                   "dtype must be floating, but got Long");
  EXPECT_STREQ(mha::parity::to_string(Status::kRefDiff), "REF-DIFF");
}

}  // namespace
