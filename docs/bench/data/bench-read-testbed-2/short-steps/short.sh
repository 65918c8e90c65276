cd /work/main
bench/testbed throttle-local 1200000000
OUT=/tmp/short; mkdir -p $OUT
T1="--tier local=/var/tmp/kvs-bw/local1S --tier shared=/mnt/kvs-shared/kvs-bw1S --chunks 128 --chunk-bytes 1M --repeat 5"
T48="--tier local=/var/tmp/kvs-bw/local48S --tier shared=/mnt/kvs-shared/kvs-bw48S --chunks 8 --chunk-bytes 48M --repeat 5"
for round in 1 2 3; do
  for r in single:local mitm; do
    flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T1 --router $r --inflight 32M --json > $OUT/r${round}_1M-32M_${r//:/-}.json 2>/dev/null
    flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T48 --router $r --inflight 32M --json > $OUT/r${round}_48M-32M_${r//:/-}.json 2>/dev/null
  done
done
bench/testbed throttle-local 0
