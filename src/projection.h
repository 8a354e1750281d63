// Internal: the linear map the modules run their projections through.
#pragma once

#include <torch/torch.h>

namespace mha::detail {

/// x · wᵀ + b for x (N, T, F) (or any rank F::linear takes), w (F', F),
/// b (F') or undefined. A contiguous 3-D x is one addmm with the bias fused
/// (F::linear on 3-D inputs runs a matmul and a separate bias pass); a
/// (N, T, F) view of a contiguous (T, N, F) tensor (seq-first input) is
/// projected in place, without copying it, and gives the same kind of view.
inline torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w,
                             const torch::Tensor& b) {
  if (x.dim() != 3) {
    return torch::nn::functional::linear(x, w, b);
  }
  if (!x.is_contiguous() && x.transpose(0, 1).is_contiguous()) {
    return project(x.transpose(0, 1), w, b).transpose(0, 1);
  }
  const auto rows = x.size(0) * x.size(1);
  auto x2d = x.reshape({rows, x.size(2)});  // (N·T, F), a view if contiguous
  auto y = b.defined() ? at::addmm(b, x2d, w.t()) : at::mm(x2d, w.t());
  return y.view({x.size(0), x.size(1), w.size(0)});  // (N, T, F')
}

}  // namespace mha::detail
