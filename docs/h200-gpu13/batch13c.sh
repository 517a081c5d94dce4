#!/usr/bin/env bash
# gpu13, call C, only if device time remains (machine warm): (4a) inter-token latency of a
# stream while entries are saved, at 4k (the bench's spill phase, P_ROUNDS rounds), then
# (4b) turn 2 after a restart at 16,384 tokens (the bench's restart phase with
# --restart-warmup, X_ROUNDS rounds). Either is skipped with its rounds at 0.
. "$(dirname "$0")/common.sh"
note "batch13c main=$(cat "$G/src-main/REV")"
model
if [ "${P_ROUNDS:-3}" -gt 0 ]; then
  note "spill 4096, ${P_ROUNDS:-3} rounds"
  timeout $(( $(left) - ${C_RESERVE:-0} )) python3 -m kvtrio bench serve --json --model "$MODEL" --dir "$W/spill" \
    --phases spill --spill-length 4096 --spill-rounds "${P_ROUNDS:-3}" > "$OUT/spill.json" 2> "$W/spill.err"
  note "spill rc=$?"; tail -c 400 "$W/spill.err"
  python3 "$G/analyze13.py" "$OUT/spill.json" | tee "$OUT/spill.txt"
fi
if [ "${X_ROUNDS:-0}" -gt 0 ]; then
  note "restart 16384, ${X_ROUNDS} rounds"
  timeout $(( $(left) - 5 )) python3 -m kvtrio bench serve --json --model "$MODEL" --dir "$W/r16" \
    --phases restart --lengths 16384 --restart-rounds "${X_ROUNDS}" --restart-warmup > "$OUT/restart16k.json" 2> "$W/r16.err"
  note "restart16k rc=$?"; tail -c 400 "$W/r16.err"
  python3 "$G/analyze13.py" "$OUT/restart16k.json" | tee "$OUT/restart16k.txt"
fi
(cd "$W" && find spill r16 -name servers.log 2>/dev/null | tar czf "$OUT/logs-c.tar.gz" -T - spill.err r16.err) 2>/dev/null || true
