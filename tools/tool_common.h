// Facts about the machine and process that the tools print with their
// results (header-only; tools only, never included by the library).
#pragma once

#include <dlfcn.h>
#include <sched.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>

namespace mha::tools {

/// The shared library providing BLAS in this process (Debian's LibTorch calls
/// the system BLAS chosen by update-alternatives), read from /proc/self/maps.
inline std::string loaded_blas() {
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

/// OpenBLAS's own thread count and build string, when OpenBLAS is loaded
/// (looked up by symbol name, so nothing links against OpenBLAS).
struct OpenBlasInfo {
  int num_threads = 0;
  std::string config;
};
inline std::optional<OpenBlasInfo> openblas_info() {
  using GetThreads = int (*)();
  using GetConfig = char* (*)();
  auto get_threads = reinterpret_cast<GetThreads>(
      dlsym(RTLD_DEFAULT, "openblas_get_num_threads"));
  if (get_threads == nullptr) {
    return std::nullopt;
  }
  OpenBlasInfo info;
  info.num_threads = get_threads();
  if (auto get_config = reinterpret_cast<GetConfig>(
          dlsym(RTLD_DEFAULT, "openblas_get_config"))) {
    info.config = get_config();
  }
  return info;
}

/// The first "model name" of /proc/cpuinfo, or "unknown".
inline std::string cpu_model() {
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

/// Online CPUs of the machine.
inline int online_cpus() {
  return static_cast<int>(sysconf(_SC_NPROCESSORS_ONLN));
}

/// CPUs this process may run on (its affinity mask).
inline int usable_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) != 0) {
    return online_cpus();
  }
  return CPU_COUNT(&set);
}

/// An environment variable's value, or "unset".
inline std::string env_or_unset(const char* name) {
  const char* value = std::getenv(name);
  return value != nullptr ? value : "unset";
}

}  // namespace mha::tools
