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
/// broadcastable to (..., L, S), or undefined. Inputs are assumed checked.
AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value,
                               const torch::Tensor& mask, double dropout_p,
                               double scale, bool need_weights);

/// Checks that `mask` (already dtype/device checked) broadcasts to `target`
/// without growing: at most as many dims, each size equal or 1.
void check_broadcastable(const torch::Tensor& mask, const char* name,
                         torch::IntArrayRef target, const char* target_name);

}  // namespace mha::detail
