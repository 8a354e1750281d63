// Internal, the layers of mha::hf (include/mha/hf.h): what config.json says
// about one layer (config.cpp) and the checkpoint's tensors of that layer
// (checkpoint.cpp, weights.cpp). Uses nlohmann-json, so it stays out of the
// installed headers. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "mha/multi_head_attention.h"

namespace mha::hf::detail {

/// The families mha::hf reads, by config.json's model_type.
enum class Family {
  kLlama,  // llama, mistral, qwen2 and the 2025 families: q/k/v/o_proj
  kGptJ,
  kGptNeoX,
  kFalcon,
  kBloom,
  kGpt2,
  kBert,
  kT5,
};

/// What config.json says about one layer's self-attention.
struct LayerSpec {
  std::string model_type;
  Family family = Family::kLlama;
  MultiHeadAttentionOptions options{1, 1};
  /// Whether the family's self-attention is causal (decoders).
  bool causal = false;
  /// The base model's prefix in a model with a head ("model.").
  std::string base_prefix;
  /// The attention module's tensors, relative to the base model
  /// ("layers.3.self_attn.").
  std::string prefix;
  /// The layer's own prefix ("encoder.layer.3."), for BERT's encoder layer.
  std::string layer_prefix;
  /// Biases on the query/key/value and on the output projection (Qwen2:
  /// true, false).
  bool qkv_bias = false;
  bool out_bias = false;
  /// Falcon: key/value heads of the fused query_key_value, new architecture.
  bool falcon_new_architecture = false;
  /// T5: the relative_attention_bias of block 0 of the stack.
  std::string relative_bias_key;
  /// BERT: layer_norm_eps and hidden_act.
  double layer_norm_eps = 1e-12;
  std::string hidden_act;
  /// The file name or label of the config, for messages.
  std::string where;
};

/// The value of the first of `keys` that config holds and is not null, or
/// nullptr; `found` (if given) gets its key (config_values.cpp, as below).
const nlohmann::json* find_key(const nlohmann::json& config,
                               std::initializer_list<const char*> keys,
                               std::string* found = nullptr);
/// "a or b or c".
std::string key_list(std::initializer_list<const char*> keys);
/// A required integer > 0: the first of `keys` present; c10::Error naming
/// `where` and the keys otherwise.
int64_t get_int(const nlohmann::json& config,
                std::initializer_list<const char*> keys,
                const std::string& where);
/// Optional values, `fallback` when absent or null; c10::Error naming
/// `where`, the key and the value for another JSON type.
int64_t opt_int(const nlohmann::json& config, const char* key, int64_t fallback,
                const std::string& where);
double opt_double(const nlohmann::json& config, const char* key,
                  double fallback, const std::string& where);
bool opt_bool(const nlohmann::json& config, const char* key, bool fallback,
              const std::string& where);
std::string opt_string(const nlohmann::json& config, const char* key,
                       const std::string& fallback, const std::string& where);

/// The options of the 2025 families on top of the Llama-like ones (qwen3,
/// olmo2, gpt_oss, gemma3_text, qwen3_next, llama4_text; config_families.cpp):
/// biases, q/k norms, sinks, output gate, scale, soft-capping, causality,
/// chunked attention and temperature tuning of layer `layer`.
void family_options(const nlohmann::json& config, int64_t layer,
                    LayerSpec& spec, MultiHeadAttentionOptions& o);

/// The rotary theta and scaling that `config` (layer 0's rope settings)
/// gives heads of `rotary_dim` rotated features, as load_attention reads
/// them (config.cpp).
std::pair<double, RotaryScaling> rotary_of(const nlohmann::json& config,
                                           int64_t rotary_dim,
                                           const std::string& where);

/// Layer `layer`'s entry of config's layer_types (5.x), or nullopt where
/// the config has none; c10::Error naming `where` unless it lists a string
/// per layer (config_values.cpp).
std::optional<std::string> layer_types_entry(const nlohmann::json& config,
                                             int64_t layer,
                                             const std::string& where);

/// Layer `layer`'s entry of a Qwen3-Next config's layer_types (5.x), or
/// for 4.x configs "linear_attention" except every
/// full_attention_interval-th layer ("full_attention"); family_modules.cpp.
std::string qwen3_next_layer_type(const nlohmann::json& config, int64_t layer,
                                  const std::string& where);

/// config.json's text parsed; `where` names it in messages.
nlohmann::json parse_config(const std::string& text, const std::string& where);

/// The text of model_dir/config.json.
std::string read_config_text(const std::string& model_dir);

/// The spec of layer `layer` (T5: of `stack`, "encoder" or "decoder").
LayerSpec layer_spec(const nlohmann::json& config, int64_t layer,
                     const std::string& stack, const std::string& where);

/// Tensors of one layer under their checkpoint names, and the file each
/// came from (for messages).
struct LayerTensors {
  torch::OrderedDict<std::string, torch::Tensor> tensors;
  std::map<std::string, std::string> file_of;
  /// Where a missing tensor would have been: the checkpoint's file or index.
  std::string source;
  /// The base-model prefix that names may carry.
  std::string base_prefix;

  /// The tensor `key` (relative to the base model), checked to be floating
  /// and of `sizes`; c10::Error naming the file and the key otherwise.
  torch::Tensor get(const std::string& key, c10::IntArrayRef sizes) const;
  /// Whether `key` (relative to the base model) is present.
  bool has(const std::string& key) const;
};

/// Reads from model_dir the tensors whose names `wanted` accepts:
/// model.safetensors, model.safetensors.index.json and its shards,
/// pytorch_model.bin or pytorch_model.bin.index.json, in that order.
LayerTensors read_checkpoint(
    const std::string& model_dir,
    const std::function<bool(const std::string&)>& wanted);

/// The tensors of `model_dir` whose names, without `base_prefix`, start
/// with `prefix` (weights.cpp).
LayerTensors read_prefixed(const std::string& model_dir,
                           const std::string& base_prefix,
                           const std::string& prefix);

/// The attention module of `spec` with the tensors of `tensors`.
MultiHeadAttention build_attention(const LayerSpec& spec,
                                   const LayerTensors& tensors);

}  // namespace mha::hf::detail
