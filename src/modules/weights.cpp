#include "mha/weights.h"

#include <string>
#include <utility>

namespace mha {
namespace {

/// Both modules' parameters, by PyTorch name, in one place.
struct AttentionParameters {
  torch::Tensor in_proj_weight, q_proj_weight, k_proj_weight, v_proj_weight;
  torch::Tensor in_proj_bias, bias_k, bias_v, out_weight, out_bias;
};

AttentionParameters parameters_of(const torch::nn::MultiheadAttentionImpl& m) {
  const bool packed = m._qkv_same_embed_dim;
  return {packed ? m.in_proj_weight : torch::Tensor(),
          packed ? torch::Tensor() : m.q_proj_weight,
          packed ? torch::Tensor() : m.k_proj_weight,
          packed ? torch::Tensor() : m.v_proj_weight,
          m.options.bias() ? m.in_proj_bias : torch::Tensor(),
          m.options.add_bias_kv() ? m.bias_k : torch::Tensor(),
          m.options.add_bias_kv() ? m.bias_v : torch::Tensor(),
          m.out_proj->weight,
          m.out_proj->bias};
}

AttentionParameters parameters_of(const MultiHeadAttentionImpl& m) {
  return {m.in_proj_weight, m.q_proj_weight,    m.k_proj_weight,
          m.v_proj_weight,  m.in_proj_bias,     m.bias_k,
          m.bias_v,         m.out_proj->weight, m.out_proj->bias};
}

void check_option(const char* name, int64_t from, int64_t to) {
  TORCH_CHECK(from == to, "copy_weights: option ", name,
              " differs: source has ", from, ", destination has ", to);
}

void copy_one(const char* name, const torch::Tensor& from, torch::Tensor& to) {
  TORCH_CHECK(from.defined() == to.defined(), "copy_weights: parameter ", name,
              " exists in the ", from.defined() ? "source" : "destination",
              " only");
  if (!from.defined()) {
    return;
  }
  TORCH_CHECK(from.sizes() == to.sizes(), "copy_weights: parameter ", name,
              " must have the destination's shape ", to.sizes(),
              ", but the source has ", from.sizes());
  to.copy_(from);
}

void copy_all(const AttentionParameters& from, AttentionParameters to) {
  torch::NoGradGuard no_grad;
  copy_one("in_proj_weight", from.in_proj_weight, to.in_proj_weight);
  copy_one("q_proj_weight", from.q_proj_weight, to.q_proj_weight);
  copy_one("k_proj_weight", from.k_proj_weight, to.k_proj_weight);
  copy_one("v_proj_weight", from.v_proj_weight, to.v_proj_weight);
  copy_one("in_proj_bias", from.in_proj_bias, to.in_proj_bias);
  copy_one("bias_k", from.bias_k, to.bias_k);
  copy_one("bias_v", from.bias_v, to.bias_v);
  copy_one("out_proj.weight", from.out_weight, to.out_weight);
  copy_one("out_proj.bias", from.out_bias, to.out_bias);
}

void check_options(const torch::nn::MultiheadAttentionOptions& ref,
                   const MultiHeadAttentionImpl& ours, bool ref_is_source) {
  auto check = [&](const char* name, int64_t ref_value, int64_t our_value) {
    if (ref_is_source) {
      check_option(name, ref_value, our_value);
    } else {
      check_option(name, our_value, ref_value);
    }
  };
  check("embed_dim", ref.embed_dim(), ours.options.embed_dim());
  check("num_heads", ref.num_heads(), ours.options.num_heads());
  check("kdim", ref.kdim(), ours.kdim());
  check("vdim", ref.vdim(), ours.vdim());
  check("bias", ref.bias(), ours.options.bias());
  check("add_bias_kv", ref.add_bias_kv(), ours.options.add_bias_kv());
  check("add_zero_attn", ref.add_zero_attn(), ours.options.add_zero_attn());
  TORCH_CHECK(ours.options.attention_kind() == AttentionKind::kSoftmax,
              "copy_weights: option attention_kind must be kSoftmax, the "
              "attention of torch::nn::MultiheadAttention, but mha's module "
              "has ",
              to_string(ours.options.attention_kind()));
}

}  // namespace

void copy_weights(const torch::nn::MultiheadAttention& from,
                  MultiHeadAttention& to) {
  TORCH_CHECK(!from.is_empty() && !to.is_empty(),
              "copy_weights: a module holder is empty (nullptr)");
  check_options(from->options, *to, /*ref_is_source=*/true);
  copy_all(parameters_of(*from), parameters_of(*to));
}

void copy_weights(const MultiHeadAttention& from,
                  torch::nn::MultiheadAttention& to) {
  TORCH_CHECK(!from.is_empty() && !to.is_empty(),
              "copy_weights: a module holder is empty (nullptr)");
  check_options(to->options, *from, /*ref_is_source=*/false);
  copy_all(parameters_of(*from), parameters_of(*to));
}

namespace {

void check_layer_options(const torch::nn::TransformerEncoderLayerOptions& ref,
                         const TransformerEncoderLayerOptions& ours,
                         bool ref_is_source) {
  auto check = [&](const char* name, int64_t ref_value, int64_t our_value) {
    if (ref_is_source) {
      check_option(name, ref_value, our_value);
    } else {
      check_option(name, our_value, ref_value);
    }
  };
  check("d_model", ref.d_model(), ours.d_model());
  check("nhead", ref.nhead(), ours.nhead());
  check("dim_feedforward", ref.dim_feedforward(), ours.dim_feedforward());
  check("bias", /*LibTorch's layer always has biases*/ 1, ours.bias());
}

/// Copies the parameters outside self_attn; `to_ref` says which side is
/// LibTorch's.
void copy_layer_rest(const torch::nn::TransformerEncoderLayerImpl& ref,
                     const TransformerEncoderLayerImpl& ours, bool to_ref) {
  torch::NoGradGuard no_grad;
  const std::pair<const char*, std::pair<torch::Tensor, torch::Tensor>>
      pairs[] = {
          {"linear1.weight", {ref.linear1->weight, ours.linear1->weight}},
          {"linear1.bias", {ref.linear1->bias, ours.linear1->bias}},
          {"linear2.weight", {ref.linear2->weight, ours.linear2->weight}},
          {"linear2.bias", {ref.linear2->bias, ours.linear2->bias}},
          {"norm1.weight", {ref.norm1->weight, ours.norm1->weight}},
          {"norm1.bias", {ref.norm1->bias, ours.norm1->bias}},
          {"norm2.weight", {ref.norm2->weight, ours.norm2->weight}},
          {"norm2.bias", {ref.norm2->bias, ours.norm2->bias}}};
  for (const auto& [name, tensors] : pairs) {
    auto destination = to_ref ? tensors.first : tensors.second;
    copy_one(name, to_ref ? tensors.second : tensors.first, destination);
  }
}

}  // namespace

void copy_weights(const torch::nn::TransformerEncoderLayer& from,
                  TransformerEncoderLayer& to) {
  TORCH_CHECK(!from.is_empty() && !to.is_empty(),
              "copy_weights: a module holder is empty (nullptr)");
  check_layer_options(from->options, to->options, /*ref_is_source=*/true);
  copy_weights(from->self_attn, to->self_attn);
  copy_layer_rest(*from, *to, /*to_ref=*/false);
}

void copy_weights(const TransformerEncoderLayer& from,
                  torch::nn::TransformerEncoderLayer& to) {
  TORCH_CHECK(!from.is_empty() && !to.is_empty(),
              "copy_weights: a module holder is empty (nullptr)");
  check_layer_options(to->options, from->options, /*ref_is_source=*/false);
  copy_weights(from->self_attn, to->self_attn);
  copy_layer_rest(*to, *from, /*to_ref=*/true);
}

}  // namespace mha
