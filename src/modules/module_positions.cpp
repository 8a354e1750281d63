// The position rules of MultiHeadAttention (module_positions.h): causal,
// window and position bias per diagonal or, at explicit positions, as a
// dense mask; the rotary embedding of the heads.
//
// Glossary: N batch, H num_heads, Hkv num_kv_heads, L query length, S key
// length, D head_dim.
#include "modules/module_positions.h"

#include <limits>
#include <string>

#include "mha/positions.h"

namespace mha::detail {

/// The position rules of the module's options for L queries, query row 0
/// at key position `diagonal`, and S keys: causal, window and the position
/// bias per diagonal (attention_core.h's KeyPositions).
KeyPositions key_positions(const MultiHeadAttentionImpl& m, int64_t L,
                           int64_t S, int64_t diagonal, bool causal,
                           const torch::TensorOptions& options) {
  KeyPositions positions(causal);
  positions.diagonal = diagonal;
  positions.window = m.options.window().value_or(0);
  const auto kind = m.options.position_bias();
  if (kind == PositionBias::kNone) {
    return positions;
  }
  // Entry k of a (H, L + S - 1) row is the diagonal j - i = k - (L - 1),
  // the relative position key - query = k - (L - 1) - diagonal.
  const auto index = options.dtype(torch::kLong);
  auto relative = torch::arange(L + S - 1, index) - (L - 1 + diagonal);
  if (kind == PositionBias::kAlibi) {
    auto slopes = alibi_slopes(m.options.num_heads(), options);  // (H)
    positions.relative_bias =
        -slopes.unsqueeze(1) * relative.abs().to(options.dtype()).unsqueeze(0);
  } else {
    auto buckets = relative_position_bucket(
        relative, m.options.relative_bidirectional(),
        m.options.relative_num_buckets(), m.options.relative_max_distance());
    positions.relative_bias =  // (L+S-1, H) → (H, L+S-1)
        m.relative_attention_bias->weight.index_select(0, buckets).t();
  }
  return positions;
}

/// With the rotary option, q (N, H, L, D) and k (N, Hkv, S, D) rotated in
/// place of the originals: at q_positions / k_positions, int64 (N, L) /
/// (N, S), or where undefined row t at offset + t; otherwise unchanged.
void rotate_heads(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                  torch::Tensor& k, const torch::Tensor& q_positions,
                  const torch::Tensor& k_positions, int64_t offset) {
  if (!m.options.rotary()) {
    return;
  }
  const bool plain = !m.options.rotary_dim().has_value() &&
                     m.options.rotary_scaling().rope_type == "default";
  const auto rotate = [&](const torch::Tensor& x,
                          const torch::Tensor& positions) {
    if (plain && !positions.defined()) {
      return rotary_embedding(x, offset, m.options.rotary_theta(),
                              m.options.rotary_pairing());
    }
    const auto at = positions.defined()
                        ? positions
                        : torch::arange(offset, offset + x.size(2),
                                        x.options().dtype(torch::kLong));
    return rotary_embedding_at(
        x, at, m.options.rotary_theta(), m.options.rotary_pairing(),
        m.options.rotary_dim(), m.options.rotary_scaling());
  };
  q = rotate(q, q_positions);
  k = rotate(k, k_positions);
}

/// Checks `positions` of forward (self-attention: (N, L) or (L); unbatched
/// (L)) or forward_cached ((N, T) or (T)) and returns it as (N, L) int64,
/// or undefined when undefined.
torch::Tensor positions_2d(const torch::Tensor& positions, int64_t N, int64_t L,
                           bool batched, const torch::Device& device,
                           const char* who) {
  if (!positions.defined()) {
    return positions;
  }
  TORCH_CHECK(positions.scalar_type() == torch::kLong, who,
              ": positions must be int64, but got dtype ",
              positions.scalar_type());
  TORCH_CHECK(positions.device() == device, who,
              ": positions must be on query's device ", device,
              ", but got device ", positions.device());
  const bool one_row = positions.dim() == 1 && positions.size(0) == L;
  const bool per_sequence = batched && positions.dim() == 2 &&
                            positions.size(0) == N && positions.size(1) == L;
  TORCH_CHECK(one_row || per_sequence, who, ": positions must be ",
              batched ? "(N, L) = (" + std::to_string(N) + ", " +
                            std::to_string(L) + ") or (L) = ("
                      : std::string("(L) = ("),
              L, ") for query's N and L (the new tokens), but got ",
              positions.sizes());
  return one_row ? positions.unsqueeze(0).expand({N, L}) : positions;
}

/// The module's window and position bias at explicit positions, as an
/// additive mask (N, H or 1, L, S) of `dtype`: key j of sequence n blocked
/// where k_positions[n][j] - q_positions[n][i] <= -window (and >= window
/// when not causal; causality itself follows the token order and is left to
/// the core), ALiBi's -m_h |distance| or T5's bucket bias added. Undefined
/// when the module has neither.
torch::Tensor position_rules_mask(const MultiHeadAttentionImpl& m,
                                  const torch::Tensor& q_positions,
                                  const torch::Tensor& k_positions, bool causal,
                                  torch::ScalarType dtype) {
  const auto kind = m.options.position_bias();
  const auto chunk = m.options.attention_chunk_size();
  if (!m.options.window().has_value() && kind == PositionBias::kNone &&
      !chunk.has_value()) {
    return torch::Tensor();
  }
  const auto options = q_positions.options().dtype(dtype);
  auto relative =  // key - query: (N, 1, S) - (N, L, 1) → (N, L, S)
      k_positions.unsqueeze(1) - q_positions.unsqueeze(2);
  const int64_t N = relative.size(0), L = relative.size(1),
                S = relative.size(2);
  auto mask = torch::zeros({N, 1, L, S}, options);  // (N, 1, L, S)
  if (m.options.window().has_value()) {
    const int64_t window = *m.options.window();
    auto blocked = relative.le(-window);
    if (!causal) {
      blocked = blocked.logical_or(relative.ge(window));
    }
    mask.masked_fill_(blocked.unsqueeze(1),
                      -std::numeric_limits<double>::infinity());
  }
  if (chunk.has_value()) {
    // Llama 4: only keys of the query's chunk of positions.
    auto chunk_of = [&](const torch::Tensor& p) {
      return torch::div(p, *chunk, "floor");
    };
    auto other = chunk_of(k_positions)
                     .unsqueeze(1)
                     .ne(chunk_of(q_positions).unsqueeze(2));  // (N, L, S)
    mask.masked_fill_(other.unsqueeze(1),
                      -std::numeric_limits<double>::infinity());
  }
  if (kind == PositionBias::kAlibi) {
    auto slopes = alibi_slopes(m.options.num_heads(), options);  // (H)
    mask = mask - slopes.view({1, -1, 1, 1}) *
                      relative.abs().to(dtype).unsqueeze(1);  // (N, H, L, S)
  } else if (kind == PositionBias::kRelative) {
    auto buckets = relative_position_bucket(
        relative, m.options.relative_bidirectional(),
        m.options.relative_num_buckets(),
        m.options.relative_max_distance());  // (N, L, S)
    auto bias =
        m.relative_attention_bias->weight.index_select(0, buckets.flatten())
            .view({N, L, S, -1});              // (N, L, S, H)
    mask = mask + bias.permute({0, 3, 1, 2});  // (N, H, L, S)
  }
  return mask;
}

}  // namespace mha::detail
