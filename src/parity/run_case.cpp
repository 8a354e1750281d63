// mha::parity: one case run three ways (mha, torch::nn, the float64
// reference) and judged part by part: forward output, weights, gradients of
// inputs and parameters (mha/parity.h).
//
// Glossary: N batch, L target length, S source length, S' = S plus the
// add_bias_kv / add_zero_attn positions, E embed_dim, H num_heads,
// D head_dim.
#include <cmath>
#include <functional>
#include <limits>
#include <map>

#include "case_tools.h"
#include "mha/flex_attention.h"
#include "mha/parity.h"
#include "mha/positions.h"
#include "mha/weights.h"

namespace mha::parity {
namespace detail {

Comparison compare(const std::string& what, const torch::Tensor& ours,
                   const torch::Tensor& reference, const Tolerance& tol) {
  Comparison c;
  c.what = what;
  if (!ours.defined() || !reference.defined() ||
      ours.sizes() != reference.sizes()) {
    c.within = false;
    c.max_abs = c.max_rel = kInf;
    return c;
  }
  auto a = ours.detach().to(torch::kCPU, torch::kFloat64);
  auto b = reference.detach().to(torch::kCPU, torch::kFloat64);
  if (a.numel() == 0) {
    return c;
  }
  auto diff = (a - b).abs();
  const bool finite = torch::isfinite(a).all().item<bool>() &&
                      torch::isfinite(b).all().item<bool>();
  if (!finite) {
    c.within = false;
    c.max_abs = c.max_rel = kInf;
    return c;
  }
  c.max_abs = diff.max().item<double>();
  c.max_rel = (diff / (b.abs() + tol.atol)).max().item<double>();
  c.within = diff.le(b.abs() * tol.rtol + tol.atol).all().item<bool>();
  return c;
}

void add(ReferenceResult& r, Comparison c) {
  r.used = true;
  r.max_abs = std::max(r.max_abs, c.max_abs);
  r.max_rel = std::max(r.max_rel, c.max_rel);
  r.within = r.within && c.within;
  r.parts.push_back(std::move(c));
}

/// Random canonical masks for a case; float masks hold finite biases and -inf
/// at the blocked positions.
void make_masks(const Case& c, int64_t N, int64_t H, int64_t L, int64_t S,
                torch::ScalarType dtype, const torch::Device& device,
                Inputs& in) {
  auto cpu_bool = torch::TensorOptions().dtype(torch::kBool);
  torch::Tensor padding;  // (N, S) bool
  if (c.key_padding_mask != MaskKind::kNone ||
      (c.fully_masked_row && c.attn_mask == MaskKind::kNone)) {
    padding = torch::zeros({N, S}, cpu_bool);
    for (int64_t n = 0; n < N; ++n) {
      const int64_t pad = std::min<int64_t>(n + 1, S - 1);  // keep key 0
      padding[n].narrow(0, S - pad, pad).fill_(true);
    }
    if (c.fully_masked_row && c.attn_mask == MaskKind::kNone) {
      padding[0].fill_(true);  // every key of batch 0 blocked
    }
  }
  torch::Tensor attn;  // (L, S) or (N*H, L, S) bool
  if (c.attn_mask != MaskKind::kNone) {
    std::vector<int64_t> shape = c.attn_mask_3d
                                     ? std::vector<int64_t>{N * H, L, S}
                                     : std::vector<int64_t>{L, S};
    attn = torch::rand(shape).lt(0.3);
    attn.select(-1, 0).fill_(false);  // no row fully blocked by chance
    if (c.fully_masked_row) {
      (c.attn_mask_3d ? attn[0][0] : attn[0]).fill_(true);
    }
  }
  auto as_kind = [&](const torch::Tensor& blocked, MaskKind kind) {
    if (!blocked.defined() || kind == MaskKind::kNone) {
      return blocked.defined() ? blocked.to(device) : blocked;
    }
    if (kind == MaskKind::kBool) {
      return blocked.to(device);
    }
    auto values = torch::randn(blocked.sizes(), torch::kFloat64) * 0.5;
    return values.masked_fill(blocked, -kInf).to(device, dtype);
  };
  in.key_padding_mask = as_kind(padding, c.key_padding_mask == MaskKind::kNone
                                             ? MaskKind::kBool
                                             : c.key_padding_mask);
  in.attn_mask = as_kind(attn, c.attn_mask);
  in.is_causal = c.is_causal;
}

/// True when some query row has every key blocked (the extra columns of
/// add_bias_kv / add_zero_attn are never blocked).
bool has_fully_masked_row(const Case& c, const Inputs& in, int64_t N, int64_t H,
                          int64_t L, int64_t S) {
  if (c.add_bias_kv || c.add_zero_attn) {
    return false;
  }
  auto blocked = torch::zeros({N, H, L, S}, torch::kBool);
  auto as_blocked = [](const torch::Tensor& m) {
    auto cpu = m.to(torch::kCPU);
    return cpu.scalar_type() == torch::kBool ? cpu : cpu.eq(-kInf);
  };
  if (in.attn_mask.defined()) {
    auto a = as_blocked(in.attn_mask);
    blocked.logical_or_(a.dim() == 2 ? a : a.view({N, H, L, S}));
  }
  if (in.key_padding_mask.defined()) {
    blocked.logical_or_(as_blocked(in.key_padding_mask).view({N, 1, 1, S}));
  }
  if (in.is_causal) {
    blocked.logical_or_(torch::ones({L, S}, torch::kBool).triu(1));
  }
  return blocked.all(-1).any().item<bool>();
}

/// Converts a canonical (N, T, F) tensor to the layout the case feeds mha.
torch::Tensor to_case_layout(const Case& c, const torch::Tensor& x) {
  if (c.unbatched) {
    return x.squeeze(0);
  }
  return c.batch_first ? x : x.transpose(0, 1);
}

torch::Tensor from_case_layout(const Case& c, const torch::Tensor& x) {
  if (c.unbatched) {
    return x.unsqueeze(0);
  }
  return c.batch_first ? x : x.transpose(0, 1);
}

bool is_half(torch::ScalarType dtype) {
  return dtype == torch::kFloat16 || dtype == torch::kBFloat16;
}

/// Known reasons why torch::nn::MultiheadAttention cannot be the reference.
std::string reference_difference(const Case& c, int64_t kdim, int64_t vdim,
                                 bool fully_masked, bool padding) {
  std::vector<std::string> reasons;
  if (c.attn_mask == MaskKind::kBool) {
    reasons.push_back("torch::nn adds a bool attn_mask as 0/1");
  }
  if (c.attn_mask != MaskKind::kNone && c.attn_mask_3d) {
    reasons.push_back("torch::nn fails on a 3-D attn_mask");
  }
  if (kdim != vdim) {
    reasons.push_back("torch::nn asserts key.sizes() == value.sizes()");
  }
  if (c.key_padding_mask == MaskKind::kFloat) {
    reasons.push_back("torch::nn does not apply a float key_padding_mask");
  }
  if (fully_masked) {
    reasons.push_back("torch::nn gives NaN on fully masked rows");
  }
  if (padding && is_half(c.dtype)) {
    // Its masked_fill dispatches over float and double only.
    reasons.push_back("torch::nn's key_padding_mask fails for half types");
  }
  std::string joined;
  for (const auto& r : reasons) {
    joined += (joined.empty() ? "" : "; ") + r;
  }
  return joined;
}

/// Output (canonical) and weights of one forward, with the loss
/// sum(output·g_out) + sum(weights·g_w) back-propagated.
struct Run {
  torch::Tensor output;   // (N, L, E)
  torch::Tensor weights;  // (N, L, S') or (N, H, L, S') or undefined
};

using Parts = std::vector<std::pair<std::string, torch::Tensor>>;

/// Machine epsilon of a floating dtype.
double dtype_epsilon(torch::ScalarType dtype) {
  switch (dtype) {
    case torch::kFloat16:
      return 9.765625e-4;  // 2^-10
    case torch::kBFloat16:
      return 7.8125e-3;  // 2^-7
    case torch::kFloat32:
      return 1.1920929e-7;  // 2^-23
    default:
      return 2.220446049250313e-16;  // 2^-52
  }
}

double max_abs(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0
             ? t.detach().to(torch::kFloat64).abs().max().item<double>()
             : 0.0;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) {
    return kInf;
  }
  auto d = a.detach().to(b.device(), torch::kFloat64) -
           b.detach().to(torch::kFloat64);
  return d.numel() > 0 ? d.abs().max().item<double>() : 0.0;
}

torch::Tensor leaf(const torch::Tensor& t, torch::ScalarType dtype) {
  return t.detach().to(dtype).clone().requires_grad_(true);
}

using LossFn = std::function<torch::Tensor(
    const torch::Tensor&, const torch::Tensor&, torch::ScalarType)>;

/// `mask` (float (L, S) or undefined) plus a float causal mask, -inf above
/// the diagonal: how torch::nn, which has no is_causal, is given one.
torch::Tensor plus_float_causal(const torch::Tensor& mask, int64_t L, int64_t S,
                                const torch::TensorOptions& on) {
  auto causal =
      torch::zeros({L, S}, on)
          .masked_fill(torch::ones({L, S}, on.dtype(torch::kBool)).triu(1),
                       -kInf);
  return mask.defined() ? mask + causal : causal;
}

/// Runs torch::nn::MultiheadAttention on the weights of `ours` and the
/// case's inputs, back-propagates `loss_of`, and returns the compared tensors
/// in run_case's order. torch::nn takes (L, N, E), has no is_causal, and
/// honours only float attn_masks: the case's inputs are translated.
Parts run_torch_nn(const Case& c,
                   const std::shared_ptr<MultiHeadAttentionImpl>& ours,
                   const Inputs& in, const LossFn& loss_of, std::string& note) {
  const auto dtype = c.dtype;
  const int64_t L = in.query.size(1);
  const int64_t S = in.key.size(1);
  torch::nn::MultiheadAttention ref(
      torch::nn::MultiheadAttentionOptions(ours->options.embed_dim(),
                                           ours->options.num_heads())
          .bias(c.bias)
          .add_bias_kv(c.add_bias_kv)
          .add_zero_attn(c.add_zero_attn)
          .kdim(ours->kdim())
          .vdim(ours->vdim()));
  ref->to(in.query.device(), dtype);
  ref->eval();
  copy_weights(MultiHeadAttention(ours), ref);
  auto rq = leaf(in.query, dtype);
  auto rk = c.self_attention ? rq : leaf(in.key, dtype);
  auto rv = c.self_attention ? rq : leaf(in.value, dtype);
  torch::Tensor attn = in.attn_mask;
  if (in.is_causal) {
    attn = plus_float_causal(attn, L, S, in.query.options());
    note = "is_causal passed to torch::nn as a float attn_mask";
  }
  auto [r_out, r_w] = ref->forward(
      rq.transpose(0, 1), rk.transpose(0, 1), rv.transpose(0, 1),
      in.key_padding_mask, c.need_weights, attn, c.average_attn_weights);
  auto ref_out = r_out.transpose(0, 1);  // (N, L, E)
  loss_of(ref_out, r_w, dtype).backward();

  Parts parts = {{"output", ref_out}};
  if (c.need_weights) {
    parts.push_back({"weights", r_w});
  }
  parts.push_back({"grad query", rq.grad()});
  if (!c.self_attention) {
    parts.push_back({"grad key", rk.grad()});
    parts.push_back({"grad value", rv.grad()});
  }
  auto ref_params = ref->named_parameters();
  for (const auto& p : ours->named_parameters()) {
    const auto* r = ref_params.find(p.key());
    parts.push_back({"grad " + p.key(), r ? r->grad() : torch::Tensor()});
  }
  return parts;
}

/// Compares mha's tensors with both references' and sets the status:
/// PASS within tolerance of both (of float64 alone where torch::nn lacks the
/// case's options: `nn` empty and `nn_threw` empty), REF-DIFF when torch::nn
/// is known to differ (`ref_diff`) and mha matches float64, else FAIL.
void judge(const Case& c, const Parts& mine_parts, const Parts& f64_parts,
           const Parts& nn_parts, const std::string& ref_diff,
           const std::string& nn_threw, CaseResult& result,
           const Parts& half_parts) {
  const auto dtype = c.dtype;
  const auto tol = result.tolerance;
  // Half types: the bound comes from computations of the same thing in the
  // same dtype: torch::nn's where it is valid, the reference's formula run
  // in the dtype where given; the larger error of the two where both are.
  const bool nn_base = is_half(dtype) && !nn_parts.empty() && ref_diff.empty();
  const bool half_rule = is_half(dtype) && (nn_base || !half_parts.empty());
  for (size_t i = 0; i < mine_parts.size(); ++i) {
    const auto& [what, mine_t] = mine_parts[i];
    const auto& f64_t = f64_parts[i].second;
    Tolerance part_tol = tol;
    if (half_rule) {
      // flash-attention's rule: our error against float64 at most twice
      // that computation's, plus one rounding step of the dtype at this
      // scale.
      double base_error = 0.0;
      if (nn_base) {
        base_error = max_abs_diff(nn_parts[i].second, f64_t);
      }
      if (!half_parts.empty()) {
        base_error =
            std::max(base_error, max_abs_diff(half_parts[i].second, f64_t));
      }
      part_tol = {2.0 * base_error + dtype_epsilon(dtype) * max_abs(f64_t),
                  0.0};
    }
    add(result.float64, compare(what, mine_t, f64_t, part_tol));
    if (!nn_parts.empty()) {
      auto vs_nn = compare(what, mine_t, nn_parts[i].second, tol);
      if (half_rule) {
        vs_nn.within = true;  // informative: the bound is against float64
      }
      add(result.torch_nn, vs_nn);
    }
  }
  if (nn_base) {
    result.note = half_parts.empty()
                      ? "bound: 2x torch::nn's error vs float64 + dtype "
                        "rounding"
                      : "bound: 2x the larger error of torch::nn and the "
                        "reference in this dtype vs float64 + dtype rounding";
  }

  if (!ref_diff.empty()) {
    if (result.torch_nn.within) {
      // The known difference did not show: say so, and hold mha to both.
      result.note =
          "expected a difference (" + ref_diff + ") but torch::nn agrees";
      result.status = result.float64.within ? Status::kPass : Status::kFail;
    } else {
      result.note =
          ref_diff + (nn_threw.empty() ? "" : " [threw: " + nn_threw + "]");
      result.status = result.float64.within ? Status::kRefDiff : Status::kFail;
    }
  } else if (!nn_threw.empty()) {
    result.note = "torch::nn threw: " + nn_threw;
    result.status = Status::kFail;
  } else {
    result.status = result.torch_nn.within && result.float64.within
                        ? Status::kPass
                        : Status::kFail;
  }
  if (half_rule && !nn_base) {
    result.note += std::string(result.note.empty() ? "" : "; ") +
                   "bound: 2x the reference's error in " +
                   (dtype == torch::kBFloat16 ? "bfloat16" : "float16") +
                   " vs float64 + dtype rounding";
  }
}

}  // namespace detail

using namespace detail;  // NOLINT: this file's own helpers

CaseResult run_case(const Case& c, const torch::Device& device, uint64_t seed) {
  if (c.encoder_layer) {
    return run_encoder_case(c, device, seed);
  }
  if (c.decoder_layer) {
    return run_decoder_case(c, device, seed);
  }
  if (c.transformer) {
    return run_transformer_case(c, device, seed);
  }
  TORCH_CHECK(!c.unbatched || c.batch == 1, "parity case ", c.name,
              ": unbatched needs batch = 1, but got ", c.batch);
  const int64_t E = c.embed_dim;
  const int64_t H = c.num_heads;
  const int64_t N = c.batch;
  const int64_t L = c.tgt_len;
  const int64_t S = c.self_attention ? c.tgt_len : c.src_len;
  const int64_t kdim = c.kdim.value_or(E);
  const int64_t vdim = c.vdim.value_or(E);
  TORCH_CHECK(!c.self_attention || (kdim == E && vdim == E), "parity case ",
              c.name, ": self-attention needs kdim = vdim = embed_dim");
  torch::manual_seed(seed);

  CaseResult result;
  result.name = c.name;
  result.tolerance = tolerance_for(c.dtype);
  const auto dtype = c.dtype;

  auto options = MultiHeadAttentionOptions(E, H)
                     .bias(c.bias)
                     .add_bias_kv(c.add_bias_kv)
                     .add_zero_attn(c.add_zero_attn)
                     .kdim(c.kdim)
                     .vdim(c.vdim)
                     .batch_first(c.batch_first);
  // FlexAttention rows: the module's score_mod, or a block mask for the
  // call (see Case::flex).
  if (c.flex == "softcap") {
    options.score_mod(
        [](const torch::Tensor& s, const torch::Tensor&, const torch::Tensor&,
           const torch::Tensor&,
           const torch::Tensor&) { return 2.0 * torch::tanh(s / 2.0); });
  } else if (c.flex == "alibi") {
    options.score_mod([slopes = alibi_slopes(H)](
                          const torch::Tensor& s, const torch::Tensor&,
                          const torch::Tensor& h, const torch::Tensor& q,
                          const torch::Tensor& kv) {
      return s + slopes.index({h}) * (kv - q).to(s.scalar_type());
    });
  } else if (c.flex == "softcap-fused") {
    options.score_mod(fused_score_mod(
        [](auto s, auto, auto, auto, auto) { return 2 * fused::tanh(s / 2); }));
  } else if (c.flex == "alibi-fused") {
    options.score_mod(
        fused_score_mod([slopes = fused::Table(alibi_slopes(H))](
                            auto s, auto, auto h, auto q, auto kv) {
          return s + fused::lookup(slopes, h) * (kv - q);
        }));
  }
  MultiHeadAttention ours(options);
  {
    // Non-zero biases, so that a misplaced bias cannot hide.
    torch::NoGradGuard no_grad;
    for (auto& p : ours->named_parameters()) {
      if (p.key().find("bias") != std::string::npos) {
        p.value().uniform_(-0.5, 0.5);
      }
    }
  }
  ours->to(device, dtype);
  ours->eval();
  // The references take their weights from this untouched copy.
  auto pristine =
      std::dynamic_pointer_cast<MultiHeadAttentionImpl>(ours->clone());
  if (c.tamper) {
    torch::NoGradGuard no_grad;
    c.tamper(*ours);
  }

  // Canonical inputs, rounded to dtype once, so that every contender sees
  // the same values.
  auto on = torch::TensorOptions().dtype(dtype).device(device);
  Inputs in;
  in.query = torch::randn({N, L, E}, on);
  in.key = c.self_attention ? in.query : torch::randn({N, S, kdim}, on);
  in.value = c.self_attention ? in.query : torch::randn({N, S, vdim}, on);
  make_masks(c, N, H, L, S, dtype, device, in);
  BlockMask block_mask;
  if (c.flex == "block-causal") {
    block_mask = create_block_mask(
        [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
           const torch::Tensor& kv) { return q.ge(kv); },
        c10::nullopt, c10::nullopt, L, S, /*block_q=*/8);
    in.is_causal = true;  // the references' equivalent
  } else if (c.flex == "block-causal-fused") {
    block_mask = create_block_mask(
        fused_mask_mod([](auto, auto, auto q, auto kv) { return q >= kv; }),
        c10::nullopt, c10::nullopt, L, S, /*block_q=*/8);
    in.is_causal = true;
  } else if (c.flex == "documents") {
    TORCH_CHECK(L == S && L > 3, "parity case ", c.name,
                ": documents need self-attention with L > 3");
    const auto lengths =
        torch::tensor({L / 3, L / 2 - L / 3, L - L / 2}, torch::kLong);
    block_mask = create_document_block_mask(lengths, /*causal=*/true, 8);
    // The references: the same documents as a float (L, S) attn_mask.
    const auto doc = document_ids(lengths);
    const auto i = torch::arange(L, torch::kLong);
    auto allowed =
        doc.unsqueeze(1)
            .eq(doc.unsqueeze(0))
            .logical_and(i.unsqueeze(1).ge(i.unsqueeze(0)));  // (L, S)
    in.attn_mask = torch::zeros({L, S}, torch::kFloat64)
                       .masked_fill(allowed.logical_not(), -kInf)
                       .to(device, dtype);
  }
  const bool fully_masked = has_fully_masked_row(c, in, N, H, L, S);
  const int64_t S2 = S + (c.add_bias_kv ? 1 : 0) + (c.add_zero_attn ? 1 : 0);
  auto g_out = torch::randn({N, L, E}, on);
  auto g_w = c.average_attn_weights ? torch::randn({N, L, S2}, on)
                                    : torch::randn({N, H, L, S2}, on);

  LossFn loss_of = [&](const torch::Tensor& out, const torch::Tensor& w,
                       torch::ScalarType t) {
    auto loss = (out * g_out.to(t)).sum();
    if (c.need_weights) {
      loss = loss + (w * g_w.to(t)).sum();
    }
    return loss;
  };
  std::string compared = c.need_weights ? "out+w" : "out";
  compared += "+grads";
  result.compared = compared;

  // --- mha ---
  auto q = leaf(in.query, dtype);
  auto k = c.self_attention ? q : leaf(in.key, dtype);
  auto v = c.self_attention ? q : leaf(in.value, dtype);
  auto kpm = in.key_padding_mask;
  if (kpm.defined() && c.unbatched) {
    kpm = kpm.squeeze(0);
  }
  // A block mask stands for the references' is_causal or attn_mask.
  const bool blocks = !block_mask.empty();
  auto [out_raw, w_raw] = ours->forward(
      to_case_layout(c, q),
      c.self_attention ? torch::Tensor() : to_case_layout(c, k),
      c.self_attention ? torch::Tensor() : to_case_layout(c, v), kpm,
      c.need_weights, blocks ? torch::Tensor() : in.attn_mask,
      c.average_attn_weights, c.is_causal && !blocks, /*positions=*/{},
      block_mask);
  Run mine{from_case_layout(c, out_raw),
           w_raw.defined() && c.unbatched ? w_raw.unsqueeze(0) : w_raw};
  loss_of(mine.output, mine.weights, dtype).backward();

  // --- float64 reference ---
  std::map<std::string, torch::Tensor> params64;
  for (const auto& p : pristine->named_parameters()) {
    params64[p.key()] = leaf(p.value(), torch::kFloat64);
  }
  Inputs in64 = in;
  in64.query = leaf(in.query, torch::kFloat64);
  in64.key = c.self_attention ? in64.query : leaf(in.key, torch::kFloat64);
  in64.value = c.self_attention ? in64.query : leaf(in.value, torch::kFloat64);
  auto [out64, w64_heads] = reference_attention(options, params64, in64);
  auto w64 = c.average_attn_weights ? w64_heads.mean(1) : w64_heads;
  loss_of(out64, w64, torch::kFloat64).backward();

  // Every compared tensor, by name, in the same order for each contender.
  Parts mine_parts = {{"output", mine.output}};
  Parts f64_parts = {{"output", out64}};
  if (c.need_weights) {
    mine_parts.push_back({"weights", mine.weights});
    f64_parts.push_back({"weights", w64});
  } else if (mine.weights.defined()) {
    add(result.float64, Comparison{"weights undefined", kInf, kInf, false});
  }
  mine_parts.push_back({"grad query", q.grad()});
  f64_parts.push_back({"grad query", in64.query.grad()});
  if (!c.self_attention) {
    mine_parts.push_back({"grad key", k.grad()});
    mine_parts.push_back({"grad value", v.grad()});
    f64_parts.push_back({"grad key", in64.key.grad()});
    f64_parts.push_back({"grad value", in64.value.grad()});
  }
  for (const auto& p : ours->named_parameters()) {
    mine_parts.push_back({"grad " + p.key(), p.value().grad()});
    f64_parts.push_back({"grad " + p.key(), params64.at(p.key()).grad()});
  }

  // --- torch::nn::MultiheadAttention, where it is a valid reference ---
  const auto ref_diff = reference_difference(c, kdim, vdim, fully_masked,
                                             in.key_padding_mask.defined());
  // On known-difference rows torch::nn runs too, on the same inputs, so the
  // report shows what it actually does (throws, differs, NaN).
  Parts nn_parts;
  std::string nn_threw;
  if (options.score_mod()) {
    // torch::nn has no score_mod: float64 alone.
    result.note = "float64 only: torch::nn has no score_mod";
  } else {
    nn_parts = run_reference(
        [&] { return run_torch_nn(c, pristine, in, loss_of, result.note); },
        nn_threw, result);
  }

  judge(c, mine_parts, f64_parts, nn_parts, ref_diff, nn_threw, result);
  if (c.need_weights) {
    // Batch element 0 as (panels, L, S').
    auto first = [&](const torch::Tensor& w) {
      if (!w.defined()) {
        return w;
      }
      auto w0 = w.detach()[0].to(torch::kCPU, torch::kFloat64);
      return c.average_attn_weights ? w0.unsqueeze(0) : w0;
    };
    result.weights = first(mine.weights);
    result.float64_weights = first(w64);
    if (nn_parts.size() > 1) {
      result.torch_nn_weights = first(nn_parts[1].second);  // "weights"
    }
  }
  return result;
}

}  // namespace mha::parity
