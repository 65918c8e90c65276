#!/bin/bash
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/rw5}
mkdir -p "$OUT"
bench/testbed throttle-local 1200000000
T4="--tier local=/var/tmp/kvs-bw/local4L --tier shared=/mnt/kvs-shared/kvs-bw4L --chunks 384 --chunk-bytes 4M --repeat 5"
run() { local name=$1; shift
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"; }
DEV=$(bench/testbed status 2>/dev/null | sed -n 's/.*(\([0-9]*:[0-9]*\)).*/\1/p' | head -1)
for round in ${ROUNDS:-1 2 3}; do
  for r in ${ROUTERS:-mitm fixed:0.75 fixed:0.8}; do
    run "r${round}_sched_${r//:/-}" $T4 --router $r --write-load $EXTRA \
       --bandwidth-schedule 0=400MB,0.25=150MB,0.5=400MB --throttle-device "$DEV"
    echo "$(date +%T) r$round $r: $(python3 -c "import json;d=json.load(open('$OUT/r${round}_sched_${r//:/-}.json'));print(round(d['over_bound'],3), round(d['seconds'],3), round(d['bound_seconds'],3))" 2>&1 | tail -1)"
  done
done
bench/testbed set-bandwidth 400000000
bench/testbed throttle-local 0
