// Linear-cost attention: linear attention with a feature map (Katharopoulos
// et al., 2020), Performer's FAVOR+ random features (Choromanski et al.,
// 2021) and Linformer's projection along the sequence (Wang et al., 2020).
//
// Semantics: the papers, cited at each name below.
//   * "Transformers are RNNs: Fast Autoregressive Transformers with Linear
//     Attention", Katharopoulos, Vyas, Pappas, Fleuret, ICML 2020,
//     arXiv:2006.16236 (eq. 4-6 non-causal, eq. 8-12 causal and recurrent).
//   * "Rethinking Attention with Performers", Choromanski et al., ICLR 2021,
//     arXiv:2009.14794 (FAVOR+: lemma 1, positive random features; section
//     2.4, orthogonal random features).
//   * "Linformer: Self-Attention with Linear Complexity", Wang, Li, Khabsa,
//     Fang, Ma, 2020, arXiv:2006.04768 (eq. 7, projections E and F; section
//     4, parameter sharing).
// The module side (MultiHeadAttentionOptions::attention_kind) is in
// mha/multi_head_attention.h; the guide is docs/linear.md.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>

namespace mha {

/// The attention a MultiHeadAttention computes between its projections
/// (MultiHeadAttentionOptions::attention_kind). Every kind keeps the
/// module's projections, parameters, mask rules and layouts.
///
/// | kind       | cost       | causal | padding | decoding | weights |
/// |------------|------------|--------|---------|----------|---------|
/// | kSoftmax   | O(L·S)     | yes    | yes     | K and V  | (L, S)  |
/// | kLinear    | O(L + S)   | yes    | yes     | constant | never   |
/// | kPerformer | O(L + S)   | yes    | yes     | constant | never   |
/// | kLinformer | O(L·k + S) | no     | bool    | no       | (L, k)  |
enum class AttentionKind {
  /// softmax(Q Kᵀ · scale) V (Vaswani et al., 2017): mha's core.
  kSoftmax,
  /// φ(Q) (φ(K)ᵀ V) / (φ(Q) · Σ_j φ(K_j)) with φ = feature_map (default
  /// elu(x) + 1), Katharopoulos et al., 2020, arXiv:2006.16236.
  kLinear,
  /// The same form with FAVOR+'s positive orthogonal random features, an
  /// unbiased estimate of the softmax kernel exp(q·k · scale) (Choromanski
  /// et al., 2021, arXiv:2009.14794).
  kPerformer,
  /// softmax(Q (E K)ᵀ · scale) (F V) with learned E, F (k, n) that project
  /// keys and values along the sequence (Wang et al., 2020,
  /// arXiv:2006.04768). Non-causal only.
  kLinformer,
};

/// "softmax", "linear", "performer" or "linformer".
const char* to_string(AttentionKind kind);

/// A feature map φ of linear attention: (..., T, D) -> (..., T, F), applied
/// to queries and keys alike. It must be elementwise along the leading and
/// T dims (row t of the result depends on row t of the input only: the
/// causal form and decoding apply it to pieces of a sequence) and should be
/// positive, so that every denominator φ(q)·Σφ(k) is > 0. Written with ATen
/// ops, it runs on every device and autograd differentiates it.
using FeatureMap = std::function<torch::Tensor(const torch::Tensor&)>;

/// elu(x) + 1, linear attention's default feature map (Katharopoulos et al.,
/// 2020, arXiv:2006.16236, eq. 7): positive, F = D.
torch::Tensor elu_feature_map(const torch::Tensor& x);

/// Linear attention (Katharopoulos et al., 2020, arXiv:2006.16236, eq. 5-6
/// and 9): each query row i gets
///
///     out_i = φ(q_i)ᵀ (Σ_j φ(k_j) v_jᵀ) / (φ(q_i)ᵀ Σ_j φ(k_j)),
///
/// the sums over every key j, or with is_causal over j <= i (top-left
/// alignment as mha::causal_mask: key j <= query i). Never forms the (L, S)
/// weights: the non-causal form costs O((L + S)·F·Dv); the causal form is
/// computed by prefix sums over blocks of C = 64 rows (within a block the
/// masked (C, C) product of eq. 4, across blocks the running sums of eq.
/// 10-11), O(L·(C·(F + Dv) + F·Dv)) time and O(L·(C + F + Dv + F·Dv / C))
/// memory per leading index: no (L, S) and no (L, F, Dv) tensor. On the
/// CPU in float32 and float64 each leading index walks its blocks on one
/// of ATen's threads, and backward is a walk of the same kind; elsewhere
/// the blocks run as batched ATen ops. Without autograd (GradMode off:
/// torch::NoGradGuard, c10::InferenceMode) φ is applied a segment of rows
/// at a time (at most 8 MiB of features per segment, the sums carried
/// from one to the next), so the features of the whole sequence never
/// exist at once; the result equals the whole form's to rounding.
///
/// Args:
///   query: (..., L, D) floating (float32, float64, or a reduced type the
///     feature map supports).
///   key:   (..., S, D), same dtype and device; leading dims broadcastable
///     with query's.
///   value: (..., S, Dv), same dtype and device; leading dims as key's.
///   is_causal: query i sees keys j <= i only.
///   feature_map: φ; empty (default) = elu_feature_map.
/// Returns: (..., L, Dv), query's dtype. A query row that sees no key (a
/// causal row when S = 0) or whose denominator is 0 gets 0, never NaN.
///
/// Throws c10::Error naming the argument for fewer than 2 dims, a key or
/// value of another D, S, dtype or device, a feature map that returns
/// another leading shape or dtype for query and key; and, from backward,
/// for a second derivative of the causal form on the CPU in float32 or
/// float64 (create_graph = true through it: its walk's gradients are
/// first derivatives only).
///
/// Equivalent LibTorch math (dense O(L·S), the test's reference):
///   auto a = torch::matmul(phi(q), phi(k).transpose(-2, -1));  // (..., L, S)
///   a = a.masked_fill(mha::causal_mask(L, S), 0);  // if is_causal
///   auto out = torch::matmul(a, v) / a.sum(-1, true);
///
/// Example:
///   auto q = torch::randn({2, 4, 1000, 32});  // (N, H, L, D)
///   auto k = torch::randn({2, 4, 1000, 32});
///   auto v = torch::randn({2, 4, 1000, 32});
///   auto out = mha::linear_attention(q, k, v, /*is_causal=*/true);
///   // out: (2, 4, 1000, 32)
torch::Tensor linear_attention(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value,
                               bool is_causal = false,
                               const FeatureMap& feature_map = {});

/// Performer's orthogonal random features (Choromanski et al., 2021,
/// arXiv:2009.14794, section 2.4): nb_features rows w_i of dimension dim,
/// in blocks of dim rows that are orthogonal to each other (Q of the QR
/// decomposition of a dim x dim standard Gaussian matrix; the last block
/// truncated), each row then scaled to the norm of an independent
/// dim-dimensional standard Gaussian vector (chi-distributed, so each w_i
/// is marginally N(0, I), as the estimator needs). Drawn in float64 on the
/// CPU from `seed` (the same features on every device and run), returned
/// with `options`' dtype and device.
/// Throws c10::Error when nb_features or dim is < 1.
torch::Tensor orthogonal_random_features(int64_t nb_features, int64_t dim,
                                         uint64_t seed,
                                         torch::TensorOptions options = {});

/// FAVOR+'s positive random features (Choromanski et al., 2021,
/// arXiv:2009.14794, lemma 1):
///
///     φ(x)_i = exp(w_iᵀ x - |x|² / 2) / sqrt(m),   i < m,
///
/// for x (..., T, D) and random_features (m, D), rows w_i ~ N(0, I_D)
/// (orthogonal_random_features). E[φ(q)ᵀ φ(k)] = exp(qᵀ k) exactly, with
/// positive estimates only. To approximate softmax(q·k / sqrt(D)), pass
/// q and k scaled by D^(-1/4). Usable as a FeatureMap:
///   auto w = mha::orthogonal_random_features(256, 32, /*seed=*/0);
///   auto phi = [w](const torch::Tensor& x) {
///     return mha::favor_features(x, w);
///   };
///   const double s = std::pow(32.0, -0.25);
///   auto out = mha::linear_attention(q * s, k * s, v, true, phi);
/// (the module's kPerformer computes the same with exponents shifted by
/// constants that cancel, so that large inputs neither overflow nor
/// underflow.) Returns (..., T, m), x's dtype.
/// Throws c10::Error when random_features is not (m, D) of x's dtype and
/// device.
torch::Tensor favor_features(const torch::Tensor& x,
                             const torch::Tensor& random_features);

}  // namespace mha
