// Access to the golden fixtures written by scripts/make_fixtures.py (the
// format is documented at the top of that script), and what tests that talk
// to Python need: a scratch directory and a python3 that imports torch.
#pragma once

#include <torch/torch.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <system_error>
#include <vector>

#include "mha/state_dict.h"

namespace fixtures {

/// The path of a file in tests/fixtures/ (MHA_FIXTURES_DIR is a compile
/// definition of the test executable).
inline std::string path(const std::string& file) {
  return std::string(MHA_FIXTURES_DIR) + "/" + file;
}

/// tests/fixtures/fixtures.json, read once.
inline const nlohmann::json& index() {
  static const nlohmann::json json = [] {
    std::ifstream in(path("fixtures.json"));
    TORCH_CHECK(in.is_open(), "cannot open ", path("fixtures.json"));
    return nlohmann::json::parse(in);
  }();
  return json;
}

/// Every fixture of one module kind ("MultiheadAttention",
/// "TransformerEncoderLayer", "TransformerEncoder").
inline std::vector<nlohmann::json> of_module(const std::string& module) {
  std::vector<nlohmann::json> found;
  for (const auto& fixture : index().at("fixtures")) {
    if (fixture.at("module") == module) {
      found.push_back(fixture);
    }
  }
  return found;
}

/// The fixture's state-dict files (full paths): safetensors, then the
/// OrderedDict and dict .pt files where it has them.
inline std::vector<std::string> state_dict_files(
    const nlohmann::json& fixture) {
  std::vector<std::string> files;
  for (const char* format : {"safetensors", "pt", "pt_dict"}) {
    if (fixture.at("state_dict").contains(format)) {
      files.push_back(path(fixture["state_dict"][format]));
    }
  }
  return files;
}

/// The fixture's inputs and expected outputs, by name.
inline torch::OrderedDict<std::string, torch::Tensor> data(
    const nlohmann::json& fixture) {
  return mha::read_state_dict(path(fixture.at("data")));
}

/// The fixture's state-dict keys in PyTorch's order.
inline std::vector<std::string> keys(const nlohmann::json& fixture) {
  return fixture.at("keys").get<std::vector<std::string>>();
}

/// A new, empty directory for a test's files (under the system's temporary
/// directory, its name starting with "mha-test-<name>-"); every directory
/// made here is removed when the test program exits.
inline std::string temp_dir(const std::string& name) {
  struct Made {
    std::vector<std::filesystem::path> dirs;
    ~Made() {
      for (const auto& dir : dirs) {
        std::error_code ignored;
        std::filesystem::remove_all(dir, ignored);
      }
    }
  };
  static Made made;
  static int counter = 0;
  const auto dir =
      std::filesystem::temp_directory_path() /
      ("mha-test-" + name + "-" + std::to_string(std::random_device{}()) + "-" +
       std::to_string(counter++));
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  made.dirs.push_back(dir);
  return dir.string();
}

/// The first of $MHA_PYTHON (when set, the only candidate), python3 and
/// /usr/bin/python3 that can `import torch`, or "" when none can. `tried`
/// gets the candidates, comma-separated, for a GTEST_SKIP message.
inline std::string python_with_torch(std::string* tried) {
  std::vector<std::string> candidates;
  if (const char* configured = std::getenv("MHA_PYTHON")) {
    candidates.emplace_back(configured);
  } else {
    candidates = {"python3", "/usr/bin/python3"};
  }
  for (const auto& python : candidates) {
    *tried += (tried->empty() ? "" : ", ") + python;
    const std::string command =
        "'" + python + "' -c 'import torch' >/dev/null 2>&1";
    if (std::system(command.c_str()) == 0) {
      return python;
    }
  }
  return "";
}

}  // namespace fixtures
