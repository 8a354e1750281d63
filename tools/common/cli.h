// Command-line pieces the three tools share: parsing with their exit-status
// conventions (0 after --help, 2 for bad usage), the one-line usage error,
// dtype names, the CUDA check and the --json output file.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>

#include <CLI/CLI.hpp>
#include <fstream>
#include <optional>
#include <string>

namespace mha::tools {

/// How a command-line error is reported on stderr (the exit status is 2).
enum class UsageStyle {
  kCli11,           ///< CLI11's own message and hint
  kOneLine,         ///< "<tool>: <what>"
  kOneLineSeeHelp,  ///< "<tool>: <what> (see --help)"
};

/// Adds --version ("<tool> <mha version> (LibTorch <version>)") and parses
/// argv into `app`. Returns nullopt when the tool goes on, 0 after printing
/// --help or --version, 2 after reporting a usage error in `style`.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                      const std::string& tool,
                                      UsageStyle style);

/// Prints "<tool>: <message>" on stderr and returns 2 (bad usage).
int usage_error(const std::string& tool, const std::string& message);

/// The dtype called "float32", "float64", "float16" or "bfloat16".
torch::ScalarType dtype_from_name(const std::string& name);
/// The name of one of those dtypes, or "?".
std::string dtype_name(torch::ScalarType dtype);

/// Whether the linked LibTorch has a float16 matrix product on the CPU
/// (LibTorch 2.x; 1.13 has none, so torch::nn and mha's projections cannot
/// run in float16 there).
constexpr bool cpu_float16_matmul() { return TORCH_VERSION_MAJOR >= 2; }

/// With --device cuda and no CUDA: says so on stderr ("<tool>: --device
/// cuda: CUDA is not available (...)") and returns true.
bool cuda_missing(const std::string& tool, bool cuda_requested);

/// Opens `path` for writing into `file`. On failure says "<tool>: <flag>
/// <path>: cannot write the file" on stderr and returns false.
bool open_output(std::ofstream& file, const std::string& path,
                 const std::string& tool, const std::string& flag);

}  // namespace mha::tools
