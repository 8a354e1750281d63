// Internal: the pieces the encoder and decoder layers share (mha/transformer.h,
// mha/transformer_decoder.h): the feed-forward block, the activation and the
// checks of their masks, with messages naming the module and the argument.
//
// Glossary: N batch, H nhead, L query length, S key length.
#pragma once

#include <torch/torch.h>

namespace mha::detail {

/// Throws c10::Error (naming `module`) if activation is an empty callable.
void check_activation(const torch::nn::activation_t& activation,
                      const char* module);

/// "relu", "gelu" or "<callable>", for pretty_print.
const char* activation_name(const torch::nn::activation_t& activation);

/// linear2(dropout(activation(linear1(x)))): x (..., E) → (..., E).
torch::Tensor feed_forward(const torch::Tensor& x, torch::nn::Linear linear1,
                           torch::nn::Dropout dropout,
                           torch::nn::Linear linear2,
                           const torch::nn::activation_t& activation);

/// Checks that `mask` (if defined) is (L, S) or (N*nhead, L, S) (unbatched:
/// nhead instead of N*nhead); the message names module, argument and the
/// letters of the two lengths, e.g. "(T, S)".
void check_attn_mask(const char* module, const char* name,
                     const torch::Tensor& mask, int64_t N, int64_t H, int64_t L,
                     int64_t S, bool batched, const char* l_name,
                     const char* s_name);

/// Checks that `mask` (if defined) is (N, L) batched or (L) unbatched.
void check_padding_mask(const char* module, const char* name,
                        const torch::Tensor& mask, int64_t N, int64_t L,
                        bool batched, const char* l_name);

}  // namespace mha::detail
