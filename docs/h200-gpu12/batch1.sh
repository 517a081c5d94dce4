#!/usr/bin/env bash
# gpu12, batch 1, first work call (after `source .gpu2/install.sh`): build the
# SmolLM2-135M-shaped float16 model, (a) starts with 1,000 entries on disk (ab.py, naive
# against kvtrio, A_ROUNDS alternated rounds), (c) the 94 MB cold load part by part.
# Everything from .gpu3/src-main (git archive of main) first on PYTHONPATH.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=$PWD/.gpu3; MODEL=$HOME/smol135m; W=/tmp/g12; OUT=${OUT:-/tmp/g12out}
mkdir -p "$W" "$OUT"
export PYTHONPATH=$G/src-main${PYTHONPATH:+:$PYTHONPATH}
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/env.txt"; }
note "batch1 main=$(cat $G/src-main/REV)"
python3 -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$OUT/env.txt" 2>&1
nproc >> "$OUT/env.txt"
if [ ! -f "$MODEL/config.json" ]; then
  timeout 150 python3 $G/src-main/kvtrio/docs/h200-gpu9/build_model.py "$MODEL" float16 > "$OUT/model.json" || exit 1
fi
note "a: start, ${A_ROUNDS:-6} rounds"
timeout ${A_S:-330} python3 $G/ab.py $W/start "$MODEL" ${A_ROUNDS:-6} naive kvtrio > "$OUT/start.jsonl" 2> $W/start.err
note "a rc=$?"; tail -c 400 $W/start.err
python3 $G/seg.py "$OUT/start.jsonl" | tee "$OUT/start.txt"
if [ "${C_SKIP:-0}" != 1 ]; then
  note "c: loadcost"
  timeout ${C_S:-150} python3 -m kvtrio.bench.loadcost --rounds 9 --json "$OUT/loadcost.json" > "$OUT/loadcost.txt" 2>&1
  note "c rc=$?"; cat "$OUT/loadcost.txt"
fi
(cd $W && tar czf "$OUT/logs1.tar.gz" start/servers.log start.err) || true
