// mha-bench --variants flex: FlexAttention calls (mha/flex_attention.h)
// against the built-in option that computes the same thing where there is
// one, forward and forward+backward, with the block mask's density and the
// peak memory of each.
//
// Glossary: B batch, H heads, L sequence length (S = L), D head_dim.
#include <fmt/format.h>
#include <torch/torch.h>

#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "bench/bench_run.h"
#include "bench/bench_tool.h"
#include "core/attention_core.h"
#include "mha/flex_attention.h"
#include "mha/positions.h"

namespace mha::bench {
namespace {

/// One call: forward (no gradient) or forward+backward (sum of the output).
struct FlexCase {
  std::string name;
  ScoreMod score_mod;
  BlockMask block_mask;
  /// The built-in call computing the same thing, or empty (no built-in).
  std::function<torch::Tensor(const torch::Tensor&, const torch::Tensor&,
                              const torch::Tensor&)>
      builtin;
};

MaskMod causal() {
  return [](const torch::Tensor&, const torch::Tensor&, const torch::Tensor& q,
            const torch::Tensor& kv) { return q.ge(kv); };
}

/// The cases at length L: causal, a causal window of `window` keys, packed
/// documents (causal), soft-capping + causal, ALiBi + causal; built-ins
/// through the attention core (detail::attention_core, as the modules call
/// it).
std::vector<FlexCase> flex_cases(int64_t L, int64_t H, int64_t window,
                                 int64_t block, const torch::Tensor& lengths) {
  const auto slopes = alibi_slopes(H);
  auto core = [](detail::KeyPositions positions) {
    return [positions](const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v) {
      const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(3)));
      return detail::attention_core(q, k, v, {}, positions, 0.0, scale,
                                    detail::WeightsMode::kNone)
          .output;
    };
  };
  detail::KeyPositions windowed(true);
  windowed.window = window;
  detail::KeyPositions alibi(true);
  // (H, 2L - 1): slope · (j - i), the causal ALiBi bias per diagonal.
  alibi.relative_bias = slopes.unsqueeze(1) *
                        torch::arange(-(L - 1), L, torch::kFloat).unsqueeze(0);
  const auto causal_mask =
      create_block_mask(causal(), c10::nullopt, c10::nullopt, L, L, block);
  MaskMod window_mod = [window](const torch::Tensor&, const torch::Tensor&,
                                const torch::Tensor& q,
                                const torch::Tensor& kv) {
    return q.ge(kv).logical_and(q.sub(kv).lt(window));
  };
  ScoreMod softcap = [](const torch::Tensor& s, const torch::Tensor&,
                        const torch::Tensor&, const torch::Tensor&,
                        const torch::Tensor&) {
    return 30.0 * torch::tanh(s / 30.0);
  };
  ScoreMod alibi_mod = [slopes](const torch::Tensor& s, const torch::Tensor&,
                                const torch::Tensor& h, const torch::Tensor& q,
                                const torch::Tensor& kv) {
    return s + slopes.index({h}) * (kv - q).to(s.scalar_type());
  };
  // The same mods fused (compiled into the tile loop, flex_attention.h).
  const auto fused_causal = create_block_mask(
      fused_mask_mod([](auto, auto, auto q, auto kv) { return q >= kv; }),
      c10::nullopt, c10::nullopt, L, L, block);
  const auto fused_window =
      create_block_mask(fused_mask_mod([window](auto, auto, auto q, auto kv) {
                          return (q >= kv) & (q - kv < window);
                        }),
                        c10::nullopt, c10::nullopt, L, L, block);
  const auto fused_softcap = fused_score_mod(
      [](auto s, auto, auto, auto, auto) { return 30 * fused::tanh(s / 30); });
  const auto fused_alibi = fused_score_mod(
      [table = fused::Table(slopes)](auto s, auto, auto h, auto q, auto kv) {
        return s + fused::lookup(table, h) * (kv - q);
      });
  return {
      {"causal", {}, causal_mask, core(detail::KeyPositions(true))},
      {"causal, fused", {}, fused_causal, core(detail::KeyPositions(true))},
      {"window " + std::to_string(window),
       {},
       create_block_mask(window_mod, c10::nullopt, c10::nullopt, L, L, block),
       core(windowed)},
      {"window " + std::to_string(window) + ", fused",
       {},
       fused_window,
       core(windowed)},
      // document_mask is a fused mask.
      {std::to_string(lengths.size(0)) + " documents, causal",
       {},
       create_document_block_mask(lengths, true, block),
       {}},
      {"soft-cap 30 + causal", softcap, causal_mask, {}},
      {"soft-cap, fused", fused_softcap, fused_causal, {}},
      {"ALiBi + causal", alibi_mod, causal_mask, core(alibi)},
      {"ALiBi, fused", fused_alibi, fused_causal, core(alibi)},
  };
}

/// Random document lengths summing to L (seeded).
torch::Tensor document_lengths(int64_t L, int64_t documents) {
  auto cuts = std::get<0>(torch::randperm(L - 1, torch::kLong)
                              .narrow(0, 0, documents - 1)
                              .add(1)
                              .sort());
  auto bounds = torch::cat({torch::zeros({1}, torch::kLong), cuts,
                            torch::full({1}, L, torch::kLong)});
  return bounds.narrow(0, 1, documents) - bounds.narrow(0, 0, documents);
}

}  // namespace

nlohmann::json flex_table(bool quick, const Settings& settings) {
  const std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{256}
            : std::vector<int64_t>{1024, 4096, 16384};
  const int64_t H = quick ? 2 : 8, D = quick ? 16 : 64;
  const int64_t window = quick ? 32 : 256, block = quick ? 64 : 128;
  const int reps = quick ? 1 : 5;
  fmt::print(
      "\nflex: flex_attention at (1, {}, L, {}), {}, block {}; built-in: the "
      "attention core with the same option (mha's modules' call); median of "
      "{} runs, flex and built-in interleaved; fwd = forward without gradient, "
      "fwd+bwd = forward and "
      "backward of sum(output); density = visited blocks / all; ratio = flex "
      "/ built-in, or for rows without one flex / (density x built-in "
      "causal) (documents, density relative to causal's) or flex / built-in "
      "causal; max diff: |flex - built-in| of the forward outputs\n",
      H, D, c10::toString(settings.dtype), block, reps);
  fmt::print(
      "{:>6} {:<22} {:>7} {:>10} {:>10} {:>6} {:>10} {:>10} {:>6} {:>9} "
      "{:>9} {:>9}\n",
      "L", "case", "density", "fwd ms", "builtin", "ratio", "f+b ms", "builtin",
      "ratio", "peak MiB", "builtin", "max diff");
  auto json = nlohmann::json::array();
  const auto options = torch::TensorOptions().dtype(settings.dtype);
  for (const auto L : lengths) {
    torch::manual_seed(settings.seed);
    auto q = torch::randn({1, H, L, D}, options);
    auto k = torch::randn({1, H, L, D}, options);
    auto v = torch::randn({1, H, L, D}, options);
    const auto docs = document_lengths(L, 7);
    double causal_fwd = 0, causal_fb = 0, causal_density = 1;
    for (const auto& c : flex_cases(L, H, window, block, docs)) {
      auto call = [&](bool flex, bool backward) -> Run {
        return [&, flex, backward] {
          torch::Tensor qq = q, kk = k, vv = v;
          if (backward) {
            qq = q.detach().requires_grad_();
            kk = k.detach().requires_grad_();
            vv = v.detach().requires_grad_();
          }
          torch::AutoGradMode grad(backward);
          auto out = flex ? std::get<0>(flex_attention(qq, kk, vv, c.score_mod,
                                                       c.block_mask))
                          : c.builtin(qq, kk, vv);
          if (backward) {
            out.sum().backward();
            return Named{{"output", out.detach()}, {"dq", qq.grad()}};
          }
          return Named{{"output", out}};
        };
      };
      // The medians of `flex` and of `builtin` (where not null), their runs
      // interleaved (flex, built-in, flex, ...) after one untimed run of
      // each, so that the machine's drift reaches both alike.
      auto medians = [&](const Run& flex,
                         const Run* builtin) -> std::pair<double, double> {
        time_once(flex, settings.device);
        if (builtin != nullptr) {
          time_once(*builtin, settings.device);
        }
        std::vector<double> t_flex, t_builtin;
        for (int i = 0; i < reps; ++i) {
          t_flex.push_back(time_once(flex, settings.device));
          if (builtin != nullptr) {
            t_builtin.push_back(time_once(*builtin, settings.device));
          }
        }
        return {median_of(t_flex),
                builtin != nullptr ? median_of(t_builtin) : NAN};
      };
      auto peak_mib = [&](const Run& run) {
        int64_t kib = 0;
        measure_in_process(run, settings.device, kib);
        return static_cast<double>(kib) / 1024.0;
      };
      const double density = 1.0 - c.block_mask.sparsity() / 100.0;
      const Run builtin_fwd = call(false, false),
                builtin_fb = call(false, true);
      const auto* has_builtin_fwd = c.builtin ? &builtin_fwd : nullptr;
      const auto* has_builtin_fb = c.builtin ? &builtin_fb : nullptr;
      const auto [fwd, b_fwd] = medians(call(true, false), has_builtin_fwd);
      const auto [fb, b_fb] = medians(call(true, true), has_builtin_fb);
      const double peak = peak_mib(call(true, true));
      double b_peak = NAN, diff = NAN;
      if (c.builtin) {
        // The two compute the same: their outputs agree to rounding.
        const auto flex_out = call(true, false)()[0].second;
        const auto builtin_out = builtin_fwd()[0].second;
        diff = (flex_out - builtin_out).abs().max().item<double>();
        b_peak = peak_mib(builtin_fb);
      }
      if (c.name == "causal") {
        causal_fwd = b_fwd;
        causal_fb = b_fb;
        causal_density = density;
      }
      // Without a built-in: against the built-in causal call's time scaled
      // by the density relative to causal's (the documents' target), or the
      // causal call itself (soft-capping's).
      const bool documents = c.name.find("documents") != std::string::npos;
      const double ratio_fwd =
          c.builtin   ? fwd / b_fwd
          : documents ? fwd / (density / causal_density * causal_fwd)
                      : fwd / causal_fwd;
      const double ratio_fb = c.builtin ? fb / b_fb
                              : documents
                                  ? fb / (density / causal_density * causal_fb)
                                  : fb / causal_fb;
      fmt::print(
          "{:>6} {:<22} {:>7.3f} {:>10.2f} {:>10.2f} {:>6.2f} {:>10.2f} "
          "{:>10.2f} {:>6.2f} {:>9.1f} {:>9.1f} {:>9.1e}\n",
          L, c.name, density, fwd, c.builtin ? b_fwd : causal_fwd, ratio_fwd,
          fb, c.builtin ? b_fb : causal_fb, ratio_fb, peak, b_peak, diff);
      std::fflush(stdout);
      json.push_back({{"L", L},
                      {"case", c.name},
                      {"density", density},
                      {"flex_fwd_ms", fwd},
                      {"flex_fwd_bwd_ms", fb},
                      {"flex_peak_mib", peak},
                      {"builtin_fwd_ms", c.builtin ? b_fwd : -1.0},
                      {"builtin_fwd_bwd_ms", c.builtin ? b_fb : -1.0},
                      {"builtin_peak_mib", c.builtin ? b_peak : -1.0},
                      {"ratio_fwd", ratio_fwd},
                      {"max_abs_diff", c.builtin ? diff : -1.0},
                      {"ratio_fwd_bwd", ratio_fb}});
    }
  }
  return json;
}

}  // namespace mha::bench
