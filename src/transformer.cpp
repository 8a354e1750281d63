// Glossary: N batch, L sequence length, E = d_model, H = nhead,
// F = dim_feedforward.
#include "mha/transformer.h"

#include <functional>
#include <string>

#include "compat.h"
#include "projection.h"

namespace mha {

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
  TORCH_CHECK(E > 0, "TransformerEncoderLayer: d_model must be > 0, but got ",
              E);
  TORCH_CHECK(H > 0, "TransformerEncoderLayer: nhead must be > 0, but got ", H);
  TORCH_CHECK(E % H == 0, "TransformerEncoderLayer: d_model (", E,
              ") must be divisible by nhead (", H, ")");
  TORCH_CHECK(F > 0,
              "TransformerEncoderLayer: dim_feedforward must be > 0, but got ",
              F);
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "TransformerEncoderLayer: dropout must be in [0, 1), but got ",
              options.dropout());
  TORCH_CHECK(options.layer_norm_eps() > 0.0,
              "TransformerEncoderLayer: layer_norm_eps must be > 0, but got ",
              options.layer_norm_eps());
  if (const auto* f = detail::variant_get_if<
          std::function<torch::Tensor(const torch::Tensor&)>>(
          options.activation())) {
    TORCH_CHECK(static_cast<bool>(*f),
                "TransformerEncoderLayer: activation is an empty callable");
  }
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
         << ", dropout=" << options.dropout() << ", activation=";
  const auto& activation = options.activation();
  if (detail::variant_get_if<torch::enumtype::kReLU>(activation)) {
    stream << "relu";
  } else if (detail::variant_get_if<torch::enumtype::kGELU>(activation)) {
    stream << "gelu";
  } else {
    stream << "<callable>";
  }
  stream << ", layer_norm_eps=" << options.layer_norm_eps()
         << ", batch_first=" << options.batch_first()
         << ", norm_first=" << options.norm_first()
         << ", bias=" << options.bias() << ")";
}

torch::Tensor TransformerEncoderLayerImpl::self_attention_block(
    const torch::Tensor& x, const torch::Tensor& src_mask,
    const torch::Tensor& src_key_padding_mask, bool is_causal) {
  auto attended = std::get<0>(self_attn->forward(
      x, torch::Tensor(), torch::Tensor(), src_key_padding_mask,
      /*need_weights=*/false, src_mask, /*average_attn_weights=*/true,
      is_causal));
  return dropout1->forward(attended);
}

torch::Tensor TransformerEncoderLayerImpl::feed_forward_block(
    const torch::Tensor& x) {
  auto hidden = detail::project(x, linear1->weight, linear1->bias);  // (..., F)
  const auto& activation = options.activation();
  if (detail::variant_get_if<torch::enumtype::kReLU>(activation)) {
    hidden.relu_();  // in place: hidden is this block's own temporary
  } else if (detail::variant_get_if<torch::enumtype::kGELU>(activation)) {
    hidden = torch::gelu(hidden);
  } else {
    hidden = (*detail::variant_get_if<
              std::function<torch::Tensor(const torch::Tensor&)>>(activation))(
        hidden);
  }
  return dropout2->forward(detail::project(dropout->forward(hidden),
                                           linear2->weight, linear2->bias));
}

torch::Tensor TransformerEncoderLayerImpl::forward(
    const torch::Tensor& src, const torch::Tensor& src_mask,
    const torch::Tensor& src_key_padding_mask, bool is_causal) {
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
  if (src_mask.defined()) {
    const bool ok = (src_mask.dim() == 2 && src_mask.size(0) == L &&
                     src_mask.size(1) == L) ||
                    (src_mask.dim() == 3 && src_mask.size(0) == N * H &&
                     src_mask.size(1) == L && src_mask.size(2) == L);
    TORCH_CHECK(ok, "TransformerEncoderLayer: src_mask must be (L, L) = (", L,
                ", ", L, ") or (", batched ? "N*nhead" : "nhead", ", L, L) = (",
                N * H, ", ", L, ", ", L, "), but got ", src_mask.sizes());
  }
  if (src_key_padding_mask.defined()) {
    const bool ok = batched ? src_key_padding_mask.dim() == 2 &&
                                  src_key_padding_mask.size(0) == N &&
                                  src_key_padding_mask.size(1) == L
                            : src_key_padding_mask.dim() == 1 &&
                                  src_key_padding_mask.size(0) == L;
    TORCH_CHECK(ok, "TransformerEncoderLayer: src_key_padding_mask must be ",
                batched ? "(N, L) = (" + std::to_string(N) + ", "
                        : std::string("(L) = ("),
                L, "), but got ", src_key_padding_mask.sizes());
  }
  auto x = src;
  if (options.norm_first()) {
    x = x + self_attention_block(norm1->forward(x), src_mask,
                                 src_key_padding_mask, is_causal);
    x = x + feed_forward_block(norm2->forward(x));
  } else {
    x = norm1->forward(
        x + self_attention_block(x, src_mask, src_key_padding_mask, is_causal));
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
    const torch::Tensor& src_key_padding_mask, bool is_causal) {
  auto x = src;
  for (const auto& layer : *layers) {
    x = layer->as<TransformerEncoderLayerImpl>()->forward(
        x, mask, src_key_padding_mask, is_causal);
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
