#!/usr/bin/env bash
# Builds the thread test (tests/test_threads.cpp: one module called from 8
# threads at once, compared bit for bit with serial calls) and the library
# with ThreadSanitizer (gcc's -fsanitize=thread) in its own build directory,
# then runs it at the lowest priority. LibTorch, OpenMP (libgomp) and
# OpenBLAS are not instrumented: what TSan reports inside them is
# suppressed by scripts/tsan.supp, one commented entry each. Exit status:
# the test's (TSan's exitcode 66 when it reports a race).
# Usage: scripts/tsan.sh [BUILD_DIR] (default build-tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${1:-build-tsan}
flags="-fsanitize=thread -g -O1 -fno-omit-frame-pointer"
if [[ ! -f $BUILD_DIR/CMakeCache.txt ]]; then
  cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS=-fsanitize=thread \
    -DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=thread \
    -DMHA_BUILD_TOOLS=OFF -DMHA_INSTALL=OFF >/dev/null
fi
nice -n 19 cmake --build "$BUILD_DIR" --target mha_thread_tests -- -j2
export TSAN_OPTIONS="suppressions=$PWD/scripts/tsan.supp exitcode=66 \
second_deadlock_stack=1 history_size=4 ${TSAN_OPTIONS:-}"
nice -n 19 "$BUILD_DIR/tests/mha_thread_tests" "${@:2}"
