#!/usr/bin/env bash
# README command 2: install dependencies, build everything, and run the whole test suite (ctest),
# then the sanitizer stages (tests/run_sanitizers.sh: ASan + UBSan with the libFuzzer smoke runs,
# then TSan), each in its own build folder. KVTRIE_SANITIZERS=0 skips those stages.
set -euo pipefail
cd "$(dirname "$0")/.."
deploy/install_deps.sh --with-node
(cd tests/reflection && npm ci --no-audit --no-fund --loglevel=error)
(cd tests/deploy && npm ci --no-audit --no-fund --loglevel=error)
deploy/build.sh
(cd build && ctest --output-on-failure -j2 --timeout 600)
if [[ "${KVTRIE_SANITIZERS:-1}" != "0" ]]; then
  tests/run_sanitizers.sh all
fi
