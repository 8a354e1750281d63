// Internal: the blocked path's matrix products, calling BLAS's gemm
// directly: batched for its one-block form (src/core/one_block_attention.cpp),
// one matrix at a time, from raw pointers, for its per-block form
// (src/core/blocked_attention.cpp: no tensor view is made for an operand). Not
// installed.
//
// Why: LibTorch 1.13's CPU bmm without MKL (Debian's build) runs each
// matrix of the batch as its own addmm, with three select views and the
// dispatcher around each; for the small matrices of a decoding step or a
// short chunk that is most of the time. Measured here (OpenBLAS 0.3.21, 2
// threads, float32): 8 products of (16 x 8)·(8 x 16) took 11-14 µs
// through at::bmm_out and 1.7-1.8 µs as 8 direct sgemm_ calls, with equal
// results bit for bit; 32 products of (8 x 64)·(64 x 128) 149-194 against
// 109-120 µs.
//
// Glossary: B batch of matrices, m x k times k x n gives m x n.
#pragma once

#include <torch/torch.h>

#include <string>

namespace mha::detail {

/// One matrix of float32 or float64 values in memory: element (i, j) at
/// data[i · row_stride + j · col_stride] (in elements).
struct StridedMatrix {
  void* data = nullptr;
  int64_t rows = 0, cols = 0, row_stride = 0, col_stride = 0;

  /// The transpose, in the same memory.
  StridedMatrix t() const { return {data, cols, rows, col_stride, row_stride}; }
};

/// A 2-D tensor's memory, for gemm_matrix.
inline StridedMatrix matrix_of(const torch::Tensor& t) {
  return {t.data_ptr(), t.size(0), t.size(1), t.stride(0), t.stride(1)};
}

/// c = alpha · a · b + beta · c (a: m x k, b: k x n, c: m x n, CPU memory
/// of `dtype`; beta 0: c's contents, NaN included, never read), with ATen's
/// CPU addmm's results bit for bit. Where LibTorch is built without MKL,
/// the dtype is float32 or float64 with BLAS's gemm found, m, n and k are
/// nonzero, a and b have unit stride along one dim, c is row-major (unit
/// column stride, not also readable as column-major: ATen computes those,
/// such as a contiguous one-column c, another way), a is not one row with a
/// row stride below k times a transposed b (LibTorch 2.x's addmm takes
/// another route there) and sizes and leading
/// dims fit an int, makes the one call of BLAS's gemm that addmm would
/// make, on the calling thread, and returns true; otherwise calls
/// at::addmm_out on tensors over the same memory and returns false. The
/// pointers must be valid for those shapes and strides (internal).
bool gemm_matrix(torch::ScalarType dtype, const StridedMatrix& a,
                 const StridedMatrix& b, double alpha, double beta,
                 const StridedMatrix& c);

/// out[i] = alpha · a[i] · b[i] for every i < B, every element of out
/// written (out's prior contents, NaN included, never read).
///
/// Shapes: out (B, m, n), a (B, m, k), b (B, k, n); all three CPU tensors of
/// one dtype. Where LibTorch is built without MKL (its bmm then calls BLAS
/// once per matrix: Debian's builds), the dtype is float32 or float64,
/// BLAS's Fortran gemm (sgemm_ / dgemm_, the interface ATen's CPU gemm
/// calls) is found among the loaded libraries, m·n·k is at least 400 (below it
/// ATen's bmm uses its own loop, not BLAS), each matrix of a and b has unit
/// stride in one of its last two dims, out's matrices are row-major (unit
/// column stride, not also readable as column-major: ATen computes those,
/// such as a contiguous one-column out, another way), the matrices are not
/// one-row a's with a row stride below k times transposed b's (as
/// gemm_matrix), and sizes and leading
/// dims fit an int, the products are one gemm call per matrix on the calling
/// thread, the call ATen's bmm makes for each matrix (same results);
/// otherwise at::bmm_out, then a multiply by alpha unless it is 1. BLAS's own
/// threads are used as set (mha's loops set one per call: blas_threads.h).
/// Shapes and dtypes are the caller's contract (internal; checked with
/// TORCH_INTERNAL_ASSERT).
void batched_gemm_out(const torch::Tensor& out, const torch::Tensor& a,
                      const torch::Tensor& b, double alpha);

/// True when batched_gemm_out and gemm_matrix can call BLAS's gemm
/// themselves for this dtype (no MKL in LibTorch, the gemm symbol found).
bool direct_gemm_available(torch::ScalarType dtype);

/// c = alpha · a · b + beta · c for float32 matrices (shapes, strides and
/// beta 0 as gemm_matrix's) through oneDNN's `dnnl_sgemm` (its C API,
/// dnnl.h: row-major, `transa`/`transb` 'N' or 'T'), where the process has
/// oneDNN loaded as a shared library built with the OpenMP or sequential
/// runtime: Debian's LibTorch links libdnnl.so (1.13: oneDNN 2.6; 2.14:
/// 3.12). Returns false, with nothing written, where it is not loaded or the
/// layout is not one gemm_matrix passes to BLAS.
///
/// Why: the per-block path's products (D = 64 columns of q, k and v) ran
/// 15-30 % faster on one core through dnnl_sgemm than through OpenBLAS's
/// SkylakeX sgemm, which packs both operands and clears c for every call
/// (measured here, float32, one thread, two products a block: 128 x 128
/// blocks 24.2 against 31.8 µs; 256 x 4096, 1617 against 2046 µs). The
/// results round differently from OpenBLAS's (not at::addmm's bits).
///
/// Threads: oneDNN runs a call on the caller's OpenMP team when called
/// outside a parallel region. The caller makes each call single threaded:
/// inside ATen's parallel region (the nested call then has one thread), or
/// with the calling thread's OpenMP thread count at 1 (OneOmpThread).
bool onednn_gemm_matrix(const StridedMatrix& a, const StridedMatrix& b,
                        double alpha, double beta, const StridedMatrix& c);

/// True when onednn_gemm_matrix can run (see there).
bool onednn_gemm_available();

/// True when onednn_gemm_matrix would compute c = a · b (float32 memory of
/// those shapes and strides) rather than return false: oneDNN is loaded,
/// no dim is empty and the layout is one it takes.
bool onednn_gemm_takes(const StridedMatrix& a, const StridedMatrix& b,
                       const StridedMatrix& c);

/// "oneDNN X.Y.Z" of the loaded library that onednn_gemm_matrix calls, or
/// empty when it is not available (for the tools' environment line).
std::string onednn_gemm_version();

}  // namespace mha::detail
