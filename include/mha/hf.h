// Attention of real model families: mha modules built from a Hugging Face
// transformers checkpoint (config.json and its weights), every convention of
// the family set from the config and the weights mapped from the
// checkpoint's names.
//
// Semantics: the modeling files of Hugging Face transformers
// (https://github.com/huggingface/transformers, src/transformers/models/
// <family>/modeling_<family>.py and configuration_<family>.py, 4.x and 5.x)
// for Llama, Mistral, Qwen2, GPT-J, GPT-NeoX, Falcon, BLOOM, GPT-2, BERT and
// T5; docs/porting.md, "Porting a Hugging Face model", lists what is read from
// config.json for each. Checked against small random transformers models in
// tests/fixtures/hf (scripts/make_hf_fixtures.py).
#pragma once

#include <torch/torch.h>

#include <string>

#include "mha/gated_delta_net.h"
#include "mha/latent_attention.h"
#include "mha/multi_head_attention.h"
#include "mha/transformer.h"

namespace mha::hf {

/// The options of layer `layer`'s self-attention of the model in
/// `model_dir` (which holds config.json), every option that changes the
/// result set from the config (batch_first = true): heads, key/value heads,
/// biases, rotary embedding (theta, pairing, rotated features, scaling),
/// sliding window, ALiBi, T5's relative buckets, softmax scale.
///
/// Args:
///   model_dir: a directory with config.json, as transformers'
///     save_pretrained writes (either generation: 4.x rope_theta +
///     rope_scaling, 5.x rope_parameters).
///   layer: the layer index, 0 <= layer < the config's layer count.
///   stack: T5 only, "encoder" (default) or "decoder": whose self-attention.
/// Throws c10::Error naming the config key and its value for a model type or
/// option mha does not express (e.g. `rope_scaling.rope_type` 'mrope',
/// `alibi` true on Falcon), for a missing or malformed config.json, and for
/// a layer out of range.
MultiHeadAttentionOptions attention_options(
    const std::string& model_dir, int64_t layer = 0,
    const std::string& stack = "encoder");

/// Layer `layer`'s self-attention of the model in `model_dir`, with the
/// options of attention_options and the checkpoint's weights, in the
/// checkpoint's dtype (float32, float16 or bfloat16; convert with ->to()),
/// on the CPU, in eval mode. Its forward(hidden_states, ..., is_causal)
/// equals the family's attention module on the same input: is_causal must be
/// given for decoder models (every family here except BERT and T5's encoder;
/// see causal_attention).
///
/// Weights: model.safetensors, or model.safetensors.index.json and the
/// shards it names, or (where no safetensors exist) pytorch_model.bin or
/// pytorch_model.bin.index.json; tensor names with or without the base-model
/// prefix ("model.", "transformer.", "gpt_neox.", "bert."). Only the
/// tensors of this layer are read (pytorch files: the shards holding them),
/// and fused layouts are split: GPT-NeoX's and BLOOM's per-head
/// query_key_value, Falcon's [q..., k, v] (multi-query) or per key/value
/// head groups (new architecture), GPT-2's transposed Conv1D weights. T5's
/// layers all get the relative_attention_bias of their stack's block 0.
///
/// Throws c10::Error as attention_options, and naming the file and the
/// tensor for a missing tensor or one of an unexpected shape or dtype.
///
/// Example:
///   auto attn = mha::hf::load_attention("llama-dir", /*layer=*/3);
///   auto x = torch::randn({1, 7, attn->options.embed_dim()});
///   auto [out, w] = attn(x, {}, {}, {}, /*need_weights=*/false, {},
///                        /*average_attn_weights=*/true, /*is_causal=*/true);
MultiHeadAttention load_attention(const std::string& model_dir, int64_t layer,
                                  const std::string& stack = "encoder");

/// Layer `layer` of a BERT encoder (BertLayer: attention, residual and
/// LayerNorm, then GELU feed-forward, residual and LayerNorm) as a post-norm
/// TransformerEncoderLayer: self_attn from query/key/value and
/// attention.output.dense, norm1 = attention.output.LayerNorm, linear1 =
/// intermediate.dense, linear2 = output.dense, norm2 = output.LayerNorm,
/// layer_norm_eps and hidden_act ("gelu" or "relu") from the config. Eval
/// mode, the checkpoint's dtype. BERT's attention_mask (1 = keep) becomes
/// src_key_padding_mask = attention_mask == 0.
/// Throws c10::Error as load_attention, and for a model_type other than bert.
TransformerEncoderLayer load_encoder_layer(const std::string& model_dir,
                                           int64_t layer);

/// attention_options from the text of a config.json (`where` names it in
/// messages).
MultiHeadAttentionOptions attention_options_from_config(
    const std::string& config_json, int64_t layer = 0,
    const std::string& stack = "encoder",
    const std::string& where = "config.json");

/// load_attention from the text of a config.json and tensors under their
/// checkpoint names (with or without the base-model prefix) already in
/// memory, e.g. those of a reference file (mha::parity); `source` names them
/// in messages.
MultiHeadAttention attention_from_tensors(
    const std::string& config_json,
    const torch::OrderedDict<std::string, torch::Tensor>& tensors,
    int64_t layer, const std::string& stack = "encoder",
    const std::string& source = "tensors");

/// Whether the family's self-attention is causal (true for the decoders:
/// Llama, Mistral, Qwen2, GPT-J, GPT-NeoX, Falcon, BLOOM, GPT-2, and T5's
/// decoder stack; false for BERT and T5's encoder), from a config.json's
/// text. Throws c10::Error for an unsupported model_type.
bool causal_attention(const std::string& config_json,
                      const std::string& stack = "encoder");

/// The Multi-head Latent Attention of layer `layer` of a DeepSeek-V2 or -V3
/// checkpoint (model_type deepseek_v2 or deepseek_v3; Kimi K2 writes
/// deepseek_v3), with its weights (the checkpoint's dtype, eval mode):
/// hidden_size, num_attention_heads, q_lora_rank (null: a plain q_proj),
/// kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim,
/// attention_bias, rope_interleave (V3; V2 always interleaves) and the rope
/// settings as load_attention reads them (V3's yarn: mscale² in the scale;
/// V2: qk_head_dim^-1/2). config.json's head_dim is qk_rope_head_dim there
/// and is not read. Tensors `model.layers.<layer>.self_attn.*` under
/// transformers' names. Causal, as DeepseekV3Attention. Throws c10::Error
/// as load_attention.
MultiHeadLatentAttention load_latent_attention(const std::string& model_dir,
                                               int64_t layer);

/// The Gated DeltaNet of layer `layer` of a Qwen3-Next checkpoint (a
/// linear_attention entry of layer_types; 4.x: all but every
/// full_attention_interval-th layer), with its weights (the checkpoint's
/// dtype, eval mode): hidden_size, linear_num_key_heads,
/// linear_num_value_heads, linear_key_head_dim, linear_value_head_dim,
/// linear_conv_kernel_dim, rms_norm_eps; tensors
/// `model.layers.<layer>.linear_attn.*`. Throws c10::Error naming the key
/// for a full-attention layer or another hidden_act than silu, and as
/// load_attention.
GatedDeltaNet load_gated_delta_net(const std::string& model_dir, int64_t layer);

}  // namespace mha::hf
