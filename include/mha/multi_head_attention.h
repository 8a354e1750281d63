// Multi-head attention with PyTorch's parameters, options and semantics.
//
// Semantics: torch.nn.MultiheadAttention
// (https://pytorch.org/docs/stable/generated/torch.nn.MultiheadAttention.html)
// and "Attention Is All You Need" (Vaswani et al., 2017), section 3.2.2.
// Differences from torch::nn::MultiheadAttention, all deliberate:
//   * batch_first defaults to true (our choice);
//   * a bool attn_mask blocks `true` positions (LibTorch adds it as 0/1);
//   * 3-D attn_mask, kdim != vdim and -inf in a float key_padding_mask work;
//   * a fully masked query row gives out_proj.bias, weights 0, no NaN;
//   * key and value may be left out for self-attention; is_causal exists.
#pragma once

#include <torch/torch.h>

#include <tuple>

#include "mha/flex_attention.h"
#include "mha/kv_cache.h"
#include "mha/linear_attention.h"
#include "mha/positions.h"

namespace mha {

/// A bias on the attention scores that depends on the query and key
/// positions only.
enum class PositionBias {
  kNone,      ///< none (PyTorch's multi-head attention)
  kAlibi,     ///< ALiBi: -m_h · |i - j|, fixed slopes (alibi_slopes)
  kRelative,  ///< T5: a learned scalar per head and relative-position bucket
};

/// The normalisation of queries and keys before attention (the models of
/// 2025: Qwen3, Gemma 3, OLMo 2, Llama 4). RMSNorm (Zhang and Sennrich,
/// 2019): x / sqrt(mean(x²) + eps) · weight, computed in float32 for
/// float16 / bfloat16 inputs as transformers' RMSNorm classes.
enum class QKNorm {
  kNone,     ///< none (default)
  kPerHead,  ///< RMSNorm over each head's head_dim features, before rotary;
             ///< q_norm.weight, k_norm.weight (head_dim): Qwen3, Gemma 3
  kFull,     ///< RMSNorm over the whole projection, before rotary;
             ///< q_norm.weight (num_heads · head_dim), k_norm.weight
             ///< (num_kv_heads · head_dim): OLMo 2
  kL2,       ///< x / sqrt(mean(x²) + eps) per head, no weight, after rotary:
             ///< Llama 4's L2 norm (use_qk_norm)
};

/// A normalisation's learned scale as a module of its own, so that its
/// parameter is named `<name>.weight` as in transformers' RMSNorm modules
/// (MultiHeadAttention's q_norm and k_norm).
class NormWeightImpl : public torch::nn::Cloneable<NormWeightImpl> {
 public:
  /// A weight of `size` features (>= 0), initialised to ones.
  explicit NormWeightImpl(int64_t size = 0);
  /// (Re)creates the weight, ones.
  void reset() override;
  /// (size)
  torch::Tensor weight;

 private:
  int64_t size_ = 0;
};

/// Holder of NormWeightImpl.
TORCH_MODULE(NormWeight);

/// Llama 4's attention temperature tuning of its NoPE layers (Nakanishi,
/// 2025, "Scalable-Softmax"; transformers' Llama4TextAttention): the query
/// of the token at index t (0-based, counting the tokens before it in a
/// cache; not its position id) is multiplied by
/// log1p(floor((t + 1) / floor_scale)) · attn_scale + 1, computed in float32
/// (float64 for float64 queries). Fields named as the config keys.
struct AttnTemperatureTuning {
  /// Tokens per step of the logarithm (config floor_scale; > 0).
  double floor_scale = 8192.0;
  /// The logarithm's factor (config attn_scale).
  double attn_scale = 0.1;
};

/// Options for MultiHeadAttention; names and defaults as PyTorch's, except
/// batch_first (true here).
struct MultiHeadAttentionOptions {
  /// embed_dim: E, the model width (query features and output features).
  /// num_heads: H; E must be divisible by H (head_dim = E / H).
  MultiHeadAttentionOptions(int64_t embed_dim, int64_t num_heads);

  /// Model width E (PyTorch: embed_dim).
  TORCH_ARG(int64_t, embed_dim);
  /// Number of heads H (PyTorch: num_heads).
  TORCH_ARG(int64_t, num_heads);
  /// Dropout probability on the attention weights in training mode, in
  /// [0, 1). Default 0.0 (PyTorch: dropout).
  TORCH_ARG(double, dropout) = 0.0;
  /// Biases in the input and output projections. Default true.
  TORCH_ARG(bool, bias) = true;
  /// Learned bias_k / bias_v rows appended to key and value (one extra key
  /// position, never masked). Default false.
  TORCH_ARG(bool, add_bias_kv) = false;
  /// A zero row appended to key and value after the projection (one extra
  /// key position, never masked). Default false.
  TORCH_ARG(bool, add_zero_attn) = false;
  /// Features of key; default (nullopt) embed_dim.
  TORCH_ARG(c10::optional<int64_t>, kdim) = c10::nullopt;
  /// Features of value; default (nullopt) embed_dim.
  TORCH_ARG(c10::optional<int64_t>, vdim) = c10::nullopt;
  /// true: inputs (N, L, E); false: (L, N, E) as torch::nn. Default true
  /// (our choice; PyTorch's default is false).
  TORCH_ARG(bool, batch_first) = true;
  /// Key/value heads for grouped-query attention (Ainslie et al., 2023;
  /// 1: multi-query attention, Shazeer, 2019): num_heads / num_kv_heads query
  /// heads share each key/value head (query head h uses key/value head
  /// h / (num_heads / num_kv_heads), as repeat_kv in Llama). Must divide
  /// num_heads. Default (nullopt): num_heads, PyTorch's multi-head attention.
  /// Not in torch::nn: with fewer key/value heads the module has no packed
  /// in_proj_weight (see the parameters below).
  TORCH_ARG(c10::optional<int64_t>, num_kv_heads) = c10::nullopt;
  /// Rotary position embedding (mha::rotary_embedding, RoFormer) of the
  /// projected query and key heads, query row i at position i and key row j
  /// at position j. Needs an even head_dim; not with add_bias_kv or
  /// add_zero_attn (their extra key position has no position). Default
  /// false. Not in torch::nn.
  TORCH_ARG(bool, rotary) = false;
  /// Base of the rotary frequencies (rotary_embedding's theta). Default
  /// 10000.
  TORCH_ARG(double, rotary_theta) = 10000.0;
  /// Which features the rotary embedding pairs. Default kHalf (GPT-NeoX,
  /// Llama in Hugging Face transformers).
  TORCH_ARG(RotaryPairing, rotary_pairing) = RotaryPairing::kHalf;
  /// Rotary: rotate only the first rotary_dim features of each head (both
  /// pairings, pairs formed within those features; the frequencies are
  /// theta^(-2i / rotary_dim)); the others pass unchanged. GPT-J's
  /// rotary_dim, GPT-NeoX's rotary_pct · head_dim (HF 5.x:
  /// partial_rotary_factor · head_dim). Even, 2 <= rotary_dim <= head_dim;
  /// needs rotary. Default (nullopt): all of head_dim. Not in torch::nn.
  TORCH_ARG(c10::optional<int64_t>, rotary_dim) = c10::nullopt;
  /// Rotary: the scaling of the frequencies (mha::RotaryScaling, Hugging
  /// Face's rope_scaling: linear, dynamic, yarn, longrope, llama3), checked
  /// by reset(). Default {}: rope_type "default", no scaling. A type other
  /// than "default" needs rotary. Not in torch::nn.
  TORCH_ARG(RotaryScaling, rotary_scaling) = {};
  /// Sliding-window (local) attention (Longformer, Beltagy et al., 2020;
  /// Mistral 7B, Jiang et al., 2023): query i sees key j only when
  /// |i - j| < window, positions as for is_causal (forward_cached: the
  /// query at the cache's position). With is_causal: the `window` keys up
  /// to and including its own position. On the CPU the blocked core
  /// computes only the scores inside the window: O(L · window). >= 1;
  /// default (nullopt): no limit. Not with add_bias_kv / add_zero_attn.
  /// Not in torch::nn.
  TORCH_ARG(c10::optional<int64_t>, window) = c10::nullopt;
  /// A position bias added to every head's scores (after the 1/sqrt(D)
  /// scaling): kAlibi (Press et al., 2022) or kRelative (T5, Raffel et al.,
  /// 2020; the learned `relative_attention_bias`). Stored per distance, never
  /// as (L, S) per head, on the blocked CPU path. Not with add_bias_kv /
  /// add_zero_attn. Default kNone. Not in torch::nn.
  TORCH_ARG(PositionBias, position_bias) = PositionBias::kNone;
  /// kRelative: buckets of relative_position_bucket. Default 32 (T5).
  TORCH_ARG(int64_t, relative_num_buckets) = 32;
  /// kRelative: the distance where the last bucket begins. Default 128 (T5).
  TORCH_ARG(int64_t, relative_max_distance) = 128;
  /// kRelative: separate buckets for keys after the query (T5's encoder,
  /// default true) or not (T5's decoder, for causal attention).
  TORCH_ARG(bool, relative_bidirectional) = true;
  /// The attention between the projections (mha/linear_attention.h):
  /// kSoftmax (default), or a linear-cost kind: kLinear (Katharopoulos et
  /// al., 2020), kPerformer (FAVOR+, Choromanski et al., 2021), kLinformer
  /// (Wang et al., 2020). kLinear and kPerformer never form the weights
  /// (need_weights=false is required), take key_padding_mask and is_causal
  /// but no attn_mask, and decode with a constant-size state
  /// (forward_cached); kLinformer is non-causal only. None of them takes
  /// add_bias_kv, add_zero_attn, window or position_bias; kLinear and
  /// kPerformer take no dropout (there are no weights to drop). `scale`:
  /// kPerformer estimates exp(q·k · scale), kLinformer's softmax uses it,
  /// kLinear has none (it must stay unset). Without autograd (GradMode
  /// off), kLinear and kPerformer run causal self-attention a segment of
  /// rows at a time, projections included, and make other calls' features
  /// a segment at a time: only the output is as long as the sequence
  /// (docs/linear.md). With autograd, their causal self-attention longer
  /// than a segment trains by segments, checkpointed: the backward
  /// recomputes each segment's forward (first derivatives only; a custom
  /// feature_map takes the whole sequence at once). Not in torch::nn.
  /// Checked by reset().
  TORCH_ARG(AttentionKind, attention_kind) = AttentionKind::kSoftmax;
  /// kLinear: the feature map φ (mha::FeatureMap); empty (default):
  /// elu(x) + 1 (Katharopoulos et al., 2020).
  TORCH_ARG(FeatureMap, feature_map) = {};
  /// kPerformer: random features per head, m; 0 (default): the paper's
  /// round(head_dim · ln(head_dim)) (at least 1).
  TORCH_ARG(int64_t, nb_features) = 0;
  /// kPerformer: the seed of the orthogonal random features
  /// (mha::orthogonal_random_features), drawn by reset_parameters() and
  /// redraw_features().
  TORCH_ARG(uint64_t, feature_seed) = 0;
  /// kLinformer: k, the rows keys and values are projected to along the
  /// sequence (>= 1).
  TORCH_ARG(int64_t, projected_length) = 0;
  /// kLinformer: n, the longest key sequence (>= 1); a sequence of S < n
  /// keys uses the first S columns of the projections.
  TORCH_ARG(int64_t, max_length) = 0;
  /// kLinformer: one projection proj_k for keys and values (true, the
  /// paper's key-value sharing), or proj_k and proj_v.
  TORCH_ARG(bool, share_kv_projection) = true;
  /// Softmax scale: the scores are (Q_h · K_hᵀ) · scale. nullopt (default):
  /// 1 / sqrt(head_dim) (Vaswani et al., 2017, and torch::nn). T5 uses 1.0
  /// (no scaling; Raffel et al., 2020, and transformers' T5Attention). The
  /// `scale` of PyTorch's scaled_dot_product_attention (2.1+). Must be
  /// finite (c10::Error otherwise).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// A score modification applied on every call of the module (forward,
  /// forward_cached, forward_projected), FlexAttention's score_mod
  /// (mha/flex_attention.h): called on the scaled scores (after a position
  /// bias, before the masks) with the batch, the query head, the query row
  /// of the call (forward_cached: 0..T-1 of the new tokens) and the key
  /// index. E.g. Gemma 2's soft-capping of the attention logits,
  /// `softcap * tanh(score / softcap)` (transformers' Gemma2Attention,
  /// config.attn_logit_softcapping). Empty (default): none.
  TORCH_ARG(ScoreMod, score_mod) = {};
  /// Per-head width D. nullopt (default): embed_dim / num_heads. Qwen3,
  /// Gemma 3, gpt-oss and Qwen3-Next have num_heads · head_dim !=
  /// embed_dim: queries project to num_heads · head_dim features, keys and
  /// values to num_kv_heads · head_dim, and out_proj back to embed_dim
  /// (out_proj.weight (E, H · D)); the module then has no packed
  /// in_proj_weight. >= 1; not with a linear attention_kind.
  TORCH_ARG(c10::optional<int64_t>, head_dim) = c10::nullopt;
  /// Normalisation of queries and keys (QKNorm): kPerHead, kFull before
  /// rotary, kL2 after it. Default kNone. Not with a linear attention_kind.
  /// transformers: Qwen3Attention, Gemma3Attention, Olmo2Attention,
  /// Llama4TextAttention.
  TORCH_ARG(QKNorm, qk_norm) = QKNorm::kNone;
  /// The RMSNorm's epsilon (transformers: config.rms_norm_eps). Default
  /// 1e-6.
  TORCH_ARG(double, qk_norm_eps) = 1e-6;
  /// The norms scale by (1 + weight), the weight as stored (zeros at
  /// initialisation): Gemma 3, Qwen3-Next. Default false (scale by weight,
  /// ones at initialisation).
  TORCH_ARG(bool, qk_norm_unit_offset) = false;
  /// gpt-oss's attention sinks: a learned logit per head (parameter
  /// `sinks`, (num_heads), zeros at initialisation) joins each query row's
  /// softmax denominator, weights_j = exp(s_j) / (Σ_k exp(s_k) +
  /// exp(sinks_h)), so a row's weights sum to less than 1 (a fully masked
  /// row: 0). transformers' GptOssAttention. Computed from the core's
  /// logsumexp: output · sigmoid(lse - sinks_h). Default false.
  TORCH_ARG(bool, attention_sinks) = false;
  /// Qwen3-Next's gated attention: the query projection yields, per head,
  /// [query_h | gate_h] (q_proj_weight (2 · H · D, E), the checkpoint's
  /// layout), and the attention's output is multiplied by sigmoid(gate)
  /// before out_proj. transformers' Qwen3NextAttention. Default false.
  TORCH_ARG(bool, output_gate) = false;
  /// Llama 4's chunked attention: a query at position p sees only keys
  /// whose position lies in its chunk, floor(position / size) equal
  /// (positions as for window: explicit ones where given, else the token
  /// indices; forward_cached: the cache's). Combined with is_causal as
  /// transformers' chunked mask. Built as a dense (N, 1, L, S) mask. >= 1;
  /// default nullopt: none. Not with add_bias_kv / add_zero_attn.
  TORCH_ARG(c10::optional<int64_t>, attention_chunk_size) = c10::nullopt;
  /// Llama 4's temperature tuning of the queries (AttnTemperatureTuning),
  /// applied after rotary and the norms. Default nullopt: none.
  TORCH_ARG(c10::optional<AttnTemperatureTuning>,
            attn_temperature_tuning) = c10::nullopt;
};

/// The keys and values of a fixed key/value sequence (an encoder's memory)
/// after a module's input projection, split into heads: computed once by
/// MultiHeadAttention::project_key_value and attended at every decoding step
/// by MultiHeadAttention::forward_projected (the cross-attention of cached
/// decoding; Hugging Face keeps the same tensors in the cross-attention half
/// of its EncoderDecoderCache). Gradients flow through them as through any
/// tensor.
struct ProjectedKeyValue {
  torch::Tensor key;    ///< (N, Hkv, S, D)
  torch::Tensor value;  ///< (N, Hkv, S, D)
};

/// Multi-head attention: out_proj(concat_h softmax(Q_h K_hᵀ · scale + mask)
/// V_h), scale = 1 / sqrt(D) unless options.scale() says otherwise,
/// Q = query·W_qᵀ + b_q, K = key·W_kᵀ + b_k, V = value·W_vᵀ + b_v.
///
/// Parameters (names as PyTorch's, so state dicts move both ways), with
/// Ekv = num_kv_heads · head_dim (E unless num_kv_heads is set):
///   in_proj_weight (3E, E)         when packed_in_proj(), else
///   q_proj_weight (Eq, E), k_proj_weight (Ekv, kdim),
///   v_proj_weight (Ekv, vdim);
///   in_proj_bias (Eq + 2 Ekv)      when bias (rows: query, key, value);
///   bias_k, bias_v (1, 1, Ekv)     when add_bias_kv;
///   out_proj.weight (E, H·D), out_proj.bias (E) (bias only when bias);
///   relative_attention_bias.weight (buckets, H)  when position_bias is
///   kRelative;
///   q_norm.weight, k_norm.weight   when qk_norm is kPerHead or kFull;
///   sinks (H)                      when attention_sinks;
/// with D = head_dim (E / H unless set), Eq = H·D (2·H·D with
/// output_gate).
/// Initialised as PyTorch: xavier_uniform projections, zero biases,
/// xavier_normal bias_k / bias_v, out_proj.weight as nn.Linear.
///
/// Example:
///   mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(64, 8));
///   auto x = torch::randn({2, 10, 64});                  // (N, L, E)
///   auto [out, weights] = attn(x);                       // self-attention
///   // out: (2, 10, 64), weights: (2, 10, 10) averaged over heads
class MultiHeadAttentionImpl
    : public torch::nn::Cloneable<MultiHeadAttentionImpl> {
 public:
  /// `embed_dim` features split over `num_heads` heads, every other option
  /// at its default (as torch::nn::MultiheadAttention(embed_dim, num_heads)).
  MultiHeadAttentionImpl(int64_t embed_dim, int64_t num_heads)
      : MultiHeadAttentionImpl(
            MultiHeadAttentionOptions(embed_dim, num_heads)) {}
  /// Builds the module from `options_`. Throws c10::Error naming the option
  /// for invalid ones (reset()).
  explicit MultiHeadAttentionImpl(const MultiHeadAttentionOptions& options_);

  /// Attends from query to key/value.
  ///
  /// Shapes (batch_first=true; with false swap N and the length, as
  /// torch::nn): query (N, L, E), key (N, S, kdim), value (N, S, vdim);
  /// unbatched: query (L, E), key (S, kdim), value (S, vdim).
  /// key and value are both given or both undefined (self-attention: key =
  /// value = query). All floating, with the parameters' dtype and device.
  ///
  /// Masks (bool: true = blocked; floating, query's dtype: added to scores):
  ///   key_padding_mask: (N, S), unbatched (S). Blocks key positions.
  ///   attn_mask: (L, S) or (N*H, L, S); unbatched (L, S) or (H, L, S).
  ///   is_causal: also block key j > query i (top-left, union with masks).
  /// Both masks may be given, bool and float mixed; the extra key position of
  /// add_bias_kv / add_zero_attn is never masked.
  ///
  /// Returns (output, weights):
  ///   output (N, L, E) ((L, N, E) if !batch_first; (L, E) unbatched);
  ///   weights, only if need_weights: (N, L, S') averaged over heads, or
  ///   (N, H, L, S') if !average_attn_weights, S' = S + add_bias_kv +
  ///   add_zero_attn (unbatched: no N); else an undefined tensor.
  /// A query row whose every key is blocked gets weights 0 and output
  /// out_proj.bias (the attention result is 0), never NaN.
  ///
  /// positions: int64 (N, L) or (L) (unbatched: (L)), the position of each
  /// token for rotary, ALiBi, T5's buckets and window, self-attention only;
  /// default (undefined) 0..L-1. is_causal still follows the token order,
  /// not positions (as Hugging Face: query i sees tokens j <= i). With
  /// position_bias or window, explicit positions make the module build the
  /// bias and window as a dense (N, H, L, S) mask. Left padding as HF:
  /// positions = cumsum(keep) - 1 with key_padding_mask blocking the pads.
  ///
  /// block_mask: a FlexAttention BlockMask (mha/flex_attention.h) made for
  /// q_len = L and kv_len = S' (B of 1 or N, H of 1 or num_heads): only its
  /// visited blocks are computed, its partial ones masked by its mask_mod
  /// (true = may attend), on top of the masks above; e.g. the documents of
  /// a packed batch (create_document_block_mask) with positions restarting
  /// in each document. Default: none.
  ///
  /// Throws c10::Error naming the argument, its shape or dtype and what was
  /// expected: wrong dims or feature sizes, batch or length mismatches, key
  /// without value, masks of the wrong shape, integer masks, another device,
  /// positions of the wrong shape or dtype or with cross-attention, a
  /// block_mask made for other lengths, batch or heads.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& query, const torch::Tensor& key = {},
      const torch::Tensor& value = {},
      const torch::Tensor& key_padding_mask = {}, bool need_weights = true,
      const torch::Tensor& attn_mask = {}, bool average_attn_weights = true,
      bool is_causal = false, const torch::Tensor& positions = {},
      const BlockMask& block_mask = {});

  /// Self-attention for incremental decoding: projects query (N, T, E)
  /// ((T, N, E) if !batch_first; (T, E) unbatched, N = 1), appends its keys
  /// and values to `cache` (positions P = cache.size() to P + T - 1 before
  /// the call, rotary keys rotated there), and attends from query row t, at
  /// position P + t, to every cached key: bottom-right alignment. With
  /// is_causal (default) query t sees the cache and new tokens <= t; window
  /// and position_bias apply at the same positions. Equal, within rounding,
  /// to forward(whole sequence, is_causal) restricted to the new rows.
  ///
  /// Returns (output like query's layout, weights (N, T, P + T) averaged or
  /// (N, H, T, P + T) per head when need_weights, else undefined). Without
  /// gradient mode (torch::NoGradGuard, as for generation) the attention
  /// reads the cache's buffers in place; with it, gradients reach this
  /// call's query, key and value but not the cached tokens of earlier calls.
  ///
  /// key_padding_mask: bool (N, P + T) (unbatched (P + T)), true =
  /// padding, over the cached and the new tokens (Hugging Face's
  /// attention_mask negated); a floating one is added as forward's. A query
  /// row whose every visible key is padding (a left pad) gets attention 0,
  /// output out_proj.bias, never NaN.
  /// positions: int64 (N, T) or (T) (unbatched (T)), the position of each
  /// new token for rotary, ALiBi, T5 buckets and window; default P + 0..T-1.
  /// Its keys are rotated there before they enter the cache, and the cache
  /// records them (KVCache::positions) for the position rules of later
  /// calls. is_causal follows the token order. A left-padded batch thus
  /// decodes through one cache exactly as HF's generate: attention_mask
  /// (1 = token), position_ids = cumsum(attention_mask) - 1, pads at 0.
  ///
  /// Throws c10::Error as forward, and for a cache of another batch size,
  /// head count, head_dim, dtype or device, or without room for T tokens.
  std::tuple<torch::Tensor, torch::Tensor> forward_cached(
      const torch::Tensor& query, KVCache& cache, bool is_causal = true,
      bool need_weights = false, bool average_attn_weights = true,
      const torch::Tensor& key_padding_mask = {},
      const torch::Tensor& positions = {});

  /// An empty KVCache for this module: batch_size sequences, capacity
  /// positions, num_kv_heads() heads of head_dim, the parameters' dtype and
  /// device.
  KVCache make_kv_cache(int64_t batch_size, int64_t capacity) const;
  /// Cross-attention for incremental decoding, first half: key (N, S,
  /// kdim) and value (N, S, vdim) ((S, N, ...) if !batch_first; (S, ...)
  /// unbatched, N = 1) through the key and value projections, split into
  /// num_kv_heads() heads. Not with add_bias_kv, add_zero_attn, rotary,
  /// window or position_bias (they give keys positions or extra rows):
  /// c10::Error naming the option. Throws c10::Error as forward for wrong
  /// dims, feature sizes, lengths, dtype or device.
  ProjectedKeyValue project_key_value(const torch::Tensor& key,
                                      const torch::Tensor& value) const;
  /// Cross-attention for incremental decoding, second half: attends from
  /// query ((N, T, E) as forward's layout) to the projected keys and values
  /// of project_key_value, without recomputing them; key_padding_mask
  /// (N, S) ((S) unbatched), bool (true = blocked) or floating, or
  /// undefined. Equal, within rounding, to forward(query, key, value,
  /// key_padding_mask, need_weights, {}, average_attn_weights) with the
  /// key and value that were projected. Returns (output, weights) as
  /// forward. Throws c10::Error as forward, and for a key_value of another
  /// batch size, head count, head_dim, dtype or device.
  std::tuple<torch::Tensor, torch::Tensor> forward_projected(
      const torch::Tensor& query, const ProjectedKeyValue& key_value,
      const torch::Tensor& key_padding_mask = {}, bool need_weights = false,
      bool average_attn_weights = true);

 protected:
  // Defaults of forward's arguments 1..9: key, value, key_padding_mask,
  // need_weights, attn_mask, average_attn_weights, is_causal, positions,
  // block_mask.
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(true)},
                           {5, torch::nn::AnyValue(torch::Tensor())},
                           {6, torch::nn::AnyValue(true)},
                           {7, torch::nn::AnyValue(false)},
                           {8, torch::nn::AnyValue(torch::Tensor())},
                           {9, torch::nn::AnyValue(BlockMask())})

 public:
  /// Checks the options and (re)creates every parameter.
  void reset() override;

  /// Initialises the parameters as PyTorch's _reset_parameters.
  void reset_parameters();

  /// Prints e.g. `mha::MultiHeadAttention(embed_dim=8, num_heads=2)`, adding
  /// only the options that differ from their defaults.
  void pretty_print(std::ostream& stream) const override;

  /// Features of key (kdim, or embed_dim when unset).
  int64_t kdim() const;
  /// Features of value (vdim, or embed_dim when unset).
  int64_t vdim() const;
  /// Key/value heads (num_kv_heads, or num_heads when unset).
  int64_t num_kv_heads() const;
  /// True when Q, K and V share the packed in_proj_weight (kdim == vdim == E,
  /// num_kv_heads == num_heads, num_heads · head_dim == E and no
  /// output_gate).
  bool packed_in_proj() const;

  /// The options this module was constructed with.
  MultiHeadAttentionOptions options;
  /// D: options.head_dim, or E / H when unset.
  int64_t head_dim = 0;

  torch::Tensor in_proj_weight;          ///< (3E, E) when packed_in_proj()
  torch::Tensor q_proj_weight;           ///< (E, E) when !packed_in_proj()
  torch::Tensor k_proj_weight;           ///< (Ekv, kdim) when !packed_in_proj()
  torch::Tensor v_proj_weight;           ///< (Ekv, vdim) when !packed_in_proj()
  torch::Tensor in_proj_bias;            ///< (E + 2 Ekv) when bias
  torch::Tensor bias_k;                  ///< (1, 1, Ekv) when add_bias_kv
  torch::Tensor bias_v;                  ///< (1, 1, Ekv) when add_bias_kv
  torch::nn::Linear out_proj = nullptr;  ///< E -> E
  /// position_bias kRelative: weight (relative_num_buckets, H), one learned
  /// bias per bucket and head (T5's name), initialised N(0, E^-1/2) as T5.
  torch::nn::Embedding relative_attention_bias = nullptr;
  /// qk_norm kPerHead / kFull: the query norm, weight (head_dim, or
  /// num_heads · head_dim for kFull), `q_norm.weight`; else null.
  NormWeight q_norm = nullptr;
  /// qk_norm kPerHead / kFull: the key norm, weight (head_dim, or
  /// num_kv_heads · head_dim for kFull), `k_norm.weight`; else null.
  NormWeight k_norm = nullptr;
  /// attention_sinks: (num_heads) logits, one per head.
  torch::Tensor sinks;

  /// kLinformer: E (projected_length, max_length), the projection of the
  /// keys along the sequence (and of the values when share_kv_projection),
  /// initialised as the authors' fairseq code: xavier_uniform, gain 1/√2.
  torch::Tensor proj_k;
  /// kLinformer without share_kv_projection: F (projected_length,
  /// max_length), the values' projection.
  torch::Tensor proj_v;
  /// kPerformer: the buffer (nb_features, head_dim) of orthogonal random
  /// features (mha::orthogonal_random_features from feature_seed), shared
  /// by the heads; in the state dict, so a loaded module reproduces the
  /// outputs of the saved one.
  torch::Tensor random_features;
  /// kPerformer: draws new random features from `seed` into
  /// random_features (same dtype and device) and records the seed in
  /// options.feature_seed (the paper redraws them during training; mha
  /// only on request). Throws c10::Error for another attention_kind.
  void redraw_features(uint64_t seed);
};

/// Holder of MultiHeadAttentionImpl (module semantics as torch::nn).
TORCH_MODULE(MultiHeadAttention);

}  // namespace mha
