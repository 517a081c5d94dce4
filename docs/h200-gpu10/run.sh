#!/usr/bin/env bash
# Usage (from the repo root, MLX on PYTHONPATH):
#   bash .gpu10/run.sh [build] NAME:SECONDS:ARGS...
# build: write the SmolLM2-135M-shaped model to $MODEL (default $HOME/smol135m) first.
# kvtrio is imported from .gpu10/src (a copy of branch gpu10's tree) when it is there, else
# from the checkout. Each NAME:SECONDS:ARGS runs `timeout SECONDS python3 -m kvtrio bench
# serve --json --model $MODEL --dir $WORK/NAME ARGS` into $OUT/NAME.json (stderr NAME.err);
# the kept servers.log and the stderr files go to $OUT/logs-NAME.tar.gz.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
PY=${PY:-python3}
MODEL=${MODEL:-$HOME/smol135m}
OUT=${OUT:-/tmp/gpu10out}
WORK=${WORK:-/tmp/gpu10work}
mkdir -p "$OUT" "$WORK"
if [ -d .gpu10/src/kvtrio ]; then
  export PYTHONPATH=$PWD/.gpu10/src${PYTHONPATH:+:$PYTHONPATH}
else
  mkdir -p /tmp/gpu10pp && ln -sfn "$PWD" /tmp/gpu10pp/kvtrio
  export PYTHONPATH=/tmp/gpu10pp${PYTHONPATH:+:$PYTHONPATH}
fi
echo "mlx $($PY -c 'import mlx.core as mx; print(mx.__version__, mx.default_device())')" \
     "mlx_lm $($PY -c 'import mlx_lm; print(mlx_lm.__version__)')" \
     "kvtrio $($PY -c 'import kvtrio, os; print(os.path.dirname(kvtrio.__file__))')" \
     "rev $(cat .gpu10/src/REV 2>/dev/null || git rev-parse --short HEAD 2>/dev/null)" \
     "load $(cut -d' ' -f1-3 /proc/loadavg)"
if [ "${1:-}" = build ]; then
  shift
  if [ ! -f "$MODEL/config.json" ]; then
    # .gpu10/build_model.py was a copy of docs/h200-gpu9/build_model.py (the same file)
    timeout ${BUILD_S:-240} $PY .gpu10/build_model.py "$MODEL" ${DTYPE:-float16} | tee "$OUT/model.json" || exit 1
  else
    echo "model already at $MODEL"
  fi
fi
for spec in "$@"; do
  name=${spec%%:*}; rest=${spec#*:}; secs=${rest%%:*}; args=${rest#*:}
  echo "== $name ($secs s): $args; $(date -u +%T), load $(cut -d' ' -f1-3 /proc/loadavg)"
  t0=$(date +%s)
  mkdir -p "$WORK/$name"
  if [ -n "${TRACE:-}" ]; then  # gpu10trace in every server (trace/sitecustomize.py)
    export KVTRIO_TRACE_DIR=$WORK/$name/traces
    case ":$PYTHONPATH:" in *":$PWD/.gpu10/trace:"*) ;; *) export PYTHONPATH=$PWD/.gpu10/trace:$PYTHONPATH;; esac
  fi
  timeout "$secs" $PY -m kvtrio bench serve --json --model "$MODEL" --dir "$WORK/$name" $args \
    > "$OUT/$name.json" 2> "$WORK/$name/bench.err"
  rc=$?
  echo "== $name rc=$rc in $(( $(date +%s) - t0 )) s"
  tail -c 1200 "$WORK/$name/bench.err"
  $PY .gpu10/summary.py "$OUT/$name.json" || true
  [ -n "${TRACE:-}" ] && $PY .gpu10/analyze.py "$WORK/$name/traces" | tee "$WORK/$name/analysis.txt"
  [ -n "${KVTRIO_TRACE_STALLS:-}" ] && $PY .gpu10/stalls.py "$WORK/$name/traces" | tee -a "$WORK/$name/analysis.txt"
  (cd "$WORK/$name" && find . -name servers.log -o -name bench.err -o -name 'trace*.jsonl' -o -name analysis.txt | tar czf "$OUT/logs-$name.tar.gz" -T -) || true
done
