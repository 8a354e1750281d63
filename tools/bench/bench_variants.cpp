// mha-bench's measurements beside the comparison table: the GEMM ceiling,
// the sliding window's cost, torch::nn's projections alone, and generation
// with and without a KV cache (bench.h declares them; bench_report.cpp
// prints them).
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#include <algorithm>
#include <vector>

#include "bench/bench.h"
#include "bench/bench_run.h"
#include "core/blas_gemm.h"
#include "core/blocked_attention.h"  // onednn_products_available
#include "mha/mha.h"
#include "mha/train.h"

namespace mha::bench {

Gemm measure_gemm(int64_t n, int reps, const Settings& settings) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(settings.seed);
  const auto options =
      torch::TensorOptions().dtype(settings.dtype).device(settings.device);
  auto a = torch::randn({n, n}, options);
  auto b = torch::randn({n, n}, options);
  // Median ms of `reps` runs after one warm-up.
  const auto median_ms = [&](const Run& run) {
    time_once(run, settings.device);
    std::vector<double> samples;
    for (int i = 0; i < reps; ++i) {
      samples.push_back(time_once(run, settings.device));
    }
    return median_of(samples);
  };
  const double flops = 2.0 * static_cast<double>(n) * static_cast<double>(n) *
                       static_cast<double>(n);
  Gemm g;
  g.n = n;
  g.reps = reps;
  g.median_ms = median_ms([&] { return Named{{"c", torch::mm(a, b)}}; });
  g.gflops = flops / (g.median_ms * 1e-3) / 1e9;
  if (settings.device.is_cpu() && settings.dtype == torch::kFloat32 &&
      detail::onednn_products_available()) {
    // Outside a parallel region dnnl_sgemm runs on the calling thread's
    // OpenMP team: ATen's intra-op threads, as torch::mm's BLAS does.
    auto c = torch::empty({n, n}, options);
    g.onednn_median_ms = median_ms([&] {
      TORCH_CHECK(
          detail::onednn_gemm_matrix(detail::matrix_of(a), detail::matrix_of(b),
                                     1.0, 0.0, detail::matrix_of(c)),
          "mha-bench: oneDNN's dnnl_sgemm refused a ", n, " x ", n, " product");
      return Named{{"c", c}};
    });
    g.onednn_gflops = flops / (g.onednn_median_ms * 1e-3) / 1e9;
  }
  return g;
}

std::vector<WindowRow> measure_window(const std::vector<int64_t>& lengths,
                                      int64_t window, int64_t embed_dim,
                                      int64_t num_heads, int reps,
                                      const Settings& settings) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(settings.seed);
  const auto options =
      torch::TensorOptions().dtype(settings.dtype).device(settings.device);
  MultiHeadAttention full(MultiHeadAttentionOptions(embed_dim, num_heads));
  MultiHeadAttention windowed(
      MultiHeadAttentionOptions(embed_dim, num_heads).window(window));
  for (auto* m : {&full, &windowed}) {
    (*m)->to(settings.device, settings.dtype);
    (*m)->eval();
  }
  std::vector<WindowRow> rows;
  for (const auto length : lengths) {
    auto x = torch::randn({1, length, embed_dim}, options);
    auto run_with = [&](MultiHeadAttention& m) -> Run {
      return [&m, &x] {
        return Named{{"output", std::get<0>(m->forward(x, {}, {}, {}, false, {},
                                                       true, true))}};
      };
    };
    const auto run_windowed = run_with(windowed), run_full = run_with(full);
    time_once(run_windowed, settings.device);
    time_once(run_full, settings.device);
    std::vector<double> w, f;
    for (int i = 0; i < reps; ++i) {
      w.push_back(time_once(run_windowed, settings.device));
      f.push_back(time_once(run_full, settings.device));
    }
    rows.push_back({length, window, median_of(w), median_of(f)});
  }
  return rows;
}

std::vector<ProjectionRow> measure_projections(const std::vector<Shape>& shapes,
                                               const std::vector<Mode>& modes,
                                               const Settings& settings) {
  std::vector<ProjectionRow> rows;
  for (const auto& shape : shapes) {
    for (const auto mode : modes) {
      if (mode == Mode::kEncoder) {
        continue;
      }
      const auto c = make_contenders(shape, mode, settings);
      const std::vector<const Run*> runs = {&c.projections, &c.torch_nn, &c.mha,
                                            &c.mha_projections};
      double round_ms = 0;
      for (const auto* run : runs) {
        round_ms += time_once(*run, settings.device);
      }
      int reps = settings.reps;
      if (reps <= 0) {
        const double fit =
            settings.budget_s * 1000.0 / std::max(round_ms, 1e-3);
        reps = static_cast<int>(
            std::clamp(std::floor(fit), static_cast<double>(settings.min_reps),
                       static_cast<double>(settings.max_reps)));
      }
      std::vector<std::vector<double>> samples(runs.size());
      for (int i = 0; i < reps; ++i) {
        for (size_t r = 0; r < runs.size(); ++r) {
          samples[r].push_back(time_once(*runs[r], settings.device));
        }
      }
      rows.push_back({shape, mode, reps, median_of(samples[0]),
                      median_of(samples[3]), median_of(samples[1]),
                      median_of(samples[2])});
    }
  }
  return rows;
}

Generation measure_generation(int64_t prompt, int64_t new_tokens, int reps,
                              uint64_t seed) {
  torch::manual_seed(seed);
  train::CharLM lm(train::CharLMOptions(/*vocab_size=*/65, /*block_size=*/64));
  auto prompt_ids = torch::randint(65, {prompt});
  const auto greedy = train::SamplingOptions().top_k(1);
  Generation g;
  g.prompt = prompt;
  g.new_tokens = new_tokens;
  g.reps = reps;
  std::vector<double> cached, recomputed;
  torch::Tensor cached_ids, recomputed_ids;
  auto seconds = [&](bool use_cache, torch::Tensor& ids) {
    const auto start = std::chrono::steady_clock::now();
    ids = train::generate(lm, prompt_ids, new_tokens, greedy, use_cache);
    return std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                         start)
        .count();
  };
  for (int i = 0; i < reps; ++i) {
    cached.push_back(seconds(true, cached_ids));
    recomputed.push_back(seconds(false, recomputed_ids));
  }
  g.cached_s = median_of(cached);
  g.recomputed_s = median_of(recomputed);
  g.identical = torch::equal(cached_ids, recomputed_ids);
  return g;
}

}  // namespace mha::bench
