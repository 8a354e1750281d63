#!/usr/bin/env bash
# Builds the API reference and the guides with Doxygen:
# build/docs/html/index.html (the README is its front page), in the
# doxygen-awesome-css theme where it is installed. Installs what
# is missing and configures ./build (scripts/configure.sh), and prints
# Doxygen's warnings (CTest docs.doxygen fails on any).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/configure.sh
BUILD_DIR=${BUILD_DIR:-build}
cmake --build "$BUILD_DIR" --target docs
log="$BUILD_DIR/docs/doxygen-warnings.log"
if [[ -s $log ]]; then
  cat "$log" >&2
  echo "docs: $(wc -l <"$log") warning lines (above)" >&2
  exit 1
fi
echo "docs: $BUILD_DIR/docs/html/index.html"
