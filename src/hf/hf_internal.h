// Internal, the layers of mha::hf (include/mha/hf.h): what config.json says
// about one layer (config.cpp) and the checkpoint's tensors of that layer
// (checkpoint.cpp, weights.cpp). Uses nlohmann-json, so it stays out of the
// installed headers. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "mha/multi_head_attention.h"

namespace mha::hf::detail {

/// The families mha::hf reads, by config.json's model_type.
enum class Family {
  kLlama,  // llama, mistral, qwen2: q/k/v/o_proj
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

/// The attention module of `spec` with the tensors of `tensors`.
MultiHeadAttention build_attention(const LayerSpec& spec,
                                   const LayerTensors& tensors);

}  // namespace mha::hf::detail
