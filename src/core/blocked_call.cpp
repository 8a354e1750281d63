// The blocked path's entry (attention_core.h: blocked_attention): the spec
// of one call (block rows, where its work items run, whether forward keeps
// the weights, the fully masked rows, FlexAttention's mods), then the
// autograd wrapper (blocked_autograd.cpp) over the two forms
// (blocked_attention.cpp, one_block_attention.cpp).
//
// Glossary: N batch, H heads, L target (query) length, S source (key)
// length, D and Dv the query/key and value features.
#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "core/blocked_attention.h"

namespace mha::detail {

Block::Block(const BlockedSpec& spec, int64_t n, int64_t h, int64_t row0_,
             int64_t rows_, int64_t L_, int64_t S)
    : Block(spec.positions, row0_, rows_, L_, S) {
  if (spec.flex == nullptr || spec.flex->block_mask.empty() || cols == 0) {
    return;
  }
  const auto& mask = spec.flex->block_mask;
  const auto first = col0, last = col0 + cols;
  spans.clear();
  cols = 0;
  // Rows (b, h, query block) of the int32 count and index tensors.
  auto row_of = [&](const torch::Tensor& counts, const torch::Tensor& indices,
                    int64_t& count) -> const int32_t* {
    if (!counts.defined()) {
      count = 0;
      return nullptr;
    }
    const auto b = counts.size(0) == 1 ? 0 : n;
    const auto hm = counts.size(1) == 1 ? 0 : h;
    const auto nq = counts.size(2), nkv = indices.size(3);
    const auto at = (b * counts.size(1) + hm) * nq + row0 / mask.block_q;
    count = counts.data_ptr<int32_t>()[at];
    return indices.data_ptr<int32_t>() + at * nkv;
  };
  int64_t n_partial = 0, n_full = 0;
  const auto* partial_blocks =
      row_of(mask.kv_num_blocks, mask.kv_indices, n_partial);
  const auto* full_blocks =
      row_of(mask.full_kv_num_blocks, mask.full_kv_indices, n_full);
  // Both lists ascend: merge them.
  int64_t i = 0, j = 0;
  while (i < n_partial || j < n_full) {
    const bool take_full =
        j < n_full && (i >= n_partial || full_blocks[j] < partial_blocks[i]);
    const int64_t kv_block = take_full ? full_blocks[j++] : partial_blocks[i++];
    const auto key0 = std::max(kv_block * mask.block_kv, first);
    const auto key1 = std::min((kv_block + 1) * mask.block_kv, last);
    if (key1 <= key0) {
      continue;
    }
    if (take_full) {
      has_full = true;
    } else {
      partial.push_back({key0, key1 - key0, cols});
    }
    if (!spans.empty() && spans.back().key0 + spans.back().cols == key0) {
      spans.back().cols += key1 - key0;
    } else {
      spans.push_back({key0, key1 - key0, cols});
    }
    cols += key1 - key0;
  }
}

namespace {

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

/// The flex part of a call's spec: `flex` with its block mask's tensors
/// int32 contiguous on the CPU, and a relative bias (Hb, L + S - 1), where
/// defined, added to the scores before its score_mod (whose captured
/// tensors it then joins).
std::shared_ptr<const FlexMods> flex_spec(const FlexMods& flex,
                                          const torch::Tensor& relative_bias,
                                          int64_t L,
                                          const torch::TensorOptions& options) {
  auto spec = std::make_shared<FlexMods>(flex);
  auto& mask = spec->block_mask;
  auto to_cpu_int = [](torch::Tensor& t) {
    if (t.defined()) {
      t = t.to(torch::kCPU, torch::kInt).contiguous();
    }
  };
  to_cpu_int(mask.kv_num_blocks);
  to_cpu_int(mask.kv_indices);
  to_cpu_int(mask.full_kv_num_blocks);
  to_cpu_int(mask.full_kv_indices);
  if (relative_bias.defined()) {
    const auto& user = flex.score_mod;
    spec->score_mod = [bias = relative_bias, L, user](
                          const torch::Tensor& score, const torch::Tensor& b,
                          const torch::Tensor& h, const torch::Tensor& q_idx,
                          const torch::Tensor& kv_idx) {
      const auto head = bias.size(0) == 1 ? torch::zeros_like(h) : h;
      auto biased = score + bias.index({head, kv_idx - q_idx + (L - 1)});
      return user ? user(biased, b, h, q_idx, kv_idx) : biased;
    };
    spec->captured = flex_captured_leaves(spec->score_mod, options);
  }
  return spec;
}

}  // namespace

AttentionResult blocked_attention(const torch::Tensor& query,
                                  const torch::Tensor& key,
                                  const torch::Tensor& value,
                                  const torch::Tensor& mask,
                                  const KeyPositions& positions, double scale,
                                  WeightsMode weights, int64_t block_rows,
                                  KeptWeights kept, const torch::Tensor& packed,
                                  const FlexMods* flex) {
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
  auto bias = positions.relative_bias;
  if (flex != nullptr && flex->active()) {
    spec.flex = flex_spec(*flex, bias, L, query.options());
    bias = torch::Tensor();  // in score_mod now
    if (!flex->block_mask.empty()) {
      spec.block_rows = flex->block_mask.block_q;  // a block: a query block
      const auto q4 = to_4d(query);
      spec.partial_masks =
          PartialMasks::evaluate(spec.flex->block_mask, q4.size(0), q4.size(1));
    }
  }
  const bool needs_grad =
      torch::GradMode::is_enabled() &&
      (query.requires_grad() || key.requires_grad() || value.requires_grad() ||
       (bias.defined() && bias.requires_grad()) ||
       (spec.flex != nullptr && !spec.flex->captured.empty()));
  // N·H·L·S: every score of the call.
  const int64_t scores = score_count(query, S);
  spec.one_block = block_rows <= 0 && scores <= kOneBlockScores &&
                   L <= kOneBlockRows && spec.flex == nullptr;
  const bool onednn = query.is_cpu() &&
                      query.scalar_type() == torch::kFloat32 &&
                      onednn_products_available();
  // A flex call's mods are user code, which OpenBLAS's threads (that must
  // make no BLAS call) do not run: where its items call one (a score_mod,
  // or mask_mod on partial blocks not evaluated before, PartialMasks), they
  // run on ATen's or in order.
  // Fused mods make no ATen or BLAS call: they run anywhere.
  const bool mods_in_items =
      spec.flex != nullptr &&
      ((spec.flex->score_mod && spec.flex->score_mod.fused() == nullptr) ||
       (!spec.flex->block_mask.empty() && spec.partial_masks == nullptr &&
        spec.flex->block_mask.mask_mod.fused() == nullptr));
  spec.threads = item_threads(scores, S, onednn && !mods_in_items);
  // oneDNN's products where each runs on one core anyway: items spread
  // over either pool, and small calls in order (kSpreadScores). Larger
  // calls in order (where OpenBLAS's idle workers spin) keep BLAS's gemm on
  // its own threads.
  spec.onednn = onednn && (spec.threads != ItemThreads::kCaller ||
                           scores <= kSpreadScores);
  if (kept == KeptWeights::kAuto && spec.flex == nullptr) {
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
    // A flex block's columns are not the kept tensor's: always recomputed.
    spec.keep_weights = kept == KeptWeights::kAlways && spec.flex == nullptr;
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
  auto outputs = apply_blocked(
      q, k, v, bias_input, spec,
      needs_grad && !spec.one_block && spec.flex == nullptr ? packed
                                                            : torch::Tensor());
  auto output = outputs[0];
  auto weights_out =
      weights != WeightsMode::kNone ? outputs[1] : torch::Tensor();
  auto lse = spec.flex != nullptr && spec.flex->return_lse ? outputs.back()
                                                           : torch::Tensor();
  // Back to the input's rank.
  for (auto d = query.dim(); d < 4; ++d) {
    output = output.squeeze(0);
    if (weights_out.defined()) {
      weights_out = weights_out.squeeze(0);
    }
  }
  return {output, weights_out, lse};
}

}  // namespace mha::detail
