"""Which part of the store's read loop costs device share under a write stream? A bare reader on the store's
4 MiB chunk files (no store), 16 reads in flight, with one mechanism of the store's at a time:

  raw-like                    files opened up front; each completion's callback submits the next read
  open-late                   the callback opens the next file (the store opens per read)
  via-queue / both            the next read is submitted by a consumer thread the completion is queued to
                              (the store before the refill-from-completion change), without / with open-late
  *+verify                    the consumer also hashes each chunk (xxh3-64)
  open-*+consumer+verify      refill in the callback (the store after the change), a consumer hashes

Usage: ROUNDS=6 flock /tmp/kvs-bench.lock .venv/bin/python refill_mechanics.py   (edit `variants` to choose)
"""
import time, threading, tempfile, shutil, statistics, sys, os, ctypes, queue
from pathlib import Path
import kvstream, xxhash
from kvstream.benchmarks.read import ReadBenchConfig, _store_config, _fill, bench_keys
from kvstream.io.engine import make_engine, OpKind, IOOp
from kvstream.io.rawread import write_files
from kvstream.io.buffers import AlignedBuffer

cfg = ReadBenchConfig(tiers=[("local", "/var/tmp/kvs-bw/local4L")], chunks=384, chunk_bytes=4 << 20, router="single:local")
keys = bench_keys(cfg.chunks, cfg.chunk_bytes)
engine = make_engine("auto")
scratch = Path(tempfile.mkdtemp(prefix="kvs-load-", dir="/var/tmp/kvs-bw/local4L"))
def with_writer(fn):
    stop = threading.Event(); out = {}
    def load():
        out["w"] = write_files([scratch / f"load-{i}" for i in range(4)], 64 << 20, engine=engine, depth=4, sync=False, until=stop)
    th = threading.Thread(target=load, daemon=True); th.start(); time.sleep(0.2)
    t0 = time.perf_counter(); fn(); dt = time.perf_counter() - t0
    stop.set(); th.join()
    return dt

bufs = []
for _ in range(16):
    b = AlignedBuffer(5 << 20, hugepages=True); ctypes.memset(b.address, 0, b.capacity); bufs.append(b)

def mech(files, sizes, *, open_late, via_queue, verify=False, depth=16, consumer=False, poll=False):
    ring = engine.ring("mech", depth=depth, max_bytes=depth * (5 << 20))
    pre = None if open_late else [os.open(f, os.O_RDONLY | os.O_DIRECT) for f in files]
    pl = []; nxt = [0]; lock = threading.Lock(); q = queue.SimpleQueue(); done = threading.Event(); out = [0]
    def make(i, buf):
        fd = os.open(files[i], os.O_RDONLY | os.O_DIRECT) if open_late else pre[i]
        return IOOp(kind=OpKind.READ, fd=fd, buf=buf, length=sizes[i], offset=0, callback=cb, tag=(i, buf, fd))
    def issue(buf):
        with lock:
            i = nxt[0]
            if i >= len(files): return False
            nxt[0] += 1
        ring.submit([make(i, buf)])
        return True
    def handle(op):
        i, buf, fd = op.tag
        if open_late: os.close(fd)
        issue(buf)
        if verify: xxhash.xxh3_64_digest(buf.view(0, sizes[i]))
        out[0] += 1
        if out[0] == len(files): done.set()
    def cb(op):
        if via_queue: q.put(op)
        elif consumer:
            i, buf, fd = op.tag
            if open_late: os.close(fd)
            issue(buf)  # NB: buffer reuse races the consumer's hash; fine for timing
            if poll: pl.append(op)
            else: q.put(op)
        else: handle(op)
    for b in bufs[:depth]: issue(b)
    if via_queue:
        while out[0] < len(files): handle(q.get())
    elif consumer and poll:
        while out[0] < len(files):
            time.sleep(0.005)
            while pl:
                op = pl.pop(); i = op.tag[0]
                if verify: xxhash.xxh3_64_digest(op.tag[1].view(0, sizes[i]))
                out[0] += 1
    elif consumer:
        while out[0] < len(files):
            op = q.get(); i = op.tag[0]
            if verify: xxhash.xxh3_64_digest(op.tag[1].view(0, sizes[i]))
            out[0] += 1
    else:
        done.wait()
    ring.close()
    if pre: [os.close(fd) for fd in pre]

with kvstream.open_store(_store_config(cfg)) as store:
    _fill(store, keys, cfg.chunk_bytes)
    files = [str(store.tiers[0].path_for(k)) for k in keys]
    sizes = [store.tiers[0].file_size(k) for k in keys]
total = sum(sizes)
variants = {
    "raw-like": dict(open_late=False, via_queue=False),
    "open-late": dict(open_late=True, via_queue=False),
    "via-queue": dict(open_late=False, via_queue=True),
    "both": dict(open_late=True, via_queue=True),
    "both+verify": dict(open_late=True, via_queue=True, verify=True),
    "open-early+consumer+verify": dict(open_late=False, via_queue=False, consumer=True, verify=True),
    "open-late+consumer+verify": dict(open_late=True, via_queue=False, consumer=True, verify=True),
}
res = {k: [] for k in variants}
for r in range(int(os.environ.get("ROUNDS", "3"))):
    for k, kw in variants.items():
        res[k].append(total / with_writer(lambda: mech(files, sizes, **kw)) / 1e9)
for k, v in res.items():
    print(f"{k:14s} median {statistics.median(v):.3f}  {[round(x,3) for x in v]}")
shutil.rmtree(scratch, ignore_errors=True)
