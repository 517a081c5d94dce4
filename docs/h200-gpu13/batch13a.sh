#!/usr/bin/env bash
# gpu13, call A (after `source .gpu2/install.sh`): the model, then turn 2 after a restart at
# 4,096 tokens, R_ROUNDS (6) rounds, four servers alternated: mlx_lm.server, naive,
# kvtrio serve (warm restart on, the default) and kvcold (kvtrio serve --restore-bytes 0),
# each answering the bench's warm-up request first (restart13.py --warmup).
. "$(dirname "$0")/common.sh"
note "batch13a main=$(cat "$G/src-main/REV")"
env_once
model
note "restart13 ${LENGTH:-4096} tokens, ${R_ROUNDS:-6} rounds"
timeout $(( $(left) - 15 )) python3 "$G/restart13.py" "$W/rs" "$MODEL" "${LENGTH:-4096}" "${R_ROUNDS:-6}" \
  --warmup --copy-turn1 mlx_lm naive kvtrio kvcold=kvtrio:--restore-bytes,0 \
  > "$OUT/restart13.jsonl" 2> "$W/rs.err"
note "restart13 rc=$?"; tail -c 400 "$W/rs.err"
python3 "$G/analyze13.py" "$OUT/restart13.jsonl" | tee "$OUT/restart13.txt"
(cd "$W" && tar czf "$OUT/logs-a.tar.gz" rs/servers.log rs.err) || true
