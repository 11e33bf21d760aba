#!/usr/bin/env bash
# Before/after of the fast residual codec (issue 19, "a fast edge codec"): runs the bench of a
# build of `before` (default 7cd3f56: integ's codec with this bench) and of this checkout
# alternately, `runs` times each, and prints every row; take medians per row.
#   bench/fast_codec_before_after.sh /path/to/before/fast_codec_bench [runs=3]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$1
runs=${2:-3}
for i in $(seq "$runs"); do
  for b in "$before" build/bench/fast_codec_bench; do
    echo "== run $i: $b"
    "$b" --skip_bits --repeats=3 --blocks=16 --only="residual fast" | grep '^| residual fast'
  done
done
