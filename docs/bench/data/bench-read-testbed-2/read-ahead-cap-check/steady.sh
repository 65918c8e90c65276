#!/bin/bash
cd "$(dirname "$0")/../../../../.."
OUT=${OUT:-/tmp/rw7}; mkdir -p "$OUT"
bench/testbed throttle-local 1200000000
T4="--tier local=/var/tmp/kvs-bw/local4L --tier shared=/mnt/kvs-shared/kvs-bw4L --chunks 384 --chunk-bytes 4M --repeat 5"
T7="--tier local=/var/tmp/kvs-bw/local7L --tier shared=/mnt/kvs-shared/kvs-bw7L --chunks 128 --chunk-bytes 7M --repeat 5"
run() { local name=$1; shift
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"
  echo "$(date +%T) $name: $(python3 -c "import json;d=json.load(open('$OUT/$name.json'));print(round(d['over_bound'],3), round(d['seconds'],3), round(d['bound_seconds'],3))" 2>&1 | tail -1)"; }
for round in ${ROUNDS:-1 2 3}; do
  for r in ${ROUTERS4:-mitm single:local}; do run "r${round}_4M_${r//:/-}" $T4 --router $r; done
  for r in ${ROUTERS7:-mitm}; do run "r${round}_7M_${r//:/-}" $T7 --router $r; done
done
bench/testbed throttle-local 0
