// The attention core (attention_core.h): the decision which path computes a
// call (choose_path), the explicit path, and the dense forms of the position
// limits and biases that the explicit path uses. The blocked path lives in
// blocked_attention.cpp; the fused one is LibTorch's (compat.h).
//
// Glossary: N batch, H query heads, Hkv key/value heads, L target (query)
// length, S source (key) length, E query/key feature size, Ev value feature
// size, "..." any leading (batch, head) dims.
#include "core/attention_core.h"

#include <algorithm>
#include <limits>

#include "compat.h"
#include "mha/masks.h"

namespace mha::detail {
namespace {

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
  torch::Tensor blocked;       // broadcastable to (..., L, S): mask == -inf
  torch::Tensor blocked_rows;  // (..., L, 1) true where every key is blocked
  if (mask.defined()) {
    blocked = mask.eq(kNegInf);
    auto rows = blocked.all(/*dim=*/-1, /*keepdim=*/true);
    // On CPU, asking whether any row is fully masked is cheap and saves
    // passes over the scores; on an accelerator it would stall the stream.
    if (!query.device().is_cpu() || rows.any().item<bool>()) {
      blocked_rows = rows;
    }
  }
  // A fully masked row's query takes no part: its gradient is 0 and a
  // non-finite value there reaches no other gradient (such as dK). Which
  // rows these are follows from the mask alone, never from the data.
  auto q = blocked_rows.defined() ? query.masked_fill(blocked_rows, 0.0)
                                  : query;  // (..., L, E)
  // (..., L, E)·(..., E, S) → (..., L, S); scaling the smaller operand.
  auto scores = torch::matmul(q * scale, key.transpose(-2, -1));
  if (positions.relative_bias.defined()) {
    // (Hb, L, S): the heads' dim of 4-D scores, else Hb = 1 broadcasts.
    auto bias = dense_relative_bias(positions.relative_bias, query.size(-2),
                                    key.size(-2));
    scores = scores + (query.dim() == 4 ? bias : bias.squeeze(0));
  }
  if (mask.defined()) {
    // Adding -inf to a score that overflowed to +inf would give NaN: blocked
    // positions are set to -inf, not added to.
    scores.add_(mask).masked_fill_(blocked, kNegInf);  // (..., L, S)
  }
  if (blocked_rows.defined()) {
    // A fully masked row would be softmax(-inf, ..., -inf) = NaN. Give it
    // finite scores, then zero its weights: the output row is 0 and no
    // gradient flows into it.
    scores.masked_fill_(blocked_rows, 0.0);
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
  if (blocked_rows.defined()) {
    // 0 · (a non-finite value) would be NaN: a fully masked row is 0.
    output = output.masked_fill(blocked_rows, 0.0);  // (..., L, Ev)
  }
  return {output, shape_weights(weights, weights_mode)};
}

// ------------------------------------------------------------ the dispatch ---

const char* to_string(AttentionPath path) {
  switch (path) {
    case AttentionPath::kFused:
      return "fused";
    case AttentionPath::kBlocked:
      return "blocked";
    case AttentionPath::kExplicit:
      return "explicit";
  }
  return "?";
}

int64_t score_count(const torch::Tensor& query, int64_t key_length) {
  return query.numel() / std::max<int64_t>(1, query.size(-1)) * key_length;
}

AttentionCall AttentionCall::of(const torch::Tensor& query,
                                const torch::Tensor& key,
                                const torch::Tensor& mask,
                                const KeyPositions& positions, double dropout_p,
                                WeightsMode weights) {
  AttentionCall call;
  call.device = query.device().type();
  call.dtype = query.scalar_type();
  call.dims = query.dim();
  call.query_length = query.size(-2);
  call.key_length = key.size(-2);
  call.scores = score_count(query, call.key_length);
  call.grouped = query.dim() == 4 && key.size(1) != query.size(1);
  call.dropout_p = dropout_p;
  call.weights = weights;
  call.plain_positions = positions.plain();
  call.mask_requires_grad = mask.defined() && mask.requires_grad();
  return call;
}

bool fused_applies(const AttentionCall& call) {
  const bool built_with_fused = call.fused_available;
  const bool no_weights_asked = call.weights == WeightsMode::kNone;
  const bool no_position_limits_or_bias = call.plain_positions;
  return built_with_fused && no_weights_asked && no_position_limits_or_bias;
}

bool blocked_applies(const AttentionCall& call) {
  const bool on_cpu = call.device == torch::kCPU;
  const bool float32_or_64 =
      call.dtype == torch::kFloat32 || call.dtype == torch::kFloat64;
  const bool no_dropout = call.dropout_p == 0.0;
  const bool two_to_four_dims = call.dims >= 2 && call.dims <= 4;
  const bool nonempty = call.query_length > 0 && call.key_length > 0;
  const bool constant_mask = !call.mask_requires_grad;
  return on_cpu && float32_or_64 && no_dropout && two_to_four_dims &&
         nonempty && constant_mask;
}

AttentionPath choose_path(const AttentionCall& call) {
  // The first path that applies, in this order:
  // 1. blocked, for grouped key/value heads: it reads key/value head
  //    h / (H / Hkv) in place, where the others need each copied per query
  //    head (repeat_kv); and for small and large calls
  //    (kBlockedFirstScores, kBlockedLargeScores), and for calls of at
  //    most kInOrderKeys keys where BLAS's workers spin, and for float32
  //    calls whose items run on OpenBLAS's threads, where it was measured
  //    faster than the fused kernel;
  // 2. fused: LibTorch's kernel, the fastest where it meets the semantics
  //    (on CPU: at the sizes between those two);
  // 3. blocked;
  // 4. explicit, which takes every input.
  const bool small = call.scores <= kBlockedFirstScores;
  const bool large = call.scores >= kBlockedLargeScores;
  const bool in_order =
      call.blas_workers_spin && call.key_length <= kInOrderKeys;
  const bool on_openblas =
      call.items_on_openblas && call.dtype == torch::kFloat32;
  if ((call.grouped || small || large || in_order || on_openblas) &&
      blocked_applies(call)) {
    return AttentionPath::kBlocked;
  }
  if (fused_applies(call)) {
    return AttentionPath::kFused;
  }
  if (blocked_applies(call)) {
    return AttentionPath::kBlocked;
  }
  return AttentionPath::kExplicit;
}

namespace {

thread_local AttentionPath last_path = AttentionPath::kExplicit;

}  // namespace

AttentionPath last_attention_path() { return last_path; }

AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key_in,
                               const torch::Tensor& value_in,
                               const torch::Tensor& mask,
                               const KeyPositions& positions, double dropout_p,
                               double scale, WeightsMode weights,
                               const torch::Tensor& packed) {
  auto call =
      AttentionCall::of(query, key_in, mask, positions, dropout_p, weights);
  TORCH_INTERNAL_ASSERT(!call.grouped || query.size(1) % key_in.size(1) == 0,
                        "attention_core: key/value heads must divide query's");
  // Paths other than blocked get each query head its key/value head, copied.
  auto copied_heads = [&](const torch::Tensor& t) {
    return call.grouped ? repeat_kv(t, query.size(1)) : t;
  };
  auto path = choose_path(call);
  if (path == AttentionPath::kFused) {
#if MHA_HAS_FUSED_SDPA
    const auto key = copied_heads(key_in);
    const auto value = copied_heads(value_in);
    // LibTorch refuses is_causal together with a mask: merge them then.
    const bool merge = positions.causal && mask.defined();
    auto fused_mask =
        merge ? with_positions(mask, positions, query, key) : mask;
    auto output = fused_sdpa(query, key, value, fused_mask, dropout_p,
                             positions.causal && !merge, scale);
    // The fused kernel adds the mask to the scores, so a score that
    // overflowed to +inf at a blocked key turns into NaN, where mha's
    // semantics say a blocked key changes nothing. On CPU such a (rare)
    // result is recomputed on the path chosen without the fused kernel; on
    // an accelerator the check would stall the stream, so there the fused
    // result stands. The check is one sum: NaN wherever an entry is (and
    // where infinities of both signs meet, entries or partial sums that
    // overflowed: a recomputation then only repeats the result); 4-5x cheaper
    // than isnan().any() (LibTorch 2.14, 2 threads: 0.26 against 1.39 ms for
    // 2^20 float32 entries).
    if (!query.device().is_cpu() || !at::isnan(output.sum()).item<bool>()) {
      last_path = AttentionPath::kFused;
      return {output, torch::Tensor()};
    }
#endif
    call.fused_available = false;
    path = choose_path(call);
  }
  last_path = path;
  switch (path) {
    case AttentionPath::kBlocked:
      // Grouped heads are read in place (see choose_path).
      return blocked_attention(query, key_in, value_in, mask, positions, scale,
                               weights, /*block_rows=*/0, KeptWeights::kAuto,
                               packed);
    case AttentionPath::kExplicit:
      return explicit_attention(query, copied_heads(key_in),
                                copied_heads(value_in), mask, positions,
                                dropout_p, scale, weights);
    case AttentionPath::kFused:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "attention_core: no path for this call");
}

// ----------------------------------------- dense position limits and bias ---

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

torch::Tensor relative_bias_index(int64_t rows, int64_t cols, int64_t offset,
                                  torch::Device device) {
  const auto options = at::TensorOptions(device).dtype(at::kLong);
  auto r = at::arange(rows, options).unsqueeze(1);  // (rows, 1)
  auto c = at::arange(cols, options).unsqueeze(0);  // (1, cols)
  return c - r + offset;                            // (rows, cols)
}

torch::Tensor dense_relative_bias(const torch::Tensor& relative_bias, int64_t L,
                                  int64_t S) {
  const auto diagonal = relative_bias_index(L, S, L - 1, relative_bias.device())
                            .view(-1);  // (L·S)
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

}  // namespace mha::detail
