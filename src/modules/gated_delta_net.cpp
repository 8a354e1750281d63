// Gated DeltaNet (mha/gated_delta_net.h): Qwen3-Next's linear attention, as
// transformers 5.x's Qwen3NextGatedDeltaNet computes it (its torch
// fallbacks torch_chunk_gated_delta_rule and
// torch_recurrent_gated_delta_rule), in the compute dtype float32 (float64
// for float64 inputs). On the CPU (float32, float64) the chunked form, the
// convolution and the gated RMSNorm are core/delta_rule.h's routines; the
// ATen forms here (chunked_rule, conv1d, the norm's ops) serve other
// devices and dtypes.
//
// Glossary: N batch, L / T length, Hk key heads, Hv value heads, G = Hv /
// Hk, dk / dv head sizes, K conv width, C chunk size, S the state (dk x
// dv per value head).
#include "mha/gated_delta_net.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/blas_threads.h"
#include "core/delta_rule.h"
#include "modules/module_inputs.h"
#include "modules/projection.h"

namespace mha {

GatedDeltaNetOptions::GatedDeltaNetOptions(int64_t embed_dim)
    : embed_dim_(embed_dim) {}

namespace {

/// Channels of the convolution: q, k (Hk·dk each) and v (Hv·dv).
int64_t conv_channels(const GatedDeltaNetOptions& o) {
  return 2 * o.num_key_heads() * o.key_head_dim() +
         o.num_value_heads() * o.value_head_dim();
}

torch::ScalarType compute_dtype(torch::ScalarType dtype) {
  return dtype == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
}

/// x / sqrt(sum(x²) + 1e-6) along the last dim (the FLA library's l2norm,
/// as transformers').
torch::Tensor l2norm(const torch::Tensor& x) {
  return x * torch::rsqrt((x * x).sum(-1, true) + 1e-6);
}

/// The delta rule over chunks of C tokens (the WY form of Yang et al.):
/// q, k (N, H, L, dk), v (N, H, L, dv), g, beta (N, H, L), state (N, H, dk,
/// dv) updated in place (replaced by the final state). Returns (N, H, L,
/// dv). Within a chunk, with G the cumulative sum of g, D[i][j] =
/// exp(G_i - G_j) (j <= i) and A = -(β k kᵀ ⊙ D) strictly below the
/// diagonal, T = (I - A)⁻¹ gives u = T (β v) and w = T (β k exp(G)); then
/// chunk by chunk: v' = u - w S, o = (q exp(G)) S + (q kᵀ ⊙ D) v', S <-
/// exp(G_C) S + (k exp(G_C - G))ᵀ v'.
torch::Tensor chunked_rule(const torch::Tensor& q, const torch::Tensor& k,
                           const torch::Tensor& v, const torch::Tensor& g,
                           const torch::Tensor& beta, torch::Tensor& state,
                           int64_t C) {
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  const int64_t dv = v.size(3);
  const int64_t pad = (C - L % C) % C;
  auto padded = [&](const torch::Tensor& t) {
    return pad == 0 ? t
                    : torch::constant_pad_nd(
                          t, t.dim() == 4 ? std::vector<int64_t>{0, 0, 0, pad}
                                          : std::vector<int64_t>{0, pad});
  };
  const int64_t chunks = (L + pad) / C;
  auto chunked = [&](const torch::Tensor& t) {  // (N, H, chunks, C, ...)
    auto p = padded(t);
    return t.dim() == 4 ? p.view({N, H, chunks, C, p.size(3)})
                        : p.view({N, H, chunks, C});
  };
  const auto qc = chunked(q), kc = chunked(k), vc = chunked(v);
  const auto bc = chunked(beta);
  const auto G = chunked(g).cumsum(-1);  // (N, H, chunks, C)
  const auto opts = q.options();
  const auto lower = torch::ones({C, C}, opts.dtype(torch::kBool)).tril();
  const auto D = (G.unsqueeze(-1) - G.unsqueeze(-2))
                     .masked_fill(~lower, 0)
                     .exp()
                     .masked_fill(~lower, 0);  // (N, H, chunks, C, C)
  const auto k_beta = kc * bc.unsqueeze(-1), v_beta = vc * bc.unsqueeze(-1);
  const auto strictly = torch::ones({C, C}, opts.dtype(torch::kBool)).tril(-1);
  const auto A = -(torch::matmul(k_beta, kc.transpose(-1, -2)) * D)
                      .masked_fill(~strictly, 0);
  const auto eye = torch::eye(C, opts);
  // T = (I - A)⁻¹, I - A unit lower triangular.
  const auto T = at::linalg_solve_triangular(eye - A, eye.expand_as(A),
                                             /*upper=*/false, /*left=*/true,
                                             /*unitriangular=*/true);
  const auto u = torch::matmul(T, v_beta);  // (.., C, dv)
  const auto w =
      torch::matmul(T, k_beta * G.exp().unsqueeze(-1));         // (.., C, dk)
  const auto qk = torch::matmul(qc, kc.transpose(-1, -2)) * D;  // (.., C, C)
  std::vector<torch::Tensor> out;
  out.reserve(chunks);
  auto S = state;
  for (int64_t i = 0; i < chunks; ++i) {
    const auto Gi = G.select(2, i);  // (N, H, C)
    const auto v_new = u.select(2, i) - torch::matmul(w.select(2, i), S);
    out.push_back(torch::matmul(qc.select(2, i) * Gi.exp().unsqueeze(-1), S) +
                  torch::matmul(qk.select(2, i), v_new));
    const auto last = Gi.narrow(2, C - 1, 1);  // (N, H, 1)
    S = S * last.exp().unsqueeze(-1) +
        torch::matmul((kc.select(2, i) * (last - Gi).exp().unsqueeze(-1))
                          .transpose(-1, -2),
                      v_new);
  }
  state = S;
  return torch::stack(out, 2).view({N, H, chunks * C, dv}).narrow(2, 0, L);
}

/// The delta rule token by token (the recurrent form), same arguments.
torch::Tensor recurrent_rule(const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v, const torch::Tensor& g,
                             const torch::Tensor& beta, torch::Tensor& state) {
  std::vector<torch::Tensor> out;
  auto S = state;
  for (int64_t t = 0; t < q.size(2); ++t) {
    const auto k_t = k.select(2, t);  // (N, H, dk)
    S = S * g.select(2, t).exp().unsqueeze(-1).unsqueeze(-1);
    const auto memory = torch::matmul(k_t.unsqueeze(-2), S).squeeze(-2);
    const auto delta = (v.select(2, t) - memory) *
                       beta.select(2, t).unsqueeze(-1);  // (N, H, dv)
    S = S + k_t.unsqueeze(-1) * delta.unsqueeze(-2);
    out.push_back(torch::matmul(q.select(2, t).unsqueeze(-2), S).squeeze(-2));
  }
  state = S;
  return torch::stack(out, 2);
}

}  // namespace

GatedDeltaNetImpl::GatedDeltaNetImpl(const GatedDeltaNetOptions& options_)
    : options(options_) {
  reset();
}

void GatedDeltaNetImpl::reset() {
  const auto& o = options;
  TORCH_CHECK(o.embed_dim() > 0 && o.num_key_heads() > 0 &&
                  o.num_value_heads() > 0 && o.key_head_dim() > 0 &&
                  o.value_head_dim() > 0 && o.conv_kernel_dim() > 0 &&
                  o.chunk_size() > 0,
              "GatedDeltaNet: embed_dim, num_key_heads, num_value_heads, "
              "key_head_dim, value_head_dim, conv_kernel_dim and chunk_size "
              "must be > 0, but got ",
              o.embed_dim(), ", ", o.num_key_heads(), ", ", o.num_value_heads(),
              ", ", o.key_head_dim(), ", ", o.value_head_dim(), ", ",
              o.conv_kernel_dim(), ", ", o.chunk_size());
  TORCH_CHECK(o.num_value_heads() % o.num_key_heads() == 0,
              "GatedDeltaNet: num_value_heads (", o.num_value_heads(),
              ") must be a multiple of num_key_heads (", o.num_key_heads(),
              ")");
  TORCH_CHECK(o.norm_eps() >= 0 && std::isfinite(o.norm_eps()),
              "GatedDeltaNet: norm_eps must be finite and >= 0, but got ",
              o.norm_eps());
  const int64_t E = o.embed_dim(), Hv = o.num_value_heads();
  const int64_t channels = conv_channels(o);
  const int64_t value_dim = Hv * o.value_head_dim();
  conv1d = register_module(
      "conv1d", torch::nn::Conv1d(torch::nn::Conv1dOptions(channels, channels,
                                                           o.conv_kernel_dim())
                                      .groups(channels)
                                      .bias(false)));
  in_proj_qkvz = register_module(
      "in_proj_qkvz",
      torch::nn::Linear(
          torch::nn::LinearOptions(E, channels + value_dim).bias(false)));
  in_proj_ba = register_module(
      "in_proj_ba",
      torch::nn::Linear(torch::nn::LinearOptions(E, 2 * Hv).bias(false)));
  dt_bias = register_parameter("dt_bias", torch::empty({Hv}));
  A_log = register_parameter("A_log", torch::empty({Hv}));
  norm = register_module("norm", NormWeight(o.value_head_dim()));
  out_proj = register_module(
      "out_proj",
      torch::nn::Linear(torch::nn::LinearOptions(value_dim, E).bias(false)));
  reset_parameters();
}

void GatedDeltaNetImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  conv1d->reset_parameters();
  in_proj_qkvz->reset_parameters();
  in_proj_ba->reset_parameters();
  out_proj->reset_parameters();
  dt_bias.fill_(1.0);
  A_log.uniform_(0.0, 16.0).log_();
  norm->weight.fill_(1.0);
}

void GatedDeltaNetImpl::pretty_print(std::ostream& stream) const {
  const auto& o = options;
  stream << "mha::GatedDeltaNet(embed_dim=" << o.embed_dim()
         << ", num_key_heads=" << o.num_key_heads()
         << ", num_value_heads=" << o.num_value_heads()
         << ", key_head_dim=" << o.key_head_dim()
         << ", value_head_dim=" << o.value_head_dim()
         << ", conv_kernel_dim=" << o.conv_kernel_dim() << ")";
}

GatedDeltaNetState GatedDeltaNetImpl::make_state(int64_t batch_size) const {
  TORCH_CHECK(batch_size >= 1,
              "GatedDeltaNet::make_state: batch_size must be >= 1, but got ",
              batch_size);
  const auto& w = out_proj->weight;
  const auto opts = w.options().dtype(compute_dtype(w.scalar_type()));
  const auto& o = options;
  GatedDeltaNetState state;
  state.conv = torch::zeros(
      {batch_size, conv_channels(o), o.conv_kernel_dim() - 1}, w.options());
  state.recurrent = torch::zeros(
      {batch_size, o.num_value_heads(), o.key_head_dim(), o.value_head_dim()},
      opts);
  return state;
}

namespace {

/// The whole layer on x (N, T, E) batch-first, after `conv_context` (N,
/// channels, K - 1) of earlier inputs (zeros for a fresh sequence), from
/// `state` (N, Hv, dk, dv), updated in place with the new context and
/// state. recurrent: token by token, else in chunks.
torch::Tensor run(const GatedDeltaNetImpl& m, const torch::Tensor& x,
                  torch::Tensor& conv_context, torch::Tensor& state,
                  bool recurrent) {
  const auto& o = m.options;
  const int64_t N = x.size(0), T = x.size(1);
  const int64_t Hk = o.num_key_heads(), Hv = o.num_value_heads();
  const int64_t G = Hv / Hk, dk = o.key_head_dim(), dv = o.value_head_dim();
  const int64_t K = o.conv_kernel_dim();
  // Rows grouped per key head: [q | k | v (G·dv) | z (G·dv)], [b | a]
  // (split, not narrowed: one gradient assembled in the backward).
  const auto qkvz = detail::project(x, m.in_proj_qkvz->weight, {})
                        .view({N, T, Hk, 2 * dk + 2 * G * dv})
                        .split_with_sizes({dk, dk, G * dv, G * dv}, 3);
  const auto ba = torch::linear(x, m.in_proj_ba->weight)
                      .view({N, T, Hk, 2 * G})
                      .split_with_sizes({G, G}, 3);
  const auto z = qkvz[3].reshape({N, T, Hv, dv});
  const auto b = ba[0].reshape({N, T, Hv});
  const auto a = ba[1].reshape({N, T, Hv});
  // The causal depthwise convolution with SiLU, over the context and x,
  // channels last: (N, T, ch) with ch = [q (Hk·dk) | k (Hk·dk) | v (Hv·dv)].
  const auto mixed = torch::cat(
      {qkvz[0].reshape({N, T, Hk * dk}), qkvz[1].reshape({N, T, Hk * dk}),
       qkvz[2].reshape({N, T, Hv * dv})},
      2);
  const int64_t ch = mixed.size(2);
  const auto context = conv_context.to(mixed.dtype());  // (N, ch, K - 1)
  torch::Tensor conv;                                   // (N, T, ch)
  if (detail::gated_delta_rule_applies(mixed)) {
    conv = detail::causal_conv_silu(mixed, context.transpose(1, 2),
                                    m.conv1d->weight.view({ch, K}));
  } else {
    conv = torch::silu(
               torch::conv1d(torch::cat({context, mixed.transpose(1, 2)}, 2),
                             m.conv1d->weight, torch::Tensor(),
                             /*stride=*/std::vector<int64_t>{1},
                             /*padding=*/std::vector<int64_t>{0},
                             /*dilation=*/std::vector<int64_t>{1},
                             /*groups=*/ch))
               .transpose(1, 2);
  }
  // The last K - 1 inputs, for the next call.
  conv_context =
      (T >= K - 1
           ? mixed.narrow(1, T - (K - 1), K - 1)
           : torch::cat(
                 {context.transpose(1, 2).narrow(1, T, K - 1 - T), mixed}, 1))
          .transpose(1, 2)
          .contiguous()
          .detach();
  const auto dtype = compute_dtype(x.scalar_type());
  const auto qkv = conv.to(dtype).split_with_sizes({Hk * dk, Hk * dk, Hv * dv},
                                                   2);  // (N, T, ·)
  // q and k normalised per key head, (N, T, Hk, dk) rows; then every
  // input as (N·Hv, T, ·) items, key heads repeated over their value heads
  // (one copy each).
  const auto qn = l2norm(qkv[0].view({N, T, Hk, dk})) *
                  (1.0 / std::sqrt(static_cast<double>(dk)));
  const auto kn = l2norm(qkv[1].view({N, T, Hk, dk}));
  auto items = [&](const torch::Tensor& t, int64_t H, int64_t d) {
    return t.unsqueeze(3)
        .expand({N, T, H, Hv / H, d})
        .permute({0, 2, 3, 1, 4})
        .reshape({N * Hv, T, d});
  };
  const auto qi = items(qn, Hk, dk), ki = items(kn, Hk, dk);
  const auto vi = items(qkv[2].view({N, T, Hv, dv}), Hv, dv);
  const auto beta =
      torch::sigmoid(b.to(dtype)).transpose(1, 2).reshape({N * Hv, T});
  const auto g = (-m.A_log.to(dtype).exp() *
                  torch::softplus(a.to(dtype) + m.dt_bias.to(dtype)))
                     .transpose(1, 2)
                     .reshape({N * Hv, T});
  torch::Tensor out;  // (N, Hv, T, dv)
  if (recurrent) {
    out = recurrent_rule(qi.view({N, Hv, T, dk}), ki.view({N, Hv, T, dk}),
                         vi.view({N, Hv, T, dv}), g.view({N, Hv, T}),
                         beta.view({N, Hv, T}), state);
  } else if (detail::gated_delta_rule_applies(qi)) {
    // The CPU walk (core/delta_rule.h) on the items.
    auto [o_items, s_items] = detail::gated_delta_rule(
        qi, ki, vi, g, beta, state.reshape({N * Hv, dk, dv}), o.chunk_size());
    out = o_items.view({N, Hv, T, dv});
    state = s_items.view({N, Hv, dk, dv});
  } else {
    out = chunked_rule(qi.view({N, Hv, T, dk}), ki.view({N, Hv, T, dk}),
                       vi.view({N, Hv, T, dv}), g.view({N, Hv, T}),
                       beta.view({N, Hv, T}), state, o.chunk_size());
  }
  // The gated RMSNorm per head (Qwen3NextRMSNormGated), then out_proj.
  torch::Tensor gated;  // (N, T, Hv, dv)
  if (detail::gated_delta_rule_applies(out)) {
    gated = detail::gated_rms_norm(out, z.to(dtype), m.norm->weight.to(dtype),
                                   o.norm_eps());
  } else {
    const auto o_t = out.transpose(1, 2);  // (N, T, Hv, dv)
    const auto normed =
        o_t * torch::rsqrt(o_t.pow(2).mean(-1, true) + o.norm_eps());
    gated = (m.norm->weight.to(dtype) * normed) * torch::silu(z.to(dtype));
  }
  return detail::project(gated.reshape({N, T, Hv * dv}).to(x.scalar_type()),
                         m.out_proj->weight, {});
}

/// Tokens per segment of forward (rounded down to whole chunks). Why: at
/// 64k tokens (Qwen3-Next's sizes at E 1024) one pass made 8 GB of
/// temporaries, and their first touch in fresh pages grew the time 16-fold
/// from 8k instead of 8-fold (measured here, LibTorch 1.13).
constexpr int64_t kSegmentTokens = 8192;

}  // namespace

torch::Tensor GatedDeltaNetImpl::forward(
    const torch::Tensor& x_in, const torch::Tensor& key_padding_mask) {
  const char* who = "GatedDeltaNet::forward";
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  auto x = detail::sequence_input(x_in, options.embed_dim(),
                                  options.batch_first(), out_proj->weight, who);
  const int64_t N = x.size(0), L = x.size(1);
  if (key_padding_mask.defined()) {
    TORCH_CHECK(key_padding_mask.scalar_type() == torch::kBool &&
                    key_padding_mask.dim() == 2 &&
                    key_padding_mask.size(0) == N &&
                    key_padding_mask.size(1) == L,
                who, ": key_padding_mask must be bool (N, L) = (", N, ", ", L,
                "), true = padding, but got ", key_padding_mask.scalar_type(),
                " ", key_padding_mask.sizes());
    // transformers' apply_mask_to_padding_states.
    x = x.masked_fill(key_padding_mask.unsqueeze(-1), 0.0);
  }
  // Segments of whole chunks, each from the state the one before left (the
  // chunks and the results are those of one call): each segment's
  // temporaries are made and freed in turn instead of all L tokens' at
  // once.
  const int64_t C = options.chunk_size();
  const int64_t segment = std::max(C, kSegmentTokens / C * C);
  auto state = make_state(N);
  std::vector<torch::Tensor> parts;
  int64_t begin = 0;
  do {
    const int64_t len = std::min(segment, L - begin);
    parts.push_back(run(*this, x.narrow(1, begin, len), state.conv,
                        state.recurrent, /*recurrent=*/false));
    begin += len;
  } while (begin < L);
  auto out = parts.size() == 1 ? parts[0] : torch::cat(parts, 1);
  return options.batch_first() ? out : out.transpose(0, 1);
}

torch::Tensor GatedDeltaNetImpl::forward_cached(const torch::Tensor& x_in,
                                                GatedDeltaNetState& state) {
  const char* who = "GatedDeltaNet::forward_cached";
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const auto x = detail::sequence_input(
      x_in, options.embed_dim(), options.batch_first(), out_proj->weight, who);
  const int64_t N = x.size(0);
  // make_state(N)'s shapes, checked without making one (a decoding step).
  const auto& o = options;
  const std::vector<int64_t> conv{N, conv_channels(o), o.conv_kernel_dim() - 1};
  const std::vector<int64_t> recurrent{N, o.num_value_heads(), o.key_head_dim(),
                                       o.value_head_dim()};
  TORCH_CHECK(state.conv.defined() && state.recurrent.defined() &&
                  state.conv.sizes() == c10::IntArrayRef(conv) &&
                  state.recurrent.sizes() == c10::IntArrayRef(recurrent),
              who, ": state must be make_state(", N, ")'s shape: conv ",
              c10::IntArrayRef(conv), ", recurrent ",
              c10::IntArrayRef(recurrent));
  auto out = run(*this, x, state.conv, state.recurrent,
                 /*recurrent=*/x.size(1) == 1);
  state.tokens += x.size(1);
  return options.batch_first() ? out : out.transpose(0, 1);
}

}  // namespace mha
