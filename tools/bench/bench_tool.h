// mha-bench's command line and report around the measuring code (bench.h):
// bench_cli.cpp holds the options, checks and settings, bench_report.cpp
// the environment lines, the table, the variants' tables, the summary and
// the --json document.
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "bench/bench.h"

namespace mha::bench {

/// Everything the command line sets.
struct Args {
  std::string json_path;
  bool quick = false;
  std::vector<std::string> config_texts;   ///< "N,L,E,H"
  std::vector<std::string> mode_texts;     ///< "" = every mode
  std::vector<std::string> variant_texts;  ///< "" = every table
  int reps = 0;
  int warmup = 1;
  int threads = 2;
  double budget_s = 2.0;
  int64_t gemm_size = 2048;
  bool gemm_size_given = false;  ///< --gemm-size on the command line
  std::string device_name = "cpu";
  std::string dtype_name = "float32";
  std::string memory_name = "auto";
  uint64_t seed = 0;
  std::string memory_child_spec;
  bool plant_fault = false;
};

/// The options of mha-bench, bound to `args`.
void add_options(CLI::App& app, Args& args);

/// The rows to measure: configurations and modes.
struct Plan {
  std::vector<Shape> shapes;
  std::vector<Mode> modes;
};
/// The shapes (--config or the defaults) and modes, and the CUDA check.
/// nullopt after a usage error was printed (exit status 2).
std::optional<Plan> plan(const CLI::App& app, Args& args);

/// The settings of every row (sets at::set_num_threads first). nullopt
/// after a usage error was printed (--memory clear_refs where it cannot be).
std::optional<Settings> make_settings(const Args& args);

/// The child of MemoryMethod::kFork (--memory-child N,L,E,H:MODE:CONTENDER):
/// prints "peak_kib <n>"; exit status 3 on OOM, 2 on a bad spec.
int memory_child(const std::string& spec, const Settings& settings);

/// The machine, the libraries and the settings, as printed and in JSON.
struct Environment {
  std::string runtime_note;  ///< what tune_runtime_environment set
  std::string blas, cpu;
  bool native_bf16 = false, native_fp16 = false;  ///< avx512_bf16, _fp16
  int online = 0, usable = 0;
  std::string wait_policy, omp_threads, blas_threads_env;
  /// GLIBC_TUNABLES as set (or "unset") and the kernel's transparent huge
  /// page mode ("always", "madvise", "never", or "n/a" off Linux): with
  /// glibc.malloc.hugetlb=1 under "madvise", glibc asks for huge pages for
  /// large blocks, whose first touch then faults per 2 MiB instead of per
  /// 4 KiB (docs/speed.md, "Settings for your program").
  std::string glibc_tunables, transparent_hugepage;
  std::string openblas_core, coretype;
  std::optional<std::string> openblas_config;  ///< nullopt: no OpenBLAS
  int openblas_threads = 0;
  /// mha::detail::openblas_workers_spin(): calls of at most kInOrderKeys
  /// keys take the blocked path, their items in order where they cannot
  /// run on OpenBLAS's threads (src/core/attention_core.h)
  bool openblas_workers_spin = false;
  /// What computes the blocked path's float32 products:
  /// mha::detail::onednn_gemm_version() ("oneDNN X.Y.Z") where
  /// onednn_products_available(), otherwise "BLAS".
  std::string blocked_gemm;
  /// Where the blocked path's work items run (large enough calls):
  /// "OpenBLAS's N threads" where mha::detail::openblas_item_threads() is N
  /// >= 2, otherwise "ATen's threads or in order".
  std::string blocked_items;
  int item_threads = 0;  ///< mha::detail::openblas_item_threads()
  std::string memory_text, reps_text;
  Gemm gemm;  ///< set by print_environment
};
Environment read_environment(const Settings& settings,
                             const std::string& runtime_note);
/// The environment lines, measuring the GEMM ceiling (into env.gemm) after
/// the thread line, then the table's head.
void print_environment(Environment& env, const Args& args,
                       const Settings& settings);

/// Discarded runs of each mode at (1,8,8,2): one-time costs (OpenMP and
/// autograd worker threads, first allocations) stay out of the first row.
void warm_up(const std::vector<Mode>& modes, const Settings& settings);
/// One table row, and the error lines of a contender that threw.
void print_row(const RowResult& row, MemoryMethod memory);

/// The variants' tables (projections, window, generation, batched
/// decoding): no results checked against torch::nn's. Each measured and printed
/// when --variants asks for it ("generation" prints the char LM line and the
/// batched decoding table; "batched-decode" the table alone; the char LM line
/// is CPU only).
struct Variants {
  nlohmann::json projections = nullptr;
  nlohmann::json window = nullptr;
  nlohmann::json generation = nullptr;
  nlohmann::json batched_decode = nullptr;
  nlohmann::json flex = nullptr;
  /// --variants linear only (never part of the default): linear_table.
  nlohmann::json linear = nullptr;
  /// The char LM's cached characters differ from the recomputed ones, or
  /// batched decoding's outputs from one sequence at a time's.
  bool generation_differs = false;
};
Variants run_variants(const Args& args, const Plan& plan,
                      const Settings& settings);

/// The flex table (bench_flex.cpp): FlexAttention calls against the
/// built-in options, CPU; measured, printed, and its JSON rows.
nlohmann::json flex_table(bool quick, const Settings& settings);
/// The linear-cost attention table (bench_linear.cpp): each attention_kind
/// against mha's softmax core, L = 1k..64k (--quick: 64, 128), time and
/// peak memory of the forward (inference) and forward+backward, the
/// crossover and growth lines, and decoding ms/token at cache lengths
/// 1k..64k; measured, printed, and its JSON.
nlohmann::json linear_table(bool quick, const Settings& settings);

/// What the rows add up to.
struct Summary {
  int rows = 0, wrong = 0, errors = 0, oom = 0, faster = 0, compared = 0;
  std::map<std::string, std::vector<double>> ratios;  ///< by mode name
  std::vector<double> all_ratios;
  std::optional<double> geomean_ratio;  ///< over all_ratios
  /// The same for mha / projections+SDPA (rows where both ran).
  int sdpa_faster = 0;
  std::map<std::string, std::vector<double>> sdpa_ratios;
  std::vector<double> all_sdpa_ratios;
  std::optional<double> sdpa_geomean_ratio;
  /// 1: results differ (mha's or the SDPA contender's from torch::nn's), an
  /// error, or generation differs.
  int exit_code = 0;
};
Summary summarize_rows(const std::vector<RowResult>& rows,
                       bool generation_differs);
/// How to read the table, the summary lines and FAILED when exit_code is 1.
void print_footer(const Summary& summary, const std::vector<Mode>& modes,
                  double elapsed_s);

/// The --json document.
nlohmann::json json_report(const Args& args, const Settings& settings,
                           const Environment& env, const Plan& plan,
                           const std::vector<RowResult>& rows,
                           const Variants& variants, const Summary& summary,
                           double elapsed_s);

}  // namespace mha::bench
