#!/usr/bin/env bash
# gpu12, batch 1, second work call: (b) turn 2 after a restart at 4,096 tokens with
# --restart-warmup, B_ROUNDS rounds, kvtrio serve's bench on main (mlx_lm, naive, kvtrio).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=$PWD/.gpu3; MODEL=$HOME/smol135m; W=/tmp/g12; OUT=${OUT:-/tmp/g12out}
mkdir -p "$W/restart" "$OUT"
export PYTHONPATH=$G/src-main${PYTHONPATH:+:$PYTHONPATH}
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/env.txt"; }
if [ ! -f "$MODEL/config.json" ]; then
  note "build model"
  timeout 150 python3 $G/src-main/kvtrio/docs/h200-gpu9/build_model.py "$MODEL" float16 > "$OUT/model.json" || exit 1
  python3 -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$OUT/env.txt"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$OUT/env.txt" 2>&1
fi
note "b: restart ${B_ROUNDS:-6} rounds, main=$(cat $G/src-main/REV)"
timeout ${B_S:-560} python3 -m kvtrio bench serve --json --model "$MODEL" --dir $W/restart \
  --phases restart --lengths 4096 --restart-rounds ${B_ROUNDS:-6} --restart-warmup \
  > "$OUT/restart.json" 2> $W/restart.err
note "b rc=$?"; tail -c 400 $W/restart.err
python3 $G/analyze.py "$OUT/restart.json" | tee "$OUT/restart.txt"
(cd $W && find restart -name servers.log | tar czf "$OUT/logs1b.tar.gz" -T - restart.err) || true
