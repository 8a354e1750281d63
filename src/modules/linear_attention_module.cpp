// MultiHeadAttention's linear-cost kinds (linear_attention_module.h): the
// options' checks, Linformer's projections and Performer's features, and
// forward, forward_cached and forward_projected through the core of
// core/linear_attention_core.h (kLinear, kPerformer) or the softmax core
// over projected keys (kLinformer); long causal self-attention of kLinear
// and kPerformer by segments (linear_attention_segments.cpp).
//
// Glossary: N batch, L target (query) length, S source (key) length, T new
// tokens of a decoding step, P tokens held by the cache before it, E
// embed_dim, H num_heads, Hkv num_kv_heads, G = H / Hkv query heads per
// key/value head, D head_dim, F features of φ (m for kPerformer), k
// projected_length and n max_length (kLinformer).
#include "modules/linear_attention_module.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "core/attention_core.h"
#include "core/blas_threads.h"
#include "core/linear_attention_core.h"
#include "mha/masks.h"
#include "modules/linear_attention_segments.h"
#include "modules/module_inputs.h"
#include "modules/module_positions.h"
#include "modules/projection.h"

namespace mha {
namespace detail {
namespace {

/// "kLinear", as the option is written.
const char* kind_name(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kSoftmax:
      return "kSoftmax";
    case AttentionKind::kLinear:
      return "kLinear";
    case AttentionKind::kPerformer:
      return "kPerformer";
    case AttentionKind::kLinformer:
      return "kLinformer";
  }
  return "?";
}

/// kLinear and kPerformer: the kinds that never form weights and keep sums.
bool keeps_sums(AttentionKind kind) {
  return kind == AttentionKind::kLinear || kind == AttentionKind::kPerformer;
}

/// The Performer's m: nb_features, or round(D · ln D), at least 1.
int64_t performer_features(const MultiHeadAttentionImpl& m) {
  if (m.options.nb_features() > 0) {
    return m.options.nb_features();
  }
  const auto D = static_cast<double>(m.head_dim);
  return std::max<int64_t>(1, std::llround(D * std::log(D)));
}

/// F, the features per head of kLinear (φ's output for one row) or
/// kPerformer (m).
int64_t kind_features(const MultiHeadAttentionImpl& m) {
  if (m.options.attention_kind() == AttentionKind::kPerformer) {
    return m.random_features.size(0);
  }
  if (!m.options.feature_map()) {
    return m.head_dim;  // elu(x) + 1
  }
  torch::NoGradGuard no_grad;
  return m.options
      .feature_map()(
          torch::zeros({1, m.head_dim}, m.out_proj->weight.options()))
      .size(-1);
}

/// need_weights=true on a kind that never forms weights: c10::Error.
void check_need_weights(const MultiHeadAttentionImpl& m, bool need_weights,
                        const char* who) {
  const auto kind = m.options.attention_kind();
  TORCH_CHECK(!need_weights || !keeps_sums(kind), who,
              ": need_weights=true is not supported with attention_kind ",
              kind_name(kind),
              ", which never forms the attention weights; "
              "pass need_weights=false (forward's default is true)");
}

/// key_padding_mask of `length` keys: (N, length), unbatched (length);
/// returns it as (N, length) or undefined. As forward's checks.
torch::Tensor padding_2d(const torch::Tensor& key_padding_mask, int64_t N,
                         int64_t length, bool batched, torch::ScalarType dtype,
                         const torch::Device& device, const char* who,
                         const char* what) {
  if (!key_padding_mask.defined()) {
    return key_padding_mask;
  }
  check_mask(key_padding_mask, "key_padding_mask", dtype, device);
  const bool ok =
      batched
          ? key_padding_mask.dim() == 2 && key_padding_mask.size(0) == N &&
                key_padding_mask.size(1) == length
          : key_padding_mask.dim() == 1 && key_padding_mask.size(0) == length;
  TORCH_CHECK(ok, who, ": key_padding_mask must be ", batched ? "(N, " : "(",
              what, ") = (", batched ? std::to_string(N) + ", " : std::string(),
              length, "), but got ", key_padding_mask.sizes());
  return key_padding_mask.view({N, length});  // (N, length)
}

/// x (N, Hkv, S, X) narrowed or zero-padded (log features: -inf) to L rows:
/// causal attention from L queries, top-left (query i sees keys j <= i).
torch::Tensor rows_for_causal(const torch::Tensor& x, int64_t L,
                              double fill = 0.0) {
  const int64_t S = x.size(-2);
  if (S >= L) {
    return x.narrow(-2, 0, L);
  }
  return torch::constant_pad_nd(x, {0, 0, 0, L - S}, fill);
}

/// The result of a kind's attention over the heads.
struct HeadsResult {
  torch::Tensor output;  // (N, H, L, D)
  // kLinformer with need_weights: (N, L, k) or (N, H, L, k); else undefined.
  torch::Tensor weights;
};

/// F as far as known before φ runs: the Performer's m, or D (elu(x) + 1;
/// a custom φ's F may differ).
int64_t planned_features(const MultiHeadAttentionImpl& m) {
  return m.options.attention_kind() == AttentionKind::kPerformer
             ? m.random_features.size(0)
             : m.head_dim;
}

/// The block length of kLinear / kPerformer's causal form.
int64_t kind_block(const MultiHeadAttentionImpl& m) {
  return causal_block_length(planned_features(m), m.head_dim);
}

/// The rows of a segment of kLinear / kPerformer for a batch of N
/// (segment_rows), in inference and in training by segments: its query
/// features (N, H, rows, F) and in-projection (N, rows, 3E) together within
/// kSegmentBytes (F: planned_features). A training segment's graph holds a
/// few times that (features of queries and keys, their exponents, the
/// projections), each tensor well under the 32 MiB from which glibc maps
/// every allocation fresh (whose page faults made the whole sequence's
/// tensors cost more than their arithmetic; docs/linear.md).
int64_t kind_segment_rows(const MultiHeadAttentionImpl& m, int64_t N,
                          int64_t element_size) {
  const int64_t per_row =
      m.options.num_heads() * planned_features(m) + 3 * m.options.embed_dim();
  return segment_rows(N * per_row * element_size, kind_block(m));
}

}  // namespace

// Declared in linear_attention_segments.h, whose segments are made of it.
torch::Tensor attend_with_sums(const MultiHeadAttentionImpl& m,
                               const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v,
                               const torch::Tensor& padding, bool causal,
                               const LinearSums& sums, LinearSums* sums_out) {
  const auto& o = m.options;
  const int64_t N = q.size(0), H = q.size(1), L = q.size(2);
  const int64_t Hkv = k.size(1), S = k.size(2), D = q.size(3);
  const int64_t G = H / Hkv;
  auto qg = q.reshape({N, Hkv, G, L, D});  // (N, Hkv, G, L, D)
  auto kg = k.unsqueeze(2);                // (N, Hkv, 1, S, D)
  auto vg = v.unsqueeze(2);                // (N, Hkv, 1, S, D)
  // F: the Performer's m; for kLinear known once φ has mapped some rows
  // (elu(x) + 1: D), and the same for every segment, queries and keys.
  int64_t features_per_head = -1;
  // The features of rows [begin, begin + length) of x (N, Hkv, G or 1, T,
  // D), as FAVOR+'s exponents or φ; keys' padded rows zeroed (log: -inf)
  // or weighted.
  const auto features = [&](const torch::Tensor& x, int64_t begin,
                            int64_t length, bool is_key) {
    auto rows = x.narrow(3, begin, length);
    Features f;
    if (o.attention_kind() == AttentionKind::kLinear) {
      const FeatureMap& phi =
          o.feature_map() ? o.feature_map() : FeatureMap(elu_feature_map);
      f = {phi(rows), /*log=*/false};
    } else {
      // FAVOR+ approximates exp(q·k · scale): q and k scaled by sqrt(scale),
      // D^(-1/4) by default (Choromanski et al., 2021, section 2.2).
      const double root = std::sqrt(
          o.scale().value_or(1.0 / std::sqrt(static_cast<double>(D))));
      f = {favor_exponents(rows * root, m.random_features), /*log=*/true};
    }
    TORCH_CHECK(
        f.values.dim() == 5 && f.values.size(3) == length &&
            (features_per_head < 0 || f.values.size(-1) == features_per_head),
        "MultiHeadAttention: feature_map must map (..., T, D) to (..., "
        "T, F), the same F for queries and keys, but mapped ",
        is_key ? "key" : "query", " heads ", rows.sizes(), " to ",
        f.values.sizes(),
        features_per_head < 0
            ? std::string()
            : " (F = " + std::to_string(features_per_head) + " before)");
    features_per_head = f.values.size(-1);
    if (is_key && padding.defined()) {
      auto p = padding.narrow(1, begin, length).view({N, 1, 1, length, 1});
      if (p.scalar_type() == torch::kBool) {
        f.values = f.values.masked_fill(
            p, f.log ? -std::numeric_limits<double>::infinity() : 0.0);
      } else {
        f.values = f.log ? f.values + p : f.values * torch::exp(p);
      }
    }
    return f;
  };
  const int64_t block = kind_block(m);
  // Inference: the features a segment at a time (at L = 64k, 4 heads, the
  // Performer's 266 features: under 8 MiB instead of 1.1 GB of fresh memory,
  // whose page faults cost more than its arithmetic on this project's VM).
  const int64_t rows =
      kind_segment_rows(m, N, static_cast<int64_t>(q.element_size()));
  if (by_segments(L, S, causal, rows)) {
    return linear_attention_by_segments(
               [&](int64_t b, int64_t n) { return features(qg, b, n, false); },
               [&](int64_t b, int64_t n) { return features(kg, b, n, true); },
               vg, L, causal, sums, rows, block, sums_out)
        .reshape({N, H, L, D});  // (N, H, L, D)
  }
  const auto queries = features(qg, 0, L, false);  // (N, Hkv, G, L, F)
  const auto keys = features(kg, 0, S, true);      // (N, Hkv, 1, S, F)
  torch::Tensor out;                               // (N, Hkv, G, L, D)
  if (causal) {
    const double fill =
        keys.log ? -std::numeric_limits<double>::infinity() : 0.0;
    const Features aligned{rows_for_causal(keys.values, L, fill), keys.log};
    out = causal_linear_attention(queries, aligned, rows_for_causal(vg, L),
                                  sums, block, sums_out);
  } else {
    auto all = add_keys(sums, keys, vg);
    out = read_sums(queries, all);
    if (sums_out != nullptr) {
      *sums_out = all;
    }
  }
  return out.reshape({N, H, L, D});  // (N, H, L, D)
}

namespace {

/// kLinformer over q (N, H, L, D), k, v (N, Hkv, S, D): keys and values
/// projected along the sequence by proj_k / proj_v (first S columns), then
/// softmax attention over the k projected rows. padding: bool (N, S)
/// (padded keys and values are zeroed before the projection) or undefined.
HeadsResult attend_linformer(const MultiHeadAttentionImpl& m,
                             const torch::Tensor& q, const torch::Tensor& k,
                             const torch::Tensor& v,
                             const torch::Tensor& padding, WeightsMode weights,
                             double dropout_p, const char* who) {
  const auto& o = m.options;
  const int64_t S = k.size(2);
  TORCH_CHECK(S <= o.max_length(), who, ": the key length S = ", S,
              " exceeds max_length n = ", o.max_length(),
              " of attention_kind kLinformer (proj_k is (projected_length, "
              "max_length) = ",
              m.proj_k.sizes(), ")");
  TORCH_CHECK(!padding.defined() || padding.scalar_type() == torch::kBool, who,
              ": key_padding_mask must be bool (true = padding) with "
              "attention_kind kLinformer, which zeroes padded keys and values "
              "before projecting them along the sequence, but got dtype ",
              padding.defined() ? padding.scalar_type() : torch::kBool);
  auto keys = k, values = v;
  if (padding.defined()) {
    auto p = padding.view({padding.size(0), 1, S, 1});  // (N, 1, S, 1)
    keys = keys.masked_fill(p, 0.0);
    values = values.masked_fill(p, 0.0);
  }
  auto E = m.proj_k.narrow(1, 0, S);  // (k, S)
  auto F = o.share_kv_projection() ? E : m.proj_v.narrow(1, 0, S);
  keys = torch::matmul(E, keys);  // (k, S)·(N, Hkv, S, D) → (N, Hkv, k, D)
  values = torch::matmul(F, values);  // (N, Hkv, k, D)
  const double scale =
      o.scale().value_or(1.0 / std::sqrt(static_cast<double>(m.head_dim)));
  auto result =
      attention_core(q, keys, values, /*mask=*/{},
                     KeyPositions(/*causal=*/false), dropout_p, scale, weights);
  return {result.output, result.weights};
}

/// A kind's attention over the heads (what attention_core is to kSoftmax).
HeadsResult attend_heads(const MultiHeadAttentionImpl& m,
                         const torch::Tensor& q, const torch::Tensor& k,
                         const torch::Tensor& v, const torch::Tensor& padding,
                         bool causal, bool need_weights,
                         bool average_attn_weights, const char* who) {
  if (m.options.attention_kind() == AttentionKind::kLinformer) {
    const auto weights = !need_weights          ? WeightsMode::kNone
                         : average_attn_weights ? WeightsMode::kAverage
                                                : WeightsMode::kPerHead;
    const double p = m.is_training() ? m.options.dropout() : 0.0;
    return attend_linformer(m, q, k, v, padding, weights, p, who);
  }
  return {attend_with_sums(m, q, k, v, padding, causal, {}, nullptr), {}};
}

}  // namespace

// Declared in linear_attention_segments.h.
torch::Tensor out_projection(const MultiHeadAttentionImpl& m,
                             const torch::Tensor& heads) {
  auto merged = heads.transpose(1, 2).reshape(
      {heads.size(0), heads.size(2), -1});  // (N, L, E)
  return project(merged, m.out_proj->weight, m.out_proj->bias);
}

namespace {

/// output (N, L, E) and weights in the caller's layout (as forward's
/// attend_and_project).
std::tuple<torch::Tensor, torch::Tensor> in_caller_layout(
    const MultiHeadAttentionImpl& m, torch::Tensor output,
    torch::Tensor weights, bool batched) {
  if (!batched) {
    output = output.squeeze(0);  // (L, E)
    if (weights.defined()) {
      weights = weights.squeeze(0);  // (L, k) or (H, L, k)
    }
  } else if (!m.options.batch_first()) {
    output = output.transpose(0, 1);  // (L, N, E)
  }
  return {output, weights};
}

/// out_proj of the heads (N, H, L, D) and the caller's layout.
std::tuple<torch::Tensor, torch::Tensor> project_output(
    const MultiHeadAttentionImpl& m, const HeadsResult& heads, bool batched) {
  return in_caller_layout(m, out_projection(m, heads.output), heads.weights,
                          batched);
}

/// The options no linear-cost kind takes (they give keys positions or
/// extra rows, or act on weights these kinds never form).
void check_kind_options(const MultiHeadAttentionImpl& m) {
  const auto& o = m.options;
  const auto kind = o.attention_kind();
  if (kind != AttentionKind::kSoftmax) {
    const char* option = o.add_bias_kv()     ? "add_bias_kv"
                         : o.add_zero_attn() ? "add_zero_attn"
                         : o.window()        ? "window"
                         : o.position_bias() != PositionBias::kNone
                             ? "position_bias"
                         : o.score_mod() ? "score_mod"
                                         : nullptr;
    TORCH_CHECK(option == nullptr, "MultiHeadAttention: the option ", option,
                " is not supported with attention_kind ", kind_name(kind),
                " (it adds key rows or acts on the (L, S) scores; this kind "
                "forms no (L, S) scores)");
  }
  if (keeps_sums(kind)) {
    TORCH_CHECK(o.dropout() == 0.0,
                "MultiHeadAttention: dropout must be 0 "
                "with attention_kind ",
                kind_name(kind),
                ", which never forms the attention weights dropout acts on, "
                "but got ",
                o.dropout());
  }
  if (kind == AttentionKind::kLinear) {
    TORCH_CHECK(!o.scale().has_value(),
                "MultiHeadAttention: scale has no meaning with attention_kind "
                "kLinear (its feature map sees the unscaled heads), but got ",
                o.scale().value_or(0.0));
  }
  if (kind == AttentionKind::kLinformer) {
    TORCH_CHECK(!o.rotary(),
                "MultiHeadAttention: rotary is not supported with "
                "attention_kind kLinformer (its projection mixes the key "
                "positions)");
    TORCH_CHECK(o.projected_length() >= 1 && o.max_length() >= 1,
                "MultiHeadAttention: attention_kind kLinformer needs "
                "projected_length >= 1 and max_length >= 1, but got "
                "projected_length=",
                o.projected_length(), ", max_length=", o.max_length());
  }
  TORCH_CHECK(o.nb_features() >= 0,
              "MultiHeadAttention: nb_features must be >= 0, but got ",
              o.nb_features());
  // Options of another kind than the one chosen would be ignored silently.
  const char* foreign =
      kind != AttentionKind::kLinear && o.feature_map() ? "feature_map"
      : kind != AttentionKind::kPerformer && o.nb_features() != 0
          ? "nb_features"
      : kind != AttentionKind::kLinformer && o.projected_length() != 0
          ? "projected_length"
      : kind != AttentionKind::kLinformer && o.max_length() != 0 ? "max_length"
      : kind != AttentionKind::kLinformer && !o.share_kv_projection()
          ? "share_kv_projection"
          : nullptr;
  TORCH_CHECK(foreign == nullptr, "MultiHeadAttention: the option ", foreign,
              " does not apply to attention_kind ", kind_name(kind),
              " (feature_map: kLinear; nb_features: kPerformer; "
              "projected_length, max_length, share_kv_projection: "
              "kLinformer)");
}

}  // namespace

void reset_attention_kind(MultiHeadAttentionImpl& m) {
  check_kind_options(m);
  m.proj_k = m.proj_v = m.random_features = torch::Tensor();
  const auto& o = m.options;
  if (o.attention_kind() == AttentionKind::kLinformer) {
    const auto k = o.projected_length(), n = o.max_length();
    m.proj_k = m.register_parameter("proj_k", torch::empty({k, n}));
    if (!o.share_kv_projection()) {
      m.proj_v = m.register_parameter("proj_v", torch::empty({k, n}));
    }
  } else if (o.attention_kind() == AttentionKind::kPerformer) {
    m.random_features = m.register_buffer(
        "random_features", torch::empty({performer_features(m), m.head_dim}));
  }
}

void reset_attention_kind_parameters(MultiHeadAttentionImpl& m) {
  torch::NoGradGuard no_grad;
  for (auto* projection : {&m.proj_k, &m.proj_v}) {
    if (projection->defined()) {
      // As the Linformer authors' fairseq code (compress_k, compress_v).
      torch::nn::init::xavier_uniform_(*projection, 1.0 / std::sqrt(2.0));
    }
  }
  if (m.random_features.defined()) {
    m.random_features.copy_(orthogonal_random_features(
        m.random_features.size(0), m.random_features.size(1),
        m.options.feature_seed(), m.random_features.options()));
  }
}

void print_attention_kind(const MultiHeadAttentionImpl& m,
                          std::ostream& stream) {
  const auto& o = m.options;
  if (o.attention_kind() == AttentionKind::kSoftmax) {
    return;
  }
  stream << ", attention_kind=" << to_string(o.attention_kind());
  if (o.feature_map()) {
    stream << ", feature_map=custom";
  }
  if (o.nb_features() != 0) {
    stream << ", nb_features=" << o.nb_features();
  }
  if (o.attention_kind() == AttentionKind::kPerformer &&
      o.feature_seed() != 0) {
    stream << ", feature_seed=" << o.feature_seed();
  }
  if (o.attention_kind() == AttentionKind::kLinformer) {
    stream << ", projected_length=" << o.projected_length()
           << ", max_length=" << o.max_length();
    if (!o.share_kv_projection()) {
      stream << ", share_kv_projection=false";
    }
  }
}

std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward(
    MultiHeadAttentionImpl& m, const torch::Tensor& query,
    const torch::Tensor& key, const torch::Tensor& value,
    const torch::Tensor& key_padding_mask, bool need_weights,
    const torch::Tensor& attn_mask, bool average_attn_weights, bool is_causal,
    const torch::Tensor& positions) {
  const BlasCallGuard blas_guard;  // blas_threads.h
  const char* who = "MultiHeadAttention";
  const auto kind = m.options.attention_kind();
  check_need_weights(m, need_weights, who);
  TORCH_CHECK(!attn_mask.defined(), who,
              ": attn_mask is not supported with attention_kind ",
              kind_name(kind),
              ", which forms no (L, S) scores to mask, but "
              "got attn_mask ",
              attn_mask.sizes(),
              "; use is_causal for causal attention and key_padding_mask for "
              "padding");
  TORCH_CHECK(!is_causal || kind != AttentionKind::kLinformer, who,
              ": is_causal is not supported with attention_kind kLinformer: "
              "its projection along the sequence mixes every key position, "
              "later ones included, into each projected key (Wang et al., "
              "2020, is non-causal only)");
  // Self-attention is decided by the arguments, never by comparing data.
  const bool self_attention =
      !key.defined() || (key.is_same(query) && value.is_same(query));
  const bool key_is_value = key.defined() && key.is_same(value);
  auto in = to_batch_first(m, query, key, value, key_padding_mask);
  const int64_t N = in.query.size(0);
  const int64_t L = in.query.size(1);
  TORCH_CHECK(!positions.defined() || self_attention, who,
              ": positions is for self-attention (key and value undefined), "
              "but key and value were given");
  const auto at = positions_2d(positions, N, L, in.batched, in.query.device(),
                               who);  // (N, L) or undefined
  if (keeps_sums(kind) && self_attention && is_causal) {
    const int64_t rows = kind_segment_rows(m, N, in.query.element_size());
    if (by_segments(L, L, /*causal=*/true, rows)) {
      return in_caller_layout(m,
                              causal_forward_by_segments(
                                  m, in.query, in.key_padding_mask, at, rows),
                              {}, in.batched);
    }
    if (trains_by_segments(m, L, rows, in.key_padding_mask)) {
      return in_caller_layout(m,
                              checkpointed_forward_by_segments(
                                  m, in.query, in.key_padding_mask, at, rows),
                              {}, in.batched);
    }
  }
  auto p = project_inputs(m, in.query, in.key, in.value, self_attention,
                          key_is_value);
  auto q = split_heads(p.q, m.options.num_heads());  // (N, H, L, D)
  auto k = split_heads(p.k, m.num_kv_heads());       // (N, Hkv, S, D)
  auto v = split_heads(p.v, m.num_kv_heads());       // (N, Hkv, S, D)
  rotate_heads(m, q, k, at, at, 0);  // row i at at[n][i], else at i
  auto heads = attend_heads(m, q, k, v, in.key_padding_mask, is_causal,
                            need_weights, average_attn_weights, who);
  return project_output(m, heads, in.batched);
}

std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward_cached(
    MultiHeadAttentionImpl& m, const torch::Tensor& query, KVCache& cache,
    bool is_causal, bool need_weights, bool average_attn_weights,
    const torch::Tensor& key_padding_mask, const torch::Tensor& positions) {
  (void)average_attn_weights;      // no weights: need_weights must be false
  const BlasCallGuard blas_guard;  // blas_threads.h
  const char* who = "MultiHeadAttention::forward_cached";
  const auto kind = m.options.attention_kind();
  TORCH_CHECK(kind != AttentionKind::kLinformer, who,
              ": attention_kind kLinformer cannot decode token by token: its "
              "projection along the sequence mixes every key position, later "
              "ones included (Wang et al., 2020, is non-causal only)");
  check_need_weights(m, need_weights, who);
  auto in = to_batch_first(m, query, {}, {}, {});
  const int64_t N = in.query.size(0);
  const int64_t T = in.query.size(1);
  const int64_t Hkv = m.num_kv_heads();
  TORCH_CHECK(cache.is_recurrent(), who, ": attention_kind ", kind_name(kind),
              " decodes with a recurrent cache (the constant-size state of "
              "linear attention), but got a cache of keys and values; make it "
              "with make_kv_cache of this module");
  const int64_t F = kind_features(m);
  TORCH_CHECK(cache.batch_size() == N && cache.num_kv_heads() == Hkv &&
                  cache.feature_dim() == F && cache.head_dim() == m.head_dim,
              who,
              ": cache must hold (N, num_kv_heads, features, head_dim) = (", N,
              ", ", Hkv, ", ", F, ", ", m.head_dim, "), but holds (",
              cache.batch_size(), ", ", cache.num_kv_heads(), ", ",
              cache.feature_dim(), ", ", cache.head_dim(), ")");
  TORCH_CHECK(cache.options().dtype() == in.query.dtype() &&
                  cache.options().device() == in.query.device(),
              who, ": cache must have query's dtype ", in.query.scalar_type(),
              " and device ", in.query.device(), ", but has ",
              cache.options().dtype(), " on ", cache.options().device());
  const int64_t P = cache.size();  // position of query row 0
  TORCH_CHECK(P + T <= cache.capacity(), who, ": cache has room for ",
              cache.capacity() - P, " more positions (capacity ",
              cache.capacity(), ", ", P, " held), but query has ", T);
  const auto dtype = in.query.scalar_type();
  const auto device = in.query.device();
  auto padding = padding_2d(key_padding_mask, N, P + T, in.batched, dtype,
                            device, who, "cache length + T");
  if (padding.defined()) {
    // The cached tokens were added (or left out) by earlier calls: only
    // the new tokens' columns are read.
    padding = padding.narrow(1, P, T);  // (N, T)
  }
  const auto at = positions_2d(positions, N, T, in.batched, device, who);
  auto p = project_inputs(m, in.query, in.query, in.query,
                          /*self_attention=*/true, /*key_is_value=*/true);
  auto q = split_heads(p.q, m.options.num_heads());  // (N, H, T, D)
  auto k = split_heads(p.k, Hkv);                    // (N, Hkv, T, D)
  auto v = split_heads(p.v, Hkv);                    // (N, Hkv, T, D)
  rotate_heads(m, q, k, at, at, P);  // row t at at[n][t] or P + t
  LinearSums sums;                   // (N, Hkv, 1, ...): broadcast over G
  if (P > 0) {
    sums.kv = cache.kv_state().unsqueeze(2);  // (N, Hkv, 1, F, D)
    sums.k = cache.k_state().unsqueeze(2);    // (N, Hkv, 1, F)
    if (kind == AttentionKind::kPerformer) {
      sums.offset = cache.state_offset().unsqueeze(2);  // (N, Hkv, 1, F)
    }
  }
  LinearSums after;
  auto out = attend_with_sums(m, q, k, v, padding, is_causal, sums, &after);
  cache.update_state(after.kv.squeeze(2).detach(), after.k.squeeze(2).detach(),
                     after.offset.defined() ? after.offset.squeeze(2).detach()
                                            : torch::Tensor(),
                     T);
  return project_output(m, {out, {}}, in.batched);
}

std::tuple<torch::Tensor, torch::Tensor> linear_kind_forward_projected(
    MultiHeadAttentionImpl& m, const torch::Tensor& query,
    const ProjectedKeyValue& key_value, const torch::Tensor& key_padding_mask,
    bool need_weights, bool average_attn_weights) {
  const BlasCallGuard blas_guard;  // blas_threads.h
  const char* who = "MultiHeadAttention::forward_projected";
  check_projectable(m, "forward_projected");
  check_need_weights(m, need_weights, who);
  const int64_t E = m.options.embed_dim();
  auto q_in = batch_first_input(m, query, "query", E, "E");  // (N, L, E)
  const int64_t N = q_in.size(0);
  const int64_t Hkv = m.num_kv_heads();
  const auto& k = key_value.key;
  const auto& v = key_value.value;
  TORCH_CHECK(k.defined() && v.defined() && k.dim() == 4 &&
                  k.sizes() == v.sizes() && k.size(0) == N &&
                  k.size(1) == Hkv && k.size(3) == m.head_dim,
              who,
              ": key_value must hold key and value (N, num_kv_heads, S, "
              "head_dim) = (",
              N, ", ", Hkv, ", S, ", m.head_dim, "), but got key ",
              k.defined() ? k.sizes() : torch::IntArrayRef{}, " and value ",
              v.defined() ? v.sizes() : torch::IntArrayRef{});
  TORCH_CHECK(k.scalar_type() == q_in.scalar_type() &&
                  v.scalar_type() == q_in.scalar_type() &&
                  k.device() == q_in.device() && v.device() == q_in.device(),
              who, ": key_value must have query's dtype ", q_in.scalar_type(),
              " and device ", q_in.device(), ", but has ", k.scalar_type(),
              " on ", k.device());
  const bool batched = query.dim() == 3;
  auto padding =
      padding_2d(key_padding_mask, N, k.size(2), batched, q_in.scalar_type(),
                 q_in.device(), who, "S");  // (N, S) or undefined
  const auto& w = m.in_proj_weight;
  auto q =
      project(q_in, m.packed_in_proj() ? rows_of(w, 0, E) : m.q_proj_weight,
              rows_of(m.in_proj_bias, 0, E));  // (N, L, E)
  auto heads =
      attend_heads(m, split_heads(q, m.options.num_heads()), k, v, padding,
                   /*causal=*/false, need_weights, average_attn_weights, who);
  return project_output(m, heads, batched);
}

KVCache linear_kind_kv_cache(const MultiHeadAttentionImpl& m,
                             int64_t batch_size, int64_t capacity) {
  const auto kind = m.options.attention_kind();
  TORCH_CHECK(keeps_sums(kind),
              "MultiHeadAttention::make_kv_cache: attention_kind ",
              kind_name(kind),
              " cannot decode token by token (its projection along the "
              "sequence mixes every key position; non-causal only)");
  return KVCache::recurrent(batch_size, m.num_kv_heads(), capacity,
                            kind_features(m), m.head_dim,
                            m.out_proj->weight.options());
}

}  // namespace detail

void MultiHeadAttentionImpl::redraw_features(uint64_t seed) {
  TORCH_CHECK(options.attention_kind() == AttentionKind::kPerformer,
              "MultiHeadAttention::redraw_features: attention_kind must be "
              "kPerformer, but is ",
              detail::kind_name(options.attention_kind()));
  options.feature_seed(seed);
  detail::reset_attention_kind_parameters(*this);
}

}  // namespace mha
