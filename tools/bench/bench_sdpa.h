// Internal to mha-bench's measuring (bench.cpp, bench_sdpa.cpp): what one
// contender's repetition is, the gradient helpers the forward+backward rows
// share, and the third contender, projections + LibTorch's fused
// at::scaled_dot_product_attention (LibTorch >= 2.0).
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench.h"

namespace mha::bench {

/// Named result tensors of one run: "output", "weights", "grad input",
/// "grad <parameter name>".
using Named = std::vector<std::pair<std::string, torch::Tensor>>;
/// One repetition of a contender.
using Run = std::function<Named()>;

/// Clears the gradients of `module`'s parameters and of `input` (set to
/// undefined, so no accumulation work or memory carries over between runs).
void clear_grads(torch::nn::Module& module, torch::Tensor& input);

/// The results of a forward+backward run: output, input and parameter grads
/// ("grad " + parameter name, for each parameter that has one).
Named backward_results(const torch::nn::Module& module,
                       const torch::Tensor& output, const torch::Tensor& input);

/// The projections+SDPA contender of one row: `run` empty when it cannot
/// run, with the reason in `unavailable` ("LibTorch < 2.0", or what the
/// mode asks that SDPA does not give).
struct SdpaContender {
  Run run;
  std::string unavailable;
};

/// Self-attention modes (fwd, fwd-weights, causal, fwd-bwd, inference) on
/// torch::nn's weights: x (L, N, E) seq-first → packed in-projection →
/// at::scaled_dot_product_attention on (N, H, L, D) heads (is_causal=true in
/// the causal rows, instead of torch::nn's (L, L) -inf mask) → out_proj.
/// fwd-bwd uses its own copy of the weights and its own input leaf (same
/// values) and returns the gradients under torch::nn's parameter names;
/// `grad_out` (L, N, E) is the fixed random upstream gradient of that mode
/// (undefined otherwise). fwd-weights is unavailable: SDPA returns no
/// attention weights. `plant_fault` (Settings::plant_fault) shifts one
/// element of its out_proj.bias, so its check must fail.
SdpaContender make_sdpa_attention(const torch::nn::MultiheadAttention& ref,
                                  const torch::Tensor& x,
                                  const torch::Tensor& grad_out, Mode mode,
                                  bool plant_fault);

/// The encoder mode: `ref`'s own post-norm ReLU layer (linear1, linear2,
/// norm1, norm2; dropout 0) with its self-attention computed as in
/// make_sdpa_attention, under NoGradGuard. x (L, N, E).
SdpaContender make_sdpa_encoder(const torch::nn::TransformerEncoderLayer& ref,
                                const torch::Tensor& x, bool plant_fault);

}  // namespace mha::bench
