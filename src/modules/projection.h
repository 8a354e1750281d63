// Internal: the linear map the modules run their projections through.
#pragma once

#include <torch/torch.h>

namespace mha::detail {

/// x · wᵀ + b for x (N, T, F) (or any rank F::linear takes), w (F', F),
/// b (F') or undefined. A contiguous 3-D x is one product with the bias
/// fused (F::linear on 3-D inputs runs a matmul and a separate bias pass);
/// a (N, T, F) view of a contiguous (T, N, F) tensor (seq-first input) is
/// projected in place, without copying it, and gives the same kind of
/// view. On the CPU, where LibTorch calls BLAS itself (no MKL):
/// - float32 where oneDNN's dnnl_sgemm is loaded and can be held to one
///   thread per call (Debian's LibTorch 1.13 and 2.x): the product in
///   fixed chunks of rows, one single-threaded oneDNN call each, on the
///   threads the blocked core's items use (module_inputs.cpp,
///   onednn_product), 1.7-2x faster
///   than addmm's OpenBLAS product on the modules' shapes; within float32's
///   rounding of addmm's result, not its bits, and the same bits at every
///   thread count;
/// - otherwise (float64, no oneDNN) at::addmm's result bit for bit: the
///   bias rows of an output of at most 2^20 elements copied on the calling
///   thread and gemm_matrix's one BLAS call (the call addmm makes): addmm
///   copies them with a parallel copy_ whose wake-up of ATen's other
///   thread costs more than the copy at a module's sizes.
/// When a gradient is recorded, that forward runs in an autograd function
/// whose backward makes AddmmBackward0's products the same way (x's and w's
/// gradients through oneDNN's chunks in float32, b's as addmm's), and
/// addmm's own calls under create_graph, so second derivatives are
/// recorded. Other devices and layouts take at::addmm (at::mm without b).
torch::Tensor project(const torch::Tensor& x, const torch::Tensor& w,
                      const torch::Tensor& b);

}  // namespace mha::detail
