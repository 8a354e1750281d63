// mha-bench's report: the environment lines (with the GEMM ceiling), one
// table row per (configuration, mode), the summary and the --json document
// (the variants' tables: bench_tables.cpp). Every number is measured in
// bench.cpp / bench_batched_decode.cpp and formatted here, once.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads,
// F dim_feedforward (4E in the encoder rows).
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "bench/bench_tool.h"
#include "common/tool_common.h"
#include "core/attention_core.h"  // kInOrderKeys
#include "core/blas_gemm.h"
#include "core/blas_threads.h"
#include "core/blocked_attention.h"  // onednn_products_available
#include "mha/version.h"

namespace mha::bench {

namespace {

/// One table row (a constant: fmt checks format strings at compile time
/// in C++20).
constexpr char kRowFormat[] =
    "{:<16} {:<12} {:>4} {:>26} {:>26} {:>6} {:>29} {:>8} {:>8} {:>8} {:>9} "
    "{:>9} {:>6}  {:<8} {}\n";

std::string format_ms(double ms) {
  if (ms < 10) {
    return fmt::format("{:.3f}", ms);
  }
  if (ms < 1000) {
    return fmt::format("{:.1f}", ms);
  }
  return fmt::format("{:.0f}", ms);
}

/// "12.345 [12.001-13.2]", or the status when the contender did not run
/// ("n/a (LibTorch < 2.0)": with the reason when it cannot run).
std::string format_time(const ContenderResult& r) {
  if (r.status == "n/a") {
    return fmt::format("n/a ({})", r.error);
  }
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

std::string format_gflops(const ContenderResult& r) {
  return r.status == "ok" ? fmt::format("{:.1f}", r.gflops) : "-";
}

std::string format_memory(const ContenderResult& r, MemoryMethod method) {
  if (method == MemoryMethod::kNone) {
    return "n/a";
  }
  return r.peak_mib ? fmt::format("{:.1f}", *r.peak_mib) : r.status;
}

std::string format_check(const Check& c) {
  if (!c.done) {
    return "unchecked";
  }
  if (c.passed) {
    return fmt::format("ok {:.0e}", c.max_rel);
  }
  return fmt::format("FAIL {} {:.1e}", c.worst, c.max_rel);
}

/// mha's check, then the SDPA contender's where it was compared.
std::string format_checks(const RowResult& row) {
  std::string text = format_check(row.check);
  if (row.sdpa_check.done) {
    text += ", sdpa " + format_check(row.sdpa_check);
  }
  return text;
}

nlohmann::json to_json(const Check& c) {
  return {{"done", c.done},       {"passed", c.passed},
          {"max_abs", c.max_abs}, {"max_rel", c.max_rel},
          {"worst", c.worst},     {"compared", c.compared},
          {"atol", c.atol},       {"rtol", c.rtol}};
}

nlohmann::json to_json(const ContenderResult& r) {
  nlohmann::json j;
  j["status"] = r.status;
  if (!r.error.empty()) {
    j[r.status == "n/a" ? "reason" : "error"] = r.error;
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
  j["mode"] = name(row.mode);
  j["flops"] = static_cast<int64_t>(row.flops);
  j["warmup"] = row.warmup;
  j["reps"] = row.reps;
  j["check"] = to_json(row.check);
  j["mha"] = to_json(row.mha);
  j["mha"]["path"] = row.path;
  j["torch_nn"] = to_json(row.torch_nn);
  j["ratio"] = row.ratio ? nlohmann::json(*row.ratio) : nullptr;
  j["memory_ratio"] =
      row.memory_ratio ? nlohmann::json(*row.memory_ratio) : nullptr;
  j["sdpa"] = to_json(row.sdpa);
  j["sdpa"]["check"] = to_json(row.sdpa_check);
  j["sdpa_ratio"] = row.sdpa_ratio ? nlohmann::json(*row.sdpa_ratio) : nullptr;
  return j;
}

double geometric_mean(const std::vector<double>& v) {
  double log_sum = 0;
  for (double x : v) {
    log_sum += std::log(x);
  }
  return std::exp(log_sum / static_cast<double>(v.size()));
}

/// The selected mode of /sys/kernel/mm/transparent_hugepage/enabled (the
/// bracketed word of "always [madvise] never"), or "n/a".
std::string transparent_hugepage_mode() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string line;
  if (!std::getline(file, line)) {
    return "n/a";
  }
  const auto open = line.find('['), close = line.find(']');
  return open != std::string::npos && close > open
             ? line.substr(open + 1, close - open - 1)
             : "n/a";
}

/// Where an environment variable came from: mha-bench's re-execution
/// (tune_runtime_environment) or the caller.
const char* source(const Environment& env, const char* variable) {
  return env.runtime_note.find(variable) != std::string::npos
             ? "set by mha-bench"
             : "from the environment";
}

}  // namespace

Environment read_environment(const Settings& settings,
                             const std::string& runtime_note) {
  Environment env;
  env.runtime_note = runtime_note;
  env.blas = mha::tools::loaded_blas();
  if (const auto openblas = mha::detail::openblas_info()) {
    env.openblas_config = openblas->config;
    env.openblas_threads = openblas->num_threads;
  }
  env.cpu = mha::tools::cpu_model();
  env.native_bf16 = mha::tools::cpu_has_flag("avx512_bf16") ||
                    mha::tools::cpu_has_flag("amx_bf16");
  env.native_fp16 = mha::tools::cpu_has_flag("avx512_fp16") ||
                    mha::tools::cpu_has_flag("amx_fp16");
  env.online = mha::tools::online_cpus();
  env.usable = mha::tools::usable_cpus();
  env.wait_policy = mha::tools::env_or_unset("OMP_WAIT_POLICY");
  env.omp_threads = mha::tools::env_or_unset("OMP_NUM_THREADS");
  env.blas_threads_env = mha::tools::env_or_unset("OPENBLAS_NUM_THREADS");
  env.glibc_tunables = mha::tools::env_or_unset("GLIBC_TUNABLES");
  env.transparent_hugepage = transparent_hugepage_mode();
  env.openblas_core = mha::detail::openblas_core();
  env.openblas_workers_spin = mha::detail::openblas_workers_spin();
  env.blocked_gemm = mha::detail::onednn_products_available()
                         ? mha::detail::onednn_gemm_version()
                         : "BLAS";
  env.item_threads = mha::detail::openblas_item_threads();
  env.blocked_items =
      env.item_threads >= 2
          ? fmt::format("OpenBLAS's {} threads", env.item_threads)
          : std::string("ATen's threads or in order");
  env.coretype = mha::tools::env_or_unset("OPENBLAS_CORETYPE");
  env.memory_text =
      settings.memory == MemoryMethod::kClearRefs
          ? "peak RSS in process: \"5\" to /proc/self/clear_refs, one run, "
            "VmHWM minus VmRSS before the run (after freeing "
            "mha's kept scratch and malloc_trim)"
      : settings.memory == MemoryMethod::kFork
          ? "peak RSS of a fresh child process per measurement (fork+exec): "
            "VmHWM after one (first) run minus VmRSS before it"
          : "not measured on CUDA (host RSS does not show device memory)";
  env.reps_text =
      settings.reps > 0
          ? fmt::format("{} timed per contender", settings.reps)
          : fmt::format("auto: as many as fit in {} s per row, {} to {}",
                        settings.budget_s, settings.min_reps,
                        settings.max_reps);
  return env;
}

void print_environment(Environment& env, const Args& args,
                       const Settings& settings) {
  fmt::print(
      "mha-bench: mha vs torch::nn and vs projections+SDPA, same weights and "
      "inputs, one process\n");
  fmt::print("CPU:       {}, {} online, {} usable by this process\n", env.cpu,
             env.online, env.usable);
  fmt::print(
      "Half:      native bfloat16 products (avx512_bf16 / amx_bf16): {}; "
      "native float16 arithmetic (avx512_fp16 / amx_fp16): {}; mha's CPU "
      "bfloat16/float16 calls: the blocked core in float32 (converted in and "
      "out; LibTorch 2.x's fused kernel where it takes the call)\n",
      env.native_bf16 ? "yes" : "no", env.native_fp16 ? "yes" : "no");
  fmt::print(
      "BLAS:      {}{}\n", env.blas,
      env.openblas_config
          ? fmt::format(
                " ({}, {} threads, kernels {}; "
                "OPENBLAS_CORETYPE {}{}{})",
                *env.openblas_config, env.openblas_threads, env.openblas_core,
                env.coretype,
                env.coretype == "unset"
                    ? ""
                    : fmt::format(" ({})", source(env, "OPENBLAS_CORETYPE")),
                env.openblas_workers_spin && args.device_name == "cpu"
                    ? fmt::format(
                          "; idle workers spin: mha runs calls of <= {} keys "
                          "on the blocked path{}",
                          mha::detail::kInOrderKeys,
                          env.item_threads >= 2 ? "" : ", their items in order")
                    : "")
          : "");
  if (args.device_name == "cpu") {
    fmt::print(
        "Products:  the blocked path's float32 products through {}{}\n",
        env.blocked_gemm,
        env.blocked_gemm == "BLAS"
            ? "'s gemm"
            : "'s dnnl_sgemm, one thread each (in order: calls of <= 2^20 "
              "scores, or spread); BLAS's gemm otherwise");
    fmt::print(
        "Items:     the blocked path's work items on {}{}\n", env.blocked_items,
        env.item_threads >= 2
            ? fmt::format(" (calls of at least {} scores whose products "
                          "are all oneDNN's), else in order or on ATen's "
                          "threads",
                          mha::detail::kOpenBlasScores)
            : "");
  }
  fmt::print("LibTorch:  {}, device {}, dtype {}\n", mha::torch_version(),
             args.device_name, args.dtype_name);
  fmt::print(
      "Threads:   at::get_num_threads() = {}; OMP_WAIT_POLICY={} ({}); "
      "OMP_NUM_THREADS {}; OPENBLAS_NUM_THREADS {} (OpenBLAS uses {})\n",
      at::get_num_threads(), env.wait_policy, source(env, "OMP_WAIT_POLICY"),
      env.omp_threads, env.blas_threads_env,
      env.openblas_config ? fmt::format("{}", env.openblas_threads) : "n/a");
  fmt::print("Memory:    GLIBC_TUNABLES {}; transparent huge pages {}\n",
             env.glibc_tunables, env.transparent_hugepage);
  std::fflush(stdout);
  const int64_t gemm_n =
      args.quick && !args.gemm_size_given ? 256 : args.gemm_size;
  env.gemm = measure_gemm(gemm_n, /*reps=*/5, settings);
  if (env.gemm.onednn_gflops > 0) {
    fmt::print(
        "GEMM:      {}^3 in {}, median of {}: torch::mm {:.1f} GFLOP/s ({:.1f} "
        "ms), oneDNN's dnnl_sgemm (the blocked path's products) {:.1f} "
        "GFLOP/s ({:.1f} ms); the ceiling: {:.1f}\n",
        env.gemm.n, args.dtype_name, env.gemm.reps, env.gemm.gflops,
        env.gemm.median_ms, env.gemm.onednn_gflops, env.gemm.onednn_median_ms,
        env.gemm.ceiling_gflops());
  } else {
    fmt::print(
        "GEMM:      {}^3 torch::mm in {}: {:.1f} GFLOP/s (median of {}, "
        "{:.1f} ms): the ceiling\n",
        env.gemm.n, args.dtype_name, env.gemm.gflops, env.gemm.reps,
        env.gemm.median_ms);
  }
  fmt::print("SDPA:      {}\n", sdpa_available()
                                    ? "in-projection -> "
                                      "at::scaled_dot_product_attention -> "
                                      "out_proj on torch::nn's weights"
                                    : "n/a (LibTorch < 2.0: no "
                                      "at::scaled_dot_product_attention)");
  fmt::print("Memory:    {}\n", env.memory_text);
  fmt::print(
      "Runs:      per row {} untimed per contender (the first measures peak "
      "memory and its results are compared), then {},\n           "
      "interleaved mha, torch::nn, sdpa, mha, ... (after a discarded "
      "warm-up of each mode at (1,8,8,2))\n\n",
      std::max(args.warmup, 1), env.reps_text);

  fmt::print(kRowFormat, "", "", "", "mha ms", "torch::nn ms", "ratio",
             "projections+SDPA ms", "ratio", "mha", "nn", "mha peak", "nn peak",
             "mem", "mha", "");
  fmt::print(kRowFormat, "config N,L,E,H", "mode", "reps", "median [min-max]",
             "median [min-max]", "mha/nn", "median [min-max]", "mha/sdpa",
             "GFLOP/s", "GFLOP/s", "MiB", "MiB", "mha/nn", "path",
             "check (max rel err vs torch::nn)");
  std::fflush(stdout);
}

void warm_up(const std::vector<Mode>& modes, const Settings& settings) {
  auto warm = settings;
  warm.memory = MemoryMethod::kNone;
  warm.reps = 1;
  warm.warmup = 1;
  for (auto mode : modes) {
    run_row({1, 8, 8, 2}, mode, warm);
  }
}

void print_row(const RowResult& row, MemoryMethod memory) {
  fmt::print(kRowFormat, to_string(row.shape), name(row.mode), row.reps,
             format_time(row.mha), format_time(row.torch_nn),
             format_optional(row.ratio), format_time(row.sdpa),
             format_optional(row.sdpa_ratio), format_gflops(row.mha),
             format_gflops(row.torch_nn), format_memory(row.mha, memory),
             format_memory(row.torch_nn, memory),
             format_optional(row.memory_ratio), row.path, format_checks(row));
  for (const auto* r : {&row.mha, &row.torch_nn, &row.sdpa}) {
    if (r->status == "error" || r->status == "OOM") {
      fmt::print("  {} {}: {}\n",
                 r == &row.mha        ? "mha"
                 : r == &row.torch_nn ? "torch::nn"
                                      : "projections+SDPA",
                 r->status, r->error);
    }
  }
  std::fflush(stdout);
}

Summary summarize_rows(const std::vector<RowResult>& rows,
                       bool generation_differs) {
  Summary s;
  s.rows = static_cast<int>(rows.size());
  for (const auto& row : rows) {
    s.wrong += row.check.done && !row.check.passed ? 1 : 0;
    s.wrong += row.sdpa_check.done && !row.sdpa_check.passed ? 1 : 0;
    for (const auto* r : {&row.mha, &row.torch_nn, &row.sdpa}) {
      s.errors += r->status == "error" ? 1 : 0;
      s.oom += r->status == "OOM" ? 1 : 0;
    }
    if (row.ratio) {
      ++s.compared;
      s.faster += *row.ratio < 1 ? 1 : 0;
      s.ratios[name(row.mode)].push_back(*row.ratio);
      s.all_ratios.push_back(*row.ratio);
    }
    if (row.sdpa_ratio) {
      s.sdpa_faster += *row.sdpa_ratio < 1 ? 1 : 0;
      s.sdpa_ratios[name(row.mode)].push_back(*row.sdpa_ratio);
      s.all_sdpa_ratios.push_back(*row.sdpa_ratio);
    }
  }
  if (!s.all_ratios.empty()) {
    s.geomean_ratio = geometric_mean(s.all_ratios);
  }
  if (!s.all_sdpa_ratios.empty()) {
    s.sdpa_geomean_ratio = geometric_mean(s.all_sdpa_ratios);
  }
  s.exit_code = s.wrong > 0 || s.errors > 0 || generation_differs ? 1 : 0;
  return s;
}

void print_footer(const Summary& summary, const std::vector<Mode>& modes,
                  double elapsed_s) {
  fmt::print(
      "\nratio = mha median / torch::nn median (< 1: mha faster); mem = mha "
      "peak / torch::nn peak.\nGFLOP/s from the dense count per forward: "
      "8*N*L*E^2 (projections) + 4*N*L*S*E (attention), + 4*N*L*E*F for "
      "the encoder layer (F = 4E);\nx3 for fwd-bwd; causal rows count the "
      "full L*S. Every contender gets the same seq-first input (L, N, E); "
      "modules in eval().\nprojections+SDPA (LibTorch >= 2.0): torch::nn's "
      "weights through in_proj, at::scaled_dot_product_attention "
      "(is_causal=true in causal rows) and out_proj, as a LibTorch 2.x user "
      "writes it;\nmha/sdpa = mha median / its median; it returns no "
      "weights (n/a in fwd-weights rows) and is checked against torch::nn "
      "too.\n");
  auto per_mode = [&](const std::map<std::string, std::vector<double>>& by) {
    std::string text;
    for (auto mode : modes) {
      const auto it = by.find(name(mode));
      if (it != by.end()) {
        text += fmt::format("{}{} {:.2f}", text.empty() ? "" : ", ", it->first,
                            geometric_mean(it->second));
      }
    }
    return text;
  };
  if (summary.geomean_ratio) {
    fmt::print(
        "geometric mean ratio mha/nn: {:.2f} over {} rows ({}); mha faster "
        "in {} of {}\n",
        *summary.geomean_ratio, summary.all_ratios.size(),
        per_mode(summary.ratios), summary.faster, summary.compared);
  }
  if (summary.sdpa_geomean_ratio) {
    fmt::print(
        "geometric mean ratio mha/sdpa: {:.2f} over {} rows ({}); mha faster "
        "in {} of {}\n",
        *summary.sdpa_geomean_ratio, summary.all_sdpa_ratios.size(),
        per_mode(summary.sdpa_ratios), summary.sdpa_faster,
        summary.all_sdpa_ratios.size());
  }
  fmt::print(
      "{} rows; results differ: {}; errors: {}; out of memory: {}; "
      "{:.1f} s\n",
      summary.rows, summary.wrong, summary.errors, summary.oom, elapsed_s);
  if (summary.exit_code != 0) {
    fmt::print("FAILED: {}\n",
               summary.wrong > 0
                   ? "results differ from torch::nn's (a FAIL of mha: "
                     "the row was not timed; of sdpa: sdpa was not timed)"
               : summary.errors > 0
                   ? "a contender threw an error"
                   : "generation differs: the char LM through the KV "
                     "cache gave other characters, or batched decoding "
                     "other outputs than one sequence at a time");
  }
}

nlohmann::json json_report(const Args& args, const Settings& settings,
                           const Environment& env, const Plan& plan,
                           const std::vector<RowResult>& rows,
                           const Variants& variants, const Summary& summary,
                           double elapsed_s) {
  nlohmann::json doc;
  doc["tool"] = "mha-bench";
  doc["environment"] = {
      {"cpu_model", env.cpu},
      {"native_bfloat16", env.native_bf16},
      {"native_float16", env.native_fp16},
      {"cpus_online", env.online},
      {"cpus_usable", env.usable},
      {"blas", env.blas},
      {"openblas_config", env.openblas_config.value_or("")},
      {"openblas_threads", env.openblas_threads},
      {"libtorch", mha::torch_version()},
      {"device", args.device_name},
      {"dtype", args.dtype_name},
      {"intra_op_threads", at::get_num_threads()},
      {"omp_wait_policy", env.wait_policy},
      {"omp_wait_policy_source", source(env, "OMP_WAIT_POLICY")},
      {"glibc_tunables", env.glibc_tunables},
      {"transparent_hugepage", env.transparent_hugepage},
      {"openblas_core", env.openblas_core},
      {"openblas_workers_spin", env.openblas_workers_spin},
      {"blocked_gemm", env.blocked_gemm},
      {"blocked_items", env.blocked_items},
      {"openblas_coretype_env", env.coretype},
      {"environment_set_by_mha_bench", env.runtime_note},
      {"omp_num_threads_env", env.omp_threads},
      {"openblas_num_threads_env", env.blas_threads_env},
      {"sdpa_available", sdpa_available()},
      {"gemm",
       {{"n", env.gemm.n},
        {"reps", env.gemm.reps},
        {"median_ms", env.gemm.median_ms},
        {"gflops", env.gemm.gflops},
        {"onednn_median_ms", env.gemm.onednn_median_ms},
        {"onednn_gflops", env.gemm.onednn_gflops},
        {"ceiling_gflops", env.gemm.ceiling_gflops()}}}};
  nlohmann::json mode_docs;
  for (auto m : plan.modes) {
    mode_docs[name(m)] = description(m);
  }
  doc["settings"] = {{"quick", args.quick},
                     {"warmup", std::max(args.warmup, 1)},
                     {"reps", settings.reps},
                     {"reps_rule", env.reps_text},
                     {"budget_s", settings.budget_s},
                     {"seed", args.seed},
                     {"memory_method", name(settings.memory)},
                     {"memory_description", env.memory_text},
                     {"modes", mode_docs}};
  auto json_rows = nlohmann::json::array();
  for (const auto& row : rows) {
    json_rows.push_back(to_json(row));
  }
  doc["rows"] = json_rows;
  doc["projections"] = variants.projections;
  doc["window"] = variants.window;
  doc["flex"] = variants.flex;
  doc["generation"] = variants.generation;
  doc["batched_decode"] = variants.batched_decode;
  doc["linear"] = variants.linear;
  doc["summary"] = {
      {"rows", rows.size()},
      {"results_differ", summary.wrong},
      {"errors", summary.errors},
      {"out_of_memory", summary.oom},
      {"mha_faster_rows", summary.faster},
      {"compared_rows", summary.compared},
      {"geomean_ratio", summary.geomean_ratio
                            ? nlohmann::json(*summary.geomean_ratio)
                            : nlohmann::json(nullptr)},
      {"sdpa_compared_rows", summary.all_sdpa_ratios.size()},
      {"mha_faster_than_sdpa_rows", summary.sdpa_faster},
      {"sdpa_geomean_ratio", summary.sdpa_geomean_ratio
                                 ? nlohmann::json(*summary.sdpa_geomean_ratio)
                                 : nlohmann::json(nullptr)},
      {"elapsed_s", elapsed_s},
      {"exit_code", summary.exit_code}};
  return doc;
}

}  // namespace mha::bench
