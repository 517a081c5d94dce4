#!/usr/bin/env bash
# gpu15: fill DEST (default /work/main/.gpu15: the device is sent the session's checkout,
# /work/main, where `.gpu*/` is ignored) with what the device calls carry: src-main/kvtrio
# (git archive of REF, default main, without docs/ and tests/; its commit in
# src-main/REV), build_model.py (docs/h200-gpu9) and this folder's scripts.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=${REPO:-/work/main}; dest=${1:-$repo/.gpu15}; ref=${REF:-main}
rm -rf "$dest" && mkdir -p "$dest/src-main/kvtrio"
git -C "$repo" archive "$ref" -- . ':!docs' ':!tests' | tar -x -C "$dest/src-main/kvtrio"
git -C "$repo" rev-parse --short "$ref" > "$dest/src-main/REV"
git -C "$repo" show "$ref:docs/h200-gpu9/build_model.py" > "$dest/build_model.py"
cp "$here"/*.py "$here"/*.sh "$dest/"
du -sh "$dest"; ls "$dest"; cat "$dest/src-main/REV"
