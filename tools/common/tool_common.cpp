// The machine and process facts of tool_common.h: /proc and sysconf reads,
// and the re-execution that sets OMP_WAIT_POLICY and OPENBLAS_CORETYPE.
#include "common/tool_common.h"

#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "core/blas_threads.h"

namespace mha::tools {

std::string loaded_blas() {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    auto slash = line.find('/');
    if (slash == std::string::npos) {
      continue;
    }
    auto path = line.substr(slash);
    if (path.find("blas") != std::string::npos ||
        path.find("mkl_core") != std::string::npos) {
      std::error_code ec;
      auto real = std::filesystem::canonical(path, ec);
      return ec ? path : real.string();
    }
  }
  return "none found (statically linked?)";
}

std::string tune_runtime_environment(char** argv, const char* marker) {
  if (const char* carried = std::getenv(marker)) {
    const std::string note = carried;
    unsetenv(marker);
    return note;
  }
  std::string note;
  if (std::getenv("OMP_WAIT_POLICY") == nullptr) {
    setenv("OMP_WAIT_POLICY", "PASSIVE", /*overwrite=*/1);
    note += "OMP_WAIT_POLICY=PASSIVE";
  }
  if (std::getenv("OPENBLAS_CORETYPE") == nullptr &&
      mha::detail::openblas_core() == "Prescott") {
    const char* core = __builtin_cpu_supports("avx512f") ? "SKYLAKEX"
                       : __builtin_cpu_supports("avx2")  ? "HASWELL"
                                                         : nullptr;
    if (core != nullptr) {
      setenv("OPENBLAS_CORETYPE", core, /*overwrite=*/1);
      note +=
          std::string(note.empty() ? "" : " ") + "OPENBLAS_CORETYPE=" + core;
    }
  }
  if (note.empty()) {
    return note;
  }
  setenv(marker, note.c_str(), /*overwrite=*/1);
  execv("/proc/self/exe", argv);
  unsetenv(marker);  // exec failed: carry on untuned
  return "";
}

std::string cpu_model() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("model name", 0) == 0) {
      auto colon = line.find(':');
      if (colon != std::string::npos) {
        return line.substr(line.find_first_not_of(' ', colon + 1));
      }
    }
  }
  return "unknown";
}

bool cpu_has_flag(const std::string& flag) {
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) == 0) {
      return (line + " ").find(" " + flag + " ") != std::string::npos;
    }
  }
  return false;
}

int online_cpus() { return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN)); }

int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    return online_cpus();
  }
  return CPU_COUNT(&set);
}

std::string env_or_unset(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "unset";
}

}  // namespace mha::tools
