// mha-bench: times mha against torch::nn on the same weights and inputs, in
// one process, after checking that both compute the same results.
// Exit status: 0 ok, 1 a failure (results differ, or a contender threw
// something other than out-of-memory), 2 bad usage.
// The measuring is in bench.cpp, the options and the report in
// bench_cli.cpp and bench_report.cpp (the mha_tools library).
//
// Glossary: N batch, L sequence length (S = L), E embed_dim, H num_heads.
#include <chrono>
#include <fstream>

#include "bench/bench_tool.h"
#include "common/cli.h"
#include "common/tool_common.h"

namespace {

/// Set in the environment across tune_runtime_environment's re-execution.
constexpr const char* kReexecMarker = "MHA_BENCH_REEXECUTED";

}  // namespace

int main(int argc, char** argv) {
  namespace bench = mha::bench;
  const auto start = std::chrono::steady_clock::now();
  const std::string runtime_note =
      mha::tools::tune_runtime_environment(argv, kReexecMarker);

  CLI::App app{
      "mha-bench: times mha against torch::nn (MultiheadAttention, "
      "TransformerEncoderLayer) on the same weights and inputs, after "
      "checking they agree. Exit 0: ok; 1: results differ or a contender "
      "failed; 2: bad usage."};
  bench::Args args;
  bench::add_options(app, args);
  if (auto status = mha::tools::parse_command_line(
          app, argc, argv, "mha-bench",
          mha::tools::UsageStyle::kOneLineSeeHelp)) {
    return *status;
  }
  const auto plan = bench::plan(app, args);
  if (!plan) {
    return 2;
  }
  std::ofstream json_file;
  if (!args.json_path.empty() &&
      !mha::tools::open_output(json_file, args.json_path, "mha-bench",
                               "--json")) {
    return 2;
  }
  const auto settings = bench::make_settings(args);
  if (!settings) {
    return 2;
  }
  if (!args.memory_child_spec.empty()) {
    return bench::memory_child(args.memory_child_spec, *settings);
  }

  auto env = bench::read_environment(*settings, runtime_note);
  bench::print_environment(env, args, *settings);
  bench::warm_up(plan->modes, *settings);
  std::vector<bench::RowResult> rows;
  for (const auto& shape : plan->shapes) {
    for (auto mode : plan->modes) {
      rows.push_back(bench::run_row(shape, mode, *settings));
      bench::print_row(rows.back(), settings->memory);
    }
  }
  const auto variants = bench::run_variants(args, *plan, *settings);

  const auto summary = bench::summarize_rows(rows, variants.generation_differs);
  const double elapsed_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  bench::print_footer(summary, plan->modes, elapsed_s);
  if (!args.json_path.empty()) {
    json_file << bench::json_report(args, *settings, env, *plan, rows, variants,
                                    summary, elapsed_s)
                     .dump(2)
              << '\n';
  }
  return summary.exit_code;
}
