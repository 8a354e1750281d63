#!/usr/bin/env bash
# The main job: installs what is missing, builds, and runs mha-parity on CPU.
# Arguments go to mha-parity (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/build.sh
BUILD_DIR=${BUILD_DIR:-build}
exec "$BUILD_DIR/tools/mha-parity" "$@"
