// Glossary: N batch, L target (query) length, S source (key) length,
// S' = S plus the add_bias_kv / add_zero_attn positions, E embed_dim,
// H num_heads, D head_dim = E / H, Hkv num_kv_heads, Ekv = Hkv·D.
#include "mha/multi_head_attention.h"

#include <cmath>
#include <string>

#include "core/attention_core.h"
#include "core/blas_threads.h"
#include "mha/masks.h"
#include "modules/attention_families.h"
#include "modules/linear_attention_module.h"
#include "modules/module_inputs.h"
#include "modules/module_positions.h"
#include "modules/projection.h"

namespace mha {
namespace {

/// (N, H, L, D) → (N, L, E).
torch::Tensor merge_heads(const torch::Tensor& x) {
  const auto N = x.size(0);
  const auto L = x.size(2);
  return x.transpose(1, 2).reshape({N, L, -1});  // (N, L, E)
}

}  // namespace

MultiHeadAttentionOptions::MultiHeadAttentionOptions(int64_t embed_dim,
                                                     int64_t num_heads)
    : embed_dim_(embed_dim), num_heads_(num_heads) {}

MultiHeadAttentionImpl::MultiHeadAttentionImpl(
    const MultiHeadAttentionOptions& options_)
    : options(options_) {
  reset();
}

int64_t MultiHeadAttentionImpl::kdim() const {
  return options.kdim().value_or(options.embed_dim());
}

int64_t MultiHeadAttentionImpl::vdim() const {
  return options.vdim().value_or(options.embed_dim());
}

int64_t MultiHeadAttentionImpl::num_kv_heads() const {
  return options.num_kv_heads().value_or(options.num_heads());
}

bool MultiHeadAttentionImpl::packed_in_proj() const {
  const int64_t E = options.embed_dim(), H = options.num_heads();
  return kdim() == E && vdim() == E && num_kv_heads() == H &&
         options.head_dim().value_or(E / H) * H == E && !options.output_gate();
}

void MultiHeadAttentionImpl::reset() {
  const int64_t E = options.embed_dim();
  const int64_t H = options.num_heads();
  TORCH_CHECK(E > 0, "MultiHeadAttention: embed_dim must be > 0, but got ", E);
  TORCH_CHECK(H > 0, "MultiHeadAttention: num_heads must be > 0, but got ", H);
  TORCH_CHECK(options.head_dim().has_value() || E % H == 0,
              "MultiHeadAttention: embed_dim (", E,
              ") must be divisible by num_heads (", H,
              ") unless head_dim is set");
  const int64_t Hkv = num_kv_heads();
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0,
              "MultiHeadAttention: num_kv_heads must be > 0 and divide "
              "num_heads (",
              H, "), but got ", Hkv);
  TORCH_CHECK(kdim() > 0 && vdim() > 0,
              "MultiHeadAttention: kdim and vdim must be > 0, but got kdim=",
              kdim(), ", vdim=", vdim());
  TORCH_CHECK(options.dropout() >= 0.0 && options.dropout() < 1.0,
              "MultiHeadAttention: dropout must be in [0, 1), but got ",
              options.dropout());
  detail::check_family_options(*this);  // attention_families.h
  head_dim = options.head_dim().value_or(E / H);
  const int64_t Ekv = Hkv * head_dim;
  // The query projection's rows: H·D, twice that with output_gate.
  const int64_t Eq = H * head_dim * (options.output_gate() ? 2 : 1);
  if (options.rotary()) {
    TORCH_CHECK(options.rotary_dim().has_value() || head_dim % 2 == 0,
                "MultiHeadAttention: rotary needs an even head_dim, but got "
                "embed_dim / num_heads = ",
                head_dim);
    const int64_t R = options.rotary_dim().value_or(head_dim);
    TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= head_dim,
                "MultiHeadAttention: rotary_dim must be even with 2 <= "
                "rotary_dim <= head_dim = ",
                head_dim, ", but got ", R);
    check_rotary_scaling(options.rotary_scaling(), R, "MultiHeadAttention");
    TORCH_CHECK(!options.add_bias_kv() && !options.add_zero_attn(),
                "MultiHeadAttention: rotary cannot be combined with "
                "add_bias_kv or add_zero_attn (their extra key position has "
                "no position)");
    TORCH_CHECK(
        std::isfinite(options.rotary_theta()) && options.rotary_theta() > 0.0,
        "MultiHeadAttention: rotary_theta must be finite and > 0, but "
        "got ",
        options.rotary_theta());
  }

  TORCH_CHECK(
      options.rotary() || (!options.rotary_dim().has_value() &&
                           options.rotary_scaling().rope_type == "default"),
      "MultiHeadAttention: rotary_dim and rotary_scaling need "
      "rotary(true), but got rotary_dim=",
      options.rotary_dim().has_value() ? std::to_string(*options.rotary_dim())
                                       : std::string("nullopt"),
      ", rotary_scaling.rope_type=\"", options.rotary_scaling().rope_type,
      "\"");

  if (options.scale().has_value()) {
    TORCH_CHECK(std::isfinite(*options.scale()),
                "MultiHeadAttention: scale must be finite, but got ",
                *options.scale());
  }
  const bool extra_keys = options.add_bias_kv() || options.add_zero_attn();
  if (options.window().has_value()) {
    TORCH_CHECK(*options.window() >= 1,
                "MultiHeadAttention: window must be >= 1, but got ",
                *options.window());
  }
  TORCH_CHECK(!extra_keys || (!options.window().has_value() &&
                              options.position_bias() == PositionBias::kNone),
              "MultiHeadAttention: window and position_bias cannot be "
              "combined with add_bias_kv or add_zero_attn (their extra key "
              "position has no position)");
  if (options.position_bias() == PositionBias::kRelative) {
    // relative_position_bucket's rules, checked here rather than at the
    // first forward.
    const int64_t n = options.relative_bidirectional()
                          ? options.relative_num_buckets() / 2
                          : options.relative_num_buckets();
    TORCH_CHECK(n / 2 >= 1 && options.relative_max_distance() > n / 2,
                "MultiHeadAttention: relative_num_buckets must be >= ",
                options.relative_bidirectional() ? 4 : 2,
                " and relative_max_distance must exceed a quarter (half when "
                "not bidirectional) of it, but got relative_num_buckets=",
                options.relative_num_buckets(),
                ", relative_max_distance=", options.relative_max_distance());
  }

  // Registration order as PyTorch's, so named_parameters() lists the same
  // keys in the same order. Unused parameters are not registered.
  in_proj_weight = q_proj_weight = k_proj_weight = v_proj_weight =
      torch::Tensor();
  in_proj_bias = bias_k = bias_v = torch::Tensor();
  if (packed_in_proj()) {
    in_proj_weight =
        register_parameter("in_proj_weight", torch::empty({3 * E, E}));
  } else {
    q_proj_weight = register_parameter("q_proj_weight", torch::empty({Eq, E}));
    k_proj_weight =
        register_parameter("k_proj_weight", torch::empty({Ekv, kdim()}));
    v_proj_weight =
        register_parameter("v_proj_weight", torch::empty({Ekv, vdim()}));
  }
  if (options.bias()) {
    in_proj_bias =
        register_parameter("in_proj_bias", torch::empty({Eq + 2 * Ekv}));
  }
  if (options.add_bias_kv()) {
    bias_k = register_parameter("bias_k", torch::empty({1, 1, Ekv}));
    bias_v = register_parameter("bias_v", torch::empty({1, 1, Ekv}));
  }
  out_proj = register_module(
      "out_proj",
      torch::nn::Linear(
          torch::nn::LinearOptions(H * head_dim, E).bias(options.bias())));
  relative_attention_bias = nullptr;
  if (options.position_bias() == PositionBias::kRelative) {
    relative_attention_bias = register_module(
        "relative_attention_bias",
        torch::nn::Embedding(options.relative_num_buckets(), H));
  }
  detail::register_family_parameters(*this);
  detail::reset_attention_kind(*this);  // linear_attention_module.h
  reset_parameters();
}

void MultiHeadAttentionImpl::reset_parameters() {
  torch::NoGradGuard no_grad;
  for (auto* weight :
       {&in_proj_weight, &q_proj_weight, &k_proj_weight, &v_proj_weight}) {
    if (weight->defined()) {
      torch::nn::init::xavier_uniform_(*weight);
    }
  }
  if (in_proj_bias.defined()) {
    in_proj_bias.zero_();
  }
  out_proj->reset_parameters();
  if (out_proj->bias.defined()) {
    out_proj->bias.zero_();
  }
  if (bias_k.defined()) {
    torch::nn::init::xavier_normal_(bias_k);
    torch::nn::init::xavier_normal_(bias_v);
  }
  if (relative_attention_bias) {
    // As Hugging Face's T5: N(0, d_model^-1/2).
    relative_attention_bias->weight.normal_(
        0.0, 1.0 / std::sqrt(static_cast<double>(options.embed_dim())));
  }
  detail::reset_family_parameters(*this);
  detail::reset_attention_kind_parameters(*this);
}

void MultiHeadAttentionImpl::pretty_print(std::ostream& stream) const {
  stream << std::boolalpha
         << "mha::MultiHeadAttention(embed_dim=" << options.embed_dim()
         << ", num_heads=" << options.num_heads();
  if (options.dropout() != 0.0) {
    stream << ", dropout=" << options.dropout();
  }
  if (!options.bias()) {
    stream << ", bias=false";
  }
  if (options.add_bias_kv()) {
    stream << ", add_bias_kv=true";
  }
  if (options.add_zero_attn()) {
    stream << ", add_zero_attn=true";
  }
  if (options.kdim().has_value()) {
    stream << ", kdim=" << *options.kdim();
  }
  if (options.vdim().has_value()) {
    stream << ", vdim=" << *options.vdim();
  }
  if (options.num_kv_heads().has_value()) {
    stream << ", num_kv_heads=" << *options.num_kv_heads();
  }
  if (options.rotary()) {
    stream << ", rotary=true";
    if (options.rotary_theta() != 10000.0) {
      stream << ", rotary_theta=" << options.rotary_theta();
    }
    if (options.rotary_pairing() == RotaryPairing::kInterleaved) {
      stream << ", rotary_pairing=interleaved";
    }
    if (options.rotary_dim().has_value()) {
      stream << ", rotary_dim=" << *options.rotary_dim();
    }
    if (options.rotary_scaling().rope_type != "default") {
      stream << ", rotary_scaling=" << options.rotary_scaling().rope_type
             << "(factor=" << options.rotary_scaling().factor << ")";
    }
  }
  if (options.window().has_value()) {
    stream << ", window=" << *options.window();
  }
  if (options.head_dim().has_value()) {
    stream << ", head_dim=" << *options.head_dim();
  }
  if (options.qk_norm() != QKNorm::kNone) {
    const auto kind = options.qk_norm();
    stream << ", qk_norm="
           << (kind == QKNorm::kPerHead ? "per_head"
               : kind == QKNorm::kFull  ? "full"
                                        : "l2")
           << (options.qk_norm_unit_offset() ? "(1 + weight)" : "");
  }
  if (options.attention_sinks()) {
    stream << ", attention_sinks=true";
  }
  if (options.output_gate()) {
    stream << ", output_gate=true";
  }
  if (options.attention_chunk_size().has_value()) {
    stream << ", attention_chunk_size=" << *options.attention_chunk_size();
  }
  if (options.attn_temperature_tuning().has_value()) {
    stream << ", attn_temperature_tuning(floor_scale="
           << options.attn_temperature_tuning()->floor_scale
           << ", attn_scale=" << options.attn_temperature_tuning()->attn_scale
           << ")";
  }
  if (options.position_bias() == PositionBias::kAlibi) {
    stream << ", position_bias=alibi";
  } else if (options.position_bias() == PositionBias::kRelative) {
    stream << ", position_bias=relative(buckets="
           << options.relative_num_buckets()
           << ", max_distance=" << options.relative_max_distance()
           << (options.relative_bidirectional() ? ")" : ", unidirectional)");
  }
  detail::print_attention_kind(*this, stream);
  if (options.scale().has_value()) {
    stream << ", scale=" << *options.scale();
  }
  if (!options.batch_first()) {
    stream << ", batch_first=false";
  }
  stream << ")";
}

namespace {

/// The attention step of forward and forward_cached on the heads q
/// (N, H, L, D), k and v (N, Hkv, S', D): the core, out_proj, and the
/// caller's layout. Returns (output (N, L, E) as the input's layout,
/// weights (N, L, S') averaged, (N, H, L, S') per head, or undefined;
/// without N when unbatched). `packed`: as attention_core's.
std::tuple<torch::Tensor, torch::Tensor> attend_and_project(
    MultiHeadAttentionImpl& m, const torch::Tensor& q, const torch::Tensor& k,
    const torch::Tensor& v, const torch::Tensor& mask,
    const detail::KeyPositions& positions, bool batched, bool need_weights,
    bool average_attn_weights, const torch::Tensor& packed = {},
    const BlockMask& block_mask = {}, const torch::Tensor& gate = {}) {
  const double p_drop = m.is_training() ? m.options.dropout() : 0.0;
  const double scale = m.options.scale().value_or(
      1.0 / std::sqrt(static_cast<double>(m.head_dim)));
  const bool sinks = m.options.attention_sinks();
  // Sinks scale each head's weights: averaged after that.
  const auto weights_mode = !need_weights ? detail::WeightsMode::kNone
                            : average_attn_weights && !sinks
                                ? detail::WeightsMode::kAverage
                                : detail::WeightsMode::kPerHead;
  // The options' score_mod and the call's block mask (FlexAttention); the
  // logsumexp for the sinks.
  detail::FlexMods flex;
  flex.score_mod = m.options.score_mod();
  flex.block_mask = block_mask;
  flex.return_lse = sinks;
  auto result = detail::attention_core(q, k, v, mask, positions, p_drop, scale,
                                       weights_mode, packed, &flex);
  detail::apply_sinks(m, result.output, result.weights, result.lse);
  if (sinks && need_weights && average_attn_weights) {
    result.weights = result.weights.mean(1);  // (N, L, S')
  }
  // (N, H, L, D) → (N, L, H·D), gated → out_proj
  auto merged = merge_heads(result.output);
  if (gate.defined()) {
    merged = merged * torch::sigmoid(gate);
  }
  auto output = detail::project(merged, m.out_proj->weight,
                                m.out_proj->bias);  // (N, L, E)
  auto weights = result.weights;
  if (!batched) {
    output = output.squeeze(0);  // (L, E)
    if (weights.defined()) {
      weights = weights.squeeze(0);  // (L, S') or (H, L, S')
    }
  } else if (!m.options.batch_first()) {
    output = output.transpose(0, 1);  // (L, N, E)
  }
  return {output, weights};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> MultiHeadAttentionImpl::forward(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const torch::Tensor& key_padding_mask,
    bool need_weights, const torch::Tensor& attn_mask,
    bool average_attn_weights, bool is_causal, const torch::Tensor& positions,
    const BlockMask& block_mask) {
  if (detail::linear_kind(*this)) {  // linear_attention_module.h
    TORCH_CHECK(block_mask.empty(),
                "MultiHeadAttention: block_mask is not supported with "
                "attention_kind kLinear, kPerformer or kLinformer (a block "
                "mask selects blocks of the (L, S) scores, which these "
                "kinds never form); use key_padding_mask or is_causal");
    return detail::linear_kind_forward(
        *this, query, key, value, key_padding_mask, need_weights, attn_mask,
        average_attn_weights, is_causal, positions);
  }
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  // Self-attention is decided by the arguments, never by comparing data.
  const bool self_attention =
      !key.defined() || (key.is_same(query) && value.is_same(query));
  const bool key_is_value = key.defined() && key.is_same(value);
  auto in = detail::to_batch_first(*this, query, key, value, key_padding_mask);
  const int64_t N = in.query.size(0);
  const int64_t L = in.query.size(1);
  const int64_t S = in.key.size(1);
  const int64_t H = options.num_heads();
  const auto dtype = in.query.scalar_type();
  const auto device = in.query.device();
  TORCH_CHECK(!positions.defined() || self_attention,
              "MultiHeadAttention: positions is for self-attention (key and "
              "value undefined), but key and value were given");
  const auto at =
      detail::positions_2d(positions, N, L, in.batched, device,
                           "MultiHeadAttention");  // (N, L) or undefined

  // One additive mask broadcastable to (N, H, L, S).
  auto attn =
      detail::attn_mask_4d(attn_mask, N, H, L, S, in.batched, dtype, device);
  torch::Tensor padding;
  if (in.key_padding_mask.defined()) {
    padding = in.key_padding_mask.view({N, 1, 1, S});  // (N, 1, 1, S)
  }
  // The appended key positions of add_bias_kv / add_zero_attn are never
  // masked, causal or not: with them, the causal block is merged into the
  // mask before it is padded; without them the core applies it.
  const bool extra_keys = options.add_bias_kv() || options.add_zero_attn();
  torch::Tensor causal;
  if (is_causal && extra_keys) {
    causal = causal_mask(L, S, in.query.options());  // (L, S)
  }
  // Explicit positions: window and position bias as a dense mask.
  torch::Tensor rules_mask;
  if (at.defined()) {
    rules_mask = detail::position_rules_mask(*this, at, at, is_causal, dtype);
  } else if (options.attention_chunk_size().has_value()) {
    // The chunks at the token indices (with window and bias, as a mask).
    const auto index =
        torch::arange(L, in.query.options().dtype(torch::kLong)).expand({N, L});
    rules_mask =
        detail::position_rules_mask(*this, index, index, is_causal, dtype);
  }
  auto mask = merge_masks({attn, padding, causal, rules_mask}, dtype);

  auto p = detail::project_inputs(*this, in.query, in.key, in.value,
                                  self_attention, key_is_value);
  if (options.add_bias_kv()) {
    p.k = torch::cat({p.k, bias_k.expand({N, 1, -1})}, 1);  // (N, S+1, Ekv)
    p.v = torch::cat({p.v, bias_v.expand({N, 1, -1})}, 1);  // (N, S+1, Ekv)
  }
  const int64_t Hkv = num_kv_heads();
  torch::Tensor gate;  // (N, L, H·D) with output_gate
  auto q = detail::split_heads(detail::split_output_gate(*this, p.q, gate),
                               H);               // (N, H, L, D)
  auto k = detail::split_heads(p.k, Hkv);        // (N, Hkv, S', D)
  auto v = detail::split_heads(p.v, Hkv);        // (N, Hkv, S', D)
  detail::norm_before_rotary(*this, q, k);       // qk_norm
  detail::rotate_heads(*this, q, k, at, at, 0);  // row i at at[n][i], else at i
  detail::norm_after_rotary(*this, q, k);
  detail::tune_temperature(*this, q, 0);
  if (options.add_zero_attn()) {
    k = torch::cat({k, torch::zeros({N, Hkv, 1, head_dim}, k.options())},
                   2);  // (N, Hkv, S'+1, D)
    v = torch::cat({v, torch::zeros({N, Hkv, 1, head_dim}, v.options())}, 2);
  }
  const int64_t extra = k.size(2) - S;
  if (mask.defined() && extra > 0) {
    // The appended key positions are never masked.
    mask = torch::constant_pad_nd(mask, {0, extra}, 0.0);  // (..., S')
  }

  // The extra key positions and the position rules exclude each other
  // (reset), so the causal block goes to the core here only without them.
  auto rules =
      detail::key_positions(*this, L, S, /*diagonal=*/0,
                            is_causal && !extra_keys, in.query.options());
  if (rules_mask.defined()) {
    rules = detail::KeyPositions(rules.causal);  // in the mask already
  }
  if (!block_mask.empty()) {
    const auto S_all = k.size(2);
    TORCH_CHECK(block_mask.q_len == L && block_mask.kv_len == S_all,
                "MultiHeadAttention: the block_mask was made for q_len = ",
                block_mask.q_len, ", kv_len = ", block_mask.kv_len,
                ", but the call has L = ", L, " queries and S = ", S_all,
                " keys",
                extra > 0 ? " (with add_bias_kv / add_zero_attn)" : "");
    const auto& counts = block_mask.kv_num_blocks;
    TORCH_CHECK((counts.size(0) == 1 || counts.size(0) == N) &&
                    (counts.size(1) == 1 || counts.size(1) == H),
                "MultiHeadAttention: the block_mask's kv_num_blocks ",
                counts.sizes(), " must have B of 1 or N = ", N,
                " and H of 1 or num_heads = ", H);
  }
  return attend_and_project(*this, q, k, v, mask, rules, in.batched,
                            need_weights, average_attn_weights, p.packed,
                            block_mask, gate);
}

std::tuple<torch::Tensor, torch::Tensor> MultiHeadAttentionImpl::forward_cached(
    const torch::Tensor& query, KVCache& cache, bool is_causal,
    bool need_weights, bool average_attn_weights,
    const torch::Tensor& key_padding_mask, const torch::Tensor& positions) {
  if (detail::linear_kind(*this)) {  // linear_attention_module.h
    return detail::linear_kind_forward_cached(
        *this, query, cache, is_causal, need_weights, average_attn_weights,
        key_padding_mask, positions);
  }
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  TORCH_CHECK(!options.add_bias_kv() && !options.add_zero_attn(),
              "MultiHeadAttention::forward_cached: add_bias_kv and "
              "add_zero_attn are not supported with a cache");
  auto in = detail::to_batch_first(*this, query, {}, {}, {});
  const int64_t N = in.query.size(0);
  const int64_t T = in.query.size(1);
  const int64_t H = options.num_heads();
  const int64_t Hkv = num_kv_heads();
  TORCH_CHECK(cache.batch_size() == N && cache.num_kv_heads() == Hkv &&
                  cache.head_dim() == head_dim,
              "MultiHeadAttention::forward_cached: cache must hold (N, "
              "num_kv_heads, head_dim) = (",
              N, ", ", Hkv, ", ", head_dim, "), but holds (",
              cache.batch_size(), ", ", cache.num_kv_heads(), ", ",
              cache.head_dim(), ")");
  TORCH_CHECK(cache.options().dtype() == in.query.dtype() &&
                  cache.options().device() == in.query.device(),
              "MultiHeadAttention::forward_cached: cache must have query's "
              "dtype ",
              in.query.scalar_type(), " and device ", in.query.device(),
              ", but has ", cache.options().dtype(), " on ",
              cache.options().device());
  const int64_t P = cache.size();  // position of query row 0
  TORCH_CHECK(P + T <= cache.capacity(),
              "MultiHeadAttention::forward_cached: cache has room for ",
              cache.capacity() - P, " more positions (capacity ",
              cache.capacity(), ", ", P, " held), but query has ", T);

  const auto dtype = in.query.scalar_type();
  const auto device = in.query.device();
  const char* who = "MultiHeadAttention::forward_cached";
  const auto at =
      detail::positions_2d(positions, N, T, in.batched, device, who);  // (N, T)
  torch::Tensor padding;
  if (key_padding_mask.defined()) {
    check_mask(key_padding_mask, "key_padding_mask", dtype, device);
    const bool ok =
        in.batched
            ? key_padding_mask.dim() == 2 && key_padding_mask.size(0) == N &&
                  key_padding_mask.size(1) == P + T
            : key_padding_mask.dim() == 1 && key_padding_mask.size(0) == P + T;
    TORCH_CHECK(
        ok, who, ": key_padding_mask must be ",
        in.batched ? "(N, cache length + T) = (" : "(cache length + T) = (",
        in.batched ? std::to_string(N) + ", " : std::string(), P + T,
        ") over the cached and the new tokens, but got ",
        key_padding_mask.sizes());
    padding = key_padding_mask.view({N, 1, 1, P + T});  // (N, 1, 1, P+T)
  }

  auto p =
      detail::project_inputs(*this, in.query, in.query, in.query,
                             /*self_attention=*/true, /*key_is_value=*/true);
  torch::Tensor gate;  // (N, T, H·D) with output_gate
  auto q = detail::split_heads(detail::split_output_gate(*this, p.q, gate),
                               H);               // (N, H, T, D)
  auto k = detail::split_heads(p.k, Hkv);        // (N, Hkv, T, D)
  auto v = detail::split_heads(p.v, Hkv);        // (N, Hkv, T, D)
  detail::norm_before_rotary(*this, q, k);       // qk_norm
  detail::rotate_heads(*this, q, k, at, at, P);  // row t at at[n][t] or P + t
  detail::norm_after_rotary(*this, q, k);
  detail::tune_temperature(*this, q, P);
  auto [k_all, v_all] = cache.append(k, v, at);  // (N, Hkv, P + T, D)
  const bool needs_grad =
      torch::GradMode::is_enabled() && (k.requires_grad() || v.requires_grad());
  if (needs_grad) {
    // The cache's copies carry no gradient: this call's keys and values
    // join the earlier ones by a differentiable concatenation.
    k_all = torch::cat({k_all.narrow(2, 0, P), k}, 2);
    v_all = torch::cat({v_all.narrow(2, 0, P), v}, 2);
  }
  auto rules = detail::key_positions(*this, T, P + T, /*diagonal=*/P, is_causal,
                                     in.query.options());
  torch::Tensor rules_mask;
  if (at.defined() || !cache.positions_are_indices() ||
      options.attention_chunk_size().has_value()) {
    // Window and position bias at the recorded positions, as a dense mask.
    const auto q_at =
        at.defined() ? at : cache.positions().narrow(1, P, T);  // (N, T)
    rules_mask =
        detail::position_rules_mask(*this, q_at, cache.positions(), is_causal,
                                    dtype);  // (N, H|1, T, P+T)
    if (rules_mask.defined()) {
      rules = detail::KeyPositions(rules.causal);
      rules.diagonal = P;
    }
  }
  auto mask = merge_masks({padding, rules_mask}, dtype);
  return attend_and_project(*this, q, k_all, v_all, mask, rules, in.batched,
                            need_weights, average_attn_weights, {}, {}, gate);
}

ProjectedKeyValue MultiHeadAttentionImpl::project_key_value(
    const torch::Tensor& key, const torch::Tensor& value) const {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  detail::check_projectable(*this, "project_key_value");
  auto k_in = detail::batch_first_input(*this, key, "key", kdim(), "kdim");
  auto v_in = detail::batch_first_input(*this, value, "value", vdim(), "vdim");
  TORCH_CHECK(key.dim() == value.dim() && k_in.size(0) == v_in.size(0) &&
                  k_in.size(1) == v_in.size(1),
              "MultiHeadAttention::project_key_value: value must have key's "
              "batch size and length, but got key ",
              key.sizes(), " and value ", value.sizes());
  // in_proj_bias rows: query [0, E), key [E, E + Ekv), value [E + Ekv, ...)
  const int64_t E = options.embed_dim();
  const int64_t Ekv = num_kv_heads() * head_dim;
  const auto& w = in_proj_weight;
  const auto& b = in_proj_bias;
  const bool packed = packed_in_proj();
  auto k =
      detail::project(k_in, packed ? detail::rows_of(w, E, Ekv) : k_proj_weight,
                      detail::rows_of(b, E, Ekv));  // (N, S, Ekv)
  auto v = detail::project(
      v_in, packed ? detail::rows_of(w, E + Ekv, Ekv) : v_proj_weight,
      detail::rows_of(b, E + Ekv, Ekv));  // (N, S, Ekv)
  return {detail::split_heads(k, num_kv_heads()),
          detail::split_heads(v, num_kv_heads())};
}

std::tuple<torch::Tensor, torch::Tensor>
MultiHeadAttentionImpl::forward_projected(const torch::Tensor& query,
                                          const ProjectedKeyValue& key_value,
                                          const torch::Tensor& key_padding_mask,
                                          bool need_weights,
                                          bool average_attn_weights) {
  if (detail::linear_kind(*this)) {  // linear_attention_module.h
    return detail::linear_kind_forward_projected(*this, query, key_value,
                                                 key_padding_mask, need_weights,
                                                 average_attn_weights);
  }
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  detail::check_projectable(*this, "forward_projected");
  const int64_t E = options.embed_dim();
  auto q_in = detail::batch_first_input(*this, query, "query", E, "E");
  const int64_t N = q_in.size(0);
  const int64_t Hkv = num_kv_heads();
  const auto& k = key_value.key;
  const auto& v = key_value.value;
  TORCH_CHECK(k.defined() && v.defined() && k.dim() == 4 &&
                  k.sizes() == v.sizes() && k.size(0) == N &&
                  k.size(1) == Hkv && k.size(3) == head_dim,
              "MultiHeadAttention::forward_projected: key_value must hold "
              "key and value (N, num_kv_heads, S, head_dim) = (",
              N, ", ", Hkv, ", S, ", head_dim, "), but got key ",
              k.defined() ? k.sizes() : torch::IntArrayRef{}, " and value ",
              v.defined() ? v.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(k.scalar_type() == q_in.scalar_type() &&
                  v.scalar_type() == q_in.scalar_type() &&
                  k.device() == q_in.device() && v.device() == q_in.device(),
              "MultiHeadAttention::forward_projected: key_value must have "
              "query's dtype ",
              q_in.scalar_type(), " and device ", q_in.device(), ", but has ",
              k.scalar_type(), " on ", k.device());
  const int64_t S = k.size(2);
  torch::Tensor mask;
  if (key_padding_mask.defined()) {
    check_mask(key_padding_mask, "key_padding_mask", q_in.scalar_type(),
               q_in.device());
    const bool batched = query.dim() == 3;
    const bool ok =
        batched
            ? key_padding_mask.dim() == 2 && key_padding_mask.size(0) == N &&
                  key_padding_mask.size(1) == S
            : key_padding_mask.dim() == 1 && key_padding_mask.size(0) == S;
    TORCH_CHECK(ok, "key_padding_mask must be ",
                batched ? "(N, S) = (" + std::to_string(N) + ", "
                        : std::string("(S) = ("),
                S, "), but got ", key_padding_mask.sizes());
    mask = merge_masks({key_padding_mask.view({N, 1, 1, S})},
                       q_in.scalar_type());  // (N, 1, 1, S)
  }
  auto q = detail::project(
      q_in,
      packed_in_proj() ? detail::rows_of(in_proj_weight, 0, E) : q_proj_weight,
      detail::rows_of(in_proj_bias, 0, E));  // (N, T, E)
  return attend_and_project(*this, detail::split_heads(q, options.num_heads()),
                            k, v, mask, detail::KeyPositions(/*causal=*/false),
                            query.dim() == 3, need_weights,
                            average_attn_weights);
}

KVCache MultiHeadAttentionImpl::make_kv_cache(int64_t batch_size,
                                              int64_t capacity) const {
  if (detail::linear_kind(*this)) {  // linear_attention_module.h
    return detail::linear_kind_kv_cache(*this, batch_size, capacity);
  }
  return KVCache(batch_size, num_kv_heads(), capacity, head_dim,
                 out_proj->weight.options());
}

}  // namespace mha
