// Tests of copy_weights between mha and torch::nn modules.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "mha/mha.h"
#include "test_helpers.h"

namespace {

class CopyWeightsTest : public SeededTest {};

/// Both directions: after the copy, both modules compute the same output.
void expect_same_function(mha::MultiHeadAttention& ours,
                          torch::nn::MultiheadAttention& ref, int64_t kdim,
                          int64_t vdim) {
  auto q = torch::randn({2, 3, ours->options.embed_dim()});
  auto k = torch::randn({2, 4, kdim}), v = torch::randn({2, 4, vdim});
  auto [out, w] = ours(q, k, v);
  auto [ref_out, ref_w] =
      ref(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1));
  expect_close(out, ref_out.transpose(0, 1), 1e-5, 0, "output");
  expect_close(w, ref_w, 1e-5, 0, "weights");
}

TEST_F(CopyWeightsTest, TorchNnToMhaAndBack) {
  for (bool bias : {true, false}) {
    for (bool bias_kv : {false, true}) {
      SCOPED_TRACE(::testing::Message()
                   << "bias=" << bias << " add_bias_kv=" << bias_kv);
      torch::nn::MultiheadAttention ref(
          torch::nn::MultiheadAttentionOptions(8, 2).bias(bias).add_bias_kv(
              bias_kv));
      mha::MultiHeadAttention ours(
          mha::MultiHeadAttentionOptions(8, 2).bias(bias).add_bias_kv(bias_kv));
      mha::copy_weights(ref, ours);
      EXPECT_TRUE(torch::equal(ours->out_proj->weight, ref->out_proj->weight));
      expect_same_function(ours, ref, 8, 8);
      // Back: a fresh torch::nn module takes mha's weights.
      torch::nn::MultiheadAttention back(
          torch::nn::MultiheadAttentionOptions(8, 2).bias(bias).add_bias_kv(
              bias_kv));
      mha::copy_weights(ours, back);
      EXPECT_TRUE(torch::equal(back->in_proj_weight, ours->in_proj_weight));
      expect_same_function(ours, back, 8, 8);
    }
  }
}

TEST_F(CopyWeightsTest, SeparateProjections) {
  torch::nn::MultiheadAttention ref(
      torch::nn::MultiheadAttentionOptions(8, 2).kdim(5).vdim(5));
  mha::MultiHeadAttention ours(
      mha::MultiHeadAttentionOptions(8, 2).kdim(5).vdim(5));
  mha::copy_weights(ref, ours);
  EXPECT_TRUE(torch::equal(ours->k_proj_weight, ref->k_proj_weight));
  expect_same_function(ours, ref, 5, 5);
  mha::MultiHeadAttention other(
      mha::MultiHeadAttentionOptions(8, 2).kdim(5).vdim(5));
  mha::copy_weights(other, ref);
  EXPECT_TRUE(torch::equal(ref->v_proj_weight, other->v_proj_weight));
}

TEST_F(CopyWeightsTest, KeepsDestinationDtype) {
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  mha::MultiHeadAttention ours(8, 2);
  ours->to(torch::kFloat64);
  mha::copy_weights(ref, ours);
  EXPECT_EQ(ours->in_proj_weight.scalar_type(), torch::kFloat64);
  expect_close(ours->in_proj_weight, ref->in_proj_weight, 0);
}

TEST_F(CopyWeightsTest, MismatchThrows) {
  torch::nn::MultiheadAttention ref(torch::nn::MultiheadAttentionOptions(8, 2));
  mha::MultiHeadAttention wide(16, 2);
  EXPECT_THROW_MSG(mha::copy_weights(ref, wide),
                   "copy_weights: option embed_dim differs: source has 8, "
                   "destination has 16");
  mha::MultiHeadAttention heads(8, 4);
  EXPECT_THROW_MSG(mha::copy_weights(heads, ref),
                   "option num_heads differs: source has 4, destination has 2");
  mha::MultiHeadAttention kv(
      mha::MultiHeadAttentionOptions(8, 2).add_bias_kv(true));
  EXPECT_THROW_MSG(
      mha::copy_weights(ref, kv),
      "option add_bias_kv differs: source has 0, destination has 1");
  mha::MultiHeadAttention kdim(mha::MultiHeadAttentionOptions(8, 2).kdim(4));
  EXPECT_THROW_MSG(mha::copy_weights(kdim, ref),
                   "option kdim differs: source has 4, destination has 8");
}

}  // namespace
