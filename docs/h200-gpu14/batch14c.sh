#!/usr/bin/env bash
# gpu14, call C (machine warm: PYTHONPATH=$HOME/site; staged with TREES="gpu14 cold14"):
# (1) the A/B of batch14b with the bench's warm-up request first (--restart-warmup, as
# gpu13 measured): mlx_lm.server, the floor, kvtrio on main and on gpu14, W_ROUNDS (3);
# (2) the cold path (--restore-bytes=0): the naive baseline, kvtrio on main and on cold14
# (each kvtrio tree writes its own turn 1), C_ROUNDS (2), as long as time is left.
. "$(dirname "$0")/common.sh"
note "batch14c main=$(cat "$G/src-main/REV") gpu14=$(cat "$G/src-gpu14/REV") cold14=$(cat "$G/src-cold14/REV" 2>/dev/null)"
model
python3 -m compileall -q "$G"/src-* > /dev/null
note "restart14 --warmup, ${W_ROUNDS:-3} rounds"
R14_WARMUP=1 timeout $(( $(left) - ${C_RESERVE:-200} )) python3 "$G/restart14.py" "$W/r14w" "$MODEL" 4096 \
  "${W_ROUNDS:-3}" "$G" mlx_lm=mlx_lm floor=floor kvmain=kvtrio@main kvnew=kvtrio@gpu14 \
  > "$OUT/restart14w.jsonl" 2> "$W/r14w.err"
note "restart14w rc=$?"; tail -c 300 "$W/r14w.err"
python3 "$G/analyze14.py" "$OUT/restart14w.jsonl" | tee "$OUT/restart14w.txt"
if [ -d "$G/src-cold14" ] && [ "$(left)" -gt 120 ]; then
  note "restart14 cold path, ${C_ROUNDS:-2} rounds"
  timeout $(( $(left) - 8 )) python3 "$G/restart14.py" "$W/r14c" "$MODEL" 4096 "${C_ROUNDS:-2}" "$G" \
    naive=naive kvcold=kvtrio@main:--restore-bytes=0 kvcold14=kvtrio@cold14:--restore-bytes=0 \
    > "$OUT/restart14c.jsonl" 2> "$W/r14c.err"
  note "restart14c rc=$?"; tail -c 300 "$W/r14c.err"
  python3 "$G/analyze14.py" "$OUT/restart14c.jsonl" | tee "$OUT/restart14c.txt"
fi
(cd "$W" && tar czf "$OUT/logs-c.tar.gz" r14w/servers.log r14w.err r14c/servers.log r14c.err 2>/dev/null) || true
