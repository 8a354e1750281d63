// mha-bench's third contender: what a LibTorch >= 2.0 user writes instead of
// torch::nn::MultiheadAttention, on the same weights: the packed
// in-projection, LibTorch's fused at::scaled_dot_product_attention (its
// flash kernel on the CPU) and the out-projection, as PyTorch's own
// nn.MultiheadAttention fast path does (torch/nn/functional.py,
// multi_head_attention_forward with need_weights=False). bench.cpp checks it
// against torch::nn and times it beside mha. Also the gradient helpers that
// every forward+backward contender shares.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads,
// D head_dim = E / H, F dim_feedforward.
#include "bench/bench_sdpa.h"

#include "compat.h"

namespace mha::bench {

void clear_grads(torch::nn::Module& module, torch::Tensor& input) {
  for (auto& p : module.parameters()) {
    p.mutable_grad() = torch::Tensor();
  }
  input.mutable_grad() = torch::Tensor();
}

Named backward_results(const torch::nn::Module& module,
                       const torch::Tensor& output,
                       const torch::Tensor& input) {
  Named results{{"output", output.detach()}, {"grad input", input.grad()}};
  for (const auto& p : module.named_parameters()) {
    if (p.value().grad().defined()) {
      results.emplace_back("grad " + p.key(), p.value().grad());
    }
  }
  return results;
}

bool sdpa_available() { return MHA_HAS_TORCH_SDPA != 0; }

#if MHA_HAS_TORCH_SDPA

namespace {

/// Self-attention around at::scaled_dot_product_attention. Its parameters
/// are copies of a torch::nn::MultiheadAttention's under the same names
/// (in_proj_weight, in_proj_bias, out_proj.weight, out_proj.bias), so its
/// gradients compare with torch::nn's by name.
class ProjectedSdpaImpl : public torch::nn::Module {
 public:
  /// A copy of `ref`'s weights; `plant_fault` shifts out_proj.bias[0] by
  /// 0.1 (mha-bench's self-test).
  ProjectedSdpaImpl(const torch::nn::MultiheadAttention& ref, bool plant_fault)
      : num_heads_(ref->options.num_heads()) {
    TORCH_CHECK(ref->in_proj_weight.defined(),
                "mha-bench: the SDPA contender needs the packed "
                "in_proj_weight (kdim = vdim = embed_dim)");
    torch::NoGradGuard no_grad;
    in_proj_weight_ = register_parameter("in_proj_weight",
                                         ref->in_proj_weight.detach().clone());
    if (ref->in_proj_bias.defined()) {
      in_proj_bias_ = register_parameter("in_proj_bias",
                                         ref->in_proj_bias.detach().clone());
    }
    const auto& out = ref->out_proj;
    out_proj_ = register_module(
        "out_proj",
        torch::nn::Linear(torch::nn::LinearOptions(out->options.in_features(),
                                                   out->options.out_features())
                              .bias(out->bias.defined())));
    out_proj_->to(out->weight.device(), out->weight.scalar_type());
    out_proj_->weight.copy_(out->weight);
    if (out->bias.defined()) {
      out_proj_->bias.copy_(out->bias);
      if (plant_fault) {
        out_proj_->bias[0].add_(0.1);
      }
    }
  }

  /// x (L, N, E) → (L, N, E).
  torch::Tensor forward(const torch::Tensor& x, bool is_causal) {
    const int64_t L = x.size(0), N = x.size(1), E = x.size(2);
    const int64_t H = num_heads_, D = E / H;
    auto qkv = torch::linear(x, in_proj_weight_, in_proj_bias_);  // (L, N, 3E)
    auto heads = qkv.view({L, N, 3, H, D})
                     .permute({2, 1, 3, 0, 4});  // (3, N, H, L, D), strided
    // (N,H,L,D)·(N,H,D,S) → (N,H,L,S), softmax, ·(N,H,S,D) → (N,H,L,D);
    // LibTorch's default scale 1/sqrt(D), top-left causal as torch::nn's
    // triu mask.
    auto attended = at::scaled_dot_product_attention(
        heads[0], heads[1], heads[2], /*attn_mask=*/{}, /*dropout_p=*/0.0,
        is_causal);  // (N, H, L, D)
    auto merged =
        attended.permute({2, 0, 1, 3}).reshape({L, N, E});  // (L, N, E)
    return out_proj_(merged);                               // (L, N, E)
  }

 private:
  int64_t num_heads_;
  torch::Tensor in_proj_weight_;  // (3E, E)
  torch::Tensor in_proj_bias_;    // (3E) or undefined
  torch::nn::Linear out_proj_ = nullptr;
};
TORCH_MODULE(ProjectedSdpa);

}  // namespace

SdpaContender make_sdpa_attention(const torch::nn::MultiheadAttention& ref,
                                  const torch::Tensor& x,
                                  const torch::Tensor& grad_out, Mode mode,
                                  bool plant_fault) {
  SdpaContender c;
  if (mode == Mode::kForwardWeights) {
    c.unavailable = "SDPA returns no weights";
    return c;
  }
  TORCH_INTERNAL_ASSERT(mode != Mode::kEncoder,
                        "make_sdpa_attention: encoder rows use "
                        "make_sdpa_encoder");
  ProjectedSdpa ours(ref, plant_fault);
  ours->eval();
  if (mode == Mode::kForwardBackward) {
    auto x_sdpa = x.clone().requires_grad_(true);  // its own leaf
    c.run = [ours, x_sdpa, grad_out]() mutable {
      clear_grads(*ours, x_sdpa);
      auto out = ours->forward(x_sdpa, /*is_causal=*/false);  // (L, N, E)
      (out * grad_out).sum().backward();
      return backward_results(*ours, out, x_sdpa);
    };
    return c;
  }
  const bool no_grad = mode == Mode::kInference;
  const bool causal = mode == Mode::kCausal;
  c.run = [ours, x, no_grad, causal]() mutable {
    torch::AutoGradMode grad_mode(/*enabled=*/!no_grad);
    return Named{{"output", ours->forward(x, causal)}};  // (L, N, E)
  };
  return c;
}

SdpaContender make_sdpa_encoder(const torch::nn::TransformerEncoderLayer& ref,
                                const torch::Tensor& x, bool plant_fault) {
  ProjectedSdpa attention(ref->self_attn, plant_fault);
  attention->eval();
  SdpaContender c;
  // Post-norm, ReLU, dropout 0: PyTorch's TransformerEncoderLayer.forward
  // with norm_first=False (torch/nn/modules/transformer.py). The holder is
  // copied (same weights): a captured const reference cannot be called.
  torch::nn::TransformerEncoderLayer layer = ref;
  c.run = [attention, layer, x]() mutable {
    torch::NoGradGuard no_grad;
    auto h = layer->norm1(x + attention->forward(x, /*is_causal=*/false));
    // (L, N, E)
    auto ff = layer->linear2(torch::relu(layer->linear1(h)));
    // (L, N, F) → (L, N, E)
    return Named{{"output", layer->norm2(h + ff)}};  // (L, N, E)
  };
  return c;
}

#else  // LibTorch < 2.0: no public at::scaled_dot_product_attention

SdpaContender make_sdpa_attention(const torch::nn::MultiheadAttention&,
                                  const torch::Tensor&, const torch::Tensor&,
                                  Mode, bool) {
  return {Run(), "LibTorch < 2.0"};
}

SdpaContender make_sdpa_encoder(const torch::nn::TransformerEncoderLayer&,
                                const torch::Tensor&, bool) {
  return {Run(), "LibTorch < 2.0"};
}

#endif

}  // namespace mha::bench
