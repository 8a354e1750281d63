// Blocked attention, the CPU path of the attention core (attention_core.h):
// for each (batch, head), query rows in blocks, the scores of one block at a
// time in a reused per-thread buffer, blocks spread over threads
// (item_threads.cpp).
//
// Glossary: N batch, H heads (the two leading dims of 4-D inputs), L target
// (query) length, S source (key) length, D and Dv the query/key and value
// features, B the query rows of one block.
#include "core/blocked_attention.h"

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <utility>

#include "core/blas_gemm.h"
#include "core/blas_threads.h"

namespace mha::detail {

/// In place on p (..., rows, cols): the columns outside each row's `limits`
/// set to -inf, then ATen's softmax over the last dim (the path of dtypes
/// and CPUs without fused_softmax_rows).
void limited_softmax(torch::Tensor& p, const RowLimits& limits) {
  const auto rows = p.size(-2), cols = p.size(-1);
  const bool limited =
      limits.begin(rows - 1, cols) > 0 || limits.end(0, cols) < cols;
  if (limited) {
    auto r = at::arange(rows, at::kLong).unsqueeze(1);  // (rows, 1)
    auto c = at::arange(cols, at::kLong).unsqueeze(0);  // (1, cols)
    auto begin = limits.begin_slides ? r + limits.begin0
                                     : at::full_like(r, limits.begin0);
    auto end =
        limits.end_slides ? r + limits.end0 : at::full_like(r, limits.end0);
    p.masked_fill_(c.lt(begin).logical_or_(c.ge(end)), kNegInf);
  }
  at::_softmax_out(p, p, /*dim=*/-1, /*half_to_float=*/false);
}

/// Row h (or 0 when shared by every head) of relative_bias (Hb, L + S - 1),
/// or undefined for the empty placeholder of no bias.
torch::Tensor bias_row(const torch::Tensor& relative_bias, int64_t h) {
  if (relative_bias.numel() == 0) {
    return torch::Tensor();
  }
  return relative_bias[relative_bias.size(0) == 1 ? 0 : h];
}

namespace {

/// The (n, h) slice of a tensor broadcastable to (N, H, ...).
torch::Tensor select_nh(const torch::Tensor& t, int64_t n, int64_t h) {
  return t.select(0, t.size(0) == 1 ? 0 : n).select(0, t.size(1) == 1 ? 0 : h);
}

/// Zeroes the rows r of t (rows, cols) whose flag empty[r] is set; empty is
/// null when no row is fully masked. Touches only those rows.
void zero_rows(torch::Tensor& t, const bool* empty) {
  if (empty == nullptr) {
    return;
  }
  for (int64_t r = 0; r < t.size(0); ++r) {
    if (empty[r]) {
      t[r].zero_();
    }
  }
}

/// The fully masked flags of rows [row0, ...) of head (n, h), or null.
const bool* empty_flags(const BlockedSpec& spec, int64_t n, int64_t h,
                        int64_t row0) {
  return spec.empty.defined()
             ? select_nh(spec.empty, n, h).data_ptr<bool>() + row0
             : nullptr;
}

/// (Nb, Hb, L) bool, true where query row i sees no key: every key of its
/// visible range [begin(i), end(i)) (positions' causal and window limits)
/// is blocked by `blocked` (mask == -inf, 4-D broadcastable to
/// (N, H, L, S), or undefined), or the range is empty. Decided from the
/// mask and the positions only, never from the scores, so that a row made
/// non-finite by its data stays non-finite. One pass over the mask (no
/// limits: all(); limits: a running count of allowed keys). Undefined when
/// no row is fully masked.
torch::Tensor fully_masked_rows(const torch::Tensor& blocked,
                                const KeyPositions& positions, int64_t L,
                                int64_t S) {
  const bool limited = positions.causal || positions.window > 0;
  if (!limited && !blocked.defined()) {
    return torch::Tensor();
  }
  torch::Tensor empty;
  if (!limited) {
    empty = blocked.all(/*dim=*/-1);  // (Nb, Hb, Lb)
  } else {
    auto begin = at::empty({L}, at::kLong), end = at::empty({L}, at::kLong);
    auto* b = begin.data_ptr<int64_t>();
    auto* e = end.data_ptr<int64_t>();
    for (int64_t i = 0; i < L; ++i) {
      b[i] = std::clamp<int64_t>(positions.begin(i), 0, S);
      e[i] = std::clamp<int64_t>(positions.end(i), b[i], S);
    }
    if (!blocked.defined()) {
      empty = end.eq(begin).view({1, 1, L});
    } else {
      // allowed[..., j] = keys < j not blocked: (Nb, Hb, Lb, S + 1)
      auto keys = blocked.expand({blocked.size(0), blocked.size(1),
                                  blocked.size(2), S});  // (Nb, Hb, Lb, S)
      auto allowed = at::constant_pad_nd(
          keys.logical_not().cumsum(/*dim=*/-1, at::kInt), {1, 0});
      const auto Nb = allowed.size(0), Hb = allowed.size(1);
      torch::Tensor count;  // (Nb, Hb, L)
      if (allowed.size(2) == 1) {
        count =
            (allowed.index_select(-1, end) - allowed.index_select(-1, begin))
                .squeeze(2);
      } else {
        auto at_rows = [&](const torch::Tensor& index) {
          return allowed.gather(
              -1, index.view({1, 1, L, 1}).expand({Nb, Hb, L, 1}));
        };
        count = (at_rows(end) - at_rows(begin)).squeeze(-1);
      }
      empty = count.eq(0);
    }
  }
  if (!empty.any().item<bool>()) {
    return torch::Tensor();
  }
  return empty.expand({empty.size(0), empty.size(1), L}).contiguous();
}

/// Rows [row0, row0 + rows) and columns [col0, col0 + cols) of a mask slice
/// that may broadcast in either dim.
torch::Tensor mask_block(const torch::Tensor& m, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols) {
  auto r = m.size(0) == 1 ? m : m.narrow(0, row0, rows);
  return r.size(1) == 1 ? r : r.narrow(1, col0, cols);
}

/// Rows [row0, row0 + rows) of matrix (n, h) of a 4-D tensor (N, H, T, F),
/// for block_gemm.
StridedMatrix rows_of(const torch::Tensor& t, int64_t n, int64_t h,
                      int64_t row0, int64_t rows) {
  auto* first = static_cast<char*>(t.data_ptr()) +
                (n * t.stride(0) + h * t.stride(1) + row0 * t.stride(2)) *
                    static_cast<int64_t>(t.element_size());
  return {first, rows, t.size(3), t.stride(2), t.stride(3)};
}

/// One block: query rows [row0, row0 + rows) and the key columns
/// [col0, col0 + cols) any of them can see (cols may be 0).
struct Block {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int64_t L = 0;  // query rows in all: relative_bias[h][j - i + L - 1]

  Block(const KeyPositions& positions, int64_t row0_, int64_t rows_, int64_t L_,
        int64_t S)
      : row0(row0_), rows(rows_), L(L_) {
    col0 = std::clamp<int64_t>(positions.begin(row0), 0, S);
    const auto end = std::clamp<int64_t>(positions.end(row0 + rows - 1), 0, S);
    cols = std::max<int64_t>(0, end - col0);
  }
  /// The visible columns of each row, relative to col0.
  RowLimits limits(const KeyPositions& positions) const {
    RowLimits l;
    l.begin0 = positions.begin(row0) - col0;
    l.end0 = positions.end(row0) - col0;
    l.begin_slides = positions.window > 0;
    l.end_slides = positions.causal || positions.window > 0;
    return l;
  }
  /// Index into relative_bias[h] of row 0's column 0 (row r, column c:
  /// bias_base() - r + c).
  int64_t bias_base() const { return col0 - row0 + L - 1; }
  /// (rows, cols) int64: bias_base() - r + c.
  torch::Tensor bias_index() const {
    return relative_bias_index(rows, cols, bias_base());
  }
};

/// The kept weights of `block` of head (n, h): rows [row0, +rows), columns
/// [col0, +cols) of kept[n][h], kept (N, H, L, S) contiguous. Contiguous
/// when the block spans all S columns.
torch::Tensor kept_block_of(const torch::Tensor& kept, int64_t n, int64_t h,
                            const Block& block) {
  const auto H = kept.size(1), L = kept.size(2), S = kept.size(3);
  return kept.as_strided(
      {block.rows, block.cols}, {S, 1},
      kept.storage_offset() + ((n * H + h) * L + block.row0) * S + block.col0);
}

/// c = alpha · a · b + beta · c for one block: through oneDNN where
/// spec.onednn and it applies, otherwise BLAS's gemm (gemm_matrix).
void block_gemm(const BlockedSpec& spec, torch::ScalarType dtype,
                const StridedMatrix& a, const StridedMatrix& b, double alpha,
                double beta, const StridedMatrix& c) {
  if (!(spec.onednn && onednn_gemm_matrix(a, b, alpha, beta, c))) {
    gemm_matrix(dtype, a, b, alpha, beta, c);
  }
}

/// Writes into `p` (rows, cols) the attention weights of one block of query
/// head h (q[n][h]) over key head h_kv (k[n][h_kv]); bias_h: that head's
/// relative_bias row, or undefined: scaled scores, mask, position bias and
/// limits, softmax, all in place; the fully masked rows (flags `empty`, or
/// null for none) become 0.
void block_weights(torch::Tensor& p, const torch::Tensor& q,
                   const torch::Tensor& k, int64_t n, int64_t h, int64_t h_kv,
                   const torch::Tensor& mask, const torch::Tensor& blocked,
                   const torch::Tensor& bias_h, const BlockedSpec& spec,
                   const Block& block, const bool* empty) {
  // p = scale · q[rows] · k[cols]ᵀ (beta = 0: p's old contents are ignored)
  block_gemm(spec, p.scalar_type(), rows_of(q, n, h, block.row0, block.rows),
             rows_of(k, n, h_kv, block.col0, block.cols).t(), spec.scale,
             /*beta=*/0, matrix_of(p));
  if (mask.defined()) {
    p.add_(mask_block(mask, block.row0, block.rows, block.col0, block.cols));
    p.masked_fill_(
        mask_block(blocked, block.row0, block.rows, block.col0, block.cols),
        kNegInf);
  }
  const auto limits = block.limits(spec.positions);
  if (p.scalar_type() == torch::kFloat && fused_softmax_available()) {
    // Limits, bias, softmax and empty rows in one kernel (fused_softmax.h).
    fused_softmax_rows(p, limits,
                       bias_h.defined()
                           ? bias_h.data_ptr<float>() + block.bias_base()
                           : nullptr);
    zero_rows(p, empty);
    return;
  }
  if (bias_h.defined()) {
    p.add_(bias_h.take(block.bias_index()));
  }
  limited_softmax(p, limits);
  // A fully masked row is softmax(-inf, ..., -inf) = NaN: it attends to
  // nothing. Rows made NaN by their data are left as they are.
  zero_rows(p, empty);
}

/// Whether oneDNN takes every matrix (the last two dims) of the 4-D
/// `operands` as a factor (one of the two strides 1, the other at least the
/// matrix's extent in that direction) and of the 4-D `results` as the
/// product (row-major: unit column stride), as onednn_gemm_matrix needs.
/// Where one does not, blocks of the call could fall back to BLAS, which
/// OpenBLAS's own threads must never call (run_on_openblas_threads).
bool onednn_only(std::initializer_list<torch::Tensor> operands,
                 std::initializer_list<torch::Tensor> results = {}) {
  auto row_major = [](const torch::Tensor& t) {
    return t.stride(3) == 1 && t.stride(2) >= std::max<int64_t>(t.size(3), 1);
  };
  auto column_major = [](const torch::Tensor& t) {
    return t.stride(2) == 1 && t.stride(3) >= std::max<int64_t>(t.size(2), 1);
  };
  return std::all_of(operands.begin(), operands.end(),
                     [&](const torch::Tensor& t) {
                       return row_major(t) || column_major(t);
                     }) &&
         std::all_of(results.begin(), results.end(), row_major);
}

/// The threads for a call whose operands oneDNN does not all take: in order
/// instead of on OpenBLAS's threads.
ItemThreads in_order(ItemThreads threads) {
  return threads == ItemThreads::kOpenBlas ? ItemThreads::kCaller : threads;
}

}  // namespace

/// Forward of blocked attention on 4-D inputs: output (N, H, L, Dv), a view
/// of an (N, L, H, Dv) buffer, or of an (L, N, H, Dv) one when q's rows are
/// laid out that way (a seq-first module input: batch stride below row
/// stride), so that merging heads, and the out-projection in the caller's
/// layout, need no copy, neither here nor in backward; weights as
/// spec.weights, and every block's weights for backward when
/// spec.keep_weights (columns a block does not see are left unset). A work
/// item is one block of query rows of one (n, h), or of one n and all heads
/// when the heads' weights are averaged (they add into the same rows).
/// relative_bias: (Hb, L + S - 1) contiguous, or empty (0) for none.
BlockedForward blocked_forward(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& relative_bias,
                               const BlockedSpec& spec) {
  const auto N = q.size(0), H = q.size(1), L = q.size(2);
  const auto group = H / k.size(1);  // query heads per key/value head
  const auto S = k.size(2), Dv = v.size(3);
  const auto B = spec.block_rows;
  const bool seq_first = N > 1 && L > 1 && q.stride(0) < q.stride(2);
  auto out = seq_first ? at::empty({L, N, H, Dv}, q.options()).transpose(0, 1)
                       : at::empty({N, L, H, Dv}, q.options());
  const auto out_nh = out.permute({0, 2, 1, 3});  // (N, H, L, Dv)
  torch::Tensor weights;
  if (spec.weights == WeightsMode::kPerHead) {
    weights = at::zeros({N, H, L, S}, q.options());
  } else if (spec.weights == WeightsMode::kAverage) {
    weights = at::zeros({N, L, S}, q.options());
  }
  torch::Tensor kept;
  if (spec.keep_weights) {
    kept = at::empty({N, H, L, S}, q.options());
  }
  const bool heads_per_item = spec.weights == WeightsMode::kAverage;
  const int64_t blocks = (L + B - 1) / B;
  const int64_t items_per_n = heads_per_item ? blocks : H * blocks;
  for_each_item(
      N * items_per_n, B * S, q.options(),
      [&](int64_t item, torch::Tensor& scratch) {
        const auto n = item / items_per_n;
        const auto h_begin = heads_per_item ? 0 : item % items_per_n / blocks;
        const auto h_end = heads_per_item ? H : h_begin + 1;
        const auto row0 = item % blocks * B;
        const Block block(spec.positions, row0, std::min(B, L - row0), L, S);
        const auto rows = block.rows, col0 = block.col0, cols = block.cols;
        const auto scratch_p =
            scratch.narrow(0, 0, rows * cols).view({rows, cols});
        for (auto h = h_begin; h < h_end; ++h) {
          // (rows, Dv), strided rows of the (N, L, H, Dv) buffer
          auto out_rows = [&] {
            return out_nh.select(0, n).select(0, h).narrow(0, row0, rows);
          };
          const bool* empty = empty_flags(spec, n, h, row0);
          if (cols == 0) {  // no row of the block sees any key
            out_rows().zero_();
            continue;
          }
          const auto h_kv = h / group;  // key/value head
          const auto mask = spec.mask.defined() ? select_nh(spec.mask, n, h)
                                                : torch::Tensor();
          const auto blocked = spec.mask.defined()
                                   ? select_nh(spec.blocked, n, h)
                                   : torch::Tensor();
          // A kept block that spans all S columns is contiguous: the weights
          // are computed there, with no copy.
          const auto kept_block = spec.keep_weights
                                      ? kept_block_of(kept, n, h, block)
                                      : torch::Tensor();
          auto p = kept_block.defined() && kept_block.is_contiguous()
                       ? kept_block
                       : scratch_p;
          block_weights(p, q, k, n, h, h_kv, mask, blocked,
                        bias_row(relative_bias, h), spec, block, empty);
          block_gemm(spec, p.scalar_type(), matrix_of(p),
                     rows_of(v, n, h_kv, col0, cols), 1, /*beta=*/0,
                     rows_of(out_nh, n, h, row0, rows));
          if (empty != nullptr) {
            // 0 · (a non-finite value) would be NaN: a fully masked row is 0.
            auto o = out_rows();
            zero_rows(o, empty);
          }
          if (kept_block.defined() && !kept_block.is_same(p)) {
            kept_block.copy_(p);
          }
          if (spec.weights == WeightsMode::kPerHead) {
            weights[n][h].narrow(0, row0, rows).narrow(1, col0, cols).copy_(p);
          } else if (spec.weights == WeightsMode::kAverage) {
            weights[n]
                .narrow(0, row0, rows)
                .narrow(1, col0, cols)
                .add_(p, 1.0 / static_cast<double>(H));
          }
        }
      },
      onednn_only({q, k, v}, {out_nh}) ? spec.threads : in_order(spec.threads),
      spec.onednn);
  return {out_nh, weights, kept};
}

/// Backward of blocked_forward: gradients of q, k, v (and relative_bias when
/// it requires grad) from the gradient of the output (N, H, L, Dv) and, if
/// defined, of the weights, written into `grads`' dq (any values) and dk, dv
/// (zero on entry), which are returned with the bias's gradient. Each block's
/// weights are taken from `kept` (blocked_forward's, when defined) or
/// recomputed; then dV += Pᵀ·dO, dP = dO·Vᵀ (+ dW), dS = softmax'(P, dP), dQ =
/// scale·dS·K, dK += scale·dSᵀ·Q, and dS summed along its diagonals into the
/// bias. A work item is one n and key/value head: the blocks of its query heads
/// add into the same dK and dV.
BlockedGradients blocked_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec,
    const torch::Tensor& kept, const torch::Tensor& grad_output,
    const torch::Tensor& grad_weights, BlockedGradients grads) {
  // A gradient oneDNN cannot take as it is (such as the expanded one of
  // out.sum()) is copied once, so that the items stay off BLAS.
  const auto grad_out = spec.onednn && !onednn_only({grad_output})
                            ? grad_output.contiguous()
                            : grad_output;
  const auto N = q.size(0), H = q.size(1), L = q.size(2);
  const auto S = k.size(2), Hkv = k.size(1);
  const auto group = H / Hkv;  // query heads per key/value head
  const auto B = spec.block_rows;
  auto& dq = grads.dq;
  auto& dk = grads.dk;
  auto& dv = grads.dv;
  // One row per (n, h), so that work items write disjoint rows; summed
  // over n (and heads, for a shared bias) at the end.
  torch::Tensor d_bias;
  if (relative_bias.numel() > 0 && relative_bias.requires_grad()) {
    d_bias = at::zeros({N, H, relative_bias.size(1)}, q.options());
  }
  for_each_item(
      N * Hkv, 3 * B * S, q.options(),
      [&](int64_t item, torch::Tensor& scratch) {
        const auto n = item / Hkv, h_kv = item % Hkv;
        const auto dtype = q.scalar_type();
        for (auto h = h_kv * group; h < (h_kv + 1) * group; ++h) {
          const auto mask = spec.mask.defined() ? select_nh(spec.mask, n, h)
                                                : torch::Tensor();
          const auto blocked = spec.mask.defined()
                                   ? select_nh(spec.blocked, n, h)
                                   : torch::Tensor();
          const auto bias_h = bias_row(relative_bias, h);
          for (int64_t row0 = 0; row0 < L; row0 += B) {
            const Block block(spec.positions, row0, std::min(B, L - row0), L,
                              S);
            const auto rows = block.rows, col0 = block.col0, cols = block.cols;
            if (cols == 0) {  // the rows see no key
              dq[n][h].narrow(0, row0, rows).zero_();
              continue;
            }
            auto buffer = [&](int64_t i) {
              return scratch.narrow(0, i * B * S, rows * cols)
                  .view({rows, cols});
            };
            auto p = buffer(0), dp = buffer(1), ds = buffer(2);
            const bool* empty = empty_flags(spec, n, h, row0);
            if (kept.defined()) {
              // ATen's softmax backward below takes contiguous weights: a
              // block of every column is read in place, others (strided
              // rows in `kept`) are copied.
              const auto kept_block = kept_block_of(kept, n, h, block);
              if (kept_block.is_contiguous()) {
                p = kept_block;
              } else {
                p.copy_(kept_block);
              }
            } else {
              block_weights(p, q, k, n, h, h_kv, mask, blocked, bias_h, spec,
                            block, empty);
            }
            const auto go = rows_of(grad_out, n, h, row0, rows);  // (rows, Dv)
            // dv[cols] += pᵀ · go
            block_gemm(spec, dtype, matrix_of(p).t(), go, 1, /*beta=*/1,
                       rows_of(dv, n, h_kv, col0, cols));
            // dp = go · v[cols]ᵀ
            block_gemm(spec, dtype, go, rows_of(v, n, h_kv, col0, cols).t(), 1,
                       /*beta=*/0, matrix_of(dp));
            if (grad_weights.defined()) {
              if (spec.weights == WeightsMode::kPerHead) {
                dp.add_(grad_weights[n][h]
                            .narrow(0, row0, rows)
                            .narrow(1, col0, cols));
              } else {
                dp.add_(
                    grad_weights[n].narrow(0, row0, rows).narrow(1, col0, cols),
                    1.0 / static_cast<double>(H));
              }
            }
            at::_softmax_backward_data_out(ds, dp, p, /*dim=*/1,
                                           q.scalar_type());
            // No gradient flows through a fully masked row, even where dp
            // is non-finite (0 · NaN).
            zero_rows(ds, empty);
            if (d_bias.defined()) {
              d_bias[n][h].index_add_(0, block.bias_index().view(-1),
                                      ds.view(-1));
            }
            // dq[rows] = scale · ds · k[cols]
            block_gemm(spec, dtype, matrix_of(ds),
                       rows_of(k, n, h_kv, col0, cols), spec.scale,
                       /*beta=*/0, rows_of(dq, n, h, row0, rows));
            // dk[cols] += scale · dsᵀ · q[rows]
            block_gemm(spec, dtype, matrix_of(ds).t(),
                       rows_of(q, n, h, row0, rows), spec.scale, /*beta=*/1,
                       rows_of(dk, n, h_kv, col0, cols));
          }
        }
      },
      onednn_only({q, k, v, grad_out}, {dq, dk, dv}) ? spec.threads
                                                     : in_order(spec.threads),
      spec.onednn);
  if (d_bias.defined()) {
    d_bias = d_bias.sum(0);  // (H, L + S - 1)
    if (relative_bias.size(0) == 1) {
      d_bias = d_bias.sum(0, /*keepdim=*/true);  // (1, L + S - 1)
    }
  }
  grads.relative_bias = d_bias;
  return grads;
}

namespace {

/// Query rows per block, chosen by measurement (mha-bench and a sweep of
/// 32..2048 rows at L = S = 1024, 4096, 8192 with head_dim 64, LibTorch
/// 1.13 + OpenBLAS, 2 threads): about 2^20 scores (4 MiB of float32) per
/// block, at least 128 rows, because GEMMs of fewer rows ran at half the
/// speed; at most 256 rows when causal, where smaller blocks skip more of
/// the masked keys. With a sliding window, a block of B rows computes
/// B + window - 1 columns per row: at most max(64, window / 2) rows
/// (blocked forward at L = 4096, H = 4, D = 64, causal, 2 threads, best of
/// 7: B = 64 fastest for windows 16..128, 6.6-10.9 ms against 9.3-14.3 ms
/// with 256 rows; B = 128 for window 256, 16.3 against 18.8 ms).
int64_t default_block_rows(int64_t L, int64_t S, bool causal, int64_t window) {
  constexpr int64_t kBlockElements = int64_t{1} << 20;
  constexpr int64_t kMinRows = 128;
  constexpr int64_t kMaxCausalRows = 256;
  constexpr int64_t kMinWindowRows = 64;
  auto rows = std::max(kMinRows, kBlockElements / S);
  if (causal || window > 0) {
    rows = std::min(rows, kMaxCausalRows);
  }
  if (window > 0) {
    rows = std::min(rows, std::max(kMinWindowRows, window / 2));
  }
  return std::min(rows, L);
}

}  // namespace

AttentionResult blocked_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& mask,
    const KeyPositions& positions, double scale, WeightsMode weights,
    int64_t block_rows, KeptWeights kept, const torch::Tensor& packed) {
  // Everything as 4-D (N, H, T, features); fewer dims become leading 1s.
  auto to_4d = [](const torch::Tensor& t) {
    auto r = t;
    while (r.defined() && r.dim() < 4) {
      r = r.unsqueeze(0);
    }
    return r;
  };
  const auto L = query.size(-2);
  const auto S = key.size(-2);
  BlockedSpec spec;
  spec.mask = to_4d(mask);
  if (mask.defined()) {
    spec.blocked = spec.mask.eq(kNegInf);
  }
  spec.positions = positions;
  spec.positions.relative_bias = torch::Tensor();  // an input, see below
  spec.empty = fully_masked_rows(spec.blocked, positions, L, S);
  spec.scale = scale;
  spec.weights = weights;
  spec.block_rows = block_rows > 0 ? std::min(block_rows, L)
                                   : default_block_rows(L, S, positions.causal,
                                                        positions.window);
  const auto& bias = positions.relative_bias;
  const bool needs_grad =
      torch::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad() ||
       (bias.defined() && bias.requires_grad()));
  // N·H·L·S: every score of the call.
  const int64_t scores = score_count(query, S);
  spec.one_block =
      block_rows <= 0 && scores <= kOneBlockScores && L <= kOneBlockRows;
  const bool onednn = query.is_cpu() &&
                      query.scalar_type() == torch::kFloat32 &&
                      onednn_products_available();
  spec.threads = item_threads(scores, S, onednn);
  // oneDNN's products where each runs on one core anyway: items spread
  // over either pool, and small calls in order (kSpreadScores). Larger
  // calls in order (where OpenBLAS's idle workers spin) keep BLAS's gemm on
  // its own threads.
  spec.onednn = onednn && (spec.threads != ItemThreads::kCaller ||
                           scores <= kSpreadScores);
  if (kept == KeptWeights::kAuto) {
    // Kept while small (at most kOneBlockScores, 4 MiB of float32), so that
    // backward skips each block's scores GEMM and softmax. A block that
    // spans all S columns is computed in its place in the kept tensor;
    // others (causal blocks short of S) are copied there. mha-bench at
    // (2,128,256,4), LibTorch 1.13, three alternating runs, mha / torch::nn
    // recomputed -> kept in place: forward+backward 0.94-0.96 -> 0.89-0.90,
    // forward 0.77-0.79 -> 0.78-0.80 (the same within the noise). Copying
    // every block instead had cost forward more than it saved backward
    // (forward 0.83-0.86 against 0.79-0.80). Without a gradient to compute
    // nothing is kept.
    spec.keep_weights = needs_grad && scores <= kOneBlockScores;
  } else {
    spec.keep_weights = kept == KeptWeights::kAlways;
  }
  // LibTorch 1.13's custom functions take no undefined inputs: no bias is
  // an empty placeholder there.
  auto q = to_4d(query);
  if (spec.empty.defined()) {
    // A fully masked row's query takes no part: its gradient is 0 and a
    // non-finite value there reaches no other gradient (such as dK).
    q = q.masked_fill(spec.empty.unsqueeze(-1), 0.0);  // (N, H, L, D)
  }
  const auto k = to_4d(key), v = to_4d(value);
  const auto bias_input =
      bias.defined() ? bias.contiguous() : at::empty({0}, query.options());
  auto outputs =
      apply_blocked(q, k, v, bias_input, spec,
                    needs_grad && !spec.one_block ? packed : torch::Tensor());
  auto output = outputs[0];
  auto weights_out = outputs.size() > 1 ? outputs[1] : torch::Tensor();
  // Back to the input's rank.
  for (auto d = query.dim(); d < 4; ++d) {
    output = output.squeeze(0);
    if (weights_out.defined()) {
      weights_out = weights_out.squeeze(0);
    }
  }
  return {output, weights_out};
}

}  // namespace mha::detail
