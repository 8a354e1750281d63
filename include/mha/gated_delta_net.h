// Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2025, "Gated Delta Networks:
// Improving Mamba2 with Delta Rule", ICLR 2025): the linear attention of
// Qwen3-Next's linear_attention layers. Semantics and parameter names:
// transformers 5.x's Qwen3NextGatedDeltaNet
// (models/qwen3_next/modeling_qwen3_next.py).
//
// Per value head h and token t, with a state S (key_head_dim x
// value_head_dim) starting at 0:
//   S <- exp(g_t) S;  S <- S + k_t ⊗ β_t (v_t - S^T k_t);  o_t = S^T q_t
// where q, k are L2-normalised (eps 1e-6) and q scaled by key_head_dim^-1/2,
// β_t = sigmoid(b_t), g_t = -exp(A_log) · softplus(a_t + dt_bias); q, k and
// v pass a short causal depthwise convolution with SiLU first, and the
// output a gated RMSNorm (norm(o) · weight · SiLU(z)) before out_proj.
//
// Glossary: N batch, L (T) length, E embed_dim, Hk key heads, Hv value
// heads (a multiple of Hk; key heads are shared by Hv / Hk value heads), dk
// key_head_dim, dv value_head_dim, K conv_kernel_dim, C chunk_size.
#pragma once

#include <torch/torch.h>

#include "mha/multi_head_attention.h"  // NormWeight

namespace mha {

/// Options of GatedDeltaNet, named as Qwen3-Next's config keys without
/// their `linear_` prefix (embed_dim: hidden_size).
struct GatedDeltaNetOptions {
  /// embed_dim: E (> 0).
  explicit GatedDeltaNetOptions(int64_t embed_dim);

  /// Model width E.
  TORCH_ARG(int64_t, embed_dim);
  /// Hk (config linear_num_key_heads). Default 16.
  TORCH_ARG(int64_t, num_key_heads) = 16;
  /// Hv (config linear_num_value_heads), a multiple of num_key_heads.
  /// Default 32.
  TORCH_ARG(int64_t, num_value_heads) = 32;
  /// dk (config linear_key_head_dim). Default 128.
  TORCH_ARG(int64_t, key_head_dim) = 128;
  /// dv (config linear_value_head_dim). Default 128.
  TORCH_ARG(int64_t, value_head_dim) = 128;
  /// K, the causal convolution's width (config linear_conv_kernel_dim).
  /// Default 4.
  TORCH_ARG(int64_t, conv_kernel_dim) = 4;
  /// Epsilon of the gated RMSNorm (config rms_norm_eps). Default 1e-6.
  TORCH_ARG(double, norm_eps) = 1e-6;
  /// Tokens per chunk of forward's chunked form (> 0). Default 64 (as
  /// transformers' torch_chunk_gated_delta_rule).
  TORCH_ARG(int64_t, chunk_size) = 64;
  /// true: inputs (N, L, E); false: (L, N, E). Default true.
  TORCH_ARG(bool, batch_first) = true;
};

/// The decoding state of GatedDeltaNet: constant size, whatever the number
/// of tokens seen.
struct GatedDeltaNetState {
  /// (N, conv channels 2·Hk·dk + Hv·dv, K - 1): the convolution's inputs
  /// of the last K - 1 tokens (zeros before the first).
  torch::Tensor conv;
  /// (N, Hv, dk, dv): the delta rule's state S.
  torch::Tensor recurrent;
  /// Tokens seen.
  int64_t tokens = 0;
};

/// Gated DeltaNet (see the file comment).
///
/// Parameters (transformers' names): conv1d.weight (2·Hk·dk + Hv·dv, 1, K),
/// in_proj_qkvz.weight (2·Hk·dk + 2·Hv·dv, E), in_proj_ba.weight (2·Hv, E),
/// dt_bias (Hv), A_log (Hv), norm.weight (dv), out_proj.weight (E, Hv·dv).
/// The projections' rows are grouped per key head as the checkpoint's:
/// [q (dk) | k (dk) | v (Hv/Hk · dv) | z (Hv/Hk · dv)] and [b | a] (Hv/Hk
/// each).
class GatedDeltaNetImpl : public torch::nn::Cloneable<GatedDeltaNetImpl> {
 public:
  /// Builds the module; c10::Error naming the option for invalid ones.
  explicit GatedDeltaNetImpl(const GatedDeltaNetOptions& options_);

  /// The chunked form (training and prefill): x (N, L, E) ((L, N, E) if
  /// !batch_first); key_padding_mask: bool (N, L), true = padding: padded
  /// tokens are zeroed before the projections, as transformers. Returns
  /// (N, L, E) in x's layout. Computed in float32 for half inputs (float64
  /// for float64), as transformers' kernels. Differentiable. Time and
  /// memory linear in L (chunks of chunk_size in order); on the CPU each
  /// value head walks its chunks on one of ATen's threads, the short
  /// convolution channels last (src/core/delta_rule.h), subnormal numbers
  /// flushed to zero within the walk; inputs longer than 8192 tokens run
  /// in segments of whole chunks carrying the state (same results).
  /// c10::Error naming the argument for wrong shapes, dtypes or devices.
  torch::Tensor forward(const torch::Tensor& x,
                        const torch::Tensor& key_padding_mask = {});

  /// An empty decoding state for batch_size sequences (the parameters'
  /// dtype, float32 for half ones, and device).
  GatedDeltaNetState make_state(int64_t batch_size) const;

  /// Decoding: x (N, T, E) continues the sequences of `state` (updated in
  /// place); T = 1 takes the recurrent form, more tokens the chunked one
  /// from the state. Equal, within rounding, to forward on the whole
  /// sequence restricted to the new tokens. Returns (N, T, E) in x's
  /// layout. c10::Error for a state of another batch size or shape.
  torch::Tensor forward_cached(const torch::Tensor& x,
                               GatedDeltaNetState& state);

  /// Checks the options and (re)creates every parameter.
  void reset() override;

  /// Initialises the parameters: Linear layers and conv1d as torch::nn's,
  /// dt_bias 1, A_log log(U(0, 16)), norm.weight 1 (transformers' init).
  void reset_parameters();

  /// Prints the options.
  void pretty_print(std::ostream& stream) const override;

  /// The options this module was built with.
  GatedDeltaNetOptions options;

  torch::nn::Conv1d conv1d = nullptr;        ///< depthwise, no bias
  torch::nn::Linear in_proj_qkvz = nullptr;  ///< E -> 2·Hk·dk + 2·Hv·dv
  torch::nn::Linear in_proj_ba = nullptr;    ///< E -> 2·Hv
  torch::Tensor dt_bias;                     ///< (Hv)
  torch::Tensor A_log;                       ///< (Hv)
  NormWeight norm = nullptr;                 ///< (dv), the gated RMSNorm
  torch::nn::Linear out_proj = nullptr;      ///< Hv·dv -> E
};

/// Holder of GatedDeltaNetImpl.
TORCH_MODULE(GatedDeltaNet);

}  // namespace mha
