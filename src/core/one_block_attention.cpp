// One block of all heads, the blocked path's form for short calls
// (blocked_attention.h: at most kOneBlockRows query rows and
// kOneBlockScores scores, such as one decoding step). Per-head work items
// would spend more time in their many small ATen calls than in arithmetic
// there: instead each thread runs one batched call per step over its share
// of the (n, key/value head) pairs. Grouped heads need no copy: the G query
// heads of one key/value head are stacked by rows, (N·Hkv, G·L, D).
//
// Glossary: N batch, H query heads, Hkv key/value heads, G = H / Hkv, L
// target (query) length, S source (key) length, D and Dv the query/key and
// value features.
#include <algorithm>
#include <functional>
#include <limits>
#include <vector>

#include "core/blas_gemm.h"
#include "core/blocked_attention.h"

namespace mha::detail {
namespace {

/// Multiply-adds below which the one block runs on the calling thread:
/// a parallel region cost more than it saved there (one decoding step at
/// N = 8, blocked_attention.h: 0.09 against 0.12 ms).
constexpr int64_t kSpreadWork = int64_t{1} << 21;

/// Consecutive (n, key/value head) pairs that form a rectangle: batches
/// [n0, n1) and key/value heads [h0, h1), either one n or whole n's, so
/// that they are one range of the flattened N·Hkv pairs.
struct PairRange {
  int64_t n0 = 0, n1 = 0, h0 = 0, h1 = 0;
  int64_t Hkv = 1, G = 1;  // key/value heads, query heads per one

  /// Index of the first pair, and how many, in the flattened N·Hkv.
  int64_t first() const { return n0 * Hkv + h0; }
  int64_t count() const { return (n1 - n0) * (h1 - h0); }
  /// The range's matrices of x (N·Hkv, ...).
  torch::Tensor of(const torch::Tensor& x) const {
    return x.narrow(0, first(), count());
  }
  /// The range's part of t broadcastable to (N, H, ...) (dims of size 1
  /// stay): (n1 - n0 or 1, (h1 - h0)·G or 1, ...).
  torch::Tensor heads(const torch::Tensor& t) const {
    auto r = t.size(0) == 1 ? t : t.narrow(0, n0, n1 - n0);
    return r.size(1) == 1 ? r : r.narrow(1, h0 * G, (h1 - h0) * G);
  }
  /// x (N·Hkv, G·L, C) range as (n1 - n0, (h1 - h0)·G, L, C).
  torch::Tensor per_head(const torch::Tensor& x, int64_t L) const {
    return of(x).view({n1 - n0, (h1 - h0) * G, L, x.size(2)});
  }
};

/// Calls body on the (n, key/value head) pairs of N·Hkv in ranges: with
/// `work` (multiply-adds) of at least kSpreadWork spread over ATen's threads
/// with one-threaded BLAS as for_each_item, else all in one range on this
/// thread. Each thread's share is split into at most three PairRanges (the
/// rest of its first n, whole n's, the start of its last n).
void for_each_pair_range(int64_t N, int64_t Hkv, int64_t G, int64_t work,
                         const torch::TensorOptions& options,
                         const std::function<void(const PairRange&)>& body) {
  const int64_t pairs = N * Hkv;
  // Below kSpreadWork multiply-adds a parallel region costs more than it
  // saves.
  const int64_t shares =
      work < kSpreadWork ? 1 : std::min<int64_t>(at::get_num_threads(), pairs);
  for_each_item(shares, 0, options, [&](int64_t share, torch::Tensor&) {
    int64_t begin = pairs * share / shares;
    const int64_t end = pairs * (share + 1) / shares;
    while (begin < end) {
      PairRange r;
      r.Hkv = Hkv;
      r.G = G;
      r.n0 = begin / Hkv;
      r.h0 = begin % Hkv;
      if (r.h0 > 0 || end - begin < Hkv) {  // part of one n
        r.n1 = r.n0 + 1;
        r.h1 = std::min(Hkv, r.h0 + (end - begin));
      } else {  // whole n's
        r.n1 = end / Hkv;
        r.h1 = Hkv;
      }
      body(r);
      begin += r.count();
    }
  });
}

/// The limits of the visible keys of every query row, columns from 0.
RowLimits whole_row_limits(const KeyPositions& positions) {
  RowLimits limits;
  limits.begin0 = positions.begin(0);
  limits.end0 = positions.end(0);
  limits.begin_slides = positions.window > 0;
  limits.end_slides = positions.causal || positions.window > 0;
  return limits;
}

/// The inputs of the one-block path as batches of matrices.
struct Stacked {
  int64_t N, H, Hkv, G, L, S;
  torch::Tensor q, k, v;  // (N·Hkv, G·L, D), (N·Hkv, S, D), (N·Hkv, S, Dv)

  Stacked(const torch::Tensor& q4, const torch::Tensor& k4,
          const torch::Tensor& v4)
      : N(q4.size(0)),
        H(q4.size(1)),
        Hkv(k4.size(1)),
        G(H / Hkv),
        L(q4.size(2)),
        S(k4.size(2)) {
    // Views where the strides allow (a cache's keys, say); each matrix
    // only needs a unit stride for the GEMMs.
    q = q4.reshape({N * Hkv, G * L, q4.size(3)});
    k = k4.reshape({N * Hkv, S, k4.size(3)});
    v = v4.reshape({N * Hkv, S, v4.size(3)});
  }
  /// A new (N·Hkv, G·L, cols) tensor.
  torch::Tensor rows(int64_t cols) const {
    return at::empty({N * Hkv, G * L, cols}, q.options());
  }
};

/// Writes into p (N·Hkv, G·L, S) the attention weights of the pairs in
/// range r, as block_weights does for one block: scaled scores, mask,
/// bias, limits, softmax, fully masked rows 0.
void range_weights(torch::Tensor& p, const Stacked& in,
                   const torch::Tensor& relative_bias, const BlockedSpec& spec,
                   const PairRange& r) {
  const auto L = in.L, S = in.S;
  batched_gemm_out(r.of(p), r.of(in.q), r.of(in.k).transpose(1, 2), spec.scale);
  auto p4 = r.per_head(p, L);  // (n, h, L, S)
  if (spec.mask.defined()) {
    p4.add_(r.heads(spec.mask)).masked_fill_(r.heads(spec.blocked), kNegInf);
  }
  const auto limits = whole_row_limits(spec.positions);
  const bool has_bias = relative_bias.numel() > 0;
  if (p.scalar_type() == torch::kFloat && fused_softmax_available()) {
    std::vector<const float*> bias;
    if (has_bias) {
      for (int64_t n = r.n0; n < r.n1; ++n) {
        for (int64_t h = r.h0 * r.G; h < r.h1 * r.G; ++h) {
          // Row 0, column 0 of head h: relative_bias[h][L - 1].
          bias.push_back(bias_row(relative_bias, h).data_ptr<float>() +
                         (L - 1));
        }
      }
    }
    auto matrices = p4.view({-1, L, S});
    fused_softmax_matrices(matrices, limits, bias);
  } else {
    if (has_bias) {
      p4.add_(r.heads(dense_relative_bias(relative_bias, L, S).unsqueeze(0)));
    }
    limited_softmax(p4, limits);
  }
  if (spec.empty.defined()) {
    // softmax(-inf, ..., -inf) = NaN: a fully masked row attends to nothing.
    p4.masked_fill_(r.heads(spec.empty).unsqueeze(-1), 0.0);
  }
}

}  // namespace

BlockedForward batched_forward(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& relative_bias,
                               const BlockedSpec& spec) {
  const Stacked in(q, k, v);
  const auto N = in.N, H = in.H, L = in.L, S = in.S, Dv = v.size(3);
  auto p = in.rows(S);
  auto out = in.rows(Dv);
  const auto work = N * H * L * S * (q.size(3) + Dv);
  for_each_pair_range(N, in.Hkv, in.G, work, q.options(),
                      [&](const PairRange& r) {
                        range_weights(p, in, relative_bias, spec, r);
                        batched_gemm_out(r.of(out), r.of(p), r.of(in.v), 1.0);
                        if (spec.empty.defined()) {
                          // 0 · (a non-finite value) would be NaN: a fully
                          // masked row is 0.
                          r.per_head(out, L).masked_fill_(
                              r.heads(spec.empty).unsqueeze(-1), 0.0);
                        }
                      });
  const auto p4 = p.view({N, H, L, S});
  BlockedForward result{out.view({N, H, L, Dv}), torch::Tensor(),
                        spec.keep_weights ? p4 : torch::Tensor(),
                        torch::Tensor()};
  if (spec.weights == WeightsMode::kPerHead) {
    result.weights = spec.keep_weights ? p4.clone() : p4;
  } else if (spec.weights == WeightsMode::kAverage) {
    // Head by head in order, as blocked_forward adds them.
    result.weights = at::zeros({N, L, S}, q.options());
    for (int64_t h = 0; h < H; ++h) {
      result.weights.add_(p4.select(1, h), 1.0 / static_cast<double>(H));
    }
  }
  return result;
}

BlockedGradients batched_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec,
    const torch::Tensor& kept, const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights) {
  const Stacked in(q, k, v);
  const auto N = in.N, H = in.H, L = in.L, S = in.S;
  const auto go = grad_out.reshape({N * in.Hkv, in.G * L, v.size(3)});
  auto p = kept.defined() ? kept.view({N * in.Hkv, in.G * L, S}) : in.rows(S);
  auto dp = in.rows(S), ds = in.rows(S);
  auto dq = in.rows(q.size(3));
  auto dk = at::empty(in.k.sizes(), in.k.options());
  auto dv = at::empty(in.v.sizes(), in.v.options());
  const bool bias_grad =
      relative_bias.numel() > 0 && relative_bias.requires_grad();
  torch::Tensor d_bias, bias_index;  // (N·H, L + S - 1), (L·S)
  if (bias_grad) {
    d_bias = at::zeros({N * H, relative_bias.size(1)}, q.options());
    bias_index = relative_bias_index(L, S, L - 1).view(-1);
  }
  // Three GEMMs of forward's size, four with the weights recomputed.
  const auto work =
      (kept.defined() ? 3 : 4) * N * H * L * S * std::max(q.size(3), v.size(3));
  for_each_pair_range(
      N, in.Hkv, in.G, work, q.options(), [&](const PairRange& r) {
        if (!kept.defined()) {
          range_weights(p, in, relative_bias, spec, r);
        }
        const auto p_r = r.of(p), go_r = r.of(go);
        auto dp_r = r.of(dp), ds_r = r.of(ds);
        batched_gemm_out(r.of(dv), p_r.transpose(1, 2), go_r, 1.0);
        batched_gemm_out(dp_r, go_r, r.of(in.v).transpose(1, 2), 1.0);
        if (grad_weights.defined()) {
          auto dp4 = r.per_head(dp, L);
          if (spec.weights == WeightsMode::kPerHead) {
            dp4.add_(r.heads(grad_weights));
          } else {
            dp4.add_(r.heads(grad_weights.unsqueeze(1)),
                     1.0 / static_cast<double>(H));
          }
        }
        at::_softmax_backward_data_out(ds_r, dp_r, p_r, /*dim=*/-1,
                                       q.scalar_type());
        if (spec.empty.defined()) {
          // No gradient flows through a fully masked row, even where dp is
          // non-finite (0 · NaN).
          r.per_head(ds, L).masked_fill_(r.heads(spec.empty).unsqueeze(-1),
                                         0.0);
        }
        if (bias_grad) {
          // Entry [h][c - r + L - 1] gets the sum of ds[n][h][r][c] over r, c.
          d_bias.narrow(0, r.first() * r.G, r.count() * r.G)
              .index_add_(1, bias_index, ds_r.view({-1, L * S}));
        }
        batched_gemm_out(r.of(dq), ds_r, r.of(in.k), spec.scale);
        batched_gemm_out(r.of(dk), ds_r.transpose(1, 2), r.of(in.q),
                         spec.scale);
      });
  BlockedGradients g;
  g.dq = dq.view(q.sizes());  // (N, H, L, D)
  g.dk = dk.view(k.sizes());  // (N, Hkv, S, D)
  g.dv = dv.view(v.sizes());  // (N, Hkv, S, Dv)
  if (bias_grad) {
    auto per_head = d_bias.view({N, H, -1}).sum(0);  // (H, L + S - 1)
    g.relative_bias = relative_bias.size(0) == 1
                          ? per_head.sum(0, /*keepdim=*/true)
                          : per_head;  // like relative_bias
  }
  return g;
}

}  // namespace mha::detail
