// TransformerDecoderLayer, TransformerDecoder and Transformer
// (mha/transformer_decoder.h), with cached decoding.
//
// Glossary: N batch, T target (tgt) length, S source (memory) length,
// E = d_model, H = nhead, F = dim_feedforward.
#include "mha/transformer_decoder.h"

#include <string>
#include <utility>

#include "core/blas_threads.h"
#include "mha/masks.h"
#include "modules/transformer_blocks.h"

namespace mha {
namespace {

/// Length and batch size of x in the layout of batch_first ((N, T, E),
/// (T, N, E) or unbatched (T, E)).
struct Layout {
  int64_t length = 0;
  int64_t batch = 1;
};

Layout layout_of(const torch::Tensor& x, bool batch_first) {
  if (x.dim() == 2) {
    return {x.size(0), 1};
  }
  return batch_first ? Layout{x.size(1), x.size(0)}
                     : Layout{x.size(0), x.size(1)};
}

/// Checks that x is (N, T, d_model) in the module's layout, or unbatched
/// (T, d_model).
void check_sequence(const char* module, const char* name,
                    const torch::Tensor& x, int64_t d_model, bool batch_first,
                    const char* length) {
  TORCH_CHECK(x.defined(), module, ": ", name, " is undefined");
  const std::string l(length);
  TORCH_CHECK(
      (x.dim() == 3 || x.dim() == 2) && x.size(-1) == d_model, module, ": ",
      name, " must be ",
      batch_first ? "(N, " + l + ", d_model)" : "(" + l + ", N, d_model)",
      " batched or (", l, ", d_model) unbatched with d_model = ", d_model,
      ", but got ", x.sizes());
}

/// Checks that memory has tgt's dims and batch size.
void check_memory(const char* module, const torch::Tensor& tgt,
                  const torch::Tensor& memory, int64_t d_model,
                  bool batch_first) {
  check_sequence(module, "memory", memory, d_model, batch_first, "S");
  TORCH_CHECK(
      memory.dim() == tgt.dim() && layout_of(memory, batch_first).batch ==
                                       layout_of(tgt, batch_first).batch,
      module, ": memory must have tgt's dims and batch size, but got tgt ",
      tgt.sizes(), " and memory ", memory.sizes());
}

/// The options of the Transformer's encoder or decoder layers.
template <typename LayerOptions>
LayerOptions layer_options(const TransformerOptions& o) {
  return LayerOptions(o.d_model(), o.nhead())
      .dim_feedforward(o.dim_feedforward())
      .dropout(o.dropout())
      .activation(o.activation())
      .layer_norm_eps(o.layer_norm_eps())
      .batch_first(o.batch_first())
      .norm_first(o.norm_first())
      .bias(o.bias());
}

}  // namespace

// ----------------------------------------------- TransformerDecoderLayer ---

TransformerDecoderLayerImpl::TransformerDecoderLayerImpl(
    const TransformerDecoderLayerOptions& options_)
    : options(options_) {
  reset();
}

void TransformerDecoderLayerImpl::reset() {
  const auto E = options.d_model();
  const auto H = options.nhead();
  const auto F = options.dim_feedforward();
  detail::check_layer_options(options, "TransformerDecoderLayer");
  const bool bias = options.bias();
  const auto attention_options = MultiHeadAttentionOptions(E, H)
                                     .dropout(options.dropout())
                                     .bias(bias)
                                     .batch_first(options.batch_first());
  // Registration order as PyTorch's.
  self_attn =
      register_module("self_attn", MultiHeadAttention(attention_options));
  multihead_attn =
      register_module("multihead_attn", MultiHeadAttention(attention_options));
  linear1 = register_module(
      "linear1", torch::nn::Linear(torch::nn::LinearOptions(E, F).bias(bias)));
  dropout = register_module("dropout", torch::nn::Dropout(options.dropout()));
  linear2 = register_module(
      "linear2", torch::nn::Linear(torch::nn::LinearOptions(F, E).bias(bias)));
  const auto norm_options =
      LayerNormOptions(E).eps(options.layer_norm_eps()).bias(bias);
  norm1 = register_module("norm1", LayerNorm(norm_options));
  norm2 = register_module("norm2", LayerNorm(norm_options));
  norm3 = register_module("norm3", LayerNorm(norm_options));
  dropout1 = register_module("dropout1", torch::nn::Dropout(options.dropout()));
  dropout2 = register_module("dropout2", torch::nn::Dropout(options.dropout()));
  dropout3 = register_module("dropout3", torch::nn::Dropout(options.dropout()));
}

void TransformerDecoderLayerImpl::reset_parameters() {
  self_attn->reset_parameters();
  multihead_attn->reset_parameters();
  linear1->reset_parameters();
  linear2->reset_parameters();
  norm1->reset_parameters();
  norm2->reset_parameters();
  norm3->reset_parameters();
}

void TransformerDecoderLayerImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha
         << "mha::TransformerDecoderLayer(d_model=" << options.d_model()
         << ", nhead=" << options.nhead()
         << ", dim_feedforward=" << options.dim_feedforward()
         << ", dropout=" << options.dropout()
         << ", activation=" << detail::activation_name(options.activation())
         << ", layer_norm_eps=" << options.layer_norm_eps()
         << ", batch_first=" << options.batch_first()
         << ", norm_first=" << options.norm_first()
         << ", bias=" << options.bias() << ")";
}

template <typename SelfAttention, typename CrossAttention>
torch::Tensor TransformerDecoderLayerImpl::blocks(const torch::Tensor& tgt,
                                                  SelfAttention&& sa,
                                                  CrossAttention&& ca) {
  auto ff = [this](const torch::Tensor& x) {
    return dropout3->forward(detail::feed_forward(x, linear1, dropout, linear2,
                                                  options.activation()));
  };
  auto x = tgt;
  if (options.norm_first()) {
    x = x + dropout1->forward(sa(norm1->forward(x)));
    x = x + dropout2->forward(ca(norm2->forward(x)));
    x = x + ff(norm3->forward(x));
  } else {
    x = norm1->forward(x + dropout1->forward(sa(x)));
    x = norm2->forward(x + dropout2->forward(ca(x)));
    x = norm3->forward(x + ff(x));
  }
  return x;
}

torch::Tensor TransformerDecoderLayerImpl::forward(
    const torch::Tensor& tgt, const torch::Tensor& memory,
    const torch::Tensor& tgt_mask, const torch::Tensor& memory_mask,
    const torch::Tensor& tgt_key_padding_mask,
    const torch::Tensor& memory_key_padding_mask, bool tgt_is_causal,
    bool memory_is_causal) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const char* module = "TransformerDecoderLayer";
  const auto E = options.d_model();
  const bool batch_first = options.batch_first();
  check_sequence(module, "tgt", tgt, E, batch_first, "T");
  check_memory(module, tgt, memory, E, batch_first);
  const bool batched = tgt.dim() == 3;
  const auto t = layout_of(tgt, batch_first);
  const auto N = t.batch;
  const auto T = t.length;
  const auto S = layout_of(memory, batch_first).length;
  const auto H = options.nhead();
  detail::check_attn_mask(module, "tgt_mask", tgt_mask, N, H, T, T, batched,
                          "T", "T");
  detail::check_attn_mask(module, "memory_mask", memory_mask, N, H, T, S,
                          batched, "T", "S");
  detail::check_padding_mask(module, "tgt_key_padding_mask",
                             tgt_key_padding_mask, N, T, batched, "T");
  detail::check_padding_mask(module, "memory_key_padding_mask",
                             memory_key_padding_mask, N, S, batched, "S");
  auto sa = [&](const torch::Tensor& x) {
    return std::get<0>(self_attn->forward(
        x, torch::Tensor(), torch::Tensor(), tgt_key_padding_mask,
        /*need_weights=*/false, tgt_mask, /*average_attn_weights=*/true,
        tgt_is_causal));
  };
  auto ca = [&](const torch::Tensor& x) {
    return std::get<0>(multihead_attn->forward(
        x, memory, memory, memory_key_padding_mask, /*need_weights=*/false,
        memory_mask, /*average_attn_weights=*/true, memory_is_causal));
  };
  return blocks(tgt, sa, ca);
}

torch::Tensor TransformerDecoderLayerImpl::forward_cached(
    const torch::Tensor& tgt, KVCache& cache, const ProjectedKeyValue& memory,
    const torch::Tensor& memory_key_padding_mask) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  check_sequence("TransformerDecoderLayer::forward_cached", "tgt", tgt,
                 options.d_model(), options.batch_first(), "T");
  auto sa = [&](const torch::Tensor& x) {
    return std::get<0>(self_attn->forward_cached(x, cache, /*is_causal=*/true,
                                                 /*need_weights=*/false));
  };
  auto ca = [&](const torch::Tensor& x) {
    return std::get<0>(multihead_attn->forward_projected(
        x, memory, memory_key_padding_mask, /*need_weights=*/false));
  };
  return blocks(tgt, sa, ca);
}

// ---------------------------------------------------- TransformerDecoder ---

TransformerDecoderImpl::TransformerDecoderImpl(
    const TransformerDecoderOptions& options_)
    : options(options_) {
  reset();
}

void TransformerDecoderImpl::reset() {
  TORCH_CHECK(!options.decoder_layer().is_empty(),
              "TransformerDecoder: decoder_layer is empty (nullptr)");
  TORCH_CHECK(options.num_layers() >= 1,
              "TransformerDecoder: num_layers must be >= 1, but got ",
              options.num_layers());
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_layers(); ++i) {
    layers->push_back(options.decoder_layer()->clone());
  }
  norm = torch::nn::AnyModule();
  if (!options.norm().is_empty()) {
    norm = options.norm().clone();
    register_module("norm", norm.ptr());
  }
}

torch::Tensor TransformerDecoderImpl::forward(
    const torch::Tensor& tgt, const torch::Tensor& memory,
    const torch::Tensor& tgt_mask, const torch::Tensor& memory_mask,
    const torch::Tensor& tgt_key_padding_mask,
    const torch::Tensor& memory_key_padding_mask, bool tgt_is_causal,
    bool memory_is_causal) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  auto x = tgt;
  for (const auto& layer : *layers) {
    x = layer->as<TransformerDecoderLayerImpl>()->forward(
        x, memory, tgt_mask, memory_mask, tgt_key_padding_mask,
        memory_key_padding_mask, tgt_is_causal, memory_is_causal);
  }
  if (!norm.is_empty()) {
    x = norm.forward(x);
  }
  return x;
}

TransformerDecoderCache TransformerDecoderImpl::make_cache(
    const torch::Tensor& memory, int64_t capacity,
    const torch::Tensor& memory_key_padding_mask) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const char* module = "TransformerDecoder::make_cache";
  const auto& first = *layers->ptr<TransformerDecoderLayerImpl>(0);
  const bool batch_first = first.options.batch_first();
  check_sequence(module, "memory", memory, first.options.d_model(), batch_first,
                 "S");
  TORCH_CHECK(capacity >= 0, module, ": capacity must be >= 0, but got ",
              capacity);
  const auto m = layout_of(memory, batch_first);
  detail::check_padding_mask(module, "memory_key_padding_mask",
                             memory_key_padding_mask, m.batch, m.length,
                             memory.dim() == 3, "S");
  if (memory_key_padding_mask.defined()) {
    check_mask(memory_key_padding_mask, "memory_key_padding_mask",
               memory.scalar_type(), memory.device());
  }
  TransformerDecoderCache cache;
  cache.memory_key_padding_mask = memory_key_padding_mask;
  for (const auto& module_ptr : *layers) {
    auto& layer = *module_ptr->as<TransformerDecoderLayerImpl>();
    cache.self_attention.push_back(
        layer.self_attn->make_kv_cache(m.batch, capacity));
    cache.memory.push_back(
        layer.multihead_attn->project_key_value(memory, memory));
  }
  return cache;
}

torch::Tensor TransformerDecoderImpl::forward_cached(
    const torch::Tensor& tgt, TransformerDecoderCache& cache) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  TORCH_CHECK(cache.self_attention.size() == layers->size() &&
                  cache.memory.size() == layers->size(),
              "TransformerDecoder::forward_cached: cache must hold one entry "
              "per layer (",
              layers->size(), "), but holds ", cache.self_attention.size(),
              " self-attention and ", cache.memory.size(),
              " memory entries (make it with make_cache)");
  auto x = tgt;
  for (size_t i = 0; i < layers->size(); ++i) {
    x = layers->ptr<TransformerDecoderLayerImpl>(i)->forward_cached(
        x, cache.self_attention[i], cache.memory[i],
        cache.memory_key_padding_mask);
  }
  if (!norm.is_empty()) {
    x = norm.forward(x);
  }
  return x;
}

void TransformerDecoderImpl::pretty_print(std::ostream& stream) const {
  stream << "mha::TransformerDecoder(num_layers=" << options.num_layers()
         << ")";
}

// ----------------------------------------------------------- Transformer ---

TransformerImpl::TransformerImpl(const TransformerOptions& options_)
    : options(options_) {
  reset();
}

void TransformerImpl::reset() {
  const char* module = "Transformer";
  TORCH_CHECK(
      options.num_encoder_layers() >= 1 || !options.custom_encoder().is_empty(),
      module, ": num_encoder_layers must be >= 1, but got ",
      options.num_encoder_layers());
  TORCH_CHECK(
      options.num_decoder_layers() >= 1 || !options.custom_decoder().is_empty(),
      module, ": num_decoder_layers must be >= 1, but got ",
      options.num_decoder_layers());
  const auto E = options.d_model();
  TORCH_CHECK(E > 0, module, ": d_model must be > 0, but got ", E);
  TORCH_CHECK(options.layer_norm_eps() > 0.0, module,
              ": layer_norm_eps must be > 0, but got ",
              options.layer_norm_eps());
  // The final norms of the built-in encoder and decoder, as Python's.
  const auto norm_options =
      LayerNormOptions(E).eps(options.layer_norm_eps()).bias(options.bias());
  if (!options.custom_encoder().is_empty()) {
    encoder = options.custom_encoder().clone();
  } else {
    encoder = torch::nn::AnyModule(TransformerEncoder(
        TransformerEncoderOptions(
            TransformerEncoderLayer(
                layer_options<TransformerEncoderLayerOptions>(options)),
            options.num_encoder_layers())
            .norm(torch::nn::AnyModule(LayerNorm(norm_options)))));
  }
  if (!options.custom_decoder().is_empty()) {
    decoder = options.custom_decoder().clone();
  } else {
    decoder = torch::nn::AnyModule(TransformerDecoder(
        TransformerDecoderOptions(
            TransformerDecoderLayer(
                layer_options<TransformerDecoderLayerOptions>(options)),
            options.num_decoder_layers())
            .norm(torch::nn::AnyModule(LayerNorm(norm_options)))));
  }
  register_module("encoder", encoder.ptr());
  register_module("decoder", decoder.ptr());
  reset_parameters();
}

void TransformerImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto& p : parameters()) {
    if (p.dim() > 1) {
      torch::nn::init::xavier_uniform_(p);
    }
  }
}

torch::Tensor TransformerImpl::forward(
    const torch::Tensor& src, const torch::Tensor& tgt,
    const torch::Tensor& src_mask, const torch::Tensor& tgt_mask,
    const torch::Tensor& memory_mask, const torch::Tensor& src_key_padding_mask,
    const torch::Tensor& tgt_key_padding_mask,
    const torch::Tensor& memory_key_padding_mask, bool src_is_causal,
    bool tgt_is_causal, bool memory_is_causal) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const char* module = "Transformer";
  const auto E = options.d_model();
  const bool batch_first = options.batch_first();
  check_sequence(module, "src", src, E, batch_first, "S");
  check_sequence(module, "tgt", tgt, E, batch_first, "T");
  TORCH_CHECK(src.dim() == tgt.dim() && layout_of(src, batch_first).batch ==
                                            layout_of(tgt, batch_first).batch,
              module,
              ": src and tgt must have the same dims and batch size, but got "
              "src ",
              src.sizes(), " and tgt ", tgt.sizes());
  auto memory = encode(src, src_mask, src_key_padding_mask, src_is_causal);
  return decoder.forward(tgt, memory, tgt_mask, memory_mask,
                         tgt_key_padding_mask, memory_key_padding_mask,
                         tgt_is_causal, memory_is_causal);
}

torch::Tensor TransformerImpl::encode(const torch::Tensor& src,
                                      const torch::Tensor& src_mask,
                                      const torch::Tensor& src_key_padding_mask,
                                      bool src_is_causal) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  return encoder.forward(src, src_mask, src_key_padding_mask, src_is_causal);
}

TransformerDecoderImpl& TransformerImpl::builtin_decoder(const char* caller) {
  auto* builtin = decoder.ptr()->as<TransformerDecoderImpl>();
  TORCH_CHECK(builtin != nullptr, "Transformer::", caller,
              ": needs the built-in mha::TransformerDecoder, but "
              "custom_decoder is another module");
  return *builtin;
}

TransformerDecoderCache TransformerImpl::make_cache(
    const torch::Tensor& memory, int64_t capacity,
    const torch::Tensor& memory_key_padding_mask) {
  return builtin_decoder("make_cache")
      .make_cache(memory, capacity, memory_key_padding_mask);
}

torch::Tensor TransformerImpl::forward_cached(const torch::Tensor& tgt,
                                              TransformerDecoderCache& cache) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  return builtin_decoder("forward_cached").forward_cached(tgt, cache);
}

torch::Tensor TransformerImpl::generate_square_subsequent_mask(
    int64_t L, torch::TensorOptions options) {
  return mha::generate_square_subsequent_mask(L, options);
}

void TransformerImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha << "mha::Transformer(d_model=" << options.d_model()
         << ", nhead=" << options.nhead()
         << ", num_encoder_layers=" << options.num_encoder_layers()
         << ", num_decoder_layers=" << options.num_decoder_layers()
         << ", dim_feedforward=" << options.dim_feedforward()
         << ", dropout=" << options.dropout()
         << ", activation=" << detail::activation_name(options.activation())
         << ", layer_norm_eps=" << options.layer_norm_eps()
         << ", batch_first=" << options.batch_first()
         << ", norm_first=" << options.norm_first()
         << ", bias=" << options.bias() << ")";
}

}  // namespace mha
