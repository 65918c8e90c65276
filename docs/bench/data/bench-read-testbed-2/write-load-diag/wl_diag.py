import time, threading, tempfile, shutil, statistics
from pathlib import Path
import kvstream
from kvstream.benchmarks.read import ReadBenchConfig, _store_config, _fill, bench_keys
from kvstream.io.engine import make_engine
from kvstream.io.rawread import read_files, write_files

import sys
cfg = ReadBenchConfig(tiers=[("local", "/var/tmp/kvs-bw/local4L")], chunks=384, chunk_bytes=4 << 20, router="single:local", inflight_bytes=int(sys.argv[1]) << 20, depth=int(sys.argv[2]))
keys = bench_keys(cfg.chunks, cfg.chunk_bytes)
engine = make_engine("auto")
scratch = Path(tempfile.mkdtemp(prefix="kvs-load-", dir="/var/tmp/kvs-bw/local4L"))

def with_writer(fn):
    stop = threading.Event(); out = {}
    def load():
        r = write_files([scratch / f"load-{i}" for i in range(4)], 64 << 20, engine=engine, depth=4, sync=False, until=stop)
        out["w"] = r
    th = threading.Thread(target=load, daemon=True); th.start(); time.sleep(0.2)
    t0 = time.perf_counter(); res = fn(); dt = time.perf_counter() - t0
    stop.set(); th.join()
    w = out["w"]
    return dt, w.bytes / w.seconds / 1e9

with kvstream.open_store(_store_config(cfg)) as store:
    _fill(store, keys, cfg.chunk_bytes)
    files = [str(store.tiers[0].path_for(k)) for k in keys]
    total = sum(store.tiers[0].file_size(k) for k in keys)
    for _ in range(2):
        store.evict_memory(); list(store.read_iter(keys))
    for rep in range(2):
        dt, wg = with_writer(lambda: read_files(files, engine=engine, depth=16))
        print(f"raw   read {total/dt/1e9:.3f} GB/s, writer {wg:.3f} GB/s")
        store.evict_memory()
        dt, wg = with_writer(lambda: sum(1 for _ in store.read_iter(keys)))
        print(f"store read {total/dt/1e9:.3f} GB/s, writer {wg:.3f} GB/s")
        store.evict_memory()
        st = store.stats()["tiers"]["local"]
        dt2 = time.perf_counter(); sum(1 for _ in store.read_iter(keys)); dt2 = time.perf_counter() - dt2
        print(f"store read, no writer {total/dt2/1e9:.3f} GB/s")
shutil.rmtree(scratch, ignore_errors=True)
