// Blocked attention, the CPU path of the attention core (attention_core.h):
// for each (batch, head), query rows in blocks, the scores of one block at a
// time in a reused per-thread buffer, blocks spread over threads
// (item_threads.cpp); a FlexAttention call's steps of a block in
// blocked_flex.cpp.
//
// Glossary: N batch, H heads (the two leading dims of 4-D inputs), L target
// (query) length, S source (key) length, D and Dv the query/key and value
// features, B the query rows of one block.
#include "core/blocked_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <mutex>
#include <utility>
#include <vector>

#include "core/blas_gemm.h"
#include "core/blas_threads.h"
#include "core/blocked_flex.h"

namespace mha::detail {

/// In place on p (..., rows, cols): the columns outside each row's `limits`
/// set to -inf, then ATen's softmax over the last dim (the path of dtypes
/// and CPUs without fused_softmax_rows).
void limited_softmax(torch::Tensor& p, const RowLimits& limits) {
  TORCH_INTERNAL_ASSERT(limits.begins == nullptr,
                        "limited_softmax: rows' own limits are fused only");
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

torch::Tensor mask_block(const torch::Tensor& m, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols) {
  auto r = m.size(0) == 1 ? m : m.narrow(0, row0, rows);
  return r.size(1) == 1 ? r : r.narrow(1, col0, cols);
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

/// Rows [row0, row0 + rows) of matrix (n, h) of a 4-D tensor (N, H, T, F),
/// for block_gemm.
StridedMatrix rows_of(const torch::Tensor& t, int64_t n, int64_t h,
                      int64_t row0, int64_t rows) {
  auto* first = static_cast<char*>(t.data_ptr()) +
                (n * t.stride(0) + h * t.stride(1) + row0 * t.stride(2)) *
                    static_cast<int64_t>(t.element_size());
  return {first, rows, t.size(3), t.stride(2), t.stride(3)};
}

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
/// null for none) become 0. A flex call (`tile` not null) runs flex_scores
/// before the softmax, and `empty` then points at its fully masked rows
/// (tile->empty) where it has any.
void block_weights(torch::Tensor& p, const torch::Tensor& q,
                   const torch::Tensor& k, int64_t n, int64_t h, int64_t h_kv,
                   const torch::Tensor& mask, const torch::Tensor& blocked,
                   const torch::Tensor& bias_h, const BlockedSpec& spec,
                   const Block& block, const bool*& empty,
                   FlexTile* tile = nullptr, bool keep_raw = false,
                   const torch::Tensor& lse_rows = {}) {
  // p = scale · q[rows] · k[keys]ᵀ, run by run (beta = 0: p's old contents
  // are ignored)
  for (const auto& span : block.spans) {
    block_gemm(spec, p.scalar_type(), rows_of(q, n, h, block.row0, block.rows),
               rows_of(k, n, h_kv, span.key0, span.cols).t(), spec.scale,
               /*beta=*/0, matrix_of(p.narrow(1, span.col, span.cols)));
  }
  RowLimits limits;
  if (tile != nullptr) {
    limits = flex_scores(p, spec, block, mask, blocked, empty, *tile, keep_raw,
                         lse_rows);
    empty = tile->empty.defined() ? tile->empty.data_ptr<bool>() : nullptr;
  } else {
    if (mask.defined()) {
      p.add_(mask_block(mask, block.row0, block.rows, block.col0, block.cols));
      p.masked_fill_(
          mask_block(blocked, block.row0, block.rows, block.col0, block.cols),
          kNegInf);
    }
    limits = block.limits(spec.positions);
  }
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
  torch::Tensor lse;
  if (spec.flex != nullptr && spec.flex->return_lse) {
    lse = at::empty({N, H, L}, q.options());
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
        const auto rows = std::min(B, L - row0);
        for (auto h = h_begin; h < h_end; ++h) {
          // (rows, Dv), strided rows of the (N, L, H, Dv) buffer
          auto out_rows = [&] {
            return out_nh.select(0, n).select(0, h).narrow(0, row0, rows);
          };
          const Block block(spec, n, h, row0, rows, L, S);
          const auto cols = block.cols;
          const auto lse_rows =
              lse.defined()
                  ? lse.select(0, n).select(0, h).narrow(0, row0, rows)
                  : torch::Tensor();
          const bool* empty = empty_flags(spec, n, h, row0);
          if (cols == 0) {  // no row of the block sees any key
            out_rows().zero_();
            if (lse_rows.defined()) {
              lse_rows.fill_(kNegInf);
            }
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
                       : scratch.narrow(0, 0, rows * cols).view({rows, cols});
          c10::optional<FlexTile> tile;
          if (spec.flex != nullptr) {
            tile.emplace(n, h);
          }
          block_weights(p, q, k, n, h, h_kv, mask, blocked,
                        bias_row(relative_bias, h), spec, block, empty,
                        tile ? &*tile : nullptr, /*keep_raw=*/false, lse_rows);
          // out[rows] = Σ over runs p[:, run] · v[run]
          for (size_t i = 0; i < block.spans.size(); ++i) {
            const auto& span = block.spans[i];
            block_gemm(spec, p.scalar_type(),
                       matrix_of(p.narrow(1, span.col, span.cols)),
                       rows_of(v, n, h_kv, span.key0, span.cols), 1,
                       /*beta=*/i == 0 ? 0 : 1,
                       rows_of(out_nh, n, h, row0, rows));
          }
          if (empty != nullptr) {
            // 0 · (a non-finite value) would be NaN: a fully masked row is 0.
            auto o = out_rows();
            zero_rows(o, empty);
          }
          if (kept_block.defined() && !kept_block.is_same(p)) {
            kept_block.copy_(p);
          }
          for (const auto& span : spec.weights == WeightsMode::kNone
                                      ? std::vector<KeySpan>()
                                      : block.spans) {
            const auto p_span = p.narrow(1, span.col, span.cols);
            if (spec.weights == WeightsMode::kPerHead) {
              weights[n][h]
                  .narrow(0, row0, rows)
                  .narrow(1, span.key0, span.cols)
                  .copy_(p_span);
            } else {
              weights[n]
                  .narrow(0, row0, rows)
                  .narrow(1, span.key0, span.cols)
                  .add_(p_span, 1.0 / static_cast<double>(H));
            }
          }
        }
      },
      onednn_only({q, k, v}, {out_nh}) ? spec.threads : in_order(spec.threads),
      spec.onednn);
  return {out_nh, weights, kept, lse};
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
    const torch::Tensor& grad_weights, BlockedGradients grads,
    const torch::Tensor& grad_lse) {
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
  // A flex call's score_mod: the scores before it are kept in a fourth
  // buffer, and the captured tensors' gradients summed here.
  const bool score_mod = spec.flex != nullptr && bool(spec.flex->score_mod);
  std::mutex captured_lock;
  if (spec.flex != nullptr) {
    grads.captured.clear();
    for (const auto& t : spec.flex->captured) {
      grads.captured.push_back(at::zeros_like(t));
    }
  }
  for_each_item(
      N * Hkv, (score_mod ? 4 : 3) * B * S, q.options(),
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
            const Block block(spec, n, h, row0, std::min(B, L - row0), L, S);
            const auto rows = block.rows, cols = block.cols;
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
            c10::optional<FlexTile> tile;
            if (spec.flex != nullptr) {
              tile.emplace(n, h);
              if (score_mod) {
                tile->raw = buffer(3);
              }
            }
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
                            block, empty, tile ? &*tile : nullptr,
                            /*keep_raw=*/score_mod);
            }
            const auto go = rows_of(grad_out, n, h, row0, rows);  // (rows, Dv)
            for (const auto& span : block.spans) {
              const auto p_span = matrix_of(p.narrow(1, span.col, span.cols));
              // dv[keys] += p[:, run]ᵀ · go
              block_gemm(spec, dtype, p_span.t(), go, 1, /*beta=*/1,
                         rows_of(dv, n, h_kv, span.key0, span.cols));
              // dp[:, run] = go · v[keys]ᵀ
              block_gemm(spec, dtype, go,
                         rows_of(v, n, h_kv, span.key0, span.cols).t(), 1,
                         /*beta=*/0,
                         matrix_of(dp.narrow(1, span.col, span.cols)));
            }
            if (grad_weights.defined()) {
              const auto gw = spec.weights == WeightsMode::kPerHead
                                  ? grad_weights[n][h]
                                  : grad_weights[n];
              const double factor = spec.weights == WeightsMode::kPerHead
                                        ? 1.0
                                        : 1.0 / static_cast<double>(H);
              for (const auto& span : block.spans) {
                dp.narrow(1, span.col, span.cols)
                    .add_(gw.narrow(0, row0, rows)
                              .narrow(1, span.key0, span.cols),
                          factor);
              }
            }
            at::_softmax_backward_data_out(ds, dp, p, /*dim=*/1,
                                           q.scalar_type());
            // No gradient flows through a fully masked row, even where dp
            // is non-finite (0 · NaN).
            zero_rows(ds, empty);
            if (grad_lse.defined()) {
              // lse_r = log Σ_c exp(s_rc): d lse_r / d s_rc = p_rc (0 in a
              // fully masked row, whose p is 0).
              ds.addcmul_(p, grad_lse[n][h].narrow(0, row0, rows).unsqueeze(1));
            }
            if (score_mod) {
              flex_score_backward(ds, spec, *tile, grads.captured,
                                  captured_lock);
            }
            if (d_bias.defined()) {
              d_bias[n][h].index_add_(0, block.bias_index().view(-1),
                                      ds.view(-1));
            }
            for (size_t i = 0; i < block.spans.size(); ++i) {
              const auto& span = block.spans[i];
              const auto ds_span = matrix_of(ds.narrow(1, span.col, span.cols));
              // dq[rows] = scale · Σ over runs ds[:, run] · k[keys]
              block_gemm(spec, dtype, ds_span,
                         rows_of(k, n, h_kv, span.key0, span.cols), spec.scale,
                         /*beta=*/i == 0 ? 0 : 1,
                         rows_of(dq, n, h, row0, rows));
              // dk[keys] += scale · ds[:, run]ᵀ · q[rows]
              block_gemm(spec, dtype, ds_span.t(), rows_of(q, n, h, row0, rows),
                         spec.scale, /*beta=*/1,
                         rows_of(dk, n, h_kv, span.key0, span.cols));
            }
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

}  // namespace mha::detail
