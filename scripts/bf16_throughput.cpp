// The measurement behind docs/speed.md#dtypes: how fast this CPU runs
// bfloat16 products against float32 ones, at the instruction and at the
// GEMM level (issue 59). Not part of the build; scripts/bf16-throughput.sh
// compiles and runs it.
//
// 1. Instruction throughput: 24 independent accumulators, so that the
//    loop is bound by issue rate, not latency: vfmadd231ps (16 float32
//    multiply-adds = 32 flops) against vdpbf16ps (16 lanes, each two
//    bfloat16 products added to a float32 = 64 flops).
// 2. oneDNN's products as mha's blocked core would call them, one thread:
//    dnnl_sgemm (float32) against dnnl_gemm_bf16bf16f32 (bfloat16 operands,
//    float32 result), on the block shapes of the core and two large ones.
#include <dlfcn.h>
#include <immintrin.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

#define MHA_X24(X)                                                            \
  X(0)                                                                        \
  X(1)                                                                        \
  X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15) \
      X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)

void instruction_throughput() {
  const long n = 1200000000;  // instructions of each kind
#define MHA_DECLARE(i) __m512 c##i = _mm512_set1_ps(i * 1e-3f);
  MHA_X24(MHA_DECLARE)
  const __m512 a = _mm512_set1_ps(0.5f), b = _mm512_set1_ps(0.25f);
  const __m512bh ab = (__m512bh)_mm512_set1_epi16(0x3f00);  // 0.5
  const __m512bh bb = (__m512bh)_mm512_set1_epi16(0x3e80);  // 0.25
  auto t0 = Clock::now();
#define MHA_FMA(i) c##i = _mm512_fmadd_ps(a, c##i, b);
  for (long r = 0; r < n / 24; ++r) {
    MHA_X24(MHA_FMA)
  }
  const double fma = seconds_since(t0);
  t0 = Clock::now();
#define MHA_DPBF16(i) c##i = _mm512_dpbf16_ps(c##i, ab, bb);
  for (long r = 0; r < n / 24; ++r) {
    MHA_X24(MHA_DPBF16)
  }
  const double dp = seconds_since(t0);
#define MHA_SUM(i) +_mm512_reduce_add_ps(c##i)
  const float sum = 0.0f MHA_X24(MHA_SUM);
  std::printf(
      "vfmadd231ps zmm: %.2f G/s = %.0f GFLOP/s\n"
      "vdpbf16ps zmm:   %.2f G/s = %.0f GFLOP/s (bfloat16 / float32 flops: "
      "%.2f)  [checksum %g]\n",
      n / fma / 1e9, n / fma / 1e9 * 32, n / dp / 1e9, n / dp / 1e9 * 64,
      (64 / dp) / (32 / fma), sum);
}

uint16_t to_bfloat16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

using Sgemm = int (*)(char, char, int64_t, int64_t, int64_t, float,
                      const float*, int64_t, const float*, int64_t, float,
                      float*, int64_t);
using Bf16Gemm = int (*)(char, char, int64_t, int64_t, int64_t, float,
                         const uint16_t*, int64_t, const uint16_t*, int64_t,
                         float, float*, int64_t);

void onednn_products(const char* library) {
  void* handle = dlopen(library, RTLD_NOW);
  if (handle == nullptr) {
    std::printf("%s: not found, GEMMs skipped\n", library);
    return;
  }
  // dlsym returns void*; POSIX guarantees the cast to a function pointer.
  const auto sgemm = reinterpret_cast<Sgemm>(dlsym(handle, "dnnl_sgemm"));
  const auto bgemm =
      reinterpret_cast<Bf16Gemm>(dlsym(handle, "dnnl_gemm_bf16bf16f32"));
  if (sgemm == nullptr || bgemm == nullptr) {
    std::printf("%s: no dnnl_sgemm / dnnl_gemm_bf16bf16f32\n", library);
    return;
  }
  std::printf("%s, one thread (OMP_NUM_THREADS=1), c = a · bᵀ:\n", library);
  const int shapes[][3] = {{128, 128, 64},     {128, 1024, 64},
                           {128, 64, 1024},    {256, 4096, 64},
                           {1024, 1024, 1024}, {4096, 512, 512}};
  for (const auto& shape : shapes) {
    const int m = shape[0], n = shape[1], k = shape[2];
    std::vector<float> a(m * k), b(n * k), c(m * n);
    std::vector<uint16_t> a16(m * k), b16(n * k);
    for (int i = 0; i < m * k; ++i) {
      a[i] = std::sin(float(i));
      a16[i] = to_bfloat16(a[i]);
    }
    for (int i = 0; i < n * k; ++i) {
      b[i] = std::cos(float(i));
      b16[i] = to_bfloat16(b[i]);
    }
    const int reps = static_cast<int>(2e9 / (2.0 * m * n * k)) + 2;
    double f32 = 0, bf16 = 0;
    for (int pass = 0; pass < 2; ++pass) {  // the first pass warms up
      auto t0 = Clock::now();
      for (int r = 0; r < reps; ++r) {
        sgemm('N', 'T', m, n, k, 1.0f, a.data(), k, b.data(), k, 0.0f, c.data(),
              n);
      }
      f32 = seconds_since(t0) / reps;
      t0 = Clock::now();
      for (int r = 0; r < reps; ++r) {
        bgemm('N', 'T', m, n, k, 1.0f, a16.data(), k, b16.data(), k, 0.0f,
              c.data(), n);
      }
      bf16 = seconds_since(t0) / reps;
    }
    std::printf(
        "  %5d x %5d x %5d: float32 %9.1f us, bfloat16 %9.1f us, "
        "bfloat16 / float32 %.2f\n",
        m, n, k, f32 * 1e6, bf16 * 1e6, bf16 / f32);
  }
}

}  // namespace

int main(int argc, char** argv) {
  instruction_throughput();
  onednn_products(argc > 1 ? argv[1] : "libdnnl.so.2");
}
