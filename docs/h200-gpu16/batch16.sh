#!/usr/bin/env bash
# gpu16: one device call's work, steps in the order given, each begun only if its time is
# left (common.sh: G16_T0, G16_LIMIT). Results go to $W/res-$CALL, packed after every step
# into $OUT/res-$CALL.tar.gz (at most 8 files come back from a call); servers' logs into
# $OUT/logs-$CALL.tar.gz; tables (analyze16.py) to stdout.
#
# Usage (after `source .gpu16b/install16.sh`, or PYTHONPATH=$HOME/site on a warm machine),
# from the checkout's root:
#   CALL=a bash .gpu16/batch16.sh STEP...
# STEP:
#   env                     MLX/GPU versions; MLX's 4- and 8-bit quantized matmul at group
#                           size 32 on the GPU against float32 (what the Q4_1 model runs)
#   model                   the SmolLM2-135M-shaped float16 model (build_model.py) if absent
#   gguf                    the real model: GGUF parts 1-2 ($HOME/g16) and 3 (.gpu16c)
#                           joined, xz -d, sha256 checked against $G/gguf.sha256
#   restart:MAX             `kvtrio bench serve --model $GGUF --json --phases restart
#                           --lengths 4096 --restart-rounds N`, N = the most rounds (<= MAX)
#                           that fit the time left, not begun under MIN_ROUNDS (3)
#   decode:MAX              the same with `--phases decode --rounds N`
#   spill:LEN:FIRST:COUNT   the bench's spill phase on $MODEL (float16) at LEN tokens,
#                           rounds FIRST..FIRST+COUNT-1, one bench process per round
#                           (spill16.py); SPILL_S_LEN s each
# A bench run of N rounds is reckoned to take (N + 1) rounds' time and 20% more:
# RESTART_ROUND_S / DECODE_ROUND_S before the first run, then the last run's wall time over (N + 1) (kept
# in $W across calls). RESTART_ARGS / DECODE_ARGS / SPILL_ARGS: more bench flags (short
# lengths for the dry runs here).
. "$(dirname "$0")/common.sh"
CALL=${CALL:-x}; R=$W/res-$CALL; mkdir -p "$R"
pack() { tar czf "$OUT/res-$CALL.tar.gz" -C "$R" . 2>/dev/null; }
note() { echo "== $* $(date -u +%T) load $(cut -d' ' -f1-3 /proc/loadavg) left $(left)s" | tee -a "$R/env.txt"; }
note "batch16 call $CALL kvtrio $(cat "$SRC/kvtrio/REV") steps: $*"
# bench PHASE MAX: one bench run of as many rounds as fit, its JSON in $R/PHASE-K.json
bench() {
  local phase=$1 max=$2 est_var=${1^^}_ROUND_S est n k flags began wall rc
  est=$(cat "$W/$phase-round-s" 2>/dev/null || echo "${!est_var:-70}")
  n=$(( ( $(left) - 15 ) * 5 / (est * 6) - 1 )); [ $n -gt "$max" ] && n=$max  # 20% to spare
  if [ $n -lt "${MIN_ROUNDS:-3}" ]; then note "$phase not begun: $n rounds of ${est}s fit"; return; fi
  k=$(ls "$R"/$phase-*.json 2>/dev/null | wc -l)
  if [ "$phase" = restart ]; then flags="--lengths ${RESTART_LENGTHS:-4096} --restart-rounds $n ${RESTART_ARGS:-}"
  else flags="--rounds $n ${DECODE_ARGS:-}"; fi
  note "$phase run $k: $n rounds (${est}s each reckoned)"
  began=$(date +%s)
  timeout -k 20 $(( $(left) - 2 )) $PY -m kvtrio bench serve --model "$GGUF" --json --phases "$phase" \
    $flags --dir "$W/$phase-$CALL-$k" > "$R/$phase-$k.json" 2> "$W/$phase-$CALL-$k.err"
  rc=$?; wall=$(( $(date +%s) - began ))
  [ $rc -eq 0 ] && echo $(( wall / (n + 1) + 1 )) > "$W/$phase-round-s"
  note "$phase run $k rc=$rc ${wall}s"; [ $rc -ne 0 ] && tail -c 1500 "$W/$phase-$CALL-$k.err"
  echo "{\"rounds\": $n, \"wall_s\": $wall, \"rc\": $rc, \"load\": \"$(cut -d' ' -f1-3 /proc/loadavg)\", \"utc_end\": \"$(date -u +%T)\"}" > "$R/$phase-$k.meta"
  pack; $PY "$G/analyze16.py" "$R/$phase-$k.json"
}
for step in "$@"; do
  IFS=: read -r what a b c <<< "$step"
  case $what in
    env)
      $PY -c 'import mlx.core as mx, mlx_lm, kvtrio; print("mlx", mx.__version__, mx.default_device(), "mlx_lm", mlx_lm.__version__, "kvtrio", kvtrio.__file__)' | tee -a "$R/env.txt"
      $PY - <<'PY' 2>&1 | tee -a "$R/env.txt"
import mlx.core as mx
mx.random.seed(0)
x = mx.random.normal((8, 576))
for bits in (4, 8):
    w = mx.random.normal((1536, 576))
    q = mx.quantize(w, group_size=32, bits=bits)
    got = mx.quantized_matmul(x, *q, transpose=True, group_size=32, bits=bits)
    ref = x @ mx.dequantize(*q, group_size=32, bits=bits).T
    err = (mx.linalg.norm(got - ref) / mx.linalg.norm(ref)).item()
    print(f"quantized matmul, {bits} bits, group 32, on {mx.default_device()}: rel err {err:.2e}")
PY
      nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader >> "$R/env.txt" 2>&1
      echo "cores $(nproc); disk $(df -h /tmp | tail -1)" >> "$R/env.txt" ;;
    model)
      if [ ! -f "$MODEL/config.json" ]; then
        note "build model"
        timeout 150 $PY "$G/build_model.py" "$MODEL" "${DTYPE:-float16}" > "$R/model.json" || exit 1
        cat "$R/model.json"
      fi ;;
    gguf)
      note "gguf"
      if [ ! -f "$GGUF" ]; then
        cat "$HOME/g16/gguf.xz.1" "$HOME/g16/gguf.xz.2" .gpu16c/gguf.xz.3 | xz -d > "$GGUF.part" && mv "$GGUF.part" "$GGUF"
      fi
      got=$(sha256sum "$GGUF" | cut -d' ' -f1); want=$(cat "$G/gguf.sha256")
      echo "gguf $GGUF $(stat -c %s "$GGUF") bytes sha256 $got $([ "$got" = "$want" ] && echo matches || echo "DIFFERS from $want")" | tee -a "$R/env.txt"
      [ "$got" = "$want" ] || exit 1 ;;
    restart|decode) bench "$what" "$a" ;;
    spill)
      need_var=SPILL_S_$a; need=${!need_var:-$(( a > 4096 ? 150 : 110 ))}
      for r in $(seq "$b" $(( b + c - 1 ))); do
        if [ "$(left)" -lt "$need" ]; then note "spill $a r$r not begun (need ${need}s)"; break; fi
        note "spill $a r$r"
        timeout -k 20 $(( $(left) - 2 )) $PY "$G/spill16.py" "$r" bench serve --json --model "$MODEL" \
          --dir "$W/spill-$a-$r" --phases spill --spill-length "$a" --spill-rounds 1 ${SPILL_ARGS:-} \
          > "$R/spill-$a-$r.json" 2> "$W/spill-$a-$r.err"
        rc=$?; note "spill $a r$r rc=$rc"; [ $rc -ne 0 ] && tail -c 800 "$W/spill-$a-$r.err"
        pack
      done
      ls "$R"/spill-$a-*.json > /dev/null 2>&1 && $PY "$G/analyze16.py" "$R"/spill-$a-*.json ;;
    *) note "unknown step $step" ;;
  esac
done
(cd "$W" && { find . -name servers.log; ls ./*.err; } 2>/dev/null | tar czf "$OUT/logs-$CALL.tar.gz" -T -) 2>/dev/null || true
pack; note "batch16 call $CALL done"; cp "$R/env.txt" "$OUT/env-$CALL.txt"
