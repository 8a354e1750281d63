// Batched matrix products through BLAS's gemm, called directly: see
// blas_gemm.h for why.
#include "core/blas_gemm.h"

#include <ATen/Context.h>
#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

namespace mha::detail {

namespace {

// The Fortran BLAS interface (column-major, every argument by pointer),
// LP64: int dimensions, as Debian's libblas.so.3 alternatives and
// OpenBLAS's default build export it.
template <typename T>
using FortranGemm = void (*)(const char* transa, const char* transb,
                             const int* m, const int* n, const int* k,
                             const T* alpha, const T* a, const int* lda,
                             const T* b, const int* ldb, const T* beta, T* c,
                             const int* ldc);

/// The gemm functions batched_gemm_out calls: none in a LibTorch built
/// with MKL, whose bmm makes one batched MKL call rather than a BLAS call
/// per matrix (calling BLAS here would change its results' rounding).
struct Gemms {
  FortranGemm<float> sgemm = nullptr;
  FortranGemm<double> dgemm = nullptr;

  static const Gemms& instance() {
    static const Gemms gemms = [] {
      Gemms g;
      if (at::hasMKL()) {
        return g;
      }
      // dlsym returns void*; POSIX guarantees the cast to a function pointer.
      g.sgemm =
          reinterpret_cast<FortranGemm<float>>(dlsym(RTLD_DEFAULT, "sgemm_"));
      g.dgemm =
          reinterpret_cast<FortranGemm<double>>(dlsym(RTLD_DEFAULT, "dgemm_"));
      return g;
    }();
    return gemms;
  }
};

template <typename T>
FortranGemm<T> gemm_for();
template <>
FortranGemm<float> gemm_for<float>() {
  return Gemms::instance().sgemm;
}
template <>
FortranGemm<double> gemm_for<double>() {
  return Gemms::instance().dgemm;
}

/// ATen's CPU bmm multiplies matrices with fewer multiply-adds than this
/// (m·n·k) in its own loop rather than through BLAS
/// (bmm_out_or_baddbmm_ in aten/src/ATen/native/LinearAlgebra.cpp, 1.13
/// to 2.x). Below it batched_gemm_out calls at::bmm_out too, so that its
/// results stay those of ATen's bmm bit for bit on either side.
constexpr int64_t kAtenBlasMinWork = 400;

bool fits_int(int64_t x) { return x >= 0 && x <= INT_MAX; }

/// How BLAS reads one row-major (rows x cols) matrix with strides
/// (row_stride, col_stride): column-major memory with leading dim `ld` is
/// the matrix transposed ('N', unit column stride) or the matrix itself
/// ('T', unit row stride). A dim of size 1 lets its stride be anything.
struct Operand {
  char trans = 'N';
  int64_t ld = 1;
  bool ok = false;
};

Operand operand(int64_t rows, int64_t cols, int64_t row_stride,
                int64_t col_stride) {
  Operand o;
  if (col_stride == 1 || cols == 1) {
    o.trans = 'N';
    o.ld = rows == 1 ? std::max<int64_t>(cols, 1) : row_stride;
    o.ok = o.ld >= std::max<int64_t>(cols, 1);
    if (o.ok) {
      return o;
    }
  }
  if (row_stride == 1 || rows == 1) {
    o.trans = 'T';
    o.ld = cols == 1 ? std::max<int64_t>(rows, 1) : col_stride;
    o.ok = o.ld >= std::max<int64_t>(rows, 1);
  }
  return o;
}

/// One product by one gemm call: see gemm_matrix.
template <typename T>
bool gemm_one(const StridedMatrix& a, const StridedMatrix& b, double alpha,
              double beta, const StridedMatrix& c) {
  const auto gemm = gemm_for<T>();
  const int64_t m = c.rows, n = c.cols, k = a.cols;
  if (gemm == nullptr || m == 0 || n == 0 || k == 0) {
    return false;  // ATen writes beta · c (or zeros) without BLAS
  }
  // Column-major BLAS computes cᵀ (n x m) = bᵀ (n x k) · aᵀ (k x m) into
  // c's row-major memory. ATen's addmm makes this call only for a row-major
  // c; it computes a column-major c (such as a contiguous (m, 1) one:
  // strides (1, 1)) as c = a · b, and any other c through a copy, which can
  // round differently (float64, n = 1, OpenBLAS 0.3.21).
  const bool aten_column_major =
      c.row_stride == 1 && (n == 1 || c.col_stride >= std::max<int64_t>(1, m));
  const bool aten_row_major =
      c.col_stride == 1 && (m == 1 || c.row_stride >= std::max<int64_t>(1, n));
  const Operand oa = operand(m, k, a.row_stride, a.col_stride);
  const Operand ob = operand(k, n, b.row_stride, b.col_stride);
  const Operand oc = operand(m, n, c.row_stride, c.col_stride);
  // A one-row a whose row stride is below k (a column's transpose: strides
  // (1, 1)) times a transposed b: LibTorch 2.14's addmm does not make this
  // call there (its float32 and float64 results differed from it in the
  // last bits; 1.13's matched). Neither of mha's paths passes that layout;
  // ATen keeps it on every version.
  const bool aten_own_route =
      m == 1 && k > 1 && a.row_stride < k && ob.trans == 'T';
  if (aten_column_major || !aten_row_major || aten_own_route || !oa.ok ||
      !ob.ok || !oc.ok || oc.trans != 'N' ||
      !(fits_int(m) && fits_int(n) && fits_int(k) && fits_int(oa.ld) &&
        fits_int(ob.ld) && fits_int(oc.ld))) {
    return false;
  }
  const int im = static_cast<int>(m), in = static_cast<int>(n),
            ik = static_cast<int>(k), lda = static_cast<int>(oa.ld),
            ldb = static_cast<int>(ob.ld), ldc = static_cast<int>(oc.ld);
  const T t_alpha = static_cast<T>(alpha), t_beta = static_cast<T>(beta);
  gemm(&ob.trans, &oa.trans, &in, &im, &ik, &t_alpha,
       static_cast<const T*>(b.data), &ldb, static_cast<const T*>(a.data), &lda,
       &t_beta, static_cast<T*>(c.data), &ldc);
  return true;
}

/// Matrix i of a 3-D CPU tensor of T.
template <typename T>
StridedMatrix matrix(const torch::Tensor& t, int64_t i) {
  return {t.data_ptr<T>() + i * t.stride(0), t.size(1), t.size(2), t.stride(1),
          t.stride(2)};
}

/// The direct calls of batched_gemm_out; false (nothing written) where they
/// do not apply.
template <typename T>
bool direct_gemm(const torch::Tensor& out, const torch::Tensor& a,
                 const torch::Tensor& b, double alpha) {
  const int64_t batch = out.size(0);
  if (out.size(1) * out.size(2) * a.size(2) < kAtenBlasMinWork || batch == 0) {
    return false;
  }
  // Every matrix of a batch has the same sizes and strides: the first
  // decides for all.
  if (!gemm_one<T>(matrix<T>(a, 0), matrix<T>(b, 0), alpha, 0.0,
                   matrix<T>(out, 0))) {
    return false;
  }
  for (int64_t i = 1; i < batch; ++i) {
    gemm_one<T>(matrix<T>(a, i), matrix<T>(b, i), alpha, 0.0,
                matrix<T>(out, i));
  }
  return true;
}

}  // namespace

bool gemm_matrix(torch::ScalarType dtype, const StridedMatrix& a,
                 const StridedMatrix& b, double alpha, double beta,
                 const StridedMatrix& c) {
  TORCH_INTERNAL_ASSERT(a.rows == c.rows && b.cols == c.cols &&
                        a.cols == b.rows);
  if ((dtype == torch::kFloat32 && gemm_one<float>(a, b, alpha, beta, c)) ||
      (dtype == torch::kFloat64 && gemm_one<double>(a, b, alpha, beta, c))) {
    return true;
  }
  // ATen's addmm on tensors over the same memory (mm is addmm with beta 0).
  auto tensor = [dtype](const StridedMatrix& m) {
    return at::from_blob(m.data, {m.rows, m.cols}, {m.row_stride, m.col_stride},
                         at::TensorOptions().dtype(dtype));
  };
  auto out = tensor(c);
  at::addmm_out(out, out, tensor(a), tensor(b), beta, alpha);
  return false;
}

namespace {

// oneDNN's C API (dnnl.h, dnnl_types.h; unchanged from 1.0 to 3.x):
// dnnl_sgemm returns a dnnl_status_t (0: success); dnnl_version's struct
// starts with these fields. CPU runtimes (dnnl_config.h): 1 sequential,
// 2 OpenMP.
using DnnlSgemm = int (*)(char transa, char transb, int64_t m, int64_t n,
                          int64_t k, float alpha, const float* a, int64_t lda,
                          const float* b, int64_t ldb, float beta, float* c,
                          int64_t ldc);
struct DnnlVersion {
  int major, minor, patch;
  const char* hash;
  unsigned cpu_runtime;
};
using DnnlVersionFn = const DnnlVersion* (*)();
constexpr unsigned kDnnlRuntimeSequential = 1;
constexpr unsigned kDnnlRuntimeOpenMp = 2;

struct OneDnn {
  DnnlSgemm sgemm = nullptr;
  std::string version;

  static const OneDnn& instance() {
    static const OneDnn onednn = [] {
      OneDnn d;
      // dlsym returns void*; POSIX guarantees the cast to a function pointer.
      const auto sgemm =
          reinterpret_cast<DnnlSgemm>(dlsym(RTLD_DEFAULT, "dnnl_sgemm"));
      const auto version_fn =
          reinterpret_cast<DnnlVersionFn>(dlsym(RTLD_DEFAULT, "dnnl_version"));
      const DnnlVersion* v = version_fn != nullptr ? version_fn() : nullptr;
      if (sgemm == nullptr || v == nullptr ||
          (v->cpu_runtime != kDnnlRuntimeOpenMp &&
           v->cpu_runtime != kDnnlRuntimeSequential)) {
        return d;  // threads mha could not hold to one per call
      }
      d.sgemm = sgemm;
      d.version = "oneDNN " + std::to_string(v->major) + "." +
                  std::to_string(v->minor) + "." + std::to_string(v->patch);
      return d;
    }();
    return onednn;
  }
};

}  // namespace

bool onednn_gemm_available() { return OneDnn::instance().sgemm != nullptr; }

std::string onednn_gemm_version() { return OneDnn::instance().version; }

bool onednn_gemm_takes(const StridedMatrix& a, const StridedMatrix& b,
                       const StridedMatrix& c) {
  TORCH_INTERNAL_ASSERT(a.rows == c.rows && b.cols == c.cols &&
                        a.cols == b.rows);
  const int64_t m = c.rows, n = c.cols, k = a.cols;
  if (OneDnn::instance().sgemm == nullptr || m == 0 || n == 0 || k == 0) {
    return false;
  }
  // Row-major operands: Operand's column-major view of the transpose.
  // Its 'N' (unit column stride) is row-major 'N' with leading dim ld.
  const Operand oc = operand(m, n, c.row_stride, c.col_stride);
  return operand(m, k, a.row_stride, a.col_stride).ok &&
         operand(k, n, b.row_stride, b.col_stride).ok && oc.ok &&
         oc.trans == 'N';
}

bool onednn_gemm_matrix(const StridedMatrix& a, const StridedMatrix& b,
                        double alpha, double beta, const StridedMatrix& c) {
  if (!onednn_gemm_takes(a, b, c)) {
    return false;
  }
  const int64_t m = c.rows, n = c.cols, k = a.cols;
  const Operand oa = operand(m, k, a.row_stride, a.col_stride);
  const Operand ob = operand(k, n, b.row_stride, b.col_stride);
  const Operand oc = operand(m, n, c.row_stride, c.col_stride);
  const int status = OneDnn::instance().sgemm(
      oa.trans, ob.trans, m, n, k, static_cast<float>(alpha),
      static_cast<const float*>(a.data), oa.ld,
      static_cast<const float*>(b.data), ob.ld, static_cast<float>(beta),
      static_cast<float*>(c.data), oc.ld);
  TORCH_CHECK(status == 0, "dnnl_sgemm failed with status ", status, " for ", m,
              " x ", k, " times ", k, " x ", n);
  return true;
}

bool direct_gemm_available(torch::ScalarType dtype) {
  return (dtype == torch::kFloat32 && Gemms::instance().sgemm != nullptr) ||
         (dtype == torch::kFloat64 && Gemms::instance().dgemm != nullptr);
}

void batched_gemm_out(const torch::Tensor& out, const torch::Tensor& a,
                      const torch::Tensor& b, double alpha) {
  TORCH_INTERNAL_ASSERT(out.dim() == 3 && a.dim() == 3 && b.dim() == 3);
  TORCH_INTERNAL_ASSERT(a.size(0) == out.size(0) && b.size(0) == out.size(0) &&
                        a.size(1) == out.size(1) && b.size(2) == out.size(2) &&
                        a.size(2) == b.size(1));
  TORCH_INTERNAL_ASSERT(a.scalar_type() == out.scalar_type() &&
                        b.scalar_type() == out.scalar_type());
  const bool cpu = out.is_cpu() && a.is_cpu() && b.is_cpu();
  if (cpu && out.scalar_type() == torch::kFloat32 &&
      direct_gemm<float>(out, a, b, alpha)) {
    return;
  }
  if (cpu && out.scalar_type() == torch::kFloat64 &&
      direct_gemm<double>(out, a, b, alpha)) {
    return;
  }
  // Not baddbmm with beta = 0 on an uninitialised `out`: LibTorch 1.13's
  // kernel for tiny matrices (under 400 multiply-adds) adds beta · NaN as
  // NaN.
  torch::Tensor result = out;
  at::bmm_out(result, a, b);
  if (alpha != 1.0) {
    result.mul_(alpha);
  }
}

}  // namespace mha::detail
