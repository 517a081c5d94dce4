#!/usr/bin/env bash
# gpu13: fill DEST (default /work/main/.gpu3, ignored there) with what the device calls
# carry: src-main/kvtrio (git archive of main, without docs/ and tests/), src-load13 where
# branch load13 has commits beyond main, build_model.py (docs/h200-gpu9), this folder's
# scripts.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=${REPO:-/work/main}; dest=${1:-$repo/.gpu3}
rm -rf "$dest" && mkdir -p "$dest"
tree() {  # tree NAME REF
  mkdir -p "$dest/src-$1/kvtrio"
  git -C "$repo" archive "$2" -- . ':!docs' ':!tests' | tar -x -C "$dest/src-$1/kvtrio"
  git -C "$repo" rev-parse --short "$2" > "$dest/src-$1/REV"
}
tree main main
if [ -n "$(git -C "$repo" log --oneline main..load13 2>/dev/null)" ]; then tree load13 load13; fi
git -C "$repo" show main:docs/h200-gpu9/build_model.py > "$dest/build_model.py"
cp "$here"/*.py "$here"/*.sh "$dest/"
du -sh "$dest"; ls "$dest"
