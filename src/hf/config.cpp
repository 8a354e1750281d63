// mha::hf, the config layer (hf_internal.h): config.json of transformers 4.x
// or 5.x to the options of one layer's self-attention, family by family.
// Facts from transformers' configuration_<family>.py and
// modeling_<family>.py (and modeling_rope_utils.py for rope_parameters);
// docs/porting.md, "Porting a Hugging Face model", lists the keys read.
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
  std::string partial_key;  // where partial_rotary_factor came from
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
  // standardize_rope_params: a top-level partial_rotary_factor wins.
  if (find_key(config, {"partial_rotary_factor"}) != nullptr) {
    rope.partial_rotary_factor =
        opt_double(config, "partial_rotary_factor", 1.0, where);
    rope.partial_key = "partial_rotary_factor";
  } else if (find_key(rope.params, {"partial_rotary_factor"}) != nullptr) {
    rope.partial_rotary_factor =
        opt_double(rope.params, "partial_rotary_factor", 1.0, where);
    rope.partial_key = rope.params_key + ".partial_rotary_factor";
  }
  return rope;
}

/// The keys of rope_parameters / rope_scaling that mha reads (others are
/// refused by name); their meaning is RotaryScaling's.
const char* const kRopeKeys[] = {
    "rope_type",        "type",
    "rope_theta",       "partial_rotary_factor",
    "factor",           "original_max_position_embeddings",
    "low_freq_factor",  "high_freq_factor",
    "beta_fast",        "beta_slow",
    "attention_factor", "short_factor",
    "long_factor",      "mscale",
    "mscale_all_dim",   "truncate"};

std::vector<double> double_list(const json& params, const char* key,
                                const std::string& what) {
  std::vector<double> out;
  const json* value = find_key(params, {key});
  if (value == nullptr) {
    return out;
  }
  TORCH_CHECK(value->is_array(), what, ".", key,
              " must be a list of numbers, got ", value->dump());
  for (const auto& x : *value) {
    TORCH_CHECK(x.is_number(), what, ".", key,
                " must be a list of numbers, got ", value->dump());
    out.push_back(x.get<double>());
  }
  return out;
}

/// RotaryScaling from the rope dict (transformers 5.x
/// modeling_rope_utils.py: yarn and longrope without a factor take
/// max_position_embeddings / original_max_position_embeddings; a top-level
/// original_max_position_embeddings, as Phi-3 writes, wins).
RotaryScaling read_scaling(const json& config, const Rope& rope,
                           int64_t max_position_embeddings,
                           const std::string& where) {
  const std::string what = where + ": " + rope.params_key;
  const std::string& t = rope.rope_type;
  TORCH_CHECK(t == "default" || t == "linear" || t == "dynamic" ||
                  t == "yarn" || t == "longrope" || t == "llama3",
              what, ".rope_type '", t,
              "' is not supported (expected default, linear, dynamic, yarn, "
              "longrope or llama3)");
  for (auto it = rope.params.begin(); it != rope.params.end(); ++it) {
    bool known = false;
    for (const char* key : kRopeKeys) {
      known = known || it.key() == key;
    }
    TORCH_CHECK(known, what, ".", it.key(), " ", it.value().dump(),
                " is not supported (mha reads rope_type, rope_theta, "
                "partial_rotary_factor, factor, "
                "original_max_position_embeddings, low_freq_factor, "
                "high_freq_factor, beta_fast, beta_slow, attention_factor, "
                "short_factor, long_factor, mscale, mscale_all_dim, "
                "truncate)");
  }
  RotaryScaling s;
  s.rope_type = t;
  s.max_position_embeddings = max_position_embeddings;
  if (t == "default") {
    return s;
  }
  const json& p = rope.params;
  s.original_max_position_embeddings =
      opt_int(p, "original_max_position_embeddings", 0, what);
  // standardize_rope_params: the top-level key wins for the types that read
  // O, when one rope dict serves every layer.
  const bool reads_original = t == "yarn" || t == "longrope" || t == "llama3";
  const bool per_layer_type = rope.params_key.find('.') != std::string::npos;
  if (reads_original && !per_layer_type &&
      find_key(config, {"original_max_position_embeddings"}) != nullptr) {
    s.original_max_position_embeddings =
        opt_int(config, "original_max_position_embeddings", 0, where);
  }
  const int64_t O = s.original_max_position_embeddings > 0
                        ? s.original_max_position_embeddings
                        : max_position_embeddings;
  double factor_default = 1.0;
  if ((t == "yarn" || t == "longrope") && O > 0 &&
      max_position_embeddings > 0) {
    factor_default =
        static_cast<double>(max_position_embeddings) / static_cast<double>(O);
  }
  s.factor = opt_double(p, "factor", factor_default, what);
  s.low_freq_factor = opt_double(p, "low_freq_factor", 1.0, what);
  s.high_freq_factor = opt_double(p, "high_freq_factor", 4.0, what);
  s.beta_fast = opt_double(p, "beta_fast", 32.0, what);
  s.beta_slow = opt_double(p, "beta_slow", 1.0, what);
  if (find_key(p, {"attention_factor"}) != nullptr) {
    s.attention_factor = opt_double(p, "attention_factor", 1.0, what);
  }
  if (find_key(p, {"mscale"}) != nullptr) {
    s.mscale = opt_double(p, "mscale", 0.0, what);
  }
  if (find_key(p, {"mscale_all_dim"}) != nullptr) {
    s.mscale_all_dim = opt_double(p, "mscale_all_dim", 0.0, what);
  }
  s.truncate = opt_bool(p, "truncate", true, what);
  s.short_factor = double_list(p, "short_factor", what);
  s.long_factor = double_list(p, "long_factor", what);
  return s;
}

/// Sets the rotary options of `o` from `rope`, with `rotary_dim` features
/// rotated per head (nullopt: all of head_dim) as the config's `rotary_key`
/// says ("rotary_dim 4", "rotary_pct 0.3").
void set_rotary(MultiHeadAttentionOptions& o, const json& config,
                const Rope& rope, c10::optional<int64_t> rotary_dim,
                const std::string& rotary_key, RotaryPairing pairing,
                int64_t max_position_embeddings, const std::string& where) {
  const int64_t head_dim = o.head_dim().value_or(o.embed_dim() / o.num_heads());
  TORCH_CHECK(std::isfinite(rope.theta) && rope.theta > 0, where, ": ",
              rope.params_key, ".rope_theta must be finite and > 0, got ",
              rope.theta);
  o.rotary(true).rotary_theta(rope.theta).rotary_pairing(pairing);
  if (rotary_dim.has_value() && *rotary_dim != head_dim) {
    TORCH_CHECK(
        *rotary_dim >= 2 && *rotary_dim <= head_dim && *rotary_dim % 2 == 0,
        where, ": ", rotary_key, " (", *rotary_dim, " of head_dim ", head_dim,
        " features rotated) is not supported (expected an even "
        "number of features, 2 .. ",
        head_dim, ")");
    o.rotary_dim(*rotary_dim);
  }
  const RotaryScaling scaling =
      read_scaling(config, rope, max_position_embeddings, where);
  check_rotary_scaling(scaling, rotary_dim.value_or(head_dim),
                       (where + ": " + rope.params_key).c_str());
  o.rotary_scaling(scaling);
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

/// "key value" of the partial rotary factor, for messages.
std::string partial_text(const Rope& rope) {
  std::ostringstream text;
  text << rope.partial_key << " " << rope.partial_rotary_factor.value_or(1.0);
  return text.str();
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
  if (t == "gemma3" || t == "llama4") {
    // The multimodal models: the language model's config is text_config,
    // its tensors under model.language_model.
    const json* text = find_key(config, {"text_config"});
    TORCH_CHECK(text != nullptr && text->is_object(), where, ": model_type '",
                t, "' needs a text_config object, which it lacks");
    json text_config = *text;
    if (!text_config.contains("model_type")) {
      text_config["model_type"] = t + "_text";
    }
    auto text_spec =
        layer_spec(text_config, layer, stack, where + " text_config");
    text_spec.base_prefix = "model.language_model.";
    return text_spec;
  }
  const std::string L = layer_str(layer);
  int64_t E = 0;
  int64_t H = 0;
  int64_t layers = 0;
  if (t == "llama" || t == "mistral" || t == "qwen2" || t == "qwen3" ||
      t == "olmo2" || t == "gpt_oss" || t == "gemma3_text" ||
      t == "qwen3_next" || t == "llama4_text") {
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
                "' is not supported (supported: llama, mistral, qwen2, qwen3, "
                "olmo2, gpt_oss, gemma3, gemma3_text, qwen3_next, llama4, "
                "llama4_text, gptj, gpt_neox, falcon, bloom, gpt2, bert, t5)");
  }
  TORCH_CHECK(layer >= 0 && layer < layers, where, ": layer ", layer,
              " out of range: the ",
              stack == "decoder" ? "decoder has " : "model has ", layers,
              " layers (expected 0 <= layer < ", layers, ")");

  MultiHeadAttentionOptions o(E, H);
  o.batch_first(true);
  int64_t D = E / std::max<int64_t>(H, 1);
  switch (spec.family) {
    case Family::kLlama: {
      // head_dim: Qwen3, gpt-oss (and any Llama-like config that sets it)
      // may have H · head_dim != E.
      TORCH_CHECK(H > 0, where, ": num_attention_heads must be > 0, got ", H);
      const bool divisible = E % H == 0;
      D = opt_int(config, "head_dim", divisible ? E / H : 0, where);
      TORCH_CHECK(D > 0, where, ": head_dim must be > 0 (the hidden size ", E,
                  " is not divisible by the ", H, " heads), got ", D);
      if (!divisible || D != E / H) {
        o.head_dim(D);
      }
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
      // Sliding windows: 5.x layer_types; 4.x Mistral sliding_window, 4.x
      // Qwen2 use_sliding_window from max_window_layers on, 4.x Gemma 3
      // sliding_window_pattern.
      bool sliding = false;
      if (const auto entry = layer_types_entry(config, layer, where)) {
        const std::string& type = *entry;
        TORCH_CHECK(type != "linear_attention", where, ": layer_types[", layer,
                    "] is 'linear_attention', a Gated DeltaNet layer: "
                    "load_attention reads full-attention layers only");
        TORCH_CHECK(type == "full_attention" || type == "sliding_attention" ||
                        type == "chunked_attention",
                    where, ": layer_types[", layer, "] '", type,
                    "' is not supported (expected full_attention, "
                    "sliding_attention or chunked_attention)");
        sliding = type == "sliding_attention";
      } else if (t == "mistral") {
        sliding = true;
      } else if (t == "qwen2") {
        sliding = opt_bool(config, "use_sliding_window", false, where) &&
                  layer >= opt_int(config, "max_window_layers", 0, where);
      } else if (t == "gemma3_text") {
        sliding =
            (layer + 1) % opt_int(config, "sliding_window_pattern", 6, where) !=
            0;
      }
      const int64_t max_pos =
          opt_int(config, "max_position_embeddings", 0, where);
      Rope rope = read_rope(config, layer, 10000.0, where);
      if (t == "gemma3_text" && sliding &&
          find_key(config, {"rope_parameters"}) == nullptr &&
          find_key(config, {"rope_local_base_freq"}) != nullptr) {
        // 4.x Gemma 3: sliding layers rotate at rope_local_base_freq,
        // unscaled (rope_scaling is the global layers').
        rope.theta = opt_double(config, "rope_local_base_freq", 10000.0, where);
        rope.params = json::object();
        rope.params_key = "rope_local_base_freq";
        rope.rope_type = "default";
      }
      // Llama 4: NoPE layers (no_rope_layers[i] == 0) rotate nothing; its
      // rotary pairs features (2i, 2i + 1), as a complex multiplication.
      bool use_rope = true;
      if (t == "llama4_text") {
        // Llama4TextConfig: without no_rope_layers, every
        // no_rope_layer_interval-th layer is NoPE.
        const json* no_rope = find_key(config, {"no_rope_layers"});
        if (no_rope == nullptr || (no_rope->is_array() && no_rope->empty())) {
          use_rope = (layer + 1) %
                         opt_int(config, "no_rope_layer_interval", 4, where) !=
                     0;
        } else {
          TORCH_CHECK(no_rope->is_array() &&
                          static_cast<int64_t>(no_rope->size()) > layer &&
                          (*no_rope)[layer].is_number_integer(),
                      where,
                      ": no_rope_layers must list 0 or 1 per layer, got ",
                      no_rope->dump());
          use_rope = (*no_rope)[layer].get<int64_t>() != 0;
        }
      }
      if (use_rope) {
        set_rotary(o, config, rope, partial_dim(rope, D), partial_text(rope),
                   t == "llama4_text" ? RotaryPairing::kInterleaved
                                      : RotaryPairing::kHalf,
                   max_pos, where);
      }
      const int64_t window = opt_int(config, "sliding_window", 0, where);
      if (sliding && window > 0) {
        o.window(window);
      }
      spec.causal = true;
      family_options(config, layer, spec, o);  // config_families.cpp
      break;
    }
    case Family::kGptJ: {
      const Rope rope = read_rope(config, layer, 10000.0, where);
      // GPTJConfig: rotary_dim 64 when the key is absent; null rotates
      // every feature.
      c10::optional<int64_t> rotary_dim = 64;
      if (config.contains("rotary_dim")) {
        rotary_dim = find_key(config, {"rotary_dim"}) != nullptr
                         ? c10::optional<int64_t>(
                               opt_int(config, "rotary_dim", D, where))
                         : c10::nullopt;
      }
      set_rotary(o, config, rope, rotary_dim,
                 "rotary_dim " + std::to_string(rotary_dim.value_or(D)),
                 RotaryPairing::kInterleaved,
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
        rope.partial_key = "rotary_pct";
      }
      set_rotary(o, config, rope, partial_dim(rope, D), partial_text(rope),
                 RotaryPairing::kHalf,
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
      set_rotary(o, config, rope, partial_dim(rope, D), partial_text(rope),
                 RotaryPairing::kHalf,
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

namespace detail {

std::pair<double, RotaryScaling> rotary_of(const json& config,
                                           int64_t rotary_dim,
                                           const std::string& where) {
  MultiHeadAttentionOptions o(rotary_dim, 1);
  const Rope rope = read_rope(config, 0, 10000.0, where);
  set_rotary(o, config, rope, c10::nullopt, "", RotaryPairing::kHalf,
             opt_int(config, "max_position_embeddings", 0, where), where);
  return {o.rotary_theta(), o.rotary_scaling()};
}

}  // namespace detail

bool causal_attention(const std::string& config_json,
                      const std::string& stack) {
  const auto config = detail::parse_config(config_json, "config.json");
  // The first attention layer's (Qwen3-Next's layer 0 is a Gated DeltaNet
  // layer, which layer_spec refuses by name).
  for (int64_t layer = 0;; ++layer) {
    try {
      return detail::layer_spec(config, layer, stack, "config.json").causal;
    } catch (const c10::Error& e) {
      if (std::string(e.what()).find("'linear_attention'") ==
          std::string::npos) {
        throw;
      }
    }
  }
}

}  // namespace mha::hf
