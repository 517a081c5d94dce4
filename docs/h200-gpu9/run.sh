#!/usr/bin/env bash
# Usage (from the repo root, MLX on PYTHONPATH):
#   bash .gpu9/run.sh [build] NAME:SECONDS:ARGS...
# build: write the SmolLM2-135M-shaped model to $MODEL (default $HOME/smol135m) first.
# Each NAME:SECONDS:ARGS runs `timeout SECONDS python3 -m kvtrio bench serve --json
# --model $MODEL ARGS` and writes its JSON to $OUT/NAME.json (stderr to $OUT/NAME.err).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
MODEL=${MODEL:-$HOME/smol135m}
OUT=${OUT:-/tmp/gpu9out}
mkdir -p "$OUT" /tmp/gpu9pp
ln -sfn "$PWD" /tmp/gpu9pp/kvtrio
export PYTHONPATH=/tmp/gpu9pp${PYTHONPATH:+:$PYTHONPATH}
echo "mlx $($PY -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')" \
     "mlx_lm $($PY -c 'import mlx_lm; print(mlx_lm.__version__)')" \
     "git $(git rev-parse --short HEAD 2>/dev/null)" "load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${1:-}" = build ]; then
  shift
  if [ ! -f "$MODEL/config.json" ]; then
    timeout ${BUILD_S:-240} $PY .gpu9/build_model.py "$MODEL" ${DTYPE:-float16} | tee "$OUT/model.json" || exit 1
  else
    echo "model already at $MODEL"
  fi
fi
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; secs=${rest%%:*}; args=${rest#*:}
  echo "== $name ($secs s): $args; $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  t0=$(date +%s)
  timeout "$secs" $PY -m kvtrio bench serve --json --model "$MODEL" $args \
    > "$OUT/$name.json" 2> "$OUT/$name.err"
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -c 1500 "$OUT/$name.err"
  $PY - "$OUT/$name.json" <<'PYEOF' || true
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no json:", e); sys.exit()
print(json.dumps(d.get("ratios"), indent=None)[:3000])
sp = d.get("spill")
if sp:
    for k, v in sp.items():
        print(k, {x: round(v[x], 2) for x in ("itl_p50_ms_quiet", "itl_p99_ms_quiet", "itl_p99_ms_during", "itl_max_ms_during")}, "samples", v["samples_during"],
              [(r["itl_p99_ms_during"], r["continued_cached_tokens"], r["spilled_while_streaming"], r["samples"]) for r in v["rounds"]])
PYEOF
done
