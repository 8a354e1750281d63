// mha::parity's layer cases: mha::TransformerEncoderLayer,
// mha::TransformerDecoderLayer and mha::Transformer run three ways (mha,
// torch::nn's layer where it has the case's options, the float64 reference) and
// judged part by part (mha/parity.h, src/parity/case_tools.h).
//
// Glossary: N batch, L target length, S source (memory) length, E d_model,
// H nhead.
#include <map>
#include <memory>
#include <string>

#include "case_tools.h"
#include "mha/parity.h"
#include "mha/weights.h"

namespace mha::parity::detail {
namespace {

/// Biases away from 0 and norm weights away from 1, so that a misplaced
/// one cannot hide.
void spread_parameters(torch::nn::Module& layer) {
  torch::NoGradGuard no_grad;
  for (auto& p : layer.named_parameters()) {
    const bool norm = p.key().rfind("norm", 0) == 0;
    if (p.key().find("bias") != std::string::npos) {
      p.value().uniform_(-0.5, 0.5);
    } else if (norm) {
      p.value().uniform_(0.5, 1.5);
    }
  }
}

/// The option of the case torch::nn's layers lack ("" if none).
std::string torch_nn_lacks(const Case& c) {
  if (c.norm_first) {
    return "norm_first";
  }
  if (!c.bias) {
    return "bias=false";
  }
  if (c.layer_norm_eps != 1e-5) {
    return "layer_norm_eps";
  }
  return "";
}

/// Copies every parameter of `from` into the parameter of `to` with the
/// same name (torch::nn's layers use PyTorch's names, as mha's).
void copy_by_name(torch::nn::Module& from, torch::nn::Module& to,
                  const char* to_name) {
  torch::NoGradGuard no_grad;
  auto to_params = to.named_parameters();
  for (const auto& p : from.named_parameters()) {
    auto* r = to_params.find(p.key());
    TORCH_CHECK(r != nullptr && r->sizes() == p.value().sizes(), to_name,
                " has no parameter ", p.key(), " of shape ", p.value().sizes());
    r->copy_(p.value());
  }
}

/// torch::nn::TransformerEncoderLayer on the weights of `ours` (post-norm,
/// seq-first, eps 1e-5: the caller checked the case has those options);
/// is_causal is passed as a float src_mask.
Parts run_torch_nn_encoder(
    const Case& c, const std::shared_ptr<TransformerEncoderLayerImpl>& ours,
    const Inputs& in, const torch::Tensor& g_out, std::string& note) {
  const auto dtype = c.dtype;
  const int64_t L = in.query.size(1);
  auto ref_options = torch::nn::TransformerEncoderLayerOptions(
                         ours->options.d_model(), ours->options.nhead())
                         .dim_feedforward(ours->options.dim_feedforward())
                         .dropout(0.0);
  if (c.gelu) {
    ref_options.activation(torch::kGELU);
  }
  torch::nn::TransformerEncoderLayer ref(ref_options);
  ref->to(in.query.device(), dtype);
  ref->eval();
  copy_weights(TransformerEncoderLayer(ours), ref);
  auto rx = leaf(in.query, dtype);
  torch::Tensor src_mask = in.attn_mask;
  if (c.is_causal) {
    src_mask = plus_float_causal(src_mask, L, L, in.query.options());
    note = "is_causal passed to torch::nn as a float src_mask";
  }
  auto out = ref->forward(rx.transpose(0, 1), src_mask, in.key_padding_mask)
                 .transpose(0, 1);  // (N, L, E)
  (out * g_out).sum().backward();
  Parts parts = {{"output", out}, {"grad src", rx.grad()}};
  auto ref_params = ref->named_parameters();
  for (const auto& p : ours->named_parameters()) {
    const auto* r = ref_params.find(p.key());
    parts.push_back({"grad " + p.key(), r ? r->grad() : torch::Tensor()});
  }
  return parts;
}

/// torch::nn::TransformerDecoderLayer on the weights of `ours` (post-norm,
/// seq-first, eps 1e-5: the caller checked the case has those options),
/// copied by parameter name; tgt_is_causal is passed as a float tgt_mask.
Parts run_torch_nn_decoder(
    const Case& c, const std::shared_ptr<TransformerDecoderLayerImpl>& ours,
    const Inputs& in, const torch::Tensor& g_out, std::string& note) {
  const int64_t L = in.query.size(1);
  auto ref_options = torch::nn::TransformerDecoderLayerOptions(
                         ours->options.d_model(), ours->options.nhead())
                         .dim_feedforward(ours->options.dim_feedforward())
                         .dropout(0.0);
  if (c.gelu) {
    ref_options.activation(torch::kGELU);
  }
  torch::nn::TransformerDecoderLayer ref(ref_options);
  ref->to(in.query.device(), c.dtype);
  ref->eval();
  copy_by_name(*ours, *ref, "torch::nn::TransformerDecoderLayer");
  auto rx = leaf(in.query, c.dtype);
  auto rm = leaf(in.key, c.dtype);
  torch::Tensor tgt_mask;
  if (c.is_causal) {
    tgt_mask = plus_float_causal(torch::Tensor(), L, L, in.query.options());
    note = "tgt_is_causal passed to torch::nn as a float tgt_mask";
  }
  auto out = ref->forward(rx.transpose(0, 1), rm.transpose(0, 1), tgt_mask,
                          in.attn_mask, torch::Tensor(), in.key_padding_mask)
                 .transpose(0, 1);  // (N, L, E)
  (out * g_out).sum().backward();
  Parts parts = {
      {"output", out}, {"grad tgt", rx.grad()}, {"grad memory", rm.grad()}};
  auto ref_params = ref->named_parameters();
  for (const auto& p : ours->named_parameters()) {
    parts.push_back({"grad " + p.key(), ref_params[p.key()].grad()});
  }
  return parts;
}

/// torch::nn::Transformer on the weights of `ours` (post-norm, seq-first,
/// eps 1e-5, final norms: the caller checked the case has those options),
/// copied by parameter name; tgt_is_causal is passed as a float tgt_mask.
Parts run_torch_nn_transformer(const Case& c,
                               const std::shared_ptr<TransformerImpl>& ours,
                               const Inputs& in, const torch::Tensor& g_out,
                               std::string& note) {
  const int64_t L = in.query.size(1);
  auto ref_options = torch::nn::TransformerOptions(
                         ours->options.d_model(), ours->options.nhead(),
                         ours->options.num_encoder_layers(),
                         ours->options.num_decoder_layers())
                         .dim_feedforward(ours->options.dim_feedforward())
                         .dropout(0.0);
  if (c.gelu) {
    ref_options.activation(torch::kGELU);
  }
  torch::nn::Transformer ref(ref_options);
  ref->to(in.query.device(), c.dtype);
  ref->eval();
  copy_by_name(*ours, *ref, "torch::nn::Transformer");
  auto rx = leaf(in.query, c.dtype);
  auto rs = leaf(in.key, c.dtype);
  torch::Tensor tgt_mask;
  if (c.is_causal) {
    tgt_mask = plus_float_causal(torch::Tensor(), L, L, in.query.options());
    note = "tgt_is_causal passed to torch::nn as a float tgt_mask";
  }
  auto out =
      ref->forward(rs.transpose(0, 1), rx.transpose(0, 1), torch::Tensor(),
                   tgt_mask, in.attn_mask, in.key_padding_mask, torch::Tensor(),
                   in.key_padding_mask)
          .transpose(0, 1);  // (N, L, E)
  (out * g_out).sum().backward();
  Parts parts = {
      {"output", out}, {"grad tgt", rx.grad()}, {"grad src", rs.grad()}};
  auto ref_params = ref->named_parameters();
  for (const auto& p : ours->named_parameters()) {
    parts.push_back({"grad " + p.key(), ref_params[p.key()].grad()});
  }
  return parts;
}

/// A layer case's result before judging: name, tolerance, what it compares.
CaseResult new_result(const Case& c) {
  CaseResult result;
  result.name = c.name;
  result.tolerance = tolerance_for(c.dtype);
  result.compared = "out+grads";
  return result;
}

/// Leaf copies of the parameters of `module` in `dtype`, by name.
std::map<std::string, torch::Tensor> parameters_as(torch::nn::Module& module,
                                                   torch::ScalarType dtype) {
  std::map<std::string, torch::Tensor> params;
  for (const auto& p : module.named_parameters()) {
    params[p.key()] = leaf(p.value(), dtype);
  }
  return params;
}

/// Appends "grad <name>" of every parameter of `ours` to `mine`.
void add_parameter_grads(torch::nn::Module& ours, Parts& mine) {
  for (const auto& p : ours.named_parameters()) {
    mine.push_back({"grad " + p.key(), p.value().grad()});
  }
}

/// Appends "grad <name>" of the reference's copy in `params` of every
/// parameter of `ours` (in ours' order) to `ref`.
void add_reference_grads(torch::nn::Module& ours,
                         const std::map<std::string, torch::Tensor>& params,
                         Parts& ref) {
  for (const auto& p : ours.named_parameters()) {
    ref.push_back({"grad " + p.key(), params.at(p.key()).grad()});
  }
}

/// The reference of a case with a target (query) and a memory / source
/// (key = value), run in ref_dtype through `run(params, inputs)`: its parts
/// in mine's order: output, "grad tgt", `memory_name`, then every parameter
/// of `ours`.
template <typename Run>
Parts target_memory_reference(torch::nn::Module& ours,
                              torch::nn::Module& pristine, const Inputs& in,
                              const torch::Tensor& g_out,
                              const char* memory_name,
                              torch::ScalarType ref_dtype, Run&& run) {
  auto params = parameters_as(pristine, ref_dtype);
  Inputs r = in;
  r.query = leaf(in.query, ref_dtype);
  r.key = r.value = leaf(in.key, ref_dtype);
  auto out_r = run(params, r);
  (out_r * g_out.to(ref_dtype)).sum().backward();
  Parts parts = {{"output", out_r},
                 {"grad tgt", r.query.grad()},
                 {memory_name, r.key.grad()}};
  add_reference_grads(ours, params, parts);
  return parts;
}

/// The reference (`reference(dtype)` gives its parts) run in the case's
/// half dtype, for the half rule where torch::nn cannot bound the error
/// (judge): PyTorch's tests of its low-precision attention compare with the
/// math reference computed in that dtype. Empty for float32 / float64, or
/// where the reference throws in that dtype.
template <typename Reference>
Parts half_reference_parts(const Case& c, Reference&& reference) {
  if (!is_half(c.dtype)) {
    return {};
  }
  try {
    return reference(c.dtype);
  } catch (const c10::Error&) {
    return {};
  }
}

/// Judges a layer case: against torch::nn's module (through `run_nn`, which
/// returns its parts) where it has the case's options, else against the
/// float64 reference alone, saying so ("float64 only: torch::nn's <what>
/// has no <option>").
template <typename RunNn>
void judge_layer_case(const Case& c, bool fully_masked, bool padding,
                      const Parts& mine, const Parts& f64, const Parts& half,
                      RunNn&& run_nn, const char* what, CaseResult& result) {
  const std::string lacks = torch_nn_lacks(c);
  Parts nn_parts;
  std::string nn_threw, ref_diff;
  if (lacks.empty()) {
    ref_diff = reference_difference(c, c.embed_dim, c.embed_dim, fully_masked,
                                    padding);
    nn_parts = run_reference(run_nn, nn_threw, result);
  }
  judge(c, mine, f64, nn_parts, ref_diff, nn_threw, result, half);
  if (!lacks.empty()) {
    result.note = std::string("float64 only: torch::nn's ") + what +
                  " has no " + lacks + (result.note.empty() ? "" : "; ") +
                  result.note;
  }
}

}  // namespace

CaseResult run_encoder_case(const Case& c, const torch::Device& device,
                            uint64_t seed) {
  TORCH_CHECK(!c.kdim && !c.vdim && !c.add_bias_kv && !c.add_zero_attn,
              "parity case ", c.name,
              ": an encoder layer has no kdim, vdim, add_bias_kv or "
              "add_zero_attn");
  TORCH_CHECK(!c.unbatched || c.batch == 1, "parity case ", c.name,
              ": unbatched needs batch = 1, but got ", c.batch);
  const int64_t E = c.embed_dim;
  const int64_t H = c.num_heads;
  const int64_t N = c.batch;
  const int64_t L = c.tgt_len;
  const auto dtype = c.dtype;
  torch::manual_seed(seed);

  CaseResult result = new_result(c);

  auto options = TransformerEncoderLayerOptions(E, H)
                     .dim_feedforward(c.dim_feedforward)
                     .dropout(0.0)
                     .layer_norm_eps(c.layer_norm_eps)
                     .batch_first(c.batch_first)
                     .norm_first(c.norm_first)
                     .bias(c.bias);
  if (c.gelu) {
    options.activation(torch::kGELU);
  }
  TransformerEncoderLayer ours(options);
  spread_parameters(*ours);
  ours->to(device, dtype);
  ours->eval();
  auto pristine =
      std::dynamic_pointer_cast<TransformerEncoderLayerImpl>(ours->clone());
  if (c.tamper) {
    torch::NoGradGuard no_grad;
    c.tamper(*ours->self_attn);
  }

  auto on = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.query = in.key = in.value = torch::randn({N, L, E}, on);
  make_masks(c, N, H, L, L, dtype, device, in);
  const bool fully_masked = has_fully_masked_row(c, in, N, H, L, L);
  auto g_out = torch::randn({N, L, E}, on);

  // --- mha ---
  auto x = leaf(in.query, dtype);
  auto kpm = in.key_padding_mask;
  if (kpm.defined() && c.unbatched) {
    kpm = kpm.squeeze(0);
  }
  auto out = from_case_layout(
      c, ours->forward(to_case_layout(c, x), in.attn_mask, kpm, c.is_causal));
  (out * g_out).sum().backward();

  Parts mine_parts = {{"output", out}, {"grad src", x.grad()}};
  add_parameter_grads(*ours, mine_parts);

  // --- the reference, in float64 (and in a half dtype: judge) ---
  auto reference = [&](torch::ScalarType ref_dtype) {
    auto params = parameters_as(*pristine, ref_dtype);
    Inputs r = in;
    r.query = r.key = r.value = leaf(in.query, ref_dtype);
    auto out_r = reference_encoder_layer(options, c.gelu, params, r);
    (out_r * g_out.to(ref_dtype)).sum().backward();
    Parts parts = {{"output", out_r}, {"grad src", r.query.grad()}};
    add_reference_grads(*ours, params, parts);
    return parts;
  };
  const Parts f64_parts = reference(torch::kFloat64);
  const Parts half_parts = half_reference_parts(c, reference);

  // --- torch::nn::TransformerEncoderLayer, where it has the options ---
  judge_layer_case(
      c, fully_masked, kpm.defined(), mine_parts, f64_parts, half_parts,
      [&] { return run_torch_nn_encoder(c, pristine, in, g_out, result.note); },
      "layer", result);
  return result;
}

CaseResult run_decoder_case(const Case& c, const torch::Device& device,
                            uint64_t seed) {
  TORCH_CHECK(!c.kdim && !c.vdim && !c.add_bias_kv && !c.add_zero_attn &&
                  !c.self_attention,
              "parity case ", c.name,
              ": a decoder layer has no kdim, vdim, add_bias_kv, "
              "add_zero_attn or self_attention");
  TORCH_CHECK(!c.unbatched || c.batch == 1, "parity case ", c.name,
              ": unbatched needs batch = 1, but got ", c.batch);
  const int64_t E = c.embed_dim;
  const int64_t H = c.num_heads;
  const int64_t N = c.batch;
  const int64_t L = c.tgt_len;
  const int64_t S = c.src_len;
  const auto dtype = c.dtype;
  torch::manual_seed(seed);

  CaseResult result = new_result(c);

  auto options = TransformerDecoderLayerOptions(E, H)
                     .dim_feedforward(c.dim_feedforward)
                     .dropout(0.0)
                     .layer_norm_eps(c.layer_norm_eps)
                     .batch_first(c.batch_first)
                     .norm_first(c.norm_first)
                     .bias(c.bias);
  if (c.gelu) {
    options.activation(torch::kGELU);
  }
  TransformerDecoderLayer ours(options);
  spread_parameters(*ours);
  ours->to(device, dtype);
  ours->eval();
  auto pristine =
      std::dynamic_pointer_cast<TransformerDecoderLayerImpl>(ours->clone());
  if (c.tamper) {
    torch::NoGradGuard no_grad;
    c.tamper(*ours->multihead_attn);
  }

  auto on = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.query = torch::randn({N, L, E}, on);           // tgt
  in.key = in.value = torch::randn({N, S, E}, on);  // memory
  make_masks(c, N, H, L, S, dtype, device, in);     // memory's masks
  Inputs cross = in;
  cross.is_causal = false;  // is_causal is the target's
  const bool fully_masked = has_fully_masked_row(c, cross, N, H, L, S);
  auto g_out = torch::randn({N, L, E}, on);

  // --- mha ---
  auto x = leaf(in.query, dtype);
  auto m = leaf(in.key, dtype);
  auto kpm = in.key_padding_mask;
  if (kpm.defined() && c.unbatched) {
    kpm = kpm.squeeze(0);
  }
  auto out = from_case_layout(
      c, ours->forward(to_case_layout(c, x), to_case_layout(c, m), {},
                       in.attn_mask, {}, kpm, c.is_causal));
  (out * g_out).sum().backward();

  Parts mine_parts = {
      {"output", out}, {"grad tgt", x.grad()}, {"grad memory", m.grad()}};
  add_parameter_grads(*ours, mine_parts);

  // --- the reference, in float64 (and in a half dtype: judge) ---
  auto reference = [&](torch::ScalarType ref_dtype) {
    return target_memory_reference(
        *ours, *pristine, in, g_out, "grad memory", ref_dtype,
        [&](const auto& params, const Inputs& r) {
          return reference_decoder_layer(options, c.gelu, params, r);
        });
  };
  const Parts f64_parts = reference(torch::kFloat64);
  const Parts half_parts = half_reference_parts(c, reference);

  // --- torch::nn::TransformerDecoderLayer, where it has the options ---
  judge_layer_case(
      c, fully_masked, kpm.defined(), mine_parts, f64_parts, half_parts,
      [&] { return run_torch_nn_decoder(c, pristine, in, g_out, result.note); },
      "layer", result);
  return result;
}

CaseResult run_transformer_case(const Case& c, const torch::Device& device,
                                uint64_t seed) {
  TORCH_CHECK(!c.kdim && !c.vdim && !c.add_bias_kv && !c.add_zero_attn &&
                  !c.self_attention && !c.unbatched && !c.attn_mask_3d,
              "parity case ", c.name,
              ": a Transformer case has no kdim, vdim, add_bias_kv, "
              "add_zero_attn, self_attention, unbatched or 3-D masks");
  const int64_t E = c.embed_dim;
  const int64_t H = c.num_heads;
  const int64_t N = c.batch;
  const int64_t L = c.tgt_len;
  const int64_t S = c.src_len;
  const auto dtype = c.dtype;
  torch::manual_seed(seed);

  CaseResult result = new_result(c);

  auto options = TransformerOptions(E, H, 2, 2)
                     .dim_feedforward(c.dim_feedforward)
                     .dropout(0.0)
                     .layer_norm_eps(c.layer_norm_eps)
                     .batch_first(c.batch_first)
                     .norm_first(c.norm_first)
                     .bias(c.bias);
  if (c.gelu) {
    options.activation(torch::kGELU);
  }
  Transformer ours(options);
  spread_parameters(*ours);
  ours->to(device, dtype);
  ours->eval();
  auto pristine = std::dynamic_pointer_cast<TransformerImpl>(ours->clone());
  if (c.tamper) {
    torch::NoGradGuard no_grad;
    auto& decoder = *ours->decoder.ptr()->as<TransformerDecoderImpl>();
    c.tamper(
        *decoder.layers->ptr<TransformerDecoderLayerImpl>(1)->multihead_attn);
  }

  auto on = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.query = torch::randn({N, L, E}, on);           // tgt
  in.key = in.value = torch::randn({N, S, E}, on);  // src
  make_masks(c, N, H, L, S, dtype, device, in);     // src's and memory's
  Inputs cross = in;
  cross.is_causal = false;  // is_causal is the target's
  const bool fully_masked = has_fully_masked_row(c, cross, N, H, L, S);
  auto g_out = torch::randn({N, L, E}, on);

  // --- mha ---
  auto x = leaf(in.query, dtype);
  auto src = leaf(in.key, dtype);
  const auto& kpm = in.key_padding_mask;
  auto out = from_case_layout(
      c, ours->forward(to_case_layout(c, src), to_case_layout(c, x), {}, {},
                       in.attn_mask, kpm, {}, kpm, false, c.is_causal));
  (out * g_out).sum().backward();

  Parts mine_parts = {
      {"output", out}, {"grad tgt", x.grad()}, {"grad src", src.grad()}};
  add_parameter_grads(*ours, mine_parts);

  // --- the reference, in float64 (and in a half dtype: judge) ---
  auto reference = [&](torch::ScalarType ref_dtype) {
    return target_memory_reference(
        *ours, *pristine, in, g_out, "grad src", ref_dtype,
        [&](const auto& params, const Inputs& r) {
          return reference_transformer(options, c.gelu, params, r);
        });
  };
  const Parts f64_parts = reference(torch::kFloat64);
  const Parts half_parts = half_reference_parts(c, reference);

  // --- torch::nn::Transformer, where it has the options ---
  judge_layer_case(
      c, fully_masked, kpm.defined(), mine_parts, f64_parts, half_parts,
      [&] {
        return run_torch_nn_transformer(c, pristine, in, g_out, result.note);
      },
      "Transformer", result);
  return result;
}

}  // namespace mha::parity::detail
