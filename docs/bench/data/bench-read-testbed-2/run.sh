#!/bin/bash
# issue 2 benchmarks 2-3 on the testbed (BENCHMARKS §8). Needs root and `bench/testbed up --size 3G --read-bps 400000000`.
# The local disk is throttled to 1.2 GB/s for the benchmark processes (bench/testbed throttle-local), so the
# ratio of the tiers is steady (3:1) and the bound is not at the mercy of this virtual disk's 1.5-2.3 GB/s swings;
# reads are ~1 s long (384 x 4 MiB, 128 x 7 MiB) so blkio's throttle slices do not flatter the short raw-reader bound.
# The store and the bound's raw reader keep the same bytes in flight (bench read's default --inflight).
# Output: one JSON per run under $OUT (default /tmp/rw4); summarize.py $OUT prints the table.
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/rw4}
mkdir -p "$OUT"
bench/testbed throttle-local 1200000000
T4="--tier local=/var/tmp/kvs-bw/local4L --tier shared=/mnt/kvs-shared/kvs-bw4L --chunks 384 --chunk-bytes 4M --repeat 5"
T7="--tier local=/var/tmp/kvs-bw/local7L --tier shared=/mnt/kvs-shared/kvs-bw7L --chunks 128 --chunk-bytes 7M --repeat 5"
run() { # run NAME ARGS...
  local name=$1; shift
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"
}
for round in 1 2 3; do
  for r in single:local single:shared fixed:0.5 fixed:0.6 fixed:0.7 fixed:0.75 fixed:0.8 fixed:0.85 fixed:0.9 fixed:0.95 mitm; do
    run "r${round}_4M_${r//:/-}" $T4 --router $r
  done
  for r in single:local mitm; do
    run "r${round}_7M_${r//:/-}" $T7 --router $r
  done
done
DEV=$(bench/testbed status 2>/dev/null | sed -n 's/.*(\([0-9]*:[0-9]*\)).*/\1/p' | head -1)
for round in 1 2 3; do
  for r in mitm fixed:0.75 fixed:0.8; do
    run "r${round}_sched_${r//:/-}" $T4 --router $r --write-load \
       --bandwidth-schedule 0=400MB,0.25=150MB,0.5=400MB --throttle-device "$DEV"
  done
done
bench/testbed set-bandwidth 400000000
bench/testbed throttle-local 0
