// FlexAttention's steps inside the blocked path's tile loop (blocked_flex.h):
// PartialMasks (blocked_attention.h), the mask_mod of a call's partial
// blocks evaluated once before the work items; and, per block, score_mod,
// the partial blocks' mask (the flags filled in as -inf, or each row's run
// of allowed keys as the softmax's limits), the rows left with no key, and
// score_mod's step of backward.
//
// Glossary: N batch, H query heads, rows and cols a block's query rows and
// its visited keys side by side.
#include "core/blocked_flex.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <memory>

namespace mha::detail {

namespace {
std::atomic<int> partial_masks_off{0};
}  // namespace

PartialMasksOff::PartialMasksOff() { ++partial_masks_off; }
PartialMasksOff::~PartialMasksOff() { --partial_masks_off; }

namespace {

/// The allowed keys f[0, w) (0 or 1) as one run [run[0], run[1]), or
/// run[0] = run[1] = -1 where they are not one run (memchr on the bytes).
void run_of_flags(const uint8_t* f, int64_t w, int32_t* run) {
  auto first = [&](int64_t from, int value) {
    const void* at = std::memchr(f + from, value, w - from);
    return at == nullptr ? w : static_cast<const uint8_t*>(at) - f;
  };
  const auto begin = first(0, 1);
  const auto end = begin == w ? w : first(begin, 0);
  const bool one_run = end == w || first(end, 1) == w;
  run[0] = one_run ? static_cast<int32_t>(begin) : -1;
  run[1] = one_run ? static_cast<int32_t>(end) : -1;
}

/// Each row's allowed keys in each partial block as one run (begin, end)
/// of the block's keys, or (-1, -1) where they are not one run: int32
/// (Nr, Hr, partials, rows, 2) from `allowed` (Nr, Hr, rows, width), the
/// partial blocks side by side from col0[j].
template <typename WidthOf>
torch::Tensor runs_of_flags(const torch::Tensor& allowed,
                            const std::vector<int64_t>& col0,
                            const WidthOf& width_of,
                            const std::vector<int64_t>& blocks) {
  const auto matrices = allowed.size(0) * allowed.size(1);
  const auto rows = allowed.size(2), width = allowed.size(3);
  const auto partials = static_cast<int64_t>(blocks.size());
  auto runs =
      torch::empty({allowed.size(0), allowed.size(1), partials, rows, 2},
                   torch::TensorOptions().dtype(torch::kInt));
  auto* run = runs.data_ptr<int32_t>();
  const auto* flags = allowed.data_ptr<bool>();
  for (int64_t m = 0; m < matrices; ++m) {
    for (int64_t j = 0; j < partials; ++j) {
      const auto w = width_of(blocks[j]);
      for (int64_t r = 0; r < rows; ++r, run += 2) {
        // (a bool is one byte, 0 or 1)
        run_of_flags(reinterpret_cast<const uint8_t*>(
                         flags + (m * rows + r) * width + col0[j]),
                     w, run);
      }
    }
  }
  return runs;
}

}  // namespace

std::shared_ptr<const PartialMasks> PartialMasks::evaluate(
    const BlockMask& mask, int64_t N, int64_t H) {
  // A fused mask_mod too, by its tensor form: once per call for all the
  // heads and batches it does not vary over, where the items would run it
  // for each (measured: packed documents at (1, 8, 4096, 64) took 1.6x the
  // time with the items' evaluation, fused_partial_flags, which remains
  // for masks over the budget).
  if (partial_masks_off.load() > 0) {
    return nullptr;
  }
  const auto& counts = mask.kv_num_blocks;
  const auto Bm = counts.size(0), Hm = counts.size(1), nq = counts.size(2);
  const auto nkv = mask.kv_indices.size(3);
  const auto* count = counts.data_ptr<int32_t>();
  const auto* index = mask.kv_indices.data_ptr<int32_t>();
  auto width_of = [&](int64_t kv_block) {
    return std::min(mask.block_kv, mask.kv_len - kv_block * mask.block_kv);
  };
  auto rows_in = [&](int64_t i) {
    return std::min(mask.block_q, mask.q_len - i * mask.block_q);
  };
  // What the flags take when no result depends on the shared batches or
  // heads: over the budget, nothing is evaluated.
  int64_t bytes = 0;
  for (int64_t m = 0; m < Bm * Hm * nq; ++m) {
    for (int32_t j = 0; j < count[m]; ++j) {
      bytes += rows_in(m % nq) * width_of(index[m * nkv + j]);
    }
  }
  if (bytes > kPartialMaskBytes) {
    return nullptr;
  }
  auto result = std::make_shared<PartialMasks>();
  result->mask_batches_ = Bm;
  result->mask_heads_ = Hm;
  result->nq_ = nq;
  result->rows_.resize(Bm * Hm * nq);
  const auto options = torch::TensorOptions().dtype(torch::kLong);
  // The batches and heads a row of the mask stands for: all of the call's
  // where the mask broadcasts, as index tensors (b (N, 1, 1, 1), h (1, H,
  // 1, 1)), else its own.
  const auto Nb = Bm == 1 ? N : 1, Hb = Hm == 1 ? H : 1;
  const auto all_b = torch::arange(Nb, options).view({Nb, 1, 1, 1});
  const auto all_h = torch::arange(Hb, options).view({1, Hb, 1, 1});
  // One mask_mod call per row of the mask, the rows spread over ATen's
  // threads (an exception reaches the caller from any of them).
  std::atomic<int64_t> taken{0};
  at::parallel_for(0, Bm * Hm * nq, 1, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      auto& row = result->rows_[m];
      if (count[m] == 0 || taken.load() > kPartialMaskBytes) {
        continue;
      }
      const auto i = m % nq, hm = m / nq % Hm, bm = m / nq / Hm;
      std::vector<torch::Tensor> keys;
      int64_t width = 0;
      for (int32_t j = 0; j < count[m]; ++j) {
        const int64_t kv_block = index[m * nkv + j];
        row.blocks.push_back(kv_block);
        row.col0.push_back(width);
        const auto k0 = kv_block * mask.block_kv;
        keys.push_back(torch::arange(k0, k0 + width_of(kv_block), options));
        width += width_of(kv_block);
      }
      const auto q0 = i * mask.block_q, rows = rows_in(i);
      auto allowed = call_mask_mod(
          mask.mask_mod, Bm == 1 ? all_b : torch::scalar_tensor(bm, options),
          Hm == 1 ? all_h : torch::scalar_tensor(hm, options),
          torch::arange(q0, q0 + rows, options).unsqueeze(1),
          torch::cat(keys).unsqueeze(0), {Nb, Hb, rows, width});
      // Keep one copy of what the mod did not vary (an expanded dim).
      if (allowed.stride(0) == 0) {
        allowed = allowed.narrow(0, 0, 1);
      }
      if (allowed.stride(1) == 0) {
        allowed = allowed.narrow(1, 0, 1);
      }
      row.allowed = allowed.contiguous();
      taken += row.allowed.numel();
      row.runs = runs_of_flags(row.allowed, row.col0, width_of, row.blocks);
    }
  });
  if (taken.load() > kPartialMaskBytes) {
    return nullptr;
  }
  return result;
}

bool PartialMasks::find(int64_t n, int64_t h, int64_t q_block, int64_t kv_block,
                        Flags& flags) const {
  const auto bm = mask_batches_ == 1 ? 0 : n, hm = mask_heads_ == 1 ? 0 : h;
  const auto& row = rows_[(bm * mask_heads_ + hm) * nq_ + q_block];
  const auto at =
      std::lower_bound(row.blocks.begin(), row.blocks.end(), kv_block);
  if (at == row.blocks.end() || *at != kv_block) {
    return false;
  }
  const auto j = at - row.blocks.begin();
  const auto& allowed = row.allowed;
  const auto rows = allowed.size(2), partials = row.runs.size(2);
  const auto matrix = (allowed.size(0) == 1 ? 0 : n) * allowed.size(1) +
                      (allowed.size(1) == 1 ? 0 : h);
  flags.stride = allowed.size(3);
  flags.allowed =
      allowed.data_ptr<bool>() + matrix * rows * flags.stride + row.col0[j];
  flags.runs =
      row.runs.data_ptr<int32_t>() + ((matrix * partials + j) * rows) * 2;
  return true;
}

namespace {

/// row[0, cols) set to -inf where flags (0 or 1) is 0, by the bits (-inf's
/// where the flag is 0, the score's where it is 1; memcpy, as the standard
/// allows), so that the compiler vectorises it: the loop with a select ran
/// a compare and branch a score.
template <typename T, typename Bits>
void fill_row(T* row, const uint8_t* flags, int64_t cols) {
  static_assert(sizeof(T) == sizeof(Bits), "fill_row: bits of T");
  const T minus_inf = -std::numeric_limits<T>::infinity();
  Bits blocked;
  std::memcpy(&blocked, &minus_inf, sizeof(T));
  for (int64_t c = 0; c < cols; ++c) {
    Bits score;
    std::memcpy(&score, row + c, sizeof(T));
    const Bits keep = Bits{0} - static_cast<Bits>(flags[c]);  // all 1s or 0
    score = (score & keep) | (blocked & ~keep);
    std::memcpy(row + c, &score, sizeof(T));
  }
}

/// p (rows, cols; unit column stride) set to -inf where `allowed` is false
/// (row r's flags at allowed + r * stride): PartialMasks' flags applied.
void fill_disallowed(const torch::Tensor& p, const bool* allowed,
                     int64_t stride) {
  const auto rows = p.size(0), cols = p.size(1), ld = p.stride(0);
  const auto* flags = reinterpret_cast<const uint8_t*>(allowed);
  for (int64_t r = 0; r < rows; ++r) {
    if (p.scalar_type() == torch::kFloat) {
      fill_row<float, uint32_t>(p.data_ptr<float>() + r * ld,
                                flags + r * stride, cols);
    } else {
      fill_row<double, uint64_t>(p.data_ptr<double>() + r * ld,
                                 flags + r * stride, cols);
    }
  }
}

/// (rows) bool, true at the rows of p (rows, cols; contiguous) whose every
/// score within `limits` is -inf (or that have none there), or undefined
/// where there is none. A row's scan stops at its first other score (a NaN
/// included, as amax(row) == -inf decides).
torch::Tensor rows_without_keys(const torch::Tensor& p,
                                const RowLimits& limits) {
  torch::Tensor none;
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "rows_without_keys", [&] {
    const auto* data = p.data_ptr<scalar_t>();
    const auto rows = p.size(0), cols = p.size(1);
    const auto blocked = -std::numeric_limits<scalar_t>::infinity();
    for (int64_t r = 0; r < rows; ++r) {
      const scalar_t* row = data + r * cols;
      if (std::all_of(row + limits.begin(r, cols), row + limits.end(r, cols),
                      [&](scalar_t x) { return x == blocked; })) {
        if (!none.defined()) {
          none =
              torch::zeros({rows}, torch::TensorOptions().dtype(torch::kBool));
        }
        none.data_ptr<bool>()[r] = true;
      }
    }
  });
  return none;
}

/// Rows of a block's scores that score_mod sees at a time, for `cols`
/// columns: about kScoreModElements scores (128 KiB of float32, glibc's
/// default mmap threshold), at least one row.
int64_t score_mod_rows(int64_t cols) {
  constexpr int64_t kScoreModElements = 32 * 1024;
  return std::max<int64_t>(1, kScoreModElements / std::max<int64_t>(1, cols));
}

/// Each row's allowed columns of a block as one run, into tile.begins and
/// tile.ends, from the partial blocks' runs (PartialMasks::Flags; every
/// column of a full key block is allowed): true where every row's are one
/// run, false (the runs unusable) where some row's are not.
bool row_runs(const Block& block, const std::vector<PartialMasks::Flags>& flags,
              const std::vector<int64_t>& offsets, FlexTile& tile) {
  tile.begins.assign(block.rows, 0);
  tile.ends.assign(block.rows, 0);
  for (int64_t r = 0; r < block.rows; ++r) {
    int64_t begin = -1, end = -1;
    bool one_run = true;
    auto add = [&](int64_t b, int64_t e) {  // columns [b, e), ascending
      if (b >= e) {
        return;
      }
      if (begin < 0) {
        begin = b;
        end = e;
      } else if (b == end) {
        end = e;
      } else {
        one_run = false;
      }
    };
    int64_t col = 0;
    for (size_t i = 0; i < block.partial.size() && one_run; ++i) {
      const auto& span = block.partial[i];
      add(col, span.col);  // full key blocks before it
      const int32_t* run = flags[i].runs + 2 * r;
      if (run[0] < 0) {
        return false;
      }
      add(span.col + std::clamp<int64_t>(run[0] - offsets[i], 0, span.cols),
          span.col + std::clamp<int64_t>(run[1] - offsets[i], 0, span.cols));
      col = span.col + span.cols;
    }
    add(col, block.cols);
    if (!one_run) {
      return false;
    }
    tile.begins[r] = std::max<int64_t>(begin, 0);
    tile.ends[r] = std::max<int64_t>(end, 0);
  }
  return true;
}

/// A fused score_mod on every visited column of p (rows, cols), row by
/// row and run by run of keys; where `with_derivative` (backward), its
/// derivative by the score into tile.raw, of p's shape.
void fused_score_mod_block(torch::Tensor& p, const Block& block,
                           const FusedScoreKernel& kernel, FlexTile& tile,
                           bool with_derivative) {
  tile.fused_derivative = with_derivative;
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "fused_score_mod", [&] {
    auto* data = p.data_ptr<scalar_t>();
    auto* derivative =
        with_derivative ? tile.raw.data_ptr<scalar_t>() : nullptr;
    const auto ld = p.stride(0);
    for (int64_t r = 0; r < block.rows; ++r) {
      for (const auto& span : block.spans) {
        scalar_t* row = data + r * ld + span.col;
        if (with_derivative) {
          kernel.apply_with_derivative(row, derivative + r * ld + span.col,
                                       span.cols, tile.n, tile.head,
                                       block.row0 + r, span.key0);
        } else {
          kernel.apply(row, span.cols, tile.n, tile.head, block.row0 + r,
                       span.key0);
        }
      }
    }
  });
}

/// A fused mask_mod on the partial blocks of `block`, as PartialMasks'
/// flags (one per partial block, its first key at offset 0): each row's
/// allowed flags and its run, in thread-local buffers that live until the
/// thread's next block.
void fused_partial_flags(const Block& block, const FusedMaskKernel& kernel,
                         const FlexTile& tile,
                         std::vector<PartialMasks::Flags>& flags) {
  thread_local std::vector<uint8_t> allowed;
  thread_local std::vector<int32_t> runs;
  int64_t width = 0;
  for (const auto& span : block.partial) {
    width += span.cols;
  }
  allowed.resize(static_cast<size_t>(block.rows * width));
  runs.resize(static_cast<size_t>(2 * block.rows * block.partial.size()));
  int64_t col = 0;
  for (size_t i = 0; i < block.partial.size(); ++i) {
    const auto& span = block.partial[i];
    uint8_t* first = allowed.data() + col;
    int32_t* run = runs.data() + 2 * block.rows * static_cast<int64_t>(i);
    for (int64_t r = 0; r < block.rows; ++r) {
      kernel.allowed(first + r * width, span.cols, tile.n, tile.head,
                     block.row0 + r, span.key0);
      run_of_flags(first + r * width, span.cols, run + 2 * r);
    }
    flags[i].allowed = reinterpret_cast<const bool*>(first);
    flags[i].stride = width;
    flags[i].runs = run;
    col += span.cols;
  }
}

}  // namespace

RowLimits flex_scores(torch::Tensor& p, const BlockedSpec& spec,
                      const Block& block, const torch::Tensor& mask,
                      const torch::Tensor& blocked, const bool* empty,
                      FlexTile& tile, bool keep_raw,
                      const torch::Tensor& lse_rows) {
  const auto& flex = *spec.flex;
  if (const auto* kernel = flex.score_mod.fused(); kernel != nullptr) {
    fused_score_mod_block(p, block, *kernel, tile, keep_raw);
  } else if (flex.score_mod) {
    tile.index(block);
    if (keep_raw) {
      tile.raw.copy_(p);
    }
    // Rows a few at a time: the mod's temporaries stay in the cache and in
    // the allocator's free lists (a whole block's are fresh pages).
    const int64_t rows = p.size(0), chunk = score_mod_rows(p.size(1));
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const auto r = std::min(chunk, rows - r0);
      auto part = p.narrow(0, r0, r);
      const auto q_idx = tile.q_idx.narrow(0, r0, r);
      if (!keep_raw) {
        part.copy_(call_score_mod(flex.score_mod, part, tile.b, tile.h, q_idx,
                                  tile.kv_idx));
        continue;
      }
      // Backward: one call gives the scores and the graph that
      // flex_score_backward differentiates.
      torch::AutoGradMode grad_mode(true);
      // A tensor of its own over the kept scores: a view of tile.raw would
      // share the version counter of the whole scratch buffer, which the
      // weights, dp and ds written later bump, and a mod that saves its
      // input (clamp, s * s) would fail in backward.
      const auto raw = tile.raw.narrow(0, r0, r);
      auto leaf = torch::from_blob(raw.data_ptr(), raw.sizes(), raw.strides(),
                                   raw.options())
                      .requires_grad_();
      auto modified = call_score_mod(flex.score_mod, leaf, tile.b, tile.h,
                                     q_idx, tile.kv_idx);
      part.copy_(modified.detach());
      if (modified.requires_grad()) {
        tile.graph_in.push_back(leaf);
        tile.graph_out.push_back(modified);
        tile.graph_rows.emplace_back(r0, r);
      }
    }
  }
  if (mask.defined()) {
    for (const auto& span : block.spans) {
      auto p_span = p.narrow(1, span.col, span.cols);
      p_span.add_(
          mask_block(mask, block.row0, block.rows, span.key0, span.cols));
      p_span.masked_fill_(
          mask_block(blocked, block.row0, block.rows, span.key0, span.cols),
          kNegInf);
    }
  }
  const auto& positions = spec.positions;
  const bool limited = positions.causal || positions.window > 0;
  // The partial blocks' evaluated flags, where every one has them.
  const auto& block_mask = flex.block_mask;
  std::vector<PartialMasks::Flags> flags(block.partial.size());
  std::vector<int64_t> offsets(block.partial.size());  // span.key0 in its block
  bool evaluated = spec.partial_masks != nullptr;
  for (size_t i = 0; i < block.partial.size() && evaluated; ++i) {
    const auto kv_block = block.partial[i].key0 / block_mask.block_kv;
    offsets[i] = block.partial[i].key0 - kv_block * block_mask.block_kv;
    evaluated = spec.partial_masks->find(
        tile.n, tile.head, block.row0 / block_mask.block_q, kv_block, flags[i]);
  }
  // Both come from one block mask: every partial block was evaluated. (The
  // items of such a call may run on OpenBLAS's threads, which must not run
  // an eager mask_mod, user code of ATen calls.)
  TORCH_INTERNAL_ASSERT(evaluated || spec.partial_masks == nullptr,
                        "flex_scores: a partial block PartialMasks lacks");
  if (const auto* kernel = block_mask.mask_mod.fused();
      kernel != nullptr && !block.partial.empty() && !evaluated) {
    fused_partial_flags(block, *kernel, tile, flags);
    std::fill(offsets.begin(), offsets.end(), 0);
    evaluated = true;
  }
  RowLimits limits;
  limits.end0 = block.cols;
  // One run of allowed keys per row: the fused softmax's limits take the
  // partial blocks' mask (where -inf outside them would count for nothing
  // else: no additive mask, no positions' limits, no logsumexp).
  if (evaluated && !block.partial.empty() && !mask.defined() && !limited &&
      !lse_rows.defined() && p.scalar_type() == torch::kFloat &&
      fused_softmax_available() && row_runs(block, flags, offsets, tile)) {
    limits.begins = tile.begins.data();
    limits.ends = tile.ends.data();
  } else {
    for (size_t i = 0; i < block.partial.size(); ++i) {
      const auto& span = block.partial[i];
      auto p_span = p.narrow(1, span.col, span.cols);
      if (evaluated) {
        fill_disallowed(p_span, flags[i].allowed + offsets[i], flags[i].stride);
        continue;
      }
      tile.index(block);
      auto kv = tile.kv_idx.narrow(1, span.col, span.cols);
      p_span.masked_fill_(call_mask_mod(block_mask.mask_mod, tile.b, tile.h,
                                        tile.q_idx, kv, {block.rows, span.cols})
                              .logical_not(),
                          kNegInf);
    }
  }
  // The positions' limits here rather than in the softmax, so that the
  // fully masked rows below count them.
  if (limited) {
    tile.index(block);
    if (positions.window > 0) {
      p.masked_fill_(tile.kv_idx.lt(tile.q_idx + positions.begin(0)), kNegInf);
    }
    p.masked_fill_(tile.kv_idx.ge(tile.q_idx + positions.end(0)), kNegInf);
  }
  // A row sees some key when the block has a full key block and nothing
  // could have set a score there to -inf.
  const bool surely_seen = block.has_full && !flex.score_mod &&
                           !mask.defined() && !limited && empty == nullptr;
  if (!surely_seen) {
    tile.empty = rows_without_keys(p, limits);  // (rows), or {} for none
    if (empty != nullptr) {
      const auto flags_in =
          torch::from_blob(const_cast<bool*>(empty), {block.rows},
                           torch::TensorOptions().dtype(torch::kBool));
      tile.empty = tile.empty.defined() ? tile.empty.logical_or(flags_in)
                                        : flags_in.clone();
      if (!tile.empty.any().item<bool>()) {
        tile.empty = torch::Tensor();
      }
    }
  }
  if (lse_rows.defined()) {
    lse_rows.copy_(at::logsumexp(p, /*dim=*/1));
    if (tile.empty.defined()) {
      lse_rows.masked_fill_(tile.empty, kNegInf);
    }
  }
  return limits;
}

void flex_score_backward(torch::Tensor& ds, const BlockedSpec& spec,
                         FlexTile& tile, std::vector<torch::Tensor>& captured,
                         std::mutex& lock) {
  const auto& flex = *spec.flex;
  if (tile.fused_derivative) {
    // ds times the fused mod's derivative, but 0 where ds is 0 (a masked
    // score's weight is 0: no gradient, even where the mod's derivative
    // there is not finite).
    AT_DISPATCH_FLOATING_TYPES(ds.scalar_type(), "fused_score_backward", [&] {
      const auto rows = ds.size(0), cols = ds.size(1);
      auto* g = ds.data_ptr<scalar_t>();
      const auto* d = tile.raw.data_ptr<scalar_t>();
      const auto ld = ds.stride(0), ld_d = tile.raw.stride(0);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const scalar_t x = g[r * ld + c];
          g[r * ld + c] = x == 0 ? scalar_t(0) : x * d[r * ld_d + c];
        }
      }
    });
    return;
  }
  const auto chunks = tile.graph_out.size();
  // Rows whose scores score_mod ignored get no gradient.
  int64_t next = 0;
  std::vector<torch::Tensor> grad_outputs;
  for (const auto& [r0, r] : tile.graph_rows) {
    ds.narrow(0, next, r0 - next).zero_();
    grad_outputs.push_back(ds.detach().narrow(0, r0, r));
    next = r0 + r;
  }
  ds.narrow(0, next, ds.size(0) - next).zero_();
  if (chunks == 0) {
    return;
  }
  std::vector<torch::Tensor> inputs = tile.graph_in;
  inputs.insert(inputs.end(), flex.captured.begin(), flex.captured.end());
  torch::AutoGradMode grad_mode(true);
  const auto grads = torch::autograd::grad(
      tile.graph_out, inputs, grad_outputs, /*retain_graph=*/false,
      /*create_graph=*/false, /*allow_unused=*/true);
  tile.graph_in.clear();
  tile.graph_out.clear();
  tile.graph_rows.clear();
  for (size_t i = 0; i < chunks; ++i) {
    if (grads[i].defined()) {
      grad_outputs[i].copy_(grads[i]);
    } else {
      grad_outputs[i].zero_();
    }
  }
  std::lock_guard<std::mutex> guard(lock);
  for (size_t i = chunks; i < grads.size(); ++i) {
    if (grads[i].defined()) {
      captured[i - chunks].add_(grads[i]);
    }
  }
}

}  // namespace mha::detail
