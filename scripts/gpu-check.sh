#!/usr/bin/env bash
# gpu-check.sh — one prepared run on a GPU machine that has a pip PyTorch,
# CMake, a C++ compiler and (for CUDA) nvcc, but no network and no Debian
# packages: build mha against that PyTorch, run the tests, then mha-parity
# and mha-bench on the GPU in float32 and bfloat16, and write one report.
#
# Usage: scripts/gpu-check.sh [options]
#   --device cuda|cpu|auto   auto (default): cuda when python3's torch sees a
#                            GPU, else cpu (the CPU path proves the script on
#                            a machine without one)
#   --budget SECONDS         wall-clock budget of the whole run (default 480).
#                            The build takes what it takes; each later step
#                            gets a share of the time left (at least 30 s)
#                            and is stopped there; the report says so
#   --quick                  short steps: builds only mha-parity and mha-bench
#                            (and the library), runs their ctest checks
#                            instead of the whole ctest, mha-bench --quick
#   --bundle DIR             the dependencies gathered by scripts/gpu-bundle.sh
#                            (default .gpu-bundle)
#   --build-dir DIR          default build-gpu
#   --jobs N                 parallel compile and test jobs (default: nproc)
#   --torch-prefix DIR       LibTorch's CMake prefix; default: python3 -c
#                            'import torch; print(torch.utils.cmake_prefix_path)'
#                            (without a python3 torch: CMake's own search)
#   -h, --help               this text
#
# Before: on a machine with the Debian packages (scripts/setup.sh), run
# scripts/gpu-bundle.sh and bring the tree with .gpu-bundle along.
# The report goes to $OUT/gpu-report.txt when OUT is set, else to
# BUILD_DIR/gpu-report.txt; the JSON of each mha-parity and mha-bench run
# lies beside it. Exit status: 0 when every step passed, 1 when one failed or
# was stopped by the budget, 2 on bad usage or a missing prerequisite.
#
# Example (GPU machine, 16 cores): scripts/gpu-check.sh
# Example (the CPU proof, 2 cores): scripts/gpu-check.sh --device cpu --quick
set -uo pipefail

usage() { sed -n '2,/^set -uo/{/^set -uo/d;s/^# \{0,1\}//;p}' "$0"; }
die() { echo "gpu-check: error: $*" >&2; exit 2; }

root=$(cd "$(dirname "$0")/.." && pwd)
device=auto budget=480 quick=0 jobs=$(nproc)
bundle=$root/.gpu-bundle build=$root/build-gpu torch_prefix=
while [[ $# -gt 0 ]]; do
  case $1 in
    --device) device=${2:?}; shift 2 ;;
    --budget) budget=${2:?}; shift 2 ;;
    --quick) quick=1; shift ;;
    --bundle) bundle=$(realpath -m "${2:?}"); shift 2 ;;
    --build-dir) build=$(realpath -m "${2:?}"); shift 2 ;;
    --jobs) jobs=${2:?}; shift 2 ;;
    --torch-prefix) torch_prefix=$(realpath -m "${2:?}"); shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument $1" ;;
  esac
done
[[ $device =~ ^(cuda|cpu|auto)$ ]] || die "--device must be cuda, cpu or auto"
[[ $budget =~ ^[0-9]+$ && $jobs =~ ^[0-9]+$ ]] ||
  die "--budget and --jobs take whole numbers"
[[ -e $bundle/lib/cmake/fmt/fmtConfig.cmake ]] ||
  die "no bundle in $bundle: run scripts/gpu-bundle.sh on a machine with" \
      "the Debian packages first"
command -v cmake >/dev/null || die "cmake is missing"

start=$SECONDS
mkdir -p "$build"
report_dir=${OUT:-$build}
mkdir -p "$report_dir"
report=$report_dir/gpu-report.txt
log=$build/gpu-check.log
: >"$log"
failures=0
summary=()

# note TEXT: a line in the report and on the terminal.
note() { echo "$*" | tee -a "$report"; }
elapsed() { echo $((SECONDS - start)); }
# step NAME SECONDS COMMAND...: runs COMMAND under a time limit, its output
# to the terminal and the log (and the report when to_report=1), and records
# its outcome for the summary.
to_report=0
step() {
  local name=$1 limit=$2 began=$SECONDS rc
  shift 2
  local copies=("$log")
  [[ $to_report == 1 ]] && copies+=("$report")
  echo "=== $name (limit ${limit} s): $*" | tee -a "${copies[@]}"
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "${copies[@]}"
  rc=${PIPESTATUS[0]}
  local outcome="ok"
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    outcome="STOPPED at the ${limit} s limit"
  elif [[ $rc -ne 0 ]]; then
    outcome="FAILED (exit $rc)"
  fi
  [[ $outcome == ok ]] || failures=$((failures + 1))
  summary+=("$(printf '%-28s %-34s %5d s' "$name" "$outcome" $((SECONDS - began)))")
  return "$rc"
}
# share PERCENT: that share of the budget left, at least 30 s.
share() {
  local s=$(((budget - $(elapsed)) * $1 / 100))
  echo $((s < 30 ? 30 : s))
}

# 1. The machine, PyTorch and the compilers.
: >"$report"
note "gpu-check: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n), $(nproc) CPUs, budget ${budget} s"
python=$(command -v python3 || true)
torch_info=
if [[ -n $python ]]; then
  torch_info=$("$python" - 2>/dev/null <<'EOF'
import torch
cuda = torch.cuda.is_available()
print(torch.__version__)
print(torch.utils.cmake_prefix_path)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(1 if cuda else 0)
print(torch.cuda.get_device_name(0) if cuda else "none")
EOF
  ) || torch_info=
fi
abi=1
if [[ -n $torch_info ]]; then
  mapfile -t t <<<"$torch_info"
  note "PyTorch:  ${t[0]} ($python); CMake prefix ${t[1]}; CXX11 ABI ${t[2]}; GPU: ${t[4]}"
  [[ -n $torch_prefix ]] || torch_prefix=${t[1]}
  abi=${t[2]}
  cuda_seen=${t[3]}
else
  note "PyTorch:  no python3 with torch; LibTorch from ${torch_prefix:-the default CMake search}"
  cuda_seen=0
  command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1 && cuda_seen=1
fi
if [[ $device == auto ]]; then
  device=cpu
  [[ $cuda_seen == 1 ]] && device=cuda
fi
note "Device:   $device$( [[ $device == cpu ]] && echo ' (no GPU: the CPU path)')"
command -v nvidia-smi >/dev/null &&
  note "nvidia-smi: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | head -n 1)"
note "CMake:    $(cmake --version | head -n 1); compiler $(${CXX:-c++} --version 2>&1 | head -n 1)"
command -v nvcc >/dev/null && note "nvcc:     $(nvcc --version | tail -n 1)"
note "Bundle:   $bundle ($(head -n 1 "$bundle/MANIFEST" 2>/dev/null))"

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# Every CMake run, the nested ones of the consumer tests too, finds the
# bundle's packages, googletest and LibTorch through this (the environment
# variable takes ':' between entries), ahead of any system package.
export CMAKE_PREFIX_PATH="$bundle:$build/deps${torch_prefix:+:$torch_prefix}"
cuda_hint=()
if [[ $device == cuda ]] && command -v nvcc >/dev/null; then
  cuda_hint=(-DCUDAToolkit_ROOT="$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")")
fi

# 2. googletest from the bundle's sources, with LibTorch's C++ ABI (its
# std::string in gtest's API must match the tests').
if [[ ! -e $build/deps/lib/cmake/GTest/GTestConfig.cmake && ! -e $build/deps/lib64/cmake/GTest/GTestConfig.cmake ]]; then
  step googletest 600 sh -c "cmake -S '$bundle/src/googletest' -B '$build/gtest' ${generator[*]} \
      -DCMAKE_BUILD_TYPE=Release -DBUILD_GMOCK=OFF -DINSTALL_GTEST=ON \
      -DCMAKE_INSTALL_PREFIX='$build/deps' -DCMAKE_INSTALL_LIBDIR=lib \
      -DCMAKE_CXX_FLAGS=-D_GLIBCXX_USE_CXX11_ABI=$abi >/dev/null &&
    cmake --build '$build/gtest' -j $jobs && cmake --install '$build/gtest' >/dev/null" ||
    { note "googletest did not build: see $log"; }
fi

# 3. Configure and build mha (library, tools, tests).
step configure 600 cmake -S "$root" -B "$build" "${generator[@]}" \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
  "${cuda_hint[@]}"
built=$?
if [[ $built -eq 0 ]]; then
  # The dependencies must come from the bundle, not from packages that
  # happen to be installed.
  for pkg in fmt CLI11 nlohmann_json GTest Torch; do
    dir=$(sed -n "s/^${pkg}_DIR:[A-Z]*=//p" "$build/CMakeCache.txt")
    note "$(printf '%-14s %s' "$pkg" "$dir")"
    if [[ $pkg != Torch && $dir != "$bundle"* && $dir != "$build/deps"* ]]; then
      note "  not from the bundle: a system package was found instead"
      failures=$((failures + 1))
    fi
  done
  targets=()
  [[ $quick == 1 ]] && targets=(--target mha-parity mha-bench)
  step build 1800 cmake --build "$build" -j "$jobs" "${targets[@]}"
  built=$?
fi
note "Build done after $(elapsed) s"

# 4. The tests, the parity tool and the benchmark, in the time left.
if [[ $built -eq 0 ]]; then
  tests=(-E '^(consumer|package)\.')  # packaging, not the GPU: slow rebuilds
  [[ $quick == 1 ]] && tests=(-R '^(mha_parity|mha_bench)\.')
  step "ctest" "$(share 40)" ctest --test-dir "$build" -j "$jobs" \
    --output-on-failure --timeout 300 "${tests[@]}"
  # Its verdict lines in the report (the whole output is in the log).
  sed -n '/^=== ctest/,$p' "$log" |
    grep -E 'tests passed|tests failed|\(Failed\)|\(Timeout\)|Not Run' >>"$report"
  to_report=1

  for dtype in float32 bfloat16; do
    percent=25
    [[ $dtype == bfloat16 ]] && percent=30
    step "mha-parity $device $dtype" "$(share $percent)" \
      "$build/tools/mha-parity" --device "$device" --dtype "$dtype" \
      --json "$report_dir/parity-$device-$dtype.json"
  done

  bench_args=(--variants window --budget 0.5)
  [[ $quick == 1 ]] && bench_args=(--quick --variants none)
  [[ $device == cuda ]] || bench_args+=(--threads "$(nproc)")
  for dtype in float32 bfloat16; do
    percent=50
    [[ $dtype == bfloat16 ]] && percent=100
    step "mha-bench $device $dtype" "$(share $percent)" \
      "$build/tools/mha-bench" --device "$device" --dtype "$dtype" \
      "${bench_args[@]}" --json "$report_dir/bench-$device-$dtype.json"
  done
fi

# 5. The summary at the top of what a reader looks for: the outcome of each
# step, then the tables (already in the report above it).
{
  echo
  echo "Steps (total $(elapsed) s of the ${budget} s budget):"
  [[ $(elapsed) -le $budget ]] ||
    echo "  (over the budget: the build is not limited by it, each later step got at least 30 s)"
  printf '  %s\n' "${summary[@]}"
  if [[ $failures -eq 0 ]]; then
    echo "gpu-check: PASSED"
  else
    echo "gpu-check: FAILED ($failures step(s) failed or stopped; log $log)"
  fi
} | tee -a "$report"
[[ -n ${OUT:-} ]] && cp "$log" "$OUT/"
echo "report: $report"
[[ $failures -eq 0 ]]
