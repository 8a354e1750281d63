// Internal: a row softmax for float32 blocks of attention scores on x86-64
// CPUs with AVX2 and FMA, fusing what the blocked attention path otherwise
// runs as separate ATen passes: the limits of the visible keys (a causal
// diagonal, a sliding window), a relative position bias, the softmax, and
// the zero rows of queries whose visible range is empty. Not installed.
//
// Why: in the blocked path the causal triangle took a masked_fill, the
// softmax a LibTorch kernel call, and fully masked rows an isnan scan, each
// a pass over the block; at long sequences this was a quarter of the
// forward time (mha-bench, docs/speed.md at 5cc4c3b). Here one parallel loop
// over the rows does it all, three passes over a row that stays in cache: its
// maximum, exp and sum (written back), the normalisation. Measured on this
// project's VM: 1.4-1.5x LibTorch 1.13's softmax alone on 128-256 x 256-4096
// blocks, 2.6-3.2x counting the causal masked_fill (docs/speed.md at
// 5cc4c3b).
//
// exp: Cody-Waite range reduction x = n ln2 + r, |r| <= ln2 / 2, then a
// degree-7 polynomial for e^r (the coefficients of Cephes' expf, S. Moshier)
// and 2^n from the exponent bits: relative error about 1e-7, as LibTorch's
// own vectorised expf (tests compare the paths within float32 tolerance).
// Arguments below -86.98 (e^x under 1.7e-38, including -inf) give 0, and
// weights that would be subnormal after the normalisation are 0 too: no
// subnormal float is ever made (see kFlushBelow).
//
// Two row kernels with the same bits: softmax_row_avx2, 8 floats a step,
// and softmax_row_avx512, 16 (softmax_row_kernel() picks). On a Zen 5 host
// the AVX-512 row ran 1.6-1.7x the AVX2 row's speed (docs/speed.md).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MHA_FUSED_SOFTMAX_X86 1
#else
#define MHA_FUSED_SOFTMAX_X86 0
#endif

namespace mha::detail {

#if MHA_FUSED_SOFTMAX_X86

/// The weights that would be subnormal floats (under FLT_MIN) are +0: the
/// normalisation zeroes e^(s - max) under kFlushBelow times the row's sum
/// instead of multiplying it. A row whose probabilities fall off steeply
/// (ALiBi's slopes over thousands of keys, a biased or modified score)
/// otherwise makes subnormals, which x86 cores make and read through
/// microcode assists of about a hundred cycles each (a fused ALiBi mod +
/// causal at (1, 8, 4096, 64) ran 1.3x its time here: 321 against 244 ms). What is dropped is under
/// 1.2e-38 of a value, far below float32's rounding of the output. NaN
/// compares false and stays.
constexpr float kFlushBelow = std::numeric_limits<float>::min();

/// exp's constants (see the file comment), shared by exp_avx2 and
/// exp_avx512 so that both compute the same function.
struct ExpConstants {
  // Below: 0. From -86.98 on, n >= -125 and e^r >= 0.7: e^x >= 1.66e-38,
  // never a subnormal float.
  static constexpr float kLowest = -86.98f;
  static constexpr float kHighest = 88.72283f;
  static constexpr float kLog2e = 1.44269504088896341f;  // 1 / ln2
  // ln2 in two parts, so that n * kLn2High is exact
  static constexpr float kLn2High = 0.693359375f;
  static constexpr float kLn2Low = -2.12194440e-4f;
  // e^r = 1 + r + r^2 (kP5 + kP4 r + ... + kP0 r^5)
  static constexpr float kP0 = 1.9875691500e-4f;
  static constexpr float kP1 = 1.3981999507e-3f;
  static constexpr float kP2 = 8.3334519073e-3f;
  static constexpr float kP3 = 4.1665795894e-2f;
  static constexpr float kP4 = 1.6666665459e-1f;
  static constexpr float kP5 = 5.0000001201e-1f;
};

/// e^x for 8 floats (see the file comment).
__attribute__((target("avx2,fma"))) inline __m256 exp_avx2(__m256 x) {
  const __m256 lowest = _mm256_set1_ps(ExpConstants::kLowest);
  const __m256 highest = _mm256_set1_ps(ExpConstants::kHighest);
  const __m256 underflow = _mm256_cmp_ps(x, lowest, _CMP_LT_OQ);
  // max/min return their second operand when either is NaN: x second, so
  // that a NaN stays NaN (and the whole row with it, as torch.softmax).
  x = _mm256_min_ps(highest, _mm256_max_ps(lowest, x));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(ExpConstants::kLog2e)),
                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ExpConstants::kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(ExpConstants::kLn2Low), r);
  __m256 p = _mm256_set1_ps(ExpConstants::kP0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpConstants::kP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpConstants::kP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpConstants::kP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpConstants::kP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(ExpConstants::kP5));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r),
                      _mm256_add_ps(r, _mm256_set1_ps(1.0f)));  // e^r
  const __m256i two_n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow,
                          _mm256_mul_ps(p, _mm256_castsi256_ps(two_n)));
}

/// Horizontal max / sum of 8 floats.
__attribute__((target("avx2,fma"))) inline float reduce_max_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}
__attribute__((target("avx2,fma"))) inline float reduce_sum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

/// The three passes of a row's softmax over row[i, n), from entry `i` on,
/// 8 floats a step and then one at a time: softmax_row_avx2 runs them from
/// 0, softmax_row_avx512 from where its 16-float steps stop, so that both
/// compute those entries alike.
///
/// First pass: adds b[i, n) (when b is not null) and returns the maximum of
/// row[i, n) and vmax's lanes.
__attribute__((target("avx2,fma"))) inline float add_bias_and_max_avx2(
    float* row, const float* b, int64_t i, int64_t n, __m256 vmax) {
  if (b != nullptr) {
    for (; i + 8 <= n; i += 8) {
      const __m256 s =
          _mm256_add_ps(_mm256_loadu_ps(row + i), _mm256_loadu_ps(b + i));
      _mm256_storeu_ps(row + i, s);
      vmax = _mm256_max_ps(vmax, s);
    }
    for (int64_t j = i; j < n; ++j) {
      row[j] += b[j];
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + i));
    }
  }
  float max = reduce_max_avx2(vmax);
  for (; i < n; ++i) {
    max = std::max(max, row[i]);
  }
  return max;
}

/// Second pass: row[i, n) becomes e^(row - max), each 8-float step added
/// to the 8-lane vsum in order; returns vsum's lanes plus the tail's
/// entries, the row's sum.
__attribute__((target("avx2,fma"))) inline float exp_and_sum_avx2(
    float* row, int64_t i, int64_t n, float max, __m256 vsum) {
  const __m256 shift = _mm256_set1_ps(max);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(row + i), shift));
    _mm256_storeu_ps(row + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  float sum = reduce_sum_avx2(vsum);
  for (; i < n; ++i) {
    row[i] = std::exp(row[i] - max);
    sum += row[i];
  }
  return sum;
}

/// Third pass: row[i, n) times `inverse` (1 / sum), but +0 where the entry
/// is under `flush_below` (kFlushBelow · sum: a subnormal weight).
__attribute__((target("avx2,fma"))) inline void scale_avx2(float* row,
                                                           int64_t i, int64_t n,
                                                           float inverse,
                                                           float flush_below) {
  const __m256 vinverse = _mm256_set1_ps(inverse);
  const __m256 vflush = _mm256_set1_ps(flush_below);
  for (; i + 8 <= n; i += 8) {
    // The entry zeroed before the product: no subnormal is made.
    const __m256 e = _mm256_loadu_ps(row + i);
    _mm256_storeu_ps(
        row + i,
        _mm256_mul_ps(_mm256_andnot_ps(_mm256_cmp_ps(e, vflush, _CMP_LT_OQ), e),
                      vinverse));
  }
  for (; i < n; ++i) {
    row[i] = row[i] < flush_below ? 0.0f : row[i] * inverse;
  }
}

/// Zeros x[0, begin) and x[max(begin, end), cols), what a row does not see.
inline void zero_outside(float* x, int64_t begin, int64_t end, int64_t cols) {
  std::fill(x, x + begin, 0.0f);
  std::fill(x + std::max(begin, end), x + cols, 0.0f);
}

/// Row x[0, cols): x[begin, end) plus bias[begin, end) (when bias is not
/// null) becomes its softmax, the rest zeros; an empty range gives zeros.
/// Non-finite entries give what torch.softmax gives: a NaN or +inf entry, or
/// a range of -inf only, makes the row NaN (the caller zeroes the rows that
/// its mask blocks entirely, decided from the mask, not from these values).
__attribute__((target("avx2,fma"))) inline void softmax_row_avx2(
    float* x, const float* bias, int64_t begin, int64_t end, int64_t cols) {
  zero_outside(x, begin, end, cols);
  const int64_t n = end - begin;
  if (n <= 0) {
    return;
  }
  float* row = x + begin;
  const float max = add_bias_and_max_avx2(
      row, bias == nullptr ? nullptr : bias + begin, 0, n,
      _mm256_set1_ps(-std::numeric_limits<float>::infinity()));
  // A NaN entry may be missing from max; it turns into NaN below all the
  // same (NaN - max), and so do +inf (inf - inf) and max = -inf.
  const float sum = exp_and_sum_avx2(row, 0, n, max, _mm256_setzero_ps());
  scale_avx2(row, 0, n, 1.0f / sum, kFlushBelow * sum);
}

// The AVX-512 code below takes the zero-masked form of the intrinsics that
// GCC 12 writes with an undefined vector (_mm512_max_ps, _mm512_roundscale_ps,
// _mm512_castps512_ps256, ...): those warn -Wmaybe-uninitialized where they
// are inlined with GCC 12.2. With every lane kept (kAllLanes16,
// kAllLanes8) the instruction and its result are the same.
constexpr __mmask16 kAllLanes16 = 0xFFFF;
constexpr __mmask8 kAllLanes8 = 0xFF;

/// exp_avx2 for 16 floats, each lane the same operations and so the same
/// bits (the underflowing lanes zeroed by the multiply's mask instead of an
/// and-not: +0 either way).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 exp_avx512(__m512 x) {
  const __m512 lowest = _mm512_set1_ps(ExpConstants::kLowest);
  const __m512 highest = _mm512_set1_ps(ExpConstants::kHighest);
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, lowest, _CMP_LT_OQ);
  x = _mm512_maskz_min_ps(kAllLanes16, highest,
                          _mm512_maskz_max_ps(kAllLanes16, lowest, x));
  const __m512 n = _mm512_maskz_roundscale_ps(
      kAllLanes16, _mm512_mul_ps(x, _mm512_set1_ps(ExpConstants::kLog2e)),
      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ExpConstants::kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(ExpConstants::kLn2Low), r);
  __m512 p = _mm512_set1_ps(ExpConstants::kP0);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpConstants::kP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpConstants::kP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpConstants::kP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpConstants::kP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(ExpConstants::kP5));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r),
                      _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i two_n = _mm512_maskz_slli_epi32(
      kAllLanes16,
      _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAllLanes16, n),
                       _mm512_set1_epi32(127)),
      23);
  return _mm512_maskz_mul_ps(static_cast<__mmask16>(~underflow), p,
                             _mm512_castsi512_ps(two_n));
}

/// The low and high 8 floats of 16 (AVX-512F alone: no AVX-512DQ).
__attribute__((target("avx512f,avx2,fma"))) inline __m256 low_half(__m512 v) {
  return _mm256_castpd_ps(
      _mm512_maskz_extractf64x4_pd(kAllLanes8, _mm512_castps_pd(v), 0));
}
__attribute__((target("avx512f,avx2,fma"))) inline __m256 high_half(__m512 v) {
  return _mm256_castpd_ps(
      _mm512_maskz_extractf64x4_pd(kAllLanes8, _mm512_castps_pd(v), 1));
}

/// softmax_row_avx2 16 floats a step, with its bits: every entry goes
/// through the same operations; the maximum does not depend on the order
/// (but for which NaN or which zero it keeps, and either gives the same
/// result); and the sum adds each step's low then high 8 floats to the
/// 8-lane accumulator, the order of softmax_row_avx2's steps. Each pass
/// ends with softmax_row_avx2's own (add_bias_and_max_avx2 and the others)
/// from where the 16-float steps stop.
__attribute__((target("avx512f,avx2,fma"))) inline void softmax_row_avx512(
    float* x, const float* bias, int64_t begin, int64_t end, int64_t cols) {
  zero_outside(x, begin, end, cols);
  const int64_t n = end - begin;
  if (n <= 0) {
    return;
  }
  float* row = x + begin;
  const float* b = bias == nullptr ? nullptr : bias + begin;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 s = _mm512_loadu_ps(row + i);
    if (b != nullptr) {
      s = _mm512_add_ps(s, _mm512_loadu_ps(b + i));
      _mm512_storeu_ps(row + i, s);
    }
    vmax = _mm512_maskz_max_ps(kAllLanes16, vmax, s);
  }
  const int64_t wide = i;  // entries the 16-float steps took
  const float max = add_bias_and_max_avx2(
      row, b, wide, n, _mm256_max_ps(low_half(vmax), high_half(vmax)));
  const __m512 shift = _mm512_set1_ps(max);
  __m256 vsum = _mm256_setzero_ps();
  for (i = 0; i < wide; i += 16) {
    const __m512 e = exp_avx512(_mm512_sub_ps(_mm512_loadu_ps(row + i), shift));
    _mm512_storeu_ps(row + i, e);
    vsum = _mm256_add_ps(_mm256_add_ps(vsum, low_half(e)), high_half(e));
  }
  const float sum = exp_and_sum_avx2(row, wide, n, max, vsum);
  const float inverse = 1.0f / sum, flush_below = kFlushBelow * sum;
  const __m512 vinverse = _mm512_set1_ps(inverse);
  const __m512 vflush = _mm512_set1_ps(flush_below);
  for (i = 0; i < wide; i += 16) {
    const __m512 e = _mm512_loadu_ps(row + i);
    // The product only in the lanes kept: no subnormal is made.
    _mm512_storeu_ps(
        row + i, _mm512_maskz_mul_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(
                                         e, vflush, _CMP_LT_OQ)),
                                     e, vinverse));
  }
  scale_avx2(row, wide, n, inverse, flush_below);
}

#endif  // MHA_FUSED_SOFTMAX_X86

/// True when fused_softmax_rows runs on this CPU (x86-64 with AVX2 and FMA).
inline bool fused_softmax_available() {
#if MHA_FUSED_SOFTMAX_X86
  static const bool available =
      __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return available;
#else
  return false;
#endif
}

/// A row kernel: softmax_row_avx2 or softmax_row_avx512.
using SoftmaxRowKernel = void (*)(float* x, const float* bias, int64_t begin,
                                  int64_t end, int64_t cols);

/// The row kernel of fused_softmax_rows and fused_softmax_matrices:
/// softmax_row_avx512 where the CPU has AVX-512F, unless
/// ATEN_CPU_CAPABILITY (LibTorch's switch for its own vectorised kernels,
/// read once) is "avx2" or "default"; softmax_row_avx2 otherwise. The two
/// give the same bits, so the choice moves only the speed (docs/speed.md).
/// Call only when fused_softmax_available().
inline SoftmaxRowKernel softmax_row_kernel() {
#if MHA_FUSED_SOFTMAX_X86
  static const SoftmaxRowKernel kernel = [] {
    const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
    const bool capped =
        capability != nullptr && (std::string_view(capability) == "avx2" ||
                                  std::string_view(capability) == "default");
    return __builtin_cpu_supports("avx512f") && !capped
               ? SoftmaxRowKernel{&softmax_row_avx512}
               : SoftmaxRowKernel{&softmax_row_avx2};
  }();
  return kernel;
#else
  return nullptr;
#endif
}

/// The visible columns of the rows of one block of scores: row r sees
/// columns [begin(r), end(r)), each limit either fixed or moving one column
/// right per row (a causal diagonal, a sliding window's edge), or, where
/// `begins` is not null, row r's own [begins[r], ends[r]) (a flex call's
/// runs of allowed keys).
struct RowLimits {
  int64_t begin0 = 0;  ///< begin of row 0 (may be negative)
  int64_t end0 = 0;    ///< end of row 0 (may exceed cols)
  bool begin_slides = false;
  bool end_slides = false;
  const int64_t* begins = nullptr;  ///< or each row's own limits
  const int64_t* ends = nullptr;

  int64_t begin(int64_t r, int64_t cols) const {
    return std::clamp<int64_t>(
        begins != nullptr ? begins[r] : begin0 + (begin_slides ? r : 0), 0,
        cols);
  }
  int64_t end(int64_t r, int64_t cols) const {
    return std::clamp<int64_t>(
        ends != nullptr ? ends[r] : end0 + (end_slides ? r : 0), 0, cols);
  }
};

/// In place on p (rows, cols), contiguous float32 scores: row r becomes the
/// softmax of entries [limits.begin(r), limits.end(r)) with zeros around
/// them (all zeros when that range is empty; NaN, as torch.softmax, when
/// the range holds only -inf). When `bias` is
/// not null, row r first adds bias[c - r] at column c (a bias constant along
/// diagonals, such as a relative position bias; bias[-(rows - 1)] to
/// bias[cols - 1] must be readable). Rows run in parallel. Call only when
/// fused_softmax_available().
inline void fused_softmax_rows(torch::Tensor& p, const RowLimits& limits,
                               const float* bias = nullptr) {
#if MHA_FUSED_SOFTMAX_X86
  const int64_t rows = p.size(0), cols = p.size(1);
  float* data = p.data_ptr<float>();
  const int64_t grain =
      std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  const SoftmaxRowKernel softmax_row = softmax_row_kernel();
  at::parallel_for(0, rows, grain, [&](int64_t row_begin, int64_t row_end) {
    for (int64_t r = row_begin; r < row_end; ++r) {
      softmax_row(data + r * cols, bias == nullptr ? nullptr : bias - r,
                  limits.begin(r, cols), limits.end(r, cols), cols);
    }
  });
#else
  (void)p;
  (void)limits;
  (void)bias;
  TORCH_CHECK(false, "fused_softmax_rows: not available on this CPU");
#endif
}

/// fused_softmax_rows on each of the M matrices of p (M, rows, cols),
/// contiguous float32, with the same limits for every matrix; `bias`, when
/// not empty, holds one pointer per matrix, each as fused_softmax_rows'
/// `bias` for that matrix. One parallel loop over all M·rows rows. Call
/// only when fused_softmax_available().
inline void fused_softmax_matrices(torch::Tensor& p, const RowLimits& limits,
                                   const std::vector<const float*>& bias) {
#if MHA_FUSED_SOFTMAX_X86
  const int64_t rows = p.size(1), cols = p.size(2);
  float* data = p.data_ptr<float>();
  const int64_t grain =
      std::max<int64_t>(1, 16384 / std::max<int64_t>(cols, 1));
  const SoftmaxRowKernel softmax_row = softmax_row_kernel();
  at::parallel_for(
      0, p.size(0) * rows, grain, [&](int64_t row_begin, int64_t row_end) {
        for (int64_t g = row_begin; g < row_end; ++g) {
          const int64_t r = g % rows;
          const float* b = bias.empty() ? nullptr : bias[g / rows] - r;
          softmax_row(data + g * cols, b, limits.begin(r, cols),
                      limits.end(r, cols), cols);
        }
      });
#else
  (void)p;
  (void)limits;
  (void)bias;
  TORCH_CHECK(false, "fused_softmax_matrices: not available on this CPU");
#endif
}

}  // namespace mha::detail
