#!/usr/bin/env bash
# The test command: installs what is missing, builds, and runs every test
# with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
cd "$BUILD_DIR"
ctest --output-on-failure --parallel "$(nproc)"
