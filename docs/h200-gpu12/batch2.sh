#!/usr/bin/env bash
# gpu12, batch 2 (one call, after `source .gpu2/install.sh`): old (main) against new (a
# helper's branch head), alternated. Turn 2 after a restart at 4,096 tokens with the
# warm-up (restart_ab.py: kvmain, kvturn12; T_ROUNDS rounds), then starts (ab.py:
# kvmain, kvstart12, start12's finer probe; S_ROUNDS rounds; G12_FILL picks the fill).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
G=$PWD/.gpu3; MODEL=${MODEL:-$HOME/smol135m}; W=${W:-/tmp/g12}; OUT=${OUT:-/tmp/g12out}
mkdir -p "$W" "$OUT"
export PYTHONPATH=$G/src-main${PYTHONPATH:+:$PYTHONPATH}
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/env.txt"; }
note "batch2 main=$(cat $G/src-main/REV) turn12=$(cat $G/src-turn12/REV) start12=$(cat $G/src-start12/REV)"
if [ ! -f "$MODEL/config.json" ]; then
  timeout 150 python3 $G/src-main/kvtrio/docs/h200-gpu9/build_model.py "$MODEL" float16 > "$OUT/model.json" || exit 1
fi
python3 -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$OUT/env.txt"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$OUT/env.txt" 2>&1
if [ "${IMPORTS:-1}" = 1 ]; then  # where the start's ~9 s after transformers go; torch's part
  for ut in AUTO 0; do
    note "imports USE_TORCH=$ut"
    USE_TORCH=$ut timeout 90 python3 -X importtime -c "import sys, time; t = time.perf_counter(); import mlx_lm.server; a = time.perf_counter() - t; from mlx_lm import load; m, tok = load('$MODEL'); print('USE_TORCH=$ut import_s', round(a, 2), 'load_s', round(time.perf_counter() - t - a, 2), 'torch imported', 'torch' in sys.modules, tok.encode('hello world'))" 2> $W/it-$ut.txt | tee -a "$OUT/importtime.txt"
    sort -t'|' -k2 -n $W/it-$ut.txt | tail -25 >> "$OUT/importtime.txt"
  done
fi
if [ "${T_ROUNDS:-3}" -gt 0 ]; then
  note "turn: restart_ab ${LENGTH:-4096} tokens, ${T_ROUNDS:-3} rounds"
  timeout ${T_S:-220} python3 $G/restart_ab.py $W/rab "$MODEL" ${LENGTH:-4096} ${T_ROUNDS:-3} \
    kvmain=$G/src-main kvturn12=$G/src-turn12 > "$OUT/restartab.jsonl" 2> $W/rab.err
  note "turn rc=$?"; tail -c 300 $W/rab.err
  python3 $G/analyze.py "$OUT/restartab.jsonl" | tee "$OUT/restartab.txt"
fi
if [ "${S_ROUNDS:-4}" -gt 0 ]; then
  note "start: ab ${S_ROUNDS:-4} rounds, fill ${G12_FILL:-flushed}"
  G12_SITE=$G/site12 timeout ${S_S:-220} python3 $G/ab.py $W/s2 "$MODEL" ${S_ROUNDS:-4} \
    kvmain=$G/src-main kvstart12=$G/src-start12 > "$OUT/startab.jsonl" 2> $W/s2.err
  note "start rc=$?"; tail -c 300 $W/s2.err
  python3 $G/seg.py --ref kvmain "$OUT/startab.jsonl" | tee "$OUT/startab.txt"
fi
(cd $W && find rab s2 -name servers.log | tar czf "$OUT/logs2.tar.gz" -T - rab.err s2.err) 2>/dev/null || true
