// Multi-head Latent Attention (mha/latent_attention.h): DeepSeek-V2/V3's
// attention, as transformers 5.x's DeepseekV3Attention computes it, with a
// latent decoding cache and the absorbed decoding path.
//
// Glossary: N batch, T new tokens, P tokens cached before the call, S = P +
// T keys, E embed_dim, H heads, r kv_lora_rank, dn qk_nope_head_dim, dr
// qk_rope_head_dim, dv v_head_dim, dq = dn + dr.
#include "mha/latent_attention.h"

#include <cmath>
#include <limits>

#include "core/attention_core.h"
#include "core/blas_threads.h"
#include "modules/module_inputs.h"
#include "modules/projection.h"

namespace mha {

MultiHeadLatentAttentionOptions::MultiHeadLatentAttentionOptions(
    int64_t embed_dim, int64_t num_heads)
    : embed_dim_(embed_dim), num_heads_(num_heads) {}

LatentCache::LatentCache(int64_t batch_size, int64_t capacity,
                         int64_t kv_lora_rank, int64_t qk_rope_head_dim,
                         const torch::TensorOptions& options) {
  TORCH_CHECK(batch_size >= 1 && capacity >= 0 && kv_lora_rank >= 1 &&
                  qk_rope_head_dim >= 1,
              "LatentCache: batch_size, kv_lora_rank and qk_rope_head_dim "
              "must be >= 1 and capacity >= 0, but got batch_size=",
              batch_size, ", capacity=", capacity,
              ", kv_lora_rank=", kv_lora_rank,
              ", qk_rope_head_dim=", qk_rope_head_dim);
  latent_ = torch::empty({batch_size, capacity, kv_lora_rank}, options);
  rotary_key_ = torch::empty({batch_size, capacity, qk_rope_head_dim}, options);
  positions_ =
      torch::zeros({batch_size, capacity}, options.dtype(torch::kLong));
}

void LatentCache::append(const torch::Tensor& latent,
                         const torch::Tensor& rotary_key,
                         const torch::Tensor& positions) {
  const int64_t N = batch_size();
  TORCH_CHECK(latent.dim() == 3 && latent.size(0) == N &&
                  latent.size(2) == latent_.size(2),
              "LatentCache::append: latent must be (N, T, kv_lora_rank) = (", N,
              ", T, ", latent_.size(2), "), but got ", latent.sizes());
  const int64_t T = latent.size(1);
  TORCH_CHECK(
      rotary_key.dim() == 3 && rotary_key.size(0) == N &&
          rotary_key.size(1) == T && rotary_key.size(2) == rotary_key_.size(2),
      "LatentCache::append: rotary_key must be (N, T, "
      "qk_rope_head_dim) = (",
      N, ", ", T, ", ", rotary_key_.size(2), "), but got ", rotary_key.sizes());
  TORCH_CHECK(
      positions.dim() == 2 && positions.size(0) == N && positions.size(1) == T,
      "LatentCache::append: positions must be (N, T) = (", N, ", ", T,
      "), but got ", positions.sizes());
  TORCH_CHECK(latent.scalar_type() == latent_.scalar_type() &&
                  latent.device() == latent_.device(),
              "LatentCache::append: latent must have the cache's dtype ",
              latent_.scalar_type(), " and device ", latent_.device(),
              ", but has ", latent.scalar_type(), " on ", latent.device());
  TORCH_CHECK(size_ + T <= capacity(), "LatentCache::append: room for ",
              capacity() - size_, " more tokens (capacity ", capacity(), ", ",
              size_, " held), but got ", T);
  torch::NoGradGuard no_grad;
  latent_.narrow(1, size_, T).copy_(latent);
  rotary_key_.narrow(1, size_, T).copy_(rotary_key);
  positions_.narrow(1, size_, T).copy_(positions);
  size_ += T;
}

namespace {

/// x / sqrt(mean(x²) + eps) · weight, in float32 for half inputs and the
/// weight applied in x's dtype (DeepseekV3RMSNorm).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight,
                       double eps) {
  const bool half =
      x.scalar_type() == torch::kBFloat16 || x.scalar_type() == torch::kHalf;
  const auto xf = half ? x.to(torch::kFloat) : x;
  const auto normed = xf * torch::rsqrt(xf.pow(2).mean(-1, true) + eps);
  return weight * normed.to(x.scalar_type());
}

/// x · weightᵀ + bias through mha's projection (projection.h).
torch::Tensor apply(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return detail::project(x, layer->weight, layer->bias);
}

torch::nn::Linear linear(int64_t in, int64_t out, bool bias) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

/// (N, T) int64 positions from `positions` ((N, T) or (T)) or offset +
/// 0..T-1.
torch::Tensor positions_of(const torch::Tensor& positions, int64_t N, int64_t T,
                           int64_t offset, const torch::Device& device,
                           const char* who) {
  if (!positions.defined()) {
    return torch::arange(
               offset, offset + T,
               torch::TensorOptions().dtype(torch::kLong).device(device))
        .expand({N, T});
  }
  TORCH_CHECK(positions.scalar_type() == torch::kLong &&
                  ((positions.dim() == 2 && positions.size(0) == N &&
                    positions.size(1) == T) ||
                   (positions.dim() == 1 && positions.size(0) == T)),
              who, ": positions must be int64 (N, T) = (", N, ", ", T,
              ") or (T), but got ", positions.scalar_type(), " ",
              positions.sizes());
  return positions.dim() == 1 ? positions.expand({N, T}) : positions;
}

}  // namespace

MultiHeadLatentAttentionImpl::MultiHeadLatentAttentionImpl(
    const MultiHeadLatentAttentionOptions& options_)
    : options(options_) {
  reset();
}

void MultiHeadLatentAttentionImpl::reset() {
  const auto& o = options;
  const int64_t E = o.embed_dim(), H = o.num_heads();
  const int64_t r = o.kv_lora_rank(), dn = o.qk_nope_head_dim();
  const int64_t dr = o.qk_rope_head_dim(), dv = o.v_head_dim();
  TORCH_CHECK(E > 0 && H > 0,
              "MultiHeadLatentAttention: embed_dim and num_heads must be > 0, "
              "but got embed_dim=",
              E, ", num_heads=", H);
  TORCH_CHECK(o.q_lora_rank() >= 0,
              "MultiHeadLatentAttention: q_lora_rank must be >= 0 (0: a plain "
              "q_proj), but got ",
              o.q_lora_rank());
  TORCH_CHECK(r > 0 && dv > 0 && dn >= 0,
              "MultiHeadLatentAttention: kv_lora_rank and v_head_dim must be "
              "> 0 and qk_nope_head_dim >= 0, but got kv_lora_rank=",
              r, ", v_head_dim=", dv, ", qk_nope_head_dim=", dn);
  TORCH_CHECK(dr > 0 && dr % 2 == 0,
              "MultiHeadLatentAttention: qk_rope_head_dim must be even and > "
              "0, but got ",
              dr);
  TORCH_CHECK(o.norm_eps() >= 0 && std::isfinite(o.norm_eps()),
              "MultiHeadLatentAttention: norm_eps must be finite and >= 0, but "
              "got ",
              o.norm_eps());
  TORCH_CHECK(std::isfinite(o.rotary_theta()) && o.rotary_theta() > 0,
              "MultiHeadLatentAttention: rotary_theta must be finite and > 0, "
              "but got ",
              o.rotary_theta());
  if (o.scale().has_value()) {
    TORCH_CHECK(std::isfinite(*o.scale()),
                "MultiHeadLatentAttention: scale must be finite, but got ",
                *o.scale());
  }
  check_rotary_scaling(o.rotary_scaling(), dr, "MultiHeadLatentAttention");
  const int64_t dq = dn + dr;
  q_proj = q_a_proj = q_b_proj = nullptr;
  q_a_layernorm = nullptr;
  if (o.q_lora_rank() == 0) {
    q_proj = register_module("q_proj", linear(E, H * dq, false));
  } else {
    q_a_proj =
        register_module("q_a_proj", linear(E, o.q_lora_rank(), o.bias()));
    q_a_layernorm =
        register_module("q_a_layernorm", NormWeight(o.q_lora_rank()));
    q_b_proj =
        register_module("q_b_proj", linear(o.q_lora_rank(), H * dq, false));
  }
  kv_a_proj_with_mqa =
      register_module("kv_a_proj_with_mqa", linear(E, r + dr, o.bias()));
  kv_a_layernorm = register_module("kv_a_layernorm", NormWeight(r));
  kv_b_proj = register_module("kv_b_proj", linear(r, H * (dn + dv), false));
  o_proj = register_module("o_proj", linear(H * dv, E, o.bias()));
}

void MultiHeadLatentAttentionImpl::pretty_print(std::ostream& stream) const {
  const auto& o = options;
  stream << "mha::MultiHeadLatentAttention(embed_dim=" << o.embed_dim()
         << ", num_heads=" << o.num_heads()
         << ", q_lora_rank=" << o.q_lora_rank()
         << ", kv_lora_rank=" << o.kv_lora_rank()
         << ", qk_nope_head_dim=" << o.qk_nope_head_dim()
         << ", qk_rope_head_dim=" << o.qk_rope_head_dim()
         << ", v_head_dim=" << o.v_head_dim();
  if (o.rotary_scaling().rope_type != "default") {
    stream << ", rotary_scaling=" << o.rotary_scaling().rope_type;
  }
  stream << ")";
}

double MultiHeadLatentAttentionImpl::softmax_scale() const {
  const auto& o = options;
  if (o.scale().has_value()) {
    return *o.scale();
  }
  double scale = 1.0 / std::sqrt(static_cast<double>(o.qk_nope_head_dim() +
                                                     o.qk_rope_head_dim()));
  const auto& s = o.rotary_scaling();
  if (s.rope_type != "default" && s.mscale_all_dim.value_or(0.0) != 0.0) {
    // yarn_get_mscale(factor, mscale_all_dim), squared.
    const double m = s.factor <= 1.0
                         ? 1.0
                         : 0.1 * *s.mscale_all_dim * std::log(s.factor) + 1.0;
    scale *= m * m;
  }
  return scale;
}

LatentPath MultiHeadLatentAttentionImpl::auto_path(int64_t T, int64_t S) const {
  const auto& o = options;
  const double H = o.num_heads(), r = o.kv_lora_rank();
  const double dn = o.qk_nope_head_dim(), dr = o.qk_rope_head_dim();
  const double dv = o.v_head_dim();
  const double absorbed = H * T * (S * (2 * r + dr) + (dn + dv) * r);
  const double naive = S * r * H * (dn + dv) + H * T * S * (dn + dr + dv);
  return absorbed < naive ? LatentPath::kAbsorbed : LatentPath::kNaive;
}

LatentCache MultiHeadLatentAttentionImpl::make_cache(int64_t batch_size,
                                                     int64_t capacity) const {
  const auto& w = kv_b_proj->weight;
  return LatentCache(
      batch_size, capacity, options.kv_lora_rank(), options.qk_rope_head_dim(),
      torch::TensorOptions().dtype(w.dtype()).device(w.device()));
}

namespace {

/// One call's queries and new latents.
struct LatentInputs {
  torch::Tensor q_nope;      // (N, H, T, dn)
  torch::Tensor q_rot;       // (N, H, T, dr), rotated
  torch::Tensor latent;      // (N, T, r), normalised
  torch::Tensor rotary_key;  // (N, T, dr), rotated
};

LatentInputs project(const MultiHeadLatentAttentionImpl& m,
                     const torch::Tensor& x, const torch::Tensor& at) {
  const auto& o = m.options;
  const int64_t N = x.size(0), T = x.size(1), H = o.num_heads();
  const int64_t r = o.kv_lora_rank(), dn = o.qk_nope_head_dim();
  const int64_t dr = o.qk_rope_head_dim();
  auto q = m.q_proj ? apply(m.q_proj, x)
                    : apply(m.q_b_proj,
                            rms_norm(apply(m.q_a_proj, x),
                                     m.q_a_layernorm->weight, o.norm_eps()));
  q = q.reshape({N, T, H, dn + dr}).transpose(1, 2);  // (N, H, T, dq)
  auto rotate = [&](const torch::Tensor& t) {
    return rotary_embedding_at(t, at, o.rotary_theta(), o.rotary_pairing(),
                               c10::nullopt, o.rotary_scaling());
  };
  const auto ckv = apply(m.kv_a_proj_with_mqa, x);  // (N, T, r + dr)
  LatentInputs in;
  in.q_nope = q.narrow(3, 0, dn);
  in.q_rot = rotate(q.narrow(3, dn, dr));
  in.latent =
      rms_norm(ckv.narrow(2, 0, r), m.kv_a_layernorm->weight, o.norm_eps());
  in.rotary_key = rotate(ckv.narrow(2, r, dr).unsqueeze(1)).squeeze(1);
  return in;
}

/// Attention of the queries over S latents (N, S, r) and rotated keys
/// (N, S, dr): (N, H, T, dv).
torch::Tensor attend(const MultiHeadLatentAttentionImpl& m,
                     const LatentInputs& in, const torch::Tensor& latent,
                     const torch::Tensor& rotary_key, const torch::Tensor& mask,
                     const detail::KeyPositions& rules, LatentPath path) {
  const auto& o = m.options;
  const int64_t N = latent.size(0), S = latent.size(1), H = o.num_heads();
  const int64_t r = o.kv_lora_rank(), dn = o.qk_nope_head_dim();
  const int64_t dr = o.qk_rope_head_dim(), dv = o.v_head_dim();
  const double scale = m.softmax_scale();
  if (path == LatentPath::kNaive) {
    // Keys and values of every latent, as DeepseekV3Attention.
    const auto kv = apply(m.kv_b_proj, latent)
                        .reshape({N, S, H, dn + dv})
                        .transpose(1, 2);  // (N, H, S, dn + dv)
    const auto k = torch::cat(
        {kv.narrow(3, 0, dn), rotary_key.unsqueeze(1).expand({N, H, S, dr})},
        3);                                               // (N, H, S, dq)
    const auto q = torch::cat({in.q_nope, in.q_rot}, 3);  // (N, H, T, dq)
    return detail::attention_core(q, k, kv.narrow(3, dn, dv), mask, rules, 0.0,
                                  scale, detail::WeightsMode::kNone)
        .output;
  }
  // Absorbed: q_nope · (W_uk c) = (W_ukᵀ q_nope) · c and W_uv (Σ p c): one
  // key/value head of r + dr (r) features shared by the H query heads.
  const auto w = m.kv_b_proj->weight.view({H, dn + dv, r});
  const auto q_latent =
      torch::matmul(in.q_nope, w.narrow(1, 0, dn));    // (N, H, T, r)
  const auto q = torch::cat({q_latent, in.q_rot}, 3);  // (N, H, T, r + dr)
  const auto k = torch::cat({latent, rotary_key}, 2).unsqueeze(1);
  const auto out_latent =
      detail::attention_core(q, k, latent.unsqueeze(1), mask, rules, 0.0, scale,
                             detail::WeightsMode::kNone)
          .output;  // (N, H, T, r)
  return torch::matmul(out_latent,
                       w.narrow(1, dn, dv).transpose(1, 2));  // (N, H, T, dv)
}

/// The additive (N, 1, 1, S) mask of a bool key_padding_mask (N, S), or
/// undefined.
torch::Tensor padding_mask(const torch::Tensor& kpm, int64_t N, int64_t S,
                           const torch::TensorOptions& options,
                           const char* who) {
  if (!kpm.defined()) {
    return torch::Tensor();
  }
  TORCH_CHECK(kpm.scalar_type() == torch::kBool && kpm.dim() == 2 &&
                  kpm.size(0) == N && kpm.size(1) == S,
              who, ": key_padding_mask must be bool (N, S) = (", N, ", ", S,
              "), true = padding, but got ", kpm.scalar_type(), " ",
              kpm.sizes());
  return torch::zeros({N, 1, 1, S}, options)
      .masked_fill(kpm.reshape({N, 1, 1, S}),
                   -std::numeric_limits<double>::infinity());
}

torch::Tensor project_out(const MultiHeadLatentAttentionImpl& m,
                          const torch::Tensor& heads) {
  const int64_t N = heads.size(0), T = heads.size(2);
  auto out =
      apply(m.o_proj, heads.transpose(1, 2).reshape({N, T, -1}));  // (N, T, E)
  return m.options.batch_first() ? out : out.transpose(0, 1);
}

}  // namespace

torch::Tensor MultiHeadLatentAttentionImpl::forward(
    const torch::Tensor& x_in, const torch::Tensor& key_padding_mask,
    bool is_causal, const torch::Tensor& positions) {
  const char* who = "MultiHeadLatentAttention::forward";
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const auto x = detail::sequence_input(
      x_in, options.embed_dim(), options.batch_first(), kv_b_proj->weight, who);
  const int64_t N = x.size(0), L = x.size(1);
  const auto at = positions_of(positions, N, L, 0, x.device(), who);
  const auto in = project(*this, x, at);
  const auto mask = padding_mask(key_padding_mask, N, L, x.options(), who);
  return project_out(
      *this, attend(*this, in, in.latent, in.rotary_key, mask,
                    detail::KeyPositions(is_causal), LatentPath::kNaive));
}

torch::Tensor MultiHeadLatentAttentionImpl::forward_cached(
    const torch::Tensor& x_in, LatentCache& cache, bool is_causal,
    const torch::Tensor& key_padding_mask, const torch::Tensor& positions,
    LatentPath path) {
  const char* who = "MultiHeadLatentAttention::forward_cached";
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  const auto x = detail::sequence_input(
      x_in, options.embed_dim(), options.batch_first(), kv_b_proj->weight, who);
  const int64_t N = x.size(0), T = x.size(1), P = cache.size();
  TORCH_CHECK(cache.batch_size() == N &&
                  cache.numbers_per_token() ==
                      options.kv_lora_rank() + options.qk_rope_head_dim(),
              who, ": cache must hold N = ", N,
              " sequences of kv_lora_rank + "
              "qk_rope_head_dim = ",
              options.kv_lora_rank() + options.qk_rope_head_dim(),
              " numbers per token, but holds ", cache.batch_size(), " of ",
              cache.numbers_per_token());
  TORCH_CHECK(P + T <= cache.capacity(), who, ": cache has room for ",
              cache.capacity() - P, " more tokens (capacity ", cache.capacity(),
              "), but x has ", T);
  const auto at = positions_of(positions, N, T, P, x.device(), who);
  const auto in = project(*this, x, at);
  cache.append(in.latent, in.rotary_key, at);
  auto latent = cache.latent(), rotary_key = cache.rotary_key();
  if (torch::GradMode::is_enabled() &&
      (in.latent.requires_grad() || in.rotary_key.requires_grad())) {
    // The cache's copies carry no gradient: this call's latents join the
    // earlier ones by a differentiable concatenation.
    latent = torch::cat({latent.narrow(1, 0, P), in.latent}, 1);
    rotary_key = torch::cat({rotary_key.narrow(1, 0, P), in.rotary_key}, 1);
  }
  const auto mask = padding_mask(key_padding_mask, N, P + T, x.options(), who);
  detail::KeyPositions rules(is_causal);
  rules.diagonal = P;  // token t sits at index P + t
  if (path == LatentPath::kAuto) {
    path = auto_path(T, P + T);
  }
  return project_out(*this,
                     attend(*this, in, latent, rotary_key, mask, rules, path));
}

}  // namespace mha
