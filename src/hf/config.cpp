// mha::hf, the config layer (hf_internal.h): config.json of transformers 4.x
// or 5.x to the options of one layer's self-attention, family by family.
// Facts from transformers' configuration_<family>.py and
// modeling_<family>.py (and modeling_rope_utils.py for rope_parameters);
// README.md, "Porting a Hugging Face model", lists the keys read.
//
// Glossary: E hidden size, H query heads, Hkv key/value heads, D head_dim.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "hf_internal.h"
#include "mha/hf.h"

namespace mha::hf::detail {
namespace {

using nlohmann::json;

/// The value of the first of `keys` that config holds and is not null, or
/// nullptr.
const json* find_key(const json& config,
                     std::initializer_list<const char*> keys,
                     std::string* found = nullptr) {
  for (const char* key : keys) {
    auto it = config.find(key);
    if (it != config.end() && !it->is_null()) {
      if (found != nullptr) {
        *found = key;
      }
      return &*it;
    }
  }
  return nullptr;
}

std::string key_list(std::initializer_list<const char*> keys) {
  std::string out;
  for (const char* key : keys) {
    out += (out.empty() ? "" : " or ") + std::string(key);
  }
  return out;
}

/// A required integer: the first of `keys` present.
int64_t get_int(const json& config, std::initializer_list<const char*> keys,
                const std::string& where) {
  std::string key;
  const json* value = find_key(config, keys, &key);
  TORCH_CHECK(value != nullptr, where, ": needs ", key_list(keys),
              " (an integer), which it lacks");
  TORCH_CHECK(value->is_number_integer() && value->get<int64_t>() > 0, where,
              ": ", key, " must be an integer > 0, got ", value->dump());
  return value->get<int64_t>();
}

/// An optional integer, `fallback` when absent or null.
int64_t opt_int(const json& config, const char* key, int64_t fallback,
                const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_number_integer(), where, ": ", key,
              " must be an integer, got ", value->dump());
  return value->get<int64_t>();
}

double opt_double(const json& config, const char* key, double fallback,
                  const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_number(), where, ": ", key, " must be a number, got ",
              value->dump());
  return value->get<double>();
}

bool opt_bool(const json& config, const char* key, bool fallback,
              const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_boolean(), where, ": ", key,
              " must be true or false, got ", value->dump());
  return value->get<bool>();
}

std::string opt_string(const json& config, const char* key,
                       const std::string& fallback, const std::string& where) {
  const json* value = find_key(config, {key});
  if (value == nullptr) {
    return fallback;
  }
  TORCH_CHECK(value->is_string(), where, ": ", key, " must be a string, got ",
              value->dump());
  return value->get<std::string>();
}

/// The rotary settings of a layer, from either generation of config.json:
/// 5.x `rope_parameters` (one dict, or one per entry of layer_types), 4.x
/// `rope_theta` + `rope_scaling` at the top level. GPT-NeoX 4.x
/// (rotary_emb_base, rotary_pct) and GPT-J (rotary_dim) are read by their
/// families.
struct Rope {
  json params = json::object();  // rope_type, factor, ... as in the config
  std::string params_key;        // "rope_parameters" or "rope_scaling"
  double theta = 10000.0;
  std::string rope_type = "default";
  c10::optional<double> partial_rotary_factor;
};

Rope read_rope(const json& config, int64_t layer, double default_theta,
               const std::string& where) {
  Rope rope;
  rope.theta = opt_double(config, "rope_theta", default_theta, where);
  const json* params = find_key(config, {"rope_parameters"});
  if (params != nullptr) {
    rope.params_key = "rope_parameters";
  } else {
    params = find_key(config, {"rope_scaling"});
    rope.params_key = "rope_scaling";
  }
  if (params != nullptr) {
    TORCH_CHECK(params->is_object(), where, ": ", rope.params_key,
                " must be an object, got ", params->dump());
    rope.params = *params;
    // 5.x: one dict per layer type ({"full_attention": {...}, ...}).
    const json* types = find_key(config, {"layer_types"});
    if (types != nullptr && types->is_array() &&
        layer < static_cast<int64_t>(types->size()) &&
        (*types)[layer].is_string() &&
        params->contains((*types)[layer].get<std::string>()) &&
        (*params)[(*types)[layer].get<std::string>()].is_object()) {
      rope.params_key += "." + (*types)[layer].get<std::string>();
      rope.params = (*params)[(*types)[layer].get<std::string>()];
    }
  }
  rope.theta = opt_double(rope.params, "rope_theta", rope.theta, where);
  rope.rope_type = opt_string(rope.params, "type", "default", where);
  rope.rope_type = opt_string(rope.params, "rope_type", rope.rope_type, where);
  if (rope.params.contains("partial_rotary_factor") &&
      !rope.params["partial_rotary_factor"].is_null()) {
    rope.partial_rotary_factor =
        opt_double(rope.params, "partial_rotary_factor", 1.0, where);
  } else if (config.contains("partial_rotary_factor") &&
             !config["partial_rotary_factor"].is_null()) {
    rope.partial_rotary_factor =
        opt_double(config, "partial_rotary_factor", 1.0, where);
  }
  return rope;
}

/// Sets the rotary options of `o` from `rope`, with `rotary_dim` features
/// rotated per head (nullopt: all of head_dim).
void set_rotary(MultiHeadAttentionOptions& o, const Rope& rope,
                c10::optional<int64_t> rotary_dim, RotaryPairing pairing,
                int64_t max_position_embeddings, const std::string& where) {
  const int64_t head_dim = o.embed_dim() / o.num_heads();
  o.rotary(true).rotary_theta(rope.theta).rotary_pairing(pairing);
  TORCH_CHECK(std::isfinite(rope.theta) && rope.theta > 0, where, ": ",
              rope.params_key, ".rope_theta must be finite and > 0, got ",
              rope.theta);
  if (rotary_dim.has_value() && *rotary_dim != head_dim) {
    TORCH_CHECK(false, where, ": rotating ", *rotary_dim, " of head_dim ",
                head_dim,
                " features (partial rotary) is not supported by this build "
                "(MultiHeadAttentionOptions has no rotary_dim yet)");
  }
  TORCH_CHECK(rope.rope_type == "default", where, ": ", rope.params_key,
              ".rope_type '", rope.rope_type,
              "' is not supported by this build (only 'default': "
              "MultiHeadAttentionOptions has no rotary_scaling yet)");
  (void)max_position_embeddings;
}

/// Rotated features per head from a partial_rotary_factor (GPT-NeoX:
/// int(head_dim * rotary_pct), as transformers).
c10::optional<int64_t> partial_dim(const Rope& rope, int64_t head_dim) {
  if (!rope.partial_rotary_factor.has_value()) {
    return c10::nullopt;
  }
  return static_cast<int64_t>(static_cast<double>(head_dim) *
                              *rope.partial_rotary_factor);
}

/// Checks that the config's head_dim (when present) is E / H, the only
/// head size mha's module has.
void check_head_dim(const json& config, int64_t embed_dim, int64_t num_heads,
                    const char* head_dim_key, const std::string& where) {
  TORCH_CHECK(embed_dim % num_heads == 0, where, ": the hidden size ",
              embed_dim, " is not divisible by the ", num_heads,
              " attention heads");
  const int64_t head_dim =
      opt_int(config, head_dim_key, embed_dim / num_heads, where);
  TORCH_CHECK(head_dim == embed_dim / num_heads, where, ": ", head_dim_key, " ",
              head_dim,
              " is not supported: mha's heads have hidden size / "
              "heads = ",
              embed_dim, " / ", num_heads, " = ", embed_dim / num_heads,
              " features");
}

std::string layer_str(int64_t layer) { return std::to_string(layer); }

}  // namespace

nlohmann::json parse_config(const std::string& text, const std::string& where) {
  json config;
  try {
    config = json::parse(text);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, where, ": not valid JSON: ", e.what());
  }
  TORCH_CHECK(config.is_object(), where, ": expected a JSON object, got ",
              config.type_name());
  return config;
}

std::string read_config_text(const std::string& model_dir) {
  const std::string path =
      (std::filesystem::path(model_dir) / "config.json").string();
  std::ifstream in(path);
  TORCH_CHECK(in.is_open(), "mha::hf: cannot open '", path,
              "' (model_dir must hold a transformers config.json)");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

LayerSpec layer_spec(const json& config, int64_t layer,
                     const std::string& stack, const std::string& where) {
  LayerSpec spec;
  spec.where = where;
  spec.model_type = opt_string(config, "model_type", "", where);
  const std::string& t = spec.model_type;
  TORCH_CHECK(!t.empty(), where, ": needs model_type, which it lacks");
  TORCH_CHECK(stack == "encoder" || (stack == "decoder" && t == "t5"), where,
              ": stack must be \"encoder\" (or \"decoder\" for T5), got '",
              stack, "' for model_type '", t, "'");
  const std::string L = layer_str(layer);
  int64_t E = 0;
  int64_t H = 0;
  int64_t layers = 0;
  if (t == "llama" || t == "mistral" || t == "qwen2") {
    spec.family = Family::kLlama;
    E = get_int(config, {"hidden_size"}, where);
    H = get_int(config, {"num_attention_heads"}, where);
    layers = get_int(config, {"num_hidden_layers"}, where);
    spec.base_prefix = "model.";
    spec.prefix = "layers." + L + ".self_attn.";
  } else if (t == "gptj") {
    spec.family = Family::kGptJ;
    E = get_int(config, {"n_embd", "hidden_size"}, where);
    H = get_int(config, {"n_head", "num_attention_heads"}, where);
    layers = get_int(config, {"n_layer", "num_hidden_layers"}, where);
    spec.base_prefix = "transformer.";
    spec.prefix = "h." + L + ".attn.";
  } else if (t == "gpt_neox") {
    spec.family = Family::kGptNeoX;
    E = get_int(config, {"hidden_size"}, where);
    H = get_int(config, {"num_attention_heads"}, where);
    layers = get_int(config, {"num_hidden_layers"}, where);
    spec.base_prefix = "gpt_neox.";
    spec.prefix = "layers." + L + ".attention.";
  } else if (t == "falcon") {
    spec.family = Family::kFalcon;
    E = get_int(config, {"hidden_size"}, where);
    H = get_int(config, {"num_attention_heads", "n_head"}, where);
    layers = get_int(config, {"num_hidden_layers", "n_layer"}, where);
    spec.base_prefix = "transformer.";
    spec.prefix = "h." + L + ".self_attention.";
  } else if (t == "bloom") {
    spec.family = Family::kBloom;
    E = get_int(config, {"hidden_size", "n_embed"}, where);
    H = get_int(config, {"n_head", "num_attention_heads"}, where);
    layers = get_int(config, {"n_layer", "num_hidden_layers"}, where);
    spec.base_prefix = "transformer.";
    spec.prefix = "h." + L + ".self_attention.";
  } else if (t == "gpt2") {
    spec.family = Family::kGpt2;
    E = get_int(config, {"n_embd", "hidden_size"}, where);
    H = get_int(config, {"n_head", "num_attention_heads"}, where);
    layers = get_int(config, {"n_layer", "num_hidden_layers"}, where);
    spec.base_prefix = "transformer.";
    spec.prefix = "h." + L + ".attn.";
  } else if (t == "bert") {
    spec.family = Family::kBert;
    E = get_int(config, {"hidden_size"}, where);
    H = get_int(config, {"num_attention_heads"}, where);
    layers = get_int(config, {"num_hidden_layers"}, where);
    spec.base_prefix = "bert.";
    spec.layer_prefix = "encoder.layer." + L + ".";
    spec.prefix = spec.layer_prefix + "attention.";
  } else if (t == "t5") {
    spec.family = Family::kT5;
    E = get_int(config, {"d_model"}, where);
    H = get_int(config, {"num_heads"}, where);
    layers = get_int(config, {"num_layers"}, where);
    if (stack == "decoder") {
      layers = opt_int(config, "num_decoder_layers", layers, where);
    }
    spec.base_prefix = "";
    spec.prefix = stack + ".block." + L + ".layer.0.SelfAttention.";
    spec.relative_bias_key =
        stack + ".block.0.layer.0.SelfAttention.relative_attention_bias.weight";
  } else {
    TORCH_CHECK(false, where, ": model_type '", t,
                "' is not supported (supported: llama, mistral, qwen2, gptj, "
                "gpt_neox, falcon, bloom, gpt2, bert, t5)");
  }
  TORCH_CHECK(layer >= 0 && layer < layers, where, ": layer ", layer,
              " out of range: the ",
              stack == "decoder" ? "decoder has " : "model has ", layers,
              " layers (expected 0 <= layer < ", layers, ")");

  MultiHeadAttentionOptions o(E, H);
  o.batch_first(true);
  const int64_t D = E / std::max<int64_t>(H, 1);
  switch (spec.family) {
    case Family::kLlama: {
      check_head_dim(config, E, H, "head_dim", where);
      const int64_t Hkv = opt_int(config, "num_key_value_heads", H, where);
      TORCH_CHECK(Hkv > 0 && H % Hkv == 0, where, ": num_key_value_heads ", Hkv,
                  " must divide num_attention_heads ", H);
      if (Hkv != H) {
        o.num_kv_heads(Hkv);
      }
      if (t == "qwen2") {
        spec.qkv_bias = true;  // Qwen2Attention: q/k/v biases, o_proj none
        spec.out_bias = false;
      } else if (t == "llama") {
        spec.qkv_bias = spec.out_bias =
            opt_bool(config, "attention_bias", false, where);
      }
      const int64_t max_pos =
          opt_int(config, "max_position_embeddings", 0, where);
      const Rope rope = read_rope(config, layer, 10000.0, where);
      set_rotary(o, rope, partial_dim(rope, D), RotaryPairing::kHalf, max_pos,
                 where);
      // Sliding windows: 5.x layer_types; 4.x Mistral sliding_window, 4.x
      // Qwen2 use_sliding_window from max_window_layers on.
      const json* types = find_key(config, {"layer_types"});
      bool sliding = false;
      if (types != nullptr) {
        TORCH_CHECK(types->is_array() &&
                        static_cast<int64_t>(types->size()) > layer &&
                        (*types)[layer].is_string(),
                    where, ": layer_types must list a string per layer, got ",
                    types->dump());
        const std::string type = (*types)[layer].get<std::string>();
        TORCH_CHECK(type == "full_attention" || type == "sliding_attention",
                    where, ": layer_types[", layer, "] '", type,
                    "' is not supported (expected full_attention or "
                    "sliding_attention)");
        sliding = type == "sliding_attention";
      } else if (t == "mistral") {
        sliding = true;
      } else if (t == "qwen2") {
        sliding = opt_bool(config, "use_sliding_window", false, where) &&
                  layer >= opt_int(config, "max_window_layers", 0, where);
      }
      const int64_t window = opt_int(config, "sliding_window", 0, where);
      if (sliding && window > 0) {
        o.window(window);
      }
      spec.causal = true;
      break;
    }
    case Family::kGptJ: {
      const Rope rope = read_rope(config, layer, 10000.0, where);
      c10::optional<int64_t> rotary_dim;
      if (find_key(config, {"rotary_dim"}) != nullptr) {
        rotary_dim = opt_int(config, "rotary_dim", D, where);
      }
      set_rotary(o, rope, rotary_dim, RotaryPairing::kInterleaved,
                 opt_int(config, "n_positions", 0, where), where);
      spec.causal = true;
      break;
    }
    case Family::kGptNeoX: {
      Rope rope = read_rope(
          config, layer, opt_double(config, "rotary_emb_base", 10000.0, where),
          where);
      if (!rope.partial_rotary_factor.has_value()) {
        // 4.x: rotary_pct (transformers' default 0.25).
        rope.partial_rotary_factor =
            opt_double(config, "rotary_pct", 0.25, where);
      }
      set_rotary(o, rope, partial_dim(rope, D), RotaryPairing::kHalf,
                 opt_int(config, "max_position_embeddings", 0, where), where);
      spec.qkv_bias = spec.out_bias =
          opt_bool(config, "attention_bias", true, where);
      spec.causal = true;
      break;
    }
    case Family::kFalcon: {
      TORCH_CHECK(!opt_bool(config, "alibi", false, where), where,
                  ": alibi true is not supported for Falcon (expected false: "
                  "rotary Falcon models)");
      spec.falcon_new_architecture =
          opt_bool(config, "new_decoder_architecture", false, where);
      int64_t Hkv = H;
      if (spec.falcon_new_architecture) {
        Hkv = opt_int(config, "num_kv_heads", H, where);
      } else if (opt_bool(config, "multi_query", true, where)) {
        Hkv = 1;
      }
      TORCH_CHECK(Hkv > 0 && H % Hkv == 0, where, ": num_kv_heads ", Hkv,
                  " must divide num_attention_heads ", H);
      if (Hkv != H) {
        o.num_kv_heads(Hkv);
      }
      const Rope rope = read_rope(config, layer, 10000.0, where);
      set_rotary(o, rope, partial_dim(rope, D), RotaryPairing::kHalf,
                 opt_int(config, "max_position_embeddings", 0, where), where);
      spec.qkv_bias = spec.out_bias = opt_bool(config, "bias", false, where);
      spec.causal = true;
      break;
    }
    case Family::kBloom:
      o.position_bias(PositionBias::kAlibi);
      spec.qkv_bias = spec.out_bias = true;
      spec.causal = true;
      break;
    case Family::kGpt2: {
      // GPT2Attention: scores / sqrt(D) when scale_attn_weights (default),
      // and / (layer + 1) more with scale_attn_by_inverse_layer_idx.
      double scale = opt_bool(config, "scale_attn_weights", true, where)
                         ? 1.0 / std::sqrt(static_cast<double>(D))
                         : 1.0;
      if (opt_bool(config, "scale_attn_by_inverse_layer_idx", false, where)) {
        scale /= static_cast<double>(layer + 1);
      }
      if (scale != 1.0 / std::sqrt(static_cast<double>(D))) {
        o.scale(scale);
      }
      spec.qkv_bias = spec.out_bias = true;
      spec.causal = true;
      break;
    }
    case Family::kBert: {
      const std::string position =
          opt_string(config, "position_embedding_type", "absolute", where);
      TORCH_CHECK(position == "absolute", where, ": position_embedding_type '",
                  position,
                  "' is not supported (expected absolute: relative_key "
                  "embeddings are not in mha)");
      TORCH_CHECK(!opt_bool(config, "is_decoder", false, where), where,
                  ": is_decoder true is not supported for BERT (expected "
                  "false: the encoder)");
      spec.qkv_bias = spec.out_bias = true;
      spec.layer_norm_eps = opt_double(config, "layer_norm_eps", 1e-12, where);
      spec.hidden_act = opt_string(config, "hidden_act", "gelu", where);
      spec.causal = false;
      break;
    }
    case Family::kT5: {
      const int64_t d_kv = opt_int(config, "d_kv", D, where);
      TORCH_CHECK(d_kv * H == E, where, ": d_kv ", d_kv,
                  " is not supported: mha needs num_heads * d_kv = d_model, "
                  "got ",
                  H, " * ", d_kv, " != ", E);
      o.position_bias(PositionBias::kRelative)
          .relative_num_buckets(
              opt_int(config, "relative_attention_num_buckets", 32, where))
          .relative_max_distance(
              opt_int(config, "relative_attention_max_distance", 128, where))
          .relative_bidirectional(stack == "encoder")
          .scale(1.0);
      spec.causal = stack == "decoder";
      break;
    }
  }
  o.bias(spec.qkv_bias || spec.out_bias);
  spec.options = o;
  return spec;
}

}  // namespace mha::hf::detail

namespace mha::hf {

MultiHeadAttentionOptions attention_options_from_config(
    const std::string& config_json, int64_t layer, const std::string& stack,
    const std::string& where) {
  return detail::layer_spec(detail::parse_config(config_json, where), layer,
                            stack, where)
      .options;
}

MultiHeadAttentionOptions attention_options(const std::string& model_dir,
                                            int64_t layer,
                                            const std::string& stack) {
  const std::string where =
      (std::filesystem::path(model_dir) / "config.json").string();
  return attention_options_from_config(detail::read_config_text(model_dir),
                                       layer, stack, where);
}

bool causal_attention(const std::string& config_json,
                      const std::string& stack) {
  const auto config = detail::parse_config(config_json, "config.json");
  return detail::layer_spec(config, 0, stack, "config.json").causal;
}

}  // namespace mha::hf
