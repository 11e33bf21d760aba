#!/usr/bin/env bash
# Before/after of the store's one read path (issue 19, trie/block_reader.h): Get RECONSTRUCTED of
# RESIDUAL fast blocks (Llama-3-8B-shaped, 512 tokens, real stories260K values; speed_bench) from
# the kvtrie-server of `before_dir` (a build folder holding server/kvtrie-server, e.g. main's) and
# from this checkout's build, with and without a learned state (--learn_first with a refit after
# 512 tokens, or --learn_predictors=false), interleaved (alternating which server runs first),
# `runs` times each; prints the Get rows.
# Take medians per row.
#   deploy/build.sh -j2 speed_bench kvtrie-server
#   bench/read_path_before_after.sh /path/to/before/build [runs=3] [codec_threads=2]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1
runs=${2:-3}
threads=${3:-2}
for i in $(seq "$runs"); do
  for state in learned none; do
    if [ "$state" = learned ]; then
      flags=(--learn_first --server_flag=--predictor_refit_tokens=512)
    else
      flags=(--server_flag=--learn_predictors=false)
    fi
    servers=("$before" build)
    if [ $((i % 2)) -eq 0 ]; then servers=(build "$before"); fi  # alternate which runs first
    for server in "${servers[@]}"; do
      echo "== run $i, state $state, server $server"
      KVTRIE_SERVER_BINARY_DIR=$(realpath "$server") build/bench/speed_bench --tokens=512 \
        --repeats=1 --codec_threads="$threads" --client_threads=2 --clients=1 --only=get \
        "--modes=RESIDUAL fast (0.1)" "${flags[@]}" 2>&1 |
        grep -E 'Get RECONSTRUCTED of RESIDUAL|Get RESIDUAL of RESIDUAL fast \(0.1\), raw|learned state'
    done
  done
done
