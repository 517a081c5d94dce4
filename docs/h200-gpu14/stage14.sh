#!/usr/bin/env bash
# gpu14: fill DEST (default /work/main/.gpu3, ignored there) with what the device calls
# carry: src-main/kvtrio (git archive of main without docs/ and tests/), src-NAME for each
# further branch named in TREES (e.g. TREES="gpu14 cold14"), build_model.py
# (docs/h200-gpu9), the turn12 probe (docs/turn12/probe) and this folder's scripts.
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
for t in ${TREES:-}; do tree "$t" "$t"; done
git -C "$repo" show main:docs/h200-gpu9/build_model.py > "$dest/build_model.py"
mkdir -p "$dest/probe"
for f in sitecustomize.py turn12probe.py; do git -C "$repo" show "main:docs/turn12/probe/$f" > "$dest/probe/$f"; done
cp "$here"/*.py "$here"/*.sh "$dest/"
du -sh "$dest"; ls "$dest"; cat "$dest"/src-*/REV
