#!/usr/bin/env bash
# Installs what is missing, then configures and builds mha (library, tools,
# tests) in ./build. Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
generator=()
if command -v ninja >/dev/null && [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  generator=(-G Ninja)
fi
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
cmake --build "$BUILD_DIR" --parallel "$(nproc)"
