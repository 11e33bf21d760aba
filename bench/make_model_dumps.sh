#!/usr/bin/env bash
# Makes bench/paper_bench's dumps for any GGUF from a document-split corpus (issue 29):
#   bench/make_model_dumps.sh MODEL DATA_DIR OUT [N_TEST] [N_TRAIN] [WINDOW_CHARS]
# e.g. bench/make_model_dumps.sh tests/data/kvllama3M/kvllama3M.gguf /work/train-run/data \
#          build/kvllama3M_dumps 34 150
# writes OUT/test/<i>.<doc>.0/ from the first N_TEST documents of DATA_DIR/heldout.jsonl (whole
# documents never trained on; those whose name, extensions stripped, also names a train.jsonl
# document are skipped, as in bench/heldout_bench.cc; so are documents shorter than WINDOW_CHARS)
# and OUT/train/<i>.<doc>.0/ from N_TRAIN documents of DATA_DIR/train.jsonl taken at an even
# stride (the learned state sees only these). Each dump is the document's first WINDOW_CHARS
# characters (default 3000), run from position 0 with BOS, at most 512 tokens (the positions of
# bench/paper.md's tables). Needs build/client/worker/kvtrie-worker.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
model="$1"
data="$2"
out="$3"
n_test="${4:-34}"
n_train="${5:-150}"
window="${6:-3000}"
worker="${KVTRIE_WORKER:-$root/build/client/worker/kvtrie-worker}"
rm -rf "$out"
mkdir -p "$out/train" "$out/test"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
/usr/bin/python3 - "$data" "$tmp" "$n_test" "$n_train" "$window" <<'PY'
import json, os, re, sys
data, tmp, n_test, n_train, window = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])

def key(path):
    base = path.rsplit("/", 1)[-1]
    while "." in base:
        ext = base.rsplit(".", 1)[1]
        if ext in ("gz", "txt", "rst", "html", "htm", "md") or re.fullmatch(r"[0-9][a-z]*", ext):
            base = base.rsplit(".", 1)[0]
        else:
            break
    return base

def name(i, path):
    return "%03d.%s" % (i, re.sub(r"[^A-Za-z0-9_+-]", "_", key(path))[:40])

train = [json.loads(l) for l in open(os.path.join(data, "train.jsonl"), encoding="utf-8")]
train_keys = {key(d["path"]) for d in train}
os.makedirs(os.path.join(tmp, "test"))
os.makedirs(os.path.join(tmp, "train"))
k = 0
for line in open(os.path.join(data, "heldout.jsonl"), encoding="utf-8"):
    d = json.loads(line)
    if k == n_test:
        break
    if key(d["path"]) in train_keys or len(d["text"]) < window:
        continue
    open(os.path.join(tmp, "test", name(k, d["path"])), "w", encoding="utf-8").write(d["text"][:window])
    k += 1
long_train = [d for d in train if len(d["text"]) >= window]
step = max(1, len(long_train) // n_train)
for i, d in enumerate(long_train[::step][:n_train]):
    open(os.path.join(tmp, "train", name(i, d["path"])), "w", encoding="utf-8").write(d["text"][:window])
PY
for side in test train; do
  for f in "$tmp/$side"/*; do
    "$worker" dump --model="$model" --text_file="$f" --out="$out/$side/$(basename "$f").0" \
      --max_chars="$window" --max_tokens=512 > /dev/null
  done
done
echo "train: $(ls "$out/train" | wc -l) dumps, test: $(ls "$out/test" | wc -l) dumps in $out"
