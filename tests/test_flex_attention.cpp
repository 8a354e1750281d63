// FlexAttention (mha/flex_attention.h): flex_attention against a dense
// float64 reference written here (forward, lse and the gradients of query,
// key, value and captured tensors), block masks against their definition,
// the built-in variants written as mods, the modules' score_mod and
// block_mask, and the errors.
//
// Glossary: B batch, H heads, L query length, S key length, E features.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <cmath>
#include <fstream>
#include <string>
#include <vector>

#include "core/blocked_attention.h"  // PartialMasksOff
#include "fixture_helpers.h"
#include "mha/mha.h"
#include "test_helpers.h"

namespace {

using mha::BlockMask;
using mha::MaskMod;
using mha::ScoreMod;

/// Index tensors of a dense (B, H, L, S) call: b (B,1,1,1) ... kv (1,1,1,S).
struct DenseIndex {
  torch::Tensor b, h, q, kv;
  DenseIndex(int64_t B, int64_t H, int64_t L, int64_t S) {
    auto idx = [](int64_t n, int64_t dim) {
      std::vector<int64_t> shape(4, 1);
      shape[dim] = n;
      return torch::arange(n, torch::kLong).view(shape);
    };
    b = idx(B, 0);
    h = idx(H, 1);
    q = idx(L, 2);
    kv = idx(S, 3);
  }
};

/// The float64 reference, straight from the definition: s = q·kᵀ·scale,
/// s = score_mod(s), s = -inf where mask_mod says no, a row of only -inf
/// gives 0 (and lse -inf), else softmax(s)·v. key/value heads repeated for
/// grouped query heads. Differentiable (gradients of captured tensors too).
struct Reference {
  torch::Tensor output, lse;
};
Reference reference(const torch::Tensor& q, const torch::Tensor& k,
                    const torch::Tensor& v, const ScoreMod& score_mod,
                    const MaskMod& mask_mod, double scale) {
  const auto B = q.size(0), H = q.size(1), L = q.size(2), S = k.size(2);
  auto k64 = k.to(torch::kFloat64), v64 = v.to(torch::kFloat64);
  if (k.size(1) != H) {
    k64 = k64.repeat_interleave(H / k.size(1), 1);
    v64 = v64.repeat_interleave(H / k.size(1), 1);
  }
  auto s = torch::matmul(q.to(torch::kFloat64), k64.transpose(-2, -1)) * scale;
  DenseIndex i(B, H, L, S);
  if (score_mod) {
    s = score_mod(s, i.b, i.h, i.q, i.kv).to(torch::kFloat64).expand_as(s);
  }
  if (mask_mod) {
    s = s.masked_fill(mask_mod(i.b, i.h, i.q, i.kv).logical_not(), -kInf);
  }
  auto empty = s.eq(-kInf).all(-1, /*keepdim=*/true);
  auto lse = s.logsumexp(-1).masked_fill(empty.squeeze(-1), -kInf);
  auto p =
      torch::softmax(s.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0);
  return {torch::matmul(p, v64), lse};
}

MaskMod causal_mod() {
  return [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
            const torch::Tensor& kv) { return q.ge(kv); };
}

MaskMod window_mod(int64_t window) {
  return [window](const torch::Tensor&, const torch::Tensor&,
                  const torch::Tensor& q, const torch::Tensor& kv) {
    return q.ge(kv).logical_and(q.sub(kv).lt(window));
  };
}

ScoreMod softcap_mod(double cap) {
  return [cap](const torch::Tensor& s, const torch::Tensor&,
               const torch::Tensor&, const torch::Tensor&,
               const torch::Tensor&) { return cap * torch::tanh(s / cap); };
}

/// score + slopes[h] · (kv - q): ALiBi with captured slopes.
ScoreMod alibi_mod(const torch::Tensor& slopes) {
  return [slopes](const torch::Tensor& s, const torch::Tensor&,
                  const torch::Tensor& h, const torch::Tensor& q,
                  const torch::Tensor& kv) {
    return s + slopes.index({h}) * (kv - q).to(s.scalar_type());
  };
}

/// score + table[h, kv - q + L - 1]: a learned relative bias.
ScoreMod table_mod(const torch::Tensor& table, int64_t L) {
  return [table, L](const torch::Tensor& s, const torch::Tensor&,
                    const torch::Tensor& h, const torch::Tensor& q,
                    const torch::Tensor& kv) {
    return s + table.index({h, kv - q + (L - 1)});
  };
}

struct Inputs {
  torch::Tensor q, k, v;
};
Inputs make_inputs(int64_t B, int64_t H, int64_t Hkv, int64_t L, int64_t S,
                   int64_t E, torch::ScalarType dtype, bool grad) {
  auto opts = torch::TensorOptions().dtype(dtype);
  Inputs in{torch::randn({B, H, L, E}, opts),
            torch::randn({B, Hkv, S, E}, opts),
            torch::randn({B, Hkv, S, E}, opts)};
  if (grad) {
    in.q.requires_grad_();
    in.k.requires_grad_();
    in.v.requires_grad_();
  }
  return in;
}

/// flex_attention against the reference: output and lse, then the
/// gradients of sum(output · R) with respect to q, k, v and `captured`
/// (tensors the mods capture, requiring grad), within the issue's
/// tolerances (float32 1e-5 + 1e-4·|ref|, float64 1e-10).
void check_against_reference(const Inputs& in, const ScoreMod& score_mod,
                             const MaskMod& mask_mod,
                             const BlockMask& block_mask,
                             c10::optional<double> scale, bool gqa,
                             std::vector<torch::Tensor> captured,
                             const std::string& what,
                             const ScoreMod& reference_score_mod = {}) {
  const double factor =
      scale.value_or(1.0 / std::sqrt(static_cast<double>(in.q.size(3))));
  auto [out, lse] = mha::flex_attention(in.q, in.k, in.v, score_mod, block_mask,
                                        scale, gqa, /*return_lse=*/true);
  auto ref = reference(in.q, in.k, in.v,
                       reference_score_mod ? reference_score_mod : score_mod,
                       mask_mod, factor);
  const bool f32 = in.q.scalar_type() == torch::kFloat32;
  auto close = [&](const torch::Tensor& a, const torch::Tensor& e,
                   const std::string& name) {
    ASSERT_TRUE(a.defined()) << what << " " << name;
    ASSERT_EQ(a.sizes(), e.sizes()) << what << " " << name;
    auto a64 = a.detach().to(torch::kFloat64), e64 = e.detach();
    // -inf (fully masked lse) must match exactly.
    auto both_inf = a64.isinf().logical_and(e64.isinf());
    EXPECT_TRUE(a64.isinf().eq(e64.isinf()).all().item<bool>())
        << what << " " << name << ": infinities differ";
    a64 = a64.masked_fill(both_inf, 0.0);
    e64 = e64.masked_fill(both_inf, 0.0);
    const double atol = f32 ? 1e-5 : 1e-10, rtol = f32 ? 1e-4 : 1e-10;
    auto excess = (a64 - e64).abs() - (atol + rtol * e64.abs());
    EXPECT_LE(excess.max().item<double>(), 0.0)
        << what << " " << name << ": max abs diff "
        << (a64 - e64).abs().max().item<double>();
  };
  EXPECT_EQ(out.scalar_type(), in.q.scalar_type());
  EXPECT_EQ(lse.scalar_type(), in.q.scalar_type());
  close(out, ref.output, "output");
  close(lse, ref.lse, "lse");
  if (!in.q.requires_grad()) {
    return;
  }
  auto R = torch::randn(out.sizes(), torch::kFloat64);
  std::vector<torch::Tensor> inputs{in.q, in.k, in.v};
  inputs.insert(inputs.end(), captured.begin(), captured.end());
  auto got = torch::autograd::grad({(out.to(torch::kFloat64) * R).sum()},
                                   inputs, {}, false, false, true);
  auto want = torch::autograd::grad({(ref.output * R).sum()}, inputs, {}, false,
                                    false, true);
  const char* names[] = {"dq", "dk", "dv"};
  for (size_t i = 0; i < inputs.size(); ++i) {
    const std::string name = i < 3 ? names[i] : "d_captured";
    ASSERT_TRUE(want[i].defined()) << what << " " << name;
    ASSERT_TRUE(got[i].defined()) << what << " " << name << " has no gradient";
    close(got[i], want[i], name);
  }
}

class FlexAttention : public SeededTest {};

/// A fixture's mods rebuilt from their kind and parameters
/// (scripts/make_flex_fixtures.py defines them), with the captured tensors
/// of its data.
struct FixtureMods {
  ScoreMod score_mod;
  MaskMod mask_mod;
};
/// The same mods as fused mods (mha::fused_score_mod / fused_mask_mod)
/// where they hold no learned tensor; null where the fixture has none or
/// its mod is learned (the relative bias table, whose gradient is checked).
FixtureMods fused_fixture_mods(
    const nlohmann::json& f,
    torch::OrderedDict<std::string, torch::Tensor>& data) {
  using mha::fused_mask_mod;
  using mha::fused_score_mod;
  namespace fused = mha::fused;
  FixtureMods mods;
  const auto& score = f.at("score_mod");
  const auto kind = score.at("kind").get<std::string>();
  if (kind == "softcap") {
    const double cap = score.at("cap").get<double>();
    mods.score_mod = fused_score_mod([cap](auto s, auto, auto, auto, auto) {
      return cap * fused::tanh(s / cap);
    });
  } else if (kind == "alibi") {
    mods.score_mod =
        fused_score_mod([slopes = fused::Table(data["alibi_slopes"])](
                            auto s, auto, auto h, auto q, auto kv) {
          return s + fused::lookup(slopes, h) * (kv - q);
        });
  }
  const auto& mask = f.at("mask_mod");
  if (mask.is_null()) {
    return mods;
  }
  const auto m = mask.at("kind").get<std::string>();
  if (m == "causal") {
    mods.mask_mod =
        fused_mask_mod([](auto, auto, auto q, auto kv) { return q >= kv; });
  } else if (m == "sliding_window") {
    const auto W = mask.at("window").get<int64_t>();
    mods.mask_mod = fused_mask_mod(
        [W](auto, auto, auto q, auto kv) { return (q >= kv) & (q - kv < W); });
  } else if (m == "prefix_lm") {
    const auto P = mask.at("prefix").get<int64_t>();
    mods.mask_mod = fused_mask_mod(
        [P](auto, auto, auto q, auto kv) { return (kv < P) | (q >= kv); });
  } else if (m == "document") {
    mods.mask_mod =
        mha::document_mask(data["doc_lengths"], mask.at("causal").get<bool>());
  } else if (m == "per_head_causal_window") {
    const auto W = mask.at("window").get<int64_t>();
    mods.mask_mod = fused_mask_mod([W](auto, auto h, auto q, auto kv) {
      return (q >= kv) & ((h % 2 == 0) | (q - kv < W));
    });
  } else if (m == "key_lengths") {
    mods.mask_mod =
        fused_mask_mod([lengths = fused::Table(data["key_lengths"])](
                           auto b, auto, auto, auto kv) {
          return kv < fused::lookup(lengths, b);
        });
  } else if (m == "fully_masked_rows") {
    const auto R = mask.at("rows_from").get<int64_t>();
    mods.mask_mod = fused_mask_mod(
        [R](auto, auto, auto q, auto kv) { return (q < R) & (q >= kv); });
  }
  return mods;
}

FixtureMods fixture_mods(const nlohmann::json& f,
                         torch::OrderedDict<std::string, torch::Tensor>& data) {
  FixtureMods mods;
  const auto L = f.at("L").get<int64_t>();
  const auto& score = f.at("score_mod");
  const auto kind = score.at("kind").get<std::string>();
  if (kind == "softcap") {
    mods.score_mod = softcap_mod(score.at("cap").get<double>());
  } else if (kind == "alibi") {
    mods.score_mod = alibi_mod(data["alibi_slopes"]);
  } else if (kind == "rel_bias") {
    mods.score_mod = table_mod(data["rel_bias"], L);
  } else {
    EXPECT_EQ(kind, "none");
  }
  const auto& mask = f.at("mask_mod");
  if (mask.is_null()) {
    return mods;
  }
  const auto m = mask.at("kind").get<std::string>();
  if (m == "causal") {
    mods.mask_mod = causal_mod();
  } else if (m == "sliding_window") {
    mods.mask_mod = window_mod(mask.at("window").get<int64_t>());
  } else if (m == "prefix_lm") {
    const auto P = mask.at("prefix").get<int64_t>();
    mods.mask_mod = [P](const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor& q, const torch::Tensor& kv) {
      return kv.lt(P).logical_or(q.ge(kv));
    };
  } else if (m == "document") {
    mods.mask_mod =
        mha::document_mask(data["doc_lengths"], mask.at("causal").get<bool>());
  } else if (m == "per_head_causal_window") {
    const auto W = mask.at("window").get<int64_t>();
    mods.mask_mod = [W](const torch::Tensor&, const torch::Tensor& h,
                        const torch::Tensor& q, const torch::Tensor& kv) {
      auto causal = q.ge(kv);
      return torch::where(h.remainder(2).eq(0), causal,
                          causal.logical_and(q.sub(kv).lt(W)));
    };
  } else if (m == "key_lengths") {
    auto lengths = data["key_lengths"];
    mods.mask_mod = [lengths](const torch::Tensor& b, const torch::Tensor&,
                              const torch::Tensor&, const torch::Tensor& kv) {
      return kv.lt(lengths.index({b}));
    };
  } else if (m == "fully_masked_rows") {
    const auto R = mask.at("rows_from").get<int64_t>();
    mods.mask_mod = [R](const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor& q, const torch::Tensor& kv) {
      return q.lt(R).logical_and(q.ge(kv));
    };
  } else {
    ADD_FAILURE() << "unknown mask_mod kind " << m;
  }
  return mods;
}

// Python PyTorch 2.14's flex_attention (eager) on the same inputs: output,
// lse and the block mask's tensors and sparsity; gradients against the
// float64 reference (Python has no CPU backward to record). Twice: the mods
// written eagerly, then as fused mods where they hold no learned tensor
// (the reference keeps the eager ones).
TEST_F(FlexAttention, MatchesPythonFixtures) {
  std::ifstream in(fixtures::path("flex/flex.json"));
  ASSERT_TRUE(in.is_open()) << "tests/fixtures/flex/flex.json";
  const auto index = nlohmann::json::parse(in);
  ASSERT_GE(index.at("fixtures").size(), 13u);
  int fused_mods = 0;
  for (const bool fused : {false, true}) {
    for (const auto& f : index.at("fixtures")) {
      const auto name =
          f.at("name").get<std::string>() + (fused ? " (fused)" : "");
      SCOPED_TRACE(name);
      auto data = mha::read_state_dict(
          fixtures::path("flex/" + f.at("data").get<std::string>()));
      const auto eager = fixture_mods(f, data);
      auto mods = eager;
      if (fused) {
        const auto fused_mods_of_f = fused_fixture_mods(f, data);
        if (fused_mods_of_f.score_mod) {
          mods.score_mod = fused_mods_of_f.score_mod;
          ++fused_mods;
        }
        if (fused_mods_of_f.mask_mod) {
          mods.mask_mod = fused_mods_of_f.mask_mod;
          ++fused_mods;
        }
      }
      BlockMask mask;
      if (mods.mask_mod) {
        auto opt = [&](const char* key) -> c10::optional<int64_t> {
          return f.at(key).is_null()
                     ? c10::nullopt
                     : c10::optional<int64_t>(f.at(key).get<int64_t>());
        };
        mask = mha::create_block_mask(
            mods.mask_mod, opt("mask_B"), opt("mask_H"),
            f.at("L").get<int64_t>(), f.at("S").get<int64_t>(),
            f.at("block_q").get<int64_t>(), f.at("block_kv").get<int64_t>());
        const std::vector<std::pair<const char*, torch::Tensor>> tensors{
            {"kv_num_blocks", mask.kv_num_blocks},
            {"kv_indices", mask.kv_indices},
            {"full_kv_num_blocks", mask.full_kv_num_blocks},
            {"full_kv_indices", mask.full_kv_indices}};
        for (const auto& [t, mine] : tensors) {
          EXPECT_TRUE(mine.equal(data[t].to(torch::kInt)))
              << t << ": " << mine.sizes() << " vs " << data[t].sizes();
        }
        EXPECT_NEAR(mask.sparsity(), f.at("sparsity").get<double>(), 1e-9);
      }
      c10::optional<double> scale;
      if (!f.at("scale").is_null()) {
        scale = f.at("scale").get<double>();
      }
      const bool gqa = f.at("enable_gqa").get<bool>();
      auto [out, lse] =
          mha::flex_attention(data["query"], data["key"], data["value"],
                              mods.score_mod, mask, scale, gqa, true);
      expect_hf_close(out, data["output"], name + " output");
      auto lse_ref = data["lse"].to(torch::kFloat64);
      auto lse64 = lse.to(torch::kFloat64);
      EXPECT_TRUE(lse64.isinf().equal(lse_ref.isinf())) << "lse infinities";
      expect_hf_close(lse64.masked_fill(lse64.isinf(), 0.0),
                      lse_ref.masked_fill(lse_ref.isinf(), 0.0), name + " lse");
      // Gradients (and the captured table's, where the mod is eager)
      // against the float64 reference.
      Inputs grads{data["query"].clone().requires_grad_(),
                   data["key"].clone().requires_grad_(),
                   data["value"].clone().requires_grad_()};
      std::vector<torch::Tensor> captured;
      for (const char* t : {"alibi_slopes", "rel_bias"}) {
        if (data.contains(t) && !(fused && std::string(t) == "alibi_slopes")) {
          data[t].requires_grad_();
          captured.push_back(data[t]);
        }
      }
      check_against_reference(grads, mods.score_mod, eager.mask_mod, mask,
                              scale, gqa, captured, name, eager.score_mod);
    }
  }
  // Every fixture's mask and its score mod but the learned table are fused.
  EXPECT_GE(fused_mods, 20);
}

TEST_F(FlexAttention, MasksAndModsMatchTheDenseReferenceWithGradients) {
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    const int64_t L = 200, S = 200;  // not a multiple of the blocks
    auto in = make_inputs(2, 2, 2, L, S, 16, dtype, true);
    auto causal = mha::create_block_mask(causal_mod(), c10::nullopt,
                                         c10::nullopt, L, S, 64);
    check_against_reference(in, {}, causal_mod(), causal, {}, false, {},
                            "causal");
    auto window = mha::create_block_mask(window_mod(48), c10::nullopt,
                                         c10::nullopt, L, S, 32, 64);
    EXPECT_GT(window.sparsity(), 50.0);
    check_against_reference(in, {}, window_mod(48), window, {}, false, {},
                            "window 48, blocks 32 x 64");
    check_against_reference(in, softcap_mod(2.0), causal_mod(), causal, 0.3,
                            false, {}, "soft-capping + causal, scale 0.3");
    check_against_reference(in, softcap_mod(1.5), {}, {}, {}, false, {},
                            "soft-capping, no block mask");
    auto table = (0.1 * torch::randn({2, L + S - 1}, dtype)).requires_grad_();
    check_against_reference(in, table_mod(table, L), causal_mod(), causal, {},
                            false, {table}, "learned relative bias + causal");
    auto prefix = [](const torch::Tensor&, const torch::Tensor&,
                     const torch::Tensor& q, const torch::Tensor& kv) {
      return kv.lt(40).logical_or(q.ge(kv));
    };
    check_against_reference(
        in, {}, prefix,
        mha::create_block_mask(prefix, c10::nullopt, c10::nullopt, L, S, 32),
        {}, false, {}, "prefix-LM");
  }
}

TEST_F(FlexAttention, GroupedHeadsWithAlibiSlopesGetTheirGradient) {
  auto in = make_inputs(2, 4, 2, 150, 150, 16, torch::kFloat32, true);
  auto slopes = torch::tensor({0.5, 0.25, 0.125, 0.0625}).requires_grad_();
  auto causal = mha::create_block_mask(causal_mod(), c10::nullopt, c10::nullopt,
                                       150, 150, 32);
  check_against_reference(in, alibi_mod(slopes), causal_mod(), causal, {},
                          /*gqa=*/true, {slopes}, "ALiBi + causal, GQA");
}

TEST_F(FlexAttention, PerHeadAndPerBatchMasksAndFullyMaskedRows) {
  auto in = make_inputs(2, 2, 2, 96, 160, 8, torch::kFloat64, true);
  // Head 0 causal, head 1 a window of 16; batch 1 sees only 100 keys.
  auto key_lengths = torch::tensor({160, 100});
  MaskMod mod = [key_lengths](const torch::Tensor& b, const torch::Tensor& h,
                              const torch::Tensor& q, const torch::Tensor& kv) {
    auto causal = q.ge(kv);
    auto window = causal.logical_and(q.sub(kv).lt(16));
    auto per_head = torch::where(h.remainder(2).eq(0), causal, window);
    return per_head.logical_and(kv.lt(key_lengths.index({b})));
  };
  auto mask = mha::create_block_mask(mod, 2, 2, 96, 160, 32);
  EXPECT_EQ(mask.kv_num_blocks.sizes(), (std::vector<int64_t>{2, 2, 3}));
  check_against_reference(in, {}, mod, mask, {}, false, {},
                          "per-head causal/window, per-batch key lengths");
  // Rows from 50 on see nothing: output 0, lse -inf, zero gradient.
  MaskMod rows = [](const torch::Tensor&, const torch::Tensor&,
                    const torch::Tensor& q, const torch::Tensor& kv) {
    return q.lt(50).logical_and(q.ge(kv));
  };
  auto rows_mask =
      mha::create_block_mask(rows, c10::nullopt, c10::nullopt, 96, 160, 32);
  check_against_reference(in, softcap_mod(3.0), rows, rows_mask, {}, false, {},
                          "fully masked rows");
  auto [out, lse] =
      mha::flex_attention(in.q, in.k, in.v, {}, rows_mask, {}, false, true);
  EXPECT_TRUE(out.narrow(2, 50, 46).eq(0).all().item<bool>());
  EXPECT_TRUE(lse.narrow(2, 50, 46).eq(-kInf).all().item<bool>());
  EXPECT_FALSE(out.isnan().any().item<bool>());
  // A score_mod that sets every score of a row to -inf masks it, as Python.
  ScoreMod drop_row = [](const torch::Tensor& s, const torch::Tensor&,
                         const torch::Tensor&, const torch::Tensor& q,
                         const torch::Tensor&) {
    return s.masked_fill(q.eq(3), -kInf);
  };
  check_against_reference(in, drop_row, {}, {}, {}, false, {},
                          "score_mod masking a row");
}

TEST_F(FlexAttention, ManyThreadsGiveTheSameResultAsOne) {
  auto in = make_inputs(2, 4, 4, 300, 300, 16, torch::kFloat32, true);
  auto table = (0.1 * torch::randn({4, 599})).requires_grad_();
  auto mask = mha::create_block_mask(causal_mod(), c10::nullopt, c10::nullopt,
                                     300, 300, 64);
  auto run = [&] {
    auto [out, lse] =
        mha::flex_attention(in.q, in.k, in.v, table_mod(table, 300), mask);
    auto grads =
        torch::autograd::grad({out.pow(2).sum()}, {in.q, in.k, in.v, table});
    grads.push_back(out);
    return grads;
  };
  std::vector<torch::Tensor> serial, spread;
  {
    IntraOpThreads one(1);
    serial = run();
  }
  {
    IntraOpThreads two(2);
    spread = run();
  }
  for (size_t i = 0; i < serial.size(); ++i) {
    expect_close(spread[i], serial[i], 1e-5, 1e-5,
                 "tensor " + std::to_string(i));
  }
}

TEST_F(FlexAttention, BlockMaskCountsAndSparsity) {
  // Causal, 4 x 4 blocks of 32 over L = S = 128: 4 partial (the diagonal),
  // 6 full below it, 6 skipped; sparsity 37.5 %.
  auto mask = mha::create_block_mask(causal_mod(), c10::nullopt, c10::nullopt,
                                     128, 128, 32);
  EXPECT_EQ(mask.kv_num_blocks.scalar_type(), torch::kInt);
  EXPECT_TRUE(mask.kv_num_blocks.flatten().equal(
      torch::tensor({1, 1, 1, 1}, torch::kInt)));
  EXPECT_TRUE(mask.full_kv_num_blocks.flatten().equal(
      torch::tensor({0, 1, 2, 3}, torch::kInt)));
  EXPECT_EQ(mask.kv_indices[0][0][2][0].item<int>(), 2);
  EXPECT_DOUBLE_EQ(mask.sparsity(), 37.5);
  EXPECT_EQ(mask.to_dense().sum().item<int64_t>(), 10);
  // L = 100 with blocks of 32: the last block runs past L, never full.
  auto ragged = mha::create_block_mask(mha::noop_mask(), c10::nullopt,
                                       c10::nullopt, 100, 100, 32);
  EXPECT_EQ(ragged.full_kv_num_blocks.sum().item<int>(), 9);
  EXPECT_EQ(ragged.kv_num_blocks.sum().item<int>(), 7);
  EXPECT_DOUBLE_EQ(ragged.sparsity(), 0.0);
}

// The core skips unvisited blocks, calls mask_mod on partial blocks only
// (once per call for all heads the block mask shares, PartialMasks) and
// score_mod on every visited block, once each.
TEST_F(FlexAttention, ModsSeeOnlyTheVisitedBlocks) {
  auto in = make_inputs(1, 2, 2, 128, 128, 8, torch::kFloat32, false);
  std::atomic<int64_t> mask_elements{0}, score_elements{0};
  MaskMod counted_causal = [&](const torch::Tensor&, const torch::Tensor&,
                               const torch::Tensor& q,
                               const torch::Tensor& kv) {
    auto allowed = q.ge(kv);
    mask_elements += allowed.numel();
    return allowed;
  };
  ScoreMod counted_identity = [&](const torch::Tensor& s, const torch::Tensor&,
                                  const torch::Tensor&, const torch::Tensor&,
                                  const torch::Tensor&) {
    score_elements += s.numel();
    return s;
  };
  auto mask = mha::create_block_mask(counted_causal, c10::nullopt, c10::nullopt,
                                     128, 128, 32);
  EXPECT_EQ(mask_elements.load(), 128 * 128);  // built block by block
  mask_elements = 0;
  torch::NoGradGuard no_grad;  // (with grad mode, one probing call more)
  auto [out, lse] =
      mha::flex_attention(in.q, in.k, in.v, counted_identity, mask);
  // The 4 diagonal (partial) blocks, once for both heads (the mod does not
  // read h), and the 10 visited ones of each head.
  EXPECT_EQ(mask_elements.load(), 4 * 32 * 32);
  EXPECT_EQ(score_elements.load(), 2 * 10 * 32 * 32);
  auto ref =
      reference(in.q, in.k, in.v, {}, causal_mod(), 1.0 / std::sqrt(8.0));
  expect_close(out, ref.output, 1e-5, 1e-4, "counted causal");
}

// Partial blocks are evaluated once per call, one mask_mod call per query
// block for every batch and head the block mask shares (b and h as index
// tensors): a mod that reads b or h there still gives each its own flags,
// the results of the items' own calls per block and head (PartialMasksOff):
// the same bits where the flags are applied as -inf (float64; a mask whose
// rows are not one run of keys), to rounding where float32's fused softmax
// takes each row's run of allowed keys as its limits instead.
TEST_F(FlexAttention, PartialBlocksAreEvaluatedOncePerCall) {
  auto key_lengths = torch::tensor({160, 100});
  std::atomic<int64_t> calls{0};
  // Every block partial for every head (the mask made without H or B is
  // right for all of them), the flags inside differing by head and batch.
  MaskMod strided = [&calls, key_lengths](
                        const torch::Tensor& b, const torch::Tensor& h,
                        const torch::Tensor& q, const torch::Tensor& kv) {
    ++calls;
    return q.sub(kv).remainder(h + 2).ne(1).logical_and(
        kv.lt(key_lengths.index({b})));
  };
  // One run per row: causal, from key 5 h + 3 b on (rows before it see
  // nothing: output 0).
  MaskMod runs = [&calls](const torch::Tensor& b, const torch::Tensor& h,
                          const torch::Tensor& q, const torch::Tensor& kv) {
    ++calls;
    return q.ge(kv).logical_and(kv.ge(h.mul(5).add(b.mul(3))));
  };
  for (auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (const auto& [name, mod] :
         {std::pair<std::string, MaskMod>{"strided", strided},
          std::pair<std::string, MaskMod>{"runs", runs}}) {
      const std::string what = name + ", " + c10::toString(dtype);
      auto in = make_inputs(2, 3, 3, 96, 160, 8, dtype, true);
      // Made from batch 1, head 2, the last keys to start: each block it
      // sees partly is partial or unseen for every batch and head.
      MaskMod last = [&mod](const torch::Tensor&, const torch::Tensor&,
                            const torch::Tensor& q, const torch::Tensor& kv) {
        return mod(torch::ones({}, torch::kLong),
                   torch::full({}, 2, torch::kLong), q, kv);
      };
      auto mask =
          mha::create_block_mask(name == "strided" ? mod : last, c10::nullopt,
                                 c10::nullopt, 96, 160, 32);
      mask.mask_mod = mod;  // what the core evaluates
      const auto partial = mask.kv_num_blocks.sum().item<int64_t>();
      EXPECT_EQ(partial, name == "strided" ? 3 * 5 : 5) << what;
      EXPECT_EQ(mask.full_kv_num_blocks.sum().item<int64_t>(),
                name == "strided" ? 0 : 1)
          << what;
      check_against_reference(in, {}, mod, mask, {}, false, {}, what);
      auto run = [&] {
        calls = 0;
        auto [out, lse] = mha::flex_attention(in.q, in.k, in.v, {}, mask);
        auto grads =
            torch::autograd::grad({out.pow(2).sum()}, {in.q, in.k, in.v});
        grads.push_back(out);
        return grads;
      };
      auto once = run();
      EXPECT_EQ(calls.load(), 3) << what;  // one per query block
      std::vector<torch::Tensor> per_block;
      {
        mha::detail::PartialMasksOff off;
        per_block = run();
      }
      // Forward and backward's recomputation, per batch, head and block.
      EXPECT_EQ(calls.load(), 2 * (2 * 3 * partial)) << what;
      for (size_t i = 0; i < once.size(); ++i) {
        if (dtype == torch::kFloat64) {
          EXPECT_TRUE(once[i].equal(per_block[i])) << what << " tensor " << i;
        } else {
          expect_close(once[i], per_block[i], 1e-6, 1e-5,
                       what + " tensor " + std::to_string(i));
        }
      }
    }
  }
}

TEST_F(FlexAttention, DocumentBlockMaskEqualsTheEvaluatedOne) {
  auto lengths = torch::tensor({70, 5, 130, 1, 50, 64}, torch::kLong);
  EXPECT_TRUE(mha::document_ids(torch::tensor({2, 1, 3}))
                  .equal(torch::tensor({0, 0, 1, 2, 2, 2}, torch::kLong)));
  for (bool causal : {false, true}) {
    for (int64_t block : {16, 32, 128}) {
      auto built = mha::create_document_block_mask(lengths, causal, block);
      auto evaluated =
          mha::create_block_mask(mha::document_mask(lengths, causal),
                                 c10::nullopt, c10::nullopt, 320, 320, block);
      const std::string what =
          std::string(causal ? "causal" : "bidirectional") + ", block " +
          std::to_string(block);
      EXPECT_TRUE(built.kv_num_blocks.equal(evaluated.kv_num_blocks)) << what;
      EXPECT_TRUE(built.kv_indices.equal(evaluated.kv_indices)) << what;
      EXPECT_TRUE(built.full_kv_num_blocks.equal(evaluated.full_kv_num_blocks))
          << what;
      EXPECT_TRUE(built.full_kv_indices.equal(evaluated.full_kv_indices))
          << what;
      EXPECT_DOUBLE_EQ(built.sparsity(), evaluated.sparsity()) << what;
    }
  }
  // Packed documents attend like each document on its own.
  auto in = make_inputs(1, 2, 2, 320, 320, 8, torch::kFloat64, true);
  auto mask = mha::create_document_block_mask(lengths, true, 32);
  check_against_reference(in, {}, mha::document_mask(lengths, true), mask, {},
                          false, {}, "packed documents, causal");
  // A 64k-token document mask is built from the lengths alone.
  auto long_mask = mha::create_document_block_mask(
      torch::full({64}, 1024, torch::kLong), true, 128);
  EXPECT_EQ(long_mask.kv_indices.size(3), 512);
  EXPECT_NEAR(long_mask.sparsity(), 100.0 * (1 - 64 * 36.0 / (512 * 512)),
              1e-9);
}

TEST_F(FlexAttention, AndOrNoopMasks) {
  DenseIndex i(1, 1, 6, 6);
  auto both =
      mha::and_masks({causal_mod(), window_mod(2)})(i.b, i.h, i.q, i.kv);
  auto either =
      mha::or_masks({causal_mod(), window_mod(2)})(i.b, i.h, i.q, i.kv);
  auto causal = causal_mod()(i.b, i.h, i.q, i.kv);
  auto window = window_mod(2)(i.b, i.h, i.q, i.kv);
  EXPECT_TRUE(both.equal(causal.logical_and(window)));
  EXPECT_TRUE(either.equal(causal.logical_or(window)));
  EXPECT_TRUE(mha::noop_mask()(i.b, i.h, i.q, i.kv).item<bool>());
  EXPECT_THROW_MSG(mha::and_masks({causal_mod(), MaskMod()}), "empty function");
}

// The built-in options written as mods give the built-ins' results.
TEST_F(FlexAttention, BuiltInsAsModsEqualTheBuiltInOptions) {
  const int64_t E = 32, H = 4, L = 130;
  auto x = torch::randn({2, L, E});
  auto run = [&](mha::MultiHeadAttentionOptions options, bool causal,
                 const BlockMask& mask) {
    torch::manual_seed(7);
    mha::MultiHeadAttention m(options);
    return std::get<0>(
        m->forward(x, {}, {}, {}, false, {}, true, causal, {}, mask));
  };
  auto base = mha::MultiHeadAttentionOptions(E, H);
  auto causal_mask = mha::create_block_mask(causal_mod(), c10::nullopt,
                                            c10::nullopt, L, L, 32);
  // Causal.
  expect_close(run(base, false, causal_mask), run(base, true, {}), 1e-5, 1e-5,
               "causal");
  // Sliding window (causal, |i - j| < 24), as options.window.
  auto window = mha::create_block_mask(window_mod(24), c10::nullopt,
                                       c10::nullopt, L, L, 32);
  expect_close(run(base, false, window),
               run(mha::MultiHeadAttentionOptions(base).window(24), true, {}),
               1e-5, 1e-5, "window");
  // ALiBi: slopes 2^(-8(h+1)/H), bias slope · (j - i).
  auto slopes = mha::alibi_slopes(H);
  auto alibi =
      mha::MultiHeadAttentionOptions(base).score_mod(alibi_mod(slopes));
  expect_close(run(alibi, true, {}),
               run(mha::MultiHeadAttentionOptions(base).position_bias(
                       mha::PositionBias::kAlibi),
                   true, {}),
               1e-5, 1e-5, "ALiBi");
}

TEST_F(FlexAttention, T5BucketsAsAScoreMod) {
  const int64_t E = 32, H = 4, L = 40;
  auto options = mha::MultiHeadAttentionOptions(E, H)
                     .position_bias(mha::PositionBias::kRelative)
                     .scale(1.0);
  torch::manual_seed(3);
  mha::MultiHeadAttention builtin(options);
  auto x = torch::randn({2, L, E});
  auto [want, unused] = builtin->forward(x, {}, {}, {}, false);
  // The same module's weights, its T5 bias as a captured table.
  auto plain = mha::MultiHeadAttentionOptions(E, H).scale(1.0);
  auto table = builtin->relative_attention_bias->weight;  // (buckets, H)
  auto buckets = mha::relative_position_bucket(
      torch::arange(-(L - 1), L, torch::kLong), true, 32, 128);  // (2L - 1)
  plain.score_mod(
      [table, buckets, L](const torch::Tensor& s, const torch::Tensor&,
                          const torch::Tensor& h, const torch::Tensor& q,
                          const torch::Tensor& kv) {
        return s + table.index({buckets.index({kv - q + (L - 1)}), h});
      });
  mha::MultiHeadAttention modded(plain);
  torch::NoGradGuard no_grad;
  for (const auto& p : builtin->named_parameters()) {
    if (p.key().find("relative_attention_bias") == std::string::npos) {
      modded->named_parameters()[p.key()].copy_(p.value());
    }
  }
  auto [got, unused2] = modded->forward(x, {}, {}, {}, false);
  expect_close(got, want, 1e-5, 1e-5, "T5 buckets");
}

TEST_F(FlexAttention, PackedDocumentsThroughTheModulesEqualSeparateRuns) {
  const int64_t E = 32, H = 4;
  auto lengths = torch::tensor({30, 70, 28});
  const int64_t T = 128;
  auto options = mha::MultiHeadAttentionOptions(E, H).rotary(true);
  mha::MultiHeadAttention m(options);
  auto x = torch::randn({1, T, E}, torch::requires_grad());
  // Positions restart in each document.
  auto positions =
      torch::cat({torch::arange(30), torch::arange(70), torch::arange(28)})
          .unsqueeze(0);
  auto mask = mha::create_document_block_mask(lengths, /*causal=*/true, 32);
  auto [packed, w] =
      m->forward(x, {}, {}, {}, false, {}, true, false, positions, mask);
  int64_t start = 0;
  for (int64_t d = 0; d < 3; ++d) {
    const auto n = lengths[d].item<int64_t>();
    auto [alone, w2] = m->forward(x.narrow(1, start, n), {}, {}, {}, false, {},
                                  true, /*is_causal=*/true);
    expect_close(packed.narrow(1, start, n), alone, 1e-5, 1e-5,
                 "document " + std::to_string(d));
    start += n;
  }
  // Through the encoder layer, with gradients.
  mha::TransformerEncoderLayer layer(
      mha::TransformerEncoderLayerOptions(E, H).dim_feedforward(64).dropout(
          0.0));
  auto y = layer->forward(x, {}, {}, false, mask);
  auto dx = torch::autograd::grad({y.sum()}, {x})[0];
  EXPECT_FALSE(dx.isnan().any().item<bool>());
  auto first = layer->forward(x.narrow(1, 0, 30), {}, {}, true);
  expect_close(y.narrow(1, 0, 30), first, 1e-5, 1e-5, "encoder layer");
  mha::TransformerEncoder encoder(mha::TransformerEncoderOptions(layer, 2));
  auto z = encoder->forward(x, {}, {}, false, mask);
  expect_close(z.narrow(1, 100, 28),
               encoder->forward(x.narrow(1, 100, 28), {}, {}, true), 1e-5, 1e-5,
               "encoder");
}

TEST_F(FlexAttention, ModuleScoreModAppliesEverywhere) {
  const int64_t E = 16, H = 2, L = 12;
  auto base = mha::MultiHeadAttentionOptions(E, H);
  auto capped =
      mha::MultiHeadAttentionOptions(base).score_mod(softcap_mod(0.5));
  torch::manual_seed(1);
  mha::MultiHeadAttention plain(base);
  torch::manual_seed(1);
  mha::MultiHeadAttention soft(capped);
  auto x = torch::randn({2, L, E});
  auto [a, wa] = plain->forward(x);
  auto [b, wb] = soft->forward(x);
  EXPECT_GT((a - b).abs().max().item<double>(), 1e-3);  // the cap acts
  // Weights as the reference: softmax(cap · tanh(s / cap)).
  auto q = x.matmul(soft->in_proj_weight.narrow(0, 0, E).t())
               .view({2, L, H, E / H})
               .transpose(1, 2);
  auto k = x.matmul(soft->in_proj_weight.narrow(0, E, E).t())
               .view({2, L, H, E / H})
               .transpose(1, 2);
  auto s = q.matmul(k.transpose(-2, -1)) / std::sqrt(E / H);
  auto w = torch::softmax(0.5 * torch::tanh(s / 0.5), -1).mean(1);
  expect_close(wb, w, 1e-5, 1e-5, "weights");
  // Cached decoding equals the full causal forward.
  auto [full, unused] = soft->forward(x, {}, {}, {}, false, {}, true, true);
  auto cache = soft->make_kv_cache(2, L);
  auto [first, u1] = soft->forward_cached(x.narrow(1, 0, 5), cache);
  auto [rest, u2] = soft->forward_cached(x.narrow(1, 5, L - 5), cache);
  expect_close(torch::cat({first, rest}, 1), full, 1e-5, 1e-5, "cached");
}

TEST_F(FlexAttention, ExplicitPathForOtherDtypes) {
  // bfloat16 runs on the blocked core in float32 (CUDA would take the
  // materialised path): close to the float64 reference.
  auto in = make_inputs(1, 2, 2, 64, 64, 16, torch::kFloat64, false);
  auto mask = mha::create_block_mask(causal_mod(), c10::nullopt, c10::nullopt,
                                     64, 64, 16);
  auto [out, lse] = mha::flex_attention(
      in.q.to(torch::kBFloat16), in.k.to(torch::kBFloat16),
      in.v.to(torch::kBFloat16), softcap_mod(2.0), mask, {}, false, true);
  auto ref = reference(in.q, in.k, in.v, softcap_mod(2.0), causal_mod(), 0.25);
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  EXPECT_EQ(lse.scalar_type(), torch::kFloat32);
  expect_close(out, ref.output, 0.05, 0.05, "bfloat16 output");
  expect_close(lse, ref.lse, 0.05, 0.02, "bfloat16 lse");
}

TEST_F(FlexAttention, ErrorsNameWhatWasWrong) {
  auto in = make_inputs(1, 4, 2, 32, 32, 8, torch::kFloat32, false);
  EXPECT_THROW_MSG(mha::flex_attention(in.q, in.k, in.v), "enable_gqa");
  auto three = make_inputs(1, 3, 2, 32, 32, 8, torch::kFloat32, false);
  EXPECT_THROW_MSG(
      mha::flex_attention(three.q, three.k, three.v, {}, {}, {}, true),
      "multiple of");
  auto other = mha::create_block_mask(causal_mod(), c10::nullopt, c10::nullopt,
                                      64, 32, 16);
  EXPECT_THROW_MSG(
      mha::flex_attention(in.q, in.k, in.v, {}, other, {}, true),
      "made for q_len = 64, kv_len = 32, but the call has L = 32, S = 32");
  ScoreMod throws = [](const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&, const torch::Tensor&,
                       const torch::Tensor&) -> torch::Tensor {
    throw std::runtime_error("boom");
  };
  {
    IntraOpThreads two(2);  // thrown on a worker thread
    EXPECT_THROW_MSG(
        mha::flex_attention(in.q, in.k, in.v, throws, {}, {}, true),
        "score_mod threw: boom");
  }
  ScoreMod integer = [](const torch::Tensor& s, const torch::Tensor&,
                        const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor&) { return s.to(torch::kLong); };
  EXPECT_THROW_MSG(mha::flex_attention(in.q, in.k, in.v, integer, {}, {}, true),
                   "expected a floating score");
  ScoreMod wrong_shape = [](const torch::Tensor& s, const torch::Tensor&,
                            const torch::Tensor&, const torch::Tensor&,
                            const torch::Tensor&) {
    return torch::zeros({7, 3}, s.options());
  };
  EXPECT_THROW_MSG(
      mha::flex_attention(in.q, in.k, in.v, wrong_shape, {}, {}, true),
      "score_mod's result must be broadcastable");
  MaskMod not_bool = [](const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor& q,
                        const torch::Tensor&) { return q.to(torch::kFloat); };
  EXPECT_THROW_MSG(
      mha::create_block_mask(not_bool, c10::nullopt, c10::nullopt, 32, 32, 16),
      "expected bool");
  EXPECT_THROW_MSG(mha::document_ids(torch::tensor({3, 0})), "positive");
  mha::MultiHeadAttention m(mha::MultiHeadAttentionOptions(8, 2));
  EXPECT_THROW_MSG(m->forward(torch::randn({1, 32, 8}), {}, {}, {}, false, {},
                              true, false, {}, other),
                   "block_mask was made for q_len = 64");
}

}  // namespace
