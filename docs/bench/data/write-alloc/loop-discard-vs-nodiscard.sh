#!/bin/bash
# write_alloc on an ext4 loop file system (loop with direct I/O on its backing file) mounted nodiscard vs discard
set -e
B=/var/tmp/kvs-loop.img; M=/mnt/kvs-loop
umount $M 2>/dev/null || true; rm -f $B; mkdir -p $M
python3 - <<'PY'
import os
with open('/var/tmp/kvs-loop.img','wb') as f:
    blk=os.urandom(1<<20)
    for i in range(7*1024): f.write(blk)
    f.flush(); os.fsync(f.fileno())
PY
L=$(losetup --direct-io=on --show -f $B)
cat /sys/block/$(basename $L)/loop/dio
mkfs.ext4 -q -F -E nodiscard $L
for opt in nodiscard discard nodiscard; do
  mount -o $opt $L $M
  grep " $M " /proc/mounts
  /work/main/.venv/bin/python /work/main/bench/write_alloc.py --dir $M/w --files 24 --reps 3 --json /tmp/wb/loopd-$opt.json | grep -v "^ \|^{\|^}"
  umount $M
done
losetup -d $L
rm -f $B
