// Internal: the core of linear-cost attention (mha/linear_attention.h) that
// the public function and the module's kLinear / kPerformer kinds share:
// the sums of linear attention, read by queries, grown by keys, and the
// causal form by blocks. Not installed.
//
// Glossary: L query length, S key length, F features per head (φ's output),
// D head_dim, Dv value features, C block length, "..." leading dims (for
// the module (N, Hkv, G) with G = H / Hkv on queries and 1 on keys: the
// sums broadcast over the query heads of a group).
#pragma once

#include <torch/torch.h>

#include <cstdint>

namespace mha::detail {

/// The features of queries or keys, φ(x) (..., T, F), or their logarithms
/// (`log`): the Performer's features are exponentials, kept as exponents
/// until shifts that keep them in range are known (LinearSums::offset).
struct Features {
  torch::Tensor values;  // (..., T, F)
  bool log = false;
};

/// The state of linear attention after some keys (Katharopoulos et al.,
/// 2020, eq. 10-11): kv = Σ_j φ(k_j) v_jᵀ (..., F, Dv) and k = Σ_j φ(k_j)
/// (..., F). With log features, row f of both is kept times
/// exp(-offset_f), offset (..., F) the largest exponent of feature f over
/// the keys so far (-inf before any key counts): every sum then stays in
/// range, and a query's features are shifted by the same offsets, so the
/// products are unchanged. Empty (undefined kv) = no keys yet.
struct LinearSums {
  torch::Tensor kv;      // (..., F, Dv)
  torch::Tensor k;       // (..., F)
  torch::Tensor offset;  // (..., F), log features only
  bool empty() const { return !kv.defined(); }
};

/// `sums` with the keys `keys` (..., S, F) and their values (..., S, Dv)
/// added (the non-causal sums, or a decoding step's); differentiable in
/// every input (the offsets are constants).
LinearSums add_keys(const LinearSums& sums, const Features& keys,
                    const torch::Tensor& values);

/// Every query row (..., L, F) against the sums: φ(q)ᵀ kv / (φ(q)ᵀ k),
/// (..., L, Dv); a row with denominator 0 gets 0. Log query features are
/// shifted by the sums' offsets and then by each row's largest (a factor
/// per row, which cancels in the ratio). `sums` must not be empty; queries
/// and keys both plain or both log.
torch::Tensor read_sums(const Features& queries, const LinearSums& sums);

/// Causal linear attention over aligned queries and keys: row i of
/// `queries` (..., T, F) sees keys 0..i of `keys` (..., T, F) and whatever
/// `sums` holds (earlier positions; may be empty). Blocks of `block` rows:
/// inside a block the masked (C, C) product, across blocks the running
/// sums (log features: offsets of each block the running maximum up to
/// its end); past 16 blocks, groups of 16 blocks one after another, the
/// sums carried from group to group. Returns (..., T, Dv); when
/// `sums_out` is given, it receives the sums after all T keys (the
/// decoding state).
torch::Tensor causal_linear_attention(const Features& queries,
                                      const Features& keys,
                                      const torch::Tensor& values,
                                      const LinearSums& sums, int64_t block,
                                      LinearSums* sums_out = nullptr);

/// The block length C of the causal form: 64. Per row it costs
/// C·(F + Dv) for the block's own product and F·Dv / C for the sums kept
/// per block; 64 keeps both near the row's own F + Dv at the head sizes
/// of real models (D = 64..128, the Performer's F = D·ln D), and the
/// (C, C) products fit the caches (the Performer's F = 266 at D = 64:
/// C = 64 needs 110 kflop per row and head, C = 256 238 kflop, for about
/// the same memory).
int64_t causal_block_length(int64_t features, int64_t value_features);

/// FAVOR+'s exponents w_iᵀ x - |x|²/2 - log(m)/2 (..., T, m) of x
/// (..., T, D), random_features (m, D): favor_features = exp of them.
torch::Tensor favor_exponents(const torch::Tensor& x,
                              const torch::Tensor& random_features);

}  // namespace mha::detail
