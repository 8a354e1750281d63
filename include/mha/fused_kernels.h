// Fused mods: the row kernels a fused score or mask function is
// instantiated in (in the translation unit that calls fused_score_mod /
// fused_mask_mod, so that the compiler inlines the user's lambda), and the
// interfaces through which the library's CPU core calls them
// (flex_attention.h; the core: src/core/blocked_flex.cpp).
//
// A row kernel runs the mod over a run of keys kv0, kv0 + 1, ... of one
// query row, one key at a time in a loop the compiler vectorises, on scores
// already in cache: the mod costs a few vector instructions a score. Speed in
// the user's build (no -march): each kernel is compiled three times, for
// AVX-512 (F, DQ, BW, VL), for AVX2 + FMA and for the baseline, through the
// compiler's target attributes, and the widest the CPU runs is picked once (GCC
// and Clang on x86-64; other compilers and CPUs get the baseline only).
// `flatten` inlines the lambda and the math into each of them.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <exception>
#include <string>

#include "mha/fused.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MHA_FUSED_X86 1
#define MHA_FUSED_AVX512                                                     \
  __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma,bmi2"), \
                 flatten))
#define MHA_FUSED_AVX2 __attribute__((target("avx2,fma,bmi2"), flatten))
#define MHA_FUSED_BASELINE __attribute__((flatten))
#elif defined(__GNUC__) || defined(__clang__)
#define MHA_FUSED_X86 0
#define MHA_FUSED_BASELINE __attribute__((flatten))
#else
#define MHA_FUSED_X86 0
#define MHA_FUSED_BASELINE
#endif

namespace mha::detail {

/// A fused score mod as the CPU core calls it, on contiguous runs of keys
/// of one query row. Row (b, h, q): h the query head.
class FusedScoreKernel {
 public:
  virtual ~FusedScoreKernel() = default;
  /// s[j] = f(s[j], b, h, q, kv0 + j) for j in [0, n), in place.
  virtual void apply(float* s, int64_t n, int64_t b, int64_t h, int64_t q,
                     int64_t kv0) const = 0;
  virtual void apply(double* s, int64_t n, int64_t b, int64_t h, int64_t q,
                     int64_t kv0) const = 0;
  /// As apply, and d[j] = ∂f/∂s at the old s[j] (f on dual numbers).
  virtual void apply_with_derivative(float* s, float* d, int64_t n, int64_t b,
                                     int64_t h, int64_t q,
                                     int64_t kv0) const = 0;
  virtual void apply_with_derivative(double* s, double* d, int64_t n, int64_t b,
                                     int64_t h, int64_t q,
                                     int64_t kv0) const = 0;
};

/// A fused mask mod as the CPU core calls it.
class FusedMaskKernel {
 public:
  virtual ~FusedMaskKernel() = default;
  /// allowed[j] = f(b, h, q, kv0 + j) (1 = may attend) for j in [0, n).
  virtual void allowed(uint8_t* allowed, int64_t n, int64_t b, int64_t h,
                       int64_t q, int64_t kv0) const = 0;
};

/// The widest row kernels this CPU runs: 2 AVX-512, 1 AVX2 + FMA, 0 the
/// baseline (ATEN_CPU_CAPABILITY=avx2 or default caps it, as LibTorch's own
/// kernels).
int fused_cpu_level();

/// Rethrows the exception in flight as a c10::Error naming `what` (the mod's
/// kind) and its message.
[[noreturn]] void rethrow_fused_error(const char* what);

/// Throws the c10::Error of a Table lookup out of range in the fused mod of
/// kind `what` (see mha::fused::lookup), on query row q, keys [kv0, kv0 + n).
[[noreturn]] void table_index_error(const char* what, int64_t q, int64_t kv0,
                                    int64_t n);

namespace fused_rows {

using mha::fused::Dual;

// Each kernel is one loop over the run with the mod instantiated on plain
// numbers (a score, its key's int64 position): the compiler's loop
// vectoriser then runs it on the widest vectors of the build (16 floats
// with AVX-512), as it cannot do as well with the lane loops of packs.
template <class T, class F>
inline void score_rows(const F& f, T* s, int64_t n, int64_t b, int64_t h,
                       int64_t q, int64_t kv0) {
  for (int64_t j = 0; j < n; ++j) {
    s[j] = mha::fused::as_value<T>(f(s[j], b, h, q, kv0 + j));
  }
}

template <class T, class F>
inline void score_rows_with_derivative(const F& f, T* s, T* d, int64_t n,
                                       int64_t b, int64_t h, int64_t q,
                                       int64_t kv0) {
  for (int64_t j = 0; j < n; ++j) {
    const auto r =
        mha::fused::as_dual<T>(f(Dual<T>{s[j], T(1)}, b, h, q, kv0 + j));
    s[j] = r.v;
    d[j] = r.d;
  }
}

template <class F>
inline void mask_rows(const F& f, uint8_t* allowed, int64_t n, int64_t b,
                      int64_t h, int64_t q, int64_t kv0) {
  for (int64_t j = 0; j < n; ++j) {
    allowed[j] = static_cast<uint8_t>(f(b, h, q, kv0 + j) ? 1 : 0);
  }
}

// The three builds of each row kernel (see the file comment).
#define MHA_FUSED_BUILDS(suffix, attributes)                             \
  template <class T, class F>                                            \
  attributes void score_##suffix(const F& f, T* s, int64_t n, int64_t b, \
                                 int64_t h, int64_t q, int64_t kv0) {    \
    score_rows<T>(f, s, n, b, h, q, kv0);                                \
  }                                                                      \
  template <class T, class F>                                            \
  attributes void derivative_##suffix(const F& f, T* s, T* d, int64_t n, \
                                      int64_t b, int64_t h, int64_t q,   \
                                      int64_t kv0) {                     \
    score_rows_with_derivative<T>(f, s, d, n, b, h, q, kv0);             \
  }                                                                      \
  template <class F>                                                     \
  attributes void mask_##suffix(const F& f, uint8_t* allowed, int64_t n, \
                                int64_t b, int64_t h, int64_t q,         \
                                int64_t kv0) {                           \
    mask_rows(f, allowed, n, b, h, q, kv0);                              \
  }
MHA_FUSED_BUILDS(baseline, MHA_FUSED_BASELINE)
#if MHA_FUSED_X86
MHA_FUSED_BUILDS(avx2, MHA_FUSED_AVX2)
MHA_FUSED_BUILDS(avx512, MHA_FUSED_AVX512)
#define MHA_FUSED_DISPATCH(kernel, ...) \
  switch (fused_cpu_level()) {          \
    case 2:                             \
      kernel##_avx512(__VA_ARGS__);     \
      break;                            \
    case 1:                             \
      kernel##_avx2(__VA_ARGS__);       \
      break;                            \
    default:                            \
      kernel##_baseline(__VA_ARGS__);   \
  }
#else
#define MHA_FUSED_DISPATCH(kernel, ...) kernel##_baseline(__VA_ARGS__);
#endif
#undef MHA_FUSED_BUILDS

/// Runs a row kernel of the fused mod of kind `what` ("score_mod",
/// "mask_mod") on query row q, keys [kv0, kv0 + n): an exception becomes
/// rethrow_fused_error's c10::Error, a Table index out of range (recorded
/// by lookup, fused_math.h) table_index_error's.
template <class Body>
void run_row_kernel(const char* what, const Body& body, int64_t q, int64_t kv0,
                    int64_t n) {
  mha::fused::detail::table_index_missed = 0;
  try {
    body();
  } catch (...) {
    rethrow_fused_error(what);
  }
  if (mha::fused::detail::table_index_missed != 0) {
    table_index_error(what, q, kv0, n);
  }
}

/// FusedScoreKernel of the lambda f (fused_score_mod).
template <class F>
class ScoreKernelOf final : public FusedScoreKernel {
 public:
  explicit ScoreKernelOf(F f) : f_(std::move(f)) {}
  void apply(float* s, int64_t n, int64_t b, int64_t h, int64_t q,
             int64_t kv0) const override {
    run([&] { MHA_FUSED_DISPATCH(score, f_, s, n, b, h, q, kv0) }, q, kv0, n);
  }
  void apply(double* s, int64_t n, int64_t b, int64_t h, int64_t q,
             int64_t kv0) const override {
    run([&] { MHA_FUSED_DISPATCH(score, f_, s, n, b, h, q, kv0) }, q, kv0, n);
  }
  void apply_with_derivative(float* s, float* d, int64_t n, int64_t b,
                             int64_t h, int64_t q, int64_t kv0) const override {
    run([&] { MHA_FUSED_DISPATCH(derivative, f_, s, d, n, b, h, q, kv0) }, q,
        kv0, n);
  }
  void apply_with_derivative(double* s, double* d, int64_t n, int64_t b,
                             int64_t h, int64_t q, int64_t kv0) const override {
    run([&] { MHA_FUSED_DISPATCH(derivative, f_, s, d, n, b, h, q, kv0) }, q,
        kv0, n);
  }

 private:
  template <class Body>
  static void run(const Body& body, int64_t q, int64_t kv0, int64_t n) {
    run_row_kernel("score_mod", body, q, kv0, n);
  }
  F f_;
};

/// FusedMaskKernel of the lambda f (fused_mask_mod).
template <class F>
class MaskKernelOf final : public FusedMaskKernel {
 public:
  explicit MaskKernelOf(F f) : f_(std::move(f)) {}
  void allowed(uint8_t* allowed, int64_t n, int64_t b, int64_t h, int64_t q,
               int64_t kv0) const override {
    run_row_kernel(
        "mask_mod",
        [&] { MHA_FUSED_DISPATCH(mask, f_, allowed, n, b, h, q, kv0) }, q, kv0,
        n);
  }

 private:
  F f_;
};
#undef MHA_FUSED_DISPATCH

}  // namespace fused_rows
}  // namespace mha::detail
