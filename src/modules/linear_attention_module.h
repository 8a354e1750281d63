// Internal: MultiHeadAttention's linear-cost kinds (attention_kind kLinear,
// kPerformer, kLinformer; mha/linear_attention.h): their options, parameters
// and buffers, and the forward, forward_cached and forward_projected that
// multi_head_attention.cpp hands them at its top. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <ostream>
#include <tuple>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"

namespace mha::detail {

/// True when the module's attention_kind is not kSoftmax.
inline bool linear_kind(const MultiHeadAttentionImpl& m) {
  return m.options.attention_kind() != AttentionKind::kSoftmax;
}

/// reset()'s part: checks the kind's options against the others (c10::Error
/// naming the option) and registers proj_k, proj_v and random_features
/// where the kind has them (every kind: the members reset to undefined).
void reset_attention_kind(MultiHeadAttentionImpl& m);

/// reset_parameters()'s part: Linformer's projections, Performer's features.
void reset_attention_kind_parameters(MultiHeadAttentionImpl& m);

/// pretty_print's part: the kind and its options that differ from their
/// defaults (nothing for kSoftmax).
void print_attention_kind(const MultiHeadAttentionImpl& m,
                          std::ostream& stream);

/// MultiHeadAttention::forward for a linear-cost kind (same arguments).
std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward(
    MultiHeadAttentionImpl& m, const torch::Tensor& query,
    const torch::Tensor& key, const torch::Tensor& value,
    const torch::Tensor& key_padding_mask, bool need_weights,
    const torch::Tensor& attn_mask, bool average_attn_weights, bool is_causal,
    const torch::Tensor& positions);

/// MultiHeadAttention::forward_cached for kLinear / kPerformer: the
/// recurrent cache's state instead of keys and values.
std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward_cached(
    MultiHeadAttentionImpl& m, const torch::Tensor& query, KVCache& cache,
    bool is_causal, bool need_weights, bool average_attn_weights,
    const torch::Tensor& key_padding_mask, const torch::Tensor& positions);

/// MultiHeadAttention::forward_projected for a linear-cost kind.
std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward_projected(
    MultiHeadAttentionImpl& m, const torch::Tensor& query,
    const ProjectedKeyValue& key_value, const torch::Tensor& key_padding_mask,
    bool need_weights, bool average_attn_weights);

/// MultiHeadAttention::make_kv_cache for kLinear / kPerformer: a recurrent
/// cache of the kind's feature count (c10::Error for kLinformer).
KVCache linear_kind_kv_cache(const MultiHeadAttentionImpl& m,
                             int64_t batch_size, int64_t capacity);

}  // namespace mha::detail
