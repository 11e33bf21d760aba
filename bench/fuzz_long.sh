#!/usr/bin/env bash
# Long libFuzzer runs of every fuzz target (issue 12), in build-asan (ASan + UBSan):
#   bench/fuzz_long.sh [seconds per target, default 300]
# Each starts from its seed corpus in the repo and keeps what it finds in /tmp/kvtrie-fuzz/NAME
# (crashes as /tmp/kvtrie-fuzz/NAME-crash-*). Prints one table row per target: executions, runs
# per second, coverage (libFuzzer's cov: edges and ft: features), corpus size, and whether it
# found a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-300}
targets=(codec/codec_decode_fuzzer server/put_stream_fuzzer codec/kv_dump_fuzzer
  codec/predictor_state_fuzzer client/residual_chain_fuzzer)
seeds=("" server/fuzz/put_stream_corpus codec/fuzz/kv_dump_corpus
  codec/fuzz/predictor_state_corpus client/fuzz/residual_chain_corpus)
tests/run_sanitizers.sh asan-build "${targets[@]##*/}" >/dev/null
export ASAN_OPTIONS=detect_leaks=1:detect_container_overflow=0
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
printf '| target | seconds | executions | exec/s | cov | ft | corpus | result |\n'
printf '|---|---|---|---|---|---|---|---|\n'
for i in "${!targets[@]}"; do
  t=${targets[$i]}
  name=${t##*/}
  corpus=/tmp/kvtrie-fuzz/$name
  mkdir -p "$corpus"
  log=/tmp/kvtrie-fuzz/$name.log
  rc=0
  "build-asan/$t" -max_total_time="$secs" -timeout=30 -rss_limit_mb=4096 -print_final_stats=1 \
    -artifact_prefix="/tmp/kvtrie-fuzz/$name-" "$corpus" ${seeds[$i]} >"$log" 2>&1 || rc=$?
  execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  rate=$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' || echo 0)
  cov=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  ft=$(grep -o 'ft: [0-9]*' "$log" | tail -1 | grep -o '[0-9]*' || echo 0)
  units=$(ls "$corpus" | wc -l)
  result=$([[ $rc == 0 ]] && echo "no crash" || echo "FAILED (rc $rc, see $log)")
  printf '| %s | %s | %s | %s | %s | %s | %s | %s |\n' "$name" "$secs" "$execs" "$rate" "$cov" \
    "$ft" "$units" "$result"
done
