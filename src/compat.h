// Internal (not installed): the one place where mha branches on the
// LibTorch version.
//
// Every version gate of the project lives in this header, each with a note
// of what differs and since which version; they test
// MHA_TORCH_VERSION_AT_LEAST from the public mha/version.h.
#pragma once

#include <torch/torch.h>

#include <variant>

#include "mha/version.h"

// LibTorch's fused `at::scaled_dot_product_attention` (flash / memory-
// efficient kernels on CUDA, flash on CPU) exists from 2.0 and takes `scale`
// from 2.1, but only from 2.5 on does a fully masked row give output 0 (and
// zero gradient) instead of NaN, as DESIGN.md requires. Older versions use
// mha's explicit softmax path for every call.
#if MHA_TORCH_VERSION_AT_LEAST(2, 5)
#define MHA_HAS_FUSED_SDPA 1
#else
#define MHA_HAS_FUSED_SDPA 0
#endif

// mha-bench's projections+SDPA contender (tools/bench/bench_sdpa.cpp) calls
// LibTorch's public `at::scaled_dot_product_attention`, new in 2.0 (1.13
// has only the internal `_scaled_dot_product_attention`). Below 2.0 its
// rows say "n/a (LibTorch < 2.0)".
#if MHA_TORCH_VERSION_AT_LEAST(2, 0)
#define MHA_HAS_TORCH_SDPA 1
#else
#define MHA_HAS_TORCH_SDPA 0
#endif

// c10d (src/train/distributed.cpp): from 2.0 the collective backends such as
// ProcessGroupGloo derive from c10d::Backend (ProcessGroup became a
// dispatcher over backends); in 1.x they derive from c10d::ProcessGroup.
#if MHA_TORCH_VERSION_AT_LEAST(2, 0)
#define MHA_C10D_BACKEND_CLASS 1
#else
#define MHA_C10D_BACKEND_CLASS 0
#endif

// c10d's TCPStore uses its libuv server by default from 2.4
// (TCPStoreOptions::useLibUV = true), and fails to start where LibTorch was
// built without libuv (Debian's 2.6 and 2.14). mha asks for the classic
// server, present in every version.
#if MHA_TORCH_VERSION_AT_LEAST(2, 4)
#define MHA_TCPSTORE_HAS_LIBUV_OPTION 1
#else
#define MHA_TCPSTORE_HAS_LIBUV_OPTION 0
#endif

namespace mha::detail {

/// The alternative T held by one of LibTorch's variants (such as
/// torch::nn::activation_t), or nullptr. LibTorch 1.13 has its own
/// c10::variant, 2.x std::variant; argument-dependent lookup picks the
/// matching get_if without naming a version.
template <class T, class Variant>
const T* variant_get_if(const Variant& variant) {
  using std::get_if;
  return get_if<T>(&variant);
}

#if MHA_HAS_FUSED_SDPA
/// softmax(query·keyᵀ·scale + mask)·value through LibTorch's fused kernel.
/// `mask` is additive (query's dtype, broadcastable to (..., L, S)) or
/// undefined; `is_causal` is top-left and must not be combined with a mask
/// (LibTorch refuses both at once).
inline torch::Tensor fused_sdpa(const torch::Tensor& query,
                                const torch::Tensor& key,
                                const torch::Tensor& value,
                                const torch::Tensor& mask, double dropout_p,
                                bool is_causal, double scale) {
  c10::optional<torch::Tensor> attn_mask;
  if (mask.defined()) {
    attn_mask = mask;
  }
  return at::scaled_dot_product_attention(query, key, value, attn_mask,
                                          dropout_p, is_causal, scale);
}
#endif

}  // namespace mha::detail
