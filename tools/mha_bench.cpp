// mha-bench: times mha against torch::nn on the same weights and inputs, in
// one process, after checking that both compute the same results.
// Exit status: 0 ok, 1 a failure (results differ, or a contender threw
// something other than out-of-memory), 2 bad usage.
#include <fmt/core.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench.h"
#include "mha/version.h"
#include "tool_common.h"

namespace {

using mha::bench::ContenderResult;
using mha::bench::MemoryMethod;
using mha::bench::Mode;
using mha::bench::RowResult;
using mha::bench::Shape;

const std::map<std::string, torch::ScalarType> kDtypes = {
    {"float32", torch::kFloat32},
    {"float64", torch::kFloat64},
    {"bfloat16", torch::kBFloat16}};

const std::vector<Shape> kDefaultShapes = {{2, 128, 256, 4},
                                           {8, 256, 512, 8},
                                           {4, 1024, 512, 8},
                                           {1, 4096, 512, 8},
                                           {1, 8192, 256, 4}};
const std::vector<Shape> kQuickShapes = {{2, 16, 32, 4}, {1, 32, 16, 2}};

/// One table row (a constant: fmt checks format strings at compile time
/// in C++20).
constexpr char kRowFormat[] =
    "{:<16} {:<12} {:>4} {:>26} {:>26} {:>6} {:>8} {:>8} {:>9} {:>9} {:>6}  "
    "{}\n";

/// Set in the environment across tune_runtime_environment's re-execution.
constexpr const char* kReexecMarker = "MHA_BENCH_REEXECUTED";

std::string self_executable() {
  std::vector<char> buffer(4096);
  const ssize_t n = readlink("/proc/self/exe", buffer.data(), buffer.size());
  if (n <= 0 || static_cast<size_t>(n) >= buffer.size()) {
    return "/proc/self/exe";
  }
  return std::string(buffer.data(), static_cast<size_t>(n));
}

std::string format_ms(double ms) {
  if (ms < 10) {
    return fmt::format("{:.3f}", ms);
  }
  if (ms < 1000) {
    return fmt::format("{:.1f}", ms);
  }
  return fmt::format("{:.0f}", ms);
}

/// "12.345 [12.001-13.2]", or the status when the contender did not run.
std::string format_time(const ContenderResult& r) {
  if (r.status != "ok") {
    return r.status;
  }
  return fmt::format("{} [{}-{}]", format_ms(r.time_ms.median),
                     format_ms(r.time_ms.min), format_ms(r.time_ms.max));
}

std::string format_optional(const std::optional<double>& v,
                            const char* missing = "-") {
  return v ? fmt::format("{:.2f}", *v) : missing;
}

std::string format_memory(const ContenderResult& r, MemoryMethod method) {
  if (method == MemoryMethod::kNone) {
    return "n/a";
  }
  return r.peak_mib ? fmt::format("{:.1f}", *r.peak_mib) : r.status;
}

std::string format_check(const mha::bench::Check& c) {
  if (!c.done) {
    return "unchecked";
  }
  if (c.passed) {
    return fmt::format("ok {:.0e}", c.max_rel);
  }
  return fmt::format("FAIL {} {:.1e}", c.worst, c.max_rel);
}

nlohmann::json to_json(const ContenderResult& r) {
  nlohmann::json j;
  j["status"] = r.status;
  if (!r.error.empty()) {
    j["error"] = r.error;
  }
  if (r.status == "ok") {
    const auto& t = r.time_ms;
    j["median_ms"] = t.median;
    j["min_ms"] = t.min;
    j["max_ms"] = t.max;
    j["q1_ms"] = t.q1;
    j["q3_ms"] = t.q3;
    j["samples_ms"] = t.samples;
    j["gflops"] = r.gflops;
  }
  j["peak_mib"] = r.peak_mib ? nlohmann::json(*r.peak_mib) : nullptr;
  return j;
}

nlohmann::json to_json(const RowResult& row) {
  const auto& s = row.shape;
  nlohmann::json j;
  j["config"] = {{"N", s.batch},
                 {"L", s.length},
                 {"S", s.length},
                 {"E", s.embed_dim},
                 {"H", s.num_heads}};
  if (row.mode == Mode::kEncoder) {
    j["config"]["F"] = 4 * s.embed_dim;
  }
  j["mode"] = mha::bench::name(row.mode);
  j["flops"] = static_cast<int64_t>(row.flops);
  j["warmup"] = row.warmup;
  j["reps"] = row.reps;
  const auto& c = row.check;
  j["check"] = {{"done", c.done},       {"passed", c.passed},
                {"max_abs", c.max_abs}, {"max_rel", c.max_rel},
                {"worst", c.worst},     {"compared", c.compared},
                {"atol", c.atol},       {"rtol", c.rtol}};
  j["mha"] = to_json(row.mha);
  j["torch_nn"] = to_json(row.torch_nn);
  j["ratio"] = row.ratio ? nlohmann::json(*row.ratio) : nullptr;
  j["memory_ratio"] =
      row.memory_ratio ? nlohmann::json(*row.memory_ratio) : nullptr;
  return j;
}

/// The child of MemoryMethod::kFork: prints "peak_kib <n>"; exit 3 on OOM.
int memory_child(const std::string& spec,
                 const mha::bench::Settings& settings) {
  const auto first = spec.find(':');
  const auto second = spec.find(':', first + 1);
  std::string error;
  auto shape = mha::bench::parse_shape(spec.substr(0, first), error);
  auto mode =
      mha::bench::parse_mode(spec.substr(first + 1, second - first - 1));
  if (first == std::string::npos || second == std::string::npos || !shape ||
      !mode) {
    fmt::print(stderr, "mha-bench: --memory-child {}: bad spec {}\n", spec,
               error);
    return 2;
  }
  try {
    const auto kib = mha::bench::child_peak_kib(
        *shape, *mode, spec.substr(second + 1), settings);
    fmt::print("peak_kib {}\n", kib);
    return 0;
  } catch (const std::exception& e) {
    if (mha::bench::is_out_of_memory(e)) {
      return 3;
    }
    fmt::print(stderr, "mha-bench: --memory-child {}: {}\n", spec, e.what());
    return 1;
  }
}

double geometric_mean(const std::vector<double>& v) {
  double log_sum = 0;
  for (double x : v) {
    log_sum += std::log(x);
  }
  return std::exp(log_sum / static_cast<double>(v.size()));
}

}  // namespace

int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  const std::string runtime_note =
      mha::tools::tune_runtime_environment(argv, kReexecMarker);

  CLI::App app{
      "mha-bench: times mha against torch::nn (MultiheadAttention, "
      "TransformerEncoderLayer) on the same weights and inputs, after "
      "checking they agree. Exit 0: ok; 1: results differ or a contender "
      "failed; 2: bad usage."};
  std::string json_path;
  bool quick = false;
  std::vector<std::string> config_texts;
  std::vector<std::string> mode_texts;
  int reps = 0;
  int warmup = 1;
  int threads = 2;
  double budget_s = 2.0;
  int64_t gemm_size = 2048;
  std::string device_name = "cpu";
  std::string dtype_name = "float32";
  std::string memory_name = "auto";
  uint64_t seed = 0;
  std::string memory_child_spec;
  bool plant_fault = false;

  std::string mode_names;
  for (auto m : mha::bench::all_modes()) {
    mode_names +=
        std::string(mode_names.empty() ? "" : ", ") + mha::bench::name(m);
  }
  app.add_option("--json", json_path, "also write the report as JSON");
  app.add_flag("--quick", quick,
               "tiny sizes, 3 repetitions, 256^3 GEMM: seconds (for tests)");
  app.add_option("--config", config_texts,
                 "N,L,E,H (repeatable); default: 2,128,256,4 8,256,512,8 "
                 "4,1024,512,8 1,4096,512,8 1,8192,256,4");
  app.add_option("--mode", mode_texts,
                 "modes to run (repeatable or comma-separated): " + mode_names +
                     "; default: all")
      ->delimiter(',')
      ->check(CLI::IsMember(
          {"fwd", "fwd-weights", "causal", "fwd-bwd", "inference", "encoder"}));
  app.add_option("--reps", reps,
                 "timed repetitions per contender; 0 (default): as many as "
                 "fit in --budget, 3 to 31")
      ->check(CLI::Range(0, 100000));
  app.add_option("--budget", budget_s,
                 "seconds of timed repetitions per row when --reps is 0")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", warmup,
                 "untimed runs per contender before timing, at least 1 (the "
                 "first measures peak memory and its results are compared)")
      ->check(CLI::Range(1, 1000));
  app.add_option("--threads", threads,
                 "at::set_num_threads for both contenders (default 2)")
      ->check(CLI::Range(1, 4096));
  app.add_option("--device", device_name, "cpu or cuda")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype_name, "float32, float64 or bfloat16")
      ->check(CLI::IsMember({"float32", "float64", "bfloat16"}));
  app.add_option("--seed", seed, "random seed of weights and inputs");
  app.add_option("--gemm-size", gemm_size,
                 "n of the n^3 torch::mm that measures the GEMM ceiling")
      ->check(CLI::Range(int64_t{1}, int64_t{65536}));
  app.add_option("--memory", memory_name,
                 "peak memory: auto (clear_refs if writable, else fork), "
                 "clear_refs (in process) or fork (a child per measurement)")
      ->check(CLI::IsMember({"auto", "clear_refs", "fork"}));
  std::vector<std::string> variant_texts;
  app.add_option("--variants", variant_texts,
                 "tables after the comparison (repeatable or "
                 "comma-separated): window (causal cost with and without a "
                 "256-key sliding window, L = 1024..8192), generation "
                 "(mha-train's default char LM, 256 characters after a "
                 "256-character prompt, KV cache vs recomputation), none; "
                 "default: both")
      ->delimiter(',')
      ->check(CLI::IsMember({"window", "generation", "none"}));
  app.add_option("--memory-child", memory_child_spec)->group("");
  app.add_flag("--plant-fault", plant_fault,
               "self-test: shift one bias of mha's copy (checks FAIL)")
      ->group("");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e);  // --help
    }
    fmt::print(stderr, "mha-bench: {} (see --help)\n", e.what());
    return 2;
  }

  std::vector<Shape> shapes = quick ? kQuickShapes : kDefaultShapes;
  if (!config_texts.empty()) {
    shapes.clear();
    for (const auto& text : config_texts) {
      std::string error;
      auto shape = mha::bench::parse_shape(text, error);
      if (!shape) {
        fmt::print(stderr, "mha-bench: {}\n", error);
        return 2;
      }
      shapes.push_back(*shape);
    }
  }
  std::vector<Mode> modes;
  for (auto m : mha::bench::all_modes()) {
    if (mode_texts.empty() ||
        std::find(mode_texts.begin(), mode_texts.end(), mha::bench::name(m)) !=
            mode_texts.end()) {
      modes.push_back(m);
    }
  }

  const bool cuda = device_name == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    fmt::print(stderr,
               "mha-bench: --device cuda: CUDA is not available (LibTorch {} "
               "built without CUDA, or no GPU)\n",
               mha::torch_version());
    return 2;
  }
  std::ofstream json_file;
  if (!json_path.empty()) {
    json_file.open(json_path);
    if (!json_file) {
      fmt::print(stderr, "mha-bench: --json {}: cannot write the file\n",
                 json_path);
      return 2;
    }
  }
  at::set_num_threads(threads);

  mha::bench::Settings settings;
  settings.device = torch::Device(cuda ? torch::kCUDA : torch::kCPU);
  settings.dtype = kDtypes.at(dtype_name);
  settings.warmup = warmup;
  settings.reps = quick && reps == 0 ? 3 : reps;
  settings.budget_s = budget_s;
  settings.seed = seed;
  settings.plant_fault = plant_fault;
  settings.child_command = {self_executable(),
                            "--device",
                            device_name,
                            "--dtype",
                            dtype_name,
                            "--threads",
                            std::to_string(threads),
                            "--seed",
                            std::to_string(seed)};
  if (cuda) {
    settings.memory = MemoryMethod::kNone;
  } else if (memory_name == "fork") {
    settings.memory = MemoryMethod::kFork;
  } else if (mha::bench::clear_refs_writable()) {
    settings.memory = MemoryMethod::kClearRefs;
  } else if (memory_name == "clear_refs") {
    fmt::print(stderr,
               "mha-bench: --memory clear_refs: /proc/self/clear_refs is not "
               "writable here (use --memory fork)\n");
    return 2;
  } else {
    settings.memory = MemoryMethod::kFork;
  }

  if (!memory_child_spec.empty()) {
    return memory_child(memory_child_spec, settings);
  }

  // The machine, the libraries and the settings, then the GEMM ceiling.
  const auto blas = mha::tools::loaded_blas();
  const auto openblas = mha::tools::openblas_info();
  const std::string openblas_threads =
      openblas ? fmt::format("{}", openblas->num_threads) : "n/a";
  const auto cpu = mha::tools::cpu_model();
  const int online = mha::tools::online_cpus();
  const int usable = mha::tools::usable_cpus();
  const std::string wait_policy = mha::tools::env_or_unset("OMP_WAIT_POLICY");
  const std::string omp_threads = mha::tools::env_or_unset("OMP_NUM_THREADS");
  const std::string blas_threads_env =
      mha::tools::env_or_unset("OPENBLAS_NUM_THREADS");
  const std::string memory_text =
      settings.memory == MemoryMethod::kClearRefs
          ? "peak RSS in process: \"5\" to /proc/self/clear_refs, one run, "
            "VmHWM minus VmRSS before the run (after malloc_trim)"
      : settings.memory == MemoryMethod::kFork
          ? "peak RSS of a fresh child process per measurement (fork+exec): "
            "VmHWM after one (first) run minus VmRSS before it"
          : "not measured on CUDA (host RSS does not show device memory)";
  const std::string reps_text =
      settings.reps > 0
          ? fmt::format("{} timed per contender", settings.reps)
          : fmt::format("auto: as many as fit in {} s per row, {} to {}",
                        settings.budget_s, settings.min_reps,
                        settings.max_reps);
  const int64_t gemm_n =
      quick && app.count("--gemm-size") == 0 ? 256 : gemm_size;

  fmt::print(
      "mha-bench: mha vs torch::nn, same weights and inputs, one "
      "process\n");
  fmt::print("CPU:       {}, {} online, {} usable by this process\n", cpu,
             online, usable);
  const std::string openblas_core = mha::tools::openblas_core();
  const std::string coretype = mha::tools::env_or_unset("OPENBLAS_CORETYPE");
  const auto source = [&](const char* variable) {
    return runtime_note.find(variable) != std::string::npos
               ? "set by mha-bench"
               : "from the environment";
  };
  fmt::print(
      "BLAS:      {}{}\n", blas,
      openblas
          ? fmt::format(" ({}, {} threads, kernels {}; "
                        "OPENBLAS_CORETYPE {}{})",
                        openblas->config, openblas->num_threads, openblas_core,
                        coretype,
                        coretype == "unset"
                            ? ""
                            : fmt::format(" ({})", source("OPENBLAS_CORETYPE")))
          : "");
  fmt::print("LibTorch:  {}, device {}, dtype {}\n", mha::torch_version(),
             device_name, dtype_name);
  fmt::print(
      "Threads:   at::get_num_threads() = {}; OMP_WAIT_POLICY={} ({}); "
      "OMP_NUM_THREADS {}; OPENBLAS_NUM_THREADS {} (OpenBLAS uses {})\n",
      at::get_num_threads(), wait_policy, source("OMP_WAIT_POLICY"),
      omp_threads, blas_threads_env, openblas_threads);
  std::fflush(stdout);
  const auto gemm = mha::bench::measure_gemm(gemm_n, /*reps=*/5, settings);
  fmt::print(
      "GEMM:      {}^3 torch::mm in {}: {:.1f} GFLOP/s (median of {}, "
      "{:.1f} ms): the ceiling\n",
      gemm.n, dtype_name, gemm.gflops, gemm.reps, gemm.median_ms);
  fmt::print("Memory:    {}\n", memory_text);
  fmt::print(
      "Runs:      per row {} untimed per contender (the first measures peak "
      "memory and its results are compared), then {},\n           "
      "interleaved mha, torch::nn, mha, torch::nn, ... (after a discarded "
      "warm-up of each mode at (1,8,8,2))\n\n",
      std::max(warmup, 1), reps_text);

  fmt::print(kRowFormat, "", "", "", "mha ms", "torch::nn ms", "ratio", "mha",
             "nn", "mha peak", "nn peak", "mem", "");
  fmt::print(kRowFormat, "config N,L,E,H", "mode", "reps", "median [min-max]",
             "median [min-max]", "mha/nn", "GFLOP/s", "GFLOP/s", "MiB", "MiB",
             "mha/nn", "check (max rel err)");
  std::fflush(stdout);

  // Process warm-up, discarded: one-time costs (OpenMP and autograd worker
  // threads, first allocations) must not land in the first row's numbers.
  {
    auto warm = settings;
    warm.memory = MemoryMethod::kNone;
    warm.reps = 1;
    warm.warmup = 1;
    for (auto mode : modes) {
      mha::bench::run_row({1, 8, 8, 2}, mode, warm);
    }
  }

  std::vector<RowResult> rows;
  nlohmann::json json_rows = nlohmann::json::array();
  for (const auto& shape : shapes) {
    for (auto mode : modes) {
      auto row = mha::bench::run_row(shape, mode, settings);
      fmt::print(
          kRowFormat, mha::bench::to_string(shape), mha::bench::name(mode),
          row.reps, format_time(row.mha), format_time(row.torch_nn),
          format_optional(row.ratio),
          row.mha.status == "ok" ? fmt::format("{:.1f}", row.mha.gflops) : "-",
          row.torch_nn.status == "ok"
              ? fmt::format("{:.1f}", row.torch_nn.gflops)
              : "-",
          format_memory(row.mha, settings.memory),
          format_memory(row.torch_nn, settings.memory),
          format_optional(row.memory_ratio), format_check(row.check));
      for (const auto* r : {&row.mha, &row.torch_nn}) {
        if (r->status == "error" || r->status == "OOM") {
          fmt::print("  {} {}: {}\n", r == &row.mha ? "mha" : "torch::nn",
                     r->status, r->error);
        }
      }
      std::fflush(stdout);
      json_rows.push_back(to_json(row));
      rows.push_back(std::move(row));
    }
  }

  // The attention variants' tables: not comparisons with torch::nn.
  auto wants = [&](const char* variant) {
    return variant_texts.empty()
               ? true
               : std::find(variant_texts.begin(), variant_texts.end(),
                           variant) != variant_texts.end();
  };
  nlohmann::json window_json = nullptr, generation_json = nullptr;
  bool generation_differs = false;
  if (wants("window")) {
    const std::vector<int64_t> lengths =
        quick ? std::vector<int64_t>{128, 256}
              : std::vector<int64_t>{1024, 2048, 4096, 8192};
    const int64_t window = quick ? 32 : 256;
    const int window_reps = quick ? 2 : 5;
    fmt::print(
        "\nsliding window: MultiHeadAttention({}, {}) causal, N = 1, "
        "inference, window {} vs none; median of {} runs each\n",
        quick ? 32 : 256, quick ? 2 : 4, window, window_reps);
    fmt::print("{:>6} {:>12} {:>14} {:>12} {:>14} {:>7}\n", "L", "window ms",
               "window us/tok", "full ms", "full us/tok", "ratio");
    window_json = nlohmann::json::array();
    for (const auto& r :
         mha::bench::measure_window(lengths, window, quick ? 32 : 256,
                                    quick ? 2 : 4, window_reps, settings)) {
      const double per_token = 1e3 / static_cast<double>(r.length);
      fmt::print("{:>6} {:>12.2f} {:>14.2f} {:>12.2f} {:>14.2f} {:>7.2f}\n",
                 r.length, r.windowed_ms, r.windowed_ms * per_token, r.full_ms,
                 r.full_ms * per_token, r.windowed_ms / r.full_ms);
      window_json.push_back({{"L", r.length},
                             {"window", r.window},
                             {"windowed_ms", r.windowed_ms},
                             {"full_ms", r.full_ms}});
    }
    std::fflush(stdout);
  }
  if (wants("generation") && !cuda) {
    const int64_t prompt = quick ? 32 : 256, new_tokens = quick ? 32 : 256;
    const int generation_reps = quick ? 1 : 3;
    const auto g = mha::bench::measure_generation(prompt, new_tokens,
                                                  generation_reps, seed);
    generation_differs = !g.identical;
    fmt::print(
        "\ngeneration: mha-train's default char LM (random weights), {} "
        "greedy characters after a {}-character prompt, median of {} runs\n"
        "  KV cache: {:.3f} s ({:.0f} tokens/s); recomputed every step: "
        "{:.3f} s ({:.0f} tokens/s); speedup {:.1f}x; same characters: "
        "{}\n",
        new_tokens, prompt, generation_reps, g.cached_s,
        static_cast<double>(new_tokens) / g.cached_s, g.recomputed_s,
        static_cast<double>(new_tokens) / g.recomputed_s,
        g.recomputed_s / g.cached_s, g.identical ? "yes" : "NO");
    generation_json = {{"prompt", g.prompt},
                       {"new_tokens", g.new_tokens},
                       {"reps", g.reps},
                       {"cached_s", g.cached_s},
                       {"recomputed_s", g.recomputed_s},
                       {"speedup", g.recomputed_s / g.cached_s},
                       {"identical", g.identical}};
    std::fflush(stdout);
  }

  // Footer: how to read the table, and the summary.
  int wrong = 0, errors = 0, oom = 0, faster = 0, compared = 0;
  std::map<std::string, std::vector<double>> ratios;  // by mode
  std::vector<double> all_ratios;
  for (const auto& row : rows) {
    wrong += row.check.done && !row.check.passed ? 1 : 0;
    for (const auto* r : {&row.mha, &row.torch_nn}) {
      errors += r->status == "error" ? 1 : 0;
      oom += r->status == "OOM" ? 1 : 0;
    }
    if (row.ratio) {
      ++compared;
      faster += *row.ratio < 1 ? 1 : 0;
      ratios[mha::bench::name(row.mode)].push_back(*row.ratio);
      all_ratios.push_back(*row.ratio);
    }
  }
  fmt::print(
      "\nratio = mha median / torch::nn median (< 1: mha faster); mem = mha "
      "peak / torch::nn peak.\nGFLOP/s from the dense count per forward: "
      "8*N*L*E^2 (projections) + 4*N*L*S*E (attention), + 4*N*L*E*F for "
      "the encoder layer (F = 4E);\nx3 for fwd-bwd; causal rows count the "
      "full L*S. Both contenders get the same seq-first input (L, N, E); "
      "modules in eval().\n");
  std::string per_mode;
  for (auto mode : modes) {
    const auto it = ratios.find(mha::bench::name(mode));
    if (it != ratios.end()) {
      per_mode += fmt::format("{}{} {:.2f}", per_mode.empty() ? "" : ", ",
                              it->first, geometric_mean(it->second));
    }
  }
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!all_ratios.empty()) {
    fmt::print(
        "geometric mean ratio: {:.2f} over {} rows ({}); mha faster "
        "in {} of {}\n",
        geometric_mean(all_ratios), all_ratios.size(), per_mode, faster,
        compared);
  }
  fmt::print(
      "{} rows; results differ: {}; errors: {}; out of memory: {}; "
      "{:.1f} s\n",
      rows.size(), wrong, errors, oom, elapsed_s);
  const int exit_code = wrong > 0 || errors > 0 || generation_differs ? 1 : 0;
  if (exit_code != 0) {
    fmt::print("FAILED: {}\n",
               wrong > 0 ? "mha's results differ from torch::nn's (rows "
                           "marked FAIL were not timed)"
               : errors > 0
                   ? "a contender threw an error"
                   : "generation through the KV cache gave other characters");
  }

  if (!json_path.empty()) {
    nlohmann::json doc;
    doc["tool"] = "mha-bench";
    doc["environment"] = {
        {"cpu_model", cpu},
        {"cpus_online", online},
        {"cpus_usable", usable},
        {"blas", blas},
        {"openblas_config", openblas ? openblas->config : ""},
        {"openblas_threads", openblas ? openblas->num_threads : 0},
        {"libtorch", mha::torch_version()},
        {"device", device_name},
        {"dtype", dtype_name},
        {"intra_op_threads", at::get_num_threads()},
        {"omp_wait_policy", wait_policy},
        {"omp_wait_policy_source", source("OMP_WAIT_POLICY")},
        {"openblas_core", openblas_core},
        {"openblas_coretype_env", coretype},
        {"environment_set_by_mha_bench", runtime_note},
        {"omp_num_threads_env", omp_threads},
        {"openblas_num_threads_env", blas_threads_env},
        {"gemm",
         {{"n", gemm.n},
          {"reps", gemm.reps},
          {"median_ms", gemm.median_ms},
          {"gflops", gemm.gflops}}}};
    nlohmann::json mode_docs;
    for (auto m : modes) {
      mode_docs[mha::bench::name(m)] = mha::bench::description(m);
    }
    doc["settings"] = {{"quick", quick},
                       {"warmup", std::max(warmup, 1)},
                       {"reps", settings.reps},
                       {"reps_rule", reps_text},
                       {"budget_s", settings.budget_s},
                       {"seed", seed},
                       {"memory_method", mha::bench::name(settings.memory)},
                       {"memory_description", memory_text},
                       {"modes", mode_docs}};
    doc["rows"] = json_rows;
    doc["window"] = window_json;
    doc["generation"] = generation_json;
    doc["summary"] = {
        {"rows", rows.size()},
        {"results_differ", wrong},
        {"errors", errors},
        {"out_of_memory", oom},
        {"mha_faster_rows", faster},
        {"compared_rows", compared},
        {"geomean_ratio", all_ratios.empty()
                              ? nlohmann::json(nullptr)
                              : nlohmann::json(geometric_mean(all_ratios))},
        {"elapsed_s", elapsed_s},
        {"exit_code", exit_code}};
    json_file << doc.dump(2) << '\n';
  }
  return exit_code;
}
