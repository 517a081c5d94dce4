#!/usr/bin/env bash
# gpu14, call A (after `source .gpu2/install.sh`): the model; (1) split14.py, turn 2 over a
# RAM hit in process, SPLIT_ROUNDS (2) rounds of its six scenarios; (2) the bench's restart
# phase at 4,096 tokens with the floor (plain mlx_lm.server never restarted), R_ROUNDS (3)
# rounds, every server under the turn12 probe (docs/turn12/probe: per-stage marks).
. "$(dirname "$0")/common.sh"
note "batch14a main=$(cat "$G/src-main/REV")"
env_once
model
note "split14 ${SPLIT_ROUNDS:-2} rounds"
timeout $(( $(left) - ${A_RESERVE:-330} )) python3 "$G/split14.py" "$MODEL" "$OUT/split14.jsonl" "${SPLIT_ROUNDS:-2}" \
  > "$OUT/split14.txt" 2> "$W/split14.err"
note "split14 rc=$?"; cat "$OUT/split14.txt"; tail -c 600 "$W/split14.err"
note "restart 4096 floor, ${R_ROUNDS:-3} rounds"
rm -f "$W/probe.log"
TURN12_PROBE=$W/probe.log PYTHONPATH=$G/probe:$PYTHONPATH timeout $(( $(left) - 12 )) python3 -m kvtrio bench serve --json \
  --model "$MODEL" --dir "$W/rs" --phases restart --lengths 4096 --restart-rounds "${R_ROUNDS:-3}" --restart-floor \
  > "$OUT/restart.json" 2> "$W/restart.err"
note "restart rc=$?"; tail -c 400 "$W/restart.err"
python3 - "$OUT/restart.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
r = d["restart"] if "restart" in d else d
print(json.dumps(r, indent=None)[:3000])
PY
gzip -c "$W/probe.log" > "$OUT/probe.log.gz" 2>/dev/null || true
(cd "$W" && find rs -name servers.log | tar czf "$OUT/logs-a.tar.gz" -T - restart.err split14.err) || true
