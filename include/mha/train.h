// Training toy models with mha: the pieces of mha-train, written to be read
// as a model for your own training loops.
//
//   * Two toy tasks: digit sequences to reverse or sort (an
//     mha::TransformerEncoder with a key padding mask), and a small GPT-style
//     character language model (pre-norm blocks of causal
//     mha::MultiHeadAttention and an MLP, the output head tied to the token
//     embedding).
//   * One training loop for both: AdamW, linear warmup + cosine learning rate,
//     gradient clipping, periodic validation, checkpoints and exact resume.
//   * The loss curve as CSV and as an SVG plot.
//
// Randomness. Every batch is a pure function of (seed, step): the loop never
// draws data from a stream that runs across steps, so a run resumed at step k
// sees the same batches as the uninterrupted run. What does run across steps,
// the dropout masks drawn from LibTorch's default CPU generator, is saved in
// checkpoints and restored. On the CPU a resumed run therefore reproduces the
// uninterrupted run's losses bit for bit (same seed, settings and threads).
// On CUDA the CUDA generator is not saved: resume works but is not exact.
//
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, V vocabulary size.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mha/distributed.h"
#include "mha/multi_head_attention.h"
#include "mha/transformer.h"

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

// ------------------------------------------------------- digit model ---

/// Options of DigitTransformer. The defaults are mha-train --task reverse's.
struct DigitTransformerOptions {
  explicit DigitTransformerOptions(int64_t max_len) : max_len_(max_len) {}
  /// Positions of the learned position embedding: the longest input.
  TORCH_ARG(int64_t, max_len);
  /// Model width E.
  TORCH_ARG(int64_t, d_model) = 64;
  /// Attention heads; must divide d_model.
  TORCH_ARG(int64_t, nhead) = 4;
  /// Encoder layers.
  TORCH_ARG(int64_t, num_layers) = 2;
  /// Hidden size of each layer's feed-forward block.
  TORCH_ARG(int64_t, dim_feedforward) = 256;
  /// Dropout in the encoder layers (training mode only).
  TORCH_ARG(double, dropout) = 0.0;
};

/// An encoder-only tagger for the digit tasks: token + learned position
/// embeddings, a pre-norm mha::TransformerEncoder with a final LayerNorm, and
/// a linear head giving, at each position, logits over the 10 digits.
///
/// Submodules: tok_emb (kDigitVocabSize, E), pos_emb (max_len, E), encoder
/// (layers.0..., norm), head (E → kNumDigits).
class DigitTransformerImpl : public torch::nn::Cloneable<DigitTransformerImpl> {
 public:
  explicit DigitTransformerImpl(const DigitTransformerOptions& options_);

  /// input (N, L) int64 token ids, L <= max_len; padding (N, L) bool, true =
  /// padded (the encoder's src_key_padding_mask), or undefined for none.
  /// Returns logits (N, L, kNumDigits), float32. Logits at padded positions
  /// are computed but carry no meaning.
  torch::Tensor forward(const torch::Tensor& input,
                        const torch::Tensor& padding = {});

  /// Checks the options and (re)creates the submodules.
  void reset() override;

  DigitTransformerOptions options;
  torch::nn::Embedding tok_emb = nullptr;
  torch::nn::Embedding pos_emb = nullptr;
  TransformerEncoder encoder = nullptr;
  torch::nn::Linear head = nullptr;
};

/// Holder of DigitTransformerImpl.
TORCH_MODULE(DigitTransformer);

/// Cross-entropy over the real (non-padded) positions only, normalised by
/// their count: sum of -log p(target) over positions whose target is not
/// kIgnoreIndex, divided by the number of such positions (nats per token).
/// logits (N, L, C) floating, target (N, L) int64. Returns a scalar.
torch::Tensor masked_cross_entropy(const torch::Tensor& logits,
                                   const torch::Tensor& target);

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

// ----------------------------------------------- character language model ---

/// Options of CharLM (the names of nanoGPT's GPTConfig). The defaults are
/// mha-train --task charlm's.
struct CharLMOptions {
  CharLMOptions(int64_t vocab_size, int64_t block_size)
      : vocab_size_(vocab_size), block_size_(block_size) {}
  /// Vocabulary size V.
  TORCH_ARG(int64_t, vocab_size);
  /// Longest context T (positions of the position embedding).
  TORCH_ARG(int64_t, block_size);
  /// Model width E.
  TORCH_ARG(int64_t, n_embd) = 96;
  /// Attention heads; must divide n_embd.
  TORCH_ARG(int64_t, n_head) = 4;
  /// Blocks.
  TORCH_ARG(int64_t, n_layer) = 3;
  /// Dropout on embeddings, attention weights and residual branches
  /// (training mode only).
  TORCH_ARG(double, dropout) = 0.1;
  /// true (default): positions by rotary embedding of every block's queries
  /// and keys (MultiHeadAttentionOptions::rotary) and each block attending
  /// to a sliding window of the last block_size positions (window), no wpe:
  /// the model reads sequences of any length, and generate() decodes through
  /// a KV cache with the same result as recomputing every step. false:
  /// nanoGPT's learned position embedding wpe, T <= block_size.
  TORCH_ARG(bool, rotary) = true;
};

/// One pre-norm block of a GPT (Radford et al. 2019; nanoGPT's Block):
///   x = x + dropout(attn(ln_1(x), is_causal=true))
///   x = x + dropout(c_proj(gelu(c_fc(ln_2(x)))))
/// attn is an mha::MultiHeadAttention called with need_weights=false.
/// Submodules: ln_1, attn, ln_2, c_fc (E → 4E), c_proj (4E → E), dropout.
class GPTBlockImpl : public torch::nn::Cloneable<GPTBlockImpl> {
 public:
  explicit GPTBlockImpl(const CharLMOptions& options_);
  /// x (N, T, E) → (N, T, E); position t sees positions <= t only (and
  /// > t - block_size when rotary).
  torch::Tensor forward(const torch::Tensor& x);
  /// forward for the next T positions of sequences whose earlier positions
  /// are in `cache` (MultiHeadAttention::forward_cached): x (N, T, E) →
  /// (N, T, E), the same rows forward(all positions) gives.
  torch::Tensor forward_cached(const torch::Tensor& x, KVCache& cache);
  /// forward(x) and the attention weights of every head, (N, H, T, T)
  /// (row t: how position t weighs positions 0..T-1; 0 right of t).
  std::tuple<torch::Tensor, torch::Tensor> forward_with_weights(
      const torch::Tensor& x);
  /// Checks the options and (re)creates the submodules (LibTorch's default
  /// initialisation; CharLM re-initialises them as nanoGPT).
  void reset() override;

  CharLMOptions options;
  LayerNorm ln_1 = nullptr;
  MultiHeadAttention attn = nullptr;
  LayerNorm ln_2 = nullptr;
  torch::nn::Linear c_fc = nullptr;
  torch::nn::Linear c_proj = nullptr;
  torch::nn::Dropout dropout = nullptr;

 private:
  std::tuple<torch::Tensor, torch::Tensor> forward_impl(const torch::Tensor& x,
                                                        bool need_weights);
  // x + dropout(attended), then the feed-forward residual branch.
  torch::Tensor residuals(const torch::Tensor& x,
                          const torch::Tensor& attended);
};

/// Holder of GPTBlockImpl.
TORCH_MODULE(GPTBlock);

/// A small GPT over characters: token and position embeddings, n_layer
/// GPTBlocks, a final LayerNorm, and an output head that reuses the token
/// embedding matrix (weight tying: logits = x · wte.weightᵀ, so there is no
/// separate head parameter).
///
/// Parameters (state-dict names): wte.weight (V, E), wpe.weight (T, E) when
/// !rotary,
/// h.<i>.{ln_1,attn,ln_2,c_fc,c_proj}.*, ln_f.{weight,bias}. Initialised as
/// nanoGPT: embeddings, attn.in_proj_weight and c_fc.weight N(0, 0.02); the
/// projections back into the residual stream (attn.out_proj.weight,
/// c_proj.weight) N(0, 0.02 / sqrt(2 n_layer)); biases 0; LayerNorms 1, 0.
///
/// Example:
///   mha::train::CharLM lm(mha::train::CharLMOptions(/*vocab_size=*/65,
///                                                   /*block_size=*/64));
///   auto logits = lm(torch::randint(65, {2, 64}));  // (2, 64, 65)
class CharLMImpl : public torch::nn::Cloneable<CharLMImpl> {
 public:
  explicit CharLMImpl(const CharLMOptions& options_);

  /// idx (N, T) int64 ids in [0, V), T <= block_size unless rotary.
  /// Returns logits (N, T, V), float32: position t predicts character t + 1
  /// from characters 0..t. Throws c10::Error if !rotary and T > block_size.
  torch::Tensor forward(const torch::Tensor& idx);

  /// One KVCache per block for batch_size sequences of up to `capacity`
  /// characters (capacity <= block_size unless rotary).
  std::vector<KVCache> make_kv_caches(int64_t batch_size,
                                      int64_t capacity) const;

  /// forward for the next T characters idx (N, T) of sequences whose
  /// earlier characters are in `caches` (make_kv_caches; appended to):
  /// logits (N, T, V) equal to the last T rows of forward(all characters),
  /// within float rounding. Throws c10::Error for a wrong number of caches,
  /// no room left, or (!rotary) positions beyond block_size.
  torch::Tensor forward_cached(const torch::Tensor& idx,
                               std::vector<KVCache>& caches);

  /// The attention weights of every block for idx (N, T) as in forward:
  /// one (N, H, T, T) float32 tensor per block, in order (row t of head h
  /// of block l: how that head weighs characters 0..t when predicting
  /// character t + 1; exactly 0 right of t). Runs in eval mode without
  /// gradients and restores the model's mode. Throws as forward.
  std::vector<torch::Tensor> attention_weights(const torch::Tensor& idx);

  /// Checks the options, (re)creates the submodules and initialises them.
  void reset() override;

  CharLMOptions options;
  torch::nn::Embedding wte = nullptr;
  torch::nn::Embedding wpe = nullptr;
  torch::nn::Dropout drop = nullptr;
  torch::nn::ModuleList h = nullptr;
  LayerNorm ln_f = nullptr;
};

/// Holder of CharLMImpl.
TORCH_MODULE(CharLM);

/// How generate() picks each next character.
struct SamplingOptions {
  /// Logits are divided by it: < 1 sharper, > 1 flatter; must be > 0.
  TORCH_ARG(double, temperature) = 0.8;
  /// Sample among the k most likely characters only; 0 = all.
  TORCH_ARG(int64_t, top_k) = 10;
  /// Seed of the sampling generator (a private CPU generator: sampling does
  /// not touch LibTorch's global one).
  TORCH_ARG(uint64_t, seed) = 0;
};

/// Extends `prompt` ((T0) int64 ids, T0 >= 1) by `max_new_tokens` sampled
/// characters. A rotary model reads the whole sequence (its window limits
/// each block); a model with learned positions at most its block_size last
/// characters. With use_kv_cache (default) each step feeds only the new
/// character through KV caches (make_kv_caches); without, and for a
/// learned-position model whose prompt and new characters outgrow
/// block_size, every step recomputes the whole context. Both give the same
/// characters (up to float rounding at near ties). Runs in eval mode without
/// gradients and restores the model's mode. Returns (T0 + max_new_tokens) int64
/// ids on the CPU.
torch::Tensor generate(CharLM& model, const torch::Tensor& prompt,
                       int64_t max_new_tokens,
                       const SamplingOptions& options = {},
                       bool use_kv_cache = true);

// ------------------------------------------------------- optimisation ---

/// Linear warmup from 0 to peak_lr over warmup_steps, then cosine decay to
/// min_lr at total_steps (Loshchilov & Hutter 2017, without restarts).
/// Steps count from 1.
struct LrSchedule {
  double peak_lr = 1e-3;
  double min_lr = 1e-4;
  int64_t warmup_steps = 100;
  int64_t total_steps = 1000;
  /// The learning rate of `step` (1-based): peak_lr * step / warmup_steps
  /// while step <= warmup_steps; then min_lr + (peak_lr - min_lr) *
  /// (1 + cos(pi * progress)) / 2 with progress = (step - warmup_steps) /
  /// (total_steps - warmup_steps), clamped to [0, 1].
  double at(int64_t step) const;
};

/// AdamW (Loshchilov & Hutter 2019) over `module`'s parameters in two
/// groups, as nanoGPT: weight decay on matrices (dim >= 2: linear and
/// embedding weights), none on vectors (biases, LayerNorm weights).
std::unique_ptr<torch::optim::AdamW> make_adamw(torch::nn::Module& module,
                                                double lr, double weight_decay,
                                                double beta1 = 0.9,
                                                double beta2 = 0.95);

/// Sets the learning rate of every parameter group of an AdamW optimizer.
void set_learning_rate(torch::optim::AdamW& optimizer, double lr);

// ------------------------------------------------------------ loss curve ---

/// Marks a loss that was not measured (a quiet NaN).
constexpr double kNoValue = std::numeric_limits<double>::quiet_NaN();

/// One training step's record.
struct LossRecord {
  int64_t step = 0;            ///< 1-based
  double lr = 0.0;             ///< learning rate used by this step
  double train_loss = 0.0;     ///< nats per token, this step's batch
  double val_loss = kNoValue;  ///< nats per token; NaN: not evaluated
  double tokens_per_s = 0.0;   ///< training throughput over this step
  double elapsed_s = 0.0;      ///< training time since step 1 (resumes add up)
};

/// Writes `records` as CSV with the header
/// `step,lr,train_loss,val_loss,tokens_per_s,elapsed_s` (val_loss empty where
/// not evaluated). Throws c10::Error naming the path if it cannot be written.
void write_loss_csv(const std::vector<LossRecord>& records,
                    const std::string& path);

/// Writes an SVG plot of the loss curve (opens in any web browser): training
/// loss per step (light), its moving average (dark), validation loss
/// (points), on a logarithmic loss axis, with axes, ticks, a legend and
/// `title`. Throws c10::Error naming the path if it cannot be written or if
/// records is empty.
void write_loss_svg(const std::vector<LossRecord>& records,
                    const std::string& title, const std::string& path);

// ------------------------------------------------------------ tasks ---

/// The loss of one training batch: a scalar with a gradient, in nats per
/// token, and how many (real) tokens it covered.
struct BatchLoss {
  torch::Tensor loss;
  int64_t tokens = 0;
};

/// A summed loss and the number of tokens it covers (their quotient is the
/// mean loss in nats per token).
struct LossSum {
  double sum = 0.0;
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
    double sequence = 0.0;
    double token = 0.0;
    int64_t num_sequences = 0;
  };
  Accuracy accuracy(int64_t num_sequences = 2000);

  DigitTransformer& transformer() { return model_; }

 private:
  DigitDataOptions data_;
  int64_t batch_size_;
  uint64_t seed_;
  torch::Device device_;
  DigitTransformer model_;
  DigitBatch val_batch_;  // fixed validation batch
};

/// The character language model task: next-character prediction on a text.
class CharLMTask : public TrainTask {
 public:
  /// `model_options.vocab_size()` must equal corpus.vocab.size() and
  /// `model_options.block_size()` is the training context T. Seeds
  /// LibTorch's global generator from `seed` and builds the model on
  /// `device`. Throws c10::Error on a mismatch or a split shorter than the
  /// context.
  CharLMTask(CharCorpus corpus, const CharLMOptions& model_options,
             int64_t batch_size, uint64_t seed,
             torch::Device device = torch::kCPU);

  std::string name() const override;
  torch::nn::Module& model() override { return *model_; }
  int64_t batch_size() const override { return batch_size_; }
  BatchLoss training_loss(int64_t step) override;
  /// Over this shard's windows of the validation part, cut into
  /// consecutive windows of block_size characters (with one shard, every
  /// character after the first of a window is predicted once).
  LossSum validation_loss_sum() override;
  std::string fingerprint() const override;

  /// unigram_baseline(corpus()).
  double unigram_baseline() const;
  /// `length` characters generated after `prompt` (characters outside the
  /// vocabulary are dropped; an empty prompt starts from the first character
  /// of the validation text). Returns the prompt followed by the sample.
  std::string sample(const std::string& prompt, int64_t length,
                     const SamplingOptions& options, bool use_kv_cache = true);

  /// Writes `dir`/layer<l>.svg for every block l: one heatmap panel per
  /// head ("layer l, head h") of the attention weights over the first
  /// `length` characters of the validation text (1 <= length <=
  /// block_size), both axes labelled with those characters (space as
  /// '␣', newline as '⏎', tab as '⇥'). Creates `dir` if needed. Returns the
  /// paths written. Throws c10::Error for a bad length or an unwritable
  /// directory or file.
  std::vector<std::string> plot_attention(const std::string& dir,
                                          int64_t length);

  const CharCorpus& corpus() const { return corpus_; }
  CharLM& lm() { return model_; }

 private:
  CharCorpus corpus_;
  int64_t batch_size_;
  uint64_t seed_;
  torch::Device device_;
  CharLM model_;
};

// ------------------------------------------------------- training loop ---

/// Options of train().
struct TrainOptions {
  /// Total optimisation steps of the run (the schedule spans them).
  TORCH_ARG(int64_t, steps) = 1000;
  /// Peak learning rate.
  TORCH_ARG(double, lr) = 1e-3;
  /// Final learning rate of the cosine decay.
  TORCH_ARG(double, min_lr) = 1e-4;
  /// Linear warmup steps.
  TORCH_ARG(int64_t, warmup_steps) = 100;
  /// AdamW's decoupled weight decay (matrices only).
  TORCH_ARG(double, weight_decay) = 0.1;
  /// Clip the global gradient norm (L2, all parameters) to this; 0 = off.
  TORCH_ARG(double, grad_clip) = 1.0;
  /// Validate every this many steps and at step `steps` (not at stop_at);
  /// 0 = only at step `steps`.
  TORCH_ARG(int64_t, eval_every) = 0;
  /// Where checkpoints and the loss curve go; empty: nowhere (no
  /// checkpoints, no files).
  TORCH_ARG(std::string, out_dir) = "";
  /// Checkpoint every this many steps (and always at the end of the run);
  /// 0 = only at the end.
  TORCH_ARG(int64_t, checkpoint_every) = 0;
  /// Continue from the checkpoint in out_dir instead of starting afresh.
  TORCH_ARG(bool, resume) = false;
  /// Stop after this step, as if interrupted (the schedule still spans
  /// `steps`); 0 = run to `steps`.
  TORCH_ARG(int64_t, stop_at) = 0;
};

/// What train() reports after each step.
struct Progress {
  int64_t step = 0;           ///< the step just done (1-based)
  int64_t steps = 0;          ///< total steps of the run
  double loss = 0.0;          ///< this step's training loss
  double lr = 0.0;            ///< this step's learning rate
  double tokens_per_s = 0.0;  ///< since the start (or resume) of this process
  double elapsed_s = 0.0;     ///< training time, resumes included
  double eta_s = 0.0;         ///< estimated time to `steps` (or stop_at)
  std::optional<double> val_loss;  ///< when this step validated
  bool checkpointed = false;       ///< when this step wrote a checkpoint
};

/// Checks `options` as train() does first: throws c10::Error naming the
/// option and its value (steps < 1, lr <= 0, min_lr outside [0, lr],
/// warmup_steps outside [0, steps], negative weight_decay, grad_clip or
/// intervals, resume without out_dir).
void validate(const TrainOptions& options);

/// Called by train() after every step.
using ProgressCallback = std::function<void(const Progress&)>;

/// What train() did.
struct TrainResult {
  std::vector<LossRecord> history;  ///< every step from 1 (resumes included)
  int64_t first_step = 1;           ///< the first step this call ran
  int64_t last_step = 0;       ///< the last step done (== first_step - 1: none)
  double val_loss = kNoValue;  ///< the last validation loss
};

/// The paths of a run's files under out_dir: checkpoint/model.safetensors
/// (the weights, for mha::load_state_dict), checkpoint/trainer.pt (optimizer,
/// step, RNG state, loss history, fingerprint; LibTorch serialization),
/// loss.csv and loss.svg.
struct RunFiles {
  explicit RunFiles(const std::string& out_dir);
  std::string checkpoint_dir;
  std::string model;
  std::string trainer;
  std::string loss_csv;
  std::string loss_svg;
};

/// Trains `task.model()`: for each step, set the scheduled learning rate,
/// compute the batch loss, backpropagate, clip the gradient norm, take an
/// AdamW step; validate, checkpoint and write the loss curve on schedule.
/// With options.resume() it first restores the checkpoint in out_dir
/// (weights, optimizer, step, RNG state, history) and continues after its
/// step; the checkpoint must come from a run with the same fingerprint
/// (task settings, seed and these options, apart from stop_at,
/// checkpoint_every, eval_every and resume).
///
/// Validation runs every eval_every steps and at step `steps` (not at
/// stop_at), so an interrupted and resumed run records exactly what the
/// uninterrupted one does. Checkpoints (and loss.csv, loss.svg) are written
/// every checkpoint_every steps and at the run's last step (stop_at or
/// steps).
///
/// Throws c10::Error on invalid options (see validate()), when resuming
/// finds no checkpoint or one with another fingerprint, when the loss
/// becomes NaN or infinite, and when files cannot be written.
///
/// Data-parallel training: with a ProcessGroup `group` of world size W,
/// every rank calls train() with the same task settings and options, and
/// the job as a whole takes exactly the steps one process takes with the
/// same (global) batch size, as DDP does:
///   * rank 0's initial weights (or its checkpoint's weights, optimizer
///     state and history, when resuming) are broadcast to every rank; the
///     checkpoint may come from a run with any world size;
///   * rank r computes the rows task.shard().rows(batch) of every global
///     batch (Shard{r, W}); its loss is divided by the global count of real
///     tokens, so the gradients summed over ranks (GradientSynchronizer,
///     kSum) are the gradient of the whole batch's mean loss, however
///     padding falls;
///   * gradient clipping and the AdamW step then run identically on every
///     rank, and the parameters stay identical;
///   * the reported training and validation losses are the global ones
///     (validation is sharded too), the same on every rank;
///   * rank 0 alone writes checkpoints and the loss curve (other ranks
///     ignore out_dir); on_progress is called on every rank;
///   * ranks other than 0 draw dropout from LibTorch's default generator
///     reseeded per rank (SeedStream::kRankDropout), so with dropout the
///     job is not bit-identical to one process, only equal in law.
/// The task's shard is set for the run and restored to {0, 1} at the end.
/// Throws c10::Error also when the batch size is smaller than W, and when
/// a collective fails (a rank died, or the group's timeout passed).
TrainResult train(TrainTask& task, const TrainOptions& options,
                  const ProgressCallback& on_progress = {},
                  distributed::ProcessGroup* group = nullptr);

/// Saves a checkpoint under `files.checkpoint_dir` (see RunFiles): written
/// into a temporary directory, then renamed over the old one. `history` is
/// every record so far; its last step is the checkpoint's step.
void save_checkpoint(const RunFiles& files, const torch::nn::Module& model,
                     torch::optim::Optimizer& optimizer,
                     const std::vector<LossRecord>& history,
                     const std::string& fingerprint);

/// Restores a checkpoint written by save_checkpoint into `model` and
/// `optimizer` (tensors go to the model's device), restores LibTorch's
/// default CPU generator, and returns the history (its last step is the
/// checkpoint's step). Throws c10::Error naming the directory if there is no
/// checkpoint, or if its fingerprint differs from `fingerprint` (both are
/// shown).
std::vector<LossRecord> load_checkpoint(const RunFiles& files,
                                        torch::nn::Module& model,
                                        torch::optim::Optimizer& optimizer,
                                        const std::string& fingerprint);

// --------------------------------------------------------------- progress ---

/// Decides when to show a progress line: on a terminal (interactive) at
/// most every `min_interval_s` seconds, redrawn in place; in a log at most
/// `max_lines` times a run (every ceil(steps / max_lines) steps), plus steps
/// that validated or checkpointed, plus the last step.
class ProgressThrottle {
 public:
  ProgressThrottle(bool interactive, int64_t steps, double min_interval_s = 0.2,
                   int64_t max_lines = 20);
  /// True if `progress` (at `now_s` seconds on any steady clock) should be
  /// shown.
  bool should_show(const Progress& progress, double now_s);

 private:
  bool interactive_;
  int64_t steps_;
  double min_interval_s_;
  int64_t every_;
  double last_shown_s_ = -1e300;
};

/// One progress line, e.g.
/// `step  120/3000 | loss 1.2345 | lr 1.00e-03 | 52.3k tok/s | ETA 1m05s`,
/// with ` | val 1.1000` when the step validated and ` | saved` when it
/// checkpointed.
std::string format_progress(const Progress& progress);

/// A duration as `42s`, `3m05s` or `1h02m`.
std::string format_duration(double seconds);

}  // namespace mha::train
