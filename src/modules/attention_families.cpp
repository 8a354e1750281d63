// The attention options of 2025's model families (attention_families.h).
#include "modules/attention_families.h"

#include <cmath>

namespace mha {

NormWeightImpl::NormWeightImpl(int64_t size) : size_(size) {
  TORCH_CHECK(size >= 0, "NormWeight: size must be >= 0, but got ", size);
  reset();
}

void NormWeightImpl::reset() {
  weight = register_parameter("weight", torch::ones({size_}));
}

}  // namespace mha

namespace mha::detail {

namespace {

/// x / sqrt(mean(x²) over `dims` + eps), in float32 for half inputs as
/// transformers' RMSNorm classes, returned in that float dtype.
torch::Tensor rms_normalized(const torch::Tensor& x, at::IntArrayRef dims,
                             double eps) {
  const bool half =
      x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
  const auto xf = half ? x.to(torch::kFloat) : x;
  return xf * torch::rsqrt(xf.pow(2).mean(dims, /*keepdim=*/true) + eps);
}

/// RMSNorm of heads x (N, Hx, T, D) with `weight` (D), or (Hx·D) over all
/// heads when `full`, times weight (or 1 + weight), in x's dtype.
torch::Tensor rms_norm_heads(const MultiHeadAttentionImpl& m,
                             const torch::Tensor& x,
                             const torch::Tensor& weight, bool full) {
  const auto Hx = x.size(1), D = x.size(3);
  auto normed = full ? rms_normalized(x, {1, 3}, m.options.qk_norm_eps())
                     : rms_normalized(x, {3}, m.options.qk_norm_eps());
  auto w = full ? weight.view({1, Hx, 1, D}) : weight.view({1, 1, 1, D});
  w = w.to(normed.scalar_type());
  if (m.options.qk_norm_unit_offset()) {
    w = w + 1.0;
  }
  return (normed * w).to(x.scalar_type());
}

}  // namespace

void check_family_options(const MultiHeadAttentionImpl& m) {
  const auto& o = m.options;
  if (o.head_dim().has_value()) {
    TORCH_CHECK(*o.head_dim() >= 1,
                "MultiHeadAttention: head_dim must be >= 1, but got ",
                *o.head_dim());
  }
  TORCH_CHECK(o.qk_norm_eps() >= 0.0 && std::isfinite(o.qk_norm_eps()),
              "MultiHeadAttention: qk_norm_eps must be finite and >= 0, but "
              "got ",
              o.qk_norm_eps());
  const bool family = o.head_dim().has_value() ||
                      o.qk_norm() != QKNorm::kNone || o.attention_sinks() ||
                      o.output_gate() || o.attention_chunk_size().has_value() ||
                      o.attn_temperature_tuning().has_value();
  TORCH_CHECK(!family || o.attention_kind() == AttentionKind::kSoftmax,
              "MultiHeadAttention: head_dim, qk_norm, attention_sinks, "
              "output_gate, attention_chunk_size and attn_temperature_tuning "
              "need attention_kind kSoftmax");
  TORCH_CHECK(!o.attention_sinks() || (!o.add_bias_kv() && !o.add_zero_attn()),
              "MultiHeadAttention: attention_sinks cannot be combined with "
              "add_bias_kv or add_zero_attn");
  if (o.attention_chunk_size().has_value()) {
    TORCH_CHECK(*o.attention_chunk_size() >= 1,
                "MultiHeadAttention: attention_chunk_size must be >= 1, but "
                "got ",
                *o.attention_chunk_size());
    TORCH_CHECK(!o.add_bias_kv() && !o.add_zero_attn(),
                "MultiHeadAttention: attention_chunk_size cannot be combined "
                "with add_bias_kv or add_zero_attn (their extra key position "
                "has no position)");
  }
  if (o.attn_temperature_tuning().has_value()) {
    const auto& tuning = *o.attn_temperature_tuning();
    TORCH_CHECK(tuning.floor_scale > 0 && std::isfinite(tuning.floor_scale) &&
                    std::isfinite(tuning.attn_scale),
                "MultiHeadAttention: attn_temperature_tuning needs a finite "
                "floor_scale > 0 and a finite attn_scale, but got floor_scale=",
                tuning.floor_scale, ", attn_scale=", tuning.attn_scale);
  }
}

void register_family_parameters(MultiHeadAttentionImpl& m) {
  const auto& o = m.options;
  const int64_t H = o.num_heads(), D = m.head_dim;
  m.q_norm = m.k_norm = nullptr;
  m.sinks = torch::Tensor();
  if (o.qk_norm() == QKNorm::kPerHead || o.qk_norm() == QKNorm::kFull) {
    const bool full = o.qk_norm() == QKNorm::kFull;
    m.q_norm = m.register_module("q_norm", NormWeight(full ? H * D : D));
    m.k_norm = m.register_module("k_norm",
                                 NormWeight(full ? m.num_kv_heads() * D : D));
  }
  if (o.attention_sinks()) {
    m.sinks = m.register_parameter("sinks", torch::empty({H}));
  }
}

void reset_family_parameters(MultiHeadAttentionImpl& m) {
  torch::NoGradGuard no_grad;
  for (auto* norm : {&m.q_norm, &m.k_norm}) {
    if (*norm) {
      (*norm)->weight.fill_(m.options.qk_norm_unit_offset() ? 0.0 : 1.0);
    }
  }
  if (m.sinks.defined()) {
    m.sinks.zero_();
  }
}

torch::Tensor split_output_gate(const MultiHeadAttentionImpl& m,
                                const torch::Tensor& q_proj,
                                torch::Tensor& gate) {
  if (!m.options.output_gate()) {
    gate = torch::Tensor();
    return q_proj;
  }
  const auto N = q_proj.size(0), L = q_proj.size(1);
  const int64_t H = m.options.num_heads(), D = m.head_dim;
  const auto per_head = q_proj.reshape({N, L, H, 2 * D});
  gate = per_head.narrow(3, D, D).reshape({N, L, H * D});
  return per_head.narrow(3, 0, D).reshape({N, L, H * D});
}

void norm_before_rotary(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                        torch::Tensor& k) {
  const auto kind = m.options.qk_norm();
  if (kind != QKNorm::kPerHead && kind != QKNorm::kFull) {
    return;
  }
  const bool full = kind == QKNorm::kFull;
  q = rms_norm_heads(m, q, m.q_norm->weight, full);
  k = rms_norm_heads(m, k, m.k_norm->weight, full);
}

void norm_after_rotary(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                       torch::Tensor& k) {
  if (m.options.qk_norm() != QKNorm::kL2) {
    return;
  }
  const double eps = m.options.qk_norm_eps();
  q = rms_normalized(q, {3}, eps).to(q.scalar_type());
  k = rms_normalized(k, {3}, eps).to(k.scalar_type());
}

void tune_temperature(const MultiHeadAttentionImpl& m, torch::Tensor& q,
                      int64_t offset) {
  if (!m.options.attn_temperature_tuning().has_value()) {
    return;
  }
  const auto& tuning = *m.options.attn_temperature_tuning();
  const auto dtype =
      q.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
  const auto t = torch::arange(offset, offset + q.size(2),
                               q.options().dtype(dtype));  // (L)
  const auto scales =
      torch::log1p(torch::floor((t + 1.0) / tuning.floor_scale)) *
          tuning.attn_scale +
      1.0;
  q = (q * scales.view({1, 1, -1, 1})).to(q.scalar_type());
}

void apply_sinks(const MultiHeadAttentionImpl& m, torch::Tensor& output,
                 torch::Tensor& weights, const torch::Tensor& lse) {
  if (!m.options.attention_sinks()) {
    return;
  }
  const int64_t H = m.options.num_heads();
  // A fully masked row: lse = -inf, the factor 0 (and no NaN).
  auto factor =
      torch::sigmoid(lse - m.sinks.to(lse.scalar_type()).view({1, H, 1}))
          .unsqueeze(-1);  // (N, H, L, 1)
  output = output * factor.to(output.scalar_type());
  if (weights.defined()) {
    weights = weights * factor.to(weights.scalar_type());
  }
}

}  // namespace mha::detail
