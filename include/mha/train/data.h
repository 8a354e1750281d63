// Training data of the toy tasks (part of mha/train.h): the seeds every
// batch is made from, digit sequences to reverse or sort, and a text as
// character ids split into training and validation parts.
//
// Randomness. Every batch is a pure function of (seed, step), so that a run
// resumed at step k sees the same batches as the uninterrupted run (see
// mha/train.h).
//
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), V vocabulary size.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace mha::train {

// ------------------------------------------------------------ randomness ---

/// Streams of derive_seed: independent randomness for the same (seed, step).
enum class SeedStream : uint64_t {
  kTrainData = 1,  ///< the training batch of a step
  kEvalData = 2,   ///< held-out data (step 0)
  kModelInit = 3,  ///< the initial weights (step 0)
  kSampling = 4,   ///< text generation
  /// Dropout of the ranks other than 0 in data-parallel training (rank 0
  /// keeps LibTorch's default generator, as a single process does).
  kRankDropout = 5,
};

/// A 64-bit seed that depends only on (seed, step, stream), mixed with
/// SplitMix64 (Steele et al. 2014), so that nearby inputs give unrelated
/// seeds. The training batch of step k is made from
/// derive_seed(seed, k, SeedStream::kTrainData).
uint64_t derive_seed(uint64_t seed, int64_t step, SeedStream stream);

// ---------------------------------------------------- digit sequence data ---

/// What the digit task asks: the input digits reversed, or sorted ascending.
enum class DigitRule { kReverse, kSort };

/// Tokens of the digit tasks: digits 0..9 are their own ids.
constexpr int64_t kNumDigits = 10;
/// The input token at padded positions.
constexpr int64_t kPadToken = 10;
/// Input vocabulary: the digits and kPadToken.
constexpr int64_t kDigitVocabSize = 11;
/// The target at padded positions; losses skip it (as PyTorch's
/// cross_entropy ignore_index default).
constexpr int64_t kIgnoreIndex = -100;

/// Random digit sequences of random length, padded to max_len.
struct DigitDataOptions {
  /// Sequences for `rule`; the other options at their defaults.
  explicit DigitDataOptions(DigitRule rule) : rule_(rule) {}
  /// Reverse or sort.
  TORCH_ARG(DigitRule, rule);
  /// Shortest sequence, >= 1.
  TORCH_ARG(int64_t, min_len) = 1;
  /// Longest sequence, >= min_len; every batch is (N, max_len).
  TORCH_ARG(int64_t, max_len) = 16;
};

/// One batch of a digit task. Position i < length holds a digit; positions
/// from length on are padding.
struct DigitBatch {
  /// (N, max_len) int64: the digits, kPadToken at padding.
  torch::Tensor input;
  /// (N, max_len) int64: the answer, kIgnoreIndex at padding.
  torch::Tensor target;
  /// (N, max_len) bool: true = padded (a src_key_padding_mask).
  torch::Tensor padding;
  /// (N) int64, in [min_len, max_len].
  torch::Tensor lengths;
};

/// A batch of `batch_size` sequences, a pure function of (options, seed);
/// lengths uniform in [min_len, max_len], digits uniform. CPU tensors.
///
/// Example (reverse, max_len 5, one row of length 3):
///   input   3 1 4 P P        (P = kPadToken)
///   target  4 1 3 - -        (- = kIgnoreIndex)
///   padding 0 0 0 1 1
/// Throws c10::Error when batch_size < 1 or the lengths are out of order.
DigitBatch make_digit_batch(const DigitDataOptions& options, int64_t batch_size,
                            uint64_t seed);

// ------------------------------------------------------ character data ---

/// The characters of a text (bytes: UTF-8 text is modelled byte by byte),
/// sorted; a character's id is its index.
class CharVocab {
 public:
  /// The distinct bytes of `text`. Throws c10::Error if text is empty.
  explicit CharVocab(const std::string& text);
  /// Number of distinct characters V.
  int64_t size() const { return static_cast<int64_t>(chars_.size()); }
  /// The characters, in id order.
  const std::string& chars() const { return chars_; }
  /// (T) int64 ids of `text`. Throws c10::Error on a character not in the
  /// vocabulary.
  torch::Tensor encode(const std::string& text) const;
  /// The text of `ids`, a 1-D integer tensor of ids in [0, V).
  std::string decode(const torch::Tensor& ids) const;

 private:
  std::string chars_;
  std::vector<int64_t> id_of_;  // 256 entries, -1 when absent
};

/// A text as ids, split into a training part (the beginning) and a
/// validation part (the end).
struct CharCorpus {
  /// The characters of the text, one id each.
  CharVocab vocab;
  torch::Tensor train;  ///< (T_train) int64
  torch::Tensor val;    ///< (T_val) int64
};

/// Splits `text` at (1 - val_fraction) of its length. The vocabulary covers
/// the whole text. Throws c10::Error unless val_fraction is in (0, 1) and
/// both parts are longer than `context` (they must hold at least one window
/// of context + 1 characters), naming the sizes.
CharCorpus make_char_corpus(const std::string& text, double val_fraction,
                            int64_t context);

/// The whole file at `path`. Throws c10::Error naming the path if it cannot
/// be read.
std::string read_text_file(const std::string& path);

/// Cross-entropy, in nats per character, of the validation part under the
/// character frequencies of the training part (add-one smoothing, so a
/// character absent from training costs log(T_train + V), not infinity):
/// the loss of the best model that ignores context. A language model must
/// get below it to have learned anything beyond letter frequencies.
double unigram_baseline(const CharCorpus& corpus);

/// A language-model batch: `batch_size` windows of context + 1 consecutive
/// characters of `data` at offsets uniform over the text, a pure function of
/// seed. Returns (input, target), both (N, T) int64 on the CPU, target =
/// input shifted left by one character.
std::pair<torch::Tensor, torch::Tensor> sample_char_batch(
    const torch::Tensor& data, int64_t batch_size, int64_t context,
    uint64_t seed);

// ---------------------------------------------------- packed documents ---

/// Documents of random lengths packed back to back into fixed-size rows:
/// packed-sequence training, no padding. Each document is a span of the
/// text; a model must keep the documents of a row apart (a causal document
/// mask: packed_documents_block_mask in mha/train/models.h) and read
/// positions that restart at 0 in each document.
///
/// Example (T = 8, two documents "abc" and "defgh" in one row):
///   input     a b c d e f g h
///   target    b c - e f g h -        (- = kIgnoreIndex)
///   positions 0 1 2 0 1 2 3 4
///   lengths   {3, 5}
struct PackedCharBatch {
  /// (N, T) int64: the documents' characters, back to back in each row.
  torch::Tensor input;
  /// (N, T) int64: each character's successor in its document;
  /// kIgnoreIndex at a document's last character, which predicts nothing
  /// (its successor in the row begins another document).
  torch::Tensor target;
  /// (N, T) int64: each character's position in its document.
  torch::Tensor positions;
  /// One 1-D int64 tensor per row: its documents' lengths in order, summing
  /// to T.
  std::vector<torch::Tensor> lengths;

  /// Rows [first, first + count) (a data-parallel shard), sharing storage.
  PackedCharBatch rows(int64_t first, int64_t count) const;
  /// Documents in all rows.
  int64_t documents() const;
  /// Characters with a target (not kIgnoreIndex): N·T - documents().
  int64_t predicted() const;
};

/// `rows` rows of `context` characters, a pure function of seed: each row is
/// filled with documents, spans of `data` at offsets uniform over the text
/// with lengths uniform in [min_len, max_len]; the document that would run
/// past the row's end is cut there (so a row's last document may be shorter
/// than min_len). CPU tensors. Throws c10::Error unless rows >= 1,
/// 1 <= min_len <= max_len <= context and data is 1-D and longer than
/// context.
PackedCharBatch sample_packed_char_batch(const torch::Tensor& data,
                                         int64_t rows, int64_t context,
                                         int64_t min_len, int64_t max_len,
                                         uint64_t seed);

/// The documents of a packed batch one per row, padded to the longest: the
/// usual alternative to packing, for comparison (the same characters and
/// targets; the model must mask the padding keys).
struct PaddedCharBatch {
  /// (D, L) int64, L the longest document: the characters; 0 at padding.
  torch::Tensor input;
  /// (D, L) int64: the packed batch's targets; kIgnoreIndex at padding.
  torch::Tensor target;
  /// (D, L) bool, true = padding (a key_padding_mask).
  torch::Tensor padding;
};

/// The documents of `batch` (row by row, in order) one per row, padded to
/// the longest.
PaddedCharBatch pad_documents(const PackedCharBatch& batch);

}  // namespace mha::train
