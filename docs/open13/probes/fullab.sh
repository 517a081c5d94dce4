#!/bin/bash
# usage: fullab.sh LABEL old|new  -- the brief's command from /tmp with PYTHONPATH to old or new
label=$1; side=$2
d=/tmp/open13/bench-$label; rm -rf $d; mkdir -p $d
cd /tmp
echo "$label start $(date -u +%H:%M:%S) load $(cat /proc/loadavg)" >> /tmp/open13/runs/log
PYTHONPATH=/tmp/open13/$side /work/wt-open13/.venv/bin/python -m kvtrio bench scale --json --sizes 1000,10000,100000 --no-maintenance --dir $d > /tmp/open13/runs/$label.json 2>/tmp/open13/runs/$label.err
echo "$label end $(date -u +%H:%M:%S) load $(cat /proc/loadavg) rc $?" >> /tmp/open13/runs/log
