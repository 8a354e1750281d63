// Facts about the machine and process that the tools print with their
// results, and the runtime settings they make before anything else (tools
// only, never included by the library; OpenBLAS's own facts come from
// src/core/blas_threads.h).
#pragma once

#include <string>

namespace mha::tools {

/// The shared library providing BLAS in this process (Debian's LibTorch calls
/// the system BLAS chosen by update-alternatives), read from /proc/self/maps.
std::string loaded_blas();

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
std::string tune_runtime_environment(char** argv, const char* marker);

/// The first "model name" of /proc/cpuinfo, or "unknown".
std::string cpu_model();

/// Whether the first "flags" line of /proc/cpuinfo lists `flag` (such as
/// avx512_bf16); false where there is none.
bool cpu_has_flag(const std::string& flag);

/// Online CPUs of the machine.
int online_cpus();

/// CPUs this process may run on (its affinity mask).
int usable_cpus();

/// An environment variable's value, or "unset".
std::string env_or_unset(const char* name);

}  // namespace mha::tools
