// Glossary: L target (query) length, S source (key) length, E query/key
// feature size, Ev value feature size, "..." any leading (batch, head) dims.
#include "mha/attention.h"

#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

#include "attention_core.h"
#include "blas_threads.h"
#include "fused_softmax.h"
#include "mha/detail/compat.h"
#include "mha/masks.h"

namespace mha {
namespace detail {

namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// Weights (..., L, S) in the requested form.
torch::Tensor shape_weights(const torch::Tensor& weights, WeightsMode mode) {
  switch (mode) {
    case WeightsMode::kNone:
      return torch::Tensor();
    case WeightsMode::kPerHead:
      return weights;
    case WeightsMode::kAverage:
      return weights.mean(/*dim=*/1);  // (N, H, L, S) → (N, L, S)
  }
  return torch::Tensor();
}

/// t (N, Hkv, S, D) with each key/value head repeated for its heads / Hkv
/// query heads: (N, heads, S, D), head h a copy of t's head h / (heads /
/// Hkv), as repeat_kv in Llama.
torch::Tensor repeat_kv(const torch::Tensor& t, int64_t heads) {
  const auto N = t.size(0), Hkv = t.size(1), S = t.size(2), D = t.size(3);
  return t.unsqueeze(2)
      .expand({N, Hkv, heads / Hkv, S, D})
      .reshape({N, heads, S, D});
}

/// `mask` (additive or undefined) with the limits of `positions` (causal,
/// window) merged in as a dense (L, S) mask.
torch::Tensor with_positions(const torch::Tensor& mask,
                             const KeyPositions& positions,
                             const torch::Tensor& query,
                             const torch::Tensor& key) {
  return merge_masks({mask, key_positions_mask(positions, query.size(-2),
                                               key.size(-2), query.options())},
                     query.scalar_type());
}

}  // namespace

AttentionResult explicit_attention(const torch::Tensor& query,
                                   const torch::Tensor& key,
                                   const torch::Tensor& value,
                                   const torch::Tensor& mask_in,
                                   const KeyPositions& positions,
                                   double dropout_p, double scale,
                                   WeightsMode weights_mode) {
  const auto dtype = query.scalar_type();
  // broadcastable to (..., L, S)
  auto mask = with_positions(mask_in, positions, query, key);
  // (..., L, E)·(..., E, S) → (..., L, S); scaling the smaller operand.
  auto scores = torch::matmul(query * scale, key.transpose(-2, -1));
  if (positions.relative_bias.defined()) {
    // (Hb, L, S): the heads' dim of 4-D scores, else Hb = 1 broadcasts.
    auto bias = dense_relative_bias(positions.relative_bias, query.size(-2),
                                    key.size(-2));
    scores = scores + (query.dim() == 4 ? bias : bias.squeeze(0));
  }
  torch::Tensor blocked_rows;  // (..., L, 1) true where every key is blocked
  if (mask.defined()) {
    auto blocked = mask.eq(kNegInf);  // broadcastable to (..., L, S)
    // Adding -inf to a score that overflowed to +inf would give NaN: blocked
    // positions are set to -inf, not added to.
    scores.add_(mask).masked_fill_(blocked, kNegInf);  // (..., L, S)
    auto rows = blocked.all(/*dim=*/-1, /*keepdim=*/true);
    // On CPU, asking whether any row is fully masked is cheap and saves two
    // passes over the scores; on an accelerator it would stall the stream.
    if (!query.device().is_cpu() || rows.any().item<bool>()) {
      // A fully masked row would be softmax(-inf, ..., -inf) = NaN. Give it
      // finite scores, then zero its weights: the output row is 0 and no
      // gradient flows into it.
      blocked_rows = rows;
      scores.masked_fill_(blocked_rows, 0.0);
    }
  }
  const bool half = dtype == torch::kHalf || dtype == torch::kBFloat16;
  auto weights = half ? torch::softmax(scores, /*dim=*/-1, torch::kFloat)
                            .to(dtype)  // accumulated in float32
                      : torch::softmax(scores, /*dim=*/-1);  // (..., L, S)
  if (blocked_rows.defined()) {
    weights = weights.masked_fill(blocked_rows, 0.0);
  }
  if (dropout_p > 0.0) {
    weights = torch::dropout(weights, dropout_p, /*train=*/true);
  }
  auto output = torch::matmul(weights, value);  // (..., L, S)·(..., S, Ev)
  return {output, shape_weights(weights, weights_mode)};
}

// ------------------------------------------------------- blocked attention ---
// Glossary here: N batch, H heads (the two leading dims of 4-D inputs), D and
// Dv the query/key and value features, B the query rows of one block.

namespace {

/// What every block of one call shares.
struct BlockedSpec {
  torch::Tensor mask;      // additive, 4-D broadcastable to (N, H, L, S), or {}
  torch::Tensor blocked;   // mask == -inf, same shape, or {}
  KeyPositions positions;  // its relative_bias travels as an input instead
  double scale = 1.0;
  WeightsMode weights = WeightsMode::kNone;
  int64_t block_rows = 0;
  // Keep every block's weights for backward instead of recomputing them.
  bool keep_weights = false;
};

/// The (n, h) slice of a tensor broadcastable to (N, H, ...).
torch::Tensor select_nh(const torch::Tensor& t, int64_t n, int64_t h) {
  return t.select(0, t.size(0) == 1 ? 0 : n).select(0, t.size(1) == 1 ? 0 : h);
}

/// Rows [row0, row0 + rows) and columns [col0, col0 + cols) of a mask slice
/// that may broadcast in either dim.
torch::Tensor mask_block(const torch::Tensor& m, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols) {
  auto r = m.size(0) == 1 ? m : m.narrow(0, row0, rows);
  return r.size(1) == 1 ? r : r.narrow(1, col0, cols);
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
    auto r = at::arange(rows, at::kLong).unsqueeze(1);
    auto c = at::arange(cols, at::kLong).unsqueeze(0);
    return c - r + bias_base();
  }
};

/// Writes into `p` (rows, cols) the attention weights of one block of one
/// head (bias_h: that head's relative_bias row, or undefined): scaled
/// scores, mask, position bias and limits, softmax, all in place; fully
/// masked rows become 0.
void block_weights(torch::Tensor& p, const torch::Tensor& q,
                   const torch::Tensor& k, const torch::Tensor& mask,
                   const torch::Tensor& blocked, const torch::Tensor& bias_h,
                   const BlockedSpec& spec, const Block& block) {
  // p = scale · q[rows] · k[cols]ᵀ (beta = 0: p's old contents are ignored)
  at::addmm_out(p, p, q.narrow(0, block.row0, block.rows),
                k.narrow(0, block.col0, block.cols).t(),
                /*beta=*/0, /*alpha=*/spec.scale);
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
    return;
  }
  if (bias_h.defined()) {
    p.add_(bias_h.take(block.bias_index()));
  }
  const bool limited = limits.begin(block.rows - 1, block.cols) > 0 ||
                       limits.end(0, block.cols) < block.cols;
  if (limited) {
    auto r = at::arange(block.rows, at::kLong).unsqueeze(1);  // (rows, 1)
    auto c = at::arange(block.cols, at::kLong).unsqueeze(0);  // (1, cols)
    auto begin = limits.begin_slides ? r + limits.begin0
                                     : at::full_like(r, limits.begin0);
    auto end =
        limits.end_slides ? r + limits.end0 : at::full_like(r, limits.end0);
    p.masked_fill_(c.lt(begin).logical_or_(c.ge(end)), kNegInf);
  }
  at::_softmax_out(p, p, /*dim=*/1, /*half_to_float=*/false);
  if (mask.defined() || limited) {
    // A fully masked row is softmax(-inf, ..., -inf) = NaN (and only such a
    // row, for finite inputs): it attends to nothing.
    auto empty_rows = p.select(1, 0).isnan();  // (rows)
    if (empty_rows.any().item<bool>()) {
      p.masked_fill_(empty_rows.unsqueeze(1), 0.0);
    }
  }
}

/// What blocked_forward returns.
struct BlockedForward {
  torch::Tensor output;   // (N, H, L, Dv)
  torch::Tensor weights;  // as spec.weights, or undefined
  torch::Tensor kept;     // (N, H, L, S) when spec.keep_weights, else {}
};

/// Row h (or 0 when shared by every head) of relative_bias (Hb, L + S - 1),
/// or undefined for the empty placeholder of no bias.
torch::Tensor bias_row(const torch::Tensor& relative_bias, int64_t h) {
  if (relative_bias.numel() == 0) {
    return torch::Tensor();
  }
  return relative_bias[relative_bias.size(0) == 1 ? 0 : h];
}

/// Forward of blocked attention on 4-D inputs: output (N, H, L, Dv) (a view
/// of an (N, L, H, Dv) buffer, so merging heads is free), weights as
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
  auto out = at::empty({N, L, H, Dv}, q.options());
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
        auto p = scratch.narrow(0, 0, rows * cols).view({rows, cols});
        for (auto h = h_begin; h < h_end; ++h) {
          // (rows, Dv), strided rows of the (N, L, H, Dv) buffer
          auto out_rows = out.select(0, n).select(1, h).narrow(0, row0, rows);
          if (cols == 0) {  // no row of the block sees any key
            out_rows.zero_();
            continue;
          }
          // (T, D); key/value head h / group
          const auto q_nh = q[n][h], k_nh = k[n][h / group],
                     v_nh = v[n][h / group];
          const auto mask = spec.mask.defined() ? select_nh(spec.mask, n, h)
                                                : torch::Tensor();
          const auto blocked = spec.mask.defined()
                                   ? select_nh(spec.blocked, n, h)
                                   : torch::Tensor();
          block_weights(p, q_nh, k_nh, mask, blocked,
                        bias_row(relative_bias, h), spec, block);
          at::mm_out(out_rows, p, v_nh.narrow(0, col0, cols));
          if (spec.keep_weights) {
            kept[n][h].narrow(0, row0, rows).narrow(1, col0, cols).copy_(p);
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
      });
  return {out.permute({0, 2, 1, 3}), weights, kept};
}

/// Gradients of blocked_backward.
struct BlockedGradients {
  torch::Tensor dq, dk, dv;
  torch::Tensor relative_bias;  // like relative_bias when it needs one
};

/// Backward of blocked_forward: gradients of q, k, v (and relative_bias when
/// it requires grad) from the gradient of the output (N, H, L, Dv) and, if
/// defined, of the weights. Each block's weights are taken from `kept`
/// (blocked_forward's, when defined) or recomputed; then dV += Pᵀ·dO,
/// dP = dO·Vᵀ (+ dW), dS = softmax'(P, dP), dQ = scale·dS·K,
/// dK += scale·dSᵀ·Q, and dS summed along its diagonals into the bias. A
/// work item is one n and key/value head: the blocks of its query heads add
/// into the same dK and dV.
BlockedGradients blocked_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec,
    const torch::Tensor& kept, const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights) {
  const auto N = q.size(0), H = q.size(1), L = q.size(2);
  const auto S = k.size(2), Hkv = k.size(1);
  const auto group = H / Hkv;  // query heads per key/value head
  const auto B = spec.block_rows;
  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::zeros(k.sizes(), k.options());
  auto dv = at::zeros(v.sizes(), v.options());
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
        const auto k_nh = k[n][h_kv], v_nh = v[n][h_kv];
        auto dk_nh = dk[n][h_kv], dv_nh = dv[n][h_kv];
        for (auto h = h_kv * group; h < (h_kv + 1) * group; ++h) {
          const auto q_nh = q[n][h];
          const auto mask = spec.mask.defined() ? select_nh(spec.mask, n, h)
                                                : torch::Tensor();
          const auto blocked = spec.mask.defined()
                                   ? select_nh(spec.blocked, n, h)
                                   : torch::Tensor();
          const auto bias_h = bias_row(relative_bias, h);
          const auto go_nh = grad_out[n][h];  // (L, Dv)
          auto dq_nh = dq[n][h];
          for (int64_t row0 = 0; row0 < L; row0 += B) {
            const Block block(spec.positions, row0, std::min(B, L - row0), L,
                              S);
            const auto rows = block.rows, col0 = block.col0, cols = block.cols;
            auto dq_rows = dq_nh.narrow(0, row0, rows);
            if (cols == 0) {  // the rows see no key
              dq_rows.zero_();
              continue;
            }
            auto buffer = [&](int64_t i) {
              return scratch.narrow(0, i * B * S, rows * cols)
                  .view({rows, cols});
            };
            auto p = buffer(0), dp = buffer(1), ds = buffer(2);
            if (kept.defined()) {
              // Copied: a block's rows are strided in `kept`, and ATen's
              // softmax backward below takes contiguous weights.
              p.copy_(kept[n][h].narrow(0, row0, rows).narrow(1, col0, cols));
            } else {
              block_weights(p, q_nh, k_nh, mask, blocked, bias_h, spec, block);
            }
            const auto go = go_nh.narrow(0, row0, rows);  // (rows, Dv)
            auto dv_cols = dv_nh.narrow(0, col0, cols);
            dv_cols.addmm_(p.t(), go);
            at::mm_out(dp, go, v_nh.narrow(0, col0, cols).t());
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
            if (d_bias.defined()) {
              d_bias[n][h].index_add_(0, block.bias_index().view(-1),
                                      ds.view(-1));
            }
            at::addmm_out(dq_rows, dq_rows, ds, k_nh.narrow(0, col0, cols),
                          /*beta=*/0, /*alpha=*/spec.scale);
            auto dk_cols = dk_nh.narrow(0, col0, cols);
            dk_cols.addmm_(ds.t(), q_nh.narrow(0, row0, rows), /*beta=*/1,
                           /*alpha=*/spec.scale);
          }
        }
      });
  if (d_bias.defined()) {
    d_bias = d_bias.sum(0);  // (H, L + S - 1)
    if (relative_bias.size(0) == 1) {
      d_bias = d_bias.sum(0, /*keepdim=*/true);  // (1, L + S - 1)
    }
  }
  return {dq, dk, dv, d_bias};
}

/// Autograd wrapper: saves the inputs, and the weights only when
/// spec.keep_weights.
class BlockedAttentionFunction
    : public torch::autograd::Function<BlockedAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
      const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& relative_bias, const BlockedSpec& spec) {
    ctx->save_for_backward({q, k, v, relative_bias});
    save_spec(ctx, spec);
    auto result = blocked_forward(q, k, v, relative_bias, spec);
    ctx->saved_data["kept"] =
        result.kept.defined() ? c10::IValue(result.kept) : c10::IValue();
    if (!result.weights.defined()) {
      return {result.output};
    }
    return {result.output, result.weights};
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& q = saved[0];
    const auto& v = saved[2];
    auto grad_out =
        grads[0].defined()
            ? grads[0]
            : at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)},
                        q.options());
    const auto grad_weights = grads.size() > 1 ? grads[1] : torch::Tensor();
    const auto& kept = ctx->saved_data.at("kept");
    auto g = blocked_backward(q, saved[1], v, saved[3], load_spec(ctx),
                              kept.isNone() ? torch::Tensor() : kept.toTensor(),
                              grad_out, grad_weights);
    return {g.dq, g.dk, g.dv, g.relative_bias, torch::Tensor()};
  }

 private:
  // The spec rides along in the context's saved_data (IValues). Its masks
  // need no gradient, so they are kept there rather than saved as variables.
  static void save_spec(torch::autograd::AutogradContext* ctx,
                        const BlockedSpec& spec) {
    auto& data = ctx->saved_data;
    auto tensor_or_none = [](const torch::Tensor& t) {
      return t.defined() ? c10::IValue(t) : c10::IValue();
    };
    data["mask"] = tensor_or_none(spec.mask);
    data["blocked"] = tensor_or_none(spec.blocked);
    data["causal"] = spec.positions.causal;
    data["diagonal"] = spec.positions.diagonal;
    data["window"] = spec.positions.window;
    data["scale"] = spec.scale;
    data["weights"] = static_cast<int64_t>(spec.weights);
    data["block_rows"] = spec.block_rows;
    data["keep_weights"] = spec.keep_weights;
  }

  static BlockedSpec load_spec(torch::autograd::AutogradContext* ctx) {
    const auto& data = ctx->saved_data;
    auto tensor_of = [&](const char* name) {
      const auto& value = data.at(name);
      return value.isNone() ? torch::Tensor() : value.toTensor();
    };
    BlockedSpec spec;
    spec.mask = tensor_of("mask");
    spec.blocked = tensor_of("blocked");
    spec.positions.causal = data.at("causal").toBool();
    spec.positions.diagonal = data.at("diagonal").toInt();
    spec.positions.window = data.at("window").toInt();
    spec.scale = data.at("scale").toDouble();
    spec.weights = static_cast<WeightsMode>(data.at("weights").toInt());
    spec.block_rows = data.at("block_rows").toInt();
    spec.keep_weights = data.at("keep_weights").toBool();
    return spec;
  }
};

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

#if AT_PARALLEL_OPENMP && !defined(_OPENMP)
// at::parallel_for is inline: with ATen's OpenMP backend it runs in parallel
// only in a translation unit compiled with OpenMP (CMakeLists.txt does that
// where the compiler has it).
constexpr bool kParallelFor = false;
#else
constexpr bool kParallelFor = true;
#endif

int64_t for_each_item(
    int64_t items, int64_t scratch_elements,
    const torch::TensorOptions& options,
    const std::function<void(int64_t, torch::Tensor&)>& body) {
  const int64_t threads = at::get_num_threads();
  const bool parallel = kParallelFor && threads > 1 && items >= threads &&
                        !at::in_parallel_region() &&
                        SingleThreadedBlas::available();
  if (!parallel) {
    auto scratch = at::empty({scratch_elements}, options);
    for (int64_t item = 0; item < items; ++item) {
      body(item, scratch);
    }
    return 1;
  }
  SingleThreadedBlas single_threaded_blas;
  const at::ThreadLocalState caller_state;
  at::parallel_for(0, threads, /*grain_size=*/1,
                   [&](int64_t begin, int64_t end) {
                     at::ThreadLocalStateGuard state_guard(caller_state);
                     auto scratch = at::empty({scratch_elements}, options);
                     for (int64_t t = begin; t < end; ++t) {
                       for (int64_t item = t; item < items; item += threads) {
                         body(item, scratch);
                       }
                     }
                   });
  return threads;
}

bool blocked_attention_applies(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& mask, double dropout_p) {
  const auto dtype = query.scalar_type();
  return query.device().is_cpu() &&
         (dtype == torch::kFloat32 || dtype == torch::kFloat64) &&
         dropout_p == 0.0 && query.dim() >= 2 && query.dim() <= 4 &&
         query.size(-2) > 0 && key.size(-2) > 0 &&
         (!mask.defined() || !mask.requires_grad());
}

AttentionResult blocked_attention(const torch::Tensor& query,
                                  const torch::Tensor& key,
                                  const torch::Tensor& value,
                                  const torch::Tensor& mask,
                                  const KeyPositions& positions, double scale,
                                  WeightsMode weights, int64_t block_rows,
                                  KeptWeights kept) {
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
  if (kept == KeptWeights::kAuto) {
    // Keeping the weights saves backward a third of its work (the scores'
    // GEMM and softmax again); worth its memory while that is small. Without
    // a gradient to compute nothing is kept.
    // Measured with mha-bench at (2,128,256,4): forward 0.87-0.90 of
    // torch::nn with the weights kept vs 0.95 through autograd of the
    // batched ops (the path small problems took before), forward+backward
    // unchanged; at (8,256,512,8) keeping 16 MiB gained nothing clear.
    constexpr int64_t kKeepScores = int64_t{1} << 20;
    spec.keep_weights =
        needs_grad &&
        query.numel() / std::max<int64_t>(1, query.size(-1)) * S <= kKeepScores;
  } else {
    spec.keep_weights = kept == KeptWeights::kAlways;
  }
  // LibTorch 1.13's custom functions take no undefined inputs: no bias is
  // an empty placeholder there.
  auto outputs = BlockedAttentionFunction::apply(
      to_4d(query), to_4d(key), to_4d(value),
      bias.defined() ? bias.contiguous() : at::empty({0}, query.options()),
      spec);
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

AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key_in,
                               const torch::Tensor& value_in,
                               const torch::Tensor& mask,
                               const KeyPositions& positions, double dropout_p,
                               double scale, WeightsMode weights) {
  const bool grouped = query.dim() == 4 && key_in.size(1) != query.size(1);
  TORCH_INTERNAL_ASSERT(!grouped || query.size(1) % key_in.size(1) == 0,
                        "attention_core: key/value heads must divide query's");
  const bool blocked =
      blocked_attention_applies(query, key_in, mask, dropout_p);
  if (grouped && blocked) {
    // The blocked path reads key/value head h / group for query head h.
    return blocked_attention(query, key_in, value_in, mask, positions, scale,
                             weights);
  }
  // Elsewhere each query head gets its key/value head, copied.
  const auto key = grouped ? repeat_kv(key_in, query.size(1)) : key_in;
  const auto value = grouped ? repeat_kv(value_in, query.size(1)) : value_in;
#if MHA_HAS_FUSED_SDPA
  if (weights == WeightsMode::kNone && positions.plain()) {
    // LibTorch refuses is_causal together with a mask: merge them then.
    const bool merge = positions.causal && mask.defined();
    auto fused_mask =
        merge ? with_positions(mask, positions, query, key) : mask;
    auto output = fused_sdpa(query, key, value, fused_mask, dropout_p,
                             positions.causal && !merge, scale);
    // The fused kernel adds the mask to the scores, so a score that
    // overflowed to +inf at a blocked key turns into NaN, where mha's
    // semantics say a blocked key changes nothing. On CPU such a (rare)
    // result is recomputed below; on an accelerator the check would stall
    // the stream, so there the fused result stands.
    if (!query.device().is_cpu() || !output.isnan().any().item<bool>()) {
      return {output, torch::Tensor()};
    }
  }
#endif
  if (blocked) {
    return blocked_attention(query, key, value, mask, positions, scale,
                             weights);
  }
  return explicit_attention(query, key, value, mask, positions, dropout_p,
                            scale, weights);
}

torch::Tensor key_positions_mask(const KeyPositions& positions, int64_t L,
                                 int64_t S,
                                 const torch::TensorOptions& options) {
  if (!positions.causal && positions.window == 0) {
    return torch::Tensor();
  }
  const auto index = torch::TensorOptions(options).dtype(torch::kLong);
  auto i = torch::arange(L, index).unsqueeze(1);  // (L, 1)
  auto j = torch::arange(S, index).unsqueeze(0);  // (1, S)
  // Visible: begin(i) <= j < end(i), as KeyPositions defines.
  auto blocked = j.lt(i + positions.begin(0))
                     .logical_or_(j.ge(i + positions.end(0)));  // (L, S)
  return torch::zeros({L, S}, options)
      .masked_fill_(blocked, -std::numeric_limits<double>::infinity());
}

torch::Tensor dense_relative_bias(const torch::Tensor& relative_bias, int64_t L,
                                  int64_t S) {
  const auto index = relative_bias.options().dtype(torch::kLong);
  auto i = torch::arange(L, index).unsqueeze(1);  // (L, 1)
  auto j = torch::arange(S, index).unsqueeze(0);  // (1, S)
  auto diagonal = (j - i + (L - 1)).view(-1);     // (L·S)
  return relative_bias.index_select(1, diagonal)
      .view({relative_bias.size(0), L, S});  // (Hb, L, S)
}

void check_broadcastable(const torch::Tensor& mask, const char* name,
                         torch::IntArrayRef target, const char* target_name) {
  const auto mask_dims = static_cast<int64_t>(mask.dim());
  const auto target_dims = static_cast<int64_t>(target.size());
  bool ok = mask_dims <= target_dims;
  for (int64_t i = 1; ok && i <= mask_dims; ++i) {
    const auto m = mask.size(mask_dims - i);
    ok = m == 1 || m == target[target_dims - i];
  }
  TORCH_CHECK(ok, name, " must be broadcastable to ", target_name, " = ",
              target, ", but got ", mask.sizes());
}

}  // namespace detail

namespace {

void check_sdpa_inputs(const torch::Tensor& query, const torch::Tensor& key,
                       const torch::Tensor& value, double dropout_p) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(),
              "scaled_dot_product_attention: query, key and value must all be "
              "defined");
  TORCH_CHECK(query.dim() >= 2,
              "scaled_dot_product_attention: query must be (..., L, E) with at "
              "least 2 dims, but got ",
              query.sizes());
  TORCH_CHECK(key.dim() == query.dim() && value.dim() == query.dim(),
              "scaled_dot_product_attention: key and value must have query's ",
              query.dim(), " dims, but got key ", key.sizes(), " and value ",
              value.sizes());
  const auto lead = query.sizes().slice(0, query.dim() - 2);
  TORCH_CHECK(key.sizes().slice(0, key.dim() - 2) == lead &&
                  value.sizes().slice(0, value.dim() - 2) == lead,
              "scaled_dot_product_attention: key and value must have query's "
              "leading dims ",
              lead, ", but got query ", query.sizes(), ", key ", key.sizes(),
              ", value ", value.sizes());
  TORCH_CHECK(key.size(-1) == query.size(-1),
              "scaled_dot_product_attention: key must be (..., S, E) with "
              "query's E = ",
              query.size(-1), ", but got ", key.sizes());
  TORCH_CHECK(value.size(-2) == key.size(-2),
              "scaled_dot_product_attention: value must be (..., S, Ev) with "
              "key's S = ",
              key.size(-2), ", but got ", value.sizes());
  TORCH_CHECK(torch::isFloatingType(query.scalar_type()),
              "scaled_dot_product_attention: query must be floating, but got "
              "dtype ",
              query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "scaled_dot_product_attention: key and value must have query's "
              "dtype ",
              query.scalar_type(), ", but got key ", key.scalar_type(),
              " and value ", value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      "scaled_dot_product_attention: key and value must be on query's "
      "device ",
      query.device(), ", but got key on ", key.device(), " and value on ",
      value.device());
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0,
              "scaled_dot_product_attention: dropout_p must be in [0, 1), but "
              "got ",
              dropout_p);
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> scaled_dot_product_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& attn_mask,
    double dropout_p, bool is_causal, c10::optional<double> scale,
    bool need_weights) {
  check_sdpa_inputs(query, key, value, dropout_p);
  const int64_t S = key.size(-2);
  const int64_t E = query.size(-1);
  check_mask(attn_mask, "attn_mask", query.scalar_type(), query.device());
  if (attn_mask.defined()) {
    auto target = query.sizes().vec();  // (..., L, S)
    target.back() = S;
    detail::check_broadcastable(attn_mask, "attn_mask", target, "(..., L, S)");
  }
  const double scale_value =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
  TORCH_CHECK(std::isfinite(scale_value),
              "scaled_dot_product_attention: scale must be finite, but got ",
              scale_value);
  // One additive mask; merge_masks turns a bool mask into 0 / -inf.
  auto mask = merge_masks({attn_mask}, query.scalar_type());
  auto result = detail::attention_core(
      query, key, value, mask, is_causal, dropout_p, scale_value,
      need_weights ? detail::WeightsMode::kPerHead
                   : detail::WeightsMode::kNone);
  return {result.output, result.weights};
}

ScaledDotProductAttentionImpl::ScaledDotProductAttentionImpl(
    const ScaledDotProductAttentionOptions& options_)
    : options(options_) {
  reset();
}

void ScaledDotProductAttentionImpl::reset() {
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "ScaledDotProductAttention: dropout must be in [0, 1), but got ",
              options.dropout());
}

std::tuple<torch::Tensor, torch::Tensor> ScaledDotProductAttentionImpl::forward(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& attn_mask, bool is_causal,
    bool need_weights) {
  const double p = is_training() ? options.dropout() : 0.0;
  return scaled_dot_product_attention(query, key, value, attn_mask, p,
                                      is_causal, options.scale(), need_weights);
}

void ScaledDotProductAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << "mha::ScaledDotProductAttention(";
  const char* sep = "";
  if (options.dropout() != 0.0) {
    stream << "dropout=" << options.dropout();
    sep = ", ";
  }
  if (options.scale().has_value()) {
    stream << sep << "scale=" << *options.scale();
  }
  stream << ")";
}

}  // namespace mha
