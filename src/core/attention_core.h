// Internal: the attention step shared by the public function and the modules,
// after their inputs have been checked. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <limits>

#include "core/blas_threads.h"
#include "mha/flex_attention.h"
#include "mha/version.h"

namespace mha::detail {

/// -inf, the score of a position a query does not attend to.
constexpr double kNegInf = -std::numeric_limits<double>::infinity();

/// Which attention weights an attention step returns.
enum class WeightsMode {
  kNone,     ///< none (undefined tensor): the fastest path
  kPerHead,  ///< (..., L, S), one map per leading index
  kAverage,  ///< (N, L, S): the mean over dim 1 (heads) of 4-D inputs
};

/// The result of one attention step.
struct AttentionResult {
  torch::Tensor output;   // (..., L, Ev)
  torch::Tensor weights;  // as WeightsMode, after dropout, or undefined
  torch::Tensor lse;      // (..., L) when FlexMods::return_lse, else undefined
};

/// FlexAttention's parts of a call (mha/flex_attention.h), on top of the
/// mask and positions every call has: a score modification applied to the
/// scaled scores (after a relative bias, before the masks), and a block mask
/// whose unvisited blocks are skipped and whose partial blocks are masked
/// by its mask_mod. Calls with one take the blocked path or, where it does
/// not apply, the explicit one.
struct FlexMods {
  ScoreMod score_mod;    ///< empty: none
  BlockMask block_mask;  ///< empty: none
  /// The leaves requiring grad that score_mod's result depends on (through
  /// captured tensors), found by flex_captured_leaves: the blocked path's
  /// backward returns their gradients.
  std::vector<torch::Tensor> captured;
  /// Also return each row's logsumexp (AttentionResult::lse).
  bool return_lse = false;

  bool active() const {
    return bool(score_mod) || !block_mask.empty() || return_lse;
  }
};

/// The leaves requiring grad that score_mod's result reaches through its
/// autograd graph, found by calling it once on one element (b = h = q_idx =
/// kv_idx = 0) with grad mode on; empty when grad mode is off or there is
/// none. `options`: the scores' dtype and device.
std::vector<torch::Tensor> flex_captured_leaves(
    const ScoreMod& score_mod, const torch::TensorOptions& options);

/// score_mod's result on `score` (any shape) with its index tensors, checked
/// and made score's shape and dtype (a copy). Throws c10::Error naming the
/// mod when it throws, returns a non-floating tensor or a shape that does
/// not broadcast to score's.
torch::Tensor call_score_mod(const ScoreMod& score_mod,
                             const torch::Tensor& score, const torch::Tensor& b,
                             const torch::Tensor& h, const torch::Tensor& q_idx,
                             const torch::Tensor& kv_idx);

/// mask_mod's result (true = may attend) expanded to `shape`, checked as
/// call_score_mod's (bool only).
torch::Tensor call_mask_mod(const MaskMod& mask_mod, const torch::Tensor& b,
                            const torch::Tensor& h, const torch::Tensor& q_idx,
                            const torch::Tensor& kv_idx,
                            torch::IntArrayRef shape);

/// Which keys each query sees, and biases that depend on positions only,
/// beyond an explicit mask. Query row i sits at key position i + diagonal
/// (0: top-left alignment; S - L: bottom-right, the last query row at the
/// last key, as in cached decoding).
struct KeyPositions {
  /// Implicit from is_causal: top-left causal or nothing.
  KeyPositions(bool causal_ = false) : causal(causal_) {}  // NOLINT

  /// Block key j when j > i + diagonal.
  bool causal = false;
  /// See above; any value, including negative.
  int64_t diagonal = 0;
  /// > 0: block key j when |i + diagonal - j| >= window (with causal: the
  /// window keys up to and including position i + diagonal). 0: no limit.
  int64_t window = 0;
  /// Undefined, or (Hb, L + S - 1) of query's dtype, Hb 1 or the query's
  /// head count H (4-D inputs; else 1): entry [h][j - i + L - 1] is added
  /// to the score of query i and key j in head h, a bias that depends on
  /// j - i only (ALiBi, T5's relative bias) stored in O(H (L + S)). May
  /// need a gradient.
  torch::Tensor relative_bias;

  /// True when nothing beyond top-left causal (or nothing) is asked for.
  bool plain() const {
    return diagonal == 0 && window == 0 && !relative_bias.defined();
  }
  /// The range of visible keys of query row i: [begin(i), end(i)) clamped to
  /// [0, S) by the caller.
  int64_t begin(int64_t i) const {
    return window > 0 ? i + diagonal - window + 1
                      : std::numeric_limits<int64_t>::min() / 2;
  }
  int64_t end(int64_t i) const {
    return causal       ? i + diagonal + 1
           : window > 0 ? i + diagonal + window
                        : std::numeric_limits<int64_t>::max() / 2;
  }
};

/// Dense (L, S) additive mask (0 / -inf) of `positions`' causal and window
/// limits, or undefined when it has none.
torch::Tensor key_positions_mask(const KeyPositions& positions, int64_t L,
                                 int64_t S,
                                 const torch::TensorOptions& options);

/// (rows, cols) int64 with [r][c] = c - r + offset: where the score of
/// query row row0 + r and key col0 + c reads a relative bias of L + S - 1
/// entries (KeyPositions::relative_bias) when offset = col0 - row0 + L - 1.
/// On `device`.
torch::Tensor relative_bias_index(int64_t rows, int64_t cols, int64_t offset,
                                  torch::Device device = torch::kCPU);

/// Dense (Hb, L, S) of `positions.relative_bias` (Hb, L + S - 1):
/// [h][i][j] = relative_bias[h][j - i + L - 1]; differentiable.
torch::Tensor dense_relative_bias(const torch::Tensor& relative_bias, int64_t L,
                                  int64_t S);

/// The paths that can compute one attention call; every one gives the same
/// result within the dtype's tolerance. choose_path picks one.
enum class AttentionPath {
  kFused,     ///< LibTorch's at::scaled_dot_product_attention (>= 2.5)
  kBlocked,   ///< blocked_attention below: CPU, float32/float64, no dropout
  kExplicit,  ///< explicit_attention below: whole (..., L, S) scores, any
              ///< device and dtype; float16/bfloat16 softmax in float32
};

/// "fused", "blocked", "explicit".
const char* to_string(AttentionPath path);

/// N·H·L·S, the scores of a call: every leading dim of `query` (..., L, D)
/// times L times `key_length` (S). What the size limits of choose_path and
/// blocked_attention count.
int64_t score_count(const torch::Tensor& query, int64_t key_length);

/// How many of OpenBLAS's threads run the work items of blocked_attention's
/// float32 calls of at least kOpenBlasScores scores (blocked_attention.h)
/// now: min(at::get_num_threads(), openblas_pool_threads()) where
/// onednn_products_available() and that is at least 2, otherwise 0 (the
/// items then run on ATen's threads or in order: spread_items).
int openblas_item_threads();

/// What choose_path looks at: the properties of one call, never its data.
struct AttentionCall {
  torch::DeviceType device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
  int64_t dims = 4;          ///< query.dim()
  int64_t query_length = 1;  ///< L
  int64_t key_length = 1;    ///< S
  int64_t scores = 1;        ///< N·H·L·S (all leading dims times L·S)
  bool grouped = false;      ///< 4-D key/value with fewer heads than query
  double dropout_p = 0.0;
  WeightsMode weights = WeightsMode::kNone;
  bool plain_positions = true;      ///< KeyPositions::plain()
  bool mask_requires_grad = false;  ///< the additive mask needs a gradient
  /// The LibTorch build has the fused kernel with mha's semantics
  /// (has_fused_sdpa(), LibTorch >= 2.5); a field so that the choice can be
  /// shown for every version, and turned off for a recomputation.
  bool fused_available = has_fused_sdpa();
  /// The loaded BLAS keeps its idle workers spinning after a call
  /// (openblas_workers_spin(), blas_threads.h); a field for the same reasons.
  bool blas_workers_spin = openblas_workers_spin();
  /// The blocked path runs the items of large enough float32 calls on
  /// OpenBLAS's threads (openblas_item_threads() >= 2); a field for the
  /// same reasons.
  bool items_on_openblas = openblas_item_threads() >= 2;

  /// The properties of attention_core's arguments.
  static AttentionCall of(const torch::Tensor& query, const torch::Tensor& key,
                          const torch::Tensor& mask,
                          const KeyPositions& positions, double dropout_p,
                          WeightsMode weights);
};

/// Calls of at most this many scores (N·H·L·S) take the blocked path where
/// it applies, before LibTorch's fused kernel. Measured (mha-bench,
/// LibTorch 2.14.1, CPU, 2 threads, OpenBLAS 0.3.34; docs/speed.md at
/// 5cc4c3b): at (2, 128, 256, 4) mha / torch::nn 0.93 fused -> 0.84 blocked
/// over the five modes without weights (forward+backward 1.04 -> 0.93); at
/// 512 Ki and 1 Mi scores blocked faster or within the noise in every mode,
/// at 4 Mi scores sometimes much slower ((1, 1024, 256, 4) inference
/// 0.80 -> 1.07).
constexpr int64_t kBlockedFirstScores = int64_t{1} << 20;

/// Calls of at least this many scores (N·H·L·S) also take the blocked path
/// where it applies, before LibTorch's fused kernel. Measured (mha-bench,
/// LibTorch 2.14.1, CPU, 2 threads, OpenBLAS 0.3.34, both paths forced in
/// alternating runs; docs/speed.md at 5cc4c3b): from 32 Mi scores the
/// blocked path was faster or within the noise in every mode at eight shapes
/// of 32 Mi to 256 Mi scores ((4, 1024, 512, 8) to (1, 8192, 256, 4); at
/// (1, 4096, 256, 4) forward+backward 0.62-0.66 of projections + SDPA
/// against 0.99-1.14 fused); between 1 Mi and 32 Mi it was clearly slower
/// at some shapes ((1, 1024, 256, 4) and (1, 2048, 256, 4) forward
/// 1.13-1.15 against 1.01-1.03), so those calls keep the fused kernel.
constexpr int64_t kBlockedLargeScores = int64_t{1} << 25;

/// Where the loaded OpenBLAS keeps its idle workers spinning after a call
/// (openblas_workers_spin, blas_threads.h: 0.3.27 or later on x86-64, more
/// than one thread), calls of at most kInOrderKeys keys (S) take the
/// blocked path where it applies (choose_path), and, where their items
/// cannot run on OpenBLAS's own threads (item_threads: products not all
/// oneDNN's), run them in order whatever their size (spread_items), each
/// GEMM on BLAS's own threads. Why: after the
/// in-projection's GEMM that worker keeps one of the cores busy for tens of
/// milliseconds, and a loop over ATen's threads runs at about half speed until
/// it stops; in order, the worker does the GEMMs' work instead. Where the core
/// takes much longer than that spell, ATen's threads win once the worker
/// sleeps. Measured (mha-bench, LibTorch 2.14.1, OpenBLAS 0.3.34, 2 threads,
/// three alternating runs; docs/speed.md at 5cc4c3b): mha / torch::nn
/// spread -> in order at (4, 1024, 512, 8) forward 0.55-0.61 -> 0.46,
/// forward+backward 0.70-0.73 -> 0.63-0.66; at (8, 256, 512, 8) with weights
/// 0.87-0.88 -> 0.80-0.81. At S = 2048 in order lost ((4, 2048, 512, 8)
/// forward 351 -> 374-379 ms), and (1, 8192, 256, 4) lost in every mode.
/// Between kBlockedFirstScores and kBlockedLargeScores, the blocked path in
/// order against the fused kernel (five shapes of 4 Mi to 16 Mi scores, five
/// modes, two alternating runs): mha's time 1-20 % lower in 24 of 25 cells
/// ((8, 512, 512, 8) forward 85-94 -> 76-79 ms, mha / projections+SDPA
/// 1.01-1.12 -> 0.92-0.93); one cell 3 % higher, (1, 1024, 256, 4)
/// forward+backward (0.96 -> 0.99-1.00 of projections+SDPA).
constexpr int64_t kInOrderKeys = 1024;

/// The fused kernel applies: built in (LibTorch >= 2.5), no weights asked
/// for (it returns none), and no position limits or bias beyond top-left
/// causal (it takes only is_causal).
bool fused_applies(const AttentionCall& call);

/// The blocked path applies: CPU, float32 or float64, no dropout, 2-D to 4-D
/// inputs with L, S > 0, and a mask that needs no gradient.
bool blocked_applies(const AttentionCall& call);

/// Whether a bfloat16 / float16 CPU call may run on the blocked core in
/// float32 (converted in and out): where blocked_applies would to the same
/// call in float32.
bool half_through_float32_applies(const AttentionCall& call);

/// The path attention_core takes: the first that applies of
/// 1. blocked, when key/value heads are grouped (read in place there), the
/// call has at most kBlockedFirstScores or at least kBlockedLargeScores
/// scores, at most kInOrderKeys keys where BLAS's workers spin, or is
/// float32 with its items on OpenBLAS's threads (items_on_openblas);
/// 2. fused; 3. blocked; 4. explicit.
/// One exception depends on data, not on the call: on CPU a fused result
/// holding NaN (a score that overflowed to +inf at a blocked key) is
/// recomputed on the path chosen with fused_available = false.
AttentionPath choose_path(const AttentionCall& call);

/// The path the calling thread's latest attention_core call took (after
/// the NaN recomputation above); kExplicit before any call. For reports
/// such as mha-bench's.
AttentionPath last_attention_path();

/// softmax(query · keyᵀ · scale + mask) · value with fully masked rows set to
/// 0. `mask` is additive (0 / -inf / any float) of query's dtype,
/// broadcastable to (..., L, S), or undefined; `positions` adds its limits
/// and bias on top of `mask` (a bool is_causal converts: key j > query i
/// blocked, top-left). Inputs are assumed
/// checked; kAverage needs 4-D (N, H, L, E) inputs. 4-D key and value may
/// have fewer heads Hkv than query's H, dividing it (grouped-query
/// attention): query head h then attends with key/value head h / (H / Hkv).
/// Computed on the path choose_path picks; a bfloat16 / float16 CPU call
/// that would take the explicit path runs on the blocked core in float32
/// instead (half_through_float32_applies). `packed`: undefined, or a tensor
/// (or a view of one) whose views query, key and value are, disjoint and
/// together all of it, such as the fused in-projection's output split into
/// heads; the blocked path then computes their gradients into one tensor
/// laid out like it (no copies to undo the views), where query, key and
/// value are still views of it (not after a rotation). The caller
/// guarantees the disjointness. `flex`: null, or FlexMods for 4-D inputs
/// (active ones take the blocked path where it applies, else the explicit
/// one; a relative bias in `positions` is added before score_mod).
AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value,
                               const torch::Tensor& mask,
                               const KeyPositions& positions, double dropout_p,
                               double scale, WeightsMode weights,
                               const torch::Tensor& packed = {},
                               const FlexMods* flex = nullptr);

/// The explicit path: whole (..., L, S) score and weight tensors. With
/// `flex` (4-D inputs), its score_mod and block mask applied to them.
AttentionResult explicit_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& mask,
    const KeyPositions& positions, double dropout_p, double scale,
    WeightsMode weights, const FlexMods* flex = nullptr);

/// Whether blocked attention keeps each block's weights for backward.
enum class KeptWeights {
  kAuto,    ///< when a gradient is needed and the call has at most 2^20
            ///< scores (N·H·L·S)
  kAlways,  ///< always, N·H·L·S scores of memory (for tests)
  kNever,   ///< backward recomputes them block by block
};

/// Blocked attention: for each (batch, head), query rows in blocks of
/// `block_rows` (0: chosen from S), scores of one block at a time in a
/// reused buffer, scale folded into the GEMM, mask, position limits and bias
/// and softmax applied in place, only the columns a block's rows can see
/// computed (right of the diagonal when causal, outside the window); blocks
/// spread over OpenBLAS's or ATen's threads (item_threads). Backward (a custom
/// autograd function) uses the weights kept by forward (`kept`: by default for
/// calls of at most 2^20 scores) or recomputes them block by block: memory then
/// O(block_rows · S) per thread besides the inputs and outputs. Calls with
/// L <= 32 and N·H·L·S <= 2^20 (a decoding step, short chunks) and
/// block_rows 0 are one block of all heads instead: each step one batched
/// call per share of the (n, key/value head) pairs, the grouped query heads
/// stacked by rows, no per-head calls. Same contract as attention_core,
/// without dropout; `packed` and `flex` as attention_core's. With an
/// active `flex`, a block is one query block of its block mask (or
/// block_rows as above where it has none) and its columns the keys of the
/// visited key blocks, side by side; its mask_mod is evaluated on the
/// partial blocks once, before the items (PartialMasks, blocked_attention.h);
/// nothing is kept for backward, and the items run on ATen's threads or in
/// order where they call a mod (user code: a score_mod, or mask_mod where
/// the partial blocks' flags were over their budget), else as a built-in
/// call's.
AttentionResult blocked_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& mask,
    const KeyPositions& positions, double scale, WeightsMode weights,
    int64_t block_rows = 0, KeptWeights kept = KeptWeights::kAuto,
    const torch::Tensor& packed = {}, const FlexMods* flex = nullptr);

/// Where for_each_item runs its work items.
enum class ItemThreads : int64_t {
  /// In order on the calling thread, BLAS on its own threads.
  kCaller = 0,
  /// Spread over ATen's intra-op threads (at::get_num_threads()), BLAS
  /// held to one thread (SingleThreadedBlas) meanwhile.
  kAten = 1,
  /// Spread over OpenBLAS's own threads (run_on_openblas_threads,
  /// blas_threads.h), each holding its OpenMP thread count at 1. The body
  /// must make no BLAS call: its products go through oneDNN.
  kOpenBlas = 2,
};

/// Calls body(item, scratch) for every item in [0, items), where scratch is
/// a tensor of `scratch_elements` with `options` for the calling thread's
/// use, on the threads `where` names:
/// - kAten where there are several, items >= threads, this is not already
///   a parallel region, and the BLAS can run single threaded on each
///   (blas_threads.h): thread t of T takes items t, t + T, ..., so that
///   neighbouring items (causal blocks of growing width) are spread;
/// - kOpenBlas where min(at::get_num_threads(), openblas_pool_threads()) >=
///   2, items >= 2, this is not already a parallel region (ATen's or
///   OpenMP's) and no other call of this kind is running (OpenBLAS would
///   queue the second behind the first's workers): each thread takes the
///   next item not yet taken;
/// - otherwise in order on this thread, with BLAS's own threads.
/// Items must write disjoint outputs. The caller's thread-local state (grad
/// mode, inference mode) holds on every thread; an exception in body is
/// rethrown here. Returns the number of threads used (1: in order on this
/// thread). With one_omp_thread, items run in order hold the calling
/// thread's OpenMP thread count at 1 meanwhile (restored after), so that a
/// library on OpenMP (oneDNN) runs each call of the body on this thread
/// alone (kOpenBlas's threads always do). A thread's scratch of at most
/// kKeptScratchBytes on the CPU is its kept buffer (see there): its values
/// on entry are whatever an earlier call left.
int64_t for_each_item(int64_t items, int64_t scratch_elements,
                      const torch::TensorOptions& options,
                      const std::function<void(int64_t, torch::Tensor&)>& body,
                      ItemThreads where = ItemThreads::kAten,
                      bool one_omp_thread = false);

/// The most bytes of scratch a thread keeps between for_each_item calls:
/// its largest CPU scratch up to this stays allocated (one buffer per
/// thread: each of ATen's and OpenBLAS's threads and each calling thread),
/// larger ones are allocated for the call. 4 MiB is the blocked path's
/// float32 forward block (about 2^20 scores); a backward's three such
/// blocks are not kept. Allocated anew for every call, the forward's
/// block was often handed back to the kernel by glibc and paid a page
/// fault for each 4 KiB on first touch: kept, the (1, 4096, 512, 8)
/// inference forward took 167 ms against 181 and (1, 8192, 256, 4) 300
/// against 305 (medians of 5 alternating processes, 1.13, 2 threads, on
/// a virtual machine where a fault costs 6-12 µs; docs/speed.md at
/// 5cc4c3b, "The forward's scratch kept between calls"); causal and
/// forward+backward did not move.
constexpr int64_t kKeptScratchBytes = int64_t{4} << 20;

/// Bytes of scratch the threads keep now (for_each_item), over all threads.
int64_t kept_scratch_bytes();

/// Frees the scratch every thread keeps, except a buffer a running
/// for_each_item holds; returns the bytes freed. mha-bench calls it before
/// it measures a peak, so that the peak counts the scratch the call needs.
int64_t release_kept_scratch();

/// Where the calling thread's latest for_each_item ran its items (kCaller
/// when in order, also when asked for another pool that could not be used
/// then); kCaller before any call. For tests and reports.
ItemThreads last_item_threads();

/// Whether blocked_attention spreads the work items of a call of `scores`
/// scores (N·H·L·S) and `keys` keys (S) over ATen's threads when it cannot
/// use OpenBLAS's (item_threads): above kSpreadScores (blocked_attention.h),
/// unless keys <= kInOrderKeys (above) where OpenBLAS's idle workers spin;
/// always while a SpreadEveryCall of kAten lives.
bool spread_items(int64_t scores, int64_t keys);

/// Where blocked_attention runs the work items of a call of `scores` scores
/// and `keys` keys, `onednn` telling whether its products can all go
/// through oneDNN: on OpenBLAS's threads where they can, the call has at
/// least kOpenBlasScores scores (blocked_attention.h) and two or more of
/// OpenBLAS's threads can take them (openblas_item_threads, the same test
/// as AttentionCall::items_on_openblas); otherwise on ATen's where
/// spread_items says so, else in order. While a SpreadEveryCall lives,
/// calls of every size go where it says (kOpenBlas only where `onednn`).
ItemThreads item_threads(int64_t scores, int64_t keys, bool onednn);

/// For tests: while an instance lives (on any thread), blocked_attention
/// spreads the work items of calls of every size over the threads `over`
/// names (kAten or kOpenBlas), so that small inputs cover the parallel
/// loops. Instances may overlap; while one of kOpenBlas lives, it wins.
class SpreadEveryCall {
 public:
  explicit SpreadEveryCall(ItemThreads over = ItemThreads::kAten);
  ~SpreadEveryCall();
  SpreadEveryCall(const SpreadEveryCall&) = delete;
  SpreadEveryCall& operator=(const SpreadEveryCall&) = delete;

 private:
  ItemThreads over_;
};

/// Checks that `mask` (already dtype/device checked) broadcasts to `target`
/// without growing: at most as many dims, each size equal or 1.
void check_broadcastable(const torch::Tensor& mask, const char* name,
                         torch::IntArrayRef target, const char* target_name);

}  // namespace mha::detail
