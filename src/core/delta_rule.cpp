// The gated delta rule on the CPU (core/delta_rule.h): one item per value
// head on mha's threads, each walking its chunks with its state and one
// chunk's temporaries in that thread's scratch, every product a direct gemm
// (core/blas_gemm.h); the backward walks the chunks from the end.
//
// Why: in ATen ops (transformers' torch_chunk_gated_delta_rule, and this
// module's first form) every chunk's products are small batched matmuls
// whose per-matrix dispatch, with the copies of the strided operands, cost
// more than the arithmetic: 40 % of transformers' Qwen3NextGatedDeltaNet
// forward at (1, 2048, 1024) was bmm at about 14 GFLOP/s (PyTorch 2.14).
//
// One chunk of R <= C rows, starting from S (the equations of the
// forward; G the cumulative sum of g in the chunk, Γ = exp(G_last),
// D_ij = exp(G_i - G_j) for j <= i, else 0):
//   P = (β ⊙ k) kᵀ,  A = -(P ⊙ D) strictly below the diagonal,
//   T = (I - A)⁻¹ (unit lower triangular, by forward substitution),
//   U = T (β ⊙ v),  W = T (β exp(G) ⊙ k),  V' = U - W S,
//   o = (exp(G) ⊙ q) S + (q kᵀ ⊙ D) V',
//   S <- Γ S + (exp(G_last - G) ⊙ k)ᵀ V'.
// (x ⊙ y with a vector x: row i of y times x_i.)
//
// Glossary: B items, L length, dk / dv head sizes, C chunk length, R rows
// of the current chunk, S state (dk x dv).
#include "core/delta_rule.h"

#include <algorithm>
#include <cmath>
#if defined(__SSE__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "core/attention_core.h"  // for_each_item
#include "core/blas_gemm.h"
#include "core/linear_attention_core.h"  // check_first_derivatives_only

namespace mha::detail {
namespace {

/// Flush-to-zero and denormals-are-zero (x86's MXCSR bits 15 and 6) on
/// this thread while alive, the previous mode restored after; no other
/// thread is touched.
///
/// Why: the gates decay over a chunk to exp(G_i - G_j) far below float32's
/// smallest normal (1.2e-38; Qwen3-Next's g reaches -20 a token), and
/// products of such numbers run many times slower on x86 (measured here:
/// the forward at (16, 2048, 128) with g in [-20, 0] 263 against 44 ms
/// for g in [-1, 0]). Flushed, a subnormal term becomes 0: its share of a
/// sum is below the rounding of any normal term beside it.
class FlushDenormals {
 public:
#if defined(__SSE__) || defined(_M_X64)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#else
  FlushDenormals() {}  // other architectures: the mode is left as it is
#endif
};

/// Row-major r x c matrix at p.
inline StridedMatrix mat(const void* p, int64_t r, int64_t c) {
  return {const_cast<void*>(p), r, c, c, 1};
}

/// One item's inputs and outputs (row-major, unit stride), and one chunk's
/// temporaries in the thread's scratch.
template <typename scalar_t>
struct Walk {
  int64_t L = 0, dk = 0, dv = 0, C = 0;
  torch::ScalarType dtype = torch::kFloat32;
  const scalar_t *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr,
                 *beta = nullptr;
  // The chunk (rows from r0): G, exp(G); β ⊙ k, β exp(G) ⊙ k, exp(G) ⊙ q,
  // exp(G_last - G) ⊙ k (C x dk); β ⊙ v, U then V' (C x dv), W (C x dk);
  // P, T, q kᵀ, q kᵀ ⊙ D (C x C).
  scalar_t *G, *eG, *KB, *KBG, *QG, *KD, *VB, *U, *W, *P, *T, *QK, *M;

  /// Claims the chunk temporaries from `space`; returns the next free.
  scalar_t* place(scalar_t* space) {
    const int64_t d = std::max(dk, dv);
    for (scalar_t** p : {&G, &eG}) {
      *p = space;
      space += C;
    }
    for (scalar_t** p : {&KB, &KBG, &QG, &KD, &VB, &U, &W}) {
      *p = space;
      space += C * d;
    }
    for (scalar_t** p : {&P, &T, &QK, &M}) {
      *p = space;
      space += C * C;
    }
    return space;
  }
  static int64_t space(int64_t C, int64_t dk, int64_t dv) {
    return 2 * C + 7 * C * std::max(dk, dv) + 4 * C * C;
  }

  void gemm(const StridedMatrix& a, const StridedMatrix& b, double alpha,
            double beta_, const StridedMatrix& c) const {
    gemm_matrix(dtype, a, b, alpha, beta_, c);
  }

  /// Everything of chunk [r0, r0 + R) up to V' (in U), from S.
  void prepare(int64_t r0, int64_t R, const scalar_t* S) {
    const scalar_t* qc = q + r0 * dk;
    const scalar_t* kc = k + r0 * dk;
    const scalar_t* vc = v + r0 * dv;
    scalar_t acc = 0;
    for (int64_t i = 0; i < R; ++i) {
      acc += g[r0 + i];
      G[i] = acc;
      eG[i] = std::exp(acc);
    }
    const scalar_t last = G[R - 1];
    for (int64_t i = 0; i < R; ++i) {
      const scalar_t b = beta[r0 + i], e = eG[i], f = std::exp(last - G[i]);
      for (int64_t c = 0; c < dk; ++c) {
        const scalar_t kv = kc[i * dk + c];
        KB[i * dk + c] = b * kv;
        KBG[i * dk + c] = b * e * kv;
        QG[i * dk + c] = e * qc[i * dk + c];
        KD[i * dk + c] = f * kv;
      }
      for (int64_t c = 0; c < dv; ++c) {
        VB[i * dv + c] = b * vc[i * dv + c];
      }
    }
    gemm(mat(KB, R, dk), mat(kc, R, dk).t(), 1.0, 0.0, mat(P, R, R));
    gemm(mat(qc, R, dk), mat(kc, R, dk).t(), 1.0, 0.0, mat(QK, R, R));
    // T = (I - A)⁻¹: row i = e_i + Σ_{j<i} A_ij row j, A_ij = -P_ij D_ij;
    // M = q kᵀ ⊙ D.
    for (int64_t i = 0; i < R; ++i) {
      scalar_t* Ti = T + i * R;
      std::fill_n(Ti, R, scalar_t(0));
      for (int64_t j = 0; j < i; ++j) {
        const scalar_t a = -P[i * R + j] * std::exp(G[i] - G[j]);
        const scalar_t* Tj = T + j * R;
        for (int64_t c = 0; c <= j; ++c) {
          Ti[c] += a * Tj[c];
        }
      }
      Ti[i] = 1;
      for (int64_t j = 0; j < R; ++j) {
        M[i * R + j] = j <= i ? QK[i * R + j] * std::exp(G[i] - G[j]) : 0;
      }
    }
    gemm(mat(T, R, R), mat(VB, R, dv), 1.0, 0.0, mat(U, R, dv));
    gemm(mat(T, R, R), mat(KBG, R, dk), 1.0, 0.0, mat(W, R, dk));
    gemm(mat(W, R, dk), mat(S, dk, dv), -1.0, 1.0, mat(U, R, dv));
  }

  /// The chunk's output rows o (R x dv), then S moved past the chunk.
  void advance(int64_t R, scalar_t* S, scalar_t* o) const {
    gemm(mat(QG, R, dk), mat(S, dk, dv), 1.0, 0.0, mat(o, R, dv));
    gemm(mat(M, R, R), mat(U, R, dv), 1.0, 1.0, mat(o, R, dv));
    const scalar_t gamma = std::exp(G[R - 1]);
    for (int64_t i = 0; i < dk * dv; ++i) {
      S[i] *= gamma;
    }
    gemm(mat(KD, R, dk).t(), mat(U, R, dv), 1.0, 1.0, mat(S, dk, dv));
  }
};

/// The gradient temporaries of one chunk (after Walk's in the scratch).
template <typename scalar_t>
struct Grads {
  // dV', dO Sᵀ, V' dSᵀ, dW, Tᵀ dV', Tᵀ dW, dP k (C x d); dM, dT, a C x C
  // temporary; G's gradient (C).
  scalar_t *dV, *dQG, *dKD, *dW, *dVB, *dKBG, *dKB, *dM, *dT, *tmp, *dG;

  scalar_t* place(scalar_t* space, int64_t C, int64_t d) {
    for (scalar_t** p : {&dV, &dQG, &dKD, &dW, &dVB, &dKBG, &dKB}) {
      *p = space;
      space += C * d;
    }
    for (scalar_t** p : {&dM, &dT, &tmp}) {
      *p = space;
      space += C * C;
    }
    dG = space;
    return space + C;
  }
  static int64_t space(int64_t C, int64_t dk, int64_t dv) {
    return 7 * C * std::max(dk, dv) + 3 * C * C + C;
  }
};

/// One item's backward over chunk [r0, r0 + R) from S (its starting state)
/// with dO (R x dv) and dS (the gradient of the state after the chunk,
/// replaced by that of the state before it); writes the chunk's rows of
/// dq, dk (R x dk), dv (R x dv), dg, dβ (R).
template <typename scalar_t>
void chunk_backward(Walk<scalar_t>& w, Grads<scalar_t>& d, int64_t r0,
                    int64_t R, const scalar_t* S, const scalar_t* dO,
                    scalar_t* dS, scalar_t* dq, scalar_t* dk, scalar_t* dv,
                    scalar_t* dg, scalar_t* dbeta) {
  const int64_t dK = w.dk, dV = w.dv;
  w.prepare(r0, R, S);
  const scalar_t* qc = w.q + r0 * dK;
  const scalar_t* kc = w.k + r0 * dK;
  const scalar_t* vc = w.v + r0 * dV;
  // Through o and the state after: dV' = Mᵀ dO + KD dS, dM = dO V'ᵀ,
  // d(QG) = dO Sᵀ, d(KD) = V' dSᵀ, dΓ = Σ S ⊙ dS.
  w.gemm(mat(w.M, R, R).t(), mat(dO, R, dV), 1.0, 0.0, mat(d.dV, R, dV));
  w.gemm(mat(w.KD, R, dK), mat(dS, dK, dV), 1.0, 1.0, mat(d.dV, R, dV));
  w.gemm(mat(dO, R, dV), mat(w.U, R, dV).t(), 1.0, 0.0, mat(d.dM, R, R));
  w.gemm(mat(dO, R, dV), mat(S, dK, dV).t(), 1.0, 0.0, mat(d.dQG, R, dK));
  w.gemm(mat(w.U, R, dV), mat(dS, dK, dV).t(), 1.0, 0.0, mat(d.dKD, R, dK));
  scalar_t d_gamma = 0;
  for (int64_t i = 0; i < dK * dV; ++i) {
    d_gamma += S[i] * dS[i];
  }
  // The state before: Γ dS + QGᵀ dO - Wᵀ dV' (V' = U - W S).
  const scalar_t gamma = std::exp(w.G[R - 1]);
  for (int64_t i = 0; i < dK * dV; ++i) {
    dS[i] *= gamma;
  }
  w.gemm(mat(w.QG, R, dK).t(), mat(dO, R, dV), 1.0, 1.0, mat(dS, dK, dV));
  w.gemm(mat(w.W, R, dK).t(), mat(d.dV, R, dV), -1.0, 1.0, mat(dS, dK, dV));
  // dW = -dV' Sᵀ; dT = dV' VBᵀ + dW KBGᵀ; d(VB) = Tᵀ dV', d(KBG) = Tᵀ dW.
  w.gemm(mat(d.dV, R, dV), mat(S, dK, dV).t(), -1.0, 0.0, mat(d.dW, R, dK));
  w.gemm(mat(d.dV, R, dV), mat(w.VB, R, dV).t(), 1.0, 0.0, mat(d.dT, R, R));
  w.gemm(mat(d.dW, R, dK), mat(w.KBG, R, dK).t(), 1.0, 1.0, mat(d.dT, R, R));
  w.gemm(mat(w.T, R, R).t(), mat(d.dV, R, dV), 1.0, 0.0, mat(d.dVB, R, dV));
  w.gemm(mat(w.T, R, R).t(), mat(d.dW, R, dK), 1.0, 0.0, mat(d.dKBG, R, dK));
  // T = (I - A)⁻¹: dA = Tᵀ dT Tᵀ (into dT).
  w.gemm(mat(d.dT, R, R), mat(w.T, R, R).t(), 1.0, 0.0, mat(d.tmp, R, R));
  w.gemm(mat(w.T, R, R).t(), mat(d.tmp, R, R), 1.0, 0.0, mat(d.dT, R, R));
  // A = -(P ⊙ D) below the diagonal, M = q kᵀ ⊙ D on and below it: dP
  // (into tmp) and d(q kᵀ) (into dM); D's gradient goes to G.
  std::fill_n(d.dG, R, scalar_t(0));
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < R; ++j) {
      const int64_t ij = i * R + j;
      if (j > i) {
        d.tmp[ij] = 0;
        d.dM[ij] = 0;
        continue;
      }
      const scalar_t D = std::exp(w.G[i] - w.G[j]);
      const scalar_t dA = j < i ? d.dT[ij] : scalar_t(0);
      const scalar_t val = (d.dM[ij] * w.QK[ij] - dA * w.P[ij]) * D;
      d.dG[i] += val;
      d.dG[j] -= val;
      d.tmp[ij] = -dA * D;
      d.dM[ij] *= D;
    }
  }
  // dq = d(q kᵀ) k + exp(G) ⊙ d(QG); dk = d(q kᵀ)ᵀ q + dPᵀ KB + ...;
  // d(KB) = dP k.
  w.gemm(mat(d.dM, R, R), mat(kc, R, dK), 1.0, 0.0, mat(dq, R, dK));
  w.gemm(mat(d.dM, R, R).t(), mat(qc, R, dK), 1.0, 0.0, mat(dk, R, dK));
  w.gemm(mat(d.tmp, R, R).t(), mat(w.KB, R, dK), 1.0, 1.0, mat(dk, R, dK));
  w.gemm(mat(d.tmp, R, R), mat(kc, R, dK), 1.0, 0.0, mat(d.dKB, R, dK));
  const scalar_t last = w.G[R - 1];
  scalar_t d_last = gamma * d_gamma;
  for (int64_t i = 0; i < R; ++i) {
    const scalar_t b = w.beta[r0 + i], e = w.eG[i];
    const scalar_t f = std::exp(last - w.G[i]);
    scalar_t db = 0, dGi = 0, dkd = 0;
    for (int64_t c = 0; c < dK; ++c) {
      const int64_t ic = i * dK + c;
      const scalar_t kv = kc[ic];
      dq[ic] += e * d.dQG[ic];
      dk[ic] += b * d.dKB[ic] + f * d.dKD[ic] + b * e * d.dKBG[ic];
      db += (d.dKB[ic] + e * d.dKBG[ic]) * kv;
      dGi += d.dQG[ic] * w.QG[ic] + d.dKBG[ic] * w.KBG[ic];
      dkd += d.dKD[ic] * w.KD[ic];
    }
    for (int64_t c = 0; c < dV; ++c) {
      const int64_t ic = i * dV + c;
      dv[ic] = b * d.dVB[ic];
      db += d.dVB[ic] * vc[ic];
    }
    dbeta[i] = db;
    d.dG[i] += dGi - dkd;
    d_last += dkd;
  }
  d.dG[R - 1] += d_last;
  // G = cumsum(g): g's gradient is the sum from each row to the end.
  scalar_t acc = 0;
  for (int64_t i = R - 1; i >= 0; --i) {
    acc += d.dG[i];
    dg[i] = acc;
  }
}

/// The forward walk of every item; `states` (B, chunks, dk, dv), when
/// defined, receives each chunk's starting state.
void forward_walk(const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v, const torch::Tensor& g,
                  const torch::Tensor& beta, const torch::Tensor& state,
                  int64_t C, const torch::Tensor& out,
                  const torch::Tensor& final_state,
                  const torch::Tensor& states) {
  const int64_t B = q.size(0), L = q.size(1), dk = q.size(2), dv = v.size(2);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "gated_delta_rule", [&] {
    const int64_t scratch = dk * dv + Walk<scalar_t>::space(C, dk, dv);
    for_each_item(B, scratch, q.options(), [&](int64_t n, torch::Tensor& sp) {
      const FlushDenormals flush;
      Walk<scalar_t> w;
      w.L = L, w.dk = dk, w.dv = dv, w.C = C, w.dtype = q.scalar_type();
      w.q = q.data_ptr<scalar_t>() + n * L * dk;
      w.k = k.data_ptr<scalar_t>() + n * L * dk;
      w.v = v.data_ptr<scalar_t>() + n * L * dv;
      w.g = g.data_ptr<scalar_t>() + n * L;
      w.beta = beta.data_ptr<scalar_t>() + n * L;
      scalar_t* S = sp.data_ptr<scalar_t>();
      w.place(S + dk * dv);
      std::copy_n(state.data_ptr<scalar_t>() + n * dk * dv, dk * dv, S);
      scalar_t* o = out.data_ptr<scalar_t>() + n * L * dv;
      for (int64_t r0 = 0, c = 0; r0 < L; r0 += C, ++c) {
        const int64_t R = std::min(C, L - r0);
        if (states.defined()) {
          std::copy_n(
              S, dk * dv,
              states.data_ptr<scalar_t>() + (n * states.size(1) + c) * dk * dv);
        }
        w.prepare(r0, R, S);
        w.advance(R, S, o + r0 * dv);
      }
      std::copy_n(S, dk * dv, final_state.data_ptr<scalar_t>() + n * dk * dv);
    });
  });
}

class GatedDeltaRuleFunction
    : public torch::autograd::Function<GatedDeltaRuleFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
      const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& g,
      const torch::Tensor& beta, const torch::Tensor& state, int64_t C,
      bool keep_states) {
    const int64_t B = q.size(0), L = q.size(1), dk = q.size(2), dv = v.size(2);
    auto out = at::empty({B, L, dv}, q.options());
    auto final_state = at::empty({B, dk, dv}, q.options());
    // The chunks' starting states, for the backward (a forward without
    // gradients keeps one state per item).
    const auto states =
        keep_states ? at::empty({B, (L + C - 1) / C, dk, dv}, q.options())
                    : torch::Tensor();
    forward_walk(q, k, v, g, beta, state, C, out, final_state, states);
    ctx->save_for_backward({q, k, v, g, beta, states});
    ctx->saved_data["chunk"] = C;
    return {out, final_state};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    check_first_derivatives_only("Gated DeltaNet's delta rule on the CPU");
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3],
               &beta = saved[4], &states = saved[5];
    const int64_t C = ctx->saved_data.at("chunk").toInt();
    const int64_t B = q.size(0), L = q.size(1), dk = q.size(2), dv = v.size(2);
    const auto dO = grads[0].defined() ? grads[0].contiguous()
                                       : at::zeros({B, L, dv}, q.options());
    auto dS = grads[1].defined() ? grads[1].contiguous().clone()
                                 : at::zeros({B, dk, dv}, q.options());
    auto dq = at::empty_like(q), dk_ = at::empty_like(k),
         dv_ = at::empty_like(v);
    auto dg = at::empty_like(g), dbeta = at::empty_like(beta);
    AT_DISPATCH_FLOATING_TYPES(
        q.scalar_type(), "gated_delta_rule_backward", [&] {
          const int64_t scratch = Walk<scalar_t>::space(C, dk, dv) +
                                  Grads<scalar_t>::space(C, dk, dv);
          for_each_item(
              B, scratch, q.options(), [&](int64_t n, torch::Tensor& sp) {
                const FlushDenormals flush;
                Walk<scalar_t> w;
                w.L = L, w.dk = dk, w.dv = dv, w.C = C,
                w.dtype = q.scalar_type();
                w.q = q.data_ptr<scalar_t>() + n * L * dk;
                w.k = k.data_ptr<scalar_t>() + n * L * dk;
                w.v = v.data_ptr<scalar_t>() + n * L * dv;
                w.g = g.data_ptr<scalar_t>() + n * L;
                w.beta = beta.data_ptr<scalar_t>() + n * L;
                Grads<scalar_t> d;
                d.place(w.place(sp.data_ptr<scalar_t>()), C, std::max(dk, dv));
                scalar_t* dSn = dS.data_ptr<scalar_t>() + n * dk * dv;
                const int64_t chunks = (L + C - 1) / C;
                for (int64_t c = chunks - 1; c >= 0; --c) {
                  const int64_t r0 = c * C, R = std::min(C, L - r0);
                  const scalar_t* S =
                      states.data_ptr<scalar_t>() + (n * chunks + c) * dk * dv;
                  chunk_backward(w, d, r0, R, S,
                                 dO.data_ptr<scalar_t>() + (n * L + r0) * dv,
                                 dSn,
                                 dq.data_ptr<scalar_t>() + (n * L + r0) * dk,
                                 dk_.data_ptr<scalar_t>() + (n * L + r0) * dk,
                                 dv_.data_ptr<scalar_t>() + (n * L + r0) * dv,
                                 dg.data_ptr<scalar_t>() + n * L + r0,
                                 dbeta.data_ptr<scalar_t>() + n * L + r0);
                }
              });
        });
    return {dq, dk_, dv_, dg, dbeta, dS, torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

bool gated_delta_rule_applies(const torch::Tensor& x) {
  return x.device().is_cpu() && (x.scalar_type() == torch::kFloat32 ||
                                 x.scalar_type() == torch::kFloat64);
}

std::pair<torch::Tensor, torch::Tensor> gated_delta_rule(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& g, const torch::Tensor& beta,
    const torch::Tensor& state, int64_t chunk) {
  TORCH_INTERNAL_ASSERT(
      gated_delta_rule_applies(q) && q.dim() == 3 && k.sizes() == q.sizes() &&
          v.dim() == 3 && v.size(0) == q.size(0) && v.size(1) == q.size(1) &&
          g.sizes() == q.sizes().slice(0, 2) && beta.sizes() == g.sizes() &&
          state.dim() == 3 && state.size(0) == q.size(0) &&
          state.size(1) == q.size(2) && state.size(2) == v.size(2) &&
          chunk >= 1,
      "gated_delta_rule: unaligned inputs");
  const int64_t C = std::min(chunk, std::max<int64_t>(q.size(1), 1));
  // (Function::apply runs forward with gradients off: asked here.)
  const bool keep_states =
      torch::GradMode::is_enabled() &&
      (q.requires_grad() || k.requires_grad() || v.requires_grad() ||
       g.requires_grad() || beta.requires_grad() || state.requires_grad());
  auto r = GatedDeltaRuleFunction::apply(
      q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(),
      beta.contiguous(), state.contiguous(), C, keep_states);
  return {r[0], r[1]};
}

}  // namespace mha::detail
