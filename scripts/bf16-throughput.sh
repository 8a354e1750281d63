#!/bin/sh
# Compiles and runs scripts/bf16_throughput.cpp: bfloat16 against float32
# products on this CPU (instructions, then oneDNN's GEMMs on one thread).
# Needs a CPU with avx512_bf16. Usage: scripts/bf16-throughput.sh [libdnnl]
set -eu
grep -q avx512_bf16 /proc/cpuinfo || {
  echo "bf16-throughput: this CPU has no avx512_bf16" >&2
  exit 2
}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
g++ -O2 -std=c++17 -mavx512f -mavx512bf16 "$(dirname "$0")/bf16_throughput.cpp" \
  -o "$out/bf16_throughput" -ldl
OMP_NUM_THREADS=1 "$out/bf16_throughput" "$@"
