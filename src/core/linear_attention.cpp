// Linear-cost attention's function and core (mha/linear_attention.h,
// core/linear_attention_core.h): the sums of linear attention (Katharopoulos
// et al., 2020, arXiv:2006.16236) and their causal form by blocks. The
// feature maps are in core/feature_maps.cpp.
//
// Glossary: L query length, S key length, T aligned query and key length,
// D head_dim (query/key features), Dv value features, F features of φ (m for
// FAVOR+), C block length, B = ceil(T / C) blocks, "..." leading dims.
#include "mha/linear_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>  // madvise
#endif

#include "core/attention_core.h"  // kNegInf
#include "core/blas_threads.h"
#include "core/linear_attention_core.h"

namespace mha {
namespace detail {
namespace {

/// x with -inf entries replaced by 0: an offset fit to subtract (an offset
/// of -inf belongs to a feature no key has yet, whose sums are all 0).
torch::Tensor finite_offset(const torch::Tensor& offset) {
  return offset.masked_fill(offset == kNegInf, 0.0);
}

/// The factor that brings sums kept relative to `from` (raw, may be -inf)
/// to the finite offset `to`: exp(from - to), 0 where from is -inf.
torch::Tensor rescale_factor(const torch::Tensor& from,
                             const torch::Tensor& to) {
  return torch::exp(finite_offset(from) - to).masked_fill(from == kNegInf, 0.0);
}

/// Log query features b (..., L, F) (exponents plus the keys' offsets, -inf
/// where a feature has no key) as features: exp(b - max_f b), each row's
/// largest 1, a row of no key 0.
torch::Tensor shifted_exp(const torch::Tensor& b) {
  auto top = b.detach().amax(-1, /*keepdim=*/true);  // (..., L, 1)
  return torch::exp(b - finite_offset(top));
}

/// num / den with 0 where den is 0 (a row that sees no key): never NaN, in
/// forward or backward.
torch::Tensor safe_divide(const torch::Tensor& num, const torch::Tensor& den) {
  const auto zero = den == 0;  // (..., L, 1)
  return (num / den.masked_fill(zero, 1.0)).masked_fill(zero, 0.0);
}

/// x (..., T, X) padded with `fill` along T to `length` rows.
torch::Tensor pad_rows(const torch::Tensor& x, int64_t length,
                       double fill = 0.0) {
  const int64_t T = x.size(-2);
  if (T == length) {
    return x;
  }
  return torch::constant_pad_nd(x, {0, 0, 0, length - T}, fill);
}

/// x (..., T, X) as (..., B, C, X), T = B·C.
torch::Tensor blocks_of(const torch::Tensor& x, int64_t B, int64_t C) {
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  sizes.pop_back();
  sizes.insert(sizes.end(), {B, C, x.size(-1)});
  return x.reshape(sizes);  // (..., B, C, X)
}

/// x (..., B, C, X) as its first T of B·C rows, (..., T, X).
torch::Tensor rows_of_blocks(const torch::Tensor& x, int64_t T) {
  auto sizes = x.sizes().vec();
  const int64_t rows = sizes[sizes.size() - 3] * sizes[sizes.size() - 2];
  sizes.erase(sizes.end() - 3, sizes.end() - 1);
  sizes.insert(sizes.end() - 1, rows);
  return x.reshape(sizes).narrow(-2, 0, T);  // (..., T, X)
}

/// Log features by blocks, shifted so that every sum stays in range: the
/// offsets of block b, per feature, are the largest key exponents up to
/// the end of block b (a running maximum over blocks, and `sums`'
/// offsets); its keys are shifted by them, its queries by them and then
/// by each row's largest (shifted_exp).
struct ShiftedBlocks {
  torch::Tensor q, k;    // (..., B, C, F): the features
  torch::Tensor peak;    // (..., B, F): each block's offsets (-inf: no key)
  torch::Tensor factor;  // (..., B, F): brings the sums before block b (or
                         // `sums`) to block b's offsets
};

/// ShiftedBlocks of the exponents q and k (..., B, C, F), in place where
/// autograd allows (exp_ keeps its result, sub and add keep nothing): one
/// tensor of the features' size each.
ShiftedBlocks shift_blocks(const torch::Tensor& q, const torch::Tensor& k,
                           const LinearSums& sums) {
  ShiftedBlocks out;
  out.peak = std::get<0>(k.detach().amax(-2).cummax(-2));  // (..., B, F)
  if (!sums.empty()) {
    out.peak = torch::maximum(out.peak, sums.offset.unsqueeze(-2));
  }
  const auto shift = finite_offset(out.peak);
  out.k = (k - shift.unsqueeze(-2)).exp_();
  auto b = q + out.peak.unsqueeze(-2);  // (..., B, C, F)
  const auto top = b.detach().amax(-1, /*keepdim=*/true);
  out.q = b.sub_(finite_offset(top)).exp_();  // shifted_exp(b)
  // The running sums move from one block's offsets to the next one's:
  // S_b = S_(b-1) · exp(offset_(b-1) - offset_b) + block_b.
  const int64_t B = out.peak.size(-2);
  auto previous = sums.empty()
                      ? torch::full_like(out.peak.narrow(-2, 0, 1), kNegInf)
                      : sums.offset.unsqueeze(-2);  // (..., 1, F)
  auto from = torch::cat({previous, out.peak.narrow(-2, 0, B - 1)}, -2);
  out.factor = rescale_factor(from, shift);  // (..., B, F)
  return out;
}

}  // namespace

LinearSums add_keys(const LinearSums& sums, const Features& keys,
                    const torch::Tensor& values) {
  LinearSums out;
  torch::Tensor phi_k;   // (..., S, F)
  torch::Tensor factor;  // (..., F): brings `sums` to out's offsets
  if (keys.log) {
    const auto& a = keys.values;                      // (..., S, F)
    auto peak = a.size(-2) > 0 ? a.detach().amax(-2)  // (..., F)
                               : torch::full(a.select(-2, 0).sizes(), kNegInf,
                                             a.options());
    if (!sums.empty()) {
      peak = torch::maximum(peak, sums.offset);  // (..., F)
    }
    out.offset = peak;
    const auto shift = finite_offset(peak);
    phi_k = torch::exp(a - shift.unsqueeze(-2));
    if (!sums.empty()) {
      factor = rescale_factor(sums.offset, shift);
    }
  } else {
    phi_k = keys.values;
  }
  out.kv = torch::matmul(phi_k.transpose(-2, -1), values);  // (..., F, Dv)
  out.k = phi_k.sum(-2);                                    // (..., F)
  if (!sums.empty()) {
    if (factor.defined()) {
      out.kv = out.kv + sums.kv * factor.unsqueeze(-1);
      out.k = out.k + sums.k * factor;
    } else {
      out.kv = out.kv + sums.kv;
      out.k = out.k + sums.k;
    }
  }
  return out;
}

torch::Tensor read_sums(const Features& queries, const LinearSums& sums) {
  TORCH_INTERNAL_ASSERT(!sums.empty(), "read_sums: no sums");
  const auto phi_q =
      queries.log ? shifted_exp(queries.values + sums.offset.unsqueeze(-2))
                  : queries.values;                       // (..., L, F)
  auto num = torch::matmul(phi_q, sums.kv);               // (..., L, Dv)
  auto den = torch::matmul(phi_q, sums.k.unsqueeze(-1));  // (..., L, 1)
  return safe_divide(num, den);                           // (..., L, Dv)
}

int64_t causal_block_length(int64_t /*features*/, int64_t /*value_features*/) {
  return 64;
}

namespace {

/// causal_linear_attention on T rows at once (every block's temporaries
/// together).
torch::Tensor causal_blocks(const Features& queries, const Features& keys,
                            const torch::Tensor& values, const LinearSums& sums,
                            int64_t block, LinearSums* sums_out) {
  const int64_t T = queries.values.size(-2);
  TORCH_INTERNAL_ASSERT(keys.values.size(-2) == T && values.size(-2) == T &&
                            queries.log == keys.log,
                        "causal_linear_attention: unaligned inputs");
  const bool log = keys.log;
  if (T == 0) {
    auto sizes = queries.values.sizes().vec();
    sizes.back() = values.size(-1);
    if (sums_out != nullptr) {
      *sums_out = sums.empty() ? add_keys(sums, keys, values) : sums;
    }
    return torch::zeros(sizes, values.options());  // (..., 0, Dv)
  }
  const int64_t C = std::min(block, T);
  const int64_t B = (T + C - 1) / C;
  const int64_t Tp = B * C;
  // Padded rows: queries of feature 0 (their rows are dropped), keys of
  // feature 0 (log features: exponent -inf).
  const double fill = log ? kNegInf : 0.0;
  auto q = blocks_of(pad_rows(queries.values, Tp, fill), B,
                     C);                                      // (..., B, C, F)
  auto k = blocks_of(pad_rows(keys.values, Tp, fill), B, C);  // (..., B, C, F)
  auto v = blocks_of(pad_rows(values, Tp), B, C);             // (..., B, C, Dv)

  // Log features: shifted by their block's offsets (shift_blocks).
  torch::Tensor peak, factor;  // (..., B, F)
  if (log) {
    auto shifted = shift_blocks(q, k, sums);
    q = shifted.q;  // (..., B, C, F)
    k = shifted.k;  // (..., B, C, F)
    peak = shifted.peak;
    factor = shifted.factor;
  }

  // Each block's own sums (Katharopoulos et al., eq. 10-11, per block).
  auto block_kv = torch::matmul(k.transpose(-2, -1), v);  // (..., B, F, Dv)
  auto block_k = k.sum(-2);                               // (..., B, F)
  // The sums of every earlier block (and `sums`) as seen from block b.
  torch::Tensor before_kv, before_k;  // (..., B, F, Dv), (..., B, F)
  LinearSums last;
  if (!log) {
    auto all_kv = block_kv.cumsum(-3);  // (..., B, F, Dv)
    auto all_k = block_k.cumsum(-2);    // (..., B, F)
    before_kv = torch::constant_pad_nd(all_kv.narrow(-3, 0, B - 1),
                                       {0, 0, 0, 0, 1, 0}, 0.0);
    before_k =
        torch::constant_pad_nd(all_k.narrow(-2, 0, B - 1), {0, 0, 1, 0}, 0.0);
    last.kv = all_kv.select(-3, B - 1);  // (..., F, Dv)
    last.k = all_k.select(-2, B - 1);    // (..., F)
    if (!sums.empty()) {
      before_kv = before_kv + sums.kv.unsqueeze(-3);
      before_k = before_k + sums.k.unsqueeze(-2);
      last.kv = last.kv + sums.kv;
      last.k = last.k + sums.k;
    }
  } else {
    // The running sums, rescaled from one block's offsets to the next
    // one's by `factor`.
    torch::Tensor running_kv, running_k;
    if (sums.empty()) {
      running_kv = torch::zeros_like(block_kv.select(-3, 0));  // (..., F, Dv)
      running_k = torch::zeros_like(block_k.select(-2, 0));    // (..., F)
    } else {
      running_kv = sums.kv;
      running_k = sums.k;
    }
    std::vector<torch::Tensor> kv_parts, k_parts;
    kv_parts.reserve(B);
    k_parts.reserve(B);
    // unbind, not select(b) in the loop: select's backward writes a whole
    // (..., B, F, Dv) gradient per block (O(B²) time and memory),
    // unbind's stacks the blocks' gradients once.
    const auto factors = factor.unbind(-2);      // B x (..., F)
    const auto block_kvs = block_kv.unbind(-3);  // B x (..., F, Dv)
    const auto block_ks = block_k.unbind(-2);    // B x (..., F)
    for (int64_t b = 0; b < B; ++b) {
      const auto& f = factors[b];
      running_kv = running_kv * f.unsqueeze(-1);
      running_k = running_k * f;
      kv_parts.push_back(running_kv);
      k_parts.push_back(running_k);
      running_kv = running_kv + block_kvs[b];
      running_k = running_k + block_ks[b];
    }
    before_kv = torch::stack(kv_parts, -3);  // (..., B, F, Dv)
    before_k = torch::stack(k_parts, -2);    // (..., B, F)
    last.kv = running_kv;
    last.k = running_k;
    last.offset = peak.select(-2, B - 1);  // (..., F)
  }

  // Across blocks: the earlier keys through the sums; inside a block: the
  // masked (C, C) product (key j <= query i), eq. 4 on C rows.
  auto num = torch::matmul(q, before_kv);               // (..., B, C, Dv)
  auto den = torch::matmul(q, before_k.unsqueeze(-1));  // (..., B, C, 1)
  const auto later = torch::ones({C, C}, values.options().dtype(torch::kBool))
                         .triu(/*diagonal=*/1);  // (C, C)
  auto a = torch::matmul(q, k.transpose(-2, -1))
               .masked_fill(later, 0.0);    // (..., B, C, C)
  num = num + torch::matmul(a, v);          // (..., B, C, Dv)
  den = den + a.sum(-1, /*keepdim=*/true);  // (..., B, C, 1)
  auto out = safe_divide(num, den);         // (..., B, C, Dv)
  if (sums_out != nullptr) {
    *sums_out = last;
  }
  return rows_of_blocks(out, T);  // (..., T, Dv)
}

/// causal_linear_attention through causal_products: features and values
/// broadcast to one leading shape of N items (the module's keys are shared
/// by G query heads), log features shifted per block (shift_blocks), the
/// offsets' moves as decay factors.
torch::Tensor causal_walk(const Features& queries, const Features& keys,
                          const torch::Tensor& values, const LinearSums& sums,
                          int64_t block, LinearSums* sums_out) {
  const int64_t T = queries.values.size(-2);
  const int64_t F = queries.values.size(-1), Dv = values.size(-1);
  const int64_t C = std::min(block, T);
  const int64_t B = (T + C - 1) / C;
  auto q = queries.values;    // (..., T, F)
  auto k = keys.values;       // (..., T, F)
  torch::Tensor peak, decay;  // (..., B, F)
  if (keys.log) {
    const int64_t Tp = B * C;
    auto shifted = shift_blocks(
        blocks_of(pad_rows(q, Tp, kNegInf), B, C),  // (..., B, C, F)
        blocks_of(pad_rows(k, Tp, kNegInf), B, C), sums);
    q = rows_of_blocks(shifted.q, T);
    k = rows_of_blocks(shifted.k, T);
    peak = shifted.peak;
    decay = shifted.factor;
  }
  const auto lead_of = [](const torch::Tensor& x) {
    return x.sizes().slice(0, x.dim() - 2).vec();
  };
  const auto key_lead = at::infer_size(lead_of(k), lead_of(values));
  const auto lead = at::infer_size(lead_of(q), key_lead);
  int64_t N = 1;
  for (const auto n : lead) {
    N *= n;
  }
  // x (..., R, X) broadcast to lead and flattened to (N, R, X).
  const auto items = [&](const torch::Tensor& x) {
    auto sizes = lead;
    sizes.insert(sizes.end(), {x.size(-2), x.size(-1)});
    return x.expand(sizes).reshape({N, x.size(-2), x.size(-1)});
  };
  torch::Tensor state_in;  // (N, F, Dv + 1)
  if (!sums.empty()) {
    state_in = items(torch::cat({sums.kv, sums.k.unsqueeze(-1)}, -1));
  }
  auto value_sizes = lead;  // values stay as they are laid out (the
                            // walk copies them once, beside a column of ones)
  value_sizes.insert(value_sizes.end(), {T, Dv});
  torch::Tensor state;
  auto out_sizes = lead;
  out_sizes.insert(out_sizes.end(), {T, Dv});
  auto result = causal_linear_products(
                    items(q), items(k), values.expand(value_sizes),
                    decay.defined() ? items(decay) : torch::Tensor(), state_in,
                    C, sums_out != nullptr ? &state : nullptr)
                    .view(out_sizes);  // (..., T, Dv)
  if (sums_out != nullptr) {
    // The sums of one item per key head: every query head of a group
    // walked the same keys.
    auto sizes = lead;
    sizes.insert(sizes.end(), {F, Dv + 1});
    auto s = state.view(sizes);  // (..., F, Dv + 1)
    const int64_t skip = static_cast<int64_t>(lead.size() - key_lead.size());
    for (int64_t d = static_cast<int64_t>(lead.size()) - 1; d >= 0; --d) {
      const int64_t kd = d - skip;
      if (kd < 0 || (key_lead[kd] == 1 && lead[d] > 1)) {
        s = kd < 0 ? s.select(d, 0) : s.narrow(d, 0, 1);
      }
    }
    LinearSums last;
    last.kv = s.narrow(-1, 0, Dv);  // (..., F, Dv)
    last.k = s.select(-1, Dv);      // (..., F)
    if (keys.log) {
      last.offset = peak.select(-2, B - 1);  // (..., F)
    }
    *sums_out = last;
  }
  return result;
}

}  // namespace

torch::Tensor causal_linear_attention(const Features& queries,
                                      const Features& keys,
                                      const torch::Tensor& values,
                                      const LinearSums& sums, int64_t block,
                                      LinearSums* sums_out) {
  if (queries.values.size(-2) > 0 && causal_products_apply(values) &&
      causal_products_apply(queries.values) &&
      causal_products_apply(keys.values)) {
    return causal_walk(queries, keys, values, sums, block, sums_out);
  }
  return causal_linear_attention_aten(queries, keys, values, sums, block,
                                      sums_out);
}

torch::Tensor causal_linear_attention_aten(
    const Features& queries, const Features& keys, const torch::Tensor& values,
    const LinearSums& sums, int64_t block, LinearSums* sums_out) {
  // Groups of kGroupBlocks blocks, one after another, the sums carried
  // from each to the next: the temporaries of a group (its blocks' sums
  // (..., kGroupBlocks, F, Dv) and (C, C) products) stay in the caches and
  // the allocator's free lists, where those of all blocks at once are
  // fresh pages whose faults grew faster than L (at L = 32k, E = 256,
  // 4 heads, a third of the forward's cycles).
  constexpr int64_t kGroupBlocks = 16;
  const int64_t T = queries.values.size(-2);
  const int64_t group = kGroupBlocks * std::max<int64_t>(1, block);
  if (T <= group) {
    return causal_blocks(queries, keys, values, sums, block, sums_out);
  }
  // split, not narrow per group: narrow's backward writes a whole
  // (..., T, ...) gradient per group (O(T²)), split's joins them once.
  const auto q_groups = queries.values.split(group, -2);
  const auto k_groups = keys.values.split(group, -2);
  const auto v_groups = values.split(group, -2);
  std::vector<torch::Tensor> parts;
  LinearSums carry = sums;
  for (size_t g = 0; g < q_groups.size(); ++g) {
    LinearSums next;
    parts.push_back(causal_blocks({q_groups[g], queries.log},
                                  {k_groups[g], keys.log}, v_groups[g], carry,
                                  block, &next));
    carry = std::move(next);
  }
  if (sums_out != nullptr) {
    *sums_out = carry;
  }
  return torch::cat(parts, -2);  // (..., T, Dv)
}

namespace {
std::atomic<int64_t> segment_rows_for_tests{0};
}  // namespace

SegmentRowsForTests::SegmentRowsForTests(int64_t rows) {
  segment_rows_for_tests = rows;
}
SegmentRowsForTests::~SegmentRowsForTests() { segment_rows_for_tests = 0; }

int64_t segment_rows(int64_t row_bytes, int64_t block) {
  const int64_t forced = segment_rows_for_tests.load();
  if (forced > 0) {
    return forced;
  }
  const int64_t rows = kSegmentBytes / std::max<int64_t>(1, row_bytes);
  return std::max<int64_t>(1, rows / block) * block;
}

torch::Tensor empty_sequence_output(torch::IntArrayRef sizes,
                                    const torch::TensorOptions& options) {
  auto out = torch::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (out.device().is_cpu() &&
      static_cast<int64_t>(out.nbytes()) >= kHugeOutputBytes) {
    constexpr uintptr_t kHugePage = uintptr_t{1} << 21;
    const auto begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const auto first = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const auto last = (begin + out.nbytes()) & ~(kHugePage - 1);
    if (last > first) {
      // Advice only: where the kernel refuses it (no transparent huge
      // pages), the pages stay 4 KiB.
      (void)madvise(reinterpret_cast<void*>(first), last - first,
                    MADV_HUGEPAGE);
    }
  }
#endif
  return out;
}

bool by_segments(int64_t L, int64_t S, bool causal, int64_t rows) {
  return !torch::GradMode::is_enabled() && S > 0 && (!causal || S >= L) &&
         std::max(L, S) > rows;
}

torch::Tensor linear_attention_by_segments(
    const SegmentFeatures& queries, const SegmentFeatures& keys,
    const torch::Tensor& values, int64_t L, bool causal, const LinearSums& sums,
    int64_t rows, int64_t block, LinearSums* sums_out) {
  const int64_t S = values.size(-2);
  TORCH_INTERNAL_ASSERT(rows > 0 && L > 0 && S > 0 && (!causal || S >= L),
                        "linear_attention_by_segments: ", rows, " rows, L ", L,
                        ", S ", S, causal ? ", causal" : "");
  torch::Tensor out;  // (..., L, Dv), allocated by the first segment
  const auto write = [&](int64_t begin, const torch::Tensor& part) {
    if (!out.defined()) {
      auto sizes = part.sizes().vec();
      sizes[sizes.size() - 2] = L;
      out = empty_sequence_output(sizes, part.options());
    }
    out.narrow(-2, begin, part.size(-2)).copy_(part);
  };
  LinearSums carry = sums;
  if (causal) {
    for (int64_t begin = 0; begin < L; begin += rows) {
      const int64_t n = std::min(rows, L - begin);
      LinearSums next;
      write(begin, causal_linear_attention(queries(begin, n), keys(begin, n),
                                           values.narrow(-2, begin, n), carry,
                                           block, &next));
      carry = std::move(next);
    }
  } else {
    for (int64_t begin = 0; begin < S; begin += rows) {
      const int64_t n = std::min(rows, S - begin);
      carry = add_keys(carry, keys(begin, n), values.narrow(-2, begin, n));
    }
    for (int64_t begin = 0; begin < L; begin += rows) {
      write(begin, read_sums(queries(begin, std::min(rows, L - begin)), carry));
    }
  }
  if (sums_out != nullptr) {
    *sums_out = carry;
  }
  return out;
}

}  // namespace detail

const char* to_string(AttentionKind kind) {
  switch (kind) {
    case AttentionKind::kSoftmax:
      return "softmax";
    case AttentionKind::kLinear:
      return "linear";
    case AttentionKind::kPerformer:
      return "performer";
    case AttentionKind::kLinformer:
      return "linformer";
  }
  return "?";
}

torch::Tensor linear_attention(const torch::Tensor& query,
                               const torch::Tensor& key,
                               const torch::Tensor& value, bool is_causal,
                               const FeatureMap& feature_map) {
  const detail::BlasCallGuard blas_guard;  // blas_threads.h
  TORCH_CHECK(query.defined() && key.defined() && value.defined(),
              "linear_attention: query, key and value must be defined");
  TORCH_CHECK(query.dim() >= 2 && key.dim() >= 2 && value.dim() >= 2,
              "linear_attention: query (..., L, D), key (..., S, D) and value "
              "(..., S, Dv) need at least 2 dims, but got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(key.size(-1) == query.size(-1),
              "linear_attention: key must have query's D = ", query.size(-1),
              " features in its last dim, but got query ", query.sizes(),
              " and key ", key.sizes());
  TORCH_CHECK(
      value.size(-2) == key.size(-2),
      "linear_attention: value must have key's length S = ", key.size(-2),
      ", but got key ", key.sizes(), " and value ", value.sizes());
  TORCH_CHECK(torch::isFloatingType(query.scalar_type()) &&
                  key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "linear_attention: query, key and value must share one floating "
              "dtype, but got ",
              query.scalar_type(), ", ", key.scalar_type(), ", ",
              value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      "linear_attention: query, key and value must be on one device, "
      "but got ",
      query.device(), ", ", key.device(), ", ", value.device());
  const auto lead = [](const torch::Tensor& t) {
    return t.sizes().slice(0, t.dim() - 2);
  };
  const auto broadcastable = [](torch::IntArrayRef a, torch::IntArrayRef b) {
    for (size_t i = 1; i <= std::min(a.size(), b.size()); ++i) {
      const auto x = a[a.size() - i], y = b[b.size() - i];
      if (x != y && x != 1 && y != 1) {
        return false;
      }
    }
    return true;
  };
  TORCH_CHECK(broadcastable(lead(query), lead(key)) &&
                  broadcastable(lead(key), lead(value)) &&
                  broadcastable(lead(query), lead(value)),
              "linear_attention: the leading dims of query, key and value "
              "must broadcast, but got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());

  const FeatureMap& phi =
      feature_map ? feature_map : FeatureMap(elu_feature_map);
  const int64_t L = query.size(-2);
  const int64_t S = key.size(-2);
  int64_t features = -1;  // F: the same for every row mapped
  // φ of rows [begin, begin + length) of x (..., T, D), checked.
  const auto map_rows = [&](const torch::Tensor& x, int64_t begin,
                            int64_t length, const char* name) {
    const auto rows = x.narrow(-2, begin, length);
    auto f = phi(rows);  // (..., length, F)
    TORCH_CHECK(f.defined() && f.dim() == rows.dim() &&
                    f.sizes().slice(0, rows.dim() - 1) ==
                        rows.sizes().slice(0, rows.dim() - 1) &&
                    f.scalar_type() == rows.scalar_type() &&
                    f.device() == rows.device(),
                "linear_attention: feature_map must map ", name,
                " (..., T, D) to (..., T, F) of its dtype and device, but "
                "mapped ",
                rows.sizes(), " ", rows.scalar_type(), " to ",
                f.defined() ? f.sizes() : torch::IntArrayRef{}, " ",
                f.defined() ? f.scalar_type() : rows.scalar_type());
    TORCH_CHECK(features < 0 || f.size(-1) == features,
                "linear_attention: feature_map must give query and key the "
                "same number of features, but gave ",
                features, " and ", f.size(-1));
    features = f.size(-1);
    return detail::Features{f, /*log=*/false};
  };
  const int64_t block =
      detail::causal_block_length(query.size(-1), value.size(-1));
  // Inference: the features a segment at a time, as the module's kinds.
  int64_t items = 1;  // rows of features per position: query's leading dims
  for (const auto n : query.sizes().slice(0, query.dim() - 2)) {
    items *= n;
  }
  const int64_t rows = detail::segment_rows(
      items * query.size(-1) * static_cast<int64_t>(query.element_size()),
      block);  // elu(x) + 1: F = D; a custom φ's F may differ
  if (detail::by_segments(L, S, is_causal, rows)) {
    return detail::linear_attention_by_segments(
        [&](int64_t b, int64_t n) { return map_rows(query, b, n, "query"); },
        [&](int64_t b, int64_t n) { return map_rows(key, b, n, "key"); }, value,
        L, is_causal, {}, rows, block);
  }
  const auto queries = map_rows(query, 0, L, "query");  // (..., L, F)
  const auto keys = map_rows(key, 0, S, "key");         // (..., S, F)
  if (!is_causal) {
    return detail::read_sums(queries, detail::add_keys({}, keys, value));
  }
  // Top-left alignment: query i sees keys j <= i, so keys from L on are
  // never seen and queries from S on see every key (zero-feature padding).
  const auto& phi_k = keys.values;
  auto k = S >= L ? phi_k.narrow(-2, 0, L) : detail::pad_rows(phi_k, L);
  auto v = S >= L ? value.narrow(-2, 0, L) : detail::pad_rows(value, L);
  return detail::causal_linear_attention(queries, {k, false}, v, {}, block);
}

}  // namespace mha
