#!/usr/bin/env bash
# gpu14, call B (after `source .gpu2/install.sh`; staged with TREES=gpu14): the model;
# (1) turn 2 after a restart at 4,096 tokens, R_ROUNDS (4) rounds, five servers alternated
# (restart14.py): plain mlx_lm.server, the floor (mlx_lm.server never restarted), kvtrio
# serve on main, on gpu14 (the batched warm-up), and on gpu14 with MLX_CUDA_USE_CUDNN_SDPA=0,
# all under the turn12 probe; (2) split14.py on gpu14's tree, main's warm-up (rule5)
# against gpu14's (rule5b), SPLIT_ROUNDS (2) rounds, as long as time is left.
. "$(dirname "$0")/common.sh"
note "batch14b main=$(cat "$G/src-main/REV") gpu14=$(cat "$G/src-gpu14/REV")"
env_once
model
python3 -m compileall -q "$G"/src-* > /dev/null
note "restart14 4096, ${R_ROUNDS:-4} rounds"
rm -f "$W/probe-b.log"
TURN12_PROBE=$W/probe-b.log PYTHONPATH=$G/probe:$PYTHONPATH timeout $(( $(left) - ${B_RESERVE:-75} )) \
  python3 "$G/restart14.py" "$W/r14" "$MODEL" 4096 "${R_ROUNDS:-4}" "$G" ${SERVERS:-mlx_lm=mlx_lm floor=floor \
  kvmain=kvtrio@main kvnew=kvtrio@gpu14 kvnew0=kvtrio@gpu14+MLX_CUDA_USE_CUDNN_SDPA=0} \
  > "$OUT/restart14.jsonl" 2> "$W/r14.err"
note "restart14 rc=$?"; tail -c 400 "$W/r14.err"
python3 "$G/analyze14.py" "$OUT/restart14.jsonl" | tee "$OUT/restart14.txt"
gzip -c "$W/probe-b.log" > "$OUT/probe-b.log.gz" 2>/dev/null || true
(cd "$W" && tar czf "$OUT/logs-b.tar.gz" r14/servers.log r14.err) || true
if [ "$(left)" -gt 45 ]; then
  note "split14 rule5/rule5b on gpu14"
  PYTHONPATH=$G/src-gpu14:${PYTHONPATH#*:} timeout $(( $(left) - 5 )) python3 "$G/split14.py" "$MODEL" \
    "$OUT/split14b.jsonl" "${SPLIT_ROUNDS:-2}" rule5 rule5b > "$OUT/split14b.txt" 2> "$W/split14b.err"
  note "split14b rc=$?"; tail -20 "$OUT/split14b.txt"
fi
