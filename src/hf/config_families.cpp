// mha::hf, the attention options of 2025's model families on top of the
// Llama-like ones that config.cpp reads (hf_internal.h's family_options).
// Facts from transformers 5.x: configuration_<family>.py and the attention
// classes of modeling_<family>.py (Qwen3Attention, Olmo2Attention,
// GptOssAttention, Gemma3Attention, Qwen3NextAttention,
// Llama4TextAttention).
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>

#include "hf_internal.h"

namespace mha::hf::detail {

using nlohmann::json;

void family_options(const json& config, int64_t layer, LayerSpec& spec,
                    MultiHeadAttentionOptions& o) {
  const std::string& t = spec.model_type;
  const std::string& where = spec.where;
  if (t == "qwen3" || t == "olmo2" || t == "gemma3_text" || t == "qwen3_next" ||
      t == "llama4_text") {
    spec.qkv_bias = spec.out_bias =
        opt_bool(config, "attention_bias", false, where);
  }
  // RMSNorm of queries and keys before rotary: per head (Qwen3, Gemma 3,
  // Qwen3-Next; the last two scale by 1 + weight), over the whole
  // projection (OLMo 2); eps = rms_norm_eps.
  if (t == "qwen3" || t == "olmo2" || t == "gemma3_text" || t == "qwen3_next") {
    o.qk_norm(t == "olmo2" ? QKNorm::kFull : QKNorm::kPerHead);
    o.qk_norm_eps(opt_double(config, "rms_norm_eps", 1e-6, where));
    o.qk_norm_unit_offset(t == "gemma3_text" || t == "qwen3_next");
  }
  if (t == "gpt_oss") {
    // GptOssConfig: attention_bias true; a sink logit per head.
    spec.qkv_bias = spec.out_bias =
        opt_bool(config, "attention_bias", true, where);
    o.attention_sinks(true);
  }
  if (t == "qwen3_next") {
    o.output_gate(true);  // q_proj: [query_h | gate_h] per head
  }
  if (t == "gemma3_text") {
    // scaling = query_pre_attn_scalar^-1/2; the logits soft-capped where
    // attn_logit_softcapping is set (None in Gemma 3's releases).
    const double scalar =
        opt_double(config, "query_pre_attn_scalar", 256.0, where);
    TORCH_CHECK(scalar > 0 && std::isfinite(scalar), where,
                ": query_pre_attn_scalar must be finite and > 0, got ", scalar);
    o.scale(1.0 / std::sqrt(scalar));
    const json* cap = find_key(config, {"attn_logit_softcapping"});
    if (cap != nullptr) {
      TORCH_CHECK(cap->is_number() && cap->get<double>() > 0, where,
                  ": attn_logit_softcapping must be a number > 0 or null, "
                  "got ",
                  cap->dump());
      const double c = cap->get<double>();
      o.score_mod([c](const torch::Tensor& s, const torch::Tensor&,
                      const torch::Tensor&, const torch::Tensor&,
                      const torch::Tensor&) { return torch::tanh(s / c) * c; });
    }
    spec.causal =
        !opt_bool(config, "use_bidirectional_attention", false, where);
  }
  if (t == "llama4_text") {
    const bool use_rope = o.rotary();  // config.cpp: no_rope_layers
    // The weightless L2 norm after rotary, on the rope layers only.
    if (use_rope && opt_bool(config, "use_qk_norm", true, where)) {
      o.qk_norm(QKNorm::kL2);
      o.qk_norm_eps(opt_double(config, "rms_norm_eps", 1e-5, where));
    }
    // Chunked attention on the layers layer_types calls chunked (the rope
    // layers when it is absent).
    bool chunked = use_rope;
    const json* types = find_key(config, {"layer_types"});
    if (types != nullptr && types->is_array() &&
        static_cast<int64_t>(types->size()) > layer) {
      chunked = (*types)[layer] == "chunked_attention";
    }
    const int64_t chunk = opt_int(config, "attention_chunk_size", 0, where);
    if (chunked && chunk > 0) {
      o.attention_chunk_size(chunk);
    }
    // Temperature tuning of the NoPE layers' queries.
    if (!use_rope && opt_bool(config, "attn_temperature_tuning", true, where)) {
      AttnTemperatureTuning tuning;
      tuning.floor_scale = opt_double(config, "floor_scale", 8192.0, where);
      tuning.attn_scale = opt_double(config, "attn_scale", 0.1, where);
      TORCH_CHECK(tuning.floor_scale > 0, where,
                  ": floor_scale must be > 0, got ", tuning.floor_scale);
      o.attn_temperature_tuning(tuning);
    }
  }
}

}  // namespace mha::hf::detail
