// Scaled dot-product attention: the function and a module around it.
//
// Semantics: "Attention Is All You Need" (Vaswani et al., 2017), eq. 1, with
// PyTorch's conventions for masks and dropout
// (https://pytorch.org/docs/stable/generated/torch.nn.functional.scaled_dot_product_attention.html),
// except the bool mask convention, see below.
#pragma once

#include <torch/torch.h>

#include <tuple>

namespace mha {

/// softmax(query · keyᵀ · scale + mask) · value, with the weights returned on
/// request.
///
/// !!! A bool `attn_mask` is `true` where attention is NOT allowed. This is
/// !!! the OPPOSITE of torch's at::scaled_dot_product_attention (true = take
/// !!! part) and the same as torch::nn::MultiheadAttention's masks.
///
/// Args:
///   query: (..., L, E) floating.
///   key:   (..., S, E), same dtype, device and leading dims as query.
///   value: (..., S, Ev), same dtype, device and leading dims as query.
///   attn_mask: optional, broadcastable to (..., L, S): bool (true =
///     blocked) or floating of query's dtype (added to the scores).
///   dropout_p: probability in [0, 1) of zeroing an attention weight
///     (inverted dropout: survivors are scaled by 1/(1-p)). Applied whenever
///     dropout_p > 0, as torch's function does; modules pass 0 in eval mode.
///   is_causal: also block key j > query i (top-left alignment, see
///     causal_mask); combines with attn_mask (union of blocked positions).
///   scale: factor on the scores; default 1/sqrt(E).
///   need_weights: return the weights (after dropout) as the second tensor;
///     when false the second tensor is undefined.
///
/// Returns: (output (..., L, Ev), weights (..., L, S) or undefined).
///
/// Fully masked rows: a query row whose every key is blocked (bool true or
/// -inf) gets output 0 and weights 0, never NaN, and contributes zero
/// gradient. A row of large finite negatives is an ordinary softmax.
///
/// Throws c10::Error for: inputs with fewer than 2 dims or differing leading
/// dims, E of key differing from query's, S of value differing from key's,
/// dtype or device mismatch, integer masks, a mask not broadcastable to
/// (..., L, S), dropout_p outside [0, 1).
///
/// Equivalent LibTorch math (without the fully-masked-row rule):
///   auto scores = torch::matmul(query, key.transpose(-2, -1)) * scale;
///   scores = scores.masked_fill(bool_mask, -INFINITY) + float_mask;
///   auto weights = torch::dropout(torch::softmax(scores, -1), p, true);
///   auto output = torch::matmul(weights, value);
///
/// Example:
///   auto q = torch::randn({2, 4, 5, 8});  // (N, H, L, E)
///   auto k = torch::randn({2, 4, 7, 8});  // (N, H, S, E)
///   auto v = torch::randn({2, 4, 7, 8});  // (N, H, S, Ev)
///   auto [out, w] = mha::scaled_dot_product_attention(
///       q, k, v, /*attn_mask=*/{}, /*dropout_p=*/0.0, /*is_causal=*/true,
///       /*scale=*/c10::nullopt, /*need_weights=*/true);
///   // out: (2, 4, 5, 8), w: (2, 4, 5, 7)
std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& attn_mask = {},
    double dropout_p = 0.0, bool is_causal = false,
    c10::optional<double> scale = c10::nullopt, bool need_weights = false);

/// Options for ScaledDotProductAttention.
struct ScaledDotProductAttentionOptions {
  /// Dropout probability on the attention weights in training mode, in
  /// [0, 1). Default 0.0.
  TORCH_ARG(double, dropout) = 0.0;
  /// Factor on the scores; default (nullopt) is 1/sqrt(E).
  TORCH_ARG(c10::optional<double>, scale) = c10::nullopt;
};

/// Module form of scaled_dot_product_attention: no parameters; dropout only
/// in training mode (`module->train()`).
class ScaledDotProductAttentionImpl
    : public torch::nn::Cloneable<ScaledDotProductAttentionImpl> {
 public:
  /// Builds the module from `options_` (dropout); reset() checks them.
  explicit ScaledDotProductAttentionImpl(
      const ScaledDotProductAttentionOptions& options_ = {});

  /// See scaled_dot_product_attention for shapes, masks and errors.
  /// Returns (output (..., L, Ev), weights (..., L, S) or undefined).
  std::tuple<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& query, const torch::Tensor& key,
      const torch::Tensor& value, const torch::Tensor& attn_mask = {},
      bool is_causal = false, bool need_weights = false);

 protected:
  // Defaults of forward's arguments 3..5: attn_mask, is_causal, need_weights.
  FORWARD_HAS_DEFAULT_ARGS({3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(false)},
                           {5, torch::nn::AnyValue(false)})

 public:
  /// Checks the options (no parameters to create).
  void reset() override;

  /// Prints `mha::ScaledDotProductAttention(dropout=0.1)`; options at their
  /// defaults are left out.
  void pretty_print(std::ostream& stream) const override;

  /// The options this module was constructed with.
  ScaledDotProductAttentionOptions options;
};

/// Holder of ScaledDotProductAttentionImpl (module semantics as torch::nn).
TORCH_MODULE(ScaledDotProductAttention);

}  // namespace mha
