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

/// The checks of a layer's options (d_model > 0, nhead > 0 dividing it,
/// dim_feedforward > 0, dropout in [0, 1), layer_norm_eps > 0, activation),
/// each error naming `module` and the value.
template <typename LayerOptions>
void check_layer_options(const LayerOptions& options, const char* module) {
  const auto E = options.d_model();
  const auto H = options.nhead();
  const auto F = options.dim_feedforward();
  TORCH_CHECK(E > 0, module, ": d_model must be > 0, but got ", E);
  TORCH_CHECK(H > 0, module, ": nhead must be > 0, but got ", H);
  TORCH_CHECK(E % H == 0, module, ": d_model (", E,
              ") must be divisible by nhead (", H, ")");
  TORCH_CHECK(F > 0, module, ": dim_feedforward must be > 0, but got ", F);
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0, module,
              ": dropout must be in [0, 1), but got ", options.dropout());
  TORCH_CHECK(options.layer_norm_eps() > 0.0, module,
              ": layer_norm_eps must be > 0, but got ",
              options.layer_norm_eps());
  check_activation(options.activation(), module);
}

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
