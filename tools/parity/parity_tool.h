// mha-parity's pieces: its options, the case list they select, and the
// report (the table on stdout, weights in the terminal or as SVG, JSON).
// parity_cli.cpp holds the first two, parity_report.cpp the report.
#pragma once

#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "mha/parity.h"

namespace mha::tools::parity {

/// Everything the command line sets.
struct Args {
  std::string device_name = "cpu";
  std::string dtype_filter;  ///< "" = the device's default dtypes
  uint64_t seed = 0;
  std::string filter;  ///< regex over case names
  std::string json_path;
  bool list = false;
  std::string show;      ///< one case whose weights go to the terminal
  std::string plot_dir;  ///< where SVG heatmaps go
  bool plant_fault = false;
  /// The custom case (--batch ... --no-weights) and whether one was asked for.
  mha::parity::Case custom;
  std::string padding = "none", attn_mask = "none";  ///< none|bool|float
  std::vector<CLI::Option*> custom_flags;
  bool use_custom = false;
  /// --reference: recorded reference files to check instead of the matrix.
  std::vector<std::string> references;
};

/// Checks every --reference file (mha::parity::check_reference): one row
/// each, the worst element under it, --json rows. Returns the exit status:
/// 0 all pass, 1 a FAIL (or a file mha cannot read or build), 2 bad usage.
int run_references(const CLI::App& app, const Args& args);

/// The options (and the custom-case group) of mha-parity, bound to `args`.
/// Call read_custom_case after parsing.
void add_options(CLI::App& app, Args& args);
/// Completes args.custom and args.use_custom from the parsed flags.
void read_custom_case(const CLI::App& app, Args& args);

/// The cases to run, each with its seed (fixed by its place in the full
/// list, so --filter reproduces a row).
struct Plan {
  torch::Device device = torch::kCPU;
  std::vector<mha::parity::Case> cases;
  std::vector<uint64_t> seeds;
};
/// Checks the arguments and selects the cases (and creates --plot's
/// directory). nullopt after a usage error was printed (exit status 2).
std::optional<Plan> plan(const CLI::App& app, const Args& args);

/// Runs one case (mha throwing is a FAIL row, not an exception).
mha::parity::CaseResult run_one(const mha::parity::Case& c,
                                const torch::Device& device, uint64_t seed,
                                bool plant_fault);

/// The rows so far: counts by status, worst error by dtype, JSON rows.
struct Tally {
  std::map<mha::parity::Status, int> counts;
  std::map<std::string, double> worst;  ///< dtype -> worst abs error
  nlohmann::json rows = nlohmann::json::array();
  int count(mha::parity::Status status) const;
};

/// The environment lines and the table's head.
void print_header(const Args& args, const std::string& blas);
/// Prints the row of `r` (a case of `dtype`) and adds it to `tally`.
void report_row(const mha::parity::CaseResult& r, torch::ScalarType dtype,
                Tally& tally);
/// --show and --plot for one row. False after printing an error (exit 2).
bool show_and_plot(const mha::parity::CaseResult& r, const Args& args);
/// The counts and the worst error per dtype.
void print_summary(const Tally& tally, size_t num_cases);
/// The --json document.
nlohmann::json json_report(const Args& args, const std::string& blas,
                           const Tally& tally);

}  // namespace mha::tools::parity
