// Internal: the attention options of 2025's model families on
// MultiHeadAttention (head_dim, qk_norm, attention_sinks, output_gate),
// shared by forward and forward_cached. Not installed. Semantics:
// transformers 5.x, the files cited at each function.
//
// Glossary: N batch, H num_heads, Hkv num_kv_heads, L query length, S key
// length, D head_dim.
#pragma once

#include <torch/torch.h>

#include "mha/multi_head_attention.h"

namespace mha::detail {

/// reset()'s checks of the family options (c10::Error naming the option).
void check_family_options(const MultiHeadAttentionImpl& m);

/// Registers q_norm.weight / k_norm.weight and sinks as the options ask
/// (after out_proj, in transformers' order), or clears them.
void register_family_parameters(MultiHeadAttentionImpl& m);

/// Their initial values: norm weights 1 (0 with qk_norm_unit_offset), sinks
/// 0.
void reset_family_parameters(MultiHeadAttentionImpl& m);

/// output_gate: splits the query projection (N, L, 2·H·D), per head
/// [query_h | gate_h] (transformers' Qwen3NextAttention), into the query
/// (N, L, H·D), returned, and the gate (N, L, H·D), written to `gate`.
/// Without the option: q_proj unchanged, gate undefined.
torch::Tensor split_output_gate(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& q_proj,
                                torch::Tensor& gate);

/// qk_norm kPerHead / kFull on q (N, H, L, D) and k (N, Hkv, S, D), before
/// rotary (Qwen3RMSNorm, Gemma3RMSNorm with the unit offset, Olmo2RMSNorm
/// over the whole projection); unchanged otherwise.
void norm_before_rotary(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                        torch::Tensor& k);

/// qk_norm kL2 after rotary (Llama4TextL2Norm); unchanged otherwise.
void norm_after_rotary(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                       torch::Tensor& k);

/// attn_temperature_tuning on q (N, H, L, D) of the tokens at indices
/// offset + 0..L-1 (Llama4TextAttention); unchanged without the option.
void tune_temperature(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                      int64_t offset);

/// attention_sinks: output (N, H, L, Dv) and per-head weights (N, H, L, S)
/// (or undefined) of the core times sigmoid(lse - sinks_h), lse (N, H, L)
/// the core's logsumexp of each row (GptOssAttention's softmax over the
/// scores and the sink, the sink's column dropped).
void apply_sinks(const MultiHeadAttentionImpl& m, torch::Tensor& output,
                 torch::Tensor& weights, const torch::Tensor& lse);

}  // namespace mha::detail
