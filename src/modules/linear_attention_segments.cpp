// Causal self-attention of MultiHeadAttention's kLinear and kPerformer a
// segment of rows at a time (linear_attention_segments.h): in inference,
// and in training, checkpointed per segment.
//
// Glossary: N batch, L sequence length, n rows of a segment, E embed_dim,
// H num_heads, Hkv num_kv_heads, D head_dim, F features of φ.
#include "modules/linear_attention_segments.h"

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "modules/module_inputs.h"
#include "modules/module_positions.h"

namespace mha::detail {
namespace {

/// One segment of kLinear / kPerformer causal self-attention, the whole
/// module forward over rows [begin, begin + n) of the sequence: `segment`
/// (N, n, E) those rows, padding and positions (N, L) of the whole
/// sequence or undefined, `sums` the sums of the rows before (empty for
/// the first segment); `sums_out` receives the sums after the segment.
/// Returns the segment's output (N, n, E).
torch::Tensor causal_segment(const MultiHeadAttentionImpl& m,
                             const torch::Tensor& segment,
                             const torch::Tensor& padding,
                             const torch::Tensor& positions, int64_t begin,
                             const LinearSums& sums, LinearSums* sums_out) {
  const int64_t n = segment.size(1);
  auto p = project_inputs(m, segment, segment, segment,
                          /*self_attention=*/true, /*key_is_value=*/true);
  auto q = split_heads(p.q, m.options.num_heads());  // (N, H, n, D)
  auto k = split_heads(p.k, m.num_kv_heads());       // (N, Hkv, n, D)
  auto v = split_heads(p.v, m.num_kv_heads());       // (N, Hkv, n, D)
  const auto at =
      positions.defined() ? positions.narrow(1, begin, n) : torch::Tensor();
  rotate_heads(m, q, k, at, at, begin);  // row t at at[n][t] or begin + t
  auto heads = attend_with_sums(
      m, q, k, v, padding.defined() ? padding.narrow(1, begin, n) : padding,
      /*causal=*/true, sums, sums_out);
  return out_projection(m, heads);  // (N, n, E)
}

/// causal_forward_by_segments; `starts`, when given, receives the sums at
/// each segment's start (the first empty).
torch::Tensor forward_by_segments(const MultiHeadAttentionImpl& m,
                                  const torch::Tensor& x,
                                  const torch::Tensor& padding,
                                  const torch::Tensor& positions, int64_t rows,
                                  std::vector<LinearSums>* starts) {
  const int64_t N = x.size(0), L = x.size(1);
  auto output =
      empty_sequence_output({N, L, m.options.embed_dim()}, x.options());
  LinearSums sums;
  for (int64_t begin = 0; begin < L; begin += rows) {
    const int64_t n = std::min(rows, L - begin);
    if (starts != nullptr) {
      starts->push_back(sums);
    }
    LinearSums next;
    output.narrow(1, begin, n)
        .copy_(causal_segment(m, x.narrow(1, begin, n), padding, positions,
                              begin, sums, begin + n < L ? &next : nullptr));
    sums = std::move(next);
  }
  return output;
}

/// What the backward of CausalSegmentsFunction needs besides its saved
/// tensors: the module (kept alive until then), the constants of the call,
/// and the sums at each segment's start, which the forward kept (a few
/// (N, Hkv, F, D) tensors: the checkpoints).
struct SegmentsCheckpoint : torch::CustomClassHolder {
  std::shared_ptr<const MultiHeadAttentionImpl> module;
  torch::Tensor padding;    // (N, L) or undefined
  torch::Tensor positions;  // (N, L) or undefined
  int64_t rows = 0;
  std::vector<LinearSums> starts;
};

/// checkpointed_forward_by_segments' autograd function (its docstring has
/// the method).
class CausalSegmentsFunction
    : public torch::autograd::Function<CausalSegmentsFunction> {
 public:
  /// x (N, L, E); tensors: those of the module the recompute reads, its
  /// parameters and buffers (saved: an in-place change before the backward
  /// is an error, not a wrong gradient); checkpoint without its starts,
  /// which the forward fills.
  static torch::Tensor forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
      torch::TensorList tensors,
      const c10::intrusive_ptr<SegmentsCheckpoint>& checkpoint) {
    auto& c = *checkpoint;
    auto output = forward_by_segments(*c.module, x, c.padding, c.positions,
                                      c.rows, &c.starts);
    std::vector<torch::Tensor> saved{x};
    saved.insert(saved.end(), tensors.begin(), tensors.end());
    ctx->save_for_backward(saved);
    ctx->saved_data["checkpoint"] = c10::IValue::make_capsule(checkpoint);
    return output;
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    // The recompute's own backward records nothing either.
    check_first_derivatives_only(
        "MultiHeadAttention: attention_kind kLinear or kPerformer trained by "
        "segments");
    const auto saved = ctx->get_saved_variables();  // checks the versions
    const auto& x = saved[0];
    const auto checkpoint =
        c10::static_intrusive_pointer_cast<SegmentsCheckpoint>(
            ctx->saved_data.at("checkpoint").toCapsule());
    const auto& c = *checkpoint;
    const int64_t P = static_cast<int64_t>(saved.size()) - 1;
    // Outputs: x's gradient, the tensors', none for the checkpoint.
    torch::autograd::variable_list out(P + 2);
    const auto& g = grads[0];  // (N, L, E)
    if (!g.defined()) {
      return out;
    }
    const int64_t L = x.size(1);
    const bool x_grad = ctx->needs_input_grad(0);
    if (x_grad) {
      out[0] = empty_sequence_output(x.sizes(), x.options());
    }
    std::vector<int64_t> trained;  // indices into saved of the parameters
    for (int64_t i = 1; i <= P; ++i) {
      if (ctx->needs_input_grad(i)) {
        trained.push_back(i);
      }
    }
    LinearSums after_grad;  // the gradient of the sums after the segment
    const int64_t count = static_cast<int64_t>(c.starts.size());
    for (int64_t s = count - 1; s >= 0; --s) {
      const int64_t begin = s * c.rows;
      const int64_t n = std::min(c.rows, L - begin);
      torch::AutoGradMode grad_mode(true);
      auto rows = x.narrow(1, begin, n).detach().requires_grad_(x_grad);
      LinearSums start = c.starts[s];
      if (!start.empty()) {
        start.kv = start.kv.detach().requires_grad_();
        start.k = start.k.detach().requires_grad_();
      }
      LinearSums after;
      auto y = causal_segment(*c.module, rows, c.padding, c.positions, begin,
                              start, after_grad.empty() ? nullptr : &after);
      torch::autograd::variable_list outputs{y};
      torch::autograd::variable_list output_grads{g.narrow(1, begin, n)};
      if (!after_grad.empty()) {
        outputs.insert(outputs.end(), {after.kv, after.k});
        output_grads.insert(output_grads.end(), {after_grad.kv, after_grad.k});
      }
      torch::autograd::variable_list inputs;
      if (x_grad) {
        inputs.push_back(rows);
      }
      for (const auto i : trained) {
        inputs.push_back(saved[i]);
      }
      if (!start.empty()) {
        inputs.insert(inputs.end(), {start.kv, start.k});
      }
      auto d = torch::autograd::grad(outputs, inputs, output_grads,
                                     /*retain_graph=*/false,
                                     /*create_graph=*/false,
                                     /*allow_unused=*/true);
      size_t next = 0;
      if (x_grad) {
        out[0].narrow(1, begin, n).copy_(d[next++]);
      }
      for (const auto i : trained) {
        auto& total = out[i];
        auto& part = d[next++];
        if (part.defined()) {
          total = total.defined() ? total.add_(part) : part;
        }
      }
      after_grad = LinearSums();
      if (!start.empty()) {
        after_grad.kv = d[next];
        after_grad.k = d[next + 1];
      }
    }
    return out;
  }
};

}  // namespace

torch::Tensor causal_forward_by_segments(const MultiHeadAttentionImpl& m,
                                         const torch::Tensor& x,
                                         const torch::Tensor& padding,
                                         const torch::Tensor& positions,
                                         int64_t rows) {
  return forward_by_segments(m, x, padding, positions, rows, nullptr);
}

bool trains_by_segments(const MultiHeadAttentionImpl& m, int64_t L,
                        int64_t rows, const torch::Tensor& padding) {
  return torch::GradMode::is_enabled() && L > rows &&
         !m.options.feature_map() &&
         !(padding.defined() && padding.requires_grad()) &&
         !m.weak_from_this().expired();
}

torch::Tensor checkpointed_forward_by_segments(MultiHeadAttentionImpl& m,
                                               const torch::Tensor& x,
                                               const torch::Tensor& padding,
                                               const torch::Tensor& positions,
                                               int64_t rows) {
  auto checkpoint = c10::make_intrusive<SegmentsCheckpoint>();
  // The module's own shared_ptr, pointing at m (Module is a virtual base
  // of it).
  checkpoint->module =
      std::shared_ptr<const MultiHeadAttentionImpl>(m.shared_from_this(), &m);
  checkpoint->padding = padding;
  checkpoint->positions = positions;
  checkpoint->rows = rows;
  // What the recompute reads: the parameters, and the Performer's
  // features (a buffer, saved for its version only).
  auto tensors = m.parameters();
  if (m.random_features.defined()) {
    tensors.push_back(m.random_features);
  }
  return CausalSegmentsFunction::apply(x, torch::TensorList(tensors),
                                       checkpoint);
}

}  // namespace mha::detail
