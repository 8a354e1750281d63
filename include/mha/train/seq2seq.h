// The encoder–decoder toy task (part of mha/train.h): adding two numbers
// with an mha::Transformer, trained with teacher forcing and decoded
// greedily through the decoder's cache (Transformer::make_cache /
// forward_cached).
//
// The data: the source holds the two operands right-aligned in fields of
// max_digits tokens around '+' ("_4821+___93" for max_digits 5; '_' is
// padding, masked as keys); the target is the sum's digits least
// significant first, "4194" for 4914. Writing the answer reversed is the
// standard trick for teaching addition to small Transformers (Lee et al.
// 2023, "Teaching Arithmetic to Small Transformers"): each digit then
// depends on the operands' digits at the same place and on the carry from
// the digit just written. Right-aligned fields put the digits of each place
// at fixed source positions, which learned position embeddings pick up in
// a few hundred steps.
//
// Glossary: N batch, S source length (2 * max_digits + 1), T target length
// (max_digits + 2: BOS or the digits of the sum, then EOS), E model width,
// V vocabulary size (kAddVocabSize).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "mha/train/data.h"
#include "mha/train/tasks.h"
#include "mha/transformer_decoder.h"

namespace mha::train {

// ------------------------------------------------------------------ data ---

/// Tokens of the addition task: digits 0..9 are their own ids, then these.
constexpr int64_t kAddPlusToken = 10;  ///< '+' between the operands
constexpr int64_t kAddPadToken = 11;   ///< padding of source and target input
constexpr int64_t kAddBosToken = 12;   ///< starts every decoder input
constexpr int64_t kAddEosToken = 13;   ///< ends every target
/// Vocabulary V of source and target: the digits and the four above.
constexpr int64_t kAddVocabSize = 14;

/// Random additions a + b. Each operand's number of digits is uniform in
/// [min_digits, max_digits], the operand uniform among the numbers with
/// that many digits (no leading zero; one digit: 0-9).
struct AdditionDataOptions {
  /// Fewest digits of an operand, >= 1.
  TORCH_ARG(int64_t, min_digits) = 1;
  /// Most digits of an operand, in [min_digits, 18].
  TORCH_ARG(int64_t, max_digits) = 5;

 public:
  /// Source length S = 2 * max_digits + 1.
  int64_t source_length() const { return 2 * max_digits() + 1; }
  /// Target length T = max_digits + 2 (the longest sum and EOS).
  int64_t target_length() const { return max_digits() + 2; }
};

/// One batch of a sequence-to-sequence task, padded to fixed lengths.
///
/// Example (max_digits 2, so S = 5 and T = 4; one row, 57 + 8 = 65):
///   src          5 7 + P 8      (P = kAddPadToken)
///   src_padding  0 0 0 1 0
///   tgt_input    B 5 6 P        (B = kAddBosToken; the sum reversed)
///   target       5 6 E -        (E = kAddEosToken, - = kIgnoreIndex)
struct Seq2SeqBatch {
  torch::Tensor src;          ///< (N, S) int64 token ids
  torch::Tensor src_padding;  ///< (N, S) bool, true = padded
  torch::Tensor tgt_input;    ///< (N, T) int64: BOS, then target shifted
  torch::Tensor target;       ///< (N, T) int64, kIgnoreIndex at padding
  /// Real target tokens (digits and EOS) of the whole batch.
  int64_t tokens = 0;
};

/// A batch of `batch_size` additions, a pure function of (options, seed).
/// CPU tensors. Throws c10::Error when batch_size < 1 or the digit counts
/// are outside 1 <= min_digits <= max_digits <= 18.
Seq2SeqBatch make_addition_batch(const AdditionDataOptions& options,
                                 int64_t batch_size, uint64_t seed);

/// The text of one row of a batch's src ("4821+93", padding left out) or
/// of a target or decoded row ("4194", up to EOS or kIgnoreIndex); other
/// tokens as '?'. row: a 1-D integer tensor.
std::string addition_text(const torch::Tensor& row);

// ----------------------------------------------------------------- model ---

/// Options of Seq2SeqTransformer. The defaults are mha-train --task add's.
struct Seq2SeqTransformerOptions {
  /// `vocab_size` tokens, sources of up to `max_src_len` and targets of up
  /// to `max_tgt_len` tokens; the other options at their defaults.
  Seq2SeqTransformerOptions(int64_t vocab_size, int64_t max_src_len,
                            int64_t max_tgt_len)
      : vocab_size_(vocab_size),
        max_src_len_(max_src_len),
        max_tgt_len_(max_tgt_len) {}
  /// Tokens V of source and target (one shared embedding).
  TORCH_ARG(int64_t, vocab_size);
  /// Positions of the source position embedding: the longest source.
  TORCH_ARG(int64_t, max_src_len);
  /// Positions of the target position embedding: the longest target.
  TORCH_ARG(int64_t, max_tgt_len);
  /// Model width E.
  TORCH_ARG(int64_t, d_model) = 64;
  /// Attention heads; must divide d_model.
  TORCH_ARG(int64_t, nhead) = 4;
  /// Encoder layers.
  TORCH_ARG(int64_t, num_encoder_layers) = 2;
  /// Decoder layers.
  TORCH_ARG(int64_t, num_decoder_layers) = 2;
  /// Hidden size of every feed-forward block.
  TORCH_ARG(int64_t, dim_feedforward) = 256;
  /// Dropout in every layer (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
};

/// An encoder–decoder Transformer over tokens (Vaswani et al. 2017): one
/// token embedding for source and target, learned source and target
/// position embeddings, a pre-norm mha::Transformer (batch_first, final
/// LayerNorms) and a linear head to logits over the vocabulary.
///
/// Submodules: tok_emb (V, E), src_pos (max_src_len, E), tgt_pos
/// (max_tgt_len, E), transformer (encoder.*, decoder.*), head (E → V).
class Seq2SeqTransformerImpl
    : public torch::nn::Cloneable<Seq2SeqTransformerImpl> {
 public:
  /// Builds the model from `options_` (reset()).
  explicit Seq2SeqTransformerImpl(const Seq2SeqTransformerOptions& options_);

  /// Teacher-forced logits. src (N, S) int64, S <= max_src_len;
  /// src_padding (N, S) bool (true = padded) or undefined; tgt (N, T)
  /// int64, T <= max_tgt_len, the decoder input (BOS first). Target token
  /// t sees target tokens <= t (tgt_is_causal) and every unpadded source
  /// token. Returns logits (N, T, V), float32. Throws c10::Error on other
  /// shapes.
  torch::Tensor forward(const torch::Tensor& src,
                        const torch::Tensor& src_padding,
                        const torch::Tensor& tgt);

  /// The encoder's output for src (as forward): memory (N, S, E).
  torch::Tensor encode(const torch::Tensor& src,
                       const torch::Tensor& src_padding);

  /// The logits of the next target tokens tgt (N, T) whose earlier tokens
  /// are in `cache` (Transformer::make_cache of encode's memory; appended
  /// to): (N, T, V), equal within rounding to the last T rows of forward
  /// over all the target tokens so far.
  torch::Tensor forward_cached(const torch::Tensor& tgt,
                               TransformerDecoderCache& cache);

  /// Checks the options and (re)creates the submodules.
  void reset() override;

  /// The options the model was built with.
  Seq2SeqTransformerOptions options;
  /// Token embedding (V, E), shared by source and target.
  torch::nn::Embedding tok_emb = nullptr;
  /// Learned source positions (max_src_len, E).
  torch::nn::Embedding src_pos = nullptr;
  /// Learned target positions (max_tgt_len, E).
  torch::nn::Embedding tgt_pos = nullptr;
  /// The encoder–decoder mha::Transformer.
  Transformer transformer = nullptr;
  /// E → V logits.
  torch::nn::Linear head = nullptr;
};

/// Holder of Seq2SeqTransformerImpl.
TORCH_MODULE(Seq2SeqTransformer);

/// Greedy decoding: starting from `bos`, the most likely next token at each
/// step, until every row has produced `eos` or max_len tokens are made.
/// With use_cache (default) the source is encoded once and each step feeds
/// only the newest token through the decoder's cache
/// (Transformer::make_cache / forward_cached); without, each step recomputes
/// forward over the whole target so far. Both give the same tokens (up to
/// float rounding at near ties). src, src_padding as forward; max_len <=
/// max_tgt_len. Returns (N, T') int64 on src's device, T' <= max_len, the
/// tokens after BOS; positions after a row's first eos hold eos. Runs in
/// eval mode without gradients and restores the model's mode. Throws
/// c10::Error for max_len outside [1, max_tgt_len].
torch::Tensor greedy_decode(Seq2SeqTransformer& model, const torch::Tensor& src,
                            const torch::Tensor& src_padding, int64_t bos,
                            int64_t eos, int64_t max_len,
                            bool use_cache = true);

/// Exact-match and token counts of decoded sequences against targets.
struct Seq2SeqMatches {
  int64_t sequences = 0;       ///< rows compared
  int64_t exact = 0;           ///< rows with every target token right
  int64_t tokens = 0;          ///< real target tokens (EOS included)
  int64_t correct_tokens = 0;  ///< of those, decoded right
};

/// Compares decoded (N, T') (greedy_decode's output) with target (N, T)
/// (kIgnoreIndex at padding), T' <= T; decoded is read as EOS-filled up to
/// T. A row is exact when every non-ignored target token matches. Throws
/// c10::Error for other shapes.
Seq2SeqMatches count_matches(const torch::Tensor& decoded,
                             const torch::Tensor& target, int64_t eos);

// ------------------------------------------------------------------ task ---

/// The addition task: learn a + b with a Seq2SeqTransformer, teacher forced
/// (cross-entropy over the real target tokens, padding masked as keys and in
/// the loss); accuracy by greedy decoding through the cache.
class AdditionTask : public TrainTask {
 public:
  /// Seeds LibTorch's global generator from `seed` and builds the model on
  /// `device`. Throws c10::Error on invalid options, or if the model's
  /// vocabulary or positions do not fit the data (vocab_size must be
  /// kAddVocabSize, max_src_len >= data.source_length(), max_tgt_len >=
  /// data.target_length()).
  AdditionTask(const AdditionDataOptions& data,
               const Seq2SeqTransformerOptions& model_options,
               int64_t batch_size, uint64_t seed,
               torch::Device device = torch::kCPU);

  std::string name() const override;
  torch::nn::Module& model() override { return *model_; }
  int64_t batch_size() const override { return batch_size_; }
  BatchLoss training_loss(int64_t step) override;
  /// Teacher-forced, over this shard's rows of a fixed batch of 500
  /// held-out additions (the first 500 of accuracy()'s).
  LossSum validation_loss_sum() override;
  std::string fingerprint() const override;

  /// Greedy decoding (greedy_decode) of `num_examples` held-out additions,
  /// drawn from SeedStream::kEvalData, never from the training stream (an
  /// addition of short operands may also occur in training, as there are
  /// only 100 of two one-digit operands). Returns the counts.
  Seq2SeqMatches accuracy(int64_t num_examples = 2000, bool use_cache = true);

  /// The first `count` held-out additions and the model's answers, one line
  /// each: "4821+93 = 4914 (model: 4914)" (the sum written normally).
  std::string examples(int64_t count);

  /// The options of the task's additions (digits, seeds).
  const AdditionDataOptions& data() const { return data_; }
  /// The model being trained.
  Seq2SeqTransformer& transformer() { return model_; }

 private:
  Seq2SeqBatch held_out(int64_t num_examples) const;

  AdditionDataOptions data_;
  int64_t batch_size_;
  uint64_t seed_;
  torch::Device device_;
  Seq2SeqTransformer model_;
  Seq2SeqBatch val_batch_;  // fixed validation batch
};

}  // namespace mha::train
