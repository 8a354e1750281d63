// Internal: the attention step shared by the public function and the modules,
// after their inputs have been checked. Not installed.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <functional>

namespace mha::detail {

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
};

/// softmax(query · keyᵀ · scale + mask) · value with fully masked rows set to
/// 0. `mask` is additive (0 / -inf / any float) of query's dtype,
/// broadcastable to (..., L, S), or undefined; `is_causal` blocks key j for
/// query i when j > i (top-left), on top of `mask`. Inputs are assumed
/// checked; kAverage needs 4-D (N, H, L, E) inputs. 4-D key and value may
/// have fewer heads Hkv than query's H, dividing it (grouped-query
/// attention): query head h then attends with key/value head h / (H / Hkv).
///
/// Three paths with the same results within the dtype's tolerance:
/// - without weights, LibTorch's fused kernel where it meets the semantics
///   (LibTorch >= 2.5, see compat.h);
/// - on CPU in float32/float64 without dropout, blocked attention
///   (blocked_attention below);
/// - otherwise the explicit softmax path, which accumulates the softmax of
///   float16 / bfloat16 scores in float32.
AttentionResult attention_core(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value,
                               const torch::Tensor& mask, bool is_causal,
                               double dropout_p, double scale,
                               WeightsMode weights);

/// The explicit path: whole (..., L, S) score and weight tensors.
AttentionResult explicit_attention(const torch::Tensor& query,
                                   const torch::Tensor& key,
                                   const torch::Tensor& value,
                                   const torch::Tensor& mask, bool is_causal,
                                   double dropout_p, double scale,
                                   WeightsMode weights);

/// True when blocked_attention handles these inputs: CPU, float32 or
/// float64, no dropout, 2-D to 4-D inputs with L, S > 0, and a mask that
/// needs no gradient.
bool blocked_attention_applies(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& mask, double dropout_p);

/// Whether blocked attention keeps each block's weights for backward.
enum class KeptWeights {
  kAuto,    ///< when a gradient is needed and N·H·L·S <= 2^20
  kAlways,  ///< always, N·H·L·S scores of memory (for tests)
  kNever,   ///< backward recomputes them block by block
};

/// Blocked attention: for each (batch, head), query rows in blocks of
/// `block_rows` (0: chosen from S), scores of one block at a time in a
/// reused buffer, scale folded into the GEMM, mask, causal block and softmax
/// applied in place, keys right of the diagonal skipped when causal; blocks
/// spread over ATen's threads (for_each_item). Backward (a custom autograd
/// function) uses each block's weights kept by forward or, for large
/// problems (`kept`), recomputes them block by block: memory then
/// O(block_rows · S) per thread besides the inputs and outputs. Same
/// contract as attention_core, without dropout.
AttentionResult blocked_attention(const torch::Tensor& query,
                                  const torch::Tensor& key,
                                  const torch::Tensor& value,
                                  const torch::Tensor& mask, bool is_causal,
                                  double scale, WeightsMode weights,
                                  int64_t block_rows = 0,
                                  KeptWeights kept = KeptWeights::kAuto);

/// Calls body(item, scratch) for every item in [0, items), where scratch is
/// a tensor of `scratch_elements` with `options` for the calling thread's
/// use. On ATen's intra-op threads (at::get_num_threads()) when there are
/// several, items >= threads, this is not already a parallel region, and
/// the BLAS can run single threaded on each (blas_threads.h): thread t of T
/// takes items t, t + T, ..., so neighbouring items (causal blocks of
/// growing width) are spread over the threads. Otherwise in order on this
/// thread, with BLAS's own threads. Items must write disjoint outputs. The
/// caller's thread-local state (grad mode, inference mode) holds on every
/// thread; an exception in body is rethrown here. Returns the number of
/// threads used (1: in order on this thread).
int64_t for_each_item(int64_t items, int64_t scratch_elements,
                      const torch::TensorOptions& options,
                      const std::function<void(int64_t, torch::Tensor&)>& body);

/// Checks that `mask` (already dtype/device checked) broadcasts to `target`
/// without growing: at most as many dims, each size equal or 1.
void check_broadcastable(const torch::Tensor& mask, const char* name,
                         torch::IntArrayRef target, const char* target_name);

}  // namespace mha::detail
