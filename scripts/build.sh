#!/usr/bin/env bash
# Installs what is missing, then configures and builds mha (library, tools,
# tests) in ./build. Extra arguments go to the CMake configure step.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/configure.sh "$@"
BUILD_DIR=${BUILD_DIR:-build}
cmake --build "$BUILD_DIR" --parallel "$(nproc)"
