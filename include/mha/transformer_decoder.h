// Transformer decoder and the whole encoder–decoder Transformer, with the
// options, forward arguments and parameter names of PyTorch's Python modules
// (torch.nn.TransformerDecoderLayer, TransformerDecoder and Transformer,
// PyTorch 2.x documentation and torch/nn/modules/transformer.py), plus
// cached (incremental) decoding, which Python's modules lack.
//
// Glossary: N batch, T target (tgt) length, S source (memory) length,
// E = d_model, H = nhead, F = dim_feedforward.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "mha/kv_cache.h"
#include "mha/multi_head_attention.h"
#include "mha/transformer.h"

namespace mha {

// ----------------------------------------------- TransformerDecoderLayer ---

/// Options of mha::TransformerDecoderLayer; as the encoder layer's
/// (defaults as PyTorch's, except batch_first = true, DESIGN.md).
struct TransformerDecoderLayerOptions {
  /// `d_model` features, `nhead` heads; the other options at their defaults.
  TransformerDecoderLayerOptions(int64_t d_model, int64_t nhead)
      : d_model_(d_model), nhead_(nhead) {}
  /// Features of tgt, memory and the output, E.
  TORCH_ARG(int64_t, d_model);
  /// Attention heads of both attention blocks; must divide d_model.
  TORCH_ARG(int64_t, nhead);
  /// Hidden size F of the feed-forward block.
  TORCH_ARG(int64_t, dim_feedforward) = 2048;
  /// Dropout probability on the attention weights, inside the feed-forward
  /// block and on the three residual branches (training mode only).
  TORCH_ARG(double, dropout) = 0.1;
  /// torch::kReLU, torch::kGELU (exact, erf-based) or any callable
  /// Tensor(const Tensor&): LibTorch's torch::nn::activation_t.
  TORCH_ARG(torch::nn::activation_t, activation) = torch::kReLU;
  /// eps of the three LayerNorms.
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// tgt (N, T, E) and memory (N, S, E) if true, (T, N, E) and (S, N, E)
  /// if false.
  TORCH_ARG(bool, batch_first) = true;
  /// Pre-norm (x + f(norm(x))) if true, post-norm (norm(x + f(x))) if false.
  TORCH_ARG(bool, norm_first) = false;
  /// false removes the bias of every Linear and LayerNorm in the layer, the
  /// attention projections included.
  TORCH_ARG(bool, bias) = true;
};

/// Keys and values of one decoder's memory, projected once per sequence for
/// cached decoding, and the self-attention caches of its layers (see
/// TransformerDecoder::make_cache).
struct TransformerDecoderCache {
  /// One per layer: the keys and values of the target tokens so far.
  std::vector<KVCache> self_attention;
  /// One per layer: memory's keys and values through that layer's
  /// cross-attention (multihead_attn) projections.
  std::vector<ProjectedKeyValue> memory;
  /// (N, S) bool (true = padding) or floating, or undefined: the
  /// memory_key_padding_mask every step uses.
  torch::Tensor memory_key_padding_mask;
  /// Target tokens decoded so far (the position of the next one).
  int64_t size() const {
    return self_attention.empty() ? 0 : self_attention.front().size();
  }
};

/// One Transformer decoder block (Vaswani et al. 2017; PyTorch's
/// torch.nn.TransformerDecoderLayer):
///   post-norm: x = norm1(x + sa(x)); x = norm2(x + ca(x, memory));
///              x = norm3(x + ff(x))
///   pre-norm:  x = x + sa(norm1(x)); x = x + ca(norm2(x), memory);
///              x = x + ff(norm3(x))
/// with sa(x) = dropout1(self_attn(x, x, x)), ca(x, m) =
/// dropout2(multihead_attn(x, m, m)) and ff(x) =
/// dropout3(linear2(dropout(activation(linear1(x))))).
///
/// Submodules (state-dict names as PyTorch's): self_attn, multihead_attn,
/// linear1, dropout, linear2, norm1, norm2, norm3, dropout1, dropout2,
/// dropout3.
///
/// Example:
///   mha::TransformerDecoderLayer layer(
///       mha::TransformerDecoderLayerOptions(64, 8).dim_feedforward(256));
///   auto memory = torch::randn({2, 12, 64});                 // (N, S, E)
///   auto y = layer(torch::randn({2, 10, 64}), memory,        // (N, T, E)
///                  {}, {}, {}, {}, /*tgt_is_causal=*/true);
class TransformerDecoderLayerImpl
    : public torch::nn::Cloneable<TransformerDecoderLayerImpl> {
 public:
  /// `d_model` features, `nhead` heads, every other option at its default.
  TransformerDecoderLayerImpl(int64_t d_model, int64_t nhead)
      : TransformerDecoderLayerImpl(
            TransformerDecoderLayerOptions(d_model, nhead)) {}
  /// Builds the layer from `options_`. Throws c10::Error naming the option
  /// for invalid ones (reset()).
  explicit TransformerDecoderLayerImpl(
      const TransformerDecoderLayerOptions& options_);

  /// Decodes tgt attending to memory.
  ///
  /// tgt: (N, T, E) if batch_first, else (T, N, E); unbatched (T, E).
  /// memory: (N, S, E), (S, N, E) or unbatched (S, E), as tgt.
  /// Floating, the parameters' dtype and device.
  ///
  /// Masks (bool: true = blocked; floating: added to the scores):
  ///   tgt_mask (T, T) or (N*nhead, T, T); memory_mask (T, S) or
  ///   (N*nhead, T, S) (unbatched: nhead instead of N*nhead);
  ///   tgt_key_padding_mask (N, T), memory_key_padding_mask (N, S)
  ///   (unbatched: (T), (S)).
  ///   tgt_is_causal: target token i attends target tokens j <= i only;
  ///   memory_is_causal: target token i attends memory j <= i only
  ///   (top-left). Each is combined with its mask when both are given (our
  ///   choice; Python treats is_causal as a hint that needs the mask).
  /// A fully masked query row's attention result is 0, never NaN.
  ///
  /// Returns a tensor of tgt's shape. Throws c10::Error naming the argument,
  /// its shape and what was expected (wrong d_model, batch sizes, masks).
  torch::Tensor forward(const torch::Tensor& tgt, const torch::Tensor& memory,
                        const torch::Tensor& tgt_mask = {},
                        const torch::Tensor& memory_mask = {},
                        const torch::Tensor& tgt_key_padding_mask = {},
                        const torch::Tensor& memory_key_padding_mask = {},
                        bool tgt_is_causal = false,
                        bool memory_is_causal = false);

  /// Incremental decoding: tgt (N, T, E) as forward's layout (usually
  /// T = 1) holds the next target tokens, at positions cache.size() to
  /// cache.size() + T - 1; self-attention is causal over the tokens in
  /// `cache` and the new ones (appended to cache), cross-attention reads
  /// memory's keys and values from `memory` (MultiHeadAttention::
  /// project_key_value of multihead_attn), masked by memory_key_padding_mask
  /// ((N, S) or undefined). Equal, within rounding, to forward(whole target,
  /// memory, tgt_is_causal = true) restricted to the new rows. Throws
  /// c10::Error as forward and MultiHeadAttention::forward_cached.
  torch::Tensor forward_cached(
      const torch::Tensor& tgt, KVCache& cache, const ProjectedKeyValue& memory,
      const torch::Tensor& memory_key_padding_mask = {});

 protected:
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(torch::Tensor())},
                           {5, torch::nn::AnyValue(torch::Tensor())},
                           {6, torch::nn::AnyValue(false)},
                           {7, torch::nn::AnyValue(false)})

 public:
  /// Checks the options and (re)creates every submodule.
  void reset() override;
  /// Re-initialises every parameter as PyTorch does at construction.
  void reset_parameters();
  /// Prints e.g. `mha::TransformerDecoderLayer(d_model=8, nhead=2, ...)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the layer was built with.
  TransformerDecoderLayerOptions options;
  MultiHeadAttention self_attn = nullptr;       ///< over the target
  MultiHeadAttention multihead_attn = nullptr;  ///< target → memory
  torch::nn::Linear linear1 = nullptr;          ///< E → F
  /// Dropout inside the feed-forward block.
  torch::nn::Dropout dropout = nullptr;
  torch::nn::Linear linear2 = nullptr;  ///< F → E
  /// Norm of the self-attention block.
  LayerNorm norm1 = nullptr;
  /// Norm of the cross-attention block.
  LayerNorm norm2 = nullptr;
  /// Norm of the feed-forward block.
  LayerNorm norm3 = nullptr;
  /// Dropout on the self-attention block's output.
  torch::nn::Dropout dropout1 = nullptr;
  /// Dropout on the cross-attention block's output.
  torch::nn::Dropout dropout2 = nullptr;
  /// Dropout on the feed-forward block's output.
  torch::nn::Dropout dropout3 = nullptr;

 private:
  template <typename SelfAttention, typename CrossAttention>
  torch::Tensor blocks(const torch::Tensor& tgt, SelfAttention&& sa,
                       CrossAttention&& ca);
};

/// Holder of TransformerDecoderLayerImpl.
TORCH_MODULE(TransformerDecoderLayer);

// ---------------------------------------------------- TransformerDecoder ---

/// Options of mha::TransformerDecoder.
struct TransformerDecoderOptions {
  /// `num_layers` deep copies of `decoder_layer`, no final norm.
  TransformerDecoderOptions(TransformerDecoderLayer decoder_layer,
                            int64_t num_layers)
      : decoder_layer_(std::move(decoder_layer)), num_layers_(num_layers) {}
  /// The layer of which the decoder holds num_layers deep copies (the same
  /// initial weights in every copy, as PyTorch).
  TORCH_ARG(TransformerDecoderLayer, decoder_layer);
  /// Number of layers, >= 1.
  TORCH_ARG(int64_t, num_layers);
  /// Optional final normalization (e.g. mha::LayerNorm), applied after the
  /// last layer; empty: none.
  TORCH_ARG(torch::nn::AnyModule, norm);
};

/// A stack of decoder layers and an optional final norm (PyTorch's
/// torch.nn.TransformerDecoder).
///
/// Submodules (state-dict names as PyTorch's): layers (layers.0, ...),
/// norm (when given).
///
/// Example, greedy decoding through the cache (N = 1, E = 64):
///   auto cache = decoder->make_cache(memory, /*capacity=*/32);
///   auto x = embed(start_token);                      // (1, 1, 64)
///   for (int t = 0; t < 32; ++t) {
///     auto y = decoder->forward_cached(x, cache);     // (1, 1, 64)
///     x = embed(next_token_from(y));
///   }
class TransformerDecoderImpl
    : public torch::nn::Cloneable<TransformerDecoderImpl> {
 public:
  /// Builds the stack from `options_` (reset()).
  explicit TransformerDecoderImpl(const TransformerDecoderOptions& options_);

  /// Runs tgt through every layer (each attending to memory), then the
  /// norm. Shapes, masks and errors as TransformerDecoderLayer::forward.
  torch::Tensor forward(const torch::Tensor& tgt, const torch::Tensor& memory,
                        const torch::Tensor& tgt_mask = {},
                        const torch::Tensor& memory_mask = {},
                        const torch::Tensor& tgt_key_padding_mask = {},
                        const torch::Tensor& memory_key_padding_mask = {},
                        bool tgt_is_causal = false,
                        bool memory_is_causal = false);

  /// Prepares cached decoding against memory ((N, S, E) as forward's
  /// layout, or (S, E) unbatched): projects memory's keys and values once
  /// per layer and makes each layer an empty self-attention cache of
  /// `capacity` target positions. memory_key_padding_mask: (N, S) ((S)
  /// unbatched), bool or floating, or undefined; kept for every step.
  /// Throws c10::Error for a memory or mask of the wrong shape, dtype or
  /// device, or capacity < 0.
  TransformerDecoderCache make_cache(
      const torch::Tensor& memory, int64_t capacity,
      const torch::Tensor& memory_key_padding_mask = {});

  /// The next target tokens tgt ((N, T, E) as forward's layout) through
  /// every layer's forward_cached, then the norm; tokens are appended to
  /// the cache. Equal, within rounding, to forward(whole target, memory,
  /// tgt_is_causal = true, memory_key_padding_mask as given to make_cache)
  /// restricted to the new rows.
  torch::Tensor forward_cached(const torch::Tensor& tgt,
                               TransformerDecoderCache& cache);

 protected:
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(torch::Tensor())},
                           {5, torch::nn::AnyValue(torch::Tensor())},
                           {6, torch::nn::AnyValue(false)},
                           {7, torch::nn::AnyValue(false)})

 public:
  /// Checks the options and (re)creates the layers (deep copies of
  /// options.decoder_layer()) and the norm (a deep copy of options.norm()).
  void reset() override;
  /// Prints e.g. `mha::TransformerDecoder(num_layers=4)` and its layers.
  void pretty_print(std::ostream& stream) const override;

  /// The options the decoder was built with.
  TransformerDecoderOptions options;
  /// The layers, state-dict names layers.0, layers.1, ...
  torch::nn::ModuleList layers = nullptr;
  /// The final norm; empty when none was given.
  torch::nn::AnyModule norm;
};

/// Holder of TransformerDecoderImpl.
TORCH_MODULE(TransformerDecoder);

// ----------------------------------------------------------- Transformer ---

/// Options of mha::Transformer. Defaults as Python's nn.Transformer, except
/// batch_first = true (DESIGN.md).
struct TransformerOptions {
  /// Python's defaults: d_model 512, nhead 8.
  TransformerOptions() = default;
  /// `d_model` features, `nhead` heads; the other options at their defaults.
  TransformerOptions(int64_t d_model, int64_t nhead)
      : d_model_(d_model), nhead_(nhead) {}
  /// As TransformerOptions(d_model, nhead) with the numbers of encoder and
  /// decoder layers (Python's positional order).
  TransformerOptions(int64_t d_model, int64_t nhead, int64_t num_encoder_layers,
                     int64_t num_decoder_layers)
      : d_model_(d_model),
        nhead_(nhead),
        num_encoder_layers_(num_encoder_layers),
        num_decoder_layers_(num_decoder_layers) {}
  /// Features E of src, tgt and the output.
  TORCH_ARG(int64_t, d_model) = 512;
  /// Attention heads of every attention block.
  TORCH_ARG(int64_t, nhead) = 8;
  /// Encoder layers (unused with custom_encoder).
  TORCH_ARG(int64_t, num_encoder_layers) = 6;
  /// Decoder layers (unused with custom_decoder).
  TORCH_ARG(int64_t, num_decoder_layers) = 6;
  /// Hidden size F of every feed-forward block.
  TORCH_ARG(int64_t, dim_feedforward) = 2048;
  /// Dropout of every layer (training mode only).
  TORCH_ARG(double, dropout) = 0.1;
  /// Activation of every feed-forward block (as the layers' option).
  TORCH_ARG(torch::nn::activation_t, activation) = torch::kReLU;
  /// Replaces the encoder: a module whose forward takes (src, mask,
  /// src_key_padding_mask, is_causal) as mha::TransformerEncoder's;
  /// empty: mha::TransformerEncoder with a final mha::LayerNorm.
  TORCH_ARG(torch::nn::AnyModule, custom_encoder);
  /// Replaces the decoder: a module whose forward takes
  /// TransformerDecoder::forward's eight arguments; empty:
  /// mha::TransformerDecoder with a final mha::LayerNorm.
  TORCH_ARG(torch::nn::AnyModule, custom_decoder);
  /// eps of every LayerNorm, the final norms included.
  TORCH_ARG(double, layer_norm_eps) = 1e-5;
  /// (N, S, E) / (N, T, E) inputs if true, (S, N, E) / (T, N, E) if false
  /// (Python's default is false).
  TORCH_ARG(bool, batch_first) = true;
  /// Pre-norm layers if true.
  TORCH_ARG(bool, norm_first) = false;
  /// false removes every bias of every layer and of the final norms.
  TORCH_ARG(bool, bias) = true;
};

/// The encoder–decoder Transformer (Vaswani et al. 2017; PyTorch's
/// torch.nn.Transformer): memory = encoder(src), output = decoder(tgt,
/// memory). Without custom modules: a TransformerEncoder of
/// num_encoder_layers layers and a TransformerDecoder of
/// num_decoder_layers layers, each with a final LayerNorm; at construction
/// every parameter of more than one dim is re-drawn xavier_uniform, as
/// Python's nn.Transformer does.
///
/// Submodules (state-dict names as PyTorch's): encoder (encoder.layers.N.*,
/// encoder.norm), decoder (decoder.layers.N.*, decoder.norm).
///
/// Example:
///   mha::Transformer model(mha::TransformerOptions(64, 4)
///                              .num_encoder_layers(2)
///                              .num_decoder_layers(2));
///   auto src = torch::randn({8, 20, 64}), tgt = torch::randn({8, 9, 64});
///   auto y = model(src, tgt, {}, mha::generate_square_subsequent_mask(9));
///   // y: (8, 9, 64)
class TransformerImpl : public torch::nn::Cloneable<TransformerImpl> {
 public:
  /// Builds the encoder and decoder (or takes the custom ones) and
  /// initialises them (reset(), reset_parameters()).
  explicit TransformerImpl(const TransformerOptions& options_ = {});

  /// output = decoder(tgt, encoder(src, src_mask, src_key_padding_mask,
  /// src_is_causal), tgt_mask, memory_mask, tgt_key_padding_mask,
  /// memory_key_padding_mask, tgt_is_causal, memory_is_causal).
  ///
  /// src (N, S, E) / tgt (N, T, E) if batch_first, else (S, N, E) /
  /// (T, N, E); unbatched (S, E) / (T, E). Masks as
  /// TransformerEncoderLayer::forward (src_*) and
  /// TransformerDecoderLayer::forward (the rest). Returns tgt's shape.
  /// Throws c10::Error when src and tgt differ in batch size or in dims, or
  /// their last dim is not d_model, and as the layers.
  torch::Tensor forward(const torch::Tensor& src, const torch::Tensor& tgt,
                        const torch::Tensor& src_mask = {},
                        const torch::Tensor& tgt_mask = {},
                        const torch::Tensor& memory_mask = {},
                        const torch::Tensor& src_key_padding_mask = {},
                        const torch::Tensor& tgt_key_padding_mask = {},
                        const torch::Tensor& memory_key_padding_mask = {},
                        bool src_is_causal = false, bool tgt_is_causal = false,
                        bool memory_is_causal = false);

  /// The encoder alone: memory for make_cache (src as forward's).
  torch::Tensor encode(const torch::Tensor& src,
                       const torch::Tensor& src_mask = {},
                       const torch::Tensor& src_key_padding_mask = {},
                       bool src_is_causal = false);
  /// The built-in decoder's make_cache (throws c10::Error with a
  /// custom_decoder that is not a mha::TransformerDecoder).
  TransformerDecoderCache make_cache(
      const torch::Tensor& memory, int64_t capacity,
      const torch::Tensor& memory_key_padding_mask = {});
  /// The built-in decoder's forward_cached (same condition).
  torch::Tensor forward_cached(const torch::Tensor& tgt,
                               TransformerDecoderCache& cache);

  /// mha::generate_square_subsequent_mask, as LibTorch's and Python's
  /// static method: float (L, L), -inf above the diagonal, 0 elsewhere.
  static torch::Tensor generate_square_subsequent_mask(
      int64_t L, torch::TensorOptions options = {});

 protected:
  FORWARD_HAS_DEFAULT_ARGS({2, torch::nn::AnyValue(torch::Tensor())},
                           {3, torch::nn::AnyValue(torch::Tensor())},
                           {4, torch::nn::AnyValue(torch::Tensor())},
                           {5, torch::nn::AnyValue(torch::Tensor())},
                           {6, torch::nn::AnyValue(torch::Tensor())},
                           {7, torch::nn::AnyValue(torch::Tensor())},
                           {8, torch::nn::AnyValue(false)},
                           {9, torch::nn::AnyValue(false)},
                           {10, torch::nn::AnyValue(false)})

 public:
  /// Checks the options and (re)creates encoder and decoder (deep copies
  /// of custom modules), then reset_parameters().
  void reset() override;
  /// xavier_uniform for every parameter of more than one dim, as Python's
  /// nn.Transformer._reset_parameters (custom modules included).
  void reset_parameters();
  /// Prints e.g. `mha::Transformer(d_model=512, nhead=8, ...)`.
  void pretty_print(std::ostream& stream) const override;

  /// The options the model was built with.
  TransformerOptions options;
  /// The encoder: a TransformerEncoder with a final LayerNorm, or
  /// custom_encoder.
  torch::nn::AnyModule encoder;
  /// The decoder: a TransformerDecoder with a final LayerNorm, or
  /// custom_decoder.
  torch::nn::AnyModule decoder;

 private:
  TransformerDecoderImpl& builtin_decoder(const char* caller);
};

/// Holder of TransformerImpl.
TORCH_MODULE(Transformer);

}  // namespace mha
