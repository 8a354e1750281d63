// Transformer encoder: LayerNorm with an optional bias, TransformerEncoderLayer
// and TransformerEncoder, with the options of PyTorch's Python modules
// (torch.nn.TransformerEncoderLayer / TransformerEncoder, PyTorch 2.x
// documentation) that LibTorch's C++ ones lack: batch_first, norm_first,
// layer_norm_eps, bias, is_causal.
//
// Glossary: N batch, L sequence length, E = d_model, H = nhead,
// F = dim_feedforward.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <utility>

#include "mha/multi_head_attention.h"

namespace mha {

// ------------------------------------------------------------- LayerNorm ---

/// Options of mha::LayerNorm: normalization over the last dim of size
/// `normalized_size`.
struct LayerNormOptions {
  /// Normalization over a last dim of `normalized_size`.
  explicit LayerNormOptions(int64_t normalized_size)
      : normalized_size_(normalized_size) {}
  /// Size of the normalized (last) dim.
  TORCH_ARG(int64_t, normalized_size);
  /// Added to the variance for stability.
  TORCH_ARG(double, eps) = 1e-5;
  /// Learnable `bias` (PyTorch >= 2.1's `bias=` switch; LibTorch's
  /// LayerNormOptions has none). The `weight` is always learnable.
  TORCH_ARG(bool, bias) = true;
};

/// Layer normalization over the last dim (Ba et al. 2016), as
/// torch.nn.LayerNorm(normalized_size, eps, elementwise_affine=True, bias):
/// y = (x - mean) / sqrt(var + eps) * weight (+ bias), biased variance.
///
/// Parameters: `weight` (normalized_size) initialised to 1; `bias`
/// (normalized_size) initialised to 0, registered only when options.bias().
/// Input (..., normalized_size), any floating dtype of the parameters.
/// Throws c10::Error if the last dim of the input is not normalized_size.
class LayerNormImpl : public torch::nn::Cloneable<LayerNormImpl> {
 public:
  /// Builds the module and its parameters from `options_` (reset()).
  explicit LayerNormImpl(const LayerNormOptions& options_);

  /// (..., normalized_size) → same shape.
  torch::Tensor forward(const torch::Tensor& input);

  /// Checks the options and (re)creates the parameters.
  void reset() override;
  /// weight = 1, bias = 0.
  void reset_parameters();
  /// Prints e.g. `mha::LayerNorm(8, eps=1e-05, bias=false)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the module was built with.
  LayerNormOptions options;
  torch::Tensor weight;  ///< (normalized_size)
  torch::Tensor bias;    ///< (normalized_size), undefined when !bias
};

/// Holder of LayerNormImpl.
TORCH_MODULE(LayerNorm);

// ----------------------------------------------- TransformerEncoderLayer ---

/// Options of mha::TransformerEncoderLayer. Defaults as PyTorch's, except
/// batch_first = true (our choice, DESIGN.md).
struct TransformerEncoderLayerOptions {
  /// `d_model` features, `nhead` heads; the other options at their defaults.
  TransformerEncoderLayerOptions(int64_t d_model, int64_t nhead)
      : d_model_(d_model), nhead_(nhead) {}
  /// Features of the input and output, E.
  TORCH_ARG(int64_t, d_model);
  /// Attention heads; must divide d_model.
  TORCH_ARG(int64_t, nhead);
  /// Hidden size F of the feed-forward block.
  TORCH_ARG(int64_t, dim_feedforward) = 2048;
  /// Dropout probability on the attention weights, inside the feed-forward
  /// block and on both residual branches (training mode only).
  TORCH_ARG(double, dropout) = 0.1;
  /// torch::kReLU, torch::kGELU (exact, erf-based) or any callable
  /// Tensor(const Tensor&): LibTorch's torch::nn::activation_t.
  TORCH_ARG(torch::nn::activation_t, activation) = torch::kReLU;
  /// eps of both LayerNorms.
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// Input (N, L, E) if true, (L, N, E) if false.
  TORCH_ARG(bool, batch_first) = true;
  /// Pre-norm (x + f(norm(x))) if true, post-norm (norm(x + f(x))) if false.
  TORCH_ARG(bool, norm_first) = false;
  /// false removes the bias of every Linear and LayerNorm in the layer,
  /// the attention projections included.
  TORCH_ARG(bool, bias) = true;
};

/// One Transformer encoder block (Vaswani et al. 2017, "Attention Is All You
/// Need"; PyTorch's torch.nn.TransformerEncoderLayer):
///   post-norm: x = norm1(x + sa(x)); x = norm2(x + ff(x))
///   pre-norm:  x = x + sa(norm1(x)); x = x + ff(norm2(x))
/// with sa(x) = dropout1(self_attn(x, x, x, need_weights=false)) and
/// ff(x) = dropout2(linear2(dropout(activation(linear1(x))))).
///
/// Submodules (state-dict names as PyTorch's): self_attn, linear1, dropout,
/// linear2, norm1, norm2, dropout1, dropout2.
///
/// Example:
///   mha::TransformerEncoderLayer layer(
///       mha::TransformerEncoderLayerOptions(64, 8).dim_feedforward(256));
///   auto y = layer(torch::randn({2, 10, 64}));  // (N, L, E) → (N, L, E)
class TransformerEncoderLayerImpl
    : public torch::nn::Cloneable<TransformerEncoderLayerImpl> {
 public:
  /// `d_model` features, `nhead` heads, every other option at its default.
  TransformerEncoderLayerImpl(int64_t d_model, int64_t nhead)
      : TransformerEncoderLayerImpl(
            TransformerEncoderLayerOptions(d_model, nhead)) {}
  /// Builds the layer from `options_`. Throws c10::Error naming the option
  /// for invalid ones (reset()).
  explicit TransformerEncoderLayerImpl(
      const TransformerEncoderLayerOptions& options_);

  /// Encodes `src`: (N, L, E) if batch_first, else (L, N, E); unbatched
  /// (L, E). Floating, the parameters' dtype and device.
  ///
  /// src_mask: (L, L) or (N*nhead, L, L); src_key_padding_mask: (N, L)
  /// (unbatched (L)); bool (true = blocked) or floating (added to the
  /// scores); is_causal: query i attends keys j <= i only (combined with
  /// src_mask if both are given). A fully masked query row attends to
  /// nothing (attention result 0), never NaN. Padded positions are computed
  /// like any other and not zeroed; their values carry no meaning.
  ///
  /// block_mask: a FlexAttention BlockMask for the self-attention
  /// (MultiHeadAttention::forward's), e.g. the documents of a packed batch;
  /// default none.
  ///
  /// Returns a tensor of src's shape. Throws c10::Error naming the argument,
  /// its shape and what was expected (wrong d_model, mask shapes, dtypes).
  torch::Tensor forward(const torch::Tensor& src,
                        const torch::Tensor& src_mask = {},
                        const torch::Tensor& src_key_padding_mask = {},
                        bool is_causal = false,
                        const BlockMask& block_mask = {});

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(false)},
                           {4, torch::nn::AnyValue(BlockMask())})

 public:
  /// Checks the options and (re)creates every submodule.
  void reset() override;
  /// Re-initialises every parameter as PyTorch does at construction.
  void reset_parameters();
  /// Prints e.g. `mha::TransformerEncoderLayer(d_model=8, nhead=2, ...)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the layer was built with.
  TransformerEncoderLayerOptions options;
  /// Self-attention (d_model, nhead), need_weights=false.
  MultiHeadAttention self_attn = nullptr;
  torch::nn::Linear linear1 = nullptr;  ///< E → F
  /// Dropout inside the feed-forward block.
  torch::nn::Dropout dropout = nullptr;
  torch::nn::Linear linear2 = nullptr;  ///< F → E
  /// Norm of the attention block (before it if norm_first, else after).
  LayerNorm norm1 = nullptr;
  /// Norm of the feed-forward block.
  LayerNorm norm2 = nullptr;
  /// Dropout on the attention block's output.
  torch::nn::Dropout dropout1 = nullptr;
  /// Dropout on the feed-forward block's output.
  torch::nn::Dropout dropout2 = nullptr;

 private:
  torch::Tensor self_attention_block(const torch::Tensor& x,
                                     const torch::Tensor& src_mask,
                                     const torch::Tensor& src_key_padding_mask,
                                     bool is_causal,
                                     const BlockMask& block_mask);
  torch::Tensor feed_forward_block(const torch::Tensor& x);
};

/// Holder of TransformerEncoderLayerImpl.
TORCH_MODULE(TransformerEncoderLayer);

// ---------------------------------------------------- TransformerEncoder ---

/// Options of mha::TransformerEncoder.
struct TransformerEncoderOptions {
  /// `num_layers` deep copies of `encoder_layer`, no final norm.
  TransformerEncoderOptions(TransformerEncoderLayer encoder_layer,
                            int64_t num_layers)
      : encoder_layer_(std::move(encoder_layer)), num_layers_(num_layers) {}
  /// The layer of which the encoder holds num_layers deep copies (the same
  /// initial weights in every copy, as PyTorch).
  TORCH_ARG(TransformerEncoderLayer, encoder_layer);
  /// Number of layers, >= 1.
  TORCH_ARG(int64_t, num_layers);
  /// Optional final normalization (e.g. mha::LayerNorm or
  /// torch::nn::LayerNorm), applied after the last layer; empty: none.
  TORCH_ARG(torch::nn::AnyModule, norm);
};

/// A stack of encoder layers and an optional final norm (PyTorch's
/// torch.nn.TransformerEncoder; the nested-tensor fast path is not
/// reproduced: padded positions are computed, not zeroed).
///
/// Submodules (state-dict names as PyTorch's): layers (layers.0, ...),
/// norm (when given).
///
/// Example:
///   mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(
///       mha::TransformerEncoderLayer(
///           mha::TransformerEncoderLayerOptions(64, 8).norm_first(true)),
///       /*num_layers=*/4));
///   auto y = encoder(torch::randn({2, 10, 64}));  // (N, L, E)
class TransformerEncoderImpl
    : public torch::nn::Cloneable<TransformerEncoderImpl> {
 public:
  /// Builds the stack from `options_` (reset()).
  explicit TransformerEncoderImpl(const TransformerEncoderOptions& options_);

  /// Runs src through every layer, then the norm. Shapes, masks and errors
  /// as TransformerEncoderLayer::forward (mask is its src_mask).
  torch::Tensor forward(const torch::Tensor& src,
                        const torch::Tensor& mask = {},
                        const torch::Tensor& src_key_padding_mask = {},
                        bool is_causal = false,
                        const BlockMask& block_mask = {});

 protected:
  FORWARD_HAS_DEFAULT_ARGS({1, torch::nn::AnyValue(torch::Tensor())},
                           {2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(false)},
                           {4, torch::nn::AnyValue(BlockMask())})

 public:
  /// Checks the options and (re)creates the layers (deep copies of
  /// options.encoder_layer()) and the norm (a deep copy of options.norm()).
  void reset() override;
  /// Prints e.g. `mha::TransformerEncoder(num_layers=4)` and its layers.
  void pretty_print(std::ostream& stream) const override;

  /// The options the encoder was built with.
  TransformerEncoderOptions options;
  /// The layers, state-dict names layers.0, layers.1, ...
  torch::nn::ModuleList layers = nullptr;
  /// The final norm; empty when none was given.
  torch::nn::AnyModule norm;
};

/// Holder of TransformerEncoderImpl.
TORCH_MODULE(TransformerEncoder);

}  // namespace mha
