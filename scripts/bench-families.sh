#!/bin/sh
# Compiles and runs scripts/bench_families.cpp (issue 60's MLA and Gated
# DeltaNet targets) against the build tree's libmha.a (scripts/build.sh
# first). Usage: scripts/bench-families.sh [build dir [--versus-transformers]]
# (CXX_STD=c++20 for LibTorch 2.14's headers)
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
build=${1:-$root/build}
shift $(($# > 0 ? 1 : 0))
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
g++ -O2 -std="${CXX_STD:-c++17}" "$root/scripts/bench_families.cpp" -o "$out/bench_families" \
  -I"$root/include" -I/usr/include/torch/csrc/api/include \
  "$build/libmha.a" -ltorch -ltorch_cpu -lc10 -fopenmp -ldl -lpthread
OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} "$out/bench_families" "$@"
