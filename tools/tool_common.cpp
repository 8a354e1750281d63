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

/// The kernel set OpenBLAS chose ("SkylakeX", "Haswell", "Prescott", ...),
/// or "" when OpenBLAS is not loaded.
inline std::string openblas_core() {
  using GetCore = char* (*)();
  auto get =
      reinterpret_cast<GetCore>(dlsym(RTLD_DEFAULT, "openblas_get_corename"));
  return get != nullptr ? std::string(get()) : std::string();
}

/// Two runtime settings that only the environment controls, read when the
/// libraries load (before main), so the tool sets them and executes itself
/// again, once, when they are unset:
///   * OMP_WAIT_POLICY=PASSIVE: idle OpenMP workers sleep instead of
///     spinning against OpenBLAS's threads for the same cores
///     (PERF-NOTES: spinning made small calls bimodal);
///   * OPENBLAS_CORETYPE: OpenBLAS 0.3.21 (Debian 12) does not recognise
///     recent Intel CPUs (this machine's model 207) and falls back to its
///     SSE3 "Prescott" kernels, several times slower than the AVX-512
///     (SkylakeX) or AVX2 (Haswell) kernels the CPU runs. Set only when
///     OpenBLAS picked Prescott on a CPU with AVX2 or AVX-512.
/// Both are process-wide: every contender of a benchmark runs under them.
/// `marker` names the environment variable that carries the note across
/// the re-execution. Returns a note of what was set ("" when nothing was).
inline std::string tune_runtime_environment(char** argv, const char* marker) {
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
      openblas_core() == "Prescott") {
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
