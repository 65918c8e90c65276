#!/bin/bash
# issue 2 benchmarks 2-3 on the testbed: router sweep (the V), then a changing bandwidth + write load
cd /work/main
mkdir -p /tmp/rw/sweep
T="--tier local=/var/tmp/kvs-bw/local4 --tier shared=/mnt/kvs-shared/kvs-bw4 --chunks 96 --chunk-bytes 4M --repeat 5"
for r in single:local single:shared fixed:0.5 fixed:0.6 fixed:0.7 fixed:0.75 fixed:0.8 fixed:0.85 fixed:0.9 fixed:0.95 mitm "mitm --read-windows fixed"; do
  name=$(echo "$r" | tr ' :' '__')
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T --router $r --json > /tmp/rw/sweep/$name.json 2>/tmp/rw/sweep/$name.err
done
DEV=$(bench/testbed status 2>/dev/null | sed -n 's/.*(\([0-9]*:[0-9]*\)).*/\1/p' | head -1)
for r in mitm fixed:0.8 fixed:0.85; do
  name=sched_$(echo "$r" | tr ' :' '__')
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T --router $r --write-load \
     --bandwidth-schedule 0=400MB,0.06=150MB,0.12=400MB --throttle-device $DEV --json > /tmp/rw/sweep/$name.json 2>/tmp/rw/sweep/$name.err
done
bench/testbed set-bandwidth 400000000
# cross-check (issue 4): replay on the testbed vs the simulator with measured bandwidths
mkdir -p /var/tmp/kvs-cc
flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream replay --out /var/tmp/kvs-cc/out --tier local=/var/tmp/kvs-cc/local \
   --tier shared=/mnt/kvs-shared/kvs-replay --systems kvstream-only,lmcache-like --tier-capacity 2GiB --crosscheck --json > /tmp/rw/crosscheck.json 2>/tmp/rw/crosscheck.err
