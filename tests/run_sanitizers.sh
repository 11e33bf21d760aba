#!/usr/bin/env bash
# The sanitizer stages of the test suite (issue 12), run by tests/run_tests.sh after the normal
# suite; alone: tests/run_sanitizers.sh [asan|tsan|all] (default all).
#
#   asan  clang-14, ASan + UBSan (-fno-sanitize-recover) over every kvtrie target but bench/ and the
#         Python module (an instrumented extension cannot load into Debian's python3),
#         plus the libFuzzer targets: ctest in build-asan runs the unit tests, the end-to-end tests
#         (their kvtrie-server is the instrumented one, so a leak or UB in the server fails the
#         test) and a 5 s run of each fuzzer on its seed corpus.
#   tsan  clang-14, TSan: the multi-threaded tests (the store, the Put limits, the end-to-end
#         concurrency stress test, the hostile-input tests) in build-tsan. Debian's abseil is not
#         built for TSan, so tests/tsan_absl_shim.cc is LD_PRELOADed to annotate absl::Mutex.
# Excluded (each runs in the normal stage): in ASan, TierTest.HotBytesNeverExceedTheBudget...,
# which bounds the process's RSS growth (ASan's shadow memory and quarantine are not the store's);
# in TSan, everything but the multi-threaded tests above. Both stages reuse ccache.
set -euo pipefail
cd "$(dirname "$0")/.."
stage=${1:-all}
launcher=()
command -v ccache >/dev/null 2>&1 &&
  launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_C_COMPILER_LAUNCHER=ccache)
common=(-G Ninja -DCMAKE_C_COMPILER=clang-14 -DCMAKE_CXX_COMPILER=clang++-14
  -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -g1 -DNDEBUG"
  -DKVTRIE_BUILD_BENCH=OFF -DKVTRIE_BUILD_PYTHON=OFF "${launcher[@]}")
# RSS bounds are meaningless under ASan (see above).
asan_exclude='^TierTest.HotBytesNeverExceedTheBudget'

build_asan() {
  cmake -S . -B build-asan "${common[@]}" -DKVTRIE_SANITIZE=address -DKVTRIE_BUILD_FUZZERS=ON \
    >/dev/null
  ninja -C build-asan "$@"
}

run_asan() {
  echo "== ASan + UBSan stage (build-asan)"
  build_asan
  export ASAN_OPTIONS=abort_on_error=1:detect_leaks=1:detect_container_overflow=0
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
  export LSAN_OPTIONS="suppressions=$PWD/tests/lsan.supp:print_suppressions=0"
  (cd build-asan && ctest --output-on-failure -j2 --timeout 900 -E "$asan_exclude")
}

run_tsan() {
  echo "== TSan stage (build-tsan)"
  cmake -S . -B build-tsan "${common[@]}" -DKVTRIE_SANITIZE=thread >/dev/null
  ninja -C build-tsan trie_test service_test kvtrie-server kvtrie hostile_e2e_test stress_test \
    callback_e2e_test
  clang++-14 -shared -fPIC -O1 tests/tsan_absl_shim.cc -o build-tsan/libtsan_absl_shim.so -ldl
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp"
  export LD_PRELOAD="$PWD/build-tsan/libtsan_absl_shim.so"
  (cd build-tsan && ctest --output-on-failure -j2 --timeout 900 \
    -R '^(KvStoreTest|ClusterStoreTest|TierTest|PredictorStoreTest|PutLimits|PutSessionTest|Hostile|Stress|CallbackE2E|ValueLogTest|RecordStoreVlogTest)\.' \
    -E '^TierTest.HotBytesNeverExceedTheBudget')
  unset LD_PRELOAD
}

case "$stage" in
  asan) run_asan ;;
  asan-build) shift; build_asan "$@" ;;  # for bench/fuzz_long.sh
  tsan) run_tsan ;;
  all) run_asan && run_tsan ;;
  *) echo "usage: $0 [asan|tsan|all|asan-build [targets]]" >&2; exit 2 ;;
esac
