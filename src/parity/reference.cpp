// mha::parity's independent references: multi-head attention and the
// encoder and decoder layers and the Transformer written plainly from their
// formulas (mha/parity.h), run in float64 by the checker.
//
// Glossary: N batch, L target length, S source length, S' = S plus the
// add_bias_kv / add_zero_attn positions, E embed_dim, H num_heads,
// D head_dim.
#include <cmath>
#include <limits>
#include <map>
#include <string>

#include "case_tools.h"
#include "mha/parity.h"
#include "mha/weights.h"

namespace mha::parity {
namespace {

using detail::kInf;

torch::Tensor param_or_undefined(
    const std::map<std::string, torch::Tensor>& params,
    const std::string& name) {
  auto it = params.find(name);
  return it == params.end() ? torch::Tensor() : it->second;
}

torch::Tensor affine(const torch::Tensor& x, const torch::Tensor& w,
                     const torch::Tensor& b) {
  auto y = torch::matmul(x, w.t());
  return b.defined() ? y + b : y;
}

/// Adds one (L, S) mask part into `blocked` / `additive` (first S columns).
void add_mask_part(const torch::Tensor& part, torch::Tensor& blocked,
                   torch::Tensor& additive) {
  const auto S = part.size(-1);
  auto blocked_part = blocked.narrow(1, 0, S);
  auto additive_part = additive.narrow(1, 0, S);
  if (part.scalar_type() == torch::kBool) {
    blocked_part.logical_or_(part);
  } else {
    auto p = part.to(additive.scalar_type());
    auto minus_inf = p.eq(-kInf);
    blocked_part.logical_or_(minus_inf);
    additive_part.add_(p.masked_fill(minus_inf, 0.0));
  }
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> reference_attention(
    const MultiHeadAttentionOptions& options,
    const std::map<std::string, torch::Tensor>& params, const Inputs& in) {
  const int64_t E = options.embed_dim();
  const int64_t H = options.num_heads();
  const int64_t D = E / H;
  const int64_t N = in.query.size(0);
  const int64_t L = in.query.size(1);
  const int64_t S = in.key.size(1);
  // The dtype of the inputs: float64, or a half dtype for the half rule's
  // base (judge).
  const auto on = in.query.options();

  torch::Tensor w_q, w_k, w_v;
  auto packed = param_or_undefined(params, "in_proj_weight");
  if (packed.defined()) {
    w_q = packed.narrow(0, 0, E);
    w_k = packed.narrow(0, E, E);
    w_v = packed.narrow(0, 2 * E, E);
  } else {
    w_q = params.at("q_proj_weight");
    w_k = params.at("k_proj_weight");
    w_v = params.at("v_proj_weight");
  }
  torch::Tensor b_q, b_k, b_v;
  auto in_bias = param_or_undefined(params, "in_proj_bias");
  if (in_bias.defined()) {
    b_q = in_bias.narrow(0, 0, E);
    b_k = in_bias.narrow(0, E, E);
    b_v = in_bias.narrow(0, 2 * E, E);
  }
  auto bias_k = param_or_undefined(params, "bias_k");
  auto bias_v = param_or_undefined(params, "bias_v");
  auto w_o = params.at("out_proj.weight");
  auto b_o = param_or_undefined(params, "out_proj.bias");

  std::vector<torch::Tensor> outputs, weights;
  for (int64_t n = 0; n < N; ++n) {
    auto q = affine(in.query[n], w_q, b_q);  // (L, E)
    auto k = affine(in.key[n], w_k, b_k);    // (S, E)
    auto v = affine(in.value[n], w_v, b_v);  // (S, E)
    if (bias_k.defined()) {
      k = torch::cat({k, bias_k.view({1, E})});  // (S+1, E)
      v = torch::cat({v, bias_v.view({1, E})});
    }
    std::vector<torch::Tensor> head_outputs, head_weights;
    for (int64_t h = 0; h < H; ++h) {
      auto q_h = q.narrow(1, h * D, D);  // (L, D)
      auto k_h = k.narrow(1, h * D, D);  // (S', D)
      auto v_h = v.narrow(1, h * D, D);  // (S', D)
      if (options.add_zero_attn()) {
        k_h = torch::cat({k_h, torch::zeros({1, D}, on)});
        v_h = torch::cat({v_h, torch::zeros({1, D}, on)});
      }
      const int64_t S2 = k_h.size(0);
      // Extra columns (bias_kv, zero_attn) stay unblocked and unbiased.
      auto blocked = torch::zeros({L, S2}, on.dtype(torch::kBool));
      auto additive = torch::zeros({L, S2}, on);
      if (in.attn_mask.defined()) {
        add_mask_part(
            in.attn_mask.dim() == 2 ? in.attn_mask : in.attn_mask[n * H + h],
            blocked, additive);
      }
      if (in.key_padding_mask.defined()) {
        add_mask_part(in.key_padding_mask[n].expand({L, S}), blocked, additive);
      }
      if (in.is_causal) {  // key j > query i, over the first S keys
        blocked.narrow(1, 0, S).logical_or_(
            torch::ones({L, S}, blocked.options()).triu(1));
      }
      auto allowed = blocked.logical_not();
      auto scores = torch::matmul(q_h, k_h.t()) / std::sqrt(double(D));
      if (options.score_mod()) {
        // FlexAttention's score_mod on the scaled scores, before the masks.
        const auto index = on.dtype(torch::kLong);
        scores = options.score_mod()(
            scores, torch::scalar_tensor(n, index),
            torch::scalar_tensor(h, index),
            torch::arange(L, index).unsqueeze(1),    // (L, 1)
            torch::arange(S2, index).unsqueeze(0));  // (1, S')
      }
      scores = scores + additive;  // (L, S')
      // Softmax over the allowed keys only; a row with none gets weights 0.
      auto row_max = scores.detach()
                         .masked_fill(blocked, -kInf)
                         .amax(/*dim=*/1, /*keepdim=*/true);
      row_max.masked_fill_(row_max.eq(-kInf), 0.0);
      auto shifted =
          torch::where(allowed, scores - row_max, torch::zeros_like(scores));
      auto e = torch::where(allowed, shifted.exp(), torch::zeros_like(scores));
      auto denom = e.sum(/*dim=*/1, /*keepdim=*/true);
      auto w = e / torch::where(denom.gt(0), denom, torch::ones_like(denom));
      head_outputs.push_back(torch::matmul(w, v_h));  // (L, D)
      head_weights.push_back(w);                      // (L, S')
    }
    outputs.push_back(affine(torch::cat(head_outputs, 1), w_o, b_o));  // (L, E)
    weights.push_back(torch::stack(head_weights));  // (H, L, S')
  }
  return {torch::stack(outputs), torch::stack(weights)};
}

namespace {

/// The parameters under `prefix` (e.g. "self_attn."), the prefix removed.
std::map<std::string, torch::Tensor> sub_params(
    const std::map<std::string, torch::Tensor>& params,
    const std::string& prefix) {
  std::map<std::string, torch::Tensor> sub;
  for (const auto& [name, value] : params) {
    if (name.rfind(prefix, 0) == 0) {
      sub[name.substr(prefix.size())] = value;
    }
  }
  return sub;
}

/// The pieces every Transformer layer is made of, written out: layer norm
/// (biased variance), the feed-forward block with relu or exact gelu.
struct LayerPieces {
  const std::map<std::string, torch::Tensor>& params;
  double eps;
  bool gelu;

  torch::Tensor p(const std::string& name) const {
    return param_or_undefined(params, name);
  }
  torch::Tensor norm(const torch::Tensor& x, const std::string& name) const {
    auto mean = x.mean(-1, /*keepdim=*/true);
    auto var = (x - mean).pow(2).mean(-1, /*keepdim=*/true);  // biased
    auto y = (x - mean) / torch::sqrt(var + eps) * p(name + ".weight");
    auto b = p(name + ".bias");
    return b.defined() ? y + b : y;
  }
  torch::Tensor feed_forward(const torch::Tensor& x) const {
    auto h = affine(x, p("linear1.weight"), p("linear1.bias"));
    h = gelu ? 0.5 * h * (1.0 + torch::erf(h / std::sqrt(2.0)))
             : h.clamp_min(0.0);
    return affine(h, p("linear2.weight"), p("linear2.bias"));
  }
};

}  // namespace

torch::Tensor reference_encoder_layer(
    const TransformerEncoderLayerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& in) {
  const LayerPieces layer{params, options.layer_norm_eps(), gelu};
  const auto attn_params = sub_params(params, "self_attn.");
  const auto attn_options =
      MultiHeadAttentionOptions(options.d_model(), options.nhead())
          .bias(options.bias());
  auto self_attention = [&](const torch::Tensor& x) {
    Inputs a = in;
    a.query = a.key = a.value = x;
    return std::get<0>(reference_attention(attn_options, attn_params, a));
  };
  auto x = in.query;  // (N, L, E)
  if (options.norm_first()) {
    x = x + self_attention(layer.norm(x, "norm1"));
    return x + layer.feed_forward(layer.norm(x, "norm2"));
  }
  x = layer.norm(x + self_attention(x), "norm1");
  return layer.norm(x + layer.feed_forward(x), "norm2");
}

torch::Tensor reference_decoder_layer(
    const TransformerDecoderLayerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& in) {
  const LayerPieces layer{params, options.layer_norm_eps(), gelu};
  const auto self_params = sub_params(params, "self_attn.");
  const auto cross_params = sub_params(params, "multihead_attn.");
  const auto attn_options =
      MultiHeadAttentionOptions(options.d_model(), options.nhead())
          .bias(options.bias());
  auto self_attention = [&](const torch::Tensor& x) {
    Inputs a;
    a.query = a.key = a.value = x;
    a.is_causal = in.is_causal;  // tgt_is_causal; no other target mask
    return std::get<0>(reference_attention(attn_options, self_params, a));
  };
  auto cross_attention = [&](const torch::Tensor& x) {
    Inputs a = in;  // memory as key and value, the memory masks
    a.query = x;
    a.is_causal = false;
    return std::get<0>(reference_attention(attn_options, cross_params, a));
  };
  auto x = in.query;  // (N, L, E)
  if (options.norm_first()) {
    x = x + self_attention(layer.norm(x, "norm1"));
    x = x + cross_attention(layer.norm(x, "norm2"));
    return x + layer.feed_forward(layer.norm(x, "norm3"));
  }
  x = layer.norm(x + self_attention(x), "norm1");
  x = layer.norm(x + cross_attention(x), "norm2");
  return layer.norm(x + layer.feed_forward(x), "norm3");
}

torch::Tensor reference_transformer(
    const TransformerOptions& options, bool gelu,
    const std::map<std::string, torch::Tensor>& params, const Inputs& in) {
  const LayerPieces pieces{params, options.layer_norm_eps(), gelu};
  const auto E = options.d_model();
  const auto H = options.nhead();
  const auto encoder_layer = TransformerEncoderLayerOptions(E, H)
                                 .layer_norm_eps(options.layer_norm_eps())
                                 .norm_first(options.norm_first())
                                 .bias(options.bias());
  Inputs src;  // self-attention over src with its padding
  src.query = src.key = src.value = in.key;
  src.key_padding_mask = in.key_padding_mask;
  for (int64_t i = 0; i < options.num_encoder_layers(); ++i) {
    src.query = src.key = src.value = reference_encoder_layer(
        encoder_layer, gelu,
        sub_params(params, "encoder.layers." + std::to_string(i) + "."), src);
  }
  Inputs tgt = in;
  tgt.key = tgt.value = pieces.norm(src.query, "encoder.norm");  // memory
  const auto decoder_layer = TransformerDecoderLayerOptions(E, H)
                                 .layer_norm_eps(options.layer_norm_eps())
                                 .norm_first(options.norm_first())
                                 .bias(options.bias());
  for (int64_t i = 0; i < options.num_decoder_layers(); ++i) {
    tgt.query = reference_decoder_layer(
        decoder_layer, gelu,
        sub_params(params, "decoder.layers." + std::to_string(i) + "."), tgt);
  }
  return pieces.norm(tgt.query, "decoder.norm");
}

}  // namespace mha::parity
