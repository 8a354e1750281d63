// Position information for attention: rotary position embedding (RoPE),
// ALiBi's linear biases and T5's bucketed relative positions.
//
// Semantics:
//   * RoPE: "RoFormer: Enhanced Transformer with Rotary Position Embedding"
//     (Su et al., 2021), section 3.4; the half-split pairing is the one of
//     GPT-NeoX and of Llama in Hugging Face transformers, the interleaved
//     one the paper's (and GPT-J's).
//   * ALiBi: "Train Short, Test Long: Attention with Linear Biases Enables
//     Input Length Extrapolation" (Press et al., 2022), section 3.
//   * T5: "Exploring the Limits of Transfer Learning with a Unified
//     Text-to-Text Transformer" (Raffel et al., 2020), section 2.1, with the
//     bucketing of the T5 code base and Hugging Face transformers.
//   * Rotary scaling (RotaryScaling): the `rope_scaling` / `rope_parameters`
//     of Hugging Face transformers 5.x, src/transformers/modeling_rope_utils.py
//     (ROPE_INIT_FUNCTIONS and dynamic_rope_update), with the papers it cites:
//     linear position interpolation (Chen et al., 2023), dynamic NTK scaling
//     (/u/bloc97 and /u/emozilla), YaRN (Peng et al., 2023), LongRoPE (Ding
//     et al., 2024) and Llama 3.1's frequency smoothing.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mha {

/// Which features of a head rotary position embedding rotates together.
enum class RotaryPairing {
  kHalf,         ///< feature i with feature i + D/2 (GPT-NeoX, Llama in HF)
  kInterleaved,  ///< feature 2i with feature 2i + 1 (the paper, GPT-J)
};

/// How a model scales the rotary frequencies beyond its training length: a
/// plain struct whose fields are named as the keys of Hugging Face's
/// `rope_scaling` (transformers 4.x) / `rope_parameters` (5.x), with the
/// meaning and defaults of transformers 5.x's modeling_rope_utils.py.
/// rotary_theta and rotary_dim (MultiHeadAttentionOptions) are that dict's
/// rope_theta and partial_rotary_factor · head_dim.
///
/// rope_type (R = rotary_dim features rotated, i in [0, R/2), w_i =
/// theta^(-2i / R) the unscaled inverse frequencies, O =
/// original_max_position_embeddings, M = max_position_embeddings):
///   "default"   w_i; no other field is read.
///   "linear"    w_i / factor (position interpolation).
///   "dynamic"   NTK-aware: with s = 1 + the largest position of the call
///               (over the whole batch, as HF's max(position_ids) + 1), s > M
///               gives w_i for the base theta · (factor · s / M - (factor -
///               1))^(R / (R - 2)); s <= M gives w_i. Needs M (or O) > 0.
///   "yarn"      w_i blended with w_i / factor by a linear ramp over the
///               frequency index between the correction dims of beta_fast
///               and beta_slow rotations within O positions (floor/ceil when
///               truncate); cos and sin times attention_factor, default
///               mscale and mscale_all_dim as HF, else 0.1 ln(factor) + 1
///               (1 for factor <= 1).
///   "longrope"  w_i / long_factor[i] when s > O, else w_i /
///               short_factor[i] (both R/2 entries); cos and sin times
///               attention_factor, default sqrt(1 + ln(factor) / ln(O)) (1
///               for factor <= 1).
///   "llama3"    w_i kept where the wavelength 2π / w_i < O /
///               high_freq_factor, w_i / factor where it is > O /
///               low_freq_factor, smoothly interpolated between.
/// Every type but "default" and "dynamic" rotates every position with the
/// same frequencies; "dynamic" and "longrope" depend on s, and mha computes
/// them afresh for every call from that call's positions (HF's module keeps
/// the last grown frequencies until a longer call: the two agree whenever
/// positions do not shrink between calls, as in generation). In cached
/// decoding the cache keeps each key as rotated when it was appended, as
/// HF's DynamicCache does.
struct RotaryScaling {
  /// "default", "linear", "dynamic", "yarn", "longrope" or "llama3"
  /// (HF: rope_type, or type in old configs). Others give a c10::Error.
  std::string rope_type = "default";
  /// The context extension factor (HF: factor). Used by linear, dynamic,
  /// yarn, llama3, and by longrope's default attention_factor. HF takes
  /// max_position_embeddings / original_max_position_embeddings for yarn and
  /// longrope configs without a factor: set it so (mha::hf does).
  double factor = 1.0;
  /// The pretraining context length O (HF: original_max_position_embeddings)
  /// of yarn, longrope and llama3. 0: max_position_embeddings below, as HF's
  /// standardize_rope_params.
  int64_t original_max_position_embeddings = 0;
  /// llama3: wavelengths above O / low_freq_factor are scaled by 1/factor.
  double low_freq_factor = 1.0;
  /// llama3: wavelengths below O / high_freq_factor are kept.
  double high_freq_factor = 4.0;
  /// yarn: rotations where the ramp starts extrapolating (0: 32, as HF).
  double beta_fast = 32.0;
  /// yarn: rotations where the ramp ends interpolating (0: 1, as HF).
  double beta_slow = 1.0;
  /// yarn and longrope: the factor on cos and sin (HF: attention_factor; it
  /// scales q·k by its square). Unset: the rope type's own formula above.
  std::optional<double> attention_factor;
  /// longrope: per-frequency divisors for s <= O, R/2 entries.
  std::vector<double> short_factor;
  /// longrope: per-frequency divisors for s > O, R/2 entries.
  std::vector<double> long_factor;
  /// yarn (DeepSeek): with mscale_all_dim, attention_factor defaults to
  /// (0.1 mscale ln(factor) + 1) / (0.1 mscale_all_dim ln(factor) + 1).
  /// Unset or 0: not used (HF's truthiness test).
  std::optional<double> mscale;
  /// yarn: see mscale.
  std::optional<double> mscale_all_dim;
  /// yarn: floor / ceil the correction range (HF: truncate, default true).
  bool truncate = true;
  /// The model's max_position_embeddings M (config.json, not a key of
  /// rope_scaling): dynamic's threshold, and O where O is 0. 0: unknown.
  int64_t max_position_embeddings = 0;
};

/// The rotary frequencies of one call: inverse frequencies and the factor on
/// cos and sin.
struct RotaryFrequencies {
  torch::Tensor inv_freq;         ///< float64 (rotary_dim / 2), CPU
  double attention_factor = 1.0;  ///< multiplies cos and sin
};

/// The inverse frequencies and attention factor of `scaling` (see
/// RotaryScaling) for rotary_dim rotated features with base theta, for a
/// call whose largest position is seq_len - 1 (read by "dynamic" and
/// "longrope" only). Computed in float64 (HF computes them in float32).
/// Throws c10::Error naming the field: an unknown rope_type, rotary_dim odd
/// or < 2, a bad theta or factor, O or M missing where needed, short_factor
/// / long_factor of another length than rotary_dim / 2.
RotaryFrequencies rotary_frequencies(int64_t rotary_dim, double theta = 10000.0,
                                     const RotaryScaling& scaling = {},
                                     int64_t seq_len = 0);

/// Checks `scaling` for rotary_dim rotated features as rotary_frequencies
/// does, without computing anything; `who` starts the message.
void check_rotary_scaling(const RotaryScaling& scaling, int64_t rotary_dim,
                          const char* who);

/// Rotary position embedding of x (..., T, D) at explicit positions: the
/// first rotary_dim features of each row (all of D when nullopt) rotated as
/// rotary_embedding below, row t of batch n at angle positions[n][t] · w_i
/// with w_i and the cos/sin factor from rotary_frequencies(rotary_dim,
/// theta, scaling, 1 + max(positions)); the other features pass unchanged
/// (GPT-J's rotary_dim, GPT-NeoX's rotary_pct). Angles, cos and sin in
/// float64, then x's dtype.
///
/// Args:
///   x: floating (N, ..., T, D) or (T, D).
///   positions: int64 (T), or (N, T) with N = x.size(0) for x of 3 or more
///     dims; any integers.
///   rotary_dim: even, 2 <= rotary_dim <= D; nullopt: D.
/// Throws c10::Error naming the argument for other shapes or dtypes.
torch::Tensor rotary_embedding_at(
    const torch::Tensor& x, const torch::Tensor& positions,
    double theta = 10000.0, RotaryPairing pairing = RotaryPairing::kHalf,
    c10::optional<int64_t> rotary_dim = c10::nullopt,
    const RotaryScaling& scaling = {});

/// Rotary position embedding of x (..., T, D), D even: row t sits at
/// position p = position_offset + t, and each feature pair (a, b) of
/// frequency index i in [0, D/2) becomes (a cos(p w_i) - b sin(p w_i),
/// a sin(p w_i) + b cos(p w_i)), w_i = theta^(-2i / D). Applied to queries
/// and keys, their dot product then depends on the positions only through
/// their difference. Angles, cosines and sines are computed in float64, then
/// rotate x in its own dtype. Differentiable; the result is a new tensor of
/// x's shape, dtype and device.
///
/// Args:
///   x: floating (..., T, D) with at least 2 dims and D even.
///   position_offset: position of row 0, >= 0 (for cached decoding: the
///     number of tokens before x).
///   theta: base of the frequencies, finite and > 0; 10000 as the paper.
///   pairing: kHalf (default) or kInterleaved.
/// Throws c10::Error naming the argument: fewer than 2 dims, odd D, a
/// non-floating dtype, a negative position_offset, a bad theta.
torch::Tensor rotary_embedding(const torch::Tensor& x,
                               int64_t position_offset = 0,
                               double theta = 10000.0,
                               RotaryPairing pairing = RotaryPairing::kHalf);

/// ALiBi's head slopes m_h, (H) with `options` (default float32): for H a
/// power of two, m_h = 2^(-8 (h + 1) / H), h = 0..H-1 (H = 8: 1/2, 1/4, ...,
/// 1/256). Otherwise, with P the largest power of two below H, the P slopes
/// for P heads followed by the slopes of even index 0, 2, 4, ... of 2P
/// heads, up to H (the paper's rule for other head counts).
/// Throws c10::Error when num_heads < 1.
torch::Tensor alibi_slopes(int64_t num_heads,
                           torch::TensorOptions options = {});

/// ALiBi's bias as a dense additive mask (H, L, S) with `options` (default
/// float32): [h][i][j] = -m_h · |i + query_offset - j|, m_h = alibi_slopes.
/// Causal attention sees j <= i + query_offset only, where this is the
/// paper's -m_h · (i - j); non-causal attention gets the symmetric
/// distance. query_offset places query row 0 at key position query_offset
/// (S - L: bottom-right, as in cached decoding). For
/// MultiHeadAttentionOptions::position_bias(PositionBias::kAlibi) the module
/// never builds this tensor (the attention core takes the bias per
/// diagonal); use it with attn_mask elsewhere.
/// Throws c10::Error when num_heads < 1 or L, S < 0.
torch::Tensor alibi_bias(int64_t num_heads, int64_t L, int64_t S,
                         int64_t query_offset = 0,
                         torch::TensorOptions options = {});

/// T5's bucket of each relative position (key position - query position),
/// int64 of relative_position's shape. With `bidirectional` (T5's encoder)
/// half the buckets are for keys after the query: num_buckets / 2 is added
/// for positive positions and the distance is |relative_position|; without
/// (T5's decoder) positive positions fall into bucket 0 with distance 0 and
/// the distance is -relative_position. Then, with n the buckets left and
/// max_exact = n / 2: a distance d < max_exact is its own bucket; larger
/// ones share logarithmically sized buckets, max_exact + floor(log(d /
/// max_exact) / log(max_distance / max_exact) · (n - max_exact)), at most
/// n - 1 (every distance from about max_distance on).
///
/// Args:
///   relative_position: integer tensor, any shape.
///   bidirectional: see above; T5's default true for the encoder.
///   num_buckets: buckets in all, >= 2 (>= 4 when bidirectional); T5: 32.
///   max_distance: where the largest bucket begins, > max_exact; T5: 128.
/// Throws c10::Error for a non-integer relative_position or bad counts.
torch::Tensor relative_position_bucket(const torch::Tensor& relative_position,
                                       bool bidirectional = true,
                                       int64_t num_buckets = 32,
                                       int64_t max_distance = 128);

}  // namespace mha
