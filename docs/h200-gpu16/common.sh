# gpu16: sourced by batch16.sh. kvtrio is imported from $W/src/kvtrio, unpacked from
# $G/src.tar.xz (stage16.sh: a git archive of REV; the checkout that travels may hold
# uncommitted edits); SRC=DIR imports it from DIR/kvtrio instead. G: the .gpu16 folder;
# MODEL: the float16 model for the spill phase; GGUF: the real model, assembled by the
# `gguf` step; W: scratch (kept on the machine between calls while it stays warm); OUT:
# what comes back. G16_T0 (the call's start, epoch s) and G16_LIMIT (s) bound the call:
# left() is the seconds remaining.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=${G:-$PWD/.gpu16}; W=${W:-/tmp/g16}; OUT=${OUT:-/tmp/g16out}
MODEL=${MODEL:-$HOME/smol135m}; GGUF=${GGUF:-$W/$(cat "$G/gguf.name")}; PY=${PY:-python3}
T0=${G16_T0:-$(date +%s)}; LIMIT=${G16_LIMIT:-570}
mkdir -p "$OUT"
SRC=${SRC:-$W/src}
if [ ! -f "$SRC/kvtrio/REV" ]; then
  rm -rf "$SRC/kvtrio" && mkdir -p "$SRC/kvtrio" && xz -dc "$G/src.tar.xz" | tar x -C "$SRC/kvtrio"
  cp "$G/REV" "$SRC/kvtrio/REV"
fi
BASE_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH=$SRC${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}
left() { echo $(( T0 + LIMIT - $(date +%s) )); }
