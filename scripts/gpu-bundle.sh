#!/usr/bin/env bash
# gpu-bundle.sh — gather the build dependencies that a GPU machine without
# network or Debian packages lacks, into one folder that travels with the
# tree; scripts/gpu-check.sh builds against it.
#
# Usage: scripts/gpu-bundle.sh [DIR]
#   DIR  the bundle (default: .gpu-bundle in the repository root; ignored
#        by git). Run on a machine where scripts/setup.sh installed the
#        Debian packages; copy the tree with DIR to the GPU machine.
#
# What the bundle holds (about 6 MB), all from this machine's packages:
#   include/CLI, include/nlohmann, include/fmt   the headers of libcli11-dev,
#        nlohmann-json3-dev and libfmt-dev (fmt is used header-only there:
#        FMT_HEADER_ONLY, so no libfmt.so has to match)
#   src/googletest   googletest's sources (Debian's googletest), built by
#        gpu-check.sh with LibTorch's _GLIBCXX_USE_CXX11_ABI
#   lib/cmake/{CLI11,nlohmann_json,fmt}   small CMake package files that
#        define the targets mha's CMakeLists.txt links (CLI11::CLI11,
#        nlohmann_json::nlohmann_json, fmt::fmt) on the headers above, with
#        the versions read from those headers
#   MANIFEST   where each part came from, and its version
# LibTorch itself is not bundled: the GPU machine has its pip PyTorch.
#
# Environment: INCLUDE_DIR (default /usr/include) and GTEST_SRC (default
# /usr/src/googletest) name other places to copy from.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
bundle=${1:-$root/.gpu-bundle}
include_dir=${INCLUDE_DIR:-/usr/include}
gtest_src=${GTEST_SRC:-/usr/src/googletest}

die() { echo "gpu-bundle: error: $*" >&2; exit 1; }
for need in "$include_dir/CLI/CLI.hpp" "$include_dir/nlohmann/json.hpp" \
            "$include_dir/fmt/format-inl.h" "$gtest_src/CMakeLists.txt"; do
  [[ -e $need ]] || die "$need is missing (Debian: apt-get install" \
    "libcli11-dev nlohmann-json3-dev libfmt-dev googletest)"
done

# The version a header states: first match of a sed expression.
header_version() { sed -n "$2" "$1" | head -n 1; }
cli11_version=$(header_version "$include_dir/CLI/Version.hpp" \
  's/^#define CLI11_VERSION "\([0-9.]*\)".*/\1/p')
fmt_number=$(header_version "$include_dir/fmt/core.h" \
  's/^#define FMT_VERSION \([0-9]*\).*/\1/p')
fmt_version=$((fmt_number / 10000)).$((fmt_number / 100 % 100)).$((fmt_number % 100))
json_macros=$include_dir/nlohmann/detail/abi_macros.hpp
[[ -e $json_macros ]] || json_macros=$include_dir/nlohmann/json.hpp
json_version=$(for part in MAJOR MINOR PATCH; do
  header_version "$json_macros" \
    "s/^#define NLOHMANN_JSON_VERSION_$part \([0-9]*\).*/\1/p"
done | paste -sd.)
[[ -n $cli11_version && -n $json_version && $fmt_number -gt 0 ]] ||
  die "could not read the versions from the headers in $include_dir"

rm -rf "$bundle"
mkdir -p "$bundle/include" "$bundle/src" "$bundle/lib/cmake"
cp -r "$include_dir/CLI" "$include_dir/nlohmann" "$include_dir/fmt" \
  "$bundle/include/"
cp -r "$gtest_src" "$bundle/src/googletest"

# package NAME VERSION TARGET [COMPILE_DEFINITIONS]: a config and a version
# file that make find_package(NAME [VERSION]) define the INTERFACE target
# TARGET on the bundle's headers.
package() {
  local name=$1 version=$2 target=$3 definitions=${4:-}
  local dir=$bundle/lib/cmake/$name
  mkdir -p "$dir"
  cat >"$dir/${name}Config.cmake" <<EOF
# Written by scripts/gpu-bundle.sh: $name $version, header-only, from the
# headers in ../../../include.
get_filename_component(_bundle_root "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET $target)
  add_library($target INTERFACE IMPORTED)
  set_target_properties($target PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "\${_bundle_root}/include"
    INTERFACE_COMPILE_DEFINITIONS "$definitions")
endif()
unset(_bundle_root)
EOF
  cat >"$dir/${name}ConfigVersion.cmake" <<EOF
# Written by scripts/gpu-bundle.sh: any request up to $version matches.
set(PACKAGE_VERSION "$version")
if(PACKAGE_FIND_VERSION AND PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION STREQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
EOF
}
package CLI11 "$cli11_version" CLI11::CLI11
package nlohmann_json "$json_version" nlohmann_json::nlohmann_json
package fmt "$fmt_version" fmt::fmt "FMT_HEADER_ONLY=1"

{
  echo "# scripts/gpu-bundle.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), on $(uname -n)"
  echo "CLI11 $cli11_version: $include_dir/CLI"
  echo "nlohmann_json $json_version: $include_dir/nlohmann"
  echo "fmt $fmt_version (header-only): $include_dir/fmt"
  echo "googletest: $gtest_src"
  if command -v dpkg-query >/dev/null; then
    dpkg-query -W -f='package ${Package} ${Version}\n' libcli11-dev \
      nlohmann-json3-dev libfmt-dev googletest 2>/dev/null || true
  fi
} >"$bundle/MANIFEST"
echo "gpu-bundle: $bundle ($(du -sh "$bundle" | cut -f1)):" \
  "CLI11 $cli11_version, nlohmann_json $json_version, fmt $fmt_version," \
  "googletest sources"
