#!/usr/bin/env bash
# Configures and builds kvtrie into ./build (CMake + Ninja). Extra arguments go to `ninja`.
# Uses ccache when it is installed (rebuilds and sibling checkouts then reuse objects).
set -euo pipefail
cd "$(dirname "$0")/.."
# Paths inside the checkout are hashed relative to the build directory, and the directory itself
# not, so build/ and client/python/setup.py's build-py-* (both one level down) share objects.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}" CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
launcher=()
command -v ccache >/dev/null 2>&1 && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-RelWithDebInfo}" \
  "${launcher[@]}" >/dev/null
ninja -C build "$@"
