#!/usr/bin/env bash
# gpu15: one device call's work, steps in the order given, each begun only if its time is
# left (common.sh: G15_T0, G15_LIMIT). Results go to $W/res-$CALL, packed after every step
# into $OUT/res-$CALL.tar.gz (at most 8 files come back from a call); servers' logs into
# $OUT/logs-$CALL.tar.gz; tables (analyze15.py) to stdout.
#
# Usage (after `source .gpu2/install.sh`, or PYTHONPATH=$HOME/site on a warm machine):
#   CALL=a bash .gpu15/batch15.sh STEP...
# STEP:
#   env                      MLX/GPU versions, the model built (build_model.py) if absent
#   spill:LEN:FIRST:COUNT    the bench's spill phase at LEN tokens, rounds FIRST..FIRST+COUNT-1,
#                            one bench process per round (spill15.py); SPILL_S_LEN s each
#   start:ROUNDS[:SECONDS]   restart time with 1,000 entries, naive and kvtrio (start15.py),
#                            up to ROUNDS more rounds, continuing the numbering of an earlier
#                            call on this machine (its fill kept in $W/start)
#   cudnn:PAIRS:LENGTHS[:SECONDS] cudnn15.py: PAIRS on/off pairs of fresh processes
#   cold:ROUNDS[:SECONDS]    turn 2 after a restart at 4,096 tokens with --restore-bytes=0
#                            (restart15.py, naive and kvtrio, the bench's warm-up request
#                            first unless COLD_WARMUP=0)
# A step that could not finish one round in the time left is not begun (START_MIN,
# START_FILL_MIN, CUDNN_MIN, COLD_MIN, SPILL_S_LEN seconds); SECONDS: the step begins no
# round that would end later than that from its start.
. "$(dirname "$0")/common.sh"
CALL=${CALL:-x}; R=$W/res-$CALL; mkdir -p "$R"
pack() { tar czf "$OUT/res-$CALL.tar.gz" -C "$R" . 2>/dev/null; }
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) left $(left)s" | tee -a "$R/env.txt"; }
END=$(( T0 + LIMIT - 4 ))
# deadline [SECONDS]: the call's end, or SECONDS from now if sooner (a step's own budget)
deadline() { local d=$END; [ -n "${1:-}" ] && [ $(( $(date +%s) + $1 )) -lt $d ] && d=$(( $(date +%s) + $1 )); echo $d; }
note "batch15 call $CALL main=$(cat "$G/src-main/REV") steps: $*"
for step in "$@"; do
  IFS=: read -r what a b c <<< "$step"
  case $what in
    env)
      python3 -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$R/env.txt"
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$R/env.txt" 2>&1
      echo "cores $(nproc); disk $(df -h /tmp | tail -1)" >> "$R/env.txt"
      if [ ! -f "$MODEL/config.json" ]; then
        note "build model"
        timeout 150 python3 "$G/build_model.py" "$MODEL" "${DTYPE:-float16}" > "$R/model.json" || exit 1
        cat "$R/model.json"
      fi ;;
    spill)
      need_var=SPILL_S_$a; need=${!need_var:-$(( a > 4096 ? 150 : 110 ))}
      for r in $(seq "$b" $(( b + c - 1 ))); do
        if [ "$(left)" -lt "$need" ]; then note "spill $a r$r not begun (need ${need}s)"; break; fi
        note "spill $a r$r"
        timeout -k 20 $(( $(left) - 2 )) python3 "$G/spill15.py" "$r" bench serve --json --model "$MODEL" \
          --dir "$W/spill-$a-$r" --phases spill --spill-length "$a" --spill-rounds 1 ${SPILL_ARGS:-} \
          > "$R/spill-$a-$r.json" 2> "$W/spill-$a-$r.err"
        rc=$?; note "spill $a r$r rc=$rc"; [ $rc -ne 0 ] && tail -c 800 "$W/spill-$a-$r.err"
        pack
      done
      python3 "$G/analyze15.py" "$R"/spill-$a-*.json ;;
    start)
      need=$([ -f "$W/start/kvtrio-filled" ] && echo "${START_MIN:-50}" || echo "${START_FILL_MIN:-160}")
      if [ "$(left)" -lt "$need" ]; then note "start not begun (need ${need}s)"; continue; fi
      first=$(cat "$W/start/next" 2>/dev/null || echo 0)
      note "start rounds from $first, up to $a"
      G15_DEADLINE=$(deadline "$b") timeout -k 20 $(( $(left) - 2 )) python3 "$G/start15.py" "$W/start" "$MODEL" "$first" "$a" \
        "${START_ENTRIES:-1000}" >> "$R/start.jsonl" 2> "$W/start-$CALL.err"
      rc=$?; note "start rc=$rc next $(cat "$W/start/next" 2>/dev/null)"; [ $rc -ne 0 ] && tail -c 800 "$W/start-$CALL.err"
      pack; python3 "$G/analyze15.py" "$R/start.jsonl" ;;
    cudnn)
      if [ "$(left)" -lt "${CUDNN_MIN:-60}" ]; then note "cudnn not begun"; continue; fi
      note "cudnn $a pairs $b"
      G15_DEADLINE=$(deadline "$c") timeout -k 20 $(( $(left) - 2 )) python3 "$G/cudnn15.py" "$MODEL" "$R/cudnn.jsonl" "$a" "$b" "${CUDNN_DECODE:-128}" \
        2> "$W/cudnn-$CALL.err"
      rc=$?; note "cudnn rc=$rc"; [ $rc -ne 0 ] && tail -c 800 "$W/cudnn-$CALL.err"
      pack; python3 "$G/analyze15.py" "$R/cudnn.jsonl" ;;
    cold)
      if [ "$(left)" -lt "${COLD_MIN:-110}" ]; then note "cold not begun"; continue; fi
      note "cold path, up to $a rounds"
      G15_DEADLINE=$(deadline "$b") R15_WARMUP=${COLD_WARMUP:-1} timeout -k 20 $(( $(left) - 2 )) python3 "$G/restart15.py" "$W/cold-$CALL" "$MODEL" \
        "${COLD_LENGTH:-4096}" "$a" "$G" naive=naive kvcold=kvtrio@main:--restore-bytes=0 \
        > "$R/cold.jsonl" 2> "$W/cold-$CALL.err"
      rc=$?; note "cold rc=$rc"; [ $rc -ne 0 ] && tail -c 800 "$W/cold-$CALL.err"
      pack; python3 "$G/analyze15.py" "$R/cold.jsonl" ;;
    *) note "unknown step $step" ;;
  esac
done
(cd "$W" && { find . -name servers.log; ls ./*.err; } 2>/dev/null | tar czf "$OUT/logs-$CALL.tar.gz" -T -) 2>/dev/null || true
pack; note "batch15 call $CALL done"; cp "$R/env.txt" "$OUT/env-$CALL.txt"
