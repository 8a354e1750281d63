// Tests of mha/train.h: the toy tasks, the models, the training loop, exact
// resume, checkpoints loadable with load_state_dict, and the loss curve.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "mha/state_dict.h"
#include "mha/train.h"
#include "test_helpers.h"
#include "train_test_helpers.h"

namespace {

namespace fs = std::filesystem;
namespace train = mha::train;
using mha_test::expect_exact_resume;
using mha_test::TempDir;

std::string read_file(const std::string& path) {
  std::ifstream file(path);
  std::stringstream buffer;
  buffer << file.rdbuf();
  return buffer.str();
}

/// A small digit task that trains in well under a second per 100 steps.
train::DigitTask tiny_digit_task(double dropout = 0.0, uint64_t seed = 0) {
  return train::DigitTask(
      train::DigitDataOptions(train::DigitRule::kReverse).min_len(1).max_len(6),
      train::DigitTransformerOptions(6)
          .d_model(32)
          .nhead(2)
          .num_layers(2)
          .dim_feedforward(64)
          .dropout(dropout),
      /*batch_size=*/32, seed);
}

/// A text with structure a character model picks up in a few steps.
std::string tiny_text() {
  std::string text;
  for (int i = 0; i < 60; ++i) {
    text += "the cat sat on the mat. the dog sat on the log. ";
  }
  return text;
}

train::CharLMTask tiny_char_task(
    double dropout = 0.0, uint64_t seed = 0,
    train::CharBatching batching = train::CharBatching::kWindows) {
  auto corpus = train::make_char_corpus(tiny_text(), /*val_fraction=*/0.1,
                                        /*context=*/32);
  const auto V = corpus.vocab.size();
  return train::CharLMTask(std::move(corpus),
                           train::CharLMOptions(V, /*block_size=*/32)
                               .n_embd(32)
                               .n_head(2)
                               .n_layer(1)
                               .dropout(dropout),
                           /*batch_size=*/8, seed, torch::kCPU,
                           train::CharDocumentOptions().batching(batching));
}

double mean_loss(const std::vector<train::LossRecord>& history, size_t begin,
                 size_t end) {
  double sum = 0.0;
  for (size_t i = begin; i < end; ++i) {
    sum += history[i].train_loss;
  }
  return sum / static_cast<double>(end - begin);
}

}  // namespace

// ------------------------------------------------------------------ data ---

TEST(TrainDataTest, DeriveSeedDependsOnSeedStepAndStream) {
  using train::SeedStream;
  const auto a = train::derive_seed(0, 1, SeedStream::kTrainData);
  EXPECT_EQ(a, train::derive_seed(0, 1, SeedStream::kTrainData));
  EXPECT_NE(a, train::derive_seed(1, 1, SeedStream::kTrainData));
  EXPECT_NE(a, train::derive_seed(0, 2, SeedStream::kTrainData));
  EXPECT_NE(a, train::derive_seed(0, 1, SeedStream::kEvalData));
}

TEST(TrainDataTest, DigitBatchReversesSortsAndPads) {
  for (const auto rule :
       {train::DigitRule::kReverse, train::DigitRule::kSort}) {
    const auto options = train::DigitDataOptions(rule).min_len(2).max_len(9);
    const auto batch = train::make_digit_batch(options, 50, /*seed=*/7);
    ASSERT_EQ(batch.input.sizes(), (std::vector<int64_t>{50, 9}));
    ASSERT_EQ(batch.target.sizes(), (std::vector<int64_t>{50, 9}));
    ASSERT_EQ(batch.padding.scalar_type(), torch::kBool);
    for (int64_t n = 0; n < 50; ++n) {
      const int64_t length = batch.lengths[n].item<int64_t>();
      ASSERT_GE(length, 2);
      ASSERT_LE(length, 9);
      auto digits = batch.input[n].narrow(0, 0, length);
      auto answer = batch.target[n].narrow(0, 0, length);
      auto expected = rule == train::DigitRule::kReverse
                          ? digits.flip({0})
                          : std::get<0>(digits.sort());
      EXPECT_TRUE(torch::equal(answer, expected));
      EXPECT_TRUE(digits.lt(train::kNumDigits).all().item<bool>());
      const int64_t pad = 9 - length;
      EXPECT_TRUE(batch.input[n]
                      .narrow(0, length, pad)
                      .eq(train::kPadToken)
                      .all()
                      .item<bool>());
      EXPECT_TRUE(batch.target[n]
                      .narrow(0, length, pad)
                      .eq(train::kIgnoreIndex)
                      .all()
                      .item<bool>());
      EXPECT_EQ(batch.padding[n].sum().item<int64_t>(), pad);
      EXPECT_FALSE(batch.padding[n].narrow(0, 0, length).any().item<bool>());
    }
    // A pure function of the seed.
    const auto again = train::make_digit_batch(options, 50, /*seed=*/7);
    EXPECT_TRUE(torch::equal(batch.input, again.input));
    const auto other = train::make_digit_batch(options, 50, /*seed=*/8);
    EXPECT_FALSE(torch::equal(batch.input, other.input));
  }
  EXPECT_THROW_MSG(train::make_digit_batch(
                       train::DigitDataOptions(train::DigitRule::kSort), 0, 0),
                   "batch_size must be >= 1, but got 0");
  EXPECT_THROW_MSG(
      train::make_digit_batch(train::DigitDataOptions(train::DigitRule::kSort)
                                  .min_len(5)
                                  .max_len(3),
                              4, 0),
      "min_len 5 and max_len 3");
}

TEST(TrainDataTest, MaskedCrossEntropyAveragesOverRealTokens) {
  torch::manual_seed(0);
  auto logits = torch::randn({2, 3, 10});
  const int64_t ignore = train::kIgnoreIndex;
  auto target = torch::tensor({int64_t{1}, int64_t{2}, ignore, int64_t{3},
                               ignore, ignore})
                    .view({2, 3});
  auto log_p = torch::log_softmax(logits, -1);
  const double expected =
      -(log_p[0][0][1] + log_p[0][1][2] + log_p[1][0][3]).item<double>() / 3.0;
  EXPECT_NEAR(train::masked_cross_entropy(logits, target).item<double>(),
              expected, 1e-6);
}

TEST(TrainDataTest, CharCorpusSplitsAndRefusesShortTexts) {
  const auto corpus = train::make_char_corpus("abcabcabcabcabcabcabcd", 0.5, 4);
  EXPECT_EQ(corpus.vocab.chars(), "abcd");
  EXPECT_EQ(corpus.train.size(0), 11);
  EXPECT_EQ(corpus.val.size(0), 11);
  EXPECT_EQ(corpus.vocab.decode(corpus.val), "cabcabcabcd");
  EXPECT_EQ(corpus.vocab.decode(corpus.vocab.encode("dcba")), "dcba");
  EXPECT_THROW_MSG(train::make_char_corpus("abcdefghij", 0.1, 8),
                   "the text (10 characters) is too short for a context of 8");
  EXPECT_THROW_MSG(corpus.vocab.encode("abz"), "byte 122 at offset 2");
}

TEST(TrainDataTest, UnigramBaselineIsCrossEntropyUnderTrainFrequencies) {
  // train "aab" (counts a 2, b 1, c 0; add-one: 3/6, 2/6, 1/6), val "abc".
  const auto corpus = train::make_char_corpus("aababc", 0.5, 1);
  const double expected =
      -(std::log(3.0 / 6) + std::log(2.0 / 6) + std::log(1.0 / 6)) / 3.0;
  EXPECT_NEAR(train::unigram_baseline(corpus), expected, 1e-12);
}

TEST(TrainDataTest, CharBatchesAreShiftedWindows) {
  auto data = torch::arange(100, torch::kInt64);
  auto [input, target] = train::sample_char_batch(data, 6, 10, /*seed=*/3);
  ASSERT_EQ(input.sizes(), (std::vector<int64_t>{6, 10}));
  EXPECT_TRUE(torch::equal(target, input + 1));
  EXPECT_TRUE(torch::equal(input.select(1, 1) - input.select(1, 0),
                           torch::ones({6}, torch::kInt64)));
  auto [again, unused] = train::sample_char_batch(data, 6, 10, /*seed=*/3);
  EXPECT_TRUE(torch::equal(input, again));
}

// Packed documents: rows filled exactly, each document a span of the text
// (here the text is 0, 1, 2, ... so a span counts up by one), positions
// restarting at 0, targets the next character within the document only;
// the padded layout holds the same documents one per row.
TEST(TrainDataTest, PackedDocumentsFillRowsAndPadToTheSameDocuments) {
  auto data = torch::arange(500, torch::kInt64);
  const int64_t N = 6, T = 32, min_len = 4, max_len = 20;
  const auto batch =
      train::sample_packed_char_batch(data, N, T, min_len, max_len, /*seed=*/7);
  ASSERT_EQ(batch.input.sizes(), (std::vector<int64_t>{N, T}));
  ASSERT_EQ(batch.target.sizes(), (std::vector<int64_t>{N, T}));
  ASSERT_EQ(batch.positions.sizes(), (std::vector<int64_t>{N, T}));
  ASSERT_EQ(static_cast<int64_t>(batch.lengths.size()), N);
  int64_t documents = 0;
  for (int64_t row = 0; row < N; ++row) {
    const auto lengths = batch.lengths[row];
    EXPECT_EQ(lengths.sum().item<int64_t>(), T) << "row " << row;
    const int64_t docs = lengths.numel();
    documents += docs;
    EXPECT_GE(docs, 2) << "row " << row;  // max_len < T
    int64_t start = 0;
    for (int64_t d = 0; d < docs; ++d) {
      const int64_t length = lengths[d].item<int64_t>();
      EXPECT_LE(length, max_len);
      if (d + 1 < docs) {
        EXPECT_GE(length, min_len);  // only the last may be cut shorter
      }
      auto input = batch.input[row].narrow(0, start, length);
      auto target = batch.target[row].narrow(0, start, length);
      auto positions = batch.positions[row].narrow(0, start, length);
      EXPECT_TRUE(torch::equal(positions, torch::arange(length)));
      EXPECT_TRUE(torch::equal(input, input[0] + torch::arange(length)));
      EXPECT_TRUE(torch::equal(target.narrow(0, 0, length - 1),
                               input.narrow(0, 1, length - 1)));
      EXPECT_EQ(target[length - 1].item<int64_t>(), train::kIgnoreIndex);
      start += length;
    }
  }
  EXPECT_EQ(batch.documents(), documents);
  EXPECT_EQ(batch.predicted(), N * T - documents);
  EXPECT_EQ((batch.target != train::kIgnoreIndex).sum().item<int64_t>(),
            batch.predicted());

  const auto again =
      train::sample_packed_char_batch(data, N, T, min_len, max_len, 7);
  EXPECT_TRUE(torch::equal(again.input, batch.input));
  const auto other =
      train::sample_packed_char_batch(data, N, T, min_len, max_len, 8);
  EXPECT_FALSE(torch::equal(other.input, batch.input));

  const auto shard = batch.rows(2, 3);
  EXPECT_TRUE(torch::equal(shard.input, batch.input.narrow(0, 2, 3)));
  ASSERT_EQ(shard.lengths.size(), 3u);
  EXPECT_TRUE(torch::equal(shard.lengths[0], batch.lengths[2]));

  const auto padded = train::pad_documents(batch);
  ASSERT_EQ(padded.input.size(0), documents);
  int64_t d = 0, longest = 0;
  for (int64_t row = 0; row < N; ++row) {
    int64_t start = 0;
    for (int64_t i = 0; i < batch.lengths[row].numel(); ++i, ++d) {
      const int64_t length = batch.lengths[row][i].item<int64_t>();
      longest = std::max(longest, length);
      EXPECT_TRUE(torch::equal(padded.input[d].narrow(0, 0, length),
                               batch.input[row].narrow(0, start, length)));
      EXPECT_TRUE(torch::equal(padded.target[d].narrow(0, 0, length),
                               batch.target[row].narrow(0, start, length)));
      EXPECT_FALSE(padded.padding[d].narrow(0, 0, length).any().item<bool>());
      EXPECT_TRUE(padded.padding[d]
                      .narrow(0, length, padded.input.size(1) - length)
                      .all()
                      .item<bool>());
      start += length;
    }
  }
  EXPECT_EQ(padded.input.size(1), longest);
  EXPECT_EQ((padded.target != train::kIgnoreIndex).sum().item<int64_t>(),
            batch.predicted());
  EXPECT_THROW_MSG(train::sample_packed_char_batch(data, N, T, 0, 8, 7),
                   "1 <= min_len <= max_len <= context = 32");
  EXPECT_THROW_MSG(train::sample_packed_char_batch(data, N, T, 4, 33, 7),
                   "max_len 33");
}

// ---------------------------------------------------------------- models ---

TEST(TrainModelTest, CharLMTiesItsHeadAndIsCausal) {
  torch::manual_seed(0);
  train::CharLM lm(train::CharLMOptions(/*vocab_size=*/11, /*block_size=*/8)
                       .n_embd(16)
                       .n_head(2)
                       .n_layer(2)
                       .dropout(0.0)
                       .rotary(false));
  std::set<std::string> keys;
  for (const auto& item : lm->named_parameters()) {
    keys.insert(item.key());
  }
  EXPECT_TRUE(keys.count("wte.weight"));
  EXPECT_TRUE(keys.count("h.1.attn.in_proj_weight"));
  EXPECT_TRUE(keys.count("h.0.c_proj.weight"));
  for (const auto& key : keys) {
    EXPECT_EQ(key.find("head"), std::string::npos) << key;  // tied: no head
  }
  auto idx = torch::randint(11, {2, 8});
  auto logits = lm(idx);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 8, 11}));
  // Changing character 5 changes no prediction made before it.
  auto changed = idx.clone();
  changed.select(1, 5).copy_(idx.select(1, 5).add(1).remainder(11));
  auto logits2 = lm(changed);
  expect_close(logits2.narrow(1, 0, 5), logits.narrow(1, 0, 5), 1e-6);
  EXPECT_FALSE(
      torch::allclose(logits2.narrow(1, 5, 3), logits.narrow(1, 5, 3)));
  // The gradient reaches the embedding through the tied head.
  logits.sum().backward();
  EXPECT_GT(lm->wte->weight.grad().abs().sum().item<double>(), 0.0);
  EXPECT_THROW_MSG(lm(torch::randint(11, {1, 9})),
                   "T <= block_size = 8, but got [1, 9]");
}

// The strongest check that nothing leaks across documents: a packed batch
// (causal document mask, positions restarting per document) gives every
// document the logits, and so the loss, it gets alone, one document at a
// time; and the padded layout the same. Rotary and learned positions, blocks
// smaller than, equal to and larger than the rows.
TEST(TrainModelTest, PackedBatchLossEqualsTheDocumentsLossesAlone) {
  const int64_t V = 11, T = 32, N = 5;
  auto data = torch::randint(V, {400}, torch::kInt64);
  const auto batch =
      train::sample_packed_char_batch(data, N, T, /*min_len=*/3,
                                      /*max_len=*/T, /*seed=*/11);
  for (const bool rotary : {true, false}) {
    torch::manual_seed(0);
    train::CharLM lm(train::CharLMOptions(V, T)
                         .n_embd(32)
                         .n_head(2)
                         .n_layer(2)
                         .dropout(0.0)
                         .rotary(rotary));
    // One document at a time: the summed loss of its targets, its logits.
    double alone_sum = 0.0;
    std::vector<torch::Tensor> alone_logits;
    for (int64_t row = 0; row < N; ++row) {
      int64_t start = 0;
      for (int64_t i = 0; i < batch.lengths[row].numel(); ++i) {
        const int64_t length = batch.lengths[row][i].item<int64_t>();
        auto document = batch.input[row].narrow(0, start, length);
        auto logits = lm(document.unsqueeze(0)).squeeze(0);  // (length, V)
        alone_logits.push_back(logits);
        if (length > 1) {
          alone_sum +=
              torch::nn::functional::cross_entropy(
                  logits.narrow(0, 0, length - 1),
                  document.narrow(0, 1, length - 1),
                  torch::nn::functional::CrossEntropyFuncOptions().reduction(
                      torch::kSum))
                  .item<double>();
        }
        start += length;
      }
    }
    const double alone_mean =
        alone_sum / static_cast<double>(batch.predicted());
    for (const int64_t block : {8, 32, 64}) {
      SCOPED_TRACE("rotary " + std::to_string(rotary) + ", block " +
                   std::to_string(block));
      const auto mask =
          train::packed_documents_block_mask(batch.lengths, block);
      EXPECT_EQ(mask.kv_num_blocks.size(0), N);
      auto packed = lm->forward(batch.input, batch.positions, mask);  // (N,T,V)
      const double packed_mean =
          train::masked_cross_entropy(packed, batch.target).item<double>();
      EXPECT_NEAR(packed_mean, alone_mean, 1e-5 * alone_mean);
      int64_t d = 0;
      for (int64_t row = 0; row < N; ++row) {
        int64_t start = 0;
        for (int64_t i = 0; i < batch.lengths[row].numel(); ++i, ++d) {
          const int64_t length = batch.lengths[row][i].item<int64_t>();
          expect_close(packed[row].narrow(0, start, length), alone_logits[d],
                       2e-5, 1e-5, "row " + std::to_string(row));
          start += length;
        }
      }
    }
    const auto padded = train::pad_documents(batch);
    auto padded_logits =
        lm->forward(padded.input, {}, {}, padded.padding);  // (D, L, V)
    EXPECT_NEAR(train::masked_cross_entropy(padded_logits, padded.target)
                    .item<double>(),
                alone_mean, 1e-5 * alone_mean);
  }
}

TEST(TrainModelTest, PackedDocumentsBlockMaskIsPerRowAndCausal) {
  const std::vector<torch::Tensor> rows = {torch::tensor({3, 5}),
                                           torch::tensor({8})};
  const auto mask = train::packed_documents_block_mask(rows, /*block=*/4);
  ASSERT_EQ(mask.q_len, 8);
  ASSERT_EQ(mask.kv_num_blocks.sizes(), (std::vector<int64_t>{2, 1, 2}));
  // Row 0: query block 1 (tokens 4-7, document 1 from token 3) sees key
  // blocks 0 and 1; row 1 (one document): block 1 sees block 0 whole.
  auto dense = mask.to_dense();
  EXPECT_TRUE(dense[0][0][1][0].item<bool>());
  EXPECT_FALSE(dense[0][0][0][1].item<bool>());
  EXPECT_EQ(mask.full_kv_num_blocks[1][0][1].item<int32_t>(), 1);
  const auto index = torch::TensorOptions().dtype(torch::kLong);
  auto q = torch::arange(8, index).unsqueeze(1);
  auto kv = torch::arange(8, index).unsqueeze(0);
  auto row0 = mask.mask_mod(torch::scalar_tensor(0, index),
                            torch::scalar_tensor(0, index), q, kv);
  auto row1 = mask.mask_mod(torch::scalar_tensor(1, index),
                            torch::scalar_tensor(0, index), q, kv);
  EXPECT_TRUE(torch::equal(row1, q.ge(kv)));
  EXPECT_FALSE(row0[4][2].item<bool>());  // another document
  EXPECT_TRUE(row0[4][3].item<bool>());
  EXPECT_TRUE(row0[2][0].item<bool>());
  EXPECT_THROW_MSG(train::packed_documents_block_mask(
                       {torch::tensor({3, 5}), torch::tensor({7})}, 4),
                   "row 0 holds 8 and row 1 holds 7");
}

// The maps mha-train --plot-attention draws: block 0's weights equal a hand
// computation from the embeddings (softmax(q kᵀ / sqrt(d)) under a causal
// mask), block 1's rows are distributions that are 0 right of the diagonal.
TEST(TrainModelTest, CharLMAttentionWeightsMatchAHandComputation) {
  torch::manual_seed(0);
  const int64_t E = 16, H = 2, T = 6, d = E / H;
  train::CharLM lm(train::CharLMOptions(/*vocab_size=*/9, /*block_size=*/8)
                       .n_embd(E)
                       .n_head(H)
                       .n_layer(2)
                       .dropout(0.1)
                       .rotary(false));
  auto idx = torch::randint(9, {3, T});
  auto weights = lm->attention_weights(idx);
  ASSERT_EQ(weights.size(), 2u);
  EXPECT_TRUE(lm->is_training());  // mode restored

  torch::NoGradGuard no_grad;
  auto* block = lm->h[0]->as<train::GPTBlockImpl>();
  auto x = block->ln_1(lm->wte(idx) + lm->wpe(torch::arange(T)));  // (N,T,E)
  auto qkv = torch::linear(x, block->attn->in_proj_weight,
                           block->attn->in_proj_bias);  // (N, T, 3E)
  auto q = qkv.narrow(2, 0, E).view({3, T, H, d}).transpose(1, 2);
  auto k = qkv.narrow(2, E, E).view({3, T, H, d}).transpose(1, 2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(double(d));
  auto future = torch::ones({T, T}, torch::kBool).triu(1);
  auto expected = scores.masked_fill(future, -INFINITY).softmax(-1);
  ASSERT_EQ(weights[0].sizes(), (std::vector<int64_t>{3, H, T, T}));
  expect_close(weights[0], expected, 1e-6);

  ASSERT_EQ(weights[1].sizes(), (std::vector<int64_t>{3, H, T, T}));
  expect_close(weights[1].sum(-1), torch::ones({3, H, T}), 1e-6);
  EXPECT_EQ(weights[1].masked_select(future).abs().max().item<float>(), 0.0f);
  EXPECT_THROW_MSG(lm->attention_weights(torch::randint(9, {1, 9})),
                   "T <= block_size = 8, but got [1, 9]");
}

// The default (rotary) CharLM: no wpe, any length, each block sees the
// last block_size positions (two blocks of window 4: position t depends on
// characters t - 6..t only), and decoding through KV caches gives the
// logits of the full forward.
TEST(TrainModelTest, RotaryCharLMHasAWindowAndDecodesThroughCaches) {
  torch::manual_seed(0);
  train::CharLM lm(train::CharLMOptions(/*vocab_size=*/11, /*block_size=*/4)
                       .n_embd(16)
                       .n_head(2)
                       .n_layer(2)
                       .dropout(0.0));
  for (const auto& item : lm->named_parameters()) {
    EXPECT_EQ(item.key().find("wpe"), std::string::npos) << item.key();
  }
  lm->eval();
  torch::NoGradGuard no_grad;
  auto idx = torch::randint(11, {2, 12});
  auto logits = lm(idx);  // T = 12 > block_size
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{2, 12, 11}));
  auto changed = idx.clone();
  changed.select(1, 0).copy_(idx.select(1, 0).add(1).remainder(11));
  auto logits2 = lm(changed);
  EXPECT_FALSE(torch::allclose(logits2.narrow(1, 6, 1),
                               logits.narrow(1, 6, 1)));  // 6 - 0 < 2 * 3 + 1
  expect_close(logits2.narrow(1, 7, 5), logits.narrow(1, 7, 5), 1e-6, 0.0,
               "beyond the two windows");

  for (bool rotary : {true, false}) {
    SCOPED_TRACE(rotary ? "rotary" : "learned");
    torch::manual_seed(1);
    train::CharLM model(train::CharLMOptions(11, 12)
                            .n_embd(16)
                            .n_head(2)
                            .n_layer(2)
                            .rotary(rotary)
                            .dropout(0.0));
    model->eval();
    auto caches = model->make_kv_caches(2, 12);
    ASSERT_EQ(caches.size(), 2u);
    auto full = model(idx);
    int64_t done = 0;
    for (int64_t step : {5, 1, 1, 3, 2}) {
      auto part = model->forward_cached(idx.narrow(1, done, step), caches);
      expect_close(part, full.narrow(1, done, step), 2e-5, 2e-5,
                   "logits at " + std::to_string(done));
      done += step;
    }
    EXPECT_THROW_MSG(model->forward_cached(idx.narrow(1, 0, 1), caches),
                     rotary ? "cache has room for 0 more positions"
                            : "T <= block_size = 0 (after the cached");
  }
  auto one_cache = lm->make_kv_caches(2, 4);
  one_cache.pop_back();
  EXPECT_THROW_MSG(lm->forward_cached(idx.narrow(1, 0, 1), one_cache),
                   "one KVCache per block (2), but got 1");
}

// The case: mha-train's default char LM (CharLMOptions' defaults),
// 256 characters after a 256-character prompt, greedy: identical with and
// without the KV caches; and sampled with a seed, for both position kinds.
TEST(TrainModelTest, GenerateWithCacheEqualsRecomputation) {
  torch::manual_seed(0);
  train::CharLM lm(train::CharLMOptions(/*vocab_size=*/65, /*block_size=*/64));
  auto prompt = torch::randint(65, {256});
  auto greedy = train::SamplingOptions().top_k(1);
  auto cached = train::generate(lm, prompt, 256, greedy, true);
  auto recomputed = train::generate(lm, prompt, 256, greedy, false);
  ASSERT_EQ(cached.size(0), 512);
  EXPECT_TRUE(torch::equal(cached, recomputed));
  EXPECT_TRUE(torch::equal(cached.narrow(0, 0, 256), prompt));

  for (bool rotary : {true, false}) {
    train::CharLM small(
        train::CharLMOptions(13, 16).n_embd(16).n_head(2).n_layer(2).rotary(
            rotary));
    auto p = torch::randint(13, {5});
    auto options = train::SamplingOptions().temperature(1.0).seed(3);
    // 11 new characters fit block_size 16; 30 do not (learned positions
    // then recompute their cropped context).
    for (int64_t n : {11, 30}) {
      EXPECT_TRUE(torch::equal(train::generate(small, p, n, options, true),
                               train::generate(small, p, n, options, false)))
          << (rotary ? "rotary, " : "learned, ") << n << " new characters";
    }
  }
}

TEST(TrainModelTest, GenerateIsSeededAndTopOneIsGreedy) {
  torch::manual_seed(0);
  train::CharLM lm(train::CharLMOptions(7, 6).n_embd(16).n_head(2).n_layer(1));
  auto prompt = torch::tensor({1, 2, 3}, torch::kInt64);
  auto options = train::SamplingOptions().temperature(1.0).top_k(0).seed(5);
  auto a = train::generate(lm, prompt, 10, options);
  auto b = train::generate(lm, prompt, 10, options);
  ASSERT_EQ(a.size(0), 13);
  EXPECT_TRUE(torch::equal(a, b));
  EXPECT_TRUE(torch::equal(a.narrow(0, 0, 3), prompt));
  EXPECT_TRUE(lm->is_training());  // mode restored
  // top_k = 1: always the most likely character.
  auto greedy = train::generate(lm, prompt, 1, options.top_k(1));
  torch::NoGradGuard no_grad;
  lm->eval();
  const auto best = lm(prompt.unsqueeze(0)).select(1, 2).argmax(-1);
  EXPECT_EQ(greedy[3].item<int64_t>(), best.item<int64_t>());
}

TEST(TrainModelTest, DigitTransformerShapesAndPaddingIndependence) {
  torch::manual_seed(0);
  train::DigitTransformer model(
      train::DigitTransformerOptions(8).d_model(16).nhead(2).num_layers(1));
  model->eval();
  const auto batch = train::make_digit_batch(
      train::DigitDataOptions(train::DigitRule::kReverse).max_len(8), 4, 1);
  auto logits = model(batch.input, batch.padding);
  ASSERT_EQ(logits.sizes(), (std::vector<int64_t>{4, 8, 10}));
  // What stands at padded positions does not change the real ones.
  auto other_input = batch.input.masked_fill(batch.padding, 3);
  auto logits2 = model(other_input, batch.padding);
  auto real = batch.padding.logical_not().unsqueeze(-1);
  expect_close(logits2.masked_fill(~real, 0), logits.masked_fill(~real, 0),
               1e-5);
}

// ----------------------------------------------------------- optimisation ---

TEST(TrainLoopTest, LearningRateWarmsUpThenFollowsACosine) {
  const train::LrSchedule s{/*peak_lr=*/1.0, /*min_lr=*/0.1,
                            /*warmup_steps=*/10, /*total_steps=*/110};
  EXPECT_DOUBLE_EQ(s.at(1), 0.1);
  EXPECT_DOUBLE_EQ(s.at(5), 0.5);
  EXPECT_DOUBLE_EQ(s.at(10), 1.0);
  EXPECT_NEAR(s.at(60), 0.55, 1e-12);  // halfway: (peak + min) / 2
  EXPECT_NEAR(s.at(110), 0.1, 1e-12);
  EXPECT_NEAR(s.at(200), 0.1, 1e-12);
}

TEST(TrainLoopTest, AdamWDecaysMatricesOnly) {
  torch::nn::Linear linear(3, 4);
  auto optimizer = train::make_adamw(*linear, 1e-3, 0.5);
  ASSERT_EQ(optimizer->param_groups().size(), 2u);
  const auto& decayed = optimizer->param_groups()[0];
  const auto& not_decayed = optimizer->param_groups()[1];
  EXPECT_EQ(decayed.params()[0].dim(), 2);
  EXPECT_EQ(not_decayed.params()[0].dim(), 1);
  EXPECT_DOUBLE_EQ(
      static_cast<const torch::optim::AdamWOptions&>(decayed.options())
          .weight_decay(),
      0.5);
  EXPECT_DOUBLE_EQ(
      static_cast<const torch::optim::AdamWOptions&>(not_decayed.options())
          .weight_decay(),
      0.0);
  train::set_learning_rate(*optimizer, 0.25);
  EXPECT_DOUBLE_EQ(static_cast<const torch::optim::AdamWOptions&>(
                       optimizer->param_groups()[1].options())
                       .lr(),
                   0.25);
}

// Stated factor: the mean training loss of the last 10 of 250 steps is at
// most a tenth of the first 10 steps' (measured with LibTorch 1.13: 2.36 →
// 0.014, a factor of 170); a few seconds on one core.
TEST(TrainLoopTest, ShortDigitRunLossFallsTenfold) {
  auto task = tiny_digit_task();
  const auto result = train::train(
      task, train::TrainOptions().steps(250).lr(3e-3).warmup_steps(10));
  ASSERT_EQ(result.history.size(), 250u);
  const double first = mean_loss(result.history, 0, 10);
  const double last = mean_loss(result.history, 240, 250);
  RecordProperty("first_loss", std::to_string(first));
  RecordProperty("last_loss", std::to_string(last));
  EXPECT_LT(last, first / 10.0) << "first " << first << ", last " << last;
  EXPECT_TRUE(std::isfinite(result.val_loss));
  EXPECT_LT(result.val_loss, first / 10.0);
}

// Stated margin: within 150 steps on a repetitive text the character model's
// validation loss ends 1 nat/char below its unigram baseline (measured with
// LibTorch 1.13: 0.37 vs 2.33, 1.96 below); about a second.
TEST(TrainLoopTest, ShortCharRunBeatsTheUnigramBaseline) {
  auto task = tiny_char_task();
  const auto result = train::train(
      task, train::TrainOptions().steps(150).lr(3e-3).warmup_steps(10));
  const double baseline = task.unigram_baseline();
  RecordProperty("val_loss", std::to_string(result.val_loss));
  RecordProperty("unigram_baseline", std::to_string(baseline));
  EXPECT_LT(result.val_loss, baseline - 1.0)
      << "val " << result.val_loss << ", unigram baseline " << baseline;
  const auto sample = task.sample("the ", 20, train::SamplingOptions());
  EXPECT_EQ(sample.size(), 24u);
  EXPECT_EQ(sample.rfind("the ", 0), 0u);
}

// Packed documents train the character model as windows do, with the loss
// of the padded layout on the same documents, and the timing of both.
TEST(TrainLoopTest, PackedCharRunBeatsTheUnigramBaselineAsPaddedDoes) {
  auto packed = tiny_char_task(0.0, 0, train::CharBatching::kPacked);
  auto padded = tiny_char_task(0.0, 0, train::CharBatching::kPadded);
  EXPECT_NE(packed.fingerprint(), tiny_char_task().fingerprint());
  EXPECT_NE(packed.fingerprint(), padded.fingerprint());
  EXPECT_EQ(packed.documents().min_len(), 4);  // 32 / 8
  EXPECT_EQ(packed.documents().max_len(), 32);
  // The same documents, the same initial weights: the same loss.
  const auto first = packed.training_loss(1);
  const auto again = padded.training_loss(1);
  EXPECT_EQ(first.tokens, again.tokens);
  EXPECT_EQ(first.tokens, packed.documents_of_step(1).predicted());
  EXPECT_NEAR(first.loss.item<double>(), again.loss.item<double>(), 1e-5);

  const auto result = train::train(
      packed, train::TrainOptions().steps(150).lr(3e-3).warmup_steps(10));
  EXPECT_LT(result.val_loss, packed.unigram_baseline() - 1.0)
      << "val " << result.val_loss << ", unigram baseline "
      << packed.unigram_baseline();

  const auto timing = packed.compare_document_layouts(/*batches=*/2);
  EXPECT_EQ(timing.batches, 2);
  EXPECT_EQ(timing.tokens, 2 * 8 * 32);
  EXPECT_GT(timing.padded_positions, timing.tokens);
  EXPECT_GT(timing.packed_tokens_per_s, 0.0);
  EXPECT_GT(timing.padded_tokens_per_s, 0.0);
  for (const auto& parameter : packed.model().parameters()) {
    ASSERT_TRUE(!parameter.grad().defined() ||
                parameter.grad().abs().sum().item<double>() == 0.0);
  }
  EXPECT_THROW_MSG(train::CharLMTask(packed.corpus(), packed.lm()->options, 8,
                                     0, torch::kCPU,
                                     train::CharDocumentOptions()
                                         .batching(train::CharBatching::kPacked)
                                         .max_len(33)),
                   "max_len <= block_size = 32");
}

// ------------------------------------------------------ resume, checkpoints
// ---

// With dropout, so that the saved generator state matters.
TEST(TrainCheckpointTest, ResumedDigitRunReproducesLossesExactly) {
  expect_exact_resume([] { return tiny_digit_task(/*dropout=*/0.1); }, "digit");
}

TEST(TrainCheckpointTest, ResumedCharRunReproducesLossesExactly) {
  expect_exact_resume([] { return tiny_char_task(/*dropout=*/0.1); }, "char");
}

TEST(TrainCheckpointTest, ResumedPackedCharRunReproducesLossesExactly) {
  expect_exact_resume(
      [] {
        return tiny_char_task(/*dropout=*/0.1, /*seed=*/0,
                              train::CharBatching::kPacked);
      },
      "packed");
}

TEST(TrainCheckpointTest, CheckpointWeightsLoadWithLoadStateDict) {
  const TempDir dir("load");
  auto task = tiny_char_task();
  train::train(
      task, train::TrainOptions().steps(5).warmup_steps(1).out_dir(dir.path()));
  const train::RunFiles files(dir.path());
  ASSERT_TRUE(fs::exists(files.model));
  ASSERT_TRUE(fs::exists(files.trainer));
  ASSERT_TRUE(fs::exists(files.loss_csv));
  ASSERT_TRUE(fs::exists(files.loss_svg));
  EXPECT_FALSE(fs::exists(files.checkpoint_dir + ".tmp"));

  auto fresh = tiny_char_task(/*dropout=*/0.0, /*seed=*/99);  // other weights
  const auto result = mha::load_state_dict(fresh.model(), files.model);
  EXPECT_TRUE(result.missing_keys.empty());
  EXPECT_TRUE(result.unexpected_keys.empty());
  const auto trained = mha::state_dict(task.model());
  const auto loaded = mha::state_dict(fresh.model());
  ASSERT_EQ(trained.size(), loaded.size());
  for (const auto& item : trained) {
    EXPECT_TRUE(torch::equal(item.value(), loaded[item.key()])) << item.key();
  }
  // The same for the digit model (an mha::TransformerEncoder inside).
  auto digit = tiny_digit_task();
  train::train(digit, train::TrainOptions().steps(3).warmup_steps(1).out_dir(
                          dir.path()));
  auto digit_fresh = tiny_digit_task(0.0, /*seed=*/5);
  mha::load_state_dict(digit_fresh.model(), files.model);
  for (const auto& item : mha::state_dict(digit.model())) {
    EXPECT_TRUE(torch::equal(item.value(),
                             mha::state_dict(digit_fresh.model())[item.key()]))
        << item.key();
  }
}

TEST(TrainCheckpointTest, ResumeRefusesOtherSettingsAndMissingCheckpoints) {
  const TempDir dir("refuse");
  auto task = tiny_digit_task();
  EXPECT_THROW_MSG(train::train(task, train::TrainOptions()
                                          .steps(4)
                                          .warmup_steps(1)
                                          .out_dir(dir.path())
                                          .resume(true)),
                   "no checkpoint to resume in");
  train::train(
      task, train::TrainOptions().steps(4).warmup_steps(1).out_dir(dir.path()));
  auto again = tiny_digit_task();
  EXPECT_THROW_MSG(train::train(again, train::TrainOptions()
                                           .steps(4)
                                           .warmup_steps(1)
                                           .lr(5e-3)
                                           .out_dir(dir.path())
                                           .resume(true)),
                   "lr 0.001 vs 0.005");
  auto other_seed = tiny_digit_task(0.0, /*seed=*/3);
  EXPECT_THROW_MSG(train::train(other_seed, train::TrainOptions()
                                                .steps(4)
                                                .warmup_steps(1)
                                                .out_dir(dir.path())
                                                .resume(true)),
                   "seed 0 vs 3");
  EXPECT_THROW_MSG(train::validate(train::TrainOptions().steps(0)),
                   "steps must be >= 1, but got 0");
  EXPECT_THROW_MSG(train::validate(train::TrainOptions().resume(true)),
                   "resume needs an out_dir");
}

// ------------------------------------------------------ loss curve, progress
// ---

TEST(TrainOutputTest, LossCurveCsvAndSvg) {
  std::vector<train::LossRecord> records;
  for (int64_t step = 1; step <= 300; ++step) {
    train::LossRecord r;
    r.step = step;
    r.lr = 1e-3;
    r.train_loss = 2.5 * std::exp(-step / 60.0) + 0.01;
    if (step % 100 == 0) {
      r.val_loss = r.train_loss * 1.1;
    }
    r.tokens_per_s = 1000;
    r.elapsed_s = step * 0.01;
    records.push_back(r);
  }
  const TempDir dir("curve");
  const auto csv_path = dir.path() + "/loss.csv",
             svg_path = dir.path() + "/loss.svg";
  train::write_loss_csv(records, csv_path);
  train::write_loss_svg(records, "a <title> & more", svg_path);
  std::istringstream csv(read_file(csv_path));
  std::string line;
  std::getline(csv, line);
  EXPECT_EQ(line, "step,lr,train_loss,val_loss,tokens_per_s,elapsed_s");
  int rows = 0, with_val = 0;
  while (std::getline(csv, line)) {
    ++rows;
    with_val += line.find(",,") == std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(rows, 300);
  EXPECT_EQ(with_val, 3);
  const auto svg = read_file(svg_path);
  EXPECT_EQ(svg.rfind("<svg xmlns=\"http://www.w3.org/2000/svg\"", 0), 0u);
  EXPECT_NE(svg.find("a &lt;title&gt; &amp; more"), std::string::npos);
  EXPECT_NE(svg.find("validation loss"), std::string::npos);
  EXPECT_NE(svg.find("<circle"), std::string::npos);
  EXPECT_NE(svg.find("</svg>"), std::string::npos);
  EXPECT_THROW_MSG(
      train::write_loss_csv(records, dir.path() + "/no/such/dir.csv"),
      "cannot write");
  EXPECT_THROW_MSG(train::write_loss_svg({}, "t", svg_path), "no records");
}

TEST(TrainOutputTest, PlotAttentionWritesOneLabelledSvgPerLayer) {
  TempDir dir("plot_attention");
  auto task = tiny_char_task();
  const auto out = dir.path() + "/maps";
  const auto paths = task.plot_attention(out, /*length=*/10);
  ASSERT_EQ(paths, std::vector<std::string>{out + "/layer0.svg"});
  const auto svg = read_file(paths[0]);
  EXPECT_NE(svg.find("layer 0, head 0"), std::string::npos);
  EXPECT_NE(svg.find("layer 0, head 1"), std::string::npos);
  // 2 heads x 10 x 10 cells, 45 per head right of the diagonal masked.
  size_t cells = 0, masked = 0;
  for (size_t at = svg.find("class=\"cell"); at != std::string::npos;
       at = svg.find("class=\"cell", at + 1)) {
    ++cells;
    masked += svg.compare(at, 19, "class=\"cell masked\"") == 0;
  }
  EXPECT_EQ(cells, 200u);
  EXPECT_EQ(masked, 90u);
  // Labelled with the validation text's characters, the space shown as ␣.
  const auto text =
      task.corpus().vocab.decode(task.corpus().val.narrow(0, 0, 10));
  ASSERT_NE(text.find(' '), std::string::npos);
  EXPECT_NE(svg.find(">\u2423</text>"), std::string::npos);
  EXPECT_THROW_MSG(task.plot_attention(out, 33), "length must be in [1, 32]");
  EXPECT_THROW_MSG(task.plot_attention(out, 0), "length must be in [1, 32]");
}

TEST(TrainOutputTest, ProgressLinesAreThrottledInLogs) {
  train::ProgressThrottle log(/*interactive=*/false, /*steps=*/1000);
  int shown = 0;
  for (int64_t step = 1; step <= 1000; ++step) {
    train::Progress p;
    p.step = step;
    p.steps = 1000;
    shown += log.should_show(p, /*now_s=*/step * 0.001) ? 1 : 0;
  }
  EXPECT_EQ(shown, 20);
  train::ProgressThrottle terminal(/*interactive=*/true, /*steps=*/1000,
                                   /*min_interval_s=*/0.25);
  shown = 0;
  for (int64_t step = 1; step <= 999; ++step) {
    train::Progress p;
    p.step = step;
    p.steps = 1000;
    shown += terminal.should_show(p, /*now_s=*/step * 0.0625) ? 1 : 0;
  }
  EXPECT_EQ(shown, 250);  // every 4th step: one line per 0.25 s

  train::Progress p;
  p.step = 42;
  p.steps = 3000;
  p.loss = 1.23456;
  p.lr = 1e-3;
  p.tokens_per_s = 52345;
  p.eta_s = 65;
  p.val_loss = 1.1;
  p.checkpointed = true;
  EXPECT_EQ(train::format_progress(p),
            "step   42/3000 | loss 1.2346 | lr 1.00e-03 | 52.3k tok/s | ETA "
            "1m05s | val 1.1000 | saved");
  EXPECT_EQ(train::format_duration(42), "42s");
  EXPECT_EQ(train::format_duration(3725), "1h02m");
}
