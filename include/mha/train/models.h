// The models of the toy tasks (part of mha/train.h): an encoder-only tagger
// for the digit tasks and a small GPT-style character language model, with
// its text generation.
//
// Glossary: N batch, L sequence length (digit tasks), T context length (the
// character model), E model width, H heads, V vocabulary size, C classes.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "mha/flex_attention.h"
#include "mha/multi_head_attention.h"
#include "mha/train/data.h"
#include "mha/transformer.h"

namespace mha::train {

// ------------------------------------------------------- digit model ---

/// Options of DigitTransformer. The defaults are mha-train --task reverse's.
struct DigitTransformerOptions {
  /// Inputs of up to `max_len` tokens; the other options at their defaults.
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
  /// The layers' self-attention (MultiHeadAttentionOptions::attention_kind):
  /// kSoftmax (default), kLinear, kPerformer or kLinformer (keys and values
  /// projected to projected_length rows, max_length = max_len). kLinear
  /// and kPerformer drop no attention weights (they form none).
  TORCH_ARG(AttentionKind, attention_kind) = AttentionKind::kSoftmax;
  /// kLinformer: k; 0 (default): max_len / 2 (at least 1).
  TORCH_ARG(int64_t, projected_length) = 0;
};

/// An encoder-only tagger for the digit tasks: token + learned position
/// embeddings, a pre-norm mha::TransformerEncoder with a final LayerNorm, and
/// a linear head giving, at each position, logits over the 10 digits.
///
/// Submodules: tok_emb (kDigitVocabSize, E), pos_emb (max_len, E), encoder
/// (layers.0..., norm), head (E → kNumDigits).
class DigitTransformerImpl : public torch::nn::Cloneable<DigitTransformerImpl> {
 public:
  /// Builds the model from `options_` (reset()).
  explicit DigitTransformerImpl(const DigitTransformerOptions& options_);

  /// input (N, L) int64 token ids, L <= max_len; padding (N, L) bool, true =
  /// padded (the encoder's src_key_padding_mask), or undefined for none.
  /// Returns logits (N, L, kNumDigits), float32. Logits at padded positions
  /// are computed but carry no meaning.
  torch::Tensor forward(const torch::Tensor& input,
                        const torch::Tensor& padding = {});

  /// Checks the options and (re)creates the submodules.
  void reset() override;

  /// The options the model was built with.
  DigitTransformerOptions options;
  /// Token embedding (kDigitVocabSize, E).
  torch::nn::Embedding tok_emb = nullptr;
  /// Learned position embedding (max_len, E).
  torch::nn::Embedding pos_emb = nullptr;
  /// Pre-norm encoder (num_layers layers, final LayerNorm).
  TransformerEncoder encoder = nullptr;
  /// E → kNumDigits logits.
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

// ----------------------------------------------- character language model ---

/// Options of CharLM (the names of nanoGPT's GPTConfig). The defaults are
/// mha-train --task charlm's.
struct CharLMOptions {
  /// `vocab_size` characters, context of `block_size` positions; the other
  /// options at their defaults.
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
  /// The blocks' causal self-attention (MultiHeadAttentionOptions::
  /// attention_kind): kSoftmax (default), kLinear or kPerformer (kLinformer
  /// cannot be causal: c10::Error). The linear kinds attend to the whole
  /// prefix (no sliding window with rotary), decode with a constant-size
  /// state, drop no attention weights (they form none) and have no
  /// attention maps (attention_weights throws).
  TORCH_ARG(AttentionKind, attention_kind) = AttentionKind::kSoftmax;
};

/// One pre-norm block of a GPT (Radford et al. 2019; nanoGPT's Block):
///   x = x + dropout(attn(ln_1(x), is_causal=true))
///   x = x + dropout(c_proj(gelu(c_fc(ln_2(x)))))
/// attn is an mha::MultiHeadAttention called with need_weights=false.
/// Submodules: ln_1, attn, ln_2, c_fc (E → 4E), c_proj (4E → E), dropout.
class GPTBlockImpl : public torch::nn::Cloneable<GPTBlockImpl> {
 public:
  /// Builds the block from the model's options (n_embd, n_head, dropout;
  /// with rotary, a window of block_size keys).
  explicit GPTBlockImpl(const CharLMOptions& options_);
  /// x (N, T, E) → (N, T, E); position t sees positions <= t only (and
  /// > t - block_size when rotary). positions, block_mask and
  /// key_padding_mask go to attn (MultiHeadAttention::forward): positions
  /// (N, T) int64 for rotary and the window, a BlockMask (e.g.
  /// packed_documents_block_mask), key_padding_mask (N, T) bool (true =
  /// padding); undefined or empty (default): none.
  torch::Tensor forward(const torch::Tensor& x,
                        const torch::Tensor& positions = {},
                        const BlockMask& block_mask = {},
                        const torch::Tensor& key_padding_mask = {});
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

  /// The model's options this block was built with.
  CharLMOptions options;
  /// Norm before attention (E).
  LayerNorm ln_1 = nullptr;
  /// Causal self-attention (E, n_head).
  MultiHeadAttention attn = nullptr;
  /// Norm before the feed-forward block (E).
  LayerNorm ln_2 = nullptr;
  /// E → 4E.
  torch::nn::Linear c_fc = nullptr;
  /// 4E → E, back into the residual stream.
  torch::nn::Linear c_proj = nullptr;
  /// Dropout on both residual branches (training mode only).
  torch::nn::Dropout dropout = nullptr;

 private:
  std::tuple<torch::Tensor, torch::Tensor> forward_impl(
      const torch::Tensor& x, bool need_weights,
      const torch::Tensor& positions = {}, const BlockMask& block_mask = {},
      const torch::Tensor& key_padding_mask = {});
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
/// `h.<i>.{ln_1,attn,ln_2,c_fc,c_proj}.*`, `ln_f.{weight,bias}`. Initialised as
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
  /// Builds and initialises the model from `options_` (reset()).
  explicit CharLMImpl(const CharLMOptions& options_);

  /// idx (N, T) int64 ids in [0, V), T <= block_size unless rotary.
  /// Returns logits (N, T, V), float32: position t predicts character t + 1
  /// from characters 0..t. Throws c10::Error if !rotary and T > block_size.
  ///
  /// Packed sequences (several documents in a row; see PackedCharBatch):
  ///   positions: (N, T) int64, each character's position (restarting at 0
  ///     in each document): the rows of wpe it reads (learned positions, in
  ///     [0, block_size)) or where rotary rotates it. Default: 0..T-1.
  ///   block_mask: the documents' causal mask (packed_documents_block_mask):
  ///     a character sees only the earlier characters of its document.
  ///   key_padding_mask: (N, T) bool, true = padding, never attended to
  ///     (padded rows; their logits carry no meaning).
  /// With the defaults (none), forward(idx) is the plain call, bit for bit.
  /// Each document then gets the logits it would get alone, within float
  /// rounding.
  torch::Tensor forward(const torch::Tensor& idx,
                        const torch::Tensor& positions = {},
                        const BlockMask& block_mask = {},
                        const torch::Tensor& key_padding_mask = {});

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

  /// The options the model was built with.
  CharLMOptions options;
  /// Token embedding (V, E), also the output head (weight tying).
  torch::nn::Embedding wte = nullptr;
  /// Learned position embedding (block_size, E); null when rotary.
  torch::nn::Embedding wpe = nullptr;
  /// Dropout on the embeddings (training mode only).
  torch::nn::Dropout drop = nullptr;
  /// The n_layer GPTBlocks (h.0, h.1, ...).
  torch::nn::ModuleList h = nullptr;
  /// Final norm (E) before the head.
  LayerNorm ln_f = nullptr;
};

/// Holder of CharLMImpl.
TORCH_MODULE(CharLM);

/// The attention mask of rows of packed documents for CharLM::forward: in
/// row b, a character may attend to the characters of its own document up
/// to itself (Python FlexAttention's causal document mask, per row). One
/// BlockMask with B = rows (one create_document_block_mask per row), H = 1,
/// blocks of `block` queries and keys. `row_lengths`: one 1-D integer
/// tensor of positive document lengths per row (PackedCharBatch::lengths),
/// every row with the same sum T. Throws c10::Error for no rows, rows of
/// different sums or bad lengths.
BlockMask packed_documents_block_mask(
    const std::vector<torch::Tensor>& row_lengths, int64_t block = 64);

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

}  // namespace mha::train
