// What the training loop trains (part of mha/train.h): the TrainTask
// interface, its shards for data-parallel training, and the two toy tasks
// (digit sequences, character language model).
//
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), V vocabulary size.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "mha/train/data.h"
#include "mha/train/models.h"

namespace mha::train {

// ------------------------------------------------------------ tasks ---

/// The loss of one training batch: a scalar with a gradient, in nats per
/// token, and how many (real) tokens it covered.
struct BatchLoss {
  /// Scalar, nats per token, with a gradient.
  torch::Tensor loss;
  /// Real (unpadded) tokens the loss covers.
  int64_t tokens = 0;
};

/// A summed loss and the number of tokens it covers (their quotient is the
/// mean loss in nats per token).
struct LossSum {
  /// Summed loss in nats.
  double sum = 0.0;
  /// Tokens the sum covers.
  int64_t tokens = 0;
  /// sum / tokens (0 when there are no tokens).
  double mean() const {
    return sum / static_cast<double>(tokens > 0 ? tokens : int64_t{1});
  }
};

/// Which part of every global batch (and of the validation data) one
/// process of a data-parallel job computes: shard `index` of `count`.
struct Shard {
  int64_t index = 0;  ///< in [0, count)
  int64_t count = 1;  ///< >= 1; 1 = the whole batch
  /// The rows [first, second) of `rows` that this shard takes: contiguous
  /// ranges in index order, sizes differing by at most one, together
  /// covering every row once. Empty when rows < count for some shards.
  std::pair<int64_t, int64_t> rows(int64_t rows) const;
};

/// What the training loop needs from a task. Implementations hold a model
/// and make each step's batch from (seed, step) alone. In data-parallel
/// training every process makes the same global batch and computes only
/// its shard's rows (set_shard), so that N processes see exactly the
/// batches one process sees.
class TrainTask {
 public:
  virtual ~TrainTask() = default;
  /// A short description, e.g. "reverse digit sequences of length 1-16"
  /// (the plot's title).
  virtual std::string name() const = 0;
  /// The model being trained.
  virtual torch::nn::Module& model() = 0;
  /// Sequences in every step's (global) batch.
  virtual int64_t batch_size() const = 0;
  /// The training loss of step `step` (1-based) over this shard's rows of
  /// the step's batch (normalised by their real tokens), with the model in
  /// training mode; the batch depends only on (seed, step).
  virtual BatchLoss training_loss(int64_t step) = 0;
  /// The summed loss and token count over this shard's part of fixed
  /// held-out data, in eval mode without gradients; leaves the model in
  /// training mode.
  virtual LossSum validation_loss_sum() = 0;
  /// validation_loss_sum() as a mean (nats per token); with the default
  /// shard, over all the held-out data.
  double validation_loss();
  /// Every setting a checkpoint must share with this task to be resumed.
  virtual std::string fingerprint() const = 0;

  /// Sets the part of every batch this task computes. Throws c10::Error
  /// unless 0 <= shard.index < shard.count.
  void set_shard(const Shard& shard);
  /// The part of every batch this task computes (set_shard).
  const Shard& shard() const { return shard_; }

 private:
  Shard shard_;
};

/// The digit task: learn to reverse or sort digit sequences of variable
/// length with a DigitTransformer, padding masked as keys and in the loss.
class DigitTask : public TrainTask {
 public:
  /// Seeds LibTorch's global generator from `seed` and builds the model on
  /// `device`. Throws c10::Error on invalid options (from the option
  /// checks) or if model_options.max_len() < data.max_len().
  DigitTask(const DigitDataOptions& data,
            const DigitTransformerOptions& model_options, int64_t batch_size,
            uint64_t seed, torch::Device device = torch::kCPU);

  std::string name() const override;
  torch::nn::Module& model() override { return *model_; }
  int64_t batch_size() const override { return batch_size_; }
  BatchLoss training_loss(int64_t step) override;
  /// Over this shard's rows of a fixed batch of 500 held-out sequences.
  LossSum validation_loss_sum() override;
  std::string fingerprint() const override;

  /// Accuracy on `num_sequences` held-out sequences: a fixed set drawn from
  /// SeedStream::kEvalData, never from the training stream (its first 500
  /// sequences are the validation set; being random, a short sequence may
  /// also occur in training, as there are only 10^n of length n). Returns
  /// the fraction of sequences with every digit right and the fraction of
  /// digits right. Eval mode, no gradients; restores the model's mode.
  struct Accuracy {
    /// Fraction of sequences with every digit right.
    double sequence = 0.0;
    /// Fraction of digits right.
    double token = 0.0;
    /// Sequences evaluated.
    int64_t num_sequences = 0;
  };
  /// Evaluates `num_sequences` held-out sequences (see Accuracy).
  Accuracy accuracy(int64_t num_sequences = 2000);

  /// The model being trained.
  DigitTransformer& transformer() { return model_; }

 private:
  DigitDataOptions data_;
  int64_t batch_size_;
  uint64_t seed_;
  torch::Device device_;
  DigitTransformer model_;
  DigitBatch val_batch_;  // fixed validation batch
};

/// How CharLMTask makes its training batches.
enum class CharBatching {
  /// batch_size windows of block_size + 1 consecutive characters
  /// (sample_char_batch); every character predicts its successor.
  kWindows,
  /// Documents of random lengths packed into batch_size rows of block_size
  /// characters (sample_packed_char_batch), each row attending through
  /// packed_documents_block_mask with positions restarting per document.
  kPacked,
  /// The same documents one per row, padded to the longest
  /// (pad_documents), the padding masked as keys: the same loss as kPacked
  /// (within float rounding), for comparison.
  kPadded,
};

/// CharLMTask's training batches: windows (the default) or documents.
struct CharDocumentOptions {
  /// How batches are made.
  TORCH_ARG(CharBatching, batching) = CharBatching::kWindows;
  /// Shortest document drawn, >= 1 (a row's last document is cut to fit);
  /// 0 (default): block_size / 8, at least 1.
  TORCH_ARG(int64_t, min_len) = 0;
  /// Longest document drawn, in [min_len, block_size]; 0 (default):
  /// block_size.
  TORCH_ARG(int64_t, max_len) = 0;
  /// Queries and keys per block of the packed rows' BlockMask (>= 1).
  /// Default 64, mha-train's context: one block a row, which the blocked
  /// core computed faster than blocks of 32 or 16 (docs/training.md).
  TORCH_ARG(int64_t, block) = 64;
};

/// What CharLMTask::compare_document_layouts measured: forward + backward
/// of the same documents packed and padded.
struct LayoutThroughput {
  /// Document characters per second (padding not counted), packed.
  double packed_tokens_per_s = 0.0;
  /// The same, padded.
  double padded_tokens_per_s = 0.0;
  /// Document characters of all the batches timed (each layout).
  int64_t tokens = 0;
  /// Positions the padded layout computed, padding included (D·L summed).
  int64_t padded_positions = 0;
  /// Documents of all the batches.
  int64_t documents = 0;
  /// Batches timed (each layout).
  int64_t batches = 0;
};

/// The character language model task: next-character prediction on a text.
class CharLMTask : public TrainTask {
 public:
  /// `model_options.vocab_size()` must equal corpus.vocab.size() and
  /// `model_options.block_size()` is the training context T. Seeds
  /// LibTorch's global generator from `seed` and builds the model on
  /// `device`. `documents`: windows (default) or packed or padded documents
  /// (their lengths resolved against block_size: documents()). Throws
  /// c10::Error on a mismatch, a split shorter than the context or document
  /// lengths outside [1, block_size].
  CharLMTask(CharCorpus corpus, const CharLMOptions& model_options,
             int64_t batch_size, uint64_t seed,
             torch::Device device = torch::kCPU,
             const CharDocumentOptions& documents = {});

  std::string name() const override;
  torch::nn::Module& model() override { return *model_; }
  int64_t batch_size() const override { return batch_size_; }
  /// Windows: the mean over every character of this shard's rows. Packed
  /// and padded: the mean over the characters with a target (each
  /// document's last one has none); BatchLoss::tokens counts those.
  BatchLoss training_loss(int64_t step) override;
  /// Over this shard's windows of the validation part, cut into
  /// consecutive windows of block_size characters (with one shard, every
  /// character after the first of a window is predicted once), whatever the
  /// batching.
  LossSum validation_loss_sum() override;
  std::string fingerprint() const override;

  /// The documents of step `step`'s training batch (this task's lengths,
  /// all batch_size rows; a pure function of the seed and step, whatever the
  /// batching).
  PackedCharBatch documents_of_step(int64_t step) const;

  /// The loss of `batch`'s rows: the mean cross-entropy over the
  /// characters with a target (BatchLoss::tokens counts them), with a
  /// gradient, in the model's current mode. Packed: the rows as they are,
  /// through packed_documents_block_mask(batch.lengths, documents().block())
  /// with batch.positions; padded: pad_documents(batch), the padding masked.
  /// Both give each document the loss it would get alone (within float
  /// rounding).
  BatchLoss document_loss(const PackedCharBatch& batch, bool padded);

  /// Times forward + backward (training mode; gradients discarded, no
  /// optimizer step, the weights unchanged) on the documents of steps
  /// 1..batches (documents_of_step), packed and padded alternately: how much
  /// packing gains over padding on the same documents. Document characters
  /// per second count no padding. Leaves the model in training mode with no
  /// gradients. Throws c10::Error unless batches >= 1.
  LayoutThroughput compare_document_layouts(int64_t batches);

  /// The batching and the resolved document lengths.
  const CharDocumentOptions& documents() const { return documents_; }

  /// unigram_baseline(corpus()).
  double unigram_baseline() const;
  /// `length` characters generated after `prompt` (characters outside the
  /// vocabulary are dropped; an empty prompt starts from the first character
  /// of the validation text). Returns the prompt followed by the sample.
  std::string sample(const std::string& prompt, int64_t length,
                     const SamplingOptions& options, bool use_kv_cache = true);

  /// Writes `<dir>/layer<l>.svg` for every block l: one heatmap panel per
  /// head ("layer l, head h") of the attention weights over the first
  /// `length` characters of the validation text (1 <= length <=
  /// block_size), both axes labelled with those characters (space as
  /// '␣', newline as '⏎', tab as '⇥'). Creates `dir` if needed. Returns the
  /// paths written. Throws c10::Error for a bad length or an unwritable
  /// directory or file.
  std::vector<std::string> plot_attention(const std::string& dir,
                                          int64_t length);

  /// The text being modelled, as ids (training and validation parts).
  const CharCorpus& corpus() const { return corpus_; }
  /// The model being trained.
  CharLM& lm() { return model_; }

 private:
  CharCorpus corpus_;
  int64_t batch_size_;
  uint64_t seed_;
  torch::Device device_;
  CharDocumentOptions documents_;
  CharLM model_;
};

}  // namespace mha::train
