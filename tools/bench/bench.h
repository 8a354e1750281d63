// The measuring part of mha-bench: mha, torch::nn and (LibTorch >= 2.0)
// projections + at::scaled_dot_product_attention on the same weights and
// inputs, each checked against torch::nn once, then timed in interleaved
// repetitions, with peak memory and dense FLOP counts (bench.cpp, and
// bench_defs.cpp for shapes, modes, FLOPs and statistics). bench_tool.h is
// the command line and the report around it.
//
// Glossary: N batch, L sequence length (self-attention: S = L), E embed_dim,
// H num_heads, F dim_feedforward (4E in the encoder-layer rows).
#pragma once

#include <torch/torch.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace mha::bench {

/// One benchmarked size.
struct Shape {
  int64_t batch = 1;      ///< N
  int64_t length = 1;     ///< L (= S)
  int64_t embed_dim = 1;  ///< E
  int64_t num_heads = 1;  ///< H
};

/// "N,L,E,H" → Shape; nullopt (and `error` set) unless four positive integers
/// with E divisible by H.
std::optional<Shape> parse_shape(const std::string& text, std::string& error);
/// "(N,L,E,H)".
std::string to_string(const Shape& shape);

/// What one row measures. Every module is in eval() (dropout off) and both
/// contenders get the same seq-first input (L, N, E) (mha with
/// batch_first=false), self-attention.
enum class Mode {
  kForward,          ///< "fwd": need_weights=false, autograd on
  kForwardWeights,   ///< "fwd-weights": need_weights=true (averaged)
  kCausal,           ///< "causal": mha is_causal=true; torch::nn a float
                     ///< (L, L) mask, -inf above the diagonal
  kForwardBackward,  ///< "fwd-bwd": loss = sum(out * fixed random), grads
                     ///< of input and parameters
  kInference,        ///< "inference": under NoGradGuard, need_weights=false
  kEncoder,          ///< "encoder": TransformerEncoderLayer, F = 4E, post-norm
                     ///< seq-first relu, inference (NoGradGuard)
};

/// Every mode in report order.
const std::vector<Mode>& all_modes();
/// "fwd", "fwd-weights", "causal", "fwd-bwd", "inference", "encoder".
const char* name(Mode mode);
/// One line saying what the mode runs.
const char* description(Mode mode);
/// The mode called `text`, or nullopt.
std::optional<Mode> parse_mode(const std::string& text);

/// Dense floating-point operations of one repetition:
///   projections 8·N·L·E² (Q, K, V, out) + attention 4·N·L·S·E,
///   plus 4·N·L·E·F for the encoder layer's feed-forward;
///   ×3 when the repetition includes the backward pass.
/// Causal rows count the full L×S (no credit for skipped blocks).
double dense_flops(const Shape& shape, Mode mode);

/// Median, quartiles and extremes of timing samples (ms).
struct Stats {
  double median = 0, min = 0, max = 0, q1 = 0, q3 = 0;
  std::vector<double> samples;  ///< in the order measured
};
/// Summary of `samples` (not empty); quartiles by linear interpolation.
Stats summarize(std::vector<double> samples);

/// How peak memory is measured.
enum class MemoryMethod {
  /// In process: write "5" to /proc/self/clear_refs (resets VmHWM to the
  /// current RSS), run once, read VmHWM; minus VmRSS before the run (after
  /// malloc_trim, so freed heap memory is not counted as in use).
  kClearRefs,
  /// Each measurement in a fresh child process (fork + exec of this tool):
  /// VmHWM after one run minus VmRSS before it; includes the one-time
  /// allocations of a first run.
  kFork,
  /// Not measured (CUDA: host RSS says nothing about device memory).
  kNone,
};
/// "clear_refs", "fork" or "none".
const char* name(MemoryMethod method);
/// True when this process may write /proc/self/clear_refs.
bool clear_refs_writable();

/// A field of /proc/self/status in KiB (e.g. "VmRSS", "VmHWM"); -1 if absent.
int64_t proc_status_kib(const std::string& field);

/// What every row shares.
struct Settings {
  torch::Device device = torch::kCPU;
  torch::ScalarType dtype = torch::kFloat32;
  /// Untimed runs per contender before timing (>= 1); the first one
  /// measures peak memory and its results are compared.
  int warmup = 1;
  /// Timed repetitions per contender; 0 = automatic: as many as fit in
  /// `budget_s` for the pair, at least `min_reps`, at most `max_reps`.
  int reps = 0;
  double budget_s = 2.0;
  int min_reps = 3;
  int max_reps = 31;
  uint64_t seed = 0;
  MemoryMethod memory = MemoryMethod::kClearRefs;
  /// kFork: the command line of a child that measures one contender; the
  /// child arguments (`--memory-child N,L,E,H:MODE:CONTENDER`) are appended.
  std::vector<std::string> child_command;
  /// Self-test: shifts one bias element of mha's copy and of the SDPA
  /// contender's: every check fails; batched decoding leaves out the
  /// padding mask (BatchedDecodeOptions::plant_fault).
  bool plant_fault = false;
};

/// One contender's outcome in a row.
struct ContenderResult {
  /// "ok", "OOM" (ran out of memory; the row goes on without it),
  /// "error" (threw something else), "skipped" (the check failed), or
  /// "n/a" (this contender cannot run the row: the SDPA one below LibTorch
  /// 2.0 or where weights are asked for).
  std::string status = "ok";
  /// The exception text for "OOM" / "error", the reason for "skipped" and
  /// "n/a" (e.g. "LibTorch < 2.0").
  std::string error;
  Stats time_ms;                   ///< empty samples unless status is "ok"
  double gflops = 0;               ///< dense_flops / median time
  std::optional<double> peak_mib;  ///< above the RSS before the run
};

/// The comparison of a contender's results (mha's, or the SDPA one's) with
/// torch::nn's, before timing.
struct Check {
  bool done = false;    ///< false when a contender could not run
  bool passed = false;  ///< every tensor within tolerance
  /// Compared tensors ("output", "weights", "grad input", "grad <param>").
  std::vector<std::string> compared;
  double max_abs = 0;  ///< max |mha - torch::nn| over every tensor
  /// max |mha - torch::nn| / max |torch::nn| of the worst tensor.
  double max_rel = 0;
  std::string worst;  ///< the tensor where max_rel occurs
  double atol = 0, rtol = 0;
};

/// One (shape, mode) row.
struct RowResult {
  Shape shape;
  Mode mode = Mode::kForward;
  double flops = 0;
  int warmup = 0;  ///< untimed runs per contender
  int reps = 0;    ///< timed runs per contender
  Check check;
  ContenderResult mha;
  /// The attention path mha's first run took ("fused", "blocked",
  /// "explicit": mha::detail::last_attention_path), or "-" if it did not run.
  std::string path = "-";
  ContenderResult torch_nn;
  std::optional<double> ratio;  ///< mha median / torch::nn median
  /// The third contender (LibTorch >= 2.0): torch::nn's weights through the
  /// packed in-projection, at::scaled_dot_product_attention (is_causal in
  /// causal rows) and out_proj; in encoder rows inside torch::nn's layer.
  /// "n/a" in fwd-weights rows (SDPA returns no weights).
  ContenderResult sdpa;
  Check sdpa_check;                  ///< its results against torch::nn's
  std::optional<double> sdpa_ratio;  ///< mha median / sdpa median
  /// mha peak / torch::nn peak, when torch::nn's is at least 1 MiB.
  std::optional<double> memory_ratio;
};

/// Builds the contenders (same seed, weights copied from torch::nn to mha
/// and to the SDPA contender), runs each once (untimed) measuring peak
/// memory, compares mha's and the SDPA contender's results with torch::nn's
/// (a row where mha differs is not timed; an SDPA contender that differs is
/// not timed), then times A B C A B C ...
/// Never throws for a contender's failure (recorded in the result).
RowResult run_row(const Shape& shape, Mode mode, const Settings& settings);

/// The child side of MemoryMethod::kFork: builds the row as run_row does,
/// runs `contender` ("mha", "torch_nn" or "sdpa") once and returns the peak in
/// KiB above the RSS before the run.
int64_t child_peak_kib(const Shape& shape, Mode mode,
                       const std::string& contender, const Settings& settings);

/// Waits for the device's queued work (CUDA); returns at once on the CPU.
void synchronize(const torch::Device& device);

/// torch::mm of two (n, n) matrices: median GFLOP/s (2n³ per product) over
/// `reps` runs after one warm-up. On the CPU in float32 where the blocked
/// path's products go through oneDNN (onednn_products_available), the same
/// product through oneDNN's dnnl_sgemm on the same threads too, timed the
/// same way: the ceiling is the faster of the two (mha's own products can
/// run at oneDNN's speed, above torch::mm's where its BLAS is slower).
struct Gemm {
  int64_t n = 0;
  int reps = 0;
  double median_ms = 0;
  double gflops = 0;
  double onednn_median_ms = 0;  ///< 0: not measured
  double onednn_gflops = 0;     ///< 0: not measured

  /// The GEMM ceiling: the higher of gflops and onednn_gflops.
  double ceiling_gflops() const { return std::max(gflops, onednn_gflops); }
};
Gemm measure_gemm(int64_t n, int reps, const Settings& settings);

/// One length of the sliding-window rows: MultiHeadAttention (E, H) causal
/// self-attention under NoGradGuard, N = 1, with the `window` option and
/// without it, timed alternately (median ms of `reps` runs each).
struct WindowRow {
  int64_t length = 0;  ///< L
  int64_t window = 0;
  double windowed_ms = 0;
  double full_ms = 0;
};
/// The rows for each length in `lengths` (settings: device, dtype, seed).
std::vector<WindowRow> measure_window(const std::vector<int64_t>& lengths,
                                      int64_t window, int64_t embed_dim,
                                      int64_t num_heads, int reps,
                                      const Settings& settings);

/// One row of the projections table: for a self-attention mode (not the
/// encoder) at one shape, torch::nn's in- and out-projection alone (the
/// value rows of the packed in-projection go straight to out_proj, no
/// attention between: the work every contender shares) timed interleaved
/// with mha and torch::nn (median ms of `reps` runs each, after one warm-up
/// each).
struct ProjectionRow {
  Shape shape;
  Mode mode = Mode::kForward;
  int reps = 0;
  double projections_ms = 0;      ///< through torch::linear
  double mha_projections_ms = 0;  ///< through mha's projection
  double torch_nn_ms = 0;
  double mha_ms = 0;
};
/// The rows for each shape in `shapes` and each self-attention mode in
/// `modes`; settings.reps <= 0: as many as fit in settings.budget_s
/// (settings.min_reps to settings.max_reps).
std::vector<ProjectionRow> measure_projections(const std::vector<Shape>& shapes,
                                               const std::vector<Mode>& modes,
                                               const Settings& settings);

/// Generation with mha-train's default char LM (CharLMOptions(65, 64):
/// rotary, window 64; random weights, seeded): `new_tokens` greedy
/// characters after a random `prompt`-character prompt, through the KV
/// caches and by recomputing every step, timed alternately on the CPU in
/// float32 (median s of `reps` runs each).
struct Generation {
  int64_t prompt = 0;
  int64_t new_tokens = 0;
  int reps = 0;
  double cached_s = 0;
  double recomputed_s = 0;
  bool identical = false;  ///< the same characters both ways
};
Generation measure_generation(int64_t prompt, int64_t new_tokens, int reps,
                              uint64_t seed);

/// The model of the batched-decoding rows (bench_batched_decode.cpp): one
/// Llama-like self-attention, MultiHeadAttention(embed_dim, num_heads)
/// with num_kv_heads grouped key/value heads, rotary (half pairing,
/// rotary_theta), no biases; random weights (seeded), eval, NoGradGuard,
/// float32 on the settings' device.
struct BatchedDecodeOptions {
  int64_t embed_dim = 512;    ///< E
  int64_t num_heads = 8;      ///< H
  int64_t num_kv_heads = 2;   ///< Hkv
  double rotary_theta = 1e4;  ///< rotary base
  int64_t max_prompt = 64;    ///< P: prompt lengths in [P/2, P]
  int64_t new_tokens = 32;    ///< G decoding steps per sequence
  int reps = 5;               ///< timed runs of each way (after one untimed)
  double tolerance = 1e-5;    ///< max |batched - alone| allowed (float32)
  /// Self-test (Settings::plant_fault): the batched way passes no
  /// key_padding_mask, so the pads are attended: the check fails.
  bool plant_fault = false;
};

/// One batch size of the batched-decoding table. Two ways decode the same
/// B prompts (random embeddings (P_b, E), P_b drawn in [P/2, P]; with
/// B > 1 the first is P long and the last P/2):
///   batched: one KVCache (B, capacity max P_b + G); the prompts
///     left-padded (random pad embeddings) to max P_b in one prefill
///     call with key_padding_mask (true at the pads) and positions
///     cumsum(keep) - 1 (pads at 0), as Hugging Face's generate; then G
///     forward_cached calls of (B, 1, E) with the padding mask over cache
///     + new token and positions P_b + g;
///   one at a time: each prompt alone in a cleared batch-1 KVCache (default
///     positions, no mask), then its G steps of (1, 1, E).
/// Each step's input is layer_norm(x + y) (no affine) of the previous
/// step's input x and output y at the sequence's last token, so the steps
/// form an autoregressive chain. Prefill and decode are timed separately
/// (synchronised): decode tokens/s = B·G / decode time.
struct BatchedDecodeRow {
  int64_t batch = 0;                    ///< B
  std::vector<int64_t> prompt_lengths;  ///< P_b
  double batched_prefill_ms = 0;        ///< medians over the timed runs
  double batched_decode_ms = 0;
  double single_prefill_ms = 0;  ///< one at a time: sum over the prompts
  double single_decode_ms = 0;
  /// Every timed run's decode ms, in the order measured.
  std::vector<double> batched_decode_samples_ms, single_decode_samples_ms;
  /// max |batched - alone| over the prompts' real tokens and every decode
  /// step's output, of the untimed first run.
  double max_abs_diff = 0;
  bool passed = false;  ///< max_abs_diff <= tolerance
};
BatchedDecodeRow measure_batched_decode(int64_t batch,
                                        const BatchedDecodeOptions& options,
                                        const Settings& settings);

/// True when mha-bench was built against LibTorch >= 2.0, whose public
/// at::scaled_dot_product_attention the projections+SDPA contender calls.
bool sdpa_available();

/// True when `e` says an allocation failed (CPU or CUDA).
bool is_out_of_memory(const std::exception& e);

}  // namespace mha::bench
