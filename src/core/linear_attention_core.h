// Internal: the core of linear-cost attention (mha/linear_attention.h) that
// the public function and the module's kLinear / kPerformer kinds share:
// the sums of linear attention, read by queries, grown by keys, and the
// causal form by blocks. Not installed.
//
// Glossary: L query length, S key length, F features per head (φ's output),
// D head_dim, Dv value features, C block length, "..." leading dims (for
// the module (N, Hkv, G) with G = H / Hkv on queries and 1 on keys: the
// sums broadcast over the query heads of a group).
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>

namespace mha::detail {

/// The features of queries or keys, φ(x) (..., T, F), or their logarithms
/// (`log`): the Performer's features are exponentials, kept as exponents
/// until shifts that keep them in range are known (LinearSums::offset).
struct Features {
  torch::Tensor values;  // (..., T, F)
  bool log = false;
};

/// The state of linear attention after some keys (Katharopoulos et al.,
/// 2020, eq. 10-11): kv = Σ_j φ(k_j) v_jᵀ (..., F, Dv) and k = Σ_j φ(k_j)
/// (..., F). With log features, row f of both is kept times
/// exp(-offset_f), offset (..., F) the largest exponent of feature f over
/// the keys so far (-inf before any key counts): every sum then stays in
/// range, and a query's features are shifted by the same offsets, so the
/// products are unchanged. Empty (undefined kv) = no keys yet.
struct LinearSums {
  torch::Tensor kv;      // (..., F, Dv)
  torch::Tensor k;       // (..., F)
  torch::Tensor offset;  // (..., F), log features only
  bool empty() const { return !kv.defined(); }
};

/// `sums` with the keys `keys` (..., S, F) and their values (..., S, Dv)
/// added (the non-causal sums, or a decoding step's); differentiable in
/// every input (the offsets are constants).
LinearSums add_keys(const LinearSums& sums, const Features& keys,
                    const torch::Tensor& values);

/// Every query row (..., L, F) against the sums: φ(q)ᵀ kv / (φ(q)ᵀ k),
/// (..., L, Dv); a row with denominator 0 gets 0. Log query features are
/// shifted by the sums' offsets and then by each row's largest (a factor
/// per row, which cancels in the ratio). `sums` must not be empty; queries
/// and keys both plain or both log.
torch::Tensor read_sums(const Features& queries, const LinearSums& sums);

/// Causal linear attention over aligned queries and keys: row i of
/// `queries` (..., T, F) sees keys 0..i of `keys` (..., T, F) and whatever
/// `sums` holds (earlier positions; may be empty). Blocks of `block` rows:
/// inside a block the masked (C, C) product, across blocks the running
/// sums (log features: offsets of each block the running maximum up to
/// its end). Returns (..., T, Dv); when `sums_out` is given, it receives
/// the sums after all T keys (the decoding state). Differentiable in the
/// features, the values and both sums. On the CPU in float32 and float64
/// each head walks its blocks on one thread (causal_products); otherwise
/// causal_linear_attention_aten.
torch::Tensor causal_linear_attention(const Features& queries,
                                      const Features& keys,
                                      const torch::Tensor& values,
                                      const LinearSums& sums, int64_t block,
                                      LinearSums* sums_out = nullptr);

/// causal_linear_attention in ATen ops on any device and dtype, every
/// block's sums and products as batched tensors; past 16 blocks, groups of
/// 16 blocks one after another, the sums carried from group to group
/// (differentiable in the sums too). Public for the tests, which compare
/// the two forms.
torch::Tensor causal_linear_attention_aten(
    const Features& queries, const Features& keys, const torch::Tensor& values,
    const LinearSums& sums, int64_t block, LinearSums* sums_out = nullptr);

/// The features of rows [begin, begin + length) of queries or keys, made
/// when a segment needs them (linear_attention_by_segments).
using SegmentFeatures = std::function<Features(int64_t begin, int64_t length)>;

/// The most memory one segment's query features (and the module's
/// in-projection) take in an inference segment (segment_rows): 8 MiB; in
/// float32 at E = 256, 4 heads, 1088 rows of the Performer's 266 features,
/// 2048 of linear attention's 64.
constexpr int64_t kSegmentBytes = int64_t{8} << 20;

/// The rows of a segment whose features take `row_bytes` per row: as many
/// as keep them within kSegmentBytes, a multiple of `block`, at least one
/// block (SegmentRowsForTests sets them).
int64_t segment_rows(int64_t row_bytes, int64_t block);

/// For tests: while an instance lives (on any thread), segment_rows gives
/// `rows` (a multiple of the block), so that short sequences take several
/// segments.
class SegmentRowsForTests {
 public:
  explicit SegmentRowsForTests(int64_t rows);
  ~SegmentRowsForTests();
  SegmentRowsForTests(const SegmentRowsForTests&) = delete;
  SegmentRowsForTests& operator=(const SegmentRowsForTests&) = delete;
};

/// Whether a call of L queries and S keys takes
/// linear_attention_by_segments with segments of `rows` rows: without
/// autograd (GradMode off), with keys to read (S >= 1; causal: S >= L), and
/// more rows than one segment.
bool by_segments(int64_t L, int64_t S, bool causal, int64_t rows);

/// Linear attention for inference, the features made `rows` rows at a
/// time: the same result as the whole sequence's features at once (to
/// rounding), with memory for one segment's features instead of (..., L,
/// F) of each (at L = 64k, 4 heads, the Performer's 266 features, float32:
/// under 8 MiB instead of 1.1 GB of exponents and features). `queries(b, n)`
/// and `keys(b, n)` give the features of rows b..b+n-1 (both plain or both
/// log), values (..., S, Dv). Causal (S >= L; key rows from L on are never
/// seen): causal_linear_attention segment after segment, the sums carried
/// (`rows` a multiple of `block`, so the blocks are the whole sequence's).
/// Non-causal: add_keys segment after segment, then read_sums segment
/// after segment (S >= 1). Starts from `sums` (may be empty); `sums_out`
/// receives the sums after all keys. Returns (..., L, Dv). For calls
/// without autograd: a graph through the carried sums would take the
/// batched ATen form.
torch::Tensor linear_attention_by_segments(
    const SegmentFeatures& queries, const SegmentFeatures& keys,
    const torch::Tensor& values, int64_t L, bool causal, const LinearSums& sums,
    int64_t rows, int64_t block, LinearSums* sums_out = nullptr);

/// An uninitialized (sizes) tensor for a whole sequence's output, written
/// once a segment at a time. On Linux, when it takes at least
/// kHugeOutputBytes on the CPU, its memory is advised MADV_HUGEPAGE
/// (madvise(2); transparent huge pages in `madvise` or `always` mode): the
/// first touch then faults once per 2 MiB instead of per 4 KiB page.
/// glibc maps blocks that large fresh on every allocation (its mmap
/// threshold stops rising at 32 MiB), and at 4 KiB per fault filling a
/// fresh (1, 64k, 256) float32 output took 220-460 ms on this project's
/// VM, against 11-160 ms advised (docs/linear.md).
torch::Tensor empty_sequence_output(torch::IntArrayRef sizes,
                                    const torch::TensorOptions& options);

/// 32 MiB: from there empty_sequence_output advises huge pages.
constexpr int64_t kHugeOutputBytes = int64_t{32} << 20;

/// The causal products of linear attention, walked block by block on the
/// CPU (src/core/linear_attention_kernel.cpp): for each leading item n,
///   forward: out_t = Σ_{j <= t} (a_t · D(t, j) b_j) c_jᵀ,
///   reverse: out_t = Σ_{j >= t} (a_t · D(j, t) b_j) c_jᵀ,
/// plus a_tᵀ D(t, start) state_in (forward) or a_tᵀ D(end, t) state_in
/// (reverse, the sums at the last block's offsets). D(t, j) is the product of
/// the decay factors of the blocks after j's up to t's (1 inside a block),
/// scaling the sums' rows (Fa, decay_rows) or columns (Fc): the log
/// features' offsets moving from block to block (Features). With a = φ(q),
/// b = φ(k), c = [v, 1] it is causal linear attention's numerator and
/// denominator (normalize: each row divided by its last column); the
/// gradients are the same walks (causal_linear_products): dq = forward(g,
/// [v, 1], k) on columns, dk = reverse([v, 1], g, q) on columns, dv =
/// reverse(k, q, g) on rows.
struct CausalProducts {
  torch::Tensor a;         // (N, T, Fa), unit stride along Fa
  torch::Tensor b;         // (N, T, Fa), unit stride along Fa
  torch::Tensor c;         // (N, T, Fc), unit stride along Fc
  torch::Tensor decay;     // (N, B, Fa or Fc), B = ceil(T / block); or none
  bool decay_rows = true;  // decay scales the sums' rows (Fa), else columns
  bool reverse = false;
  int64_t block = 64;      // C
  torch::Tensor state_in;  // (N, Fa, Fc) starting sums; or none
  bool normalize = false;  // forward only: out (N, T, Fc - 1) = the first
                           // Fc - 1 columns over the last (0 where it is 0)
};

/// In the backward of a form with first derivatives only: an error when
/// grad mode is on there (a backward with create_graph=true, whose second
/// derivative would otherwise be silently missing). `what` names the
/// form.
void check_first_derivatives_only(const char* what);

/// Whether causal_products takes tensors like x: CPU float32 or float64.
bool causal_products_apply(const torch::Tensor& x);

/// out (N, T, Fc) of CausalProducts (normalize: (N, T, Fc - 1), and `den`
/// (N, T) receives the last column), every item's walk on one thread
/// (for_each_item), the products by gemm_matrix; `state_out`, when given,
/// receives the sums after the walk (N, Fa, Fc). No autograd.
torch::Tensor causal_products(const CausalProducts& p, torch::Tensor* state_out,
                              torch::Tensor* den = nullptr);

/// Causal linear attention's rows y = num / den (N, T, E) (0 where den is
/// 0) from q = φ(q) (N, T, F), k = φ(k) (N, T, F) and v (..., T, E) (any
/// layout, N = the product of its leading dims; copied once), the
/// normalized forward walk of causal_products(q, k, [v, 1]), as a
/// differentiable function of q, k, v and state_in (N, F, E + 1) (the
/// starting sums [kv, k]; may be undefined), and so are the sums after
/// that `state_out` receives (N, F, E + 1). decay (N, B, F) is a constant
/// (may be undefined).
torch::Tensor causal_linear_products(const torch::Tensor& q,
                                     const torch::Tensor& k,
                                     const torch::Tensor& v,
                                     const torch::Tensor& decay,
                                     const torch::Tensor& state_in,
                                     int64_t block, torch::Tensor* state_out);

/// The block length C of the causal form: 64. Per row it costs
/// C·(F + Dv) for the block's own product and F·Dv / C for the sums kept
/// per block; 64 keeps both near the row's own F + Dv at the head sizes
/// of real models (D = 64..128, the Performer's F = D·ln D), and the
/// (C, C) products fit the caches (the Performer's F = 266 at D = 64:
/// C = 64 needs 110 kflop per row and head, C = 256 238 kflop, for about
/// the same memory).
int64_t causal_block_length(int64_t features, int64_t value_features);

/// FAVOR+'s exponents w_iᵀ x - |x|²/2 - log(m)/2 (..., T, m) of x
/// (..., T, D), random_features (m, D): favor_features = exp of them.
torch::Tensor favor_exponents(const torch::Tensor& x,
                              const torch::Tensor& random_features);

}  // namespace mha::detail
