// Tests of the encoder–decoder task of mha/train.h (mha/train/seq2seq.h):
// addition batches checked digit by digit, exact-match counting, cached
// decoding against recomputation, a short run's learning signal, exact
// resume and the fingerprint.
// Glossary: N batch, S source length, T target length, V vocabulary size.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "test_helpers.h"
#include "train_test_helpers.h"

namespace {

namespace train = mha::train;

/// A small addition task that trains at a few ms per step.
train::AdditionTask tiny_addition_task(int64_t max_digits, double dropout = 0.0,
                                       uint64_t seed = 0) {
  const auto data = train::AdditionDataOptions().max_digits(max_digits);
  return train::AdditionTask(
      data,
      train::Seq2SeqTransformerOptions(
          train::kAddVocabSize, data.source_length(), data.target_length())
          .d_model(32)
          .nhead(2)
          .num_encoder_layers(1)
          .num_decoder_layers(1)
          .dim_feedforward(64)
          .dropout(dropout),
      /*batch_size=*/32, seed);
}

/// The number a right-aligned field row[begin, end) spells (padding, then
/// at least one digit) and its count of digits; -1 digits if the field is
/// not of that form.
std::pair<uint64_t, int64_t> read_field(const std::vector<int64_t>& row,
                                        int64_t begin, int64_t end) {
  int64_t i = begin;
  while (i < end && row[i] == mha::train::kAddPadToken) {
    ++i;
  }
  uint64_t value = 0;
  const int64_t digits = end - i;
  for (; i < end; ++i) {
    if (row[i] < 0 || row[i] > 9) {
      return {0, -1};
    }
    value = value * 10 + static_cast<uint64_t>(row[i]);
  }
  return {value, digits >= 1 ? digits : -1};
}

/// A 1-D int64 tensor of token ids.
torch::Tensor ids(std::vector<int64_t> values) { return torch::tensor(values); }

std::vector<int64_t> row_of(const torch::Tensor& t, int64_t n) {
  auto row = t[n].contiguous();
  return std::vector<int64_t>(row.data_ptr<int64_t>(),
                              row.data_ptr<int64_t>() + row.numel());
}

}  // namespace

// ------------------------------------------------------------------ data ---

// Every row re-read by hand: a '+' b in the source (each right-aligned in a
// field of max_digits, padding first), the sum's digits least significant
// first and EOS in the target, BOS and the shifted target in the decoder
// input, target padding only after the real tokens.
TEST(AdditionDataTest, BatchesHoldCorrectSumsReversed) {
  const auto options = train::AdditionDataOptions().max_digits(4);
  const int64_t N = 300, S = 9, T = 6;
  const auto batch = train::make_addition_batch(options, N, /*seed=*/7);
  ASSERT_EQ(batch.src.sizes(), (std::vector<int64_t>{N, S}));
  ASSERT_EQ(batch.tgt_input.sizes(), (std::vector<int64_t>{N, T}));
  ASSERT_EQ(batch.target.sizes(), (std::vector<int64_t>{N, T}));
  EXPECT_TRUE(
      torch::equal(batch.src_padding, batch.src == train::kAddPadToken));
  int64_t tokens = 0, five_digit_sums = 0;
  std::vector<int> digit_counts(5, 0);
  for (int64_t n = 0; n < N; ++n) {
    const auto src = row_of(batch.src, n);
    const auto [a, a_digits] = read_field(src, 0, 4);
    ASSERT_EQ(src[4], train::kAddPlusToken) << "row " << n;
    const auto [b, b_digits] = read_field(src, 5, S);
    ASSERT_TRUE(a_digits >= 1 && a_digits <= 4 && b_digits >= 1 &&
                b_digits <= 4)
        << "row " << n << ": " << batch.src[n];
    EXPECT_TRUE(a_digits == 1 || src[4 - a_digits] != 0)
        << "leading zero, row " << n;
    ++digit_counts[a_digits];
    // The expected target: the sum's digits, least significant first.
    std::vector<int64_t> expected;
    for (uint64_t s = a + b; expected.empty() || s > 0; s /= 10) {
      expected.push_back(static_cast<int64_t>(s % 10));
    }
    five_digit_sums += expected.size() == 5;
    expected.push_back(train::kAddEosToken);
    tokens += static_cast<int64_t>(expected.size());
    const auto target = row_of(batch.target, n);
    const auto input = row_of(batch.tgt_input, n);
    EXPECT_EQ(input[0], train::kAddBosToken);
    for (int64_t t = 0; t < T; ++t) {
      const bool real = t < static_cast<int64_t>(expected.size());
      EXPECT_EQ(target[t], real ? expected[t] : train::kIgnoreIndex)
          << "row " << n << " (" << a << " + " << b << "), position " << t;
      if (t + 1 < T) {
        EXPECT_EQ(input[t + 1], t + 1 < static_cast<int64_t>(expected.size())
                                    ? expected[t]
                                    : train::kAddPadToken)
            << "row " << n << ", position " << t + 1;
      }
    }
  }
  EXPECT_EQ(batch.tokens, tokens);
  EXPECT_GT(five_digit_sums, 0);  // carries out of the top digit occur
  for (int d = 1; d <= 4; ++d) {  // digit counts uniform: about 75 each
    EXPECT_GT(digit_counts[d], 40) << d << " digits";
  }
  // A pure function of the seed.
  EXPECT_TRUE(torch::equal(
      train::make_addition_batch(options, N, /*seed=*/7).src, batch.src));
  EXPECT_FALSE(torch::equal(
      train::make_addition_batch(options, N, /*seed=*/8).src, batch.src));
  EXPECT_THROW_MSG(train::make_addition_batch(options, 0, 1),
                   "batch_size must be >= 1, but got 0");
  EXPECT_THROW_MSG(
      train::make_addition_batch(
          train::AdditionDataOptions().min_digits(3).max_digits(19), 4, 1),
      "need 1 <= min_digits <= max_digits <= 18, but got min_digits 3 and "
      "max_digits 19");
}

TEST(AdditionDataTest, AdditionTextSpellsRows) {
  using train::kAddEosToken;
  using train::kAddPadToken;
  using train::kAddPlusToken;
  EXPECT_EQ(train::addition_text(ids({5, 7, kAddPlusToken, kAddPadToken, 8})),
            "57+8");
  EXPECT_EQ(
      train::addition_text(ids({5, 6, kAddEosToken, train::kIgnoreIndex})),
      "56");
}

// A hand-made case: row 0 right (its EOS included), row 1 wrong in one
// digit; a decoded row that stops before T counts as EOS-filled.
TEST(AdditionDataTest, CountMatchesNeedsEveryTargetTokenAndEos) {
  const int64_t E = train::kAddEosToken, I = train::kIgnoreIndex;
  auto target = ids({5, 6, E, I, 1, E, I, I}).view({2, 4});  // (N, T)
  auto decoded = ids({5, 6, E, 2, E, E}).view({2, 3});
  auto m = train::count_matches(decoded, target, E);
  EXPECT_EQ(m.sequences, 2);
  EXPECT_EQ(m.exact, 1);
  EXPECT_EQ(m.tokens, 5);
  EXPECT_EQ(m.correct_tokens, 4);
  // Missing EOS: "56" then "7" is wrong even though the digits match.
  auto no_eos = ids({5, 6, 7, 1, E, E}).view({2, 3});
  m = train::count_matches(no_eos, target, E);
  EXPECT_EQ(m.exact, 1);  // row 1 only
  EXPECT_EQ(m.correct_tokens, 4);
  // Stopped after two tokens: the rest reads as EOS.
  m = train::count_matches(ids({5, 6, 1, E}).view({2, 2}), target, E);
  EXPECT_EQ(m.exact, 2);
  EXPECT_THROW_MSG(
      train::count_matches(torch::zeros({3, 2}, torch::kInt64), target, E),
      "decoded must be (N, T') and target (N, T) with T' <= T, but got "
      "decoded [3, 2] and target [2, 4]");
}

// ----------------------------------------------------------------- model ---

// The decoder's cache gives the logits of full recomputation step by step,
// and padded source tokens change nothing.
TEST(Seq2SeqModelTest, CachedLogitsEqualForwardAndPaddingIsMasked) {
  torch::manual_seed(3);
  auto task = tiny_addition_task(/*max_digits=*/3);
  auto& model = task.transformer();
  model->eval();
  torch::NoGradGuard no_grad;
  const auto batch = train::make_addition_batch(task.data(), 16, 11);
  auto full = model(batch.src, batch.src_padding, batch.tgt_input);  // (N,T,V)
  auto cache = model->transformer->make_cache(
      model->encode(batch.src, batch.src_padding),
      /*capacity=*/batch.tgt_input.size(1), batch.src_padding);
  for (int64_t t = 0; t < batch.tgt_input.size(1); ++t) {
    auto step = model->forward_cached(batch.tgt_input.narrow(1, t, 1),
                                      cache);  // (N, 1, V)
    EXPECT_TRUE(torch::allclose(step.squeeze(1), full.select(1, t),
                                /*rtol=*/1e-5, /*atol=*/1e-5))
        << "position " << t << ", max diff "
        << (step.squeeze(1) - full.select(1, t)).abs().max().item<double>();
  }
  // Other tokens at padded source positions: the same logits.
  auto scrambled =
      torch::where(batch.src_padding,
                   torch::randint(0, 10, batch.src.sizes(), torch::kInt64),
                   batch.src);  // (N, S)
  EXPECT_TRUE(torch::allclose(
      model(scrambled, batch.src_padding, batch.tgt_input), full, 1e-5, 1e-5));
  EXPECT_THROW_MSG(
      model(batch.src, batch.src_padding, torch::zeros({16, 9}, torch::kInt64)),
      "tgt must be (N, L) int64 with 1 <= L <= 5, but got shape "
      "[16, 9]");
}

// Greedy decoding through the cache and by recomputing every step give the
// same tokens, untrained (arbitrary answers) and after a short training.
TEST(Seq2SeqModelTest, GreedyDecodingThroughTheCacheEqualsRecomputation) {
  auto task = tiny_addition_task(/*max_digits=*/3);
  auto& model = task.transformer();
  const auto batch = train::make_addition_batch(task.data(), 200, 5);
  auto decode = [&](bool use_cache) {
    return train::greedy_decode(model, batch.src, batch.src_padding,
                                train::kAddBosToken, train::kAddEosToken,
                                task.data().target_length(), use_cache);
  };
  auto cached = decode(true);
  EXPECT_TRUE(model->is_training());  // restored
  EXPECT_EQ(cached.size(0), 200);
  EXPECT_LE(cached.size(1), 5);
  EXPECT_TRUE(torch::equal(cached, decode(false)));
  train::train(task, train::TrainOptions().steps(60).lr(3e-3).warmup_steps(5));
  cached = decode(true);
  EXPECT_TRUE(torch::equal(cached, decode(false)));
  // After a row's EOS comes EOS only.
  auto is_eos = (cached == train::kAddEosToken).to(torch::kInt64);  // (N, T')
  EXPECT_TRUE(torch::equal(std::get<0>(is_eos.cummax(1)), is_eos));
  EXPECT_THROW_MSG(
      train::greedy_decode(model, batch.src, batch.src_padding,
                           train::kAddBosToken, train::kAddEosToken, 6),
      "max_len must be in [1, max_tgt_len = 5], but got 6");
}

// ------------------------------------------------------------------ task ---

// Stated margin: 300 steps of the tiny model on 1-2 digit additions bring
// the validation loss below half the uniform baseline log(14) = 2.64 nats
// and exact match on 500 held-out additions from 0 to above 5 % (measured
// with LibTorch 1.13: 1.035 nats, 59 of 500 right; the full model of
// mha-train --task add reaches 99 %); about 3 s on an idle core.
TEST(AdditionTaskTest, ShortRunLearnsToAdd) {
  auto task = tiny_addition_task(/*max_digits=*/2);
  const auto before = task.accuracy(500);
  const auto result = train::train(
      task, train::TrainOptions().steps(300).lr(3e-3).warmup_steps(20));
  const auto after = task.accuracy(500);
  const double uniform = std::log(static_cast<double>(train::kAddVocabSize));
  RecordProperty("val_loss", std::to_string(result.val_loss));
  RecordProperty("exact_before", std::to_string(before.exact));
  RecordProperty("exact_after", std::to_string(after.exact));
  EXPECT_LT(result.val_loss, uniform / 2.0) << "val " << result.val_loss;
  EXPECT_GT(after.exact, 25) << "of 500; before training " << before.exact;
  EXPECT_LT(before.exact, 5);
  EXPECT_EQ(after.sequences, 500);
  // The cached and the recomputed decoding score the same.
  const auto recomputed = task.accuracy(500, /*use_cache=*/false);
  EXPECT_EQ(recomputed.exact, after.exact);
  EXPECT_EQ(recomputed.correct_tokens, after.correct_tokens);
  EXPECT_NE(task.examples(2).find(" (model: "), std::string::npos);
}

// With dropout, so that the saved generator state matters.
TEST(AdditionTaskTest, ResumedRunReproducesLossesExactly) {
  mha_test::expect_exact_resume(
      [] { return tiny_addition_task(/*max_digits=*/3, /*dropout=*/0.1); },
      "add");
}

TEST(AdditionTaskTest, ResumeRefusesOtherDigitsAndChecksOptions) {
  const mha_test::TempDir dir("add_refuse");
  const auto options =
      train::TrainOptions().steps(3).warmup_steps(1).out_dir(dir.path());
  auto task = tiny_addition_task(/*max_digits=*/2);
  train::train(task, options);
  auto other = tiny_addition_task(/*max_digits=*/3);
  EXPECT_THROW_MSG(
      train::train(other, train::TrainOptions(options).resume(true)),
      "max_digits 2 vs 3");
  const auto data = train::AdditionDataOptions().max_digits(4);
  EXPECT_THROW_MSG(train::AdditionTask(
                       data, train::Seq2SeqTransformerOptions(12, 9, 6), 8, 0),
                   "vocab_size must be kAddVocabSize (14), but got 12");
  EXPECT_THROW_MSG(
      train::AdditionTask(data, train::Seq2SeqTransformerOptions(14, 8, 6), 8,
                          0),
      "must be >= the data's source and target lengths (9 and 6 for "
      "max_digits 4), but got 8 and 6");
}
