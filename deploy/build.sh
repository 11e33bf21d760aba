#!/usr/bin/env bash
# Configures and builds kvtrie into ./build (CMake + Ninja). Extra arguments go to `ninja`.
set -euo pipefail
cd "$(dirname "$0")/.."
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-RelWithDebInfo}" >/dev/null
ninja -C build "$@"
