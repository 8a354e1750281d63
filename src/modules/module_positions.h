// Internal: the position rules of MultiHeadAttention (causal, window,
// position bias, rotary) at default or explicit token positions, shared by
// forward and forward_cached. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "core/attention_core.h"
#include "mha/multi_head_attention.h"

namespace mha::detail {

/// The position rules of the module's options for L queries, query row 0
/// at key position `diagonal`, and S keys: causal, window and the position
/// bias per diagonal (attention_core.h's KeyPositions).
KeyPositions key_positions(const MultiHeadAttentionImpl& m, int64_t L,
                           int64_t S, int64_t diagonal, bool causal,
                           const torch::TensorOptions& options);

/// With the rotary option, q (N, H, L, D) and k (N, Hkv, S, D) rotated in
/// place of the originals: at q_positions / k_positions, int64 (N, L) /
/// (N, S), or where undefined row t at offset + t; otherwise unchanged.
void rotate_heads(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                  torch::Tensor& k, const torch::Tensor& q_positions,
                  const torch::Tensor& k_positions, int64_t offset);

/// Checks `positions` of forward (self-attention: (N, L) or (L); unbatched
/// (L)) or forward_cached ((N, T) or (T)) and returns it as (N, L) int64,
/// or undefined when undefined. `who` starts the messages.
torch::Tensor positions_2d(const torch::Tensor& positions, int64_t N, int64_t L,
                           bool batched, const torch::Device& device,
                           const char* who);

/// The module's window, attention chunks and position bias at explicit
/// positions, as an additive mask (N, H or 1, L, S) of `dtype`: key j of
/// sequence n blocked where k_positions[n][j] - q_positions[n][i] <=
/// -window (and >= window when not causal; causality itself follows the
/// token order and is left to the core) or where the two positions lie in
/// different chunks of attention_chunk_size, ALiBi's -m_h |distance| or
/// T5's bucket bias added. Undefined when the module has none of them.
torch::Tensor position_rules_mask(const MultiHeadAttentionImpl& m,
                                  const torch::Tensor& q_positions,
                                  const torch::Tensor& k_positions, bool causal,
                                  torch::ScalarType dtype);

}  // namespace mha::detail
