// Moving weights between mha modules and LibTorch's torch::nn modules.
#pragma once

#include <torch/torch.h>

#include "mha/multi_head_attention.h"
#include "mha/transformer.h"

namespace mha {

/// Copies every parameter of `from` into `to` (values only; `to` keeps its
/// dtype and device), under torch::NoGradGuard.
///
/// Both modules must have the same embed_dim, num_heads, kdim, vdim, bias,
/// add_bias_kv and add_zero_attn; dropout and batch_first may differ.
/// Throws c10::Error naming the first option or parameter shape that differs.
///
/// Example:
///   torch::nn::MultiheadAttention ref(
///       torch::nn::MultiheadAttentionOptions(8, 2));
///   mha::MultiHeadAttention attn(mha::MultiHeadAttentionOptions(8, 2));
///   mha::copy_weights(ref, attn);  // attn now computes what ref computes
void copy_weights(const torch::nn::MultiheadAttention& from,
                  MultiHeadAttention& to);
/// The other direction; see above.
void copy_weights(const MultiHeadAttention& from,
                  torch::nn::MultiheadAttention& to);

/// Copies every parameter of a LibTorch encoder layer into an mha one
/// (self_attn.*, linear1, linear2, norm1, norm2; values only, under
/// torch::NoGradGuard).
///
/// Both must have the same d_model, nhead and dim_feedforward, and the mha
/// layer must have bias=true (LibTorch's layer always has biases). Options
/// that change no parameter (dropout, activation, layer_norm_eps,
/// batch_first, norm_first) may differ: LibTorch's layer is post-norm,
/// seq-first, eps 1e-5, so equal outputs need those settings on the mha side.
/// Throws c10::Error naming the first option or parameter that differs.
void copy_weights(const torch::nn::TransformerEncoderLayer& from,
                  TransformerEncoderLayer& to);
/// The other direction; see above.
void copy_weights(const TransformerEncoderLayer& from,
                  torch::nn::TransformerEncoderLayer& to);

}  // namespace mha
