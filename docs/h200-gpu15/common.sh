# gpu15: sourced by batch15.sh. G: the .gpu15 folder (scripts, src-main); MODEL; W: scratch
# (kept on the machine between calls while it stays warm); OUT: what comes back.
# G15_T0 (the call's start, epoch s) and G15_LIMIT (s) bound the call: left() is the
# seconds remaining.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=${G:-$PWD/.gpu15}; MODEL=${MODEL:-$HOME/smol135m}; W=${W:-/tmp/g15}; OUT=${OUT:-/tmp/g15out}
T0=${G15_T0:-$(date +%s)}; LIMIT=${G15_LIMIT:-570}
mkdir -p "$W" "$OUT"
BASE_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH=$G/src-main${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}
left() { echo $(( T0 + LIMIT - $(date +%s) )); }
