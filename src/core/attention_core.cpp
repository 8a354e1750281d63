// The attention core (attention_core.h): the decision which path computes a
// call (choose_path), the explicit path, and the dense forms of the position
// limits and biases that the explicit path uses. The blocked path lives in
// blocked_attention.cpp; the fused one is LibTorch's (compat.h).
//
// Glossary: N batch, H query heads, Hkv key/value heads, L target (query)
// length, S source (key) length, E query/key feature size, Ev value feature
// size, "..." any leading (batch, head) dims.
#include "core/attention_core.h"

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include <algorithm>
#include <limits>
#include <vector>

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

namespace {

/// int64 (sizes) of t's dtype kLong holding 0..n-1 along dim `dim` of a
/// `dims`-D tensor, size 1 elsewhere: index tensors for a mod.
torch::Tensor index_along(int64_t n, int64_t dim, int64_t dims,
                          const torch::Device& device) {
  std::vector<int64_t> shape(dims, 1);
  shape[dim] = n;
  return torch::arange(n, torch::TensorOptions(device).dtype(torch::kLong))
      .view(shape);
}

/// bool (N, H, L, S): true where the block mask lets query i of batch n and
/// head h see key j: its block is full, or partial and mask_mod allows (as
/// Python, mask_mod sees the call's n and h; the mask's B or H of size 1
/// broadcasts).
torch::Tensor dense_block_mask(const BlockMask& mask, int64_t N, int64_t H,
                               const torch::Device& device) {
  const auto L = mask.q_len, S = mask.kv_len;
  auto expand_blocks = [&](const torch::Tensor& blocks) {  // (Bm, Hm, nq, nkv)
    return blocks.to(device)
        .repeat_interleave(mask.block_q, 2)
        .narrow(2, 0, L)
        .repeat_interleave(mask.block_kv, 3)
        .narrow(3, 0, S);  // (Bm, Hm, L, S)
  };
  BlockMask partial = mask;
  partial.full_kv_num_blocks = torch::Tensor();
  partial.full_kv_indices = torch::Tensor();
  auto visited_partial = expand_blocks(partial.to_dense());
  auto allowed = call_mask_mod(
      mask.mask_mod, index_along(N, 0, 4, device), index_along(H, 1, 4, device),
      index_along(L, 2, 4, device), index_along(S, 3, 4, device), {N, H, L, S});
  allowed = allowed.logical_and(visited_partial);
  if (mask.full_kv_num_blocks.defined()) {
    BlockMask full = mask;
    full.kv_num_blocks = mask.full_kv_num_blocks;
    full.kv_indices = mask.full_kv_indices;
    full.full_kv_num_blocks = torch::Tensor();
    full.full_kv_indices = torch::Tensor();
    allowed = allowed.logical_or(expand_blocks(full.to_dense()));
  }
  return allowed;
}

}  // namespace

AttentionResult explicit_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& mask_in,
    const KeyPositions& positions, double dropout_p, double scale,
    WeightsMode weights_mode, const FlexMods* flex) {
  const auto dtype = query.scalar_type();
  const bool is_flex = flex != nullptr && flex->active();
  // broadcastable to (..., L, S)
  auto mask = with_positions(mask_in, positions, query, key);
  torch::Tensor blocked;       // broadcastable to (..., L, S): mask == -inf
  torch::Tensor blocked_rows;  // (..., L, 1) true where every key is blocked
  if (mask.defined() && !is_flex) {
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
  if (is_flex) {
    // (N, H, L, S): score_mod on every score, then the masks; a row whose
    // every score ends -inf (masked, or so modified) is fully masked, as
    // in Python's FlexAttention.
    const auto device = query.device();
    const auto N = query.size(0), H = query.size(1);
    const auto L = query.size(2), S = key.size(2);
    if (flex->score_mod) {
      scores = call_score_mod(
          flex->score_mod, scores, index_along(N, 0, 4, device),
          index_along(H, 1, 4, device), index_along(L, 2, 4, device),
          index_along(S, 3, 4, device));
    }
    if (mask.defined()) {
      // -inf set, not added (a +inf score would give NaN).
      scores = scores.add(mask).masked_fill(mask.eq(kNegInf), kNegInf);
    }
    if (!flex->block_mask.empty()) {
      scores = scores.masked_fill(
          dense_block_mask(flex->block_mask, N, H, device).logical_not(),
          kNegInf);
    }
    blocked_rows = scores.eq(kNegInf).all(/*dim=*/-1, /*keepdim=*/true);
  } else if (mask.defined()) {
    // Adding -inf to a score that overflowed to +inf would give NaN: blocked
    // positions are set to -inf, not added to.
    scores.add_(mask).masked_fill_(blocked, kNegInf);  // (..., L, S)
  }
  const bool half = dtype == torch::kHalf || dtype == torch::kBFloat16;
  torch::Tensor lse;
  if (is_flex && flex->return_lse) {
    // (N, H, L): float32 for float16/bfloat16, as Python's; differentiable
    // (a fully masked row's scores made finite first: it gets -inf and no
    // gradient, never NaN).
    const auto finite =
        blocked_rows.defined() ? scores.masked_fill(blocked_rows, 0.0) : scores;
    lse = (half ? finite.to(torch::kFloat) : finite).logsumexp(/*dim=*/-1);
    if (blocked_rows.defined()) {
      lse = lse.masked_fill(blocked_rows.squeeze(-1), kNegInf);
    }
  }
  if (blocked_rows.defined()) {
    // A fully masked row would be softmax(-inf, ..., -inf) = NaN. Give it
    // finite scores, then zero its weights: the output row is 0 and no
    // gradient flows into it.
    scores = scores.masked_fill(blocked_rows, 0.0);
  }
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
  return {output, shape_weights(weights, weights_mode), lse};
}

// ----------------------------------------------------------- flex's mods ---

std::vector<torch::Tensor> flex_captured_leaves(
    const ScoreMod& score_mod, const torch::TensorOptions& options) {
  std::vector<torch::Tensor> leaves;
  if (!score_mod || !torch::GradMode::is_enabled()) {
    return leaves;
  }
  const auto index = torch::zeros({}, options.dtype(torch::kLong));
  const auto score = torch::zeros({1}, options).requires_grad_();
  const auto probe =
      call_score_mod(score_mod, score, index, index, index, index);
  // Every leaf the result's graph reaches, but the score itself.
  std::vector<torch::autograd::Node*> stack;
  std::vector<const torch::autograd::Node*> seen;
  if (probe.grad_fn()) {
    stack.push_back(probe.grad_fn().get());
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (std::find(seen.begin(), seen.end(), node) != seen.end()) {
      continue;
    }
    seen.push_back(node);
    if (auto* accumulate =
            dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const auto& leaf = accumulate->variable;
      if (!leaf.is_same(score)) {
        leaves.push_back(leaf);
      }
      continue;
    }
    for (const auto& edge : node->next_edges()) {
      if (edge.function) {
        stack.push_back(edge.function.get());
      }
    }
  }
  return leaves;
}

torch::Tensor call_score_mod(const ScoreMod& score_mod,
                             const torch::Tensor& score, const torch::Tensor& b,
                             const torch::Tensor& h, const torch::Tensor& q_idx,
                             const torch::Tensor& kv_idx) {
  torch::Tensor result;
  try {
    result = score_mod(score, b, h, q_idx, kv_idx);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flex_attention: score_mod threw: ", e.what());
  }
  TORCH_CHECK(result.defined(),
              "flex_attention: score_mod returned an undefined tensor; "
              "expected the modified scores, broadcastable to ",
              score.sizes());
  TORCH_CHECK(result.is_floating_point(),
              "flex_attention: score_mod returned a tensor of dtype ",
              result.scalar_type(), "; expected a floating score (",
              score.scalar_type(), ")");
  std::vector<int64_t> target = score.sizes().vec();
  check_broadcastable(result, "flex_attention: score_mod's result", target,
                      "the scores' shape");
  if (result.scalar_type() != score.scalar_type()) {
    result = result.to(score.scalar_type());
  }
  return result.sizes() == score.sizes() ? result : result.expand(target);
}

torch::Tensor call_mask_mod(const MaskMod& mask_mod, const torch::Tensor& b,
                            const torch::Tensor& h, const torch::Tensor& q_idx,
                            const torch::Tensor& kv_idx,
                            torch::IntArrayRef shape) {
  TORCH_CHECK(bool(mask_mod),
              "flex_attention: the block mask has no mask_mod (an empty "
              "function) but partial blocks");
  torch::Tensor result;
  try {
    result = mask_mod(b, h, q_idx, kv_idx);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flex_attention: mask_mod threw: ", e.what());
  }
  TORCH_CHECK(result.defined(),
              "flex_attention: mask_mod returned an undefined tensor; "
              "expected bool, broadcastable to ",
              shape);
  TORCH_CHECK(result.scalar_type() == torch::kBool,
              "flex_attention: mask_mod returned a tensor of dtype ",
              result.scalar_type(), "; expected bool (true = may attend)");
  check_broadcastable(result, "flex_attention: mask_mod's result", shape,
                      "the block's shape");
  return result.expand(shape);
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

bool half_through_float32_applies(const AttentionCall& call) {
  const bool half =
      call.dtype == torch::kBFloat16 || call.dtype == torch::kHalf;
  AttentionCall as_float32 = call;
  as_float32.dtype = torch::kFloat32;
  return half && blocked_applies(as_float32);
}

namespace {

/// attention_core for a bfloat16 / float16 call on the CPU, through the
/// blocked float32 core: query, key, value, a float mask and the relative
/// bias converted to float32 (differentiably: gradients come back in the
/// input's dtype, accumulated in float32), the output and weights converted
/// back; lse stays float32, as the explicit path's and Python's. (No
/// `packed`: the converted inputs are views of no common tensor.)
AttentionResult half_through_float32(const torch::Tensor& query,
                                     const torch::Tensor& key,
                                     const torch::Tensor& value,
                                     const torch::Tensor& mask,
                                     const KeyPositions& positions,
                                     double scale, WeightsMode weights,
                                     const FlexMods* flex) {
  const auto dtype = query.scalar_type();
  auto to_float = [](const torch::Tensor& t) {
    return t.defined() && t.is_floating_point() ? t.to(torch::kFloat) : t;
  };
  KeyPositions positions32 = positions;
  positions32.relative_bias = to_float(positions.relative_bias);
  auto result = attention_core(to_float(query), to_float(key), to_float(value),
                               to_float(mask), positions32, /*dropout_p=*/0.0,
                               scale, weights, /*packed=*/{}, flex);
  result.output = result.output.to(dtype);
  if (result.weights.defined()) {
    result.weights = result.weights.to(dtype);
  }
  return result;
}

}  // namespace

AttentionResult attention_core(
    const torch::Tensor& query, const torch::Tensor& key_in,
    const torch::Tensor& value_in, const torch::Tensor& mask,
    const KeyPositions& positions, double dropout_p, double scale,
    WeightsMode weights, const torch::Tensor& packed, const FlexMods* flex_in) {
  auto call =
      AttentionCall::of(query, key_in, mask, positions, dropout_p, weights);
  // bfloat16 / float16 on the CPU: the blocked core in float32 where
  // LibTorch's fused kernel does not take the call (it computes in the half
  // dtype natively where it does, LibTorch 2.x).
  if (half_through_float32_applies(call) &&
      ((flex_in != nullptr && flex_in->active()) ||
       choose_path(call) == AttentionPath::kExplicit)) {
    return half_through_float32(query, key_in, value_in, mask, positions, scale,
                                weights, flex_in);
  }
  if (flex_in != nullptr && flex_in->active()) {
    // LibTorch's kernel has no place for the mods: blocked, else explicit.
    FlexMods flex = *flex_in;
    flex.captured = flex_captured_leaves(flex.score_mod, query.options());
    if (blocked_applies(call) && query.dim() == 4) {
      last_path = AttentionPath::kBlocked;
      return blocked_attention(query, key_in, value_in, mask, positions, scale,
                               weights, /*block_rows=*/0, KeptWeights::kNever,
                               packed, &flex);
    }
    last_path = AttentionPath::kExplicit;
    const auto heads = query.size(1);
    auto copied = [&](const torch::Tensor& t) {
      return t.size(1) != heads ? repeat_kv(t, heads) : t;
    };
    return explicit_attention(query, copied(key_in), copied(value_in), mask,
                              positions, dropout_p, scale, weights, &flex);
  }
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
      return {output, torch::Tensor(), torch::Tensor()};
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
