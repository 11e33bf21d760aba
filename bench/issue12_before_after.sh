#!/usr/bin/env bash
# Issue 12, before and after: runs the defects' end-to-end tests of this checkout (built in
# ./build) against the kvtrie-server and kvtrie CLI of another build (default: commit 7bd6e03,
# where the defects were found, built in /work/wt/old7bd/build), then the CLI-level
# reproductions that the tests cannot show against an old server (a new client avoids them, or
# the test needs a flag the old server lacks). The results are in bench/issue12_before_after.md.
#   bench/issue12_before_after.sh [OLD_BUILD_DIR [NEW_BUILD_DIR]]
set -uo pipefail
cd "$(dirname "$0")/.."
old=${1:-/work/wt/old7bd/build}
new=${2:-$PWD/build}
out=${OUT_DIR:-/tmp/kvtrie-issue12}
rm -rf "$out" && mkdir -p "$out"
tmp=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$tmp"' EXIT

# The flags of the fixes that 7bd6e03's server does not know: left out, so that the tests show
# the defect rather than "unknown flag".
drop=put_idle_timeout_seconds,max_inflight_put_bytes_per_namespace,max_concurrent_put_streams,max_threads
echo "== the tests of $(git rev-parse --short HEAD) against $old"
for t in hostile_e2e_test bad_input_matrix_test stress_test; do
  KVTRIE_SERVER_BINARY_DIR=$old KVTRIE_SERVER_DROP_FLAGS=$drop timeout 600 "$new/tests/$t" >"$out/$t.old.log" 2>&1
  rc=$?
  failed=$(grep -o '^\[  FAILED  \] [A-Za-z0-9_]*\.[A-Za-z0-9_]*' "$out/$t.old.log" | sort -u)
  echo "$t: rc $rc, $(grep -c . <<<"$failed") failed ($out/$t.old.log)"
  [[ -n $failed ]] && echo "$failed"
done

# Starts `$1/server/kvtrie-server` on a free port with data in $tmp/$2 and flags ${@:3};
# sets $port.
start() {
  local bin=$1 name=$2
  shift 2
  rm -f "$tmp/$name.port"
  "$bin/server/kvtrie-server" --listen=127.0.0.1:0 --port_file="$tmp/$name.port" \
    --data_dir="$tmp/$name" "$@" >"$tmp/$name.log" 2>&1 &
  for _ in $(seq 300); do [[ -s $tmp/$name.port ]] && break; sleep 0.1; done
  port=$(cat "$tmp/$name.port")
}
cli() { "$bin/client/kvtrie" --target=127.0.0.1:$port "$@"; }

# A 1M-token dump (1 layer, 1 head, head_dim 1) with surprisal: its header alone is ~6 MB.
/usr/bin/python3 - "$tmp/dump1m" <<'PY'
import json, os, sys
import numpy as np
d = sys.argv[1]
os.makedirs(d)
n = 1 << 20
rng = np.random.default_rng(12)
for name in ("k", "v"):
    np.save(f"{d}/{name}.npy", (rng.standard_normal((1, 1, n, 1)) * 0.5).astype(np.float16))
json.dump({"token_ids": rng.integers(0, 16000, n).tolist(),
           "surprisal_bits": (rng.integers(0, 1000, n) / 100).tolist(),
           "layers": 1, "kv_heads": 1, "head_dim": 1, "model_file": "tiny"},
          open(f"{d}/manifest.json", "w"))
PY

for side in old new; do
  bin=${!side}
  echo "== CLI reproductions, $side ($bin)"
  start "$bin" "$side"
  s0=tests/data/sessions/s0
  # 2: a 1M-token Put with surprisal.
  echo "-- 2 1M-token put:"; cli put "$tmp/dump1m" 2>&1 | tail -c 300; echo
  # 3: one Put in namespace a; namespace b's stats.
  cli --namespace=a put "$s0" >/dev/null 2>&1
  echo "-- 3 stats of namespace b after one Put in a:"
  cli --namespace=b stats 2>&1 | grep -iE '"(puts|nodes|lookups|blocks_?stored|blocks_?deduplicated)"'
  cli --namespace=b put "$s0" >/dev/null 2>&1
  echo "-- 3 first node id of namespace b's first Put (after a's 32 nodes):" \
    "$(cli --namespace=b lookup "$s0" 2>&1 | tr -d ' \n' | grep -oiE '"node_?ids":\[[0-9]+')"
  # 7: the stats CLI's histogram.
  echo "-- 7 stats histogram buckets: $(cli stats 2>&1 | grep -c '"count"')"
  kill %1 2>/dev/null; wait 2>/dev/null
  # 5: a second server on the first one's port.
  start "$bin" "$side-a"
  timeout 5 "$bin/server/kvtrie-server" --listen=127.0.0.1:$port --data_dir="$tmp/$side-b" \
    >"$tmp/$side-b.log" 2>&1
  echo "-- 5 second server on port $port: rc $? (124 = it kept serving); $(tail -n1 "$tmp/$side-b.log" | cut -c1-160)"
  kill %1 2>/dev/null; wait 2>/dev/null
  # 7: --memory_bytes with a unit.
  timeout 5 "$bin/server/kvtrie-server" --memory_bytes=1MB --listen=127.0.0.1:0 \
    --data_dir="$tmp/$side-m" >"$tmp/$side-m.log" 2>&1
  echo "-- 7 --memory_bytes=1MB: rc $? (124 = it started); $(head -n1 "$tmp/$side-m.log" | cut -c1-160)"
done
