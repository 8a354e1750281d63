// FlexAttention (mha/flex_attention.h): block masks, the mask helpers, and
// flex_attention's checks before the attention core, which computes it
// (attention_core.h: FlexMods; the blocked path's tile loop or the explicit
// path).
//
// Glossary: B batch, Hq query heads, Hkv key/value heads, L query length,
// S key length, E query/key features, Ev value features; nq, nkv the query
// and key blocks.
#include "mha/flex_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/attention_core.h"

namespace mha {
namespace {

/// Blocks of `block` covering `length`.
int64_t blocks_of(int64_t length, int64_t block) {
  return (length + block - 1) / block;
}

/// bool (B, H, nq, nkv) of the first counts[b][h][i] entries of
/// indices[b][h][i] (Python's layout: the visited blocks first).
torch::Tensor dense_of(const torch::Tensor& counts,
                       const torch::Tensor& indices) {
  const auto nkv = indices.size(-1);
  auto order = torch::arange(nkv, indices.options().dtype(torch::kLong));
  auto valid = order.lt(counts.unsqueeze(-1).to(torch::kLong));  // (.., nkv)
  // Entries past the count point at an extra column, cut off below.
  auto where = indices.to(torch::kLong).masked_fill(valid.logical_not(), nkv);
  auto dense =
      torch::zeros({counts.size(0), counts.size(1), counts.size(2), nkv + 1},
                   indices.options().dtype(torch::kBool));
  dense.scatter_(-1, where, true);
  return dense.narrow(-1, 0, nkv);
}

/// A BlockMask from the state of every block, int8 (B, H, nq, nkv): 0 not
/// visited, 1 partial, 2 full; in Python's layout (counts, then the
/// indices of the blocks of that kind first, ascending, then the others,
/// as a stable descending argsort gives).
BlockMask from_block_states(const torch::Tensor& states, MaskMod mask_mod,
                            int64_t q_len, int64_t kv_len, int64_t block_q,
                            int64_t block_kv) {
  auto layout = [&](const torch::Tensor& chosen,
                    torch::Tensor& counts,     // (B, H, nq)
                    torch::Tensor& indices) {  // (B, H, nq, nkv)
    const auto as_int = chosen.to(torch::kInt);
    counts = as_int.sum(-1).to(torch::kInt);
    indices = std::get<1>(torch::sort(as_int, /*stable=*/true, /*dim=*/-1,
                                      /*descending=*/true))
                  .to(torch::kInt);
  };
  BlockMask mask;
  mask.q_len = q_len;
  mask.kv_len = kv_len;
  mask.block_q = block_q;
  mask.block_kv = block_kv;
  layout(states.eq(1), mask.kv_num_blocks, mask.kv_indices);
  layout(states.eq(2), mask.full_kv_num_blocks, mask.full_kv_indices);
  mask.mask_mod = std::move(mask_mod);
  return mask;
}

void check_block_sizes(int64_t q_len, int64_t kv_len, int64_t block_q,
                       int64_t block_kv) {
  TORCH_CHECK(q_len > 0 && kv_len > 0,
              "create_block_mask: q_len and kv_len must be positive, but got "
              "q_len = ",
              q_len, ", kv_len = ", kv_len);
  TORCH_CHECK(block_q > 0 && block_kv > 0,
              "create_block_mask: block_q and block_kv must be positive, but "
              "got block_q = ",
              block_q, ", block_kv = ", block_kv);
}

/// The block states (B, H, nq, nkv) of a fused mask_mod, from its flags one
/// query row at a time (no tensor per block): 2 where every element of a
/// whole block may attend, 1 where some may, 0 where none.
void fused_block_states(const detail::FusedMaskKernel& kernel,
                        torch::Tensor& states, int64_t q_len, int64_t kv_len,
                        int64_t block_q, int64_t block_kv) {
  const auto batches = states.size(0), heads = states.size(1);
  const auto nq = states.size(2), nkv = states.size(3);
  auto* state = states.data_ptr<int8_t>();
  at::parallel_for(0, batches * heads * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> allowed(static_cast<size_t>(kv_len));
    std::vector<uint8_t> any(static_cast<size_t>(nkv)),
        all(static_cast<size_t>(nkv));
    for (int64_t m = begin; m < end; ++m) {
      const auto i = m % nq, h = m / nq % heads, b = m / nq / heads;
      const auto row0 = i * block_q;
      const auto rows = std::min(block_q, q_len - row0);
      std::fill(any.begin(), any.end(), 0);
      // A block past q_len or kv_len is never full (padded with false).
      for (int64_t j = 0; j < nkv; ++j) {
        all[j] = rows == block_q && (j + 1) * block_kv <= kv_len;
      }
      for (int64_t r = 0; r < rows; ++r) {
        kernel.allowed(allowed.data(), kv_len, b, h, row0 + r, 0);
        for (int64_t j = 0; j < nkv; ++j) {
          const auto k0 = j * block_kv, k1 = std::min(kv_len, k0 + block_kv);
          for (auto k = k0; k < k1; ++k) {
            any[j] |= allowed[k];
            all[j] &= allowed[k];
          }
        }
      }
      for (int64_t j = 0; j < nkv; ++j) {
        state[m * nkv + j] = static_cast<int8_t>(any[j] + (any[j] & all[j]));
      }
    }
  });
}

}  // namespace

double BlockMask::sparsity() const {
  TORCH_CHECK(!empty(), "BlockMask::sparsity: the mask is empty (no mask)");
  const auto dense = to_dense();
  const auto visited = dense.sum().item<double>();
  return 100.0 * (1.0 - visited / static_cast<double>(dense.numel()));
}

torch::Tensor BlockMask::to_dense() const {
  TORCH_CHECK(!empty(), "BlockMask::to_dense: the mask is empty (no mask)");
  auto dense = dense_of(kv_num_blocks, kv_indices);
  if (full_kv_num_blocks.defined()) {
    dense.logical_or_(dense_of(full_kv_num_blocks, full_kv_indices));
  }
  return dense;
}

BlockMask create_block_mask(MaskMod mask_mod, c10::optional<int64_t> B,
                            c10::optional<int64_t> H, int64_t q_len,
                            int64_t kv_len, int64_t block_q,
                            c10::optional<int64_t> block_kv_in) {
  const auto block_kv = block_kv_in.value_or(block_q);
  check_block_sizes(q_len, kv_len, block_q, block_kv);
  TORCH_CHECK(bool(mask_mod), "create_block_mask: mask_mod is empty");
  const auto batches = B.value_or(1), heads = H.value_or(1);
  TORCH_CHECK(batches > 0 && heads > 0,
              "create_block_mask: B and H must be positive, but got B = ",
              batches, ", H = ", heads);
  const auto nq = blocks_of(q_len, block_q), nkv = blocks_of(kv_len, block_kv);
  const auto index = torch::TensorOptions().dtype(torch::kLong);
  auto states = torch::zeros({batches, heads, nq, nkv},
                             torch::TensorOptions().dtype(torch::kChar));
  const auto kv_idx = torch::arange(kv_len, index).unsqueeze(0);  // (1, S)
  // One query block against every key at a time: (block_q, nkv·block_kv)
  // bools, padded with false past q_len and kv_len.
  auto padded = torch::zeros({block_q, nkv * block_kv},
                             torch::TensorOptions().dtype(torch::kBool));
  if (const auto* kernel = mask_mod.fused(); kernel != nullptr) {
    fused_block_states(*kernel, states, q_len, kv_len, block_q, block_kv);
    return from_block_states(states, std::move(mask_mod), q_len, kv_len,
                             block_q, block_kv);
  }
  for (int64_t b = 0; b < batches; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t i = 0; i < nq; ++i) {
        const auto row0 = i * block_q;
        const auto rows = std::min(block_q, q_len - row0);
        const auto q_idx =
            torch::arange(row0, row0 + rows, index).unsqueeze(1);  // (rows, 1)
        const auto allowed = detail::call_mask_mod(
            mask_mod, torch::scalar_tensor(b, index),
            torch::scalar_tensor(h, index), q_idx, kv_idx, {rows, kv_len});
        padded.zero_();
        padded.narrow(0, 0, rows).narrow(1, 0, kv_len).copy_(allowed);
        const auto tiles =
            padded.view({block_q, nkv, block_kv});  // (block_q, nkv, block_kv)
        const auto any = tiles.any(2).any(0);       // (nkv)
        const auto all = tiles.all(2).all(0);       // (nkv)
        states[b][h][i].copy_(any.to(torch::kChar) + all.to(torch::kChar));
      }
    }
  }
  return from_block_states(states, std::move(mask_mod), q_len, kv_len, block_q,
                           block_kv);
}

namespace {

/// The elementwise `combine` (logical_and or logical_or) of every mod's
/// result, starting from `identity` (true or false, broadcast as Python's
/// b.new_ones(()) / new_zeros(())).
MaskMod fold_masks(std::vector<MaskMod> mods, bool identity,
                   torch::Tensor (torch::Tensor::*combine)(const torch::Tensor&)
                       const,
                   const char* who) {
  for (const auto& mod : mods) {
    TORCH_CHECK(bool(mod), who, ": an empty function among the masks");
  }
  return [mods = std::move(mods), identity, combine](
             const torch::Tensor& b, const torch::Tensor& h,
             const torch::Tensor& q_idx, const torch::Tensor& kv_idx) {
    auto result = torch::full({}, identity, b.options().dtype(torch::kBool));
    for (const auto& mod : mods) {
      result = (result.*combine)(mod(b, h, q_idx, kv_idx));
    }
    return result;
  };
}

/// The fused form of and_masks / or_masks of fused masks: each part's
/// flags combined, 256 keys at a time.
class CombinedMaskKernel final : public detail::FusedMaskKernel {
 public:
  CombinedMaskKernel(std::vector<std::shared_ptr<const FusedMaskKernel>> parts,
                     bool all)
      : parts_(std::move(parts)), all_(all) {}
  void allowed(uint8_t* allowed, int64_t n, int64_t b, int64_t h, int64_t q,
               int64_t kv0) const override {
    if (parts_.empty()) {
      std::fill(allowed, allowed + n, static_cast<uint8_t>(all_ ? 1 : 0));
      return;
    }
    parts_[0]->allowed(allowed, n, b, h, q, kv0);
    constexpr int64_t kChunk = 256;
    uint8_t other[kChunk];
    for (size_t i = 1; i < parts_.size(); ++i) {
      for (int64_t j = 0; j < n; j += kChunk) {
        const auto m = std::min(kChunk, n - j);
        parts_[i]->allowed(other, m, b, h, q, kv0 + j);
        for (int64_t c = 0; c < m; ++c) {
          allowed[j + c] =
              all_ ? (allowed[j + c] & other[c]) : (allowed[j + c] | other[c]);
        }
      }
    }
  }

 private:
  std::vector<std::shared_ptr<const FusedMaskKernel>> parts_;
  bool all_;
};

/// fold_masks, kept fused where every mod is fused.
MaskMod combine_masks(std::vector<MaskMod> mods, bool all) {
  std::vector<std::shared_ptr<const detail::FusedMaskKernel>> kernels;
  for (const auto& mod : mods) {
    if (mod.fused_kernel() != nullptr) {
      kernels.push_back(mod.fused_kernel());
    }
  }
  const bool fused = kernels.size() == mods.size();
  auto folded =
      fold_masks(std::move(mods), all,
                 all ? &torch::Tensor::logical_and : &torch::Tensor::logical_or,
                 all ? "and_masks" : "or_masks");
  if (!fused) {
    return folded;
  }
  MaskMod::Function tensor_form =
      [folded](const torch::Tensor& b, const torch::Tensor& h,
               const torch::Tensor& q,
               const torch::Tensor& kv) { return folded(b, h, q, kv); };
  return MaskMod(
      std::move(tensor_form),
      std::make_shared<const CombinedMaskKernel>(std::move(kernels), all));
}

}  // namespace

MaskMod and_masks(std::vector<MaskMod> mods) {
  return combine_masks(std::move(mods), /*all=*/true);
}

MaskMod or_masks(std::vector<MaskMod> mods) {
  return combine_masks(std::move(mods), /*all=*/false);
}

namespace detail {

int fused_cpu_level() {
#if MHA_FUSED_X86
  static const int level = [] {
    const char* capability = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string cap = capability == nullptr ? "" : capability;
    const bool avx512 =
        __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2") &&
        __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi2");
    const bool avx2 = __builtin_cpu_supports("avx2") &&
                      __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("bmi2");
    if (cap == "default") {
      return 0;
    }
    if (avx512 && cap != "avx2") {
      return 2;
    }
    return avx2 ? 1 : 0;
  }();
  return level;
#else
  return 0;
#endif
}

void rethrow_fused_error(const char* what) {
  try {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "flex_attention: the fused ", what,
                " threw: ", e.what_without_backtrace());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "flex_attention: the fused ", what,
                " threw: ", e.what());
  } catch (...) {
    TORCH_CHECK(false, "flex_attention: the fused ", what,
                " threw an exception that is not a std::exception");
  }
}

void table_index_error(const char* what, int64_t q, int64_t kv0, int64_t n) {
  TORCH_CHECK(false, "flex_attention: the fused ", what,
              " read a mha::fused::Table at an index out of range (lookup) "
              "on query row ",
              q, ", keys ", kv0, " to ", kv0 + n - 1);
}

}  // namespace detail

namespace fused::detail {

bool clamp_passes_at_bounds() { return probe_clamp_passes_at_bounds(); }

bool probe_clamp_passes_at_bounds() {
  static const bool passes = [] {
    c10::InferenceMode not_inference(false);
    torch::AutoGradMode grad_mode(true);
    auto x = torch::ones({1}, torch::kDouble).requires_grad_();
    const auto gradient =
        torch::autograd::grad({torch::clamp(x, 0.0, 1.0).sum()}, {x})[0];
    return gradient.item<double>() == 1.0;
  }();
  return passes;
}

}  // namespace fused::detail

MaskMod noop_mask() {
  return [](const torch::Tensor& b, const torch::Tensor&, const torch::Tensor&,
            const torch::Tensor&) {
    return torch::ones({}, b.options().dtype(torch::kBool));
  };
}

torch::Tensor document_ids(const torch::Tensor& lengths) {
  TORCH_CHECK(lengths.defined() && lengths.dim() == 1 &&
                  !lengths.is_floating_point() &&
                  lengths.scalar_type() != torch::kBool && lengths.numel() > 0,
              "document_ids: lengths must be a non-empty 1-D integer tensor, "
              "but got ",
              lengths.defined() ? lengths.sizes() : torch::IntArrayRef{},
              lengths.defined() ? " of dtype " : " (undefined)",
              lengths.defined() ? c10::toString(lengths.scalar_type()) : "");
  const auto counts = lengths.to(torch::kLong);
  TORCH_CHECK(counts.gt(0).all().item<bool>(),
              "document_ids: every length must be positive, but got ",
              counts.min().item<int64_t>());
  return torch::repeat_interleave(
      torch::arange(counts.size(0), counts.options()), counts);  // (T)
}

MaskMod document_mask(const torch::Tensor& lengths, bool causal) {
  const fused::Table doc(document_ids(lengths));
  // A fused mask (its tensor form moves doc to the indices' device).
  if (causal) {
    return fused_mask_mod([doc](auto, auto, auto q, auto kv) {
      return (fused::lookup(doc, q) == fused::lookup(doc, kv)) & (q >= kv);
    });
  }
  return fused_mask_mod([doc](auto, auto, auto q, auto kv) {
    return fused::lookup(doc, q) == fused::lookup(doc, kv);
  });
}

BlockMask create_document_block_mask(const torch::Tensor& lengths, bool causal,
                                     int64_t block) {
  document_ids(lengths);  // checks the lengths
  const auto counts = lengths.to(torch::kCPU, torch::kLong).contiguous();
  const auto docs = counts.size(0);
  std::vector<int64_t> starts(docs + 1, 0);
  for (int64_t d = 0; d < docs; ++d) {
    starts[d + 1] = starts[d] + counts.data_ptr<int64_t>()[d];
  }
  const auto T = starts[docs];
  check_block_sizes(T, T, block, block);
  const auto n = blocks_of(T, block);
  // The document of token t: the last start at or before it.
  auto doc = [&](int64_t t) {
    return static_cast<int64_t>(
        std::upper_bound(starts.begin(), starts.end(), t) - starts.begin() - 1);
  };
  auto states =
      torch::zeros({1, 1, n, n}, torch::TensorOptions().dtype(torch::kChar));
  auto* state = states.data_ptr<int8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const auto q0 = i * block, q1 = std::min(q0 + block, T);  // [q0, q1)
    const auto d0 = doc(q0), d1 = doc(q1 - 1);
    // Only the keys of those documents (and, causal, up to q1 - 1).
    const auto key_end = causal ? std::min(starts[d1 + 1], q1) : starts[d1 + 1];
    for (auto j = starts[d0] / block; j * block < key_end; ++j) {
      const auto k0 = j * block, k1 = std::min(k0 + block, T);  // [k0, k1)
      bool any = false;
      for (auto d = std::max(d0, doc(k0)); d <= std::min(d1, doc(k1 - 1));
           ++d) {
        // Some query of d in [q0, q1) sees some key of d in [k0, k1).
        const auto last_query = std::min(q1, starts[d + 1]) - 1;
        const auto first_key = std::max(k0, starts[d]);
        any = any || !causal || last_query >= first_key;
      }
      if (!any) {
        continue;
      }
      const bool whole = q1 - q0 == block && k1 - k0 == block;
      const bool one_document = d0 == d1 && doc(k0) == d0 && doc(k1 - 1) == d0;
      const bool full = whole && one_document && (!causal || k1 - 1 <= q0);
      state[i * n + j] = full ? 2 : 1;
    }
  }
  return from_block_states(states, document_mask(lengths, causal), T, T, block,
                           block);
}

std::tuple<torch::Tensor, torch::Tensor> flex_attention(
    const torch::Tensor& query, const torch::Tensor& key,
    const torch::Tensor& value, const ScoreMod& score_mod,
    const BlockMask& block_mask, c10::optional<double> scale, bool enable_gqa,
    bool return_lse) {
  TORCH_CHECK(query.defined() && key.defined() && value.defined(),
              "flex_attention: query, key and value must be defined");
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "flex_attention: query (B, Hq, L, E), key (B, Hkv, S, E) and "
              "value (B, Hkv, S, Ev) must be 4-D, but got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(query.is_floating_point(),
              "flex_attention: query must be floating, but got dtype ",
              query.scalar_type());
  TORCH_CHECK(key.scalar_type() == query.scalar_type() &&
                  value.scalar_type() == query.scalar_type(),
              "flex_attention: key and value must have query's dtype ",
              query.scalar_type(), ", but got key ", key.scalar_type(),
              ", value ", value.scalar_type());
  TORCH_CHECK(
      key.device() == query.device() && value.device() == query.device(),
      "flex_attention: key and value must be on query's device ",
      query.device(), ", but got key on ", key.device(), ", value on ",
      value.device());
  const auto B = query.size(0), Hq = query.size(1), L = query.size(2),
             E = query.size(3);
  const auto Hkv = key.size(1), S = key.size(2);
  TORCH_CHECK(key.size(0) == B && value.size(0) == B,
              "flex_attention: key and value must have query's batch size ", B,
              ", but got key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(key.size(3) == E,
              "flex_attention: key's feature size must equal query's E = ", E,
              ", but got key ", key.sizes());
  TORCH_CHECK(value.size(1) == Hkv && value.size(2) == S,
              "flex_attention: value (B, Hkv, S, Ev) must match key's Hkv = ",
              Hkv, " and S = ", S, ", but got value ", value.sizes());
  TORCH_CHECK(L > 0 && S > 0 && E > 0,
              "flex_attention: L, S and E must be positive, but got query ",
              query.sizes(), ", key ", key.sizes());
  if (enable_gqa) {
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0,
                "flex_attention: with enable_gqa, query's heads Hq = ", Hq,
                " must be a multiple of key/value's Hkv = ", Hkv);
  } else {
    TORCH_CHECK(Hq == Hkv, "flex_attention: query has Hq = ", Hq,
                " heads and key/value Hkv = ", Hkv,
                "; they must be equal, or pass enable_gqa = true for grouped "
                "heads (Hq a multiple of Hkv)");
  }
  if (!block_mask.empty()) {
    TORCH_CHECK(block_mask.q_len == L && block_mask.kv_len == S,
                "flex_attention: the block_mask was made for q_len = ",
                block_mask.q_len, ", kv_len = ", block_mask.kv_len,
                ", but the call has L = ", L, ", S = ", S);
    const auto& counts = block_mask.kv_num_blocks;
    TORCH_CHECK(
        counts.dim() == 3 && (counts.size(0) == 1 || counts.size(0) == B) &&
            (counts.size(1) == 1 || counts.size(1) == Hq) &&
            counts.size(2) == blocks_of(L, block_mask.block_q) &&
            block_mask.kv_indices.dim() == 4 &&
            block_mask.kv_indices.size(3) == blocks_of(S, block_mask.block_kv),
        "flex_attention: the block_mask's kv_num_blocks ", counts.sizes(),
        " and kv_indices ", block_mask.kv_indices.sizes(),
        " do not fit the call: expected (1 or B = ", B, ", 1 or Hq = ", Hq,
        ", ", blocks_of(L, block_mask.block_q), ") and (..., ",
        blocks_of(S, block_mask.block_kv), ")");
  }
  detail::FlexMods mods;
  mods.score_mod = score_mod;
  mods.block_mask = block_mask;
  mods.return_lse = return_lse;
  const double factor =
      scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(E));
  auto result = detail::attention_core(
      query, key, value, /*mask=*/{}, detail::KeyPositions(),
      /*dropout_p=*/0.0, factor, detail::WeightsMode::kNone, /*packed=*/{},
      &mods);
  return {result.output, result.lse};
}

}  // namespace mha
