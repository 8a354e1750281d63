// mha-bench --variants linear: linear-cost attention (attention_kind
// kLinear, kPerformer, kLinformer) against mha's softmax core, time and
// peak memory for growing lengths, and decoding a token at growing cache
// lengths (bench_tool.h declares it). Asked for by name only: the default
// run (every other table) leaves it out, its long rows take minutes.
//
// Glossary: N batch (1), L sequence length (S = L), E embed_dim, H
// num_heads, D head_dim, P positions held by the cache.
#include <fmt/format.h>
#include <malloc.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "bench/bench_run.h"
#include "bench/bench_tool.h"
#include "core/attention_core.h"  // release_kept_scratch
#include "mha/mha.h"

namespace mha::bench {
namespace {

/// One measured run: milliseconds, and the peak RSS above the RSS before
/// it (MiB; negative when not measured).
struct LinearRun {
  double ms = 0;
  double peak_mib = -1;
};

/// `run` once under a fresh VmHWM (clear_refs) when `memory`, timed.
LinearRun measure_linear_run(const Run& run, const torch::Device& device,
                             bool memory) {
  LinearRun m;
  if (!memory) {
    m.ms = time_once(run, device);
    return m;
  }
  detail::release_kept_scratch();
  malloc_trim(0);
  const int64_t before = proc_status_kib("VmRSS");
  {
    std::ofstream clear_refs("/proc/self/clear_refs");
    clear_refs << "5";
  }
  m.ms = time_once(run, device);
  m.peak_mib = static_cast<double>(proc_status_kib("VmHWM") - before) / 1024.0;
  return m;
}

/// The median of `reps` timed runs after the measured one (whose time
/// counts as one sample).
LinearRun median_linear_run(const Run& run, const torch::Device& device,
                            bool memory, int reps) {
  auto first = measure_linear_run(run, device, memory);
  std::vector<double> samples = {first.ms};
  for (int i = 1; i < reps; ++i) {
    samples.push_back(time_once(run, device));
  }
  first.ms = median_of(samples);
  return first;
}

struct LinearKind {
  std::string name;
  MultiHeadAttention module = nullptr;
  bool causal = true;
  bool quadratic = false;  ///< time grows as L²: skipped past the budget
};

std::string linear_ms_text(double ms) {
  return ms < 0 ? std::string("-") : fmt::format("{:.1f}", ms);
}
std::string linear_mib_text(double mib) {
  return mib < 0 ? std::string("n/a") : fmt::format("{:.1f}", mib);
}

}  // namespace

nlohmann::json linear_table(bool quick, const Settings& settings) {
  const std::vector<int64_t> lengths =
      quick ? std::vector<int64_t>{64, 128}
            : std::vector<int64_t>{1024, 2048, 4096, 8192, 16384, 32768, 65536};
  const std::vector<int64_t> cache_lengths = lengths;
  const int64_t E = quick ? 32 : 256, H = quick ? 2 : 4;
  const int64_t k = quick ? 16 : 256;  // Linformer's projected length
  const int64_t max_length = lengths.back();
  const int decode_steps = quick ? 4 : 16;
  // A run projected past this many seconds is skipped (softmax at long L).
  const double budget_ms = quick ? 1e9 : 90e3;
  const bool memory = settings.device.is_cpu() && clear_refs_writable();
  const auto options =
      torch::TensorOptions().dtype(settings.dtype).device(settings.device);
  torch::manual_seed(settings.seed);
  const auto base = MultiHeadAttentionOptions(E, H);
  std::vector<LinearKind> kinds = {
      {"softmax", MultiHeadAttention(base), true, true},
      {"linear",
       MultiHeadAttention(MultiHeadAttentionOptions(base).attention_kind(
           AttentionKind::kLinear)),
       true, false},
      {"performer",
       MultiHeadAttention(MultiHeadAttentionOptions(base).attention_kind(
           AttentionKind::kPerformer)),
       true, false},
      {"linformer",
       MultiHeadAttention(MultiHeadAttentionOptions(base)
                              .attention_kind(AttentionKind::kLinformer)
                              .projected_length(k)
                              .max_length(max_length)),
       false, false},
  };
  for (auto& kind : kinds) {
    kind.module->to(settings.device, settings.dtype);
    kind.module->eval();
  }
  const int64_t m = kinds[2].module->random_features.size(0);
  fmt::print(
      "\nlinear-cost attention: MultiHeadAttention({}, {}) self-attention, "
      "N = 1, {}; softmax = mha's core, linear (elu + 1), performer (m = {} "
      "features), linformer (k = {}, n = {}; non-causal, the others "
      "causal);\nfwd = inference (no gradient), fwd+bwd = forward and "
      "backward of the sum; peak = RSS above the run's start{}{}\n",
      E, H, c10::toString(settings.dtype), m, k, max_length,
      memory ? "" : " (not measured here)",
      quick ? ""
            : fmt::format("; runs projected past {:.0f} s skipped",
                          budget_ms / 1e3));
  fmt::print("{:<10} {:>6} {:>10} {:>9} {:>11} {:>12}\n", "kind", "L", "fwd ms",
             "fwd MiB", "fwd+bwd ms", "fwd+bwd MiB");
  auto rows = nlohmann::json::array();
  // (kind, L) -> forward ms, for the crossover and growth lines.
  std::map<std::string, std::map<int64_t, LinearRun>> forward, backward;
  for (auto& kind : kinds) {
    double last_ms = 0;
    int64_t last_length = 0;
    for (const auto L : lengths) {
      const double growth =
          static_cast<double>(L) / std::max<int64_t>(last_length, 1);
      const double projected =
          last_length == 0
              ? 0
              : last_ms * (kind.quadratic ? growth * growth : growth);
      if (projected > budget_ms) {
        fmt::print(
            "{:<10} {:>6} {:>10}\n", kind.name, L,
            fmt::format("skipped (~{:.0f} s projected)", projected / 1e3));
        rows.push_back({{"kind", kind.name}, {"L", L}, {"skipped", true}});
        continue;
      }
      auto x = torch::randn({1, L, E}, options);
      auto& module = kind.module;
      const bool causal = kind.causal;
      const Run fwd = [&] {
        torch::NoGradGuard no_grad;
        return Named{{"out", std::get<0>(module->forward(x, {}, {}, {},
                                                         /*need_weights=*/false,
                                                         {}, true, causal))}};
      };
      auto xg = x.detach().requires_grad_();
      const Run fwd_bwd = [&] {
        auto out = std::get<0>(
            module->forward(xg, {}, {}, {}, false, {}, true, causal));
        out.sum().backward();
        return Named{{"grad", xg.grad()}};
      };
      LinearRun f, b;
      try {
        // The first run is cold (its peak measured after malloc_trim):
        // five where they are short, for a median this VM's page faults
        // move less.
        const int reps = last_ms > 2000 ? 1 : last_ms > 500 ? 3 : 5;
        f = median_linear_run(fwd, settings.device, memory, reps);
        b = median_linear_run(fwd_bwd, settings.device, memory, reps);
      } catch (const std::exception& e) {
        fmt::print("{:<10} {:>6} error: {}\n", kind.name, L,
                   std::string(e.what()).substr(0, 80));
        rows.push_back({{"kind", kind.name}, {"L", L}, {"error", e.what()}});
        continue;
      }
      for (auto& p : module->parameters()) {
        p.mutable_grad() = torch::Tensor();
      }
      forward[kind.name][L] = f;
      backward[kind.name][L] = b;
      fmt::print("{:<10} {:>6} {:>10} {:>9} {:>11} {:>12}\n", kind.name, L,
                 linear_ms_text(f.ms), linear_mib_text(f.peak_mib),
                 linear_ms_text(b.ms), linear_mib_text(b.peak_mib));
      std::fflush(stdout);
      rows.push_back({{"kind", kind.name},
                      {"L", L},
                      {"causal", causal},
                      {"forward_ms", f.ms},
                      {"forward_peak_mib", f.peak_mib},
                      {"forward_backward_ms", b.ms},
                      {"forward_backward_peak_mib", b.peak_mib}});
      last_ms = std::max(f.ms, b.ms);
      last_length = L;
    }
  }

  // Where the causal linear kinds overtake softmax (the shortest L from
  // which they are faster at every length both measured), and their
  // growth from 8k (--quick: the first length) to their longest length.
  nlohmann::json summary;
  const int64_t from = quick ? lengths.front() : 8192;
  for (const char* name : {"linear", "performer"}) {
    auto& ours = forward[name];
    auto& theirs = forward["softmax"];
    int64_t crossover = 0;
    for (auto it = lengths.rbegin(); it != lengths.rend(); ++it) {
      if (!ours.count(*it) || !theirs.count(*it)) {
        continue;
      }
      if (ours[*it].ms >= theirs[*it].ms) {
        break;
      }
      crossover = *it;
    }
    const int64_t to = ours.empty() ? 0 : ours.rbegin()->first;
    const auto growth = [&](std::map<int64_t, LinearRun>& by, bool mib) {
      if (!by.count(from) || !by.count(to) || to <= from) {
        return -1.0;
      }
      const double a = mib ? by[from].peak_mib : by[from].ms;
      const double z = mib ? by[to].peak_mib : by[to].ms;
      return a > 0 && z >= 0 ? z / a : -1.0;
    };
    const auto text = [](double x) {
      return x < 0 ? std::string("n/a") : fmt::format("x{:.2f}", x);
    };
    const double tf = growth(forward[name], false);
    const double tb = growth(backward[name], false);
    const double mf = growth(forward[name], true);
    const double mb = growth(backward[name], true);
    fmt::print(
        "{}: causal forward faster than softmax's from L = {} on; L {} -> {} "
        "(x{}): time {} fwd, {} fwd+bwd; peak {} fwd, {} fwd+bwd\n",
        name, crossover > 0 ? std::to_string(crossover) : "-", from, to,
        to > from ? to / from : 0, text(tf), text(tb), text(mf), text(mb));
    summary[name] = {{"crossover_L", crossover},
                     {"growth_from_L", from},
                     {"growth_to_L", to},
                     {"time_growth_forward", tf},
                     {"time_growth_forward_backward", tb},
                     {"peak_growth_forward", mf},
                     {"peak_growth_forward_backward", mb}};
  }

  // Decoding: one token after P positions, median of decode_steps steps.
  // Softmax's cache is filled with random keys and values (no attention
  // computed); the linear kinds' state by a causal prefill of P tokens.
  // Each kind's steps are taken in rounds over every P, the caches kept
  // meanwhile, after untimed steps at each P of a round: on this VM a
  // step's time moves between levels (about 0.12 and 0.19 ms for linear
  // attention, at every P) every few seconds, and the two or three steps
  // of linear attention after softmax's at P = 64k (which streams its
  // 128 MiB cache) took 0.16-0.61 ms. Timed right after softmax's steps,
  // both read as growth with P (x1.29-1.39 in four runs; alternating P =
  // 1k and 64k in one program, the steps cost the same).
  constexpr int kRounds = 4;
  fmt::print(
      "decoding one token (forward_cached, inference) after P cached "
      "positions, ms/token, median of {} steps in {} rounds over every P "
      "(after untimed ones):"
      "\n{:>6} {:>10} {:>10} {:>10}\n",
      decode_steps, kRounds, "P", "softmax", "linear", "performer");
  auto decode_rows = nlohmann::json::array();
  std::map<std::string, std::map<int64_t, double>> per_token;
  torch::NoGradGuard no_grad;
  std::map<int64_t, std::vector<KVCache>> caches;  // P -> one per kind
  for (const auto P : cache_lengths) {
    for (size_t i = 0; i < 3; ++i) {
      auto& kind = kinds[i];
      auto cache =
          kind.module->make_kv_cache(1, P + kRounds + 3 + decode_steps);
      if (cache.is_recurrent()) {
        kind.module->forward_cached(torch::randn({1, P, E}, options), cache);
      } else {
        const int64_t D = E / H;
        cache.append(torch::randn({1, H, P, D}, options),
                     torch::randn({1, H, P, D}, options));
      }
      caches[P].push_back(std::move(cache));
    }
  }
  std::map<int64_t, std::vector<std::vector<double>>> samples;  // P, kind
  for (const auto P : cache_lengths) {
    samples[P].resize(3);
  }
  for (size_t i = 0; i < 3; ++i) {
    for (int round = 0; round < kRounds; ++round) {
      const int steps =
          decode_steps / kRounds + (round < decode_steps % kRounds);
      for (const auto P : cache_lengths) {
        auto& cache = caches[P][i];
        // Untimed: one, four at the kind's first (after another kind's).
        const int untimed = round == 0 && P == cache_lengths.front() ? 4 : 1;
        for (int step = 0; step < untimed; ++step) {
          kinds[i].module->forward_cached(torch::randn({1, 1, E}, options),
                                          cache);
        }
        for (int step = 0; step < steps; ++step) {
          auto token = torch::randn({1, 1, E}, options);
          samples[P][i].push_back(time_once(
              [&] {
                return Named{
                    {"out", std::get<0>(kinds[i].module->forward_cached(
                                token, cache))}};
              },
              settings.device));
        }
      }
    }
  }
  for (const auto P : cache_lengths) {
    nlohmann::json row = {{"P", P}};
    std::vector<std::string> cells;
    for (size_t i = 0; i < 3; ++i) {
      const double ms = median_of(samples[P][i]);
      per_token[kinds[i].name][P] = ms;
      row[kinds[i].name + "_ms"] = ms;
      cells.push_back(fmt::format("{:.3f}", ms));
    }
    fmt::print("{:>6} {:>10} {:>10} {:>10}\n", P, cells[0], cells[1], cells[2]);
    decode_rows.push_back(row);
  }
  const int64_t first = cache_lengths.front(), last = cache_lengths.back();
  fmt::print(
      "decoding at P = {} over P = {}: softmax x{:.2f}, linear x{:.2f}, "
      "performer x{:.2f}\n",
      last, first, per_token["softmax"][last] / per_token["softmax"][first],
      per_token["linear"][last] / per_token["linear"][first],
      per_token["performer"][last] / per_token["performer"][first]);
  std::fflush(stdout);
  return {{"embed_dim", E},         {"num_heads", H}, {"nb_features", m},
          {"projected_length", k},  {"rows", rows},   {"summary", summary},
          {"decoding", decode_rows}};
}

}  // namespace mha::bench
