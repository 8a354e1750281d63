// Internal: the gated delta rule of Gated DeltaNet (mha/gated_delta_net.h)
// on the CPU, chunk by chunk on mha's threads, with its backward. Not
// installed.
//
// Glossary: B items (batch x value heads), L length, dk / dv key / value
// head sizes, C chunk length, S the state (dk x dv).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>

namespace mha::detail {

/// The gated delta rule (Yang et al., "Gated Delta Networks", ICLR 2025;
/// transformers' torch_recurrent_gated_delta_rule without its
/// normalizations, which the caller applies): from the state S (dk x dv),
/// for t = 0 .. L - 1:
///   S <- exp(g_t) S;  S <- S + k_t (β_t (v_t - Sᵀ k_t))ᵀ;  o_t = Sᵀ q_t.
/// Computed in chunks of `chunk` tokens by the WY representation (the form
/// of transformers' torch_chunk_gated_delta_rule, without padding to whole
/// chunks): each item walks its chunks on one thread, every product a direct
/// gemm (core/blas_gemm.h), its temporaries one chunk's.
///
/// Shapes: q, k (B, L, dk), v (B, L, dv), g, beta (B, L), state (B, dk,
/// dv); CPU float32 or float64, one dtype. g <= 0 keeps every exponential
/// in range (the module's g is). Returns (o (B, L, dv), the final state (B,
/// dk, dv)), differentiable in all six inputs (first derivatives: the
/// backward walks the chunks from the end, recomputing each chunk from its
/// saved starting state).
std::pair<torch::Tensor, torch::Tensor> gated_delta_rule(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& g, const torch::Tensor& beta,
    const torch::Tensor& state, int64_t chunk);

/// True where gated_delta_rule and causal_conv_silu run: a CPU tensor of
/// float32 or float64.
bool gated_delta_rule_applies(const torch::Tensor& x);

/// SiLU of the causal depthwise convolution of Gated DeltaNet (transformers'
/// torch_causal_conv1d_update / Qwen3NextGatedDeltaNet's conv1d without
/// bias, then F.silu), channels last:
///   y[n, t, c] = silu(Σ_{j<K} w[c, j] · xc[n, t + j, c]),
/// xc = [context; x] along time (the K - 1 inputs before x, then x).
///
/// Shapes: x (N, T, ch), context (N, K - 1, ch), weight (ch, K); CPU
/// float32 or float64, one dtype. Returns y (N, T, ch), differentiable in
/// all three (first derivatives). One pass over x each way, on ATen's
/// threads by blocks of channels: no transposes, no SiLU temporaries
/// (core/delta_net_parts.cpp).
torch::Tensor causal_conv_silu(const torch::Tensor& x,
                               const torch::Tensor& context,
                               const torch::Tensor& weight);

/// Gated DeltaNet's gated RMSNorm per head (transformers'
/// Qwen3NextRMSNormGated), fused:
///   y[n, t, h, :] = o[n, h, t, :] · rsqrt(mean(o[n, h, t, :]²) + eps)
///                   · weight · silu(z[n, t, h, :]).
/// Shapes: o (N, H, T, d) (gated_delta_rule's items), z (N, T, H, d),
/// weight (d); CPU float32 or float64, one dtype (core/delta_net_parts.cpp).
/// Returns y (N, T, H, d), differentiable in o, z and weight (first
/// derivatives).
torch::Tensor gated_rms_norm(const torch::Tensor& o, const torch::Tensor& z,
                             const torch::Tensor& weight, double eps);

}  // namespace mha::detail
