#!/usr/bin/env bash
# Runs the test suite and mha-parity in several environments, each through a
# command prefix that runs a command on this checkout there, and prints one
# line per environment: LibTorch version, tests passed/failed, mha-parity.
#
# Usage: scripts/test-matrix.sh [PREFIX ...]
#   PREFIX   a command prefix, one argument each ("" or "host" = this
#            machine); it is evaluated by the shell with the command appended,
#            must start the command in this checkout's root, and must pass the
#            command's exit status back. No PREFIX: this machine alone.
#
# Example (the LibTorch 2.6 and 2.14 chroots of the lab tools):
#   scripts/test-matrix.sh host \
#     "../shared/tools/in-trixie.sh $PWD --" \
#     "../shared/tools/in-trixie.sh -r /opt/sid $PWD --"
#
# Each environment builds in its own directory, build-matrix-<hash of the
# prefix>, and keeps its full log there (matrix.log). Exit status 0 only if
# every environment passed every test and mha-parity.
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ $# -eq 0 ]]; then
  set -- host
fi

summary=()
status=0
for prefix in "$@"; do
  [[ $prefix == host ]] && prefix=""
  id=$(printf '%s' "$prefix" | md5sum | cut -c1-8)
  dir=build-matrix-$id
  mkdir -p "$dir"
  log=$dir/matrix.log
  name=${prefix:-host}
  echo "== $name (build dir $dir, log $log)"
  eval "$prefix env BUILD_DIR=$dir scripts/test.sh" >"$log" 2>&1
  test_rc=$?
  eval "$prefix $dir/tools/mha-parity" >>"$log" 2>&1
  parity_rc=$?
  version=$(sed -n 's/^mha-parity: LibTorch \([^,]*\),.*/\1/p' "$log" | tail -1)
  tests=$(grep -E '^[0-9]+% tests passed' "$log" | tail -1)
  passed=$(sed -n 's/^[0-9]*% tests passed, \([0-9]*\) tests failed out of \([0-9]*\)$/\2 \1/p' <<<"$tests")
  if [[ -n $passed ]]; then
    read -r total failed <<<"$passed"
    tests="$((total - failed)) passed, $failed failed"
  else
    tests="no CTest summary (exit $test_rc)"
  fi
  parity=$(grep -E '^[0-9]+ cases: ' "$log" | tail -1)
  [[ -n $parity ]] || parity="no summary"
  ok=PASS
  if [[ $test_rc -ne 0 || $parity_rc -ne 0 ]]; then
    ok=FAIL
    status=1
  fi
  summary+=("$(printf '%-4s LibTorch %-7s tests: %s; mha-parity (exit %d): %s [%s]' \
    "$ok" "${version:-?}" "$tests" "$parity_rc" "$parity" "$name")")
done

echo
printf '%s\n' "${summary[@]}"
exit $status
