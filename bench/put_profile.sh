#!/usr/bin/env bash
# bench/put_profile.sh BUILD_DIR OUT CLIENTS [REPEATS]: perf over put_bench RAW and its children
# (kvtrie-server, redis-server); writes OUT.data and OUT.top.txt, the kvtrie-server process's
# samples only (shares of that process). Set KVTRIE_SERVER_BINARY_DIR to profile another
# build's server; KVTRIE_PROFILE_MODES=encoded (put_bench --modes) profiles another row. Used for
# bench/speed_put.md.
set -euo pipefail
B=$1 OUT=$2 C=$3 R=${4:-1}
perf record -F 499 -g -o "$OUT.data" -- "$B/bench/put_bench" --repeats="$R" --modes="${KVTRIE_PROFILE_MODES:-raw}" \
  --clients="$C" > "$OUT.bench.txt" 2>&1 &
perf_pid=$!
server=""
for _ in $(seq 1 300); do
  bench=$(pgrep -P "$perf_pid" put_bench || true)
  [[ -n "$bench" ]] && server=$(pgrep -P "$bench" kvtrie-server | head -1 || true)
  [[ -n "$server" ]] && break
  sleep 0.1
done
wait "$perf_pid"
echo "kvtrie-server pid ${server:?did not start}"
perf report -i "$OUT.data" --pid="$server" --percentage relative --no-children \
  --sort dso,symbol -g none --stdio 2>/dev/null | grep -v '^$' | head -45 > "$OUT.top.txt"
