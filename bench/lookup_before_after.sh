#!/bin/bash
# Interleaved before/after Lookup measurements of bench/speed.md "Lookup (path compression)".
# Before: a build of 20a16da (trie_bench copied to /tmp/trie_bench_main; its server and speed_bench
# copied to /tmp/lookup_main/server/kvtrie-server and /tmp/lookup_main/speed_bench_main).
cd "$(dirname "$0")/.."
L=--lookup_tokens=1024,16384,131072,1048576
echo "load at start: $(cat /proc/loadavg)"
for i in 1 2 3; do
  echo "## trie_bench round $i"
  echo "### main"; /tmp/trie_bench_main | grep 1048576
  echo "### lookup"; build/bench/trie_bench | grep 1048576
done
for i in 1 2 3; do
  echo "## e2e round $i"
  echo "### A main bench + main server (learning on)"
  /tmp/lookup_main/speed_bench_main --only=lookup --codec_threads=2 --repeats=3 $L 2>/dev/null | grep "Lookup"
  echo "### B lookup bench + lookup server (learning on)"
  build/bench/speed_bench --only=lookup --codec_threads=2 --repeats=3 $L 2>/dev/null | grep "Lookup"
  echo "### C lookup bench + main server (learning off)"
  KVTRIE_SERVER_BINARY_DIR=/tmp/lookup_main build/bench/speed_bench --only=lookup --codec_threads=2 --repeats=3 $L --server_flag=--learn_predictors=false 2>/dev/null | grep "Lookup"
  echo "### D lookup bench + lookup server (learning off)"
  build/bench/speed_bench --only=lookup --codec_threads=2 --repeats=3 $L --server_flag=--learn_predictors=false 2>/dev/null | grep "Lookup"
done
echo "load at end: $(cat /proc/loadavg)"
