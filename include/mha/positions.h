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
#pragma once

#include <torch/torch.h>

namespace mha {

/// Which features of a head rotary position embedding rotates together.
enum class RotaryPairing {
  kHalf,         ///< feature i with feature i + D/2 (GPT-NeoX, Llama in HF)
  kInterleaved,  ///< feature 2i with feature 2i + 1 (the paper, GPT-J)
};

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
