// Internal: the input side of MultiHeadAttention (multi_head_attention.cpp)
// — the checks of forward's and the projected-key/value methods' arguments,
// their batch-first layout, attn_mask's 4-D view, the input projection and
// the head split. Not installed.
//
// Glossary: N batch, L target (query) length, S source (key) length, E
// embed_dim, H num_heads, D head_dim = E / H, T any length.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "mha/multi_head_attention.h"

namespace mha::detail {

/// Inputs brought to the batched, batch-first layout.
struct BatchFirstInputs {
  torch::Tensor query;             // (N, L, E)
  torch::Tensor key;               // (N, S, kdim)
  torch::Tensor value;             // (N, S, vdim)
  torch::Tensor key_padding_mask;  // (N, S) or undefined
  bool batched = true;
};

/// Q, K and V after the input projection.
struct Projected {
  torch::Tensor q;  // (N, L, E)
  torch::Tensor k;  // (N, S, E)
  torch::Tensor v;  // (N, S, E)
  // Self-attention's one projection (N, L, 3E), of which q, k and v are
  // disjoint views (attention_core's `packed`), or undefined.
  torch::Tensor packed;
};

/// (N, T, E) → (N, H, T, D), a view.
torch::Tensor split_heads(const torch::Tensor& x, int64_t num_heads);

/// Rows [start, start + count) of t, or t itself when undefined (no bias).
torch::Tensor rows_of(const torch::Tensor& t, int64_t start, int64_t count);

/// Checks the inputs of forward (layout, features, dtype and device against
/// the parameters', batch size, key_padding_mask (N, S) or (S)) and brings
/// them to (N, T, features); undefined key and value mean self-attention.
/// Raises c10::Error naming the argument, what it got and what it expected.
BatchFirstInputs to_batch_first(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& query,
                                const torch::Tensor& key_in,
                                const torch::Tensor& value_in,
                                const torch::Tensor& key_padding_mask);

/// Checks attn_mask (bool or the query's dtype, (L, S) or
/// (N·num_heads, L, S), (num_heads, L, S) unbatched) and views it as
/// (L, S) or (N, H, L, S); undefined stays undefined.
torch::Tensor attn_mask_4d(const torch::Tensor& attn_mask, int64_t N, int64_t H,
                           int64_t L, int64_t S, bool batched,
                           torch::ScalarType dtype,
                           const torch::Device& device);

/// The input projection of batch-first query (N, L, E), key (N, S, kdim),
/// value (N, S, vdim): one GEMM for self-attention (its output kept as
/// Projected::packed), two when key is value, else three.
Projected project_inputs(const MultiHeadAttentionImpl& m,
                         const torch::Tensor& query, const torch::Tensor& key,
                         const torch::Tensor& value, bool self_attention,
                         bool key_is_value);

/// project_key_value and forward_projected take no option that places keys
/// at positions or appends key rows: raises c10::Error naming the option
/// and `caller` otherwise.
void check_projectable(const MultiHeadAttentionImpl& m, const char* caller);

/// x (N, L, E), or (L, N, E) when !batch_first, with `weight`'s dtype and
/// device, as (N, L, E): the input of the sequence modules
/// (MultiHeadLatentAttention, GatedDeltaNet). c10::Error starting with `who`
/// otherwise.
torch::Tensor sequence_input(const torch::Tensor& x, int64_t embed_dim,
                             bool batch_first, const torch::Tensor& weight,
                             const char* who);

/// x (N, T, F) in the module's layout ((T, N, F) if !batch_first, (T, F)
/// unbatched) as (N, T, F), after the checks of forward for `name` (F =
/// `features`, called `feature_name` in the error).
torch::Tensor batch_first_input(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& x, const char* name,
                                int64_t features, const char* feature_name);

}  // namespace mha::detail
