#!/usr/bin/env bash
# Usage (repo root, MLX on PYTHONPATH): bash .gpu11/run.sh [build] NAME:TREE:SECONDS:ARGS...
# TREE: new (.gpu11/src-new = 4ec346f) or old (.gpu11/src-old = f979bb0). Each spec runs
# `timeout SECONDS python3 .gpu11/benchrun.py bench serve --json --model $MODEL --dir
# $WORK/NAME ARGS` with that tree first on PYTHONPATH (bench and every server it starts)
# into $OUT/NAME.json; servers.log and bench.err of all go to $OUT/logs.tar.gz at the end.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
MODEL=${MODEL:-$HOME/smol135m}
OUT=${OUT:-/tmp/gpu11out}
WORK=${WORK:-/tmp/gpu11work}
BASE=${PYTHONPATH:-}
mkdir -p "$OUT" "$WORK"
echo "mlx $($PY -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')" \
     "mlx_lm $($PY -c 'import mlx_lm; print(mlx_lm.__version__)')" \
     "load $(cut -d' ' -f1-3 /proc/loadavg) $(date -u +%T)" | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$OUT/env.txt" 2>&1
if [ "${1:-}" = build ]; then
  shift
  if [ ! -f "$MODEL/config.json" ]; then
    PYTHONPATH=$PWD/.gpu11/src-new${BASE:+:$BASE} timeout ${BUILD_S:-240} $PY docs/h200-gpu9/build_model.py "$MODEL" float16 | tee "$OUT/model.json" || exit 1
  else
    echo "model already at $MODEL"
  fi
fi
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; tree=${rest%%:*}; rest=${rest#*:}
  secs=${rest%%:*}; args=${rest#*:}
  export PYTHONPATH=$PWD/.gpu11/src-$tree${BASE:+:$BASE}
  $PY -c "import kvtrio, importlib.util as u; print(\"kvtrio from\", kvtrio.__file__, \"triesearch\", u.find_spec(\"kvtrio.serve.triesearch\") is not None)"
  echo "== $name [$tree $(cat .gpu11/src-$tree/REV)] ($secs s): $args; $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/env.txt"
  t0=$(date +%s)
  mkdir -p "$WORK/$name"
  timeout "$secs" $PY .gpu11/benchrun.py bench serve --json --model "$MODEL" --dir "$WORK/$name" $args \
    > "$OUT/$name.json" 2> "$WORK/$name/bench.err"
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/env.txt"
  tail -c 600 "$WORK/$name/bench.err"
  $PY .gpu11/summary.py "$OUT/$name.json" || true
  (cd "$WORK" && find . -name servers.log -o -name bench.err | tar czf "$OUT/logs.tar.gz" -T -) || true
done
export PYTHONPATH=$BASE
