// Compiles and runs every C++ block of the guides (docs/*.md), extracted
// by tests/guide_blocks.cmake, and checks the values the guides document.
// Fragments are included into the body of their test (which may set up
// what the guide's text says the block starts from); whole programs are
// included at namespace scope with main renamed guide_NAME_main.
// Glossary: N batch, L target length, S source length, E embed_dim,
// H heads, D head_dim, T new tokens.
#include <gtest/gtest.h>
#include <mha/mha.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include "guide_includes.inc"
#include "test_helpers.h"

namespace {

// Every block the guides mark, as extracted at configure time.
struct GuideBlock {
  const char* name;
  const char* guide;
};
#define GUIDE_BLOCK(name, guide) GuideBlock{name, guide},
const std::vector<GuideBlock> kGuideBlocks = {
#include "guide_blocks.inc"
};
#undef GUIDE_BLOCK

// Whole programs.
#include "guide_first_program.inc"

// Runs a test body in a fresh temporary directory (blocks that write files).
class InTempDir {
 public:
  InTempDir()
      : old_(std::filesystem::current_path()),
        dir_(std::filesystem::temp_directory_path() /
             ("mha-guides-" + std::to_string(::getpid()))) {
    std::filesystem::create_directories(dir_);
    std::filesystem::current_path(dir_);
  }
  ~InTempDir() {
    std::filesystem::current_path(old_);
    std::filesystem::remove_all(dir_);
  }

 private:
  std::filesystem::path old_;
  std::filesystem::path dir_;
};

// Every marked block has a test of its name here, so none is extracted and
// then left uncompiled.
TEST(GuideBlocks, EveryBlockHasATest) {
  std::set<std::string> tests;
  const auto* suite = ::testing::UnitTest::GetInstance()->current_test_suite();
  for (int i = 0; i < suite->total_test_count(); ++i) {
    tests.insert(suite->GetTestInfo(i)->name());
  }
  ASSERT_GE(kGuideBlocks.size(), 12u);  // the guides' blocks when written
  for (const auto& block : kGuideBlocks) {
    EXPECT_EQ(tests.count(block.name), 1u)
        << block.guide << ": block " << block.name
        << " has no TEST(GuideBlocks, " << block.name << ")";
  }
}

// docs/getting-started.md
TEST(GuideBlocks, first_program) {
  testing::internal::CaptureStdout();
  const int rc = guide_first_program_main();
  const std::string printed = testing::internal::GetCapturedStdout();
  EXPECT_EQ(rc, 0);
  EXPECT_NE(printed.find("out [2, 10, 64], weights [2, 10, 10]\n"),
            std::string::npos)
      << printed;
  EXPECT_NE(printed.find(std::string("mha ") + mha::version() +
                         " on LibTorch " + mha::torch_version()),
            std::string::npos)
      << printed;
}

// docs/masks.md
TEST(GuideBlocks, mask_helpers) {
  torch::manual_seed(0);
#include "guide_mask_helpers.inc"
  // The drawn picture: row i blocks keys j > i.
  EXPECT_EQ(blocked.dtype(), torch::kBool);
  EXPECT_TRUE(
      torch::equal(blocked, torch::tensor({0, 1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1})
                                .view({3, 4})
                                .to(torch::kBool)));
  EXPECT_TRUE(torch::equal(padding, torch::tensor({false, false, true})));
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(torch::equal(
      additive, torch::tensor({0.f, -inf, -inf, 0.f, 0.f, -inf, 0.f, 0.f, 0.f})
                    .view({3, 3})));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({1, 1, 3, 3}));
  EXPECT_EQ(w.select(-1, 2).abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::allclose(w.sum(-1), torch::ones({1, 1, 3})));
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({1, 1, 3, 8}));
}

// docs/variants.md
TEST(GuideBlocks, gqa) {
  torch::manual_seed(0);
#include "guide_gqa.inc"
  EXPECT_EQ(gqa->k_proj_weight.sizes(), torch::IntArrayRef({16, 64}));
  EXPECT_EQ(gqa->in_proj_bias.sizes(), torch::IntArrayRef({96}));
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 10, 64}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 10, 10}));
}

TEST(GuideBlocks, rotary) {
  torch::manual_seed(0);
#include "guide_rotary.inc"
  EXPECT_EQ(q_rot.sizes(), q.sizes());
  // A rotation keeps each pair's length, so each row's norm.
  EXPECT_TRUE(
      torch::allclose((q_rot * q_rot).sum(-1), (q * q).sum(-1), 1e-4, 1e-5));
  // Position 0 is not rotated.
  EXPECT_TRUE(torch::allclose(q_rot.select(2, 0), q.select(2, 0)));
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({2, 10, 64}));
  EXPECT_EQ(attn.sizes(), torch::IntArrayRef({2, 10, 10}));
}

TEST(GuideBlocks, window) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
#include "guide_window.inc"
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({1, 4096, 256}));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_FALSE(unused.defined());  // need_weights=false
}

TEST(GuideBlocks, position_biases) {
  torch::manual_seed(0);
#include "guide_position_biases.inc"
  EXPECT_EQ(a.sizes(), torch::IntArrayRef({2, 10, 64}));
  EXPECT_EQ(b.sizes(), torch::IntArrayRef({2, 10, 64}));
  // "gradients reach the bias table"
  b.sum().backward();
  const auto table = t5->named_parameters()["relative_attention_bias.weight"];
  EXPECT_EQ(table.sizes(), torch::IntArrayRef({32, 8}));  // (buckets, H)
  ASSERT_TRUE(table.grad().defined());
  EXPECT_GT(table.grad().abs().sum().item<float>(), 0.0f);
}

// docs/flex.md
TEST(GuideBlocks, flex_softcap) {
  torch::manual_seed(0);
#include "guide_flex_softcap.inc"
  EXPECT_EQ(out.sizes(), torch::IntArrayRef({1, 8, 256, 64}));
  EXPECT_EQ(lse.sizes(), torch::IntArrayRef({1, 8, 256}));
  EXPECT_DOUBLE_EQ(block_mask.sparsity(), 25.0);  // 2 x 2 blocks, 1 skipped
  // Row 0 attends to key 0 alone: its output is v's row 0.
  EXPECT_TRUE(torch::allclose(out.select(2, 0), v.select(2, 0), 1e-5, 1e-6));
}

TEST(GuideBlocks, flex_learned_bias) {
  torch::manual_seed(0);
#include "guide_flex_learned_bias.inc"
  ASSERT_TRUE(table.grad().defined());
  EXPECT_EQ(table.grad().sizes(), torch::IntArrayRef({4, 255}));
  EXPECT_GT(table.grad().abs().sum().item<float>(), 0.0f);
  EXPECT_FALSE(unused.defined());
}

TEST(GuideBlocks, flex_packed) {
  torch::manual_seed(0);
  torch::NoGradGuard no_grad;
#include "guide_flex_packed.inc"
  auto [alone, w2] = attn->forward(x.narrow(1, 30, 70), {}, {}, {}, false, {},
                                   true, /*is_causal=*/true);
  EXPECT_TRUE(torch::allclose(packed.narrow(1, 30, 70), alone, 1e-5, 1e-5));
  EXPECT_FALSE(w.defined());
}

// docs/linear.md
TEST(GuideBlocks, linear_attention) {
  torch::manual_seed(0);
#include "guide_linear_attention.inc"
  EXPECT_EQ(heads.sizes(), torch::IntArrayRef({1, 4, 4096, 32}));
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 1000, 128}));
  EXPECT_FALSE(none.defined());
  EXPECT_EQ(prompt.sizes(), torch::IntArrayRef({2, 999, 128}));
  EXPECT_TRUE(torch::allclose(last, y.narrow(1, 999, 1), 1e-4, 1e-5));
  EXPECT_EQ(cache.kv_state().sizes(), torch::IntArrayRef({2, 4, 64, 32}));
  EXPECT_EQ(cache.size(), 1000);
  EXPECT_EQ(z.sizes(), torch::IntArrayRef({2, 300, 128}));
  EXPECT_EQ(w.sizes(), torch::IntArrayRef({2, 300, 64}));
}

// docs/decoding.md
TEST(GuideBlocks, kv_cache) {
  torch::manual_seed(0);
#include "guide_kv_cache.inc"
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({1, 100, 64}));
  EXPECT_EQ(z.sizes(), torch::IntArrayRef({1, 1, 64}));
  EXPECT_EQ(cache.size(), 101);
  // "The result equals the new rows of forward(whole sequence,
  // is_causal=true)."
  auto whole = torch::cat({prompt, next}, 1);  // (1, 101, 64)
  auto [full, unused3] =
      attn->forward(whole, {}, {}, {}, /*need_weights=*/false, {}, true,
                    /*is_causal=*/true);
  EXPECT_TRUE(torch::allclose(y, full.narrow(1, 0, 100), 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(z, full.narrow(1, 100, 1), 1e-5, 1e-5));
}

TEST(GuideBlocks, left_padded) {
  torch::manual_seed(0);
#include "guide_left_padded.inc"
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 3, 64}));
  EXPECT_EQ(z.sizes(), torch::IntArrayRef({2, 1, 64}));
  EXPECT_TRUE(
      torch::equal(positions, torch::tensor({0, 1, 2, 0, 0, 0}).view({2, 3})));
  EXPECT_TRUE(torch::equal(next_positions, torch::tensor({3, 1}).view({2, 1})));
  EXPECT_EQ(cache.size(), 4);
  // The padded query rows of sequence 1 attend to nothing: out_proj.bias,
  // never NaN.
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_TRUE(torch::allclose(y[1][0], attn->out_proj->bias));
  EXPECT_TRUE(torch::isfinite(z).all().item<bool>());
}

// docs/transformer.md
TEST(GuideBlocks, encoder) {
  torch::manual_seed(0);
#include "guide_encoder.inc"
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({2, 10, 64}));
  EXPECT_EQ(encoder->layers->size(), 4u);
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
}

TEST(GuideBlocks, transformer_decoding) {
  torch::manual_seed(0);
#include "guide_transformer_decoding.inc"
  EXPECT_EQ(y.sizes(), torch::IntArrayRef({8, 9, 64}));
  EXPECT_EQ(memory.sizes(), torch::IntArrayRef({8, 20, 64}));
  EXPECT_EQ(step.sizes(), torch::IntArrayRef({8, 1, 64}));
  EXPECT_EQ(cache.size(), 9);
  EXPECT_TRUE(torch::isfinite(step).all().item<bool>());
}

// docs/porting.md
TEST(GuideBlocks, state_dict) {
  torch::manual_seed(0);
  InTempDir in_temp_dir;
  auto make_encoder = [] {
    return mha::TransformerEncoder(mha::TransformerEncoderOptions(
        mha::TransformerEncoderLayer(
            mha::TransformerEncoderLayerOptions(16, 2)),
        /*num_layers=*/2));
  };
  // model.pt as Python's torch.save(model.state_dict()) would hold it.
  auto source = make_encoder();
  mha::save_state_dict(*source, "model.pt");
  auto encoder = make_encoder();
#include "guide_state_dict.inc"
  auto expected = source->named_parameters();
  for (const auto& item : encoder->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
  }
  auto reloaded = make_encoder();
  mha::load_state_dict(*reloaded, "model.safetensors");
  for (const auto& item : reloaded->named_parameters()) {
    EXPECT_TRUE(torch::equal(item.value(), expected[item.key()])) << item.key();
  }
}

TEST(GuideBlocks, hf_load) {
  // Running the block needs real checkpoints; here its first call must fail
  // clearly for a directory that does not exist.
  try {
#include "guide_hf_load.inc"
    ADD_FAILURE() << "mha::hf::load_attention found path/to/llama";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("path/to/llama"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

}  // namespace
