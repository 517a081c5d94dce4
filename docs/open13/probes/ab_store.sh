#!/bin/bash
# ab_store.sh ROUNDS OUT A B: open_phases at 10k and 100k, builds A and B (under /tmp/open13/) alternated
rounds=$1; out=$2; a=$3; b=$4; : > $out
cd /tmp
for r in $(seq $rounds); do for n in 10000 100000; do for side in $a $b; do
  PYTHONPATH=/tmp/open13/$side /work/wt-open13/.venv/bin/python /work/wt-open13/docs/scale12/open_phases.py /tmp/open13/dirs/n$n | python3 -c "import json,sys; d=json.loads(sys.stdin.read()); d['side']='$side'; d['round']=$r; print(json.dumps(d))" >> $out
done; done; done
