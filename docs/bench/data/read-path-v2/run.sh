#!/bin/bash
# Reduced §8.0 re-run on the new read path (and the old code for the A/B), testbed up.
cd "$(dirname "$0")/../../../.."
OUT=${OUT:-/tmp/rpv2}; mkdir -p "$OUT"; OLD=${OLD:-/tmp/oldtree/src}  # the previous read path: git worktree add /tmp/oldtree 3140efd
bench/testbed throttle-local 1200000000
T4="--tier local=/var/tmp/kvs-bw/local4L --tier shared=/mnt/kvs-shared/kvs-bw4L --chunks 384 --chunk-bytes 4M --repeat 5"
run() { local name=$1 pp=$2; shift 2
  flock /tmp/kvs-bench.lock env PYTHONPATH=$pp LMCACHE_TRACK_USAGE=false bench/testbed run -- .venv/bin/python -m kvstream bench read "$@" --json >"$OUT/$name.json" 2>"$OUT/$name.err"; }
DEV=$(bench/testbed status 2>/dev/null | sed -n 's/.*(\([0-9]*:[0-9]*\)).*/\1/p' | head -1)
for round in 1 2 3; do
  for r in mitm fixed:0.75 single:local; do run "r${round}_new_${r//:/-}" "$PWD/src" $T4 --router $r; done
  run "r${round}_old_mitm" $OLD $T4 --router mitm
  for r in mitm fixed:0.75; do
    run "r${round}_new_sched_${r//:/-}" "$PWD/src" $T4 --router $r --write-load --bandwidth-schedule 0=400MB,0.25=150MB,0.5=400MB --throttle-device "$DEV"
  done
  run "r${round}_old_sched_mitm" $OLD $T4 --router mitm --write-load --bandwidth-schedule 0=400MB,0.25=150MB,0.5=400MB --throttle-device "$DEV"
done
bench/testbed set-bandwidth 400000000
bench/testbed throttle-local 0
