#!/bin/bash
# read windows: fixed vs balanced on the testbed (local=/var/tmp disk, shared=loop dev throttled 0.4 GB/s)
cd /work/main
for round in 1 2 3; do
  for cfg in "single:local fixed 32M" "mitm fixed 32M" "mitm balanced 32M" "mitm fixed 64M" "mitm balanced 64M"; do
    set -- $cfg
    out=/tmp/rw/r${round}_${1//:/-}_$2_$3.json
    flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read --tier local=/var/tmp/kvs-bw/local --tier shared=/mnt/kvs-shared/kvs-bw --chunks 48 --chunk-bytes 7M --repeat 5 --router $1 --read-windows $2 --inflight $3 --json > $out 2>/dev/null
  done
done
