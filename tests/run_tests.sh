#!/usr/bin/env bash
# README command 2: install dependencies, build everything, and run the whole test suite (ctest).
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install_deps.sh --with-node
(cd tests/reflection && npm ci --no-audit --no-fund --loglevel=error)
(cd tests/deploy && npm ci --no-audit --no-fund --loglevel=error)
deploy/build.sh
cd build
ctest --output-on-failure -j2 --timeout 600
