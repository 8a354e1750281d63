// The public attention function and module (mha/attention.h): checks the
// inputs, merges the masks, and hands the call to the attention core
// (attention_core.h), which picks the path that computes it.
//
// Glossary: L target (query) length, S source (key) length, E query/key
// feature size, Ev value feature size, "..." any leading (batch, head) dims.
#include "mha/attention.h"

#include <cmath>
#include <tuple>

#include "core/attention_core.h"
#include "core/blas_threads.h"
#include "mha/masks.h"

namespace mha {

namespace {

void check_sdpa_inputs(const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, double dropout_p) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(),
              "scaled_dot_product_attention: query, key and value must all be "
              "defined");
  TORCH_CHECK(query.dim() >= 2,
              "scaled_dot_product_attention: query must be (..., L, E) with at "
              "least 2 dims, but got ",
              query.sizes());
  TORCH_CHECK(key.dim() == query.dim() && value.dim() == query.dim(),
              "scaled_dot_product_attention: key and value must have query's ",
              query.dim(), " dims, but got key ", key.sizes(), " and value ",
              value.sizes());
  const auto lead = query.sizes().slice(0, query.dim() - 2);
  TORCH_CHECK(key.sizes().slice(0, key.dim() - 2) == lead &&
                  value.sizes().slice(0, value.dim() - 2) == lead,
              "scaled_dot_product_attention: key and value must have query's "
              "leading dims ",
              lead, ", but got query ", query.sizes(), ", key ", key.sizes(),
              ", value ", value.sizes());
  TORCH_CHECK(key.size(-1) == query.size(-1),
              "scaled_dot_product_attention: key must be (..., S, E) with "
              "query's E = ",
              query.size(-1), ", but got ", key.sizes());
  TORCH_CHECK(value.size(-2) == key.size(-2),
              "scaled_dot_product_attention: value must be (..., S, Ev) with "
              "key's S = ",
              key.size(-2), ", but got ", value.sizes());
  TORCH_CHECK(torch::isFloatingType(query.scalar_type()),
              "scaled_dot_product_attention: query must be floating, but got "
              "dtype ",
              query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "scaled_dot_product_attention: key and value must have query's "
              "dtype ",
              query.scalar_type(), ", but got key ", key.scalar_type(),
              " and value ", value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      "scaled_dot_product_attention: key and value must be on query's "
      "device ",
      query.device(), ", but got key on ", key.device(), " and value on ",
      value.device());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "scaled_dot_product_attention: dropout_p must be in [0, 1), but "
              "got ",
              dropout_p);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& attn_mask,
    double dropout_p, bool is_causal, c10::optional<double> scale,
    bool need_weights) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  check_sdpa_inputs(query, key, value, dropout_p);
  const int64_t S = key.size(-2);
  const int64_t E = query.size(-1);
  check_mask(attn_mask, "attn_mask", query.scalar_type(), query.device());
  if (attn_mask.defined()) {
    auto target = query.sizes().vec();  // (..., L, S)
    target.back() = S;
    detail::check_broadcastable(attn_mask, "attn_mask", target, "(..., L, S)");
  }
  const double scale_value =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
  TORCH_CHECK(std::isfinite(scale_value),
              "scaled_dot_product_attention: scale must be finite, but got ",
              scale_value);
  // One additive mask; merge_masks turns a bool mask into 0 / -inf.
  auto mask = merge_masks({attn_mask}, query.scalar_type());
  auto result = detail::attention_core(
      query, key, value, mask, is_causal, dropout_p, scale_value,
      need_weights ? detail::WeightsMode::kPerHead
                   : detail::WeightsMode::kNone);
  return {result.output, result.weights};
}

ScaledDotProductAttentionImpl::ScaledDotProductAttentionImpl(
    const ScaledDotProductAttentionOptions& options_)
    : options(options_) {
  reset();
}

void ScaledDotProductAttentionImpl::reset() {
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "ScaledDotProductAttention: dropout must be in [0, 1), but got ",
              options.dropout());
}

std::tuple<torch::Tensor, torch::Tensor> ScaledDotProductAttentionImpl::forward(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& attn_mask, bool is_causal,
    bool need_weights) {
  const double p = is_training() ? options.dropout() : 0.0;
  return scaled_dot_product_attention(query, key, value, attn_mask, p,
                                      is_causal, options.scale(), need_weights);
}

void ScaledDotProductAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "mha::ScaledDotProductAttention(";
  const char* sep = "";
  if (options.dropout() != 0.0) {
    stream << "dropout=" << options.dropout();
    sep = ", ";
  }
  if (options.scale().has_value()) {
    stream << sep << "scale=" << *options.scale();
  }
  stream << ")";
}

}  // namespace mha
