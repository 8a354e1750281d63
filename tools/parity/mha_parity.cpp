// mha-parity: proves that mha::MultiHeadAttention equals
// torch::nn::MultiheadAttention (and a float64 reference) on this machine.
// Exit status: 0 all cases PASS or REF-DIFF, 1 some case FAILs, 2 bad usage.
// The options, checks and report live in parity_cli.cpp and
// parity_report.cpp (the mha_tools library).
#include <fmt/core.h>

#include <fstream>

#include "common/cli.h"
#include "common/tool_common.h"
#include "parity/parity_tool.h"

namespace parity = mha::tools::parity;

int main(int argc, char** argv) {
  CLI::App app{
      "mha-parity: checks mha::MultiHeadAttention against "
      "torch::nn::MultiheadAttention and a float64 reference (outputs, "
      "weights, gradients). Exit 0: all PASS or REF-DIFF; 1: a FAIL; 2: bad "
      "usage."};
  parity::Args args;
  parity::add_options(app, args);
  if (auto status = mha::tools::parse_command_line(
          app, argc, argv, "mha-parity", mha::tools::UsageStyle::kCli11)) {
    return *status;
  }
  parity::read_custom_case(app, args);
  if (!args.references.empty()) {
    return parity::run_references(app, args);
  }

  const auto plan = parity::plan(app, args);
  if (!plan) {
    return 2;
  }
  if (args.list) {
    for (const auto& c : plan->cases) {
      fmt::print("{}\n", c.name);
    }
    return 0;
  }
  std::ofstream json_file;
  if (!args.json_path.empty() &&
      !mha::tools::open_output(json_file, args.json_path, "mha-parity",
                               "--json")) {
    return 2;
  }

  const auto blas = mha::tools::loaded_blas();
  parity::print_header(args, blas);
  parity::Tally tally;
  for (size_t i = 0; i < plan->cases.size(); ++i) {
    const auto r = parity::run_one(plan->cases[i], plan->device, plan->seeds[i],
                                   args.plant_fault);
    parity::report_row(r, plan->cases[i].dtype, tally);
    if (!parity::show_and_plot(r, args)) {
      return 2;
    }
  }
  parity::print_summary(tally, plan->cases.size());
  if (!args.json_path.empty()) {
    json_file << parity::json_report(args, blas, tally).dump(2) << '\n';
  }
  return tally.count(mha::parity::Status::kFail) == 0 ? 0 : 1;
}
