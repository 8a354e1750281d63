// The blocked path's autograd wrappers (attention_core.h: blocked_attention):
// the spec and kept weights carried from forward to backward, one wrapper
// for separate q, k, v and one for q, k, v that are views of one packed
// tensor, whose gradient backward then returns whole.
//
// Glossary: N batch, H heads, L target (query) length, S source (key)
// length, D and Dv the query/key and value features.
#include <array>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/blocked_attention.h"

namespace mha::detail {
namespace {

/// A flex call's mods and evaluated partial blocks in the context's
/// saved_data (a capsule IValue).
struct FlexHolder : torch::CustomClassHolder {
  FlexHolder(std::shared_ptr<const FlexMods> flex_,
             std::shared_ptr<const PartialMasks> partial_masks_)
      : flex(std::move(flex_)), partial_masks(std::move(partial_masks_)) {}
  std::shared_ptr<const FlexMods> flex;
  std::shared_ptr<const PartialMasks> partial_masks;
};

// The spec rides along in the context's saved_data (IValues). Its masks need
// no gradient, so they are kept there rather than saved as variables.
void save_spec(torch::autograd::AutogradContext* ctx, const BlockedSpec& spec) {
  auto& data = ctx->saved_data;
  auto tensor_or_none = [](const torch::Tensor& t) {
    return t.defined() ? c10::IValue(t) : c10::IValue();
  };
  data["mask"] = tensor_or_none(spec.mask);
  data["blocked"] = tensor_or_none(spec.blocked);
  data["empty"] = tensor_or_none(spec.empty);
  data["causal"] = spec.positions.causal;
  data["diagonal"] = spec.positions.diagonal;
  data["window"] = spec.positions.window;
  data["scale"] = spec.scale;
  data["weights"] = static_cast<int64_t>(spec.weights);
  data["block_rows"] = spec.block_rows;
  data["keep_weights"] = spec.keep_weights;
  data["one_block"] = spec.one_block;
  data["threads"] = static_cast<int64_t>(spec.threads);
  data["onednn"] = spec.onednn;
  data["flex"] =
      spec.flex ? c10::IValue::make_capsule(c10::make_intrusive<FlexHolder>(
                      spec.flex, spec.partial_masks))
                : c10::IValue();
}

BlockedSpec load_spec(torch::autograd::AutogradContext* ctx) {
  const auto& data = ctx->saved_data;
  auto tensor_of = [&](const char* name) {
    const auto& value = data.at(name);
    return value.isNone() ? torch::Tensor() : value.toTensor();
  };
  BlockedSpec spec;
  spec.mask = tensor_of("mask");
  spec.blocked = tensor_of("blocked");
  spec.empty = tensor_of("empty");
  spec.positions.causal = data.at("causal").toBool();
  spec.positions.diagonal = data.at("diagonal").toInt();
  spec.positions.window = data.at("window").toInt();
  spec.scale = data.at("scale").toDouble();
  spec.weights = static_cast<WeightsMode>(data.at("weights").toInt());
  spec.block_rows = data.at("block_rows").toInt();
  spec.keep_weights = data.at("keep_weights").toBool();
  spec.one_block = data.at("one_block").toBool();
  spec.threads = static_cast<ItemThreads>(data.at("threads").toInt());
  spec.onednn = data.at("onednn").toBool();
  const auto& flex = data.at("flex");
  if (!flex.isNone()) {
    const auto holder =
        c10::static_intrusive_pointer_cast<FlexHolder>(flex.toCapsule());
    spec.flex = holder->flex;
    spec.partial_masks = holder->partial_masks;
  }
  return spec;
}

/// The forward of both autograd wrappers below: the spec and the kept
/// weights into ctx (the caller saves the inputs); the output, and the
/// weights when asked for.
torch::autograd::variable_list forward_saving(
    torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
    const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias, const BlockedSpec& spec) {
  save_spec(ctx, spec);
  auto result = spec.one_block ? batched_forward(q, k, v, relative_bias, spec)
                               : blocked_forward(q, k, v, relative_bias, spec);
  ctx->saved_data["kept"] =
      result.kept.defined() ? c10::IValue(result.kept) : c10::IValue();
  torch::autograd::variable_list outputs{result.output};
  if (result.weights.defined()) {
    outputs.push_back(result.weights);
  }
  if (result.lse.defined()) {
    outputs.push_back(result.lse);
  }
  return outputs;
}

/// The backward of both autograd wrappers: gradients of q, k, v (into the
/// buffers make_buffers returns, see blocked_backward; the one-block form
/// allocates its own) and of relative_bias.
BlockedGradients backward_from(
    torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
    const torch::Tensor& k, const torch::Tensor& v,
    const torch::Tensor& relative_bias,
    const torch::autograd::variable_list& grads,
    const std::function<BlockedGradients()>& make_buffers) {
  // Grad mode on in backward means create_graph, which the kernels below
  // cannot give: they record nothing (ATen's out= products would refuse
  // it with a message that does not say why).
  TORCH_CHECK(!torch::GradMode::is_enabled(),
              "attention: the blocked CPU path has first derivatives only; a "
              "backward with create_graph=true through it is not supported");
  auto grad_out = grads[0].defined()
                      ? grads[0]
                      : at::zeros({q.size(0), q.size(1), q.size(2), v.size(3)},
                                  q.options());
  const auto spec = load_spec(ctx);
  const auto grad_weights =
      spec.weights != WeightsMode::kNone ? grads[1] : torch::Tensor();
  const auto& kept = ctx->saved_data.at("kept");
  const auto kept_weights = kept.isNone() ? torch::Tensor() : kept.toTensor();
  if (spec.one_block) {
    return batched_backward(q, k, v, relative_bias, spec, kept_weights,
                            grad_out, grad_weights);
  }
  // The logsumexp's gradient, when it is an output (the last) and used.
  const auto grad_lse = spec.flex != nullptr && spec.flex->return_lse
                            ? grads.back()
                            : torch::Tensor();
  return blocked_backward(q, k, v, relative_bias, spec, kept_weights, grad_out,
                          grad_weights, make_buffers(), grad_lse);
}

/// Autograd wrapper: saves the inputs, and the weights only when
/// spec.keep_weights.
class BlockedAttentionFunction
    : public torch::autograd::Function<BlockedAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
      const torch::Tensor& k, const torch::Tensor& v,
      const torch::Tensor& relative_bias, const BlockedSpec& spec) {
    ctx->save_for_backward({q, k, v, relative_bias});
    return forward_saving(ctx, q, k, v, relative_bias, spec);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    auto g = backward_from(ctx, q, k, v, saved[3], grads, [&] {
      return BlockedGradients{at::empty(q.sizes(), q.options()),
                              at::zeros(k.sizes(), k.options()),
                              at::zeros(v.sizes(), v.options()),
                              torch::Tensor(),
                              {}};
    });
    return {g.dq, g.dk, g.dv, g.relative_bias, torch::Tensor()};
  }
};

/// Autograd wrapper of a flex call (spec.flex): the tensors its score_mod
/// captures (spec.flex->captured) are inputs beside q, k and v, so that
/// backward returns their gradients.
class FlexAttentionFunction
    : public torch::autograd::Function<FlexAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& q,
      const torch::Tensor& k, const torch::Tensor& v,
      at::TensorList /*captured: inputs for autograd*/,
      const BlockedSpec& spec) {
    ctx->save_for_backward({q, k, v});
    return forward_saving(ctx, q, k, v, at::empty({0}, q.options()), spec);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2];
    auto g =
        backward_from(ctx, q, k, v, at::empty({0}, q.options()), grads, [&] {
          return BlockedGradients{at::empty(q.sizes(), q.options()),
                                  at::zeros(k.sizes(), k.options()),
                                  at::zeros(v.sizes(), v.options()),
                                  torch::Tensor(),
                                  {}};
        });
    torch::autograd::variable_list result{g.dq, g.dk, g.dv};
    result.insert(result.end(), g.captured.begin(), g.captured.end());
    result.push_back(torch::Tensor());  // spec
    return result;
  }
};

/// Where a view sits in the tensor it views: sizes, strides and storage
/// offset from that tensor's.
struct ViewGeometry {
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;

  ViewGeometry(const torch::Tensor& view, const torch::Tensor& base)
      : sizes(view.sizes().vec()),
        strides(view.strides().vec()),
        offset(view.storage_offset() - base.storage_offset()) {}
  /// The same view of t, a tensor laid out like the base.
  torch::Tensor of(const torch::Tensor& t) const {
    return t.as_strided(sizes, strides, t.storage_offset() + offset);
  }
};

/// Autograd wrapper for q, k and v that are disjoint views of one tensor
/// `packed` (the modules' fused in-projection output; see apply_blocked):
/// backward writes their gradients into one tensor laid out like `packed`
/// and returns it whole. The alternative, a gradient per view, costs autograd
/// a copy per view to undo the head split and one more to join the three
/// (measured at (N, L, E, H) = (2, 128, 256, 4): 0.2-0.35 ms a call).
class PackedAttentionFunction
    : public torch::autograd::Function<PackedAttentionFunction> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const torch::Tensor& packed,
      const torch::Tensor& relative_bias, const BlockedSpec& spec,
      const std::array<ViewGeometry, 3>& views) {
    ctx->save_for_backward({packed, relative_bias});
    for (size_t i = 0; i < views.size(); ++i) {
      const auto name = std::to_string(i);
      ctx->saved_data["sizes" + name] = views[i].sizes;
      ctx->saved_data["strides" + name] = views[i].strides;
      ctx->saved_data["offset" + name] = views[i].offset;
    }
    return forward_saving(ctx, views[0].of(packed), views[1].of(packed),
                          views[2].of(packed), relative_bias, spec);
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& packed = saved[0];
    auto of = [&](const torch::Tensor& t, size_t i) {
      const auto name = std::to_string(i);
      const auto& data = ctx->saved_data;
      return t.as_strided(
          data.at("sizes" + name).toIntVector(),
          data.at("strides" + name).toIntVector(),
          t.storage_offset() + data.at("offset" + name).toInt());
    };
    // `packed` is dense and the views cover it (packed_base checks),
    // so every element is written: dq's, and dk's and dv's zeroed here.
    auto d_packed =
        at::empty_strided(packed.sizes(), packed.strides(), packed.options());
    const auto g = backward_from(ctx, of(packed, 0), of(packed, 1),
                                 of(packed, 2), saved[1], grads, [&] {
                                   BlockedGradients buffers{of(d_packed, 0),
                                                            of(d_packed, 1),
                                                            of(d_packed, 2),
                                                            torch::Tensor(),
                                                            {}};
                                   buffers.dk.zero_();
                                   buffers.dv.zero_();
                                   return buffers;
                                 });
    return {d_packed, g.relative_bias, torch::Tensor(), torch::Tensor()};
  }
};

/// The tensor q, k and v are views of when `packed` (or its base) is that
/// tensor, dense, and exactly covered by the three (the caller guarantees
/// they are disjoint); otherwise undefined.
torch::Tensor packed_base(const torch::Tensor& packed, const torch::Tensor& q,
                          const torch::Tensor& k, const torch::Tensor& v) {
  if (!packed.defined()) {
    return {};
  }
  const auto base = packed.is_view() ? torch::Tensor(packed._base()) : packed;
  auto views_base = [&](const torch::Tensor& t) {
    return t.is_view() && t._base().is_same(base);
  };
  if (!views_base(q) || !views_base(k) || !views_base(v) ||
      !base.is_non_overlapping_and_dense() ||
      q.numel() + k.numel() + v.numel() != base.numel()) {
    return {};
  }
  return base;
}

}  // namespace

torch::autograd::variable_list apply_blocked(const torch::Tensor& q,
                                             const torch::Tensor& k,
                                             const torch::Tensor& v,
                                             const torch::Tensor& relative_bias,
                                             const BlockedSpec& spec,
                                             const torch::Tensor& packed) {
  if (spec.flex != nullptr) {
    // As a TensorList, each captured tensor is an input of its own.
    return FlexAttentionFunction::apply(
        q, k, v, at::TensorList(spec.flex->captured), spec);
  }
  const auto base = packed_base(packed, q, k, v);
  if (!base.defined()) {
    return BlockedAttentionFunction::apply(q, k, v, relative_bias, spec);
  }
  return PackedAttentionFunction::apply(
      base, relative_bias, spec,
      std::array<ViewGeometry, 3>{ViewGeometry(q, base), ViewGeometry(k, base),
                                  ViewGeometry(v, base)});
}

}  // namespace mha::detail
