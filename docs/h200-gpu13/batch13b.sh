#!/usr/bin/env bash
# gpu13, call B (machine warm: PYTHONPATH=$HOME/site): (2) the bench's start phase with
# 1,000 entries on disk, S_ROUNDS (6) rounds; (3) the ~94 MB cold load with 1/2/4/8 read
# streams through kvtrio serve's adapter (loadthreads.py, L_ROUNDS rounds, main and, where
# .gpu3/src-load13 exists, load13, alternated process by process), and `kvtrio bench tier`
# on the same bytes with KVTRIO_LOAD_THREADS=1,2,4,8 (T_ROUNDS rounds alternated).
. "$(dirname "$0")/common.sh"
note "batch13b main=$(cat "$G/src-main/REV") load13=$(cat "$G/src-load13/REV" 2>/dev/null || echo none)"
model
if [ "${S_ROUNDS:-6}" -gt 0 ]; then
  note "start ${S_ROUNDS:-6} rounds"
  timeout $(( $(left) - ${B_RESERVE:-100} )) python3 -m kvtrio bench serve --json --model "$MODEL" --dir "$W/start" \
    --phases start --start-rounds "${S_ROUNDS:-6}" > "$OUT/start.json" 2> "$W/start.err"
  note "start rc=$?"; tail -c 400 "$W/start.err"
  python3 "$G/analyze13.py" "$OUT/start.json" | tee "$OUT/start.txt"
  (cd "$W" && find start -name servers.log | tar czf "$OUT/logs-b.tar.gz" -T - start.err) || true
fi
trees="main"; [ -d "$G/src-load13" ] && trees="main load13 main load13"
for t in $trees; do
  [ "$(left)" -lt 40 ] && break
  note "loadthreads $t"
  G13_TREE=$t PYTHONPATH=$G/src-$t:${PYTHONPATH#*:} timeout $(( $(left) - 20 )) python3 "$G/loadthreads.py" "${L_ROUNDS:-7}" "$W/lt-$t-$(date +%s).json" 2>&1 | tail -3
done
python3 - "$OUT/loadthreads.json" "$W"/lt-*.json <<'PY'
import json, sys
runs = [json.load(open(p)) for p in sorted(sys.argv[2:])]
json.dump(runs, open(sys.argv[1], "w"), indent=1)
PY
for r in $(seq 1 "${T_ROUNDS:-2}"); do
  for n in 1 2 4 8; do
    [ "$(left)" -lt 15 ] && break 2
    KVTRIO_LOAD_THREADS=$n timeout 60 python3 -m kvtrio bench tier --json --size-mib 90 --tensors 60 --dir "$W" \
      | python3 -c "import json,sys; d=json.load(sys.stdin); d['load_threads']=$n; d['round']=$r; print(json.dumps(d))" >> "$OUT/tier.jsonl"
  done
done
note "tier rc=$?"
python3 "$G/analyze13.py" "$OUT/loadthreads.json" "$OUT/tier.jsonl" | tee "$OUT/load.txt"
