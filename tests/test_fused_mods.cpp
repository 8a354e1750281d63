// Fused mods (mha/flex_attention.h, mha/fused.h): every fused mod against
// the same mod written eagerly (outputs, lse and the gradients of query,
// key and value; float64 1e-12, float32 1e-5 + 1e-4 |ref|), the dual-number
// derivative against autograd's, the float32 lane math against ATen's, fused
// block masks against eager ones, the eager mods whose derivative needs
// their input scores, and the errors.
//
// Glossary: B batch, H heads, L query length, S key length, E features.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "mha/mha.h"
#include "test_helpers.h"

namespace {

using mha::BlockMask;
using mha::MaskMod;
using mha::ScoreMod;
namespace fused = mha::fused;

/// One call's result: output, lse and the gradients of sum(output · R).
struct Run {
  torch::Tensor out, lse, dq, dk, dv;
};

Run run_flex(const torch::Tensor& q0, const torch::Tensor& k0,
             const torch::Tensor& v0, const ScoreMod& score_mod,
             const BlockMask& block_mask, c10::optional<double> scale, bool gqa,
             const torch::Tensor& R) {
  auto q = q0.detach().clone().requires_grad_();
  auto k = k0.detach().clone().requires_grad_();
  auto v = v0.detach().clone().requires_grad_();
  auto [out, lse] =
      mha::flex_attention(q, k, v, score_mod, block_mask, scale, gqa, true);
  auto grads = torch::autograd::grad({(out * R).sum()}, {q, k, v});
  return {out.detach(), lse, grads[0], grads[1], grads[2]};
}

/// a within the tolerance of the reference e (-inf where e is).
void expect_equal_within(const torch::Tensor& a, const torch::Tensor& e,
                         const std::string& what) {
  ASSERT_EQ(a.sizes(), e.sizes()) << what;
  const bool f32 = e.scalar_type() == torch::kFloat32;
  auto a64 = a.to(torch::kFloat64), e64 = e.to(torch::kFloat64);
  EXPECT_TRUE(a64.isinf().eq(e64.isinf()).all().item<bool>())
      << what << ": infinities differ";
  const auto finite = e64.isfinite();
  a64 = a64.masked_fill(finite.logical_not(), 0.0);
  e64 = e64.masked_fill(finite.logical_not(), 0.0);
  const double atol = f32 ? 1e-5 : 1e-12, rtol = f32 ? 1e-4 : 1e-12;
  const auto excess = (a64 - e64).abs() - (atol + rtol * e64.abs());
  EXPECT_LE(excess.max().item<double>(), 0.0)
      << what << ": max abs diff " << (a64 - e64).abs().max().item<double>();
}

void expect_runs_equal(const Run& a, const Run& e, const std::string& what) {
  expect_equal_within(a.out, e.out, what + " output");
  expect_equal_within(a.lse, e.lse, what + " lse");
  expect_equal_within(a.dq, e.dq, what + " dq");
  expect_equal_within(a.dk, e.dk, what + " dk");
  expect_equal_within(a.dv, e.dv, what + " dv");
}

/// A case: a mod written fused and eagerly, and the call's shape.
struct Case {
  std::string name;
  ScoreMod fused_score, eager_score;
  MaskMod fused_mask, eager_mask;
  int64_t B = 1, H = 2, Hkv = 2, L = 150, S = 150, block = 32;
  c10::optional<double> scale;
};

torch::Tensor causal_eager(const torch::Tensor& q, const torch::Tensor& kv) {
  return q.ge(kv);
}

std::vector<Case> cases() {
  std::vector<Case> all;
  const auto eager_mask = [](std::function<torch::Tensor(
                                 const torch::Tensor&, const torch::Tensor&,
                                 const torch::Tensor&, const torch::Tensor&)>
                                 f) { return MaskMod(std::move(f)); };
  {
    Case c;
    c.name = "causal";
    c.fused_mask = mha::fused_mask_mod(
        [](auto, auto, auto q, auto kv) { return q >= kv; });
    c.eager_mask = eager_mask(
        [](auto&, auto&, auto& q, auto& kv) { return causal_eager(q, kv); });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "window 40";
    c.fused_mask = mha::fused_mask_mod(
        [](auto, auto, auto q, auto kv) { return (q >= kv) & (q - kv < 40); });
    c.eager_mask = eager_mask([](auto&, auto&, auto& q, auto& kv) {
      return q.ge(kv).logical_and(q.sub(kv).lt(40));
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "prefix-LM 50";
    c.fused_mask = mha::fused_mask_mod(
        [](auto, auto, auto q, auto kv) { return (kv < 50) | (q >= kv); });
    c.eager_mask = eager_mask([](auto&, auto&, auto& q, auto& kv) {
      return kv.lt(50).logical_or(q.ge(kv));
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "documents";
    const auto lengths = torch::tensor({30, 70, 1, 49}, torch::kLong);
    c.fused_mask = mha::document_mask(lengths, true);
    const auto doc = mha::document_ids(lengths);
    c.eager_mask = eager_mask([doc](auto&, auto&, auto& q, auto& kv) {
      return doc.index({q}).eq(doc.index({kv})).logical_and(q.ge(kv));
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "soft-cap 5 + causal, block 64";
    c.block = 64;
    c.fused_score = mha::fused_score_mod(
        [](auto s, auto, auto, auto, auto) { return 5 * fused::tanh(s / 5); });
    c.eager_score = [](auto& s, auto&, auto&, auto&, auto&) {
      return 5.0 * torch::tanh(s / 5.0);
    };
    c.fused_mask = all[0].fused_mask;
    c.eager_mask = all[0].eager_mask;
    all.push_back(c);
  }
  {
    Case c;
    c.name = "ALiBi, grouped heads, causal";
    c.H = 4;
    c.Hkv = 2;
    const auto slopes = torch::tensor({0.5, 0.25, 0.125, 0.0625});
    c.fused_score =
        mha::fused_score_mod([slopes](auto s, auto, auto h, auto q, auto kv) {
          return s + fused::lookup(slopes, h) * (kv - q);
        });
    c.eager_score = [slopes](auto& s, auto&, auto& h, auto& q, auto& kv) {
      return s + slopes.index({h}) * (kv - q).to(s.scalar_type());
    };
    c.fused_mask = all[0].fused_mask;
    c.eager_mask = all[0].eager_mask;
    all.push_back(c);
  }
  {
    Case c;
    c.name = "dilated 2, block 96";
    c.block = 96;
    c.fused_mask = mha::fused_mask_mod(
        [](auto, auto, auto q, auto kv) { return (q - kv) % 2 == 0; });
    c.eager_mask = eager_mask([](auto&, auto&, auto& q, auto& kv) {
      return torch::fmod(q - kv, 2).eq(0);
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "per-head window";
    const auto windows = torch::tensor({8, 64}, torch::kLong);
    c.fused_mask =
        mha::fused_mask_mod([windows](auto, auto h, auto q, auto kv) {
          return (q >= kv) & (q - kv < fused::lookup(windows, h));
        });
    c.eager_mask = eager_mask([windows](auto&, auto& h, auto& q, auto& kv) {
      return q.ge(kv).logical_and((q - kv).lt(windows.index({h})));
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "fully masked rows";
    c.fused_mask = mha::fused_mask_mod(
        [](auto, auto, auto q, auto kv) { return (q >= 20) & (kv <= q); });
    c.eager_mask = eager_mask([](auto&, auto&, auto& q, auto& kv) {
      return q.ge(20).logical_and(kv.le(q));
    });
    all.push_back(c);
  }
  {
    Case c;
    c.name = "T5 buckets through lookup, custom scale, cross lengths";
    c.L = 70;
    c.S = 130;
    c.scale = 1.0;
    const auto bias = torch::randn({2, c.L + c.S - 1}, torch::kFloat64);
    const auto L = c.L;
    c.fused_score =
        mha::fused_score_mod([bias, L](auto s, auto, auto h, auto q, auto kv) {
          return s + fused::lookup(bias, h, kv - q + (L - 1));
        });
    c.eager_score = [bias, L](auto& s, auto&, auto& h, auto& q, auto& kv) {
      return s + bias.index({h, kv - q + (L - 1)});
    };
    all.push_back(c);
  }
  {
    Case c;
    c.name = "clamp, square, where, min, max, exp, log";
    c.fused_score =
        mha::fused_score_mod([](auto s, auto, auto, auto q, auto kv) {
          const auto a = fused::clamp(s, -1.5, 1.5) + s * s / 8;
          const auto b =
              fused::where(q > kv, fused::min(a, 1.0), fused::max(s, -0.5));
          return b + fused::exp(s / 4) - fused::log(fused::abs(s) + 1) +
                 fused::sigmoid(s) + fused::sqrt(s * s + 1);
        });
    c.eager_score = [](auto& s, auto&, auto&, auto& q, auto& kv) {
      const auto a = torch::clamp(s, -1.5, 1.5) + s * s / 8;
      const auto b =
          torch::where(q.gt(kv), a.clamp_max(1.0), s.clamp_min(-0.5));
      return b + torch::exp(s / 4) - torch::log(s.abs() + 1) +
             torch::sigmoid(s) + torch::sqrt(s * s + 1);
    };
    all.push_back(c);
  }
  return all;
}

class FusedMods : public SeededTest {};

TEST_F(FusedMods, EqualTheSameModWrittenEagerly) {
  for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
    for (const auto& c : cases()) {
      const auto opts = torch::TensorOptions().dtype(dtype);
      const auto q = torch::randn({c.B, c.H, c.L, 16}, opts);
      const auto k = torch::randn({c.B, c.Hkv, c.S, 16}, opts);
      const auto v = torch::randn({c.B, c.Hkv, c.S, 16}, opts);
      const auto R = torch::randn({c.B, c.H, c.L, 16}, opts);
      const bool gqa = c.H != c.Hkv;
      BlockMask fused_blocks, eager_blocks;
      if (c.fused_mask) {
        fused_blocks = mha::create_block_mask(c.fused_mask, c10::nullopt, c.H,
                                              c.L, c.S, c.block);
        eager_blocks = mha::create_block_mask(c.eager_mask, c10::nullopt, c.H,
                                              c.L, c.S, c.block);
        ASSERT_TRUE(torch::equal(fused_blocks.kv_num_blocks,
                                 eager_blocks.kv_num_blocks))
            << c.name;
        ASSERT_TRUE(
            torch::equal(fused_blocks.kv_indices, eager_blocks.kv_indices))
            << c.name;
        ASSERT_TRUE(torch::equal(fused_blocks.full_kv_num_blocks,
                                 eager_blocks.full_kv_num_blocks))
            << c.name;
        ASSERT_TRUE(torch::equal(fused_blocks.full_kv_indices,
                                 eager_blocks.full_kv_indices))
            << c.name;
      }
      const auto name = c.name + (dtype == torch::kFloat32 ? " f32" : " f64");
      const auto eager =
          run_flex(q, k, v, c.eager_score, eager_blocks, c.scale, gqa, R);
      const auto fused_run =
          run_flex(q, k, v, c.fused_score, fused_blocks, c.scale, gqa, R);
      expect_runs_equal(fused_run, eager, name);
      // The tensor form on the explicit path (float64 reference).
      if (dtype == torch::kFloat64) {
        const auto mixed =
            run_flex(q, k, v, c.fused_score, eager_blocks, c.scale, gqa, R);
        expect_runs_equal(mixed, eager, name + " (eager block mask)");
      }
    }
  }
}

TEST_F(FusedMods, EagerModsWhoseDerivativeNeedsTheirScores) {
  // clamp, s * s and clamp_max save their input for backward.
  const std::vector<std::pair<std::string, ScoreMod>> mods = {
      {"clamp", [](auto& s, auto&, auto&, auto&,
                   auto&) { return torch::clamp(s, -0.5, 0.5); }},
      {"square", [](auto& s, auto&, auto&, auto&, auto&) { return s * s; }},
      {"clamp_max",
       [](auto& s, auto&, auto&, auto&, auto&) { return s.clamp_max(0.3); }},
  };
  const auto causal = mha::create_block_mask(
      [](auto&, auto&, auto& q, auto& kv) { return causal_eager(q, kv); },
      c10::nullopt, c10::nullopt, 100, 100, 32);
  for (const auto& [name, mod] : mods) {
    for (const bool masked : {false, true}) {
      const auto q = torch::randn({1, 2, 100, 8}, torch::kFloat64);
      const auto k = torch::randn({1, 2, 100, 8}, torch::kFloat64);
      const auto v = torch::randn({1, 2, 100, 8}, torch::kFloat64);
      const auto R = torch::randn({1, 2, 100, 8}, torch::kFloat64);
      const BlockMask blocks = masked ? causal : BlockMask();
      const auto got = run_flex(q, k, v, mod, blocks, c10::nullopt, false, R);
      // The dense reference: autograd through whole (L, S) tensors.
      auto qr = q.clone().requires_grad_(), kr = k.clone().requires_grad_(),
           vr = v.clone().requires_grad_();
      auto s = torch::matmul(qr, kr.transpose(-2, -1)) / std::sqrt(8.0);
      const auto idx = torch::arange(100, torch::kLong);
      s = mod(s, torch::zeros({1, 1, 1, 1}, torch::kLong),
              torch::arange(2).view({1, 2, 1, 1}), idx.view({1, 1, 100, 1}),
              idx.view({1, 1, 1, 100}));
      if (masked) {
        s = s.masked_fill(idx.view({100, 1}).lt(idx.view({1, 100})), -kInf);
      }
      auto out = torch::matmul(torch::softmax(s, -1), vr);
      auto want = torch::autograd::grad({(out * R).sum()}, {qr, kr, vr});
      const auto label = name + (masked ? " causal" : "");
      expect_equal_within(got.out, out.detach(), label + " output");
      expect_equal_within(got.dq, want[0], label + " dq");
      expect_equal_within(got.dk, want[1], label + " dk");
      expect_equal_within(got.dv, want[2], label + " dv");
    }
  }
}

/// Scores with the kinks of the mods below among them.
torch::Tensor probe_scores(torch::ScalarType dtype) {
  auto s = torch::randn({997}, torch::TensorOptions().dtype(dtype)) * 4;
  auto kinks = torch::tensor({-1.5, 1.5, 0.0, 1.0, -0.5, 0.625, -0.625, 30.0,
                              -90.0, 90.0, 1e-4, -1e-4},
                             torch::TensorOptions().dtype(dtype));
  return torch::cat({s, kinks});
}

TEST_F(FusedMods, DualDerivativeEqualsAutograd) {
  const std::vector<std::pair<std::string, ScoreMod>> mods = {
      {"softcap", mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
         return 30 * fused::tanh(s / 30);
       })},
      {"clamp bounds", mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
         return fused::clamp(s, -1.5, 1.5);
       })},
      {"where switch",
       mha::fused_score_mod([](auto s, auto, auto, auto, auto kv) {
         return fused::where(s > 1, s * s, -s / 2 + kv);
       })},
      {"min / max of two, ties",
       mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
         return fused::min(s, -s) + fused::max(s * 2, s);
       })},
      {"min / max with numbers",
       mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
         return fused::min(s, 1.0) + fused::max(s, -0.5);
       })},
      {"abs, exp, log, sigmoid, sqrt",
       mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
         return fused::abs(s) + fused::exp(-fused::abs(s)) +
                fused::log(s * s + 1) + fused::sigmoid(s) +
                fused::sqrt(s * s + 2);
       })},
  };
  for (const auto& [name, mod] : mods) {
    ASSERT_NE(mod.fused(), nullptr) << name;
    const auto s = probe_scores(torch::kFloat64);
    const auto kv = torch::arange(s.numel(), torch::kLong);
    const auto zero = torch::zeros({}, torch::kLong);
    auto leaf = s.clone().requires_grad_();
    const auto eager = mod(leaf, zero, zero, zero, kv);
    const auto want = torch::autograd::grad({eager.sum()}, {leaf})[0];
    auto value = s.clone();
    auto derivative = torch::empty_like(s);
    mod.fused()->apply_with_derivative(value.data_ptr<double>(),
                                       derivative.data_ptr<double>(), s.numel(),
                                       0, 0, 0, 0);
    expect_equal_within(value, eager.detach(), name + " value");
    expect_equal_within(derivative, want, name + " derivative");
    // float32 lanes: the polynomials against ATen's float32 functions.
    const auto s32 = s.to(torch::kFloat32);
    auto v32 = s32.clone();
    mod.fused()->apply(v32.data_ptr<float>(), s.numel(), 0, 0, 0, 0);
    const auto e32 = mod(s32, zero, zero, zero, kv);
    EXPECT_TRUE(torch::allclose(v32, e32, 1e-5, 1e-6)) << name << " float32";
  }
}

TEST_F(FusedMods, Float32MathMatchesATen) {
  auto x = torch::cat(
      {torch::linspace(-100, 100, 20001),
       torch::tensor({0.0, -0.0, 1e-30, -1e-30, kInf, -kInf, std::nan("")})
           .to(torch::kFloat32)});
  const auto n = x.numel();
  const auto run = [&](const ScoreMod& mod) {
    auto y = x.clone();
    mod.fused()->apply(y.data_ptr<float>(), n, 0, 0, 0, 0);
    return y;
  };
  const auto close = [&](const torch::Tensor& a, const torch::Tensor& e,
                         const char* name) {
    // Below -87.3 exp is 0 where ATen gives a denormal (under FLT_MIN).
    EXPECT_TRUE(torch::allclose(a, e, 5e-7, 1.2e-38, /*equal_nan=*/true))
        << name << ": max rel diff "
        << ((a - e).abs() / e.abs()).nan_to_num(0, 0, 0).max().item<float>()
        << " at x = "
        << x.index({torch::isclose(a, e, 5e-7, 1.2e-38, true).logical_not()})
               .narrow(0, 0, 1);
  };
  close(run(mha::fused_score_mod(
            [](auto s, auto, auto, auto, auto) { return fused::exp(s); })),
        torch::exp(x), "exp");
  close(run(mha::fused_score_mod(
            [](auto s, auto, auto, auto, auto) { return fused::tanh(s); })),
        torch::tanh(x), "tanh");
  close(run(mha::fused_score_mod(
            [](auto s, auto, auto, auto, auto) { return fused::log(s); })),
        torch::log(x), "log");
  close(run(mha::fused_score_mod(
            [](auto s, auto, auto, auto, auto) { return fused::sigmoid(s); })),
        torch::sigmoid(x), "sigmoid");
}

TEST_F(FusedMods, FusedMasksCombineAndStayFused) {
  const auto causal =
      mha::fused_mask_mod([](auto, auto, auto q, auto kv) { return q >= kv; });
  const auto near = mha::fused_mask_mod(
      [](auto, auto, auto q, auto kv) { return q - kv < 9; });
  const auto both = mha::and_masks({causal, near});
  const auto either = mha::or_masks({causal, near});
  ASSERT_NE(both.fused(), nullptr);
  ASSERT_NE(either.fused(), nullptr);
  const MaskMod eager = [](auto&, auto&, auto& q, auto& kv) {
    return q.ge(kv);
  };
  EXPECT_EQ(mha::and_masks({causal, eager}).fused(), nullptr);
  const auto q = torch::arange(300, torch::kLong).view({300, 1});
  const auto kv = torch::arange(300, torch::kLong).view({1, 300});
  const auto zero = torch::zeros({}, torch::kLong);
  for (const auto& [mod, want] :
       {std::make_pair(both, q.ge(kv).logical_and((q - kv).lt(9))),
        std::make_pair(either, q.ge(kv).logical_or((q - kv).lt(9)))}) {
    EXPECT_TRUE(torch::equal(mod(zero, zero, q, kv), want));
    std::vector<uint8_t> row(300);
    for (int64_t i = 0; i < 300; i += 37) {
      mod.fused()->allowed(row.data(), 300, 0, 0, i, 0);
      const auto got = torch::from_blob(row.data(), {300}, torch::kUInt8);
      EXPECT_TRUE(torch::equal(got.to(torch::kBool), want[i])) << i;
    }
  }
}

TEST_F(FusedMods, ModuleScoreModEqualsEager) {
  auto options = mha::MultiHeadAttentionOptions(32, 4);
  mha::MultiHeadAttention eager(
      options.score_mod([](auto& s, auto&, auto&, auto&, auto&) {
        return 8.0 * torch::tanh(s / 8.0);
      }));
  mha::MultiHeadAttention fused_module(
      mha::MultiHeadAttentionOptions(32, 4).score_mod(
          mha::fused_score_mod([](auto s, auto, auto, auto, auto) {
            return 8 * fused::tanh(s / 8);
          })));
  {
    torch::NoGradGuard no_grad;
    const auto from = eager->named_parameters();
    for (auto& p : fused_module->named_parameters()) {
      p.value().copy_(from[p.key()]);
    }
  }
  const auto x = torch::randn({2, 40, 32});
  const auto a =
      std::get<0>(eager->forward(x, {}, {}, {}, false, {}, true, true));
  const auto b =
      std::get<0>(fused_module->forward(x, {}, {}, {}, false, {}, true, true));
  expect_equal_within(b, a, "module output");
}

TEST_F(FusedMods, ErrorsAndNaN) {
  const auto q = torch::randn({1, 2, 300, 8});
  const auto table = torch::zeros({10});
  // A lookup out of range, on the work items' threads.
  const auto bad =
      mha::fused_score_mod([table](auto s, auto, auto, auto, auto kv) {
        return s + fused::lookup(table, kv);
      });
  EXPECT_THROW_MSG(mha::flex_attention(q, q, q, bad), "fused score_mod threw");
  EXPECT_THROW_MSG(mha::flex_attention(q, q, q, bad), "out of range");
  const auto bad_mask = mha::fused_mask_mod([table](auto, auto, auto, auto kv) {
    return fused::lookup(table, kv) == 0;
  });
  EXPECT_THROW_MSG(
      mha::create_block_mask(bad_mask, c10::nullopt, c10::nullopt, 300, 300),
      "fused mask_mod threw");
  // The same through a Table: the kernels report it after the run of keys.
  const auto bad_table = mha::fused_score_mod(
      [t = fused::Table(table)](auto s, auto, auto, auto, auto kv) {
        return s + fused::lookup(t, kv);
      });
  EXPECT_THROW_MSG(mha::flex_attention(q, q, q, bad_table),
                   "read a mha::fused::Table at an index out of range");
  const auto bad_table_mask = mha::fused_mask_mod(
      [t = fused::Table(table)](auto, auto, auto q_idx, auto) {
        return fused::lookup(t, q_idx) == 0;
      });
  EXPECT_THROW_MSG(mha::create_block_mask(bad_table_mask, c10::nullopt,
                                          c10::nullopt, 300, 300),
                   "fused mask_mod read a mha::fused::Table");
  // An empty Table: an error, not a read past its end.
  const auto empty_table = mha::fused_score_mod(
      [t = fused::Table(torch::zeros({0}))](auto s, auto, auto, auto, auto kv) {
        return s + fused::lookup(t, kv);
      });
  EXPECT_THROW_MSG(mha::flex_attention(q, q, q, empty_table), "out of");
  std::vector<float> row(4, 0.0f);  // the kernel itself, on a row of keys
  EXPECT_THROW_MSG(empty_table.fused()->apply(row.data(), 4, 0, 0, 0, 0),
                   "read a mha::fused::Table at an index out of range");
  // And in backward (the derivative's kernel).
  {
    const auto leaf = q.clone().requires_grad_();
    const auto late =
        mha::fused_score_mod([t = fused::Table(torch::zeros({300}))](
                                 auto s, auto, auto, auto, auto kv) {
          return s + fused::lookup(t, kv);
        });
    EXPECT_NO_THROW(
        std::get<0>(mha::flex_attention(leaf, q, q, late)).sum().backward());
  }
  // A lookup in range after one out of range on the same thread is not
  // blamed for it.
  EXPECT_NEAR(fused::lookup(fused::Table(torch::ones({3})), 5), 1.0, 0.0);
  EXPECT_NO_THROW(mha::flex_attention(
      q, q, q,
      mha::fused_score_mod([t = fused::Table(torch::zeros({300}))](
                               auto s, auto, auto, auto, auto kv) {
        return s + fused::lookup(t, kv);
      })));
  // NaN the mod produces stays visible.
  const auto nan = mha::fused_score_mod([](auto s, auto, auto, auto i, auto) {
    return fused::where(i == 7, s * NAN, s);
  });
  const auto out = std::get<0>(mha::flex_attention(q, q, q, nan));
  EXPECT_TRUE(out[0][0][7].isnan().all().item<bool>());
  EXPECT_FALSE(out[0][0][6].isnan().any().item<bool>());
}

}  // namespace
