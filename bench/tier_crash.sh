#!/bin/sh
# The crash loop of tests/tier_crash_test.cc, longer: SIGKILL a real kvtrie-server at random
# moments during 4 concurrent Put streams, restart, check every acknowledged block bit-exact.
#   bench/tier_crash.sh [rounds=50] [build dir=build]
set -e
KVTRIE_CRASH_ROUNDS="${1:-50}" "${2:-build}/tests/tier_crash_test"
