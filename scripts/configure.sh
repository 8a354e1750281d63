#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then configures mha in ./build
# (or $BUILD_DIR; Ninja where installed, Release). Extra arguments go to
# CMake. Called by scripts/build.sh and scripts/docs.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BUILD_DIR=${BUILD_DIR:-build}
generator=()
if command -v ninja >/dev/null && [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  generator=(-G Ninja)
fi
cmake -S . -B "$BUILD_DIR" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "$@" >/dev/null
