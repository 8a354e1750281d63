// Compiles and runs the README's usage example (extracted by CMake).
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <torch/torch.h>

namespace {

TEST(ReadmeExampleTest, RunsAndGivesDocumentedShapes) {
  torch::manual_seed(0);
#include "readme_example.inc"
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 10, 64}));
  EXPECT_EQ(weights.sizes(), torch::IntArrayRef({2, 10, 10}));
  // Zero above the diagonal (is_causal) and on batch 1's padded keys.
  EXPECT_EQ(weights.triu(1).abs().max().item<float>(), 0.0f);
  EXPECT_EQ(weights[1].narrow(1, 7, 3).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::allclose(weights.sum(-1), torch::ones({2, 10})));
}

}  // namespace
