#!/usr/bin/env bash
# Installs the Debian 12 packages mha needs to build, test and run.
# Idempotent: does nothing (and prints nothing) when everything is present.
set -euo pipefail

packages=(
  libtorch-dev          # LibTorch 1.13.1 (CPU)
  libopenblas0-pthread  # fast BLAS for LibTorch (the reference BLAS is ~60x slower)
  libgtest-dev          # GoogleTest
  libfmt-dev            # fmt (tools and src only)
  libcli11-dev          # CLI11 (tool command lines)
  nlohmann-json3-dev    # JSON (safetensors headers, mha-parity --json)
  python3-torch         # Python PyTorch: the state-dict round-trip test
  libgloo-dev           # Gloo headers: c10d data-parallel training (mha-train --nproc)
  pkg-config            # the consumer test built with `pkg-config --cflags --libs mha`
  dpkg-dev file         # dpkg-shlibdeps and file(1) for `cpack -G DEB`
  doxygen               # the API reference and guides (scripts/docs.sh, CTest docs.doxygen)
  doxygen-awesome-css   # their theme (without it: Doxygen's default look)
  clang libomp-dev      # CTest consumer.sources_alone: each library source compiled
                        # on its own, in a fraction of g++'s time (OpenMP as in g++'s build)
  cmake g++ make ninja-build
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "setup: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "setup: done"
