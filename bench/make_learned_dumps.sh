#!/usr/bin/env bash
# Makes the real KV dumps of bench/learned_bench from the committed texts of bench/texts/:
#   bench/make_learned_dumps.sh [BUILD_DIR] [WINDOW_CHARS]
# writes BUILD_DIR/learned_dumps/{train,test}/<text>.<k>/ (k.npy, v.npy, manifest.json): window k
# of a text is its characters [k * W, (k + 1) * W) (cut at a space), run from position 0 with BOS,
# at most 512 tokens (stories260K's trained context). train / test follow bench/texts/split.tsv,
# a split by text. Needs BUILD_DIR/client/worker/kvtrie-worker (deploy/build.sh kvtrie-worker).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$(cd "${1:-$root/build}" && pwd)"
window="${2:-2000}"
worker="$build/client/worker/kvtrie-worker"
out="$build/learned_dumps"
rm -rf "$out"
mkdir -p "$out/train" "$out/test"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
while IFS=$'\t' read -r name side source; do
  /usr/bin/python3 - "$root/bench/texts/$name.txt" "$tmp" "$window" <<'PY'
import sys
text = open(sys.argv[1], encoding="utf-8").read()
w = int(sys.argv[3])
k = 0
start = 0
while start < len(text) and len(text) - start >= 200:
    end = min(len(text), start + w)
    if end < len(text):
        cut = text.rfind(" ", start + w // 2, end)
        end = cut if cut > 0 else end
    open(f"{sys.argv[2]}/w{k}.txt", "w", encoding="utf-8").write(text[start:end])
    k += 1
    start = end
if k == 0:
    open(f"{sys.argv[2]}/w0.txt", "w", encoding="utf-8").write(text)
PY
  for f in "$tmp"/w*.txt; do
    k="$(basename "$f" .txt)"
    "$worker" dump --text_file="$f" --out="$out/$side/$name.${k#w}" --max_chars="$window" \
      --max_tokens=512 > /dev/null
    rm -f "$f"
  done
done < "$root/bench/texts/split.tsv"
echo "train: $(ls "$out/train" | wc -l) dumps, test: $(ls "$out/test" | wc -l) dumps in $out"
