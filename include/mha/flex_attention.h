// Programmable attention: score and mask functions written by the user, and
// block-sparse masks that let the core skip the blocks no query may see.
//
// Semantics: PyTorch's FlexAttention (`torch.nn.attention.flex_attention`,
// PyTorch >= 2.5;
// https://pytorch.org/docs/stable/nn.attention.flex_attention.html, and the
// blog post "FlexAttention: The Flexibility of PyTorch with the Performance of
// FlashAttention", 2024). Python runs it on CPU compiled and forward only;
// mha's is C++, eager (no compile step), with backward.
//
// !!! A MaskMod returns bool TRUE where the query MAY ATTEND to the key:
// !!! Python FlexAttention's convention, so that mask functions port
// !!! verbatim. It is the OPPOSITE of mha's bool masks (attn_mask,
// !!! key_padding_mask: true = blocked).
#pragma once

#include <torch/torch.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "mha/fused_kernels.h"

namespace mha {

/// A score modification: returns the modified scores of some set of
/// (batch, head, query, key) elements. A small value class: either an eager
/// function of tensors (constructible from the same callables as the
/// std::function it once was, so existing code compiles unchanged) or a
/// fused mod (fused_score_mod: compiled into the CPU core's tile loop, and
/// callable with tensors everywhere else).
///
/// The eager form's arguments:
///   score: the scaled scores q·kᵀ·scale of the elements (float32 or
///     float64; any shape the core picks: a tile, a row block, all heads).
///   b, h, q_idx, kv_idx: int64 index tensors broadcastable against score:
///     the batch, the QUERY head, the query position and the key position of
///     each element. Only in-range indices are ever passed (q_idx < L,
///     kv_idx < S), so a mod may index captured tensors with them.
/// Returns: the modified scores, broadcastable to score's shape; a floating
/// result of another dtype is converted to the scores' dtype.
///
/// Write it with ATen's elementwise ops and indexing, as the Python function
/// is written: the core may call it on any set of elements, so it must act
/// element by element. It may capture tensors (a learned bias table, ALiBi
/// slopes): gradients reach every captured tensor that requires grad (found
/// through the autograd graph of one probing call; see flex_attention).
///
/// Example (Gemma 2's soft-capping, Python `softcap * tanh(score / softcap)`):
///   mha::ScoreMod softcap = [](const torch::Tensor& score, const
///   torch::Tensor&,
///                              const torch::Tensor&, const torch::Tensor&,
///                              const torch::Tensor&) {
///     return 30.0 * torch::tanh(score / 30.0);
///   };
/// The same as a fused mod (the way to write one that needs no learned
/// tensor; see fused_score_mod):
///   auto softcap = mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
///     return 30 * mha::fused::tanh(s / 30);
///   });
class ScoreMod {
 public:
  /// The eager form's signature.
  using Function = std::function<torch::Tensor(
      const torch::Tensor& score, const torch::Tensor& b,
      const torch::Tensor& h, const torch::Tensor& q_idx,
      const torch::Tensor& kv_idx)>;

  /// No mod.
  ScoreMod() = default;
  /// No mod (as std::function from nullptr).
  ScoreMod(std::nullptr_t) {}  // NOLINT: as std::function
  /// An eager mod from any callable of Function's signature.
  template <class F,
            std::enable_if_t<!std::is_same_v<std::decay_t<F>, ScoreMod> &&
                                 std::is_constructible_v<Function, F>,
                             int> = 0>
  ScoreMod(F f) : tensor_form_(std::move(f)) {}  // NOLINT: implicit
  /// A fused mod: its tensor form and its compiled kernel (fused_score_mod
  /// makes both).
  ScoreMod(Function tensor_form,
           std::shared_ptr<const detail::FusedScoreKernel> kernel)
      : tensor_form_(std::move(tensor_form)), kernel_(std::move(kernel)) {}

  /// The mod on tensors (a fused mod's tensor form). Throws c10::Error when
  /// empty.
  torch::Tensor operator()(const torch::Tensor& score, const torch::Tensor& b,
                           const torch::Tensor& h, const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const {
    TORCH_CHECK(bool(tensor_form_), "ScoreMod: called while empty");
    return tensor_form_(score, b, h, q_idx, kv_idx);
  }
  /// True unless empty.
  explicit operator bool() const { return bool(tensor_form_); }
  /// The compiled kernel of a fused mod, or null for an eager one.
  const detail::FusedScoreKernel* fused() const { return kernel_.get(); }

  /// Empty (as std::function's comparison with nullptr).
  friend bool operator==(const ScoreMod& m, std::nullptr_t) { return !m; }
  /// Not empty.
  friend bool operator!=(const ScoreMod& m, std::nullptr_t) { return bool(m); }

 private:
  Function tensor_form_;
  std::shared_ptr<const detail::FusedScoreKernel> kernel_;
};

/// A mask predicate: bool, TRUE = the query MAY ATTEND to the key (Python
/// FlexAttention's convention, the OPPOSITE of mha's bool masks). A value
/// class as ScoreMod: an eager function of tensors or a fused mod
/// (fused_mask_mod). The eager form's indices are as ScoreMod's; its result
/// must broadcast against them. It must act element by element too:
/// flex_attention's CPU core calls it once per query block of the block
/// mask, on that block's partial key blocks side by side, with b (B, 1, 1,
/// 1) and h (1, Hq, 1, 1) where the block mask is shared by the batches or
/// heads (a mod that reads neither is evaluated once for all).
///
/// Example (causal, Python `q_idx >= kv_idx`):
///   mha::MaskMod causal = [](const torch::Tensor&, const torch::Tensor&,
///                            const torch::Tensor& q_idx,
///                            const torch::Tensor& kv_idx) {
///     return q_idx >= kv_idx;
///   };
/// The same fused:
///   auto causal = mha::fused_mask_mod(
///       [](auto, auto, auto q, auto kv) { return q >= kv; });
class MaskMod {
 public:
  /// The eager form's signature.
  using Function = std::function<torch::Tensor(
      const torch::Tensor& b, const torch::Tensor& h,
      const torch::Tensor& q_idx, const torch::Tensor& kv_idx)>;

  /// No mask.
  MaskMod() = default;
  /// No mask (as std::function from nullptr).
  MaskMod(std::nullptr_t) {}  // NOLINT: as std::function
  /// An eager mask from any callable of Function's signature.
  template <class F,
            std::enable_if_t<!std::is_same_v<std::decay_t<F>, MaskMod> &&
                                 std::is_constructible_v<Function, F>,
                             int> = 0>
  MaskMod(F f) : tensor_form_(std::move(f)) {}  // NOLINT: implicit
  /// A fused mask: its tensor form and its compiled kernel (fused_mask_mod
  /// makes both).
  MaskMod(Function tensor_form,
          std::shared_ptr<const detail::FusedMaskKernel> kernel)
      : tensor_form_(std::move(tensor_form)), kernel_(std::move(kernel)) {}

  /// The mask on tensors (a fused mask's tensor form). Throws c10::Error
  /// when empty.
  torch::Tensor operator()(const torch::Tensor& b, const torch::Tensor& h,
                           const torch::Tensor& q_idx,
                           const torch::Tensor& kv_idx) const {
    TORCH_CHECK(bool(tensor_form_), "MaskMod: called while empty");
    return tensor_form_(b, h, q_idx, kv_idx);
  }
  /// True unless empty.
  explicit operator bool() const { return bool(tensor_form_); }
  /// The compiled kernel of a fused mask, or null for an eager one.
  const detail::FusedMaskKernel* fused() const { return kernel_.get(); }
  /// The kernel shared (and_masks / or_masks keep fused masks fused).
  const std::shared_ptr<const detail::FusedMaskKernel>& fused_kernel() const {
    return kernel_;
  }

  /// Empty.
  friend bool operator==(const MaskMod& m, std::nullptr_t) { return !m; }
  /// Not empty.
  friend bool operator!=(const MaskMod& m, std::nullptr_t) { return bool(m); }

 private:
  Function tensor_form_;
  std::shared_ptr<const detail::FusedMaskKernel> kernel_;
};

namespace detail {
/// A fused mod's result as a tensor: a TensorValue's, or a number's as a
/// 0-dim tensor with `like`'s options (bool for a bool).
template <class R>
torch::Tensor fused_result(const R& r, const torch::Tensor& like) {
  if constexpr (fused::kIsTensor<R>) {
    return r.t;
  } else {
    static_assert(fused::kIsNumber<R>,
                  "a fused mod must return a value of the mod's family");
    if constexpr (std::is_same_v<fused::Plain<R>, bool>) {
      return torch::scalar_tensor(r, like.options().dtype(torch::kBool));
    } else {
      return torch::scalar_tensor(static_cast<double>(r), like.options());
    }
  }
}
}  // namespace detail

/// A fused score mod: `f(score, b, h, q_idx, kv_idx)`, every parameter
/// `auto`, written once with + - * /, comparisons, numbers and namespace
/// mha::fused (exp, log, tanh, sigmoid, sqrt, abs, min, max, clamp, where,
/// lookup). The CPU core calls it inside its tile loop on a run of keys of
/// one query row, key by key in a loop the compiler vectorises: score a
/// float32 or float64 score, kv_idx, b, h (the QUERY head) and q_idx
/// int64_t (the fused::Pack types take the same lambda); backward instantiates
/// it with fused::Dual numbers for its derivative by the score (ATen's
/// convention at kinks: fused.h). Every other path calls its tensor form (f on
/// fused::TensorValue). No `if` on an argument (use where); a captured
/// tensor read with lookup gets no gradient (a learned table: write an
/// eager ScoreMod). Semantics: Python FlexAttention's score_mod.
///
/// Example (Gemma 2's soft-capping, Python `30 * tanh(score / 30)`):
///   auto softcap = mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
///     return 30 * mha::fused::tanh(s / 30);
///   });
template <class F>
ScoreMod fused_score_mod(F f) {
  // Probed here, on the caller's thread: the kernels may run where ATen
  // must not be called (fused_math.h).
  (void)fused::detail::probe_clamp_passes_at_bounds();
  auto kernel = std::make_shared<const detail::fused_rows::ScoreKernelOf<F>>(f);
  ScoreMod::Function tensor_form =
      [f](const torch::Tensor& s, const torch::Tensor& b,
          const torch::Tensor& h, const torch::Tensor& q,
          const torch::Tensor& kv) {
        using fused::TensorValue;
        return detail::fused_result(
            f(TensorValue{s}, TensorValue{b}, TensorValue{h}, TensorValue{q},
              TensorValue{kv}),
            s);
      };
  return ScoreMod(std::move(tensor_form), std::move(kernel));
}

/// A fused mask mod: `f(b, h, q_idx, kv_idx)` -> mask, TRUE = may attend;
/// every parameter `auto`; comparisons of indices, & | ! to combine them,
/// lookup. As fused_score_mod: kv_idx a fused::IndexPack in the CPU core,
/// fused::TensorValue in the tensor form. Semantics: Python FlexAttention's
/// mask_mod.
///
/// Example (a sliding window of 256 keys, causal):
///   auto window = mha::fused_mask_mod([](auto, auto, auto q, auto kv) {
///     return (q >= kv) & (q - kv < 256);
///   });
template <class F>
MaskMod fused_mask_mod(F f) {
  auto kernel = std::make_shared<const detail::fused_rows::MaskKernelOf<F>>(f);
  MaskMod::Function tensor_form = [f](const torch::Tensor& b,
                                      const torch::Tensor& h,
                                      const torch::Tensor& q,
                                      const torch::Tensor& kv) {
    using fused::TensorValue;
    return detail::fused_result(
        f(TensorValue{b}, TensorValue{h}, TensorValue{q}, TensorValue{kv}), b);
  };
  return MaskMod(std::move(tensor_form), std::move(kernel));
}

/// Which (query block, key block) pairs a call visits, as Python's BlockMask:
/// for each batch b and head h (size 1 broadcasts) and query block i, the
/// key blocks some element of which may attend, split into partial blocks
/// (mask_mod is called on their elements) and full blocks (every element may
/// attend: mask_mod is not called there). Query block i holds the query rows
/// [i·block_q, (i + 1)·block_q) ∩ [0, q_len), key block j the keys
/// [j·block_kv, (j + 1)·block_kv) ∩ [0, kv_len). As in Python, the mask is
/// padded with false to whole blocks: a block that runs past q_len or kv_len
/// is never full. A default-constructed BlockMask is no mask (every key
/// visible); build one with create_block_mask or create_document_block_mask.
struct BlockMask {
  int64_t q_len = 0;     ///< the query length it was made for
  int64_t kv_len = 0;    ///< the key length it was made for
  int64_t block_q = 0;   ///< query rows per block
  int64_t block_kv = 0;  ///< keys per block
  /// int32 (B, H, nq): the number of partial key blocks of each query
  /// block; nq = ceil(q_len / block_q).
  torch::Tensor kv_num_blocks;
  /// int32 (B, H, nq, nkv): the partial blocks' indices, ascending, in the
  /// first kv_num_blocks entries of each row (the rest: the other blocks,
  /// as Python pads them); nkv = ceil(kv_len / block_kv).
  torch::Tensor kv_indices;
  /// As kv_num_blocks, for the full blocks (undefined: none).
  torch::Tensor full_kv_num_blocks;
  /// As kv_indices, for the full blocks (undefined: none).
  torch::Tensor full_kv_indices;
  /// The predicate the partial blocks are evaluated with.
  MaskMod mask_mod;

  /// True for a default-constructed (empty) mask.
  bool empty() const { return !kv_num_blocks.defined(); }
  /// Percent of (query block, key block) pairs skipped, over all (b, h), as
  /// Python's BlockMask.sparsity(): 100 · (1 − visited / all).
  double sparsity() const;
  /// bool (B, H, nq, nkv): true where the block is visited (partial or full).
  torch::Tensor to_dense() const;
};

/// Builds a BlockMask by evaluating `mask_mod` block by block (one query
/// block against all keys at a time, never a (q_len, kv_len) tensor), as
/// Python's create_block_mask.
///
/// Args:
///   mask_mod: true = may attend.
///   B, H: the batch and head extents to evaluate; nullopt (Python's None)
///     is size 1, shared by every batch or head (mask_mod then sees b = 0 or
///     h = 0).
///   q_len, kv_len: > 0.
///   block_q: query rows per block (> 0); block_kv: keys per block, default
///     block_q.
/// Throws c10::Error for non-positive sizes, or a mask_mod that throws,
/// returns a non-bool tensor or one that does not broadcast to
/// (block_q, kv_len).
BlockMask create_block_mask(MaskMod mask_mod, c10::optional<int64_t> B,
                            c10::optional<int64_t> H, int64_t q_len,
                            int64_t kv_len, int64_t block_q = 128,
                            c10::optional<int64_t> block_kv = c10::nullopt);

/// Elements that every one of `mods` allows (Python's and_masks; no mods:
/// every element). Throws c10::Error for an empty function among them.
MaskMod and_masks(std::vector<MaskMod> mods);
/// Elements that any of `mods` allows (Python's or_masks; no mods: none).
/// Throws c10::Error for an empty function among them.
MaskMod or_masks(std::vector<MaskMod> mods);
/// Every element allowed (Python's noop_mask).
MaskMod noop_mask();

/// The document of each token of a packed sequence: int64 (sum(lengths)),
/// token t in document d when sum(lengths[:d]) <= t < sum(lengths[:d + 1]).
/// `lengths`: 1-D integer tensor of positive lengths. Throws c10::Error
/// otherwise.
torch::Tensor document_ids(const torch::Tensor& lengths);

/// Tokens attend within their own document (and, when `causal`, to earlier
/// tokens of it): doc[q_idx] == doc[kv_idx] (&& q_idx >= kv_idx).
MaskMod document_mask(const torch::Tensor& lengths, bool causal);

/// The BlockMask of document_mask(lengths, causal) over sum(lengths) tokens,
/// with block_q = block_kv = block, built from the lengths in
/// O(number of blocks) without calling the mask (the same tensors
/// create_block_mask gives).
BlockMask create_document_block_mask(const torch::Tensor& lengths, bool causal,
                                     int64_t block = 128);

/// FlexAttention: s = query·keyᵀ·scale; s = score_mod(s, b, h, q, k) where
/// block_mask's mask_mod allows (and its block is visited), -inf elsewhere;
/// output = softmax(s)·value.
///
/// Args:
///   query: (B, Hq, L, E) float32 or float64 (CPU: the blocked core; any
///     floating dtype or device: a materialised path, see docs/flex.md).
///   key: (B, Hkv, S, E), value: (B, Hkv, S, Ev), query's dtype and device.
///   score_mod: empty for none.
///   block_mask: empty for none (every key visible); otherwise made for
///     q_len = L and kv_len = S, B and H of size 1 or the call's B and Hq.
///   scale: default 1/sqrt(E).
///   enable_gqa: Hq % Hkv == 0 and query head h reads key/value head
///     h / (Hq / Hkv); without it Hq must equal Hkv.
///   return_lse: also return the logsumexp of each row's modified, masked
///     scores (natural log; differentiable: d lse / d score is the score's
///     weight, so a loss on lse reaches query, key and the captured tensors
///     as it would through torch::logsumexp of the scores).
/// Returns: (output (B, Hq, L, Ev) of query's dtype, lse (B, Hq, L) float32
/// for float32 and float64 for float64 inputs, or undefined unless
/// return_lse).
///
/// A query row that may see no key (every score -inf after the mods and the
/// mask) gets output 0 and lse -inf, never NaN, and zero gradient.
/// Gradients reach query, key, value and every tensor score_mod captures
/// that requires grad (found through one probing call of score_mod; a
/// captured tensor computed from leaves passes the gradient to those
/// leaves). Memory beyond inputs and outputs: one block of rows times the
/// visited keys per thread, forward and backward.
///
/// Throws c10::Error for: inputs not 4-D, mismatched batch, E, S, dtype or
/// device; Hq != Hkv without enable_gqa, or Hq not a multiple of Hkv; a
/// block_mask made for other lengths (naming both) or other B / H; a mod
/// that throws (on any thread), returns a non-floating score (or a non-bool
/// mask) or a shape that does not broadcast.
///
/// Example (causal soft-capped attention, as Gemma 2):
///   auto q = torch::randn({1, 8, 256, 64});
///   auto k = torch::randn({1, 8, 256, 64}), v = torch::randn({1, 8, 256, 64});
///   auto causal = mha::create_block_mask(
///       [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
///          const torch::Tensor& kv) { return q >= kv; },
///       c10::nullopt, c10::nullopt, 256, 256);
///   auto [out, lse] = mha::flex_attention(
///       q, k, v,
///       [](const torch::Tensor& s, const torch::Tensor&, const torch::Tensor&,
///          const torch::Tensor&, const torch::Tensor&) {
///         return 50.0 * torch::tanh(s / 50.0);
///       },
///       causal);
std::tuple<torch::Tensor, torch::Tensor> flex_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const ScoreMod& score_mod = {},
    const BlockMask& block_mask = {},
    c10::optional<double> scale = c10::nullopt, bool enable_gqa = false,
    bool return_lse = false);

}  // namespace mha
