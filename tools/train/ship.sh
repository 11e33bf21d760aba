#!/usr/bin/env bash
# Exports a checkpoint into tests/data/kvllama3M/ (GGUF F16, sha256, the worker's dumps of a train
# text and a held-out text, PyTorch's per-token surprisal of the held-out one) and checks the
# worker against PyTorch. Run from the repository root after deploy/build.sh kvtrie-worker:
#   tools/train/ship.sh /work/train-run/cpu/ckpt.pt /work/train-run/data
set -euo pipefail
ckpt=$1 data=$2
out=tests/data/kvllama3M
worker=build/client/worker/kvtrie-worker
py=/usr/bin/python3
mkdir -p "$out"
$py tools/train/export_gguf.py --ckpt "$ckpt" --tokenizer "$data/tok.model" \
  --out "$out/kvllama3M.gguf" --name kvllama3M
(cd "$out" && sha256sum kvllama3M.gguf > kvllama3M.gguf.sha256)
# Zephaniah is held out (a whole book of the KJV); Genesis 1-3 is in the train split and is the
# text of stories260K's genesis_1-3 dump.
$py - "$data" "$out/zephaniah.txt" <<'PY'
import json, sys
for line in open(sys.argv[1] + "/heldout.jsonl"):
    r = json.loads(line)
    if r["path"] == "/usr/lib/bible.data#Zephaniah":
        open(sys.argv[2], "w").write(r["text"][:3000])
PY
$py tools/train/verify_worker.py --model "$out/kvllama3M.gguf" --worker "$worker" \
  --text_file "$out/zephaniah.txt" --max_tokens 512 \
  --write_reference "$out/zephaniah_pytorch_surprisal.txt"
for t in zephaniah:"$out/zephaniah.txt" genesis_1-3:tests/data/texts/genesis_1-3.txt; do
  "$worker" dump --model="$out/kvllama3M.gguf" --text_file="${t#*:}" --out="$out/${t%%:*}" \
    --max_tokens=512 --max_chars=3000
done
