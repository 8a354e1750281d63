// Internal: what the two forms of the blocked CPU path share. Not
// installed. blocked_attention.cpp: query rows in blocks per (batch, head),
// the blocks spread over threads; one_block_attention.cpp: short calls as
// one block of all heads, with batched calls.
//
// Glossary: N batch, H query heads, Hkv key/value heads, L target (query)
// length, S source (key) length, D and Dv the query/key and value features.
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/attention_core.h"
#include "core/fused_softmax.h"

namespace mha::detail {

/// mask_mod's result on every partial block of a flex call's block mask,
/// evaluated once per call before the work items, so that the items read
/// it instead of calling mask_mod block by block, head by head. One call per
/// query block of the mask (its partial key blocks side by side), with the
/// batches and heads the mask shares passed as index tensors, b (N, 1, 1,
/// 1) and h (1, H, 1, 1) (mods are elementwise, DESIGN.md): a mask_mod
/// that does not read them gives one result for all, one that does a result
/// per batch or head. It also keeps each row's allowed keys in each block
/// as one run where they are one (causal, documents, windows), which
/// float32's fused softmax then takes as its limits instead of a -inf fill.
/// Why: per block and head, the mod's ATen calls and the -inf fill cost
/// more than the block's softmax (a causal mask_mod on a 128 x 128 block,
/// LibTorch 1.13: q.ge(kv) 7.6 us, logical_not 1 us, masked_fill 12.4 us,
/// against about 2.5 us for a fill from these flags). Forward at (1, 8,
/// 4096, 64), 2 threads: causal through create_block_mask 77.8 -> 64.6 ms
/// (the built-in causal call 63-66 ms), seven packed documents 45.4 ->
/// 20-25 ms (docs/flex.md). Defined in blocked_flex.cpp.
class PartialMasks {
 public:
  /// The flags of `mask` (int32 contiguous CPU tensors, as BlockedSpec's)
  /// for a call of N batches and H query heads, or null where they would
  /// take more than kPartialMaskBytes: the items then call mask_mod.
  static std::shared_ptr<const PartialMasks> evaluate(const BlockMask& mask,
                                                      int64_t N, int64_t H);

  /// One partial block of one head, as find gives it.
  struct Flags {
    /// true = may attend: row r, key j of the block at allowed[r * stride
    /// + j].
    const bool* allowed = nullptr;
    int64_t stride = 0;
    /// Row r's allowed keys as one run [runs[2 r], runs[2 r + 1]) of the
    /// block's keys (empty: begin = end), or runs[2 r] = -1 where they are
    /// not one run.
    const int32_t* runs = nullptr;
  };

  /// The flags of key block kv_block against query block q_block of head
  /// (n, h); false where that block is not partial there.
  bool find(int64_t n, int64_t h, int64_t q_block, int64_t kv_block,
            Flags& flags) const;

 private:
  /// One query block of one (batch, head) row of the mask.
  struct Row {
    torch::Tensor allowed;        // bool (Nr, Hr, rows, width), contiguous
    torch::Tensor runs;           // int32 (Nr, Hr, partials, rows, 2)
    std::vector<int64_t> blocks;  // its partial key blocks, ascending
    std::vector<int64_t> col0;    // the first column of each in `allowed`
  };
  std::vector<Row> rows_;  // (mask batch, mask head, query block)
  int64_t mask_batches_ = 1, mask_heads_ = 1, nq_ = 0;
};

/// For tests: while an instance lives (on any thread), PartialMasks::evaluate
/// gives null, so that flex calls take the path of masks over the budget
/// (mask_mod called per block in the work items).
class PartialMasksOff {
 public:
  PartialMasksOff();
  ~PartialMasksOff();
  PartialMasksOff(const PartialMasksOff&) = delete;
  PartialMasksOff& operator=(const PartialMasksOff&) = delete;
};

/// The most memory PartialMasks takes for one call: 16 MiB of flags, 128
/// causal diagonal blocks of 128 x 128 at L = 16384 taking 2 MiB.
constexpr int64_t kPartialMaskBytes = int64_t{16} << 20;

/// What every block of one call shares.
struct BlockedSpec {
  torch::Tensor mask;     // additive, 4-D broadcastable to (N, H, L, S), or {}
  torch::Tensor blocked;  // mask == -inf, same shape, or {}
  // (Nb, Hb, L) bool, true at the fully masked query rows (fully_masked_rows),
  // or {} when there is none.
  torch::Tensor empty;
  KeyPositions positions;  // its relative_bias travels as an input instead
  double scale = 1.0;
  WeightsMode weights = WeightsMode::kNone;
  int64_t block_rows = 0;
  // Keep every block's weights for backward instead of recomputing them.
  bool keep_weights = false;
  // The whole call is one block of every (n, h): batched ATen calls over
  // all heads instead of one work item per head (batched_forward).
  bool one_block = false;
  // Where the work items run (for_each_item, item_threads).
  ItemThreads threads = ItemThreads::kAten;
  // The products through oneDNN (onednn_gemm_matrix, blas_gemm.h), each
  // call on one thread: in a parallel loop, or in order with the calling
  // thread's OpenMP thread count held at 1. False: BLAS's gemm
  // (gemm_matrix), on BLAS's own threads where the items run in order.
  // Always true where threads is kOpenBlas.
  bool onednn = false;
  // FlexAttention's mods (attention_core.h), or null. Its block mask's
  // tensors are int32 contiguous on the CPU; a relative bias of the
  // positions is folded into its score_mod.
  std::shared_ptr<const FlexMods> flex;
  // Its block mask's partial blocks evaluated (PartialMasks), or null.
  std::shared_ptr<const PartialMasks> partial_masks;
};

/// A run of keys a block computes: keys [key0, key0 + cols) sit at columns
/// [col, col + cols) of the block's scores.
struct KeySpan {
  int64_t key0 = 0, cols = 0, col = 0;
};

/// One block: query rows [row0, row0 + rows) and the keys any of them can
/// see, `cols` in all, side by side in `spans`: one run [col0, col0 + cols)
/// from the positions' limits, or, for a flex call with a block mask, the
/// keys of the visited key blocks (within those limits), adjacent blocks
/// joined into one run; `partial` lists its partial blocks' keys (mask_mod
/// is evaluated there).
struct Block {
  int64_t row0 = 0, rows = 0, col0 = 0, cols = 0;
  int64_t L = 0;  // query rows in all: relative_bias[h][j - i + L - 1]
  std::vector<KeySpan> spans;
  std::vector<KeySpan> partial;  // flex: the partial blocks' keys
  bool has_full = false;         // flex: a full key block is visited

  Block(const KeyPositions& positions, int64_t row0_, int64_t rows_, int64_t L_,
        int64_t S)
      : row0(row0_), rows(rows_), L(L_) {
    col0 = std::clamp<int64_t>(positions.begin(row0), 0, S);
    const auto end = std::clamp<int64_t>(positions.end(row0 + rows - 1), 0, S);
    cols = std::max<int64_t>(0, end - col0);
    if (cols > 0) {
      spans.push_back({col0, cols, 0});
    }
  }
  /// The block of head (n, h) of a call: the positions' run, cut to the
  /// visited blocks of spec.flex's block mask where it has one (the block
  /// is then one query block of it: row0 a multiple of block_q).
  Block(const BlockedSpec& spec, int64_t n, int64_t h, int64_t row0_,
        int64_t rows_, int64_t L_, int64_t S);
  /// The visible columns of each row, relative to col0 (one run from the
  /// positions; a flex call with a block mask applies its limits itself).
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

/// What blocked_forward and batched_forward return.
struct BlockedForward {
  torch::Tensor output;   // (N, H, L, Dv)
  torch::Tensor weights;  // as spec.weights, or undefined
  torch::Tensor kept;     // (N, H, L, S) when spec.keep_weights, else {}
  torch::Tensor lse;      // (N, H, L) when spec.flex->return_lse, else {}
};

/// What blocked_backward and batched_backward return.
struct BlockedGradients {
  torch::Tensor dq, dk, dv;
  torch::Tensor relative_bias;  // like relative_bias when it needs one
  // Those of spec.flex->captured, in its order (flex calls only).
  std::vector<torch::Tensor> captured;
};

/// The per-block form's forward and backward (blocked_attention.cpp, where
/// their layouts are described): query rows in blocks of spec.block_rows
/// for each (n, h), spread over threads. blocked_backward writes into
/// `grads`' dq (any values) and dk, dv (zero on entry) and returns them with
/// the bias's gradient. Shapes as batched_forward's and batched_backward's.
/// grad_lse: the gradient of a flex call's logsumexp (N, H, L), or
/// undefined: d lse_r / d s_rc is the weight p_rc, so p · grad_lse joins
/// each row's score gradient.
BlockedForward blocked_forward(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& relative_bias,
                               const BlockedSpec& spec);

BlockedGradients blocked_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec,
    const torch::Tensor& kept, const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights, BlockedGradients grads,
    const torch::Tensor& grad_lse = {});

/// Runs a blocked call under autograd (blocked_autograd.cpp): output, and
/// weights when spec asks for them, then the logsumexp when spec.flex asks
/// for it (differentiable: blocked_backward's grad_lse). With spec.flex, the
/// tensors its score_mod captures (spec.flex->captured) are inputs too, whose
/// gradients backward returns. relative_bias (Hb, L + S - 1) contiguous, or
/// empty (0) for none. With `packed` undefined, or not a tensor that q, k and v
/// are views of and cover exactly (attention_core's `packed`), backward returns
/// a gradient per input; otherwise it returns one gradient for the packed
/// tensor. Pass `packed` only when a gradient is needed and the call is not
/// spec.one_block.
torch::autograd::variable_list apply_blocked(const torch::Tensor& q,
                                             const torch::Tensor& k,
                                             const torch::Tensor& v,
                                             const torch::Tensor& relative_bias,
                                             const BlockedSpec& spec,
                                             const torch::Tensor& packed);

/// blocked_attention computes a call as one block when it has at most
/// kOneBlockRows query rows and kOneBlockScores scores (N·H·L·S, 4 MiB of
/// float32; also the most it keeps for backward). Measured (attention
/// alone, float32, D = 64, 2 threads, OpenBLAS): one decoding step of 8
/// query heads on 2 key/value heads over 96 cached keys 0.03 / 0.09 / 0.36
/// ms at N = 1 / 8 / 32 against 0.09 / 0.60 / 2.4 ms in per-head items;
/// (N, H, L, S) = (2, 4, 32, 32) 0.12 against 0.19 ms. From L = 128 the
/// per-head items were as fast or faster, and a buffer of all scores
/// is a fresh allocation whose pages fault in on every call.
constexpr int64_t kOneBlockRows = 32;
constexpr int64_t kOneBlockScores = int64_t{1} << 20;

/// The per-block path spreads its work items over ATen's threads only for
/// calls of more than kSpreadScores scores (N·H·L·S); smaller calls run
/// their items in order on the calling thread, each GEMM on BLAS's own
/// threads. Why: BLAS's threads, woken by the in-projection just before,
/// stay busy waiting for their next call (OpenBLAS spins for
/// OPENBLAS_THREAD_TIMEOUT) on the cores the parallel loop then wants, and
/// on a small call the loop's gain is less than what that costs.
/// Measured (mha-bench, LibTorch 1.13.1, OpenBLAS 0.3.21, 2 threads;
/// docs/speed.md at 5cc4c3b): up to (1, 512, 256, 4) the items in order
/// were faster or within the noise in every mode; at (1, 1024, 256, 4)
/// causal 0.58 of torch::nn's time in order against 0.37 spread.
constexpr int64_t kSpreadScores = int64_t{1} << 20;

/// Calls of at least kOpenBlasScores scores whose products can all go
/// through oneDNN run their work items on OpenBLAS's threads
/// (item_threads, attention_core.h), below that in order. Why: OpenBLAS's
/// idle worker, woken by the in-projection, otherwise keeps a core that the
/// items want (it spins there from OpenBLAS 0.3.27 on); on its own threads
/// the items have both cores. Measured (2 threads, PASSIVE; docs/speed.md
/// at 5cc4c3b, "The blocked path's items on OpenBLAS's threads"):
/// mha-bench, mha / torch::nn at (2, 128, 256, 4) forward+backward, in
/// order -> OpenBLAS's threads, 0.82-0.83 -> 0.73-0.74 (LibTorch 1.13) and
/// 0.86 -> 0.76 (2.14); the larger rows' cells 6-31 % less time on 2.14
/// (two cells' runs overlapping), and on 1.13 less or the same within the
/// noise but one (+4 %). Below 2^15 the gain shrinks while waking a
/// sleeping worker costs more: the core alone at (1, 4, L, 64), no BLAS
/// call before it, in order against OpenBLAS's threads: L = 64 (2^14
/// scores) 63 -> 70 µs, L = 96 123 -> 97 µs, L = 128 266 -> 133 µs; after
/// a 300 ms pause 429 -> 559 µs at L = 64, 571 -> 575 µs at L = 96.
constexpr int64_t kOpenBlasScores = int64_t{1} << 15;

/// Whether blocked_attention's float32 calls can make their products
/// through oneDNN (onednn_gemm_matrix): it is loaded, and this build can
/// hold it to one thread per call (ATen's loop is an OpenMP region and
/// item_threads.cpp is compiled with OpenMP). Which calls do:
/// BlockedSpec::onednn.
bool onednn_products_available();

/// In place on p (..., rows, cols): the columns outside each row's `limits`
/// set to -inf, then ATen's softmax over the last dim (the path of dtypes
/// and CPUs without fused_softmax_rows).
void limited_softmax(torch::Tensor& p, const RowLimits& limits);

/// Rows [row0, row0 + rows) and columns [col0, col0 + cols) of a mask slice
/// (rows, cols) that may broadcast in either dim.
torch::Tensor mask_block(const torch::Tensor& m, int64_t row0, int64_t rows,
                         int64_t col0, int64_t cols);

/// Row h (or 0 when shared by every head) of relative_bias (Hb, L + S - 1),
/// or undefined for the empty placeholder of no bias.
torch::Tensor bias_row(const torch::Tensor& relative_bias, int64_t h);

/// The forward of spec.one_block calls: output (N, H, L, Dv) contiguous,
/// weights as spec.weights, all of (N, H, L, S) kept when
/// spec.keep_weights. q (N, H, L, D), k (N, Hkv, S, D), v (N, Hkv, S, Dv),
/// relative_bias (Hb, L + S - 1) contiguous or empty (0) for none.
BlockedForward batched_forward(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& relative_bias,
                               const BlockedSpec& spec);

/// The backward of batched_forward: the steps of blocked_backward, one
/// batched call per step for each range of (n, key/value head) pairs; the
/// weights from `kept` (batched_forward's) or recomputed.
BlockedGradients batched_backward(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec,
    const torch::Tensor& kept, const torch::Tensor& grad_out,
    const torch::Tensor& grad_weights);

}  // namespace mha::detail
