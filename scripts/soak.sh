#!/usr/bin/env bash
# Soak (issue 22, item 7; not a CTest test): builds tests/soak.cpp and runs
# CALLS (default 100000) forward calls of varied shapes (N 1..4, L 1..97,
# weights on/off, causal on/off, key padding, a windowed ALiBi module) in
# one process at the lowest priority, printing the resident set size every
# EVERY calls (default 10000). A flat rss_kib column after the first
# thousands of calls (allocator caches warm) means no leak.
# Usage: scripts/soak.sh [CALLS] [EVERY]   (BUILD_DIR: default build)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
nice -n 19 cmake --build "$BUILD_DIR" --target mha_soak -- -j2
nice -n 19 "$BUILD_DIR/tests/mha_soak" "${1:-100000}" "${2:-10000}"
