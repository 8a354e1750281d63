// Internal: causal self-attention of MultiHeadAttention's kLinear and
// kPerformer a segment of rows at a time (linear_attention_segments.cpp),
// in inference and in training (checkpointed), and the two pieces of the
// kinds' forward (linear_attention_module.cpp) a segment is made of. Not
// installed.
//
// Glossary: N batch, L sequence length, S key length, E embed_dim, H
// num_heads, Hkv num_kv_heads, D head_dim.
#pragma once

#include <torch/torch.h>

#include <cstdint>

#include "core/linear_attention_core.h"
#include "mha/multi_head_attention.h"

namespace mha::detail {

/// kLinear / kPerformer over q (N, H, L, D), k, v (N, Hkv, S, D): the sums
/// of linear attention, grown from `sums` (a decoding state or empty);
/// `sums_out` receives the sums after the keys. padding: (N, S), bool
/// (true = blocked) or floating (key j's terms times exp(padding_j), as an
/// added score multiplies exp(score)), or undefined. Returns (N, H, L, D).
/// (linear_attention_module.cpp)
torch::Tensor attend_with_sums(const MultiHeadAttentionImpl& m,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& padding, bool causal,
                               const LinearSums& sums, LinearSums* sums_out);

/// out_proj of the heads (N, H, L, D): (N, L, E).
/// (linear_attention_module.cpp)
torch::Tensor out_projection(const MultiHeadAttentionImpl& m,
                             const torch::Tensor& heads);

/// kLinear / kPerformer causal self-attention for inference, the whole
/// forward a segment of rows at a time, the sums carried from one to the
/// next as forward_cached carries them from call to call: only the output
/// (N, L, E) is as long as the sequence, no projection, feature or head
/// tensor is (at L = 64k, E = 256, 4 heads, the Performer's 266 features:
/// the forward's peak 1430 -> 102 MiB, and the page faults of that memory
/// cost more than its arithmetic on this project's VM; see docs/linear.md).
/// x (N, L, E), padding (N, L) or undefined, positions (N, L) or
/// undefined, rows per segment. Returns (N, L, E).
torch::Tensor causal_forward_by_segments(const MultiHeadAttentionImpl& m,
                                         const torch::Tensor& x,
                                         const torch::Tensor& padding,
                                         const torch::Tensor& positions,
                                         int64_t rows);

/// Whether kLinear / kPerformer causal self-attention of L rows trains by
/// segments of `rows` (checkpointed_forward_by_segments): with autograd,
/// longer than a segment, the module owned by a shared_ptr (a
/// ModuleHolder) so that the backward can keep it, φ the built-in one (a
/// custom feature map may hold parameters the checkpoint would not see),
/// and padding not itself requiring a gradient.
bool trains_by_segments(const MultiHeadAttentionImpl& m, int64_t L,
                        int64_t rows, const torch::Tensor& padding);

/// kLinear / kPerformer causal self-attention with autograd, a segment at
/// a time and checkpointed (Chen et al., 2016, "Training Deep Nets with
/// Sublinear Memory Cost"; what torch.utils.checkpoint does for a Python
/// function, here per segment with the sums carried between them): the
/// forward runs causal_forward_by_segments without a graph, keeping only
/// the sums at each segment's start; the backward walks the segments from
/// the last, recomputes each one's forward with a graph from its rows and
/// starting sums, and takes its gradients (of its rows, the parameters and
/// its starting sums) from those of its output and of the sums after it,
/// which the segment after handed back. Memory: one segment's graph
/// instead of the whole sequence's, for one more forward. First
/// derivatives only (create_graph=true is an error in the backward); a
/// parameter or the Performer's features changed in place before the
/// backward is an error too. Arguments as causal_forward_by_segments; the
/// module must pass trains_by_segments.
torch::Tensor checkpointed_forward_by_segments(MultiHeadAttentionImpl& m,
                                               const torch::Tensor& x,
                                               const torch::Tensor& padding,
                                               const torch::Tensor& positions,
                                               int64_t rows);

}  // namespace mha::detail
