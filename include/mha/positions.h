// Position information for attention: rotary position embedding (RoPE).
//
// Semantics: "RoFormer: Enhanced Transformer with Rotary Position
// Embedding" (Su et al., 2021), section 3.4; the half-split pairing is the
// one of GPT-NeoX and of Llama in Hugging Face transformers, the interleaved
// one the paper's (and GPT-J's).
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

}  // namespace mha
