// mha::hf's loaders of the modules other than MultiHeadAttention
// (mha/hf.h): load_latent_attention (DeepSeek-V2 / V3's Multi-head Latent
// Attention) and load_gated_delta_net (Qwen3-Next's linear layers). Facts
// from transformers 5.x's configuration_deepseek_v3.py / _v2.py /
// configuration_qwen3_next.py and DeepseekV3Attention /
// DeepseekV2Attention / Qwen3NextGatedDeltaNet.
#include <cmath>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <string>

#include "hf_internal.h"
#include "mha/hf.h"

namespace mha::hf {

namespace {

/// Copies into every parameter of `module` the checkpoint's tensor of the
/// same name under `model.<prefix>` (transformers' names are the module's),
/// in the checkpoint's dtype; eval mode.
void load_named(torch::nn::Module& module, const std::string& model_dir,
                const std::string& prefix) {
  const auto tensors = detail::read_prefixed(model_dir, "model.", prefix);
  torch::NoGradGuard no_grad;
  bool first = true;
  for (auto& p : module.named_parameters()) {
    const auto w = tensors.get(prefix + p.key(), p.value().sizes());
    if (first) {
      module.to(w.scalar_type());
      first = false;
    }
    p.value().copy_(w);
  }
  module.eval();
}

/// model_dir's config.json, read for a loader of `what` (e.g. "Gated
/// DeltaNet layers"): `where` names the file, `type` is its model_type.
struct FamilyConfig {
  nlohmann::json config;
  std::string where, type;
};

/// c10::Error naming the file unless its model_type is one of `types`
/// (listed as supported) and `layer` is within num_hidden_layers.
FamilyConfig family_config(const std::string& model_dir, int64_t layer,
                           std::initializer_list<const char*> types,
                           const char* what) {
  FamilyConfig c;
  c.where = model_dir + "/config.json";
  c.config = detail::parse_config(detail::read_config_text(model_dir), c.where);
  c.type = detail::opt_string(c.config, "model_type", "", c.where);
  bool known = false;
  std::string supported;
  for (const char* t : types) {
    known = known || c.type == t;
    supported += (supported.empty() ? "" : ", ") + std::string(t);
  }
  TORCH_CHECK(known, c.where, ": model_type '", c.type, "' has no ", what,
              " (supported: ", supported, ")");
  const int64_t layers =
      detail::get_int(c.config, {"num_hidden_layers"}, c.where);
  TORCH_CHECK(layer >= 0 && layer < layers, c.where, ": layer ", layer,
              " out of range: the model has ", layers,
              " layers (expected 0 <= layer < ", layers, ")");
  return c;
}

}  // namespace

MultiHeadLatentAttention load_latent_attention(const std::string& model_dir,
                                               int64_t layer) {
  using detail::get_int;
  using detail::opt_bool;
  using detail::opt_int;
  const auto [config, where, t] =
      family_config(model_dir, layer, {"deepseek_v2", "deepseek_v3"},
                    "Multi-head Latent Attention");
  const int64_t E = get_int(config, {"hidden_size"}, where);
  const int64_t H = get_int(config, {"num_attention_heads"}, where);
  MultiHeadLatentAttentionOptions o(E, H);
  // q_lora_rank null: a plain q_proj (DeepSeek-V2-Lite).
  o.q_lora_rank(opt_int(config, "q_lora_rank", 0, where));
  o.kv_lora_rank(get_int(config, {"kv_lora_rank"}, where));
  o.qk_nope_head_dim(opt_int(config, "qk_nope_head_dim", 128, where));
  o.qk_rope_head_dim(get_int(config, {"qk_rope_head_dim"}, where));
  o.v_head_dim(get_int(config, {"v_head_dim"}, where));
  o.bias(opt_bool(config, "attention_bias", false, where));
  // config.json's head_dim is qk_rope_head_dim for DeepSeek: not read.
  const auto [theta, scaling] =
      detail::rotary_of(config, o.qk_rope_head_dim(), where);
  o.rotary_theta(theta).rotary_scaling(scaling);
  if (t == "deepseek_v3") {
    o.rotary_pairing(opt_bool(config, "rope_interleave", true, where)
                         ? RotaryPairing::kInterleaved
                         : RotaryPairing::kHalf);
  } else {
    // DeepseekV2Attention: complex rotary (interleaved pairs), scale
    // qk_head_dim^-1/2 without yarn's mscale.
    o.rotary_pairing(RotaryPairing::kInterleaved);
    o.scale(1.0 / std::sqrt(static_cast<double>(o.qk_nope_head_dim() +
                                                o.qk_rope_head_dim())));
  }
  MultiHeadLatentAttention module(o);
  load_named(*module, model_dir,
             "layers." + std::to_string(layer) + ".self_attn.");
  return module;
}

namespace detail {

std::string qwen3_next_layer_type(const nlohmann::json& config, int64_t layer,
                                  const std::string& where) {
  // layer_types (5.x), else every full_attention_interval-th layer is full.
  if (auto type = layer_types_entry(config, layer, where)) {
    return *type;
  }
  return (layer + 1) % opt_int(config, "full_attention_interval", 4, where)
             ? "linear_attention"
             : "full_attention";
}

}  // namespace detail

GatedDeltaNet load_gated_delta_net(const std::string& model_dir,
                                   int64_t layer) {
  using detail::get_int;
  using detail::opt_double;
  using detail::opt_int;
  const auto [config, where, t] =
      family_config(model_dir, layer, {"qwen3_next"}, "Gated DeltaNet layers");
  const std::string type = detail::qwen3_next_layer_type(config, layer, where);
  TORCH_CHECK(type == "linear_attention", where, ": layer_types[", layer,
              "] is '", type,
              "', not a Gated DeltaNet layer (load_attention reads "
              "full_attention layers)");
  const std::string act =
      detail::opt_string(config, "hidden_act", "silu", where);
  TORCH_CHECK(act == "silu", where, ": hidden_act '", act,
              "' is not supported (Gated DeltaNet's convolution and gate use "
              "silu)");
  GatedDeltaNetOptions o(get_int(config, {"hidden_size"}, where));
  o.num_key_heads(get_int(config, {"linear_num_key_heads"}, where))
      .num_value_heads(get_int(config, {"linear_num_value_heads"}, where))
      .key_head_dim(get_int(config, {"linear_key_head_dim"}, where))
      .value_head_dim(get_int(config, {"linear_value_head_dim"}, where))
      .conv_kernel_dim(opt_int(config, "linear_conv_kernel_dim", 4, where))
      .norm_eps(opt_double(config, "rms_norm_eps", 1e-6, where));
  GatedDeltaNet module(o);
  load_named(*module, model_dir,
             "layers." + std::to_string(layer) + ".linear_attn.");
  return module;
}

}  // namespace mha::hf
