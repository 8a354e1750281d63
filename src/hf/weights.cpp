// mha::hf, the weights layer and the public calls of include/mha/hf.h: a
// layer's checkpoint tensors mapped onto MultiHeadAttention's parameters,
// fused layouts split (facts from transformers' modeling_<family>.py):
//   GPT-NeoX, BLOOM: query_key_value rows per head [q_h, k_h, v_h];
//   Falcon: rows per key/value head [q_{g,0..G-1}, k_g, v_g], G = H / Hkv
//     (multi-query: one group; the old per-head layout: G = 1);
//   GPT-2: Conv1D weights stored (in, out), i.e. transposed.
//
// Glossary: E hidden size, H query heads, Hkv key/value heads, D head_dim,
// Ekv = Hkv · D, G = H / Hkv query heads per key/value head, F the BERT
// feed-forward width.
#include <filesystem>
#include <string>
#include <vector>

#include "hf_internal.h"
#include "mha/hf.h"

namespace mha::hf::detail {
namespace {

/// Query, key and value projections (weights and biases) in the module's
/// layout, and the output projection.
struct Projections {
  torch::Tensor wq, wk, wv, wo;  // (E, E), (Ekv, E), (Ekv, E), (E, E)
  torch::Tensor bq, bk, bv, bo;  // (E), (Ekv), (Ekv), (E); undefined: none
};

/// Splits fused rows [groups][q_per + 2][D] (q_per query heads, then one
/// key and one value head per group) of t (rows, ...) into q (groups ·
/// q_per · D, ...), k and v (groups · D, ...).
void split_fused(const torch::Tensor& t, int64_t groups, int64_t q_per,
                 int64_t D, torch::Tensor* q, torch::Tensor* k,
                 torch::Tensor* v) {
  std::vector<int64_t> shape = {groups, q_per + 2, D};
  for (int64_t i = 1; i < t.dim(); ++i) {
    shape.push_back(t.size(i));
  }
  const auto grouped = t.reshape(shape);  // (groups, q_per + 2, D, ...)
  auto flat = [&](const torch::Tensor& x) {
    std::vector<int64_t> out = {-1};
    for (int64_t i = 1; i < t.dim(); ++i) {
      out.push_back(t.size(i));
    }
    return x.reshape(out);
  };
  *q = flat(grouped.narrow(1, 0, q_per));   // (groups · q_per · D, ...)
  *k = flat(grouped.select(1, q_per));      // (groups · D, ...)
  *v = flat(grouped.select(1, q_per + 1));  // (groups · D, ...)
}

/// Separate q/k/v/o linear layers named prefix + {q, k, v, o} + ".weight";
/// Eq query rows (E unless head_dim or an output gate says otherwise), Eo
/// columns of the output projection (H · D; default Eq).
Projections separate(const LayerSpec& spec, const LayerTensors& t,
                     const std::vector<std::string>& names, int64_t E,
                     int64_t Ekv, int64_t Eq = 0, int64_t Eo = 0) {
  const std::string& P = spec.prefix;
  if (Eq == 0) {
    Eq = E;
  }
  if (Eo == 0) {
    Eo = Eq;
  }
  Projections p;
  p.wq = t.get(P + names[0] + ".weight", {Eq, E});
  p.wk = t.get(P + names[1] + ".weight", {Ekv, E});
  p.wv = t.get(P + names[2] + ".weight", {Ekv, E});
  p.wo = t.get(P + names[3] + ".weight", {E, Eo});
  if (spec.qkv_bias) {
    p.bq = t.get(P + names[0] + ".bias", {Eq});
    p.bk = t.get(P + names[1] + ".bias", {Ekv});
    p.bv = t.get(P + names[2] + ".bias", {Ekv});
  }
  if (spec.out_bias) {
    p.bo = t.get(P + names[3] + ".bias", {E});
  }
  return p;
}

Projections projections(const LayerSpec& spec, const LayerTensors& t) {
  const auto& o = spec.options;
  const int64_t E = o.embed_dim();
  const int64_t H = o.num_heads();
  const int64_t D = o.head_dim().value_or(E / H);
  const int64_t Hkv = o.num_kv_heads().value_or(H);
  const int64_t Ekv = Hkv * D;
  const std::string& P = spec.prefix;
  switch (spec.family) {
    case Family::kLlama:
      // Qwen3-Next's q_proj: [query_h | gate_h] per head.
      return separate(spec, t, {"q_proj", "k_proj", "v_proj", "o_proj"}, E, Ekv,
                      H * D * (o.output_gate() ? 2 : 1), H * D);
    case Family::kGptJ:
      return separate(spec, t, {"q_proj", "k_proj", "v_proj", "out_proj"}, E,
                      Ekv);
    case Family::kBert:
      return separate(spec, t,
                      {"self.query", "self.key", "self.value", "output.dense"},
                      E, Ekv);
    case Family::kT5:
      return separate(spec, t, {"q", "k", "v", "o"}, E, Ekv);
    case Family::kGptNeoX:
    case Family::kBloom:
    case Family::kFalcon: {
      // Per key/value head groups of G query heads, then k and v (GPT-NeoX
      // and BLOOM: Hkv = H, G = 1).
      const int64_t G = H / Hkv;
      Projections p;
      const auto w = t.get(P + "query_key_value.weight", {E + 2 * Ekv, E});
      split_fused(w, Hkv, G, D, &p.wq, &p.wk, &p.wv);
      if (spec.qkv_bias) {
        const auto b = t.get(P + "query_key_value.bias", {E + 2 * Ekv});
        split_fused(b, Hkv, G, D, &p.bq, &p.bk, &p.bv);
      }
      p.wo = t.get(P + "dense.weight", {E, E});
      if (spec.out_bias) {
        p.bo = t.get(P + "dense.bias", {E});
      }
      return p;
    }
    case Family::kGpt2: {
      // Conv1D: weight (in, out); c_attn's outputs are [q, k, v].
      Projections p;
      const auto w = t.get(P + "c_attn.weight", {E, 3 * E}).t();  // (3E, E)
      const auto b = t.get(P + "c_attn.bias", {3 * E});
      p.wq = w.narrow(0, 0, E);
      p.wk = w.narrow(0, E, E);
      p.wv = w.narrow(0, 2 * E, E);
      p.bq = b.narrow(0, 0, E);
      p.bk = b.narrow(0, E, E);
      p.bv = b.narrow(0, 2 * E, E);
      p.wo = t.get(P + "c_proj.weight", {E, E}).t();
      p.bo = t.get(P + "c_proj.bias", {E});
      return p;
    }
  }
  TORCH_INTERNAL_ASSERT(false, "unhandled family");
}

torch::Tensor or_zeros(const torch::Tensor& t, int64_t n,
                       const torch::Tensor& like) {
  return t.defined() ? t : torch::zeros({n}, like.options());
}

/// Copies `p` into `m` (in m's dtype).
void set_projections(MultiHeadAttentionImpl& m, const Projections& p) {
  torch::NoGradGuard no_grad;
  if (m.packed_in_proj()) {
    m.in_proj_weight.copy_(torch::cat({p.wq, p.wk, p.wv}));  // (3E, E)
  } else {
    m.q_proj_weight.copy_(p.wq);
    m.k_proj_weight.copy_(p.wk);
    m.v_proj_weight.copy_(p.wv);
  }
  m.out_proj->weight.copy_(p.wo);
  if (m.options.bias()) {
    m.in_proj_bias.copy_(torch::cat({or_zeros(p.bq, p.wq.size(0), p.wq),
                                     or_zeros(p.bk, p.wk.size(0), p.wk),
                                     or_zeros(p.bv, p.wv.size(0), p.wv)}));
    m.out_proj->bias.copy_(or_zeros(p.bo, p.wo.size(0), p.wo));
  }
}

/// Whether a checkpoint tensor `name` belongs to the layer of `spec`
/// (with_layer: BERT's whole encoder layer).
bool wanted(const LayerSpec& spec, const std::string& name, bool with_layer) {
  std::string key = name;
  if (!spec.base_prefix.empty() &&
      key.compare(0, spec.base_prefix.size(), spec.base_prefix) == 0) {
    key = key.substr(spec.base_prefix.size());
  }
  const std::string& prefix = with_layer ? spec.layer_prefix : spec.prefix;
  return key.compare(0, prefix.size(), prefix) == 0 ||
         (!spec.relative_bias_key.empty() && key == spec.relative_bias_key);
}

std::string config_path(const std::string& model_dir) {
  return (std::filesystem::path(model_dir) / "config.json").string();
}

}  // namespace

MultiHeadAttention build_attention(const LayerSpec& spec,
                                   const LayerTensors& tensors) {
  const Projections p = projections(spec, tensors);
  MultiHeadAttention module(spec.options);
  module->to(p.wq.scalar_type());
  module->eval();
  set_projections(*module, p);
  if (spec.family == Family::kT5) {
    const auto& o = spec.options;
    const auto w = tensors.get(spec.relative_bias_key,
                               {o.relative_num_buckets(), o.num_heads()});
    torch::NoGradGuard no_grad;
    module->relative_attention_bias->weight.copy_(w);
  }
  // Qwen3 / OLMo 2 q_norm, k_norm; gpt-oss sinks (same names in the
  // checkpoint, under the attention's prefix).
  torch::NoGradGuard no_grad;
  for (auto* norm : {&module->q_norm, &module->k_norm}) {
    if (*norm) {
      const std::string name = norm == &module->q_norm ? "q_norm" : "k_norm";
      (*norm)->weight.copy_(tensors.get(spec.prefix + name + ".weight",
                                        {(*norm)->weight.size(0)}));
    }
  }
  if (module->sinks.defined()) {
    module->sinks.copy_(
        tensors.get(spec.prefix + "sinks", {spec.options.num_heads()}));
  }
  return module;
}

LayerTensors read_prefixed(const std::string& model_dir,
                           const std::string& base_prefix,
                           const std::string& prefix) {
  auto tensors = read_checkpoint(model_dir, [&](const std::string& name) {
    std::string key = name;
    if (!base_prefix.empty() &&
        key.compare(0, base_prefix.size(), base_prefix) == 0) {
      key = key.substr(base_prefix.size());
    }
    return key.compare(0, prefix.size(), prefix) == 0;
  });
  tensors.base_prefix = base_prefix;
  return tensors;
}

}  // namespace mha::hf::detail

namespace mha::hf {

MultiHeadAttention load_attention(const std::string& model_dir, int64_t layer,
                                  const std::string& stack) {
  const std::string where = detail::config_path(model_dir);
  const auto spec = detail::layer_spec(
      detail::parse_config(detail::read_config_text(model_dir), where), layer,
      stack, where);
  auto tensors =
      detail::read_checkpoint(model_dir, [&](const std::string& name) {
        return detail::wanted(spec, name, /*with_layer=*/false);
      });
  tensors.base_prefix = spec.base_prefix;
  return detail::build_attention(spec, tensors);
}

MultiHeadAttention attention_from_tensors(
    const std::string& config_json,
    const torch::OrderedDict<std::string, torch::Tensor>& tensors,
    int64_t layer, const std::string& stack, const std::string& source) {
  const auto spec = detail::layer_spec(
      detail::parse_config(config_json, source + " (config)"), layer, stack,
      source + " (config)");
  detail::LayerTensors t;
  t.source = source;
  t.base_prefix = spec.base_prefix;
  for (const auto& item : tensors) {
    if (detail::wanted(spec, item.key(), /*with_layer=*/false)) {
      t.tensors.insert(item.key(), item.value());
    }
  }
  return detail::build_attention(spec, t);
}

TransformerEncoderLayer load_encoder_layer(const std::string& model_dir,
                                           int64_t layer) {
  const std::string where = detail::config_path(model_dir);
  const auto config =
      detail::parse_config(detail::read_config_text(model_dir), where);
  const auto spec = detail::layer_spec(config, layer, "encoder", where);
  TORCH_CHECK(spec.family == detail::Family::kBert, where, ": model_type '",
              spec.model_type,
              "' is not supported by load_encoder_layer (expected bert; use "
              "load_attention for the attention of other families)");
  torch::nn::activation_t activation = torch::kGELU;
  if (spec.hidden_act == "relu") {
    activation = torch::kReLU;
  } else if (spec.hidden_act == "gelu_new" ||
             spec.hidden_act == "gelu_pytorch_tanh") {
    activation = std::function<torch::Tensor(const torch::Tensor&)>(
        [](const torch::Tensor& x) { return torch::gelu(x, "tanh"); });
  } else {
    TORCH_CHECK(spec.hidden_act == "gelu", where, ": hidden_act '",
                spec.hidden_act,
                "' is not supported (expected gelu, gelu_new, "
                "gelu_pytorch_tanh or relu)");
  }
  TORCH_CHECK(config.contains("intermediate_size") &&
                  config["intermediate_size"].is_number_integer(),
              where, ": needs intermediate_size (an integer), which it lacks");
  const int64_t F = config["intermediate_size"].get<int64_t>();
  const int64_t E = spec.options.embed_dim();
  auto tensors =
      detail::read_checkpoint(model_dir, [&](const std::string& name) {
        return detail::wanted(spec, name, /*with_layer=*/true);
      });
  tensors.base_prefix = spec.base_prefix;
  const auto attn = detail::build_attention(spec, tensors);
  const std::string& P = spec.layer_prefix;
  const auto w1 = tensors.get(P + "intermediate.dense.weight", {F, E});
  TransformerEncoderLayer module(
      TransformerEncoderLayerOptions(E, spec.options.num_heads())
          .dim_feedforward(F)
          .dropout(0.0)
          .activation(activation)
          .layer_norm_eps(spec.layer_norm_eps)
          .batch_first(true)
          .norm_first(false));
  module->to(w1.scalar_type());
  module->eval();
  torch::NoGradGuard no_grad;
  for (const auto& item : attn->named_parameters()) {
    module->self_attn->named_parameters()[item.key()].copy_(item.value());
  }
  module->linear1->weight.copy_(w1);
  module->linear1->bias.copy_(tensors.get(P + "intermediate.dense.bias", {F}));
  module->linear2->weight.copy_(tensors.get(P + "output.dense.weight", {E, F}));
  module->linear2->bias.copy_(tensors.get(P + "output.dense.bias", {E}));
  module->norm1->weight.copy_(
      tensors.get(P + "attention.output.LayerNorm.weight", {E}));
  module->norm1->bias.copy_(
      tensors.get(P + "attention.output.LayerNorm.bias", {E}));
  module->norm2->weight.copy_(tensors.get(P + "output.LayerNorm.weight", {E}));
  module->norm2->bias.copy_(tensors.get(P + "output.LayerNorm.bias", {E}));
  return module;
}

}  // namespace mha::hf
