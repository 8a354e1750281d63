// The shared command-line pieces of cli.h.
#include "common/cli.h"

#include <fmt/core.h>

#include <map>

#include "mha/version.h"

namespace mha::tools {

namespace {

const std::map<std::string, torch::ScalarType> kDtypes = {
    {"float32", torch::kFloat32},
    {"float64", torch::kFloat64},
    {"float16", torch::kFloat16},
    {"bfloat16", torch::kBFloat16}};

}  // namespace

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv,
                                      const std::string& tool,
                                      UsageStyle style) {
  app.set_version_flag("--version",
                       fmt::format("{} {} (LibTorch {})", tool, mha::version(),
                                   mha::torch_version()));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) {
      return app.exit(e);  // --help, --version
    }
    // Every usage error exits 2 (CLI11's own codes vary).
    switch (style) {
      case UsageStyle::kCli11:
        app.exit(e);
        break;
      case UsageStyle::kOneLine:
        fmt::print(stderr, "{}: {}\n", tool, e.what());
        break;
      case UsageStyle::kOneLineSeeHelp:
        fmt::print(stderr, "{}: {} (see --help)\n", tool, e.what());
        break;
    }
    return 2;
  }
  return std::nullopt;
}

int usage_error(const std::string& tool, const std::string& message) {
  fmt::print(stderr, "{}: {}\n", tool, message);
  return 2;
}

torch::ScalarType dtype_from_name(const std::string& name) {
  return kDtypes.at(name);
}

std::string dtype_name(torch::ScalarType dtype) {
  for (const auto& [name, type] : kDtypes) {
    if (type == dtype) {
      return name;
    }
  }
  return "?";
}

bool cuda_missing(const std::string& tool, bool cuda_requested) {
  if (!cuda_requested || torch::cuda::is_available()) {
    return false;
  }
  fmt::print(stderr,
             "{}: --device cuda: CUDA is not available (LibTorch {} built "
             "without CUDA, or no GPU)\n",
             tool, mha::torch_version());
  return true;
}

bool open_output(std::ofstream& file, const std::string& path,
                 const std::string& tool, const std::string& flag) {
  file.open(path);
  if (!file) {
    fmt::print(stderr, "{}: {} {}: cannot write the file\n", tool, flag, path);
    return false;
  }
  return true;
}

}  // namespace mha::tools
