#!/bin/bash
# bench/verify_sample_ab.sh: the server CPU of an encoded Put under --verify_encoded_puts=structure vs
# sample, interleaved (3 rounds of put_bench, 1 client, 1,024-token prefixes of 2 MiB blocks).
cd "$(dirname "$0")/.."
for r in 1 2 3; do
  for m in structure sample; do
    echo "### round $r verify=$m"
    build/bench/put_bench --modes=encoded,encoded_lossless --clients=1 --repeats=1 --tokens=1024 --server_flags=--verify_encoded_puts=$m 2>&1 | grep -E "^\|" | grep -v -- "---"
  done
done
