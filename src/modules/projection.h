// Internal: the linear map the modules run their projections through.
#pragma once

#include <torch/torch.h>

namespace mha::detail {

/// x · wᵀ + b for x (N, T, F) (or any rank F::linear takes), w (F', F),
/// b (F') or undefined; the result of at::addmm / F::linear bit for bit.
/// A contiguous 3-D x is one addmm with the bias fused (F::linear on 3-D
/// inputs runs a matmul and a separate bias pass); a (N, T, F) view of a
/// contiguous (T, N, F) tensor (seq-first input) is projected in place,
/// without copying it, and gives the same kind of view. With a bias, on
/// the CPU and a dtype gemm_matrix takes, the bias rows of an output of at
/// most 2^20 elements are copied on the calling thread and the product is
/// gemm_matrix's one BLAS call (the call addmm makes): at::addmm copies
/// them with a parallel copy_ whose wake-up of ATen's other thread costs
/// more than the copy at a module's sizes.
/// When a gradient is recorded, that forward runs in an autograd function
/// whose backward makes AddmmBackward0's calls, so the gradients of x, w and
/// b are also addmm's bit for bit.
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w,
                      const torch::Tensor& b);

}  // namespace mha::detail
