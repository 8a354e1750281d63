// Internal: the attention step shared by the public function and the modules,
// after their inputs have been checked. Not installed.
#pragma once

#include <torch/torch.h>

namespace mha::detail {

/// The result of one attention step.
struct AttentionResult {
  torch::Tensor output;   // (..., L, Ev)
  torch::Tensor weights;  // (..., L, S) after dropout, or undefined
};

/// softmax(query · keyᵀ · scale + mask) · value with fully masked rows set to
/// 0. `mask` is additive (0 / -inf / any float) of query's dtype,
/// broadcastable to (..., L, S), or undefined; `is_causal` blocks key j for
/// query i when j > i (top-left), on top of `mask`. Inputs are assumed
/// checked.
///
/// Two paths with the same results within the dtype's tolerance: without
/// `need_weights`, LibTorch's fused kernel where it meets the semantics
/// (see compat.h); otherwise the explicit softmax path, which accumulates the
/// softmax of float16 / bfloat16 scores in float32.
AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value,
                               const torch::Tensor& mask, bool is_causal,
                               double dropout_p, double scale,
                               bool need_weights);

/// The explicit path of attention_core, whatever the LibTorch version.
AttentionResult explicit_attention(const torch::Tensor& query,
                                   const torch::Tensor& key,
                                   const torch::Tensor& value,
                                   const torch::Tensor& mask, bool is_causal,
                                   double dropout_p, double scale,
                                   bool need_weights);

/// Checks that `mask` (already dtype/device checked) broadcasts to `target`
/// without growing: at most as many dims, each size equal or 1.
void check_broadcastable(const torch::Tensor& mask, const char* name,
                         torch::IntArrayRef target, const char* target_name);

}  // namespace mha::detail
