// Internal: FlexAttention's steps inside the blocked path's tile loop
// (blocked_attention.cpp): the index tensors a block's mods see, score_mod,
// the partial blocks' mask (PartialMasks, evaluated once per call, or
// mask_mod per block), the rows left with no key, and score_mod's step of
// backward. Not installed.
//
// Glossary: rows and cols, a block's query rows and its visited keys side
// by side (Block, blocked_attention.h).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "core/blocked_attention.h"

namespace mha::detail {

/// What a flex call's block needs beyond the scores: the index tensors its
/// mods see, the scores before score_mod (kept for backward), and its fully
/// masked rows.
struct FlexTile {
  int64_t n = 0, head = 0;  // the block's (batch, query head)
  torch::Tensor b, h;       // () int64, made by index()
  torch::Tensor q_idx;      // (rows, 1) int64
  torch::Tensor kv_idx;     // (1, cols) int64: the key of each column
  // (rows, cols): scores before an eager score_mod, or, where
  // fused_derivative, a fused score_mod's derivative at them; or {}
  torch::Tensor raw;
  bool fused_derivative = false;
  torch::Tensor empty;  // (rows) bool: rows left with no key, or {}
  // Each row's run of allowed columns, where flex_scores gives them to the
  // softmax as its limits (row_runs).
  std::vector<int64_t> begins, ends;
  // Backward: score_mod's graph, one per chunk of rows (score_mod_rows)
  // whose output depends on the leaf: the leaves (views of raw), what
  // score_mod made of them, and their first row and rows.
  std::vector<torch::Tensor> graph_in, graph_out;
  std::vector<std::pair<int64_t, int64_t>> graph_rows;

  FlexTile(int64_t n_, int64_t head_) : n(n_), head(head_) {}
  /// Makes the index tensors of `block` (once): only a block that calls a
  /// mod needs them.
  void index(const Block& block) {
    if (q_idx.defined()) {
      return;
    }
    const auto options = torch::TensorOptions().dtype(torch::kLong);
    b = torch::scalar_tensor(n, options);
    h = torch::scalar_tensor(head, options);
    q_idx = torch::arange(block.row0, block.row0 + block.rows, options)
                .unsqueeze(1);  // (rows, 1)
    std::vector<torch::Tensor> keys;
    for (const auto& span : block.spans) {
      keys.push_back(torch::arange(span.key0, span.key0 + span.cols, options));
    }
    kv_idx = (keys.size() == 1 ? keys[0] : torch::cat(keys)).unsqueeze(0);
  }
};

/// The flex steps of block_weights on the scaled scores p (rows, cols):
/// score_mod (where `keep_raw`, backward's recomputation, on a copy of the
/// scores in tile.raw, with its autograd graph kept in tile.graph_*),
/// the additive mask, the partial blocks' mask (PartialMasks' flags, or
/// mask_mod called here) and, with a block mask, the positions' limits;
/// then the rows left with no key (every score -inf, as Python's
/// FlexAttention decides) in tile.empty, OR-ed with the mask's `empty`
/// flags, and each row's logsumexp into `lse_rows` where defined. Returns
/// the limits for the softmax: every column, or, where the fused softmax
/// runs and each row's allowed keys are one run (causal, documents,
/// windows), those runs instead of -inf outside them.
RowLimits flex_scores(torch::Tensor& p, const BlockedSpec& spec,
                      const Block& block, const torch::Tensor& mask,
                      const torch::Tensor& blocked, const bool* empty,
                      FlexTile& tile, bool keep_raw,
                      const torch::Tensor& lse_rows);

/// The flex step of backward: ds (rows, cols), the gradient of the scores
/// after score_mod, becomes that of the scores before it (through
/// score_mod's autograd graph that block_weights kept in tile.graph_*, one
/// pass over its chunks), and the gradients of the captured tensors are
/// added to `captured` (under `lock`).
void flex_score_backward(torch::Tensor& ds, const BlockedSpec& spec,
                         FlexTile& tile, std::vector<torch::Tensor>& captured,
                         std::mutex& lock);

}  // namespace mha::detail
