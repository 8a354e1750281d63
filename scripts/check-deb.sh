#!/usr/bin/env bash
# The Debian package proven on a fresh Debian 12: builds mha's .deb (setup,
# cmake, cpack -G DEB), removes the build-time packages the .deb must pull in
# by itself (libtorch-dev, libopenblas0-pthread), installs the .deb with apt
# (which must resolve them from its Depends), then builds and runs against
# the installed /usr files, outside this tree: a find_package(mha) consumer,
# a `pkg-config --cflags --libs mha` consumer (one g++ command line) and the
# five programs of examples/; and prints the tools' --version.
#
# Run it on a scratch machine only (it purges packages), e.g.
#   /work/shared/tools/fresh-machine.sh "$PWD" -- scripts/check-deb.sh
# It refuses to run where libtorch-dev is installed before it starts (not a
# fresh machine) unless given --force.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=$PWD
step() { echo; echo "=== check-deb: $*"; }
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }

if [[ ${1:-} != --force ]] && installed libtorch-dev; then
  echo "check-deb: libtorch-dev is installed already: not a fresh machine." >&2
  echo "check-deb: this script purges packages; run it through fresh-machine.sh, or pass --force." >&2
  exit 2
fi
[[ $(id -u) -eq 0 ]] || { echo "check-deb: run as root (apt-get)" >&2; exit 2; }
export DEBIAN_FRONTEND=noninteractive
echo "check-deb: $(. /etc/os-release && echo "$PRETTY_NAME"), $(nproc) cores"

step "setup and build (library and tools, no tests)"
scripts/setup.sh
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DMHA_BUILD_TESTS=OFF
cmake --build build -j"$(nproc)"

step "cpack -G DEB"
(cd build && cpack -G DEB)
debs=(build/mha_*.deb)
[[ ${#debs[@]} -eq 1 && -f ${debs[0]} ]] || { echo "check-deb: expected one build/mha_*.deb, got: ${debs[*]}" >&2; exit 1; }
deb=${debs[0]}
dpkg-deb -I "$deb"
echo "Depends line: $(dpkg-deb -f "$deb" Depends)"

step "purge what the package must pull in by itself"
apt-get purge -y -qq --auto-remove libtorch-dev libopenblas0-pthread >/dev/null
for p in libtorch-dev libopenblas0-pthread; do
  if installed "$p"; then echo "check-deb: $p is still installed after purge" >&2; exit 1; fi
done
echo "libtorch-dev and libopenblas0-pthread are not installed"

step "apt install ./$deb"
apt-get install -y -qq "./$deb" >/dev/null
for p in mha libtorch-dev libopenblas0-pthread; do
  installed "$p" || { echo "check-deb: $p is not installed after apt install" >&2; exit 1; }
  echo "installed: $p $(dpkg-query -W -f='${Version}' "$p")"
done
dpkg -L mha | grep -E '(libmha|mha-config|mha\.pc|/mha\.h|bin/)' | sort

# Everything below uses copies outside the tree and the files under /usr.
work=$(mktemp -d /tmp/check-deb.XXXXXX)
cp -r "$tree/tests/consumer" "$tree/examples" "$work/"
mkdir -p "$work/checkpoint"
cp "$tree"/tests/fixtures/hf/llama/{config.json,model.safetensors,reference.safetensors} "$work/checkpoint/"
cd "$work"

step "tools: --version"
for tool in mha-parity mha-bench mha-train; do
  echo "$(command -v "$tool"): $("$tool" --version)"
done

step "consumer with find_package(mha)"
cmake -S consumer -B consumer-build -DCMAKE_BUILD_TYPE=Release >/dev/null
grep -E '^mha_DIR:' consumer-build/CMakeCache.txt
cmake --build consumer-build -j"$(nproc)"
consumer-build/consumer
consumer-build/consumer_train

step "consumer with pkg-config --cflags --libs mha"
echo "pkg-config --cflags --libs mha: $(pkg-config --cflags --libs mha)"
# shellcheck disable=SC2046  # the flags are meant to split
g++ -O1 consumer/main.cpp $(pkg-config --cflags --libs mha) -o consumer-pkg-config
./consumer-pkg-config

step "examples/ against the installed package"
cmake -S examples -B examples-build -DCMAKE_BUILD_TYPE=Release \
  -DMHA_EXAMPLE_HF_DIR="$work/checkpoint" -DMHA_EXAMPLE_HF_LAYER=1 \
  -DMHA_EXAMPLE_HF_REFERENCE="$work/checkpoint/reference.safetensors" >/dev/null
cmake --build examples-build -j"$(nproc)"
ctest --test-dir examples-build --no-tests=error -V

step "all checks passed"
