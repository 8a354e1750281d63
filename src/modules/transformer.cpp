// Glossary: N batch, L sequence length, E = d_model, H = nhead,
// F = dim_feedforward.
#include "mha/transformer.h"

#include <functional>
#include <string>

#include "compat.h"
#include "core/blas_threads.h"
#include "modules/projection.h"
#include "modules/transformer_blocks.h"

namespace mha {

// ------------------------------------------------- shared layer pieces ---

namespace detail {

void check_activation(const torch::nn::activation_t& activation,
                      const char* module) {
  if (const auto* f =
          variant_get_if<std::function<torch::Tensor(const torch::Tensor&)>>(
              activation)) {
    TORCH_CHECK(static_cast<bool>(*f), module,
                ": activation is an empty callable");
  }
}

const char* activation_name(const torch::nn::activation_t& activation) {
  if (variant_get_if<torch::enumtype::kReLU>(activation)) {
    return "relu";
  }
  if (variant_get_if<torch::enumtype::kGELU>(activation)) {
    return "gelu";
  }
  return "<callable>";
}

torch::Tensor feed_forward(const torch::Tensor& x, torch::nn::Linear linear1,
                           torch::nn::Dropout dropout,
                           torch::nn::Linear linear2,
                           const torch::nn::activation_t& activation) {
  auto hidden = project(x, linear1->weight, linear1->bias);  // (..., F)
  if (variant_get_if<torch::enumtype::kReLU>(activation)) {
    hidden.relu_();  // in place: hidden is this block's own temporary
  } else if (variant_get_if<torch::enumtype::kGELU>(activation)) {
    hidden = torch::gelu(hidden);
  } else {
    hidden =
        (*variant_get_if<std::function<torch::Tensor(const torch::Tensor&)>>(
            activation))(hidden);
  }
  return project(dropout->forward(hidden), linear2->weight, linear2->bias);
}

void check_attn_mask(const char* module, const char* name,
                     const torch::Tensor& mask, int64_t N, int64_t H, int64_t L,
                     int64_t S, bool batched, const char* l_name,
                     const char* s_name) {
  if (!mask.defined()) {
    return;
  }
  const bool ok = (mask.dim() == 2 && mask.size(0) == L && mask.size(1) == S) ||
                  (mask.dim() == 3 && mask.size(0) == N * H &&
                   mask.size(1) == L && mask.size(2) == S);
  TORCH_CHECK(ok, module, ": ", name, " must be (", l_name, ", ", s_name,
              ") = (", L, ", ", S, ") or (", batched ? "N*nhead" : "nhead",
              ", ", l_name, ", ", s_name, ") = (", N * H, ", ", L, ", ", S,
              "), but got ", mask.sizes());
}

void check_padding_mask(const char* module, const char* name,
                        const torch::Tensor& mask, int64_t N, int64_t L,
                        bool batched, const char* l_name) {
  if (!mask.defined()) {
    return;
  }
  const bool ok =
      batched ? mask.dim() == 2 && mask.size(0) == N && mask.size(1) == L
              : mask.dim() == 1 && mask.size(0) == L;
  TORCH_CHECK(ok, module, ": ", name, " must be ",
              batched ? "(N, " + std::string(l_name) + ") = (" +
                            std::to_string(N) + ", "
                      : "(" + std::string(l_name) + ") = (",
              L, "), but got ", mask.sizes());
}

}  // namespace detail

// ------------------------------------------------------------- LayerNorm ---

LayerNormImpl::LayerNormImpl(const LayerNormOptions& options_)
    : options(options_) {
  reset();
}

void LayerNormImpl::reset() {
  TORCH_CHECK(options.normalized_size() > 0,
              "LayerNorm: normalized_size must be > 0, but got ",
              options.normalized_size());
  TORCH_CHECK(options.eps() > 0.0, "LayerNorm: eps must be > 0, but got ",
              options.eps());
  const auto size = options.normalized_size();
  weight = register_parameter("weight", torch::empty({size}));
  bias = options.bias() ? register_parameter("bias", torch::empty({size}))
                        : torch::Tensor();
  reset_parameters();
}

void LayerNormImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  weight.fill_(1.0);
  if (bias.defined()) {
    bias.zero_();
  }
}

torch::Tensor LayerNormImpl::forward(const torch::Tensor& input) {
  const auto size = options.normalized_size();
  TORCH_CHECK(input.dim() >= 1 && input.size(-1) == size,
              "LayerNorm: input must be (..., ", size, "), but got ",
              input.sizes());
  return torch::layer_norm(input, {size}, weight, bias, options.eps());
}

void LayerNormImpl::pretty_print(std::ostream& stream) const {
  stream << "mha::LayerNorm(" << options.normalized_size()
         << ", eps=" << options.eps();
  if (!options.bias()) {
    stream << ", bias=false";
  }
  stream << ")";
}

// ----------------------------------------------- TransformerEncoderLayer ---

TransformerEncoderLayerImpl::TransformerEncoderLayerImpl(
    const TransformerEncoderLayerOptions& options_)
    : options(options_) {
  reset();
}

void TransformerEncoderLayerImpl::reset() {
  const auto E = options.d_model();
  const auto H = options.nhead();
  const auto F = options.dim_feedforward();
  detail::check_layer_options(options, "TransformerEncoderLayer");
  const bool bias = options.bias();
  // Registration order as PyTorch's.
  self_attn = register_module(
      "self_attn", MultiHeadAttention(MultiHeadAttentionOptions(E, H)
                                          .dropout(options.dropout())
                                          .bias(bias)
                                          .batch_first(options.batch_first())));
  linear1 = register_module(
      "linear1", torch::nn::Linear(torch::nn::LinearOptions(E, F).bias(bias)));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  linear2 = register_module(
      "linear2", torch::nn::Linear(torch::nn::LinearOptions(F, E).bias(bias)));
  const auto norm_options =
      LayerNormOptions(E).eps(options.layer_norm_eps()).bias(bias);
  norm1 = register_module("norm1", LayerNorm(norm_options));
  norm2 = register_module("norm2", LayerNorm(norm_options));
  dropout1 = register_module("dropout1", torch::nn::Dropout(options.dropout()));
  dropout2 = register_module("dropout2", torch::nn::Dropout(options.dropout()));
}

void TransformerEncoderLayerImpl::reset_parameters() {
  self_attn->reset_parameters();
  linear1->reset_parameters();
  linear2->reset_parameters();
  norm1->reset_parameters();
  norm2->reset_parameters();
}

void TransformerEncoderLayerImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha
         << "mha::TransformerEncoderLayer(d_model=" << options.d_model()
         << ", nhead=" << options.nhead()
         << ", dim_feedforward=" << options.dim_feedforward()
         << ", dropout=" << options.dropout()
         << ", activation=" << detail::activation_name(options.activation())
         << ", layer_norm_eps=" << options.layer_norm_eps()
         << ", batch_first=" << options.batch_first()
         << ", norm_first=" << options.norm_first()
         << ", bias=" << options.bias() << ")";
}

torch::Tensor TransformerEncoderLayerImpl::self_attention_block(
    const torch::Tensor& x, const torch::Tensor& src_mask,
    const torch::Tensor& src_key_padding_mask, bool is_causal,
    const BlockMask& block_mask) {
  auto attended = std::get<0>(self_attn->forward(
      x, torch::Tensor(), torch::Tensor(), src_key_padding_mask,
      /*need_weights=*/false, src_mask, /*average_attn_weights=*/true,
      is_causal, /*positions=*/torch::Tensor(), block_mask));
  return dropout1->forward(attended);
}

torch::Tensor TransformerEncoderLayerImpl::feed_forward_block(
    const torch::Tensor& x) {
  return dropout2->forward(
      detail::feed_forward(x, linear1, dropout, linear2, options.activation()));
}

torch::Tensor TransformerEncoderLayerImpl::forward(
    const torch::Tensor& src, const torch::Tensor& src_mask,
    const torch::Tensor& src_key_padding_mask, bool is_causal,
    const BlockMask& block_mask) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const auto E = options.d_model();
  const char* layout =
      options.batch_first() ? "(N, L, d_model)" : "(L, N, d_model)";
  TORCH_CHECK(src.defined(), "TransformerEncoderLayer: src is undefined");
  TORCH_CHECK((src.dim() == 3 || src.dim() == 2) && src.size(-1) == E,
              "TransformerEncoderLayer: src must be ", layout,
              " batched or (L, d_model) unbatched with d_model = ", E,
              ", but got ", src.sizes());
  const bool batched = src.dim() == 3;
  const auto L = src.size(batched && !options.batch_first() ? 0 : -2);
  const auto N = batched ? src.size(options.batch_first() ? 0 : 1) : 1;
  const auto H = options.nhead();
  const char* module = "TransformerEncoderLayer";
  detail::check_attn_mask(module, "src_mask", src_mask, N, H, L, L, batched,
                          "L", "L");
  detail::check_padding_mask(module, "src_key_padding_mask",
                             src_key_padding_mask, N, L, batched, "L");
  auto x = src;
  if (options.norm_first()) {
    x = x + self_attention_block(norm1->forward(x), src_mask,
                                 src_key_padding_mask, is_causal, block_mask);
    x = x + feed_forward_block(norm2->forward(x));
  } else {
    x = norm1->forward(x + self_attention_block(x, src_mask,
                                                src_key_padding_mask, is_causal,
                                                block_mask));
    x = norm2->forward(x + feed_forward_block(x));
  }
  return x;
}

// ---------------------------------------------------- TransformerEncoder ---

TransformerEncoderImpl::TransformerEncoderImpl(
    const TransformerEncoderOptions& options_)
    : options(options_) {
  reset();
}

void TransformerEncoderImpl::reset() {
  TORCH_CHECK(!options.encoder_layer().is_empty(),
              "TransformerEncoder: encoder_layer is empty (nullptr)");
  TORCH_CHECK(options.num_layers() >= 1,
              "TransformerEncoder: num_layers must be >= 1, but got ",
              options.num_layers());
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_layers(); ++i) {
    layers->push_back(options.encoder_layer()->clone());
  }
  norm = torch::nn::AnyModule();
  if (!options.norm().is_empty()) {
    norm = options.norm().clone();
    register_module("norm", norm.ptr());
  }
}

torch::Tensor TransformerEncoderImpl::forward(
    const torch::Tensor& src, const torch::Tensor& mask,
    const torch::Tensor& src_key_padding_mask, bool is_causal,
    const BlockMask& block_mask) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  auto x = src;
  for (const auto& layer : *layers) {
    x = layer->as<TransformerEncoderLayerImpl>()->forward(
        x, mask, src_key_padding_mask, is_causal, block_mask);
  }
  if (!norm.is_empty()) {
    x = norm.forward(x);
  }
  return x;
}

void TransformerEncoderImpl::pretty_print(std::ostream& stream) const {
  stream << "mha::TransformerEncoder(num_layers=" << options.num_layers()
         << ")";
}

}  // namespace mha
