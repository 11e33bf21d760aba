#!/usr/bin/env bash
# How the texts in bench/texts/ were collected (run once on a Debian 12 machine; CI does not run
# it: the texts are committed, since CI's machine may lack man pages). Usage:
#   bench/texts/collect_texts.sh BUILD_DIR     (BUILD_DIR holds client/worker/kvtrie-worker)
# Each text is cut to at most 8,000 characters. split.tsv names each text's side (train / test):
# the split is by TEXT, never by window of one text.
set -euo pipefail
build="$(cd "${1:?usage: collect_texts.sh BUILD_DIR}" && pwd)"
cd "$(dirname "$0")"
tmp="$(mktemp)"
trap 'rm -f "$tmp"' EXIT
cut8k() {
  cat > "$tmp"
  /usr/bin/python3 -c 'import sys; sys.stdout.write(open(sys.argv[1], "rb").read()[:8000].decode("utf-8", "ignore"))' "$tmp"
}
: > split.tsv
add() {  # name side source < text
  cut8k > "$1.txt"
  printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> split.tsv
}
for l in Apache-2.0 Artistic BSD CC0-1.0 GFDL-1.3 GPL-1 GPL-2 LGPL-2.1 MPL-1.1; do
  add "license_$l" train "/usr/share/common-licenses/$l" < "/usr/share/common-licenses/$l"
done
for l in LGPL-3 MPL-2.0; do
  add "license_$l" test "/usr/share/common-licenses/$l" < "/usr/share/common-licenses/$l"
done
train_docs="bash coreutils curl git gcc-12 libc6 make openssl perl python3.11 rsync sed tar zstd
            cmake less procps findutils grep gawk"
test_docs="ccache ninja-build"
for d in $train_docs; do
  f="/usr/share/doc/$d/copyright"
  [ -f "$f" ] && add "copyright_$d" train "$f" < "$f"
done
for d in $test_docs; do
  f="/usr/share/doc/$d/copyright"
  [ -f "$f" ] && add "copyright_$d" test "$f" < "$f"
done
for m in ls grep tar bash find sed ssh git cmake make ps top cp chmod; do
  { MANWIDTH=80 man -P cat "$m" 2>/dev/null || true; } | col -b | add "man_$m" train "man $m"
done
for m in curl less mv; do
  { MANWIDTH=80 man -P cat "$m" 2>/dev/null || true; } | col -b | add "man_$m" test "man $m"
done
# The held-out texts of tests/data (their source texts, from the shared data folder).
for t in GPL-3 genesis_1-3 story_prompt; do
  add "$t" test "shared/data/texts/$t.txt" < "../../../shared/data/texts/$t.txt"
done
i=0
while IFS= read -r prompt; do
  side=train
  [ $i -ge 8 ] && side=test
  "$build/client/worker/kvtrie-worker" generate --prompt="$prompt" --steps=480 \
    | add "story_$i" "$side" "kvtrie-worker generate --steps=480 --prompt=\"$prompt\""
  i=$((i + 1))
done <<'PROMPTS'
Once upon a time, there was a little dog named Max.
One day, a girl named Sue went to the park with her mom.
Tom had a big red ball.
The sun was hot and the bird was sad.
Lily wanted to bake a cake for her friend.
There was a tall tree in the garden.
Ben and Mia found a box in the woods.
A little fish lived in a pond.
The cat looked at the moon and smiled.
Sam was scared of the dark.
PROMPTS
