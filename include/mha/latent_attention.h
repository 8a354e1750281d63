// Multi-head Latent Attention (MLA): DeepSeek-V2 (DeepSeek-AI, 2024,
// "DeepSeek-V2: A Strong, Economical, and Efficient Mixture-of-Experts
// Language Model", section 2.1) and DeepSeek-V3 / Kimi K2. Semantics and
// parameter names: transformers 5.x's DeepseekV3Attention
// (models/deepseek_v3/modeling_deepseek_v3.py).
//
// Queries, keys and values come from low-rank latents: a query latent
// (q_lora_rank, RMSNorm) and one key/value latent c (kv_lora_rank, RMSNorm)
// per token, shared by every head, plus a rotary key part (qk_rope_head_dim)
// also shared by every head. Decoding caches only c and the rotated key
// part: kv_lora_rank + qk_rope_head_dim numbers per token (576 in V3) instead
// of 2 · heads · head_dim.
//
// Glossary: N batch, L (T) query length, S key length (cache length + T),
// E embed_dim, H num_heads, r kv_lora_rank, dn qk_nope_head_dim, dr
// qk_rope_head_dim, dv v_head_dim, dq = dn + dr.
#pragma once

#include <torch/torch.h>

#include "mha/multi_head_attention.h"
#include "mha/positions.h"

namespace mha {

/// Options for MultiHeadLatentAttention; names as DeepseekV3Config's keys.
struct MultiHeadLatentAttentionOptions {
  /// embed_dim: E (config hidden_size); num_heads: H.
  MultiHeadLatentAttentionOptions(int64_t embed_dim, int64_t num_heads);

  /// Model width E (> 0).
  TORCH_ARG(int64_t, embed_dim);
  /// Heads H (> 0).
  TORCH_ARG(int64_t, num_heads);
  /// Rank of the query latent (q_a_proj, q_a_layernorm, q_b_proj); 0: a
  /// plain q_proj (DeepSeek-V2-Lite). Default 1536 (V3).
  TORCH_ARG(int64_t, q_lora_rank) = 1536;
  /// r: rank of the key/value latent (> 0). Default 512.
  TORCH_ARG(int64_t, kv_lora_rank) = 512;
  /// dn: per-head query/key features without rotary (>= 0). Default 128.
  TORCH_ARG(int64_t, qk_nope_head_dim) = 128;
  /// dr: rotary query/key features, the key's shared by all heads (even,
  /// > 0). Default 64.
  TORCH_ARG(int64_t, qk_rope_head_dim) = 64;
  /// dv: per-head value features (> 0). Default 128.
  TORCH_ARG(int64_t, v_head_dim) = 128;
  /// Biases on q_a_proj, kv_a_proj_with_mqa and o_proj (config
  /// attention_bias). Default false.
  TORCH_ARG(bool, bias) = false;
  /// Epsilon of q_a_layernorm and kv_a_layernorm. Default 1e-6: the value
  /// transformers' DeepseekV3Attention constructs them with (it does not
  /// pass config.rms_norm_eps).
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// Base of the rotary frequencies. Default 10000.
  TORCH_ARG(double, rotary_theta) = 10000.0;
  /// kInterleaved (default: config rope_interleave true, V3's layout) or
  /// kHalf.
  TORCH_ARG(RotaryPairing, rotary_pairing) = RotaryPairing::kInterleaved;
  /// Scaling of the rotary frequencies (yarn in V3), as MultiHeadAttention's.
  TORCH_ARG(RotaryScaling, rotary_scaling) = {};
  /// Softmax scale. nullopt (default): dq^-1/2, times mscale² where
  /// rotary_scaling is not "default" and has mscale_all_dim (yarn's
  /// 0.1 · mscale_all_dim · ln(factor) + 1, as DeepseekV3Attention).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
  /// true: inputs (N, L, E); false: (L, N, E). Default true.
  TORCH_ARG(bool, batch_first) = true;
};

/// The decoding cache of MultiHeadLatentAttention: per token, the
/// normalised key/value latent (r) and the rotated key part (dr), nothing
/// per head. Positions are recorded for the position rules of later calls.
class LatentCache {
 public:
  /// An empty cache for batch_size sequences, `capacity` tokens, latents
  /// of kv_lora_rank and rotary keys of qk_rope_head_dim, with `options`'
  /// dtype and device. c10::Error for sizes < 1 (capacity may be 0).
  LatentCache(int64_t batch_size, int64_t capacity, int64_t kv_lora_rank,
              int64_t qk_rope_head_dim,
              const torch::TensorOptions& options = {});

  /// Tokens held.
  int64_t size() const { return size_; }
  /// Tokens it can hold.
  int64_t capacity() const { return latent_.size(1); }
  /// N.
  int64_t batch_size() const { return latent_.size(0); }
  /// Numbers stored per token and sequence: kv_lora_rank + qk_rope_head_dim.
  int64_t numbers_per_token() const {
    return latent_.size(2) + rotary_key_.size(2);
  }
  /// (N, size, r): the normalised latents held.
  torch::Tensor latent() const { return latent_.narrow(1, 0, size_); }
  /// (N, size, dr): the rotated key parts held.
  torch::Tensor rotary_key() const { return rotary_key_.narrow(1, 0, size_); }
  /// (N, size) int64: the position of each token held.
  torch::Tensor positions() const { return positions_.narrow(1, 0, size_); }
  /// Appends latent (N, T, r), rotary_key (N, T, dr) and positions (N, T);
  /// c10::Error without room or for other shapes, dtype or device.
  void append(const torch::Tensor& latent, const torch::Tensor& rotary_key,
              const torch::Tensor& positions);
  /// Empties the cache (the buffers stay).
  void clear() { size_ = 0; }

 private:
  torch::Tensor latent_, rotary_key_, positions_;
  int64_t size_ = 0;
};

/// How MultiHeadLatentAttention::forward_cached attends.
enum class LatentPath {
  kAuto,      ///< the cheaper of the two for the call's sizes (default)
  kNaive,     ///< keys and values up-projected from every cached latent
  kAbsorbed,  ///< kv_b_proj absorbed into the query and the output: one
              ///< shared key/value head of the latents (r + dr features)
};

/// Multi-head Latent Attention (see the file comment).
///
/// Parameters (transformers' names): q_proj.weight (H·dq, E) when
/// q_lora_rank is 0, else q_a_proj.weight (q_lora_rank, E) [+ .bias],
/// q_a_layernorm.weight (q_lora_rank), q_b_proj.weight (H·dq, q_lora_rank);
/// kv_a_proj_with_mqa.weight (r + dr, E) [+ .bias], kv_a_layernorm.weight
/// (r), kv_b_proj.weight (H·(dn + dv), r); o_proj.weight (E, H·dv) [+
/// .bias]. Linear layers initialised as torch::nn::Linear, norms to ones.
class MultiHeadLatentAttentionImpl
    : public torch::nn::Cloneable<MultiHeadLatentAttentionImpl> {
 public:
  /// Builds the module; c10::Error naming the option for invalid ones.
  explicit MultiHeadLatentAttentionImpl(
      const MultiHeadLatentAttentionOptions& options_);

  /// Self-attention of x (N, L, E) ((L, N, E) if !batch_first).
  ///   key_padding_mask: bool (N, L), true = padding, or undefined.
  ///   is_causal: token i sees tokens j <= i (default true, as DeepSeek).
  ///   positions: int64 (N, L) or (L), the rotary positions; default 0..L-1.
  /// Returns the output, x's shape. A query row that sees no key gives
  /// o_proj's bias. c10::Error naming the argument for wrong shapes, dtypes
  /// or devices.
  torch::Tensor forward(const torch::Tensor& x,
                        const torch::Tensor& key_padding_mask = {},
                        bool is_causal = true,
                        const torch::Tensor& positions = {});

  /// Incremental decoding: x (N, T, E) ((T, N, E) if !batch_first); its
  /// latents and rotated keys are appended to `cache` (positions P =
  /// cache.size() ... before the call, or `positions` (N, T)), and token t
  /// attends to the cache and the new tokens up to itself (is_causal) or
  /// all of them. key_padding_mask: bool (N, P + T), true = padding, over
  /// the cached and the new tokens. `path` chooses how (LatentPath); both
  /// paths give the same result within rounding. Equal, within rounding, to
  /// forward on the whole sequence restricted to the new rows. Returns the
  /// output, x's shape. c10::Error as forward, and for a cache of another
  /// batch size, rank, dtype or device, or without room for T tokens.
  torch::Tensor forward_cached(const torch::Tensor& x, LatentCache& cache,
                               bool is_causal = true,
                               const torch::Tensor& key_padding_mask = {},
                               const torch::Tensor& positions = {},
                               LatentPath path = LatentPath::kAuto);

  /// An empty LatentCache for this module: batch_size sequences, capacity
  /// tokens, the parameters' dtype and device.
  LatentCache make_cache(int64_t batch_size, int64_t capacity) const;

  /// The path forward_cached takes with LatentPath::kAuto for T new tokens
  /// and S keys in all: kAbsorbed when its multiply-adds, H·T·(S·(2r + dr)
  /// + (dn + dv)·r), are fewer than the naive path's, S·r·H·(dn + dv) +
  /// H·T·S·(dq + dv).
  LatentPath auto_path(int64_t T, int64_t S) const;

  /// The softmax scale in use (options.scale, else as documented there).
  double softmax_scale() const;

  /// Checks the options and (re)creates every parameter.
  void reset() override;

  /// Prints the options that differ from their defaults.
  void pretty_print(std::ostream& stream) const override;

  /// The options this module was built with.
  MultiHeadLatentAttentionOptions options;

  torch::nn::Linear q_proj = nullptr;    ///< (H·dq, E) when q_lora_rank is 0
  torch::nn::Linear q_a_proj = nullptr;  ///< (q_lora_rank, E)
  NormWeight q_a_layernorm = nullptr;    ///< (q_lora_rank)
  torch::nn::Linear q_b_proj = nullptr;  ///< (H·dq, q_lora_rank)
  torch::nn::Linear kv_a_proj_with_mqa = nullptr;  ///< (r + dr, E)
  NormWeight kv_a_layernorm = nullptr;             ///< (r)
  torch::nn::Linear kv_b_proj = nullptr;           ///< (H·(dn + dv), r)
  torch::nn::Linear o_proj = nullptr;              ///< (E, H·dv)
};

/// Holder of MultiHeadLatentAttentionImpl.
TORCH_MODULE(MultiHeadLatentAttention);

}  // namespace mha
