# gpu14: sourced by batch14*.sh. G: the .gpu3 folder (scripts, src-*); MODEL; W: scratch;
# OUT: what comes back. G14_T0 (the call's start, epoch s) and G14_LIMIT (s) bound the
# call: left() is the seconds remaining.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=${G:-$PWD/.gpu3}; MODEL=${MODEL:-$HOME/smol135m}; W=${W:-/tmp/g14}; OUT=${OUT:-/tmp/g14out}
T0=${G14_T0:-$(date +%s)}; LIMIT=${G14_LIMIT:-590}
mkdir -p "$W" "$OUT"
BASE_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH=$G/src-main${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}
left() { echo $(( T0 + LIMIT - $(date +%s) )); }
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) left $(left)s" | tee -a "$OUT/env.txt"; }
env_once() {
  python3 -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$OUT/env.txt"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$OUT/env.txt" 2>&1
  echo "cores $(nproc); disk $(df -h /tmp | tail -1)" >> "$OUT/env.txt"
}
model() {
  if [ ! -f "$MODEL/config.json" ]; then
    note "build model"
    timeout 150 python3 "$G/build_model.py" "$MODEL" float16 > "$OUT/model.json" || exit 1
  fi
}
