#!/usr/bin/env bash
# Copy branch gpu10's package (no tests, docs or venv) and these scripts into
# /work/main/.gpu10 (ignored there), which the device call carries.
set -eu
WT=${WT:-/work/wt-gpu10}
DST=/work/main/.gpu10
mkdir -p "$DST/src"
rm -rf "$DST/src/kvtrio"
(cd "$WT" && git ls-files | grep -v -e '^tests/' -e '^docs/' | tar cf - -T -) \
  | (mkdir -p "$DST/src/kvtrio" && tar xf - -C "$DST/src/kvtrio")
git -C "$WT" rev-parse --short HEAD > "$DST/src/REV"
cp "$WT"/docs/h200-gpu10/*.sh "$WT"/docs/h200-gpu10/*.py "$DST/"
mkdir -p "$DST/trace" && cp "$WT"/docs/h200-gpu10/trace/*.py "$DST/trace/"
du -sh "$DST"
