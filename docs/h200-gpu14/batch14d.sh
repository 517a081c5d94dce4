#!/usr/bin/env bash
# gpu14, call D (after `source .gpu2/install.sh`; staged with TREES="gpu14 cold14"): the
# cold path (--restore-bytes=0) with the bench's warm-up request first (so turn 2 is not
# the process's first request): the naive baseline, kvtrio on main and on cold14 (each
# kvtrio tree writes its own turn 1), D_ROUNDS (4), as long as time is left.
. "$(dirname "$0")/common.sh"
note "batch14d main=$(cat "$G/src-main/REV") cold14=$(cat "$G/src-cold14/REV")"
model
python3 -m compileall -q "$G"/src-* > /dev/null
note "restart14 cold path --warmup, ${D_ROUNDS:-4} rounds"
R14_WARMUP=1 timeout $(( $(left) - 6 )) python3 "$G/restart14.py" "$W/r14d" "$MODEL" 4096 "${D_ROUNDS:-4}" "$G" \
  naive=naive kvcold=kvtrio@main:--restore-bytes=0 kvcold14=kvtrio@cold14:--restore-bytes=0 \
  > "$OUT/restart14d.jsonl" 2> "$W/r14d.err"
note "restart14d rc=$?"; tail -c 300 "$W/r14d.err"
python3 "$G/analyze14.py" "$OUT/restart14d.jsonl" | tee "$OUT/restart14d.txt"
(cd "$W" && tar czf "$OUT/logs-d.tar.gz" r14d/servers.log r14d.err 2>/dev/null) || true
