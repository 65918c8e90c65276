cd /work/main
T4="--tier local=/var/tmp/kvs-bw/local4L --tier shared=/mnt/kvs-shared/kvs-bw4L --chunks 384 --chunk-bytes 4M --repeat 5"
mkdir -p /tmp/ab2
for round in 1 2 3; do
  for v in old new; do
    if [ $v = new ]; then export KVS_STEAL_WINDOW=1; else unset KVS_STEAL_WINDOW; fi
    flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T4 --router mitm --json > /tmp/ab2/r${round}_4M_mitm-$v.json 2>/dev/null
  done
  unset KVS_STEAL_WINDOW
  flock /tmp/kvs-bench.lock bench/testbed run -- .venv/bin/kvstream bench read $T4 --router single:local --json > /tmp/ab2/r${round}_4M_single-local.json 2>/dev/null
done
