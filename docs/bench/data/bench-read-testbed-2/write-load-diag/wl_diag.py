"""One tier under a concurrent write stream: the store's read vs the raw reader's, same files, same bytes in flight.

Usage: wl_diag.py INFLIGHT_MiB DEPTH [MEMORY_MiB]   (env ROUNDS=5, VERIFY=1; KVSTREAM_HUGEPAGES=0 to compare)
Prints, per round, each reader's GB/s, the writer's GB/s, per-op latency (issue to reap) and the mean number
of ops the ring had admitted; then the medians and raw/store. Run under `flock /tmp/kvs-bench.lock`.
"""
import os, time, threading, tempfile, shutil, statistics, sys
from pathlib import Path
import kvstream
from kvstream.benchmarks.read import ReadBenchConfig, _store_config, _fill, bench_keys
from kvstream.io.engine import make_engine
from kvstream.io.rawread import read_files, write_files

cfg = ReadBenchConfig(tiers=[("local", "/var/tmp/kvs-bw/local4L")], chunks=384, chunk_bytes=4 << 20,
                      router="single:local", verify=os.environ.get("VERIFY", "1") == "1",
                      inflight_bytes=int(sys.argv[1]) << 20, depth=int(sys.argv[2]))
keys = bench_keys(cfg.chunks, cfg.chunk_bytes)
engine = make_engine("auto")
scratch = Path(tempfile.mkdtemp(prefix="kvs-load-", dir="/var/tmp/kvs-bw/local4L"))


def sampler(ring_getter, stop, out):
    while not stop.is_set():
        r = ring_getter()
        if r is not None:
            out.append(r._limits.active_ops)
        time.sleep(0.0005)


def with_writer(fn, ring_getter):
    stop = threading.Event(); out = {}; samples = []
    def load():
        out["w"] = write_files([scratch / f"load-{i}" for i in range(4)], 64 << 20, engine=engine, depth=4,
                               sync=False, until=stop)
    th = threading.Thread(target=load, daemon=True); th.start(); time.sleep(0.2)
    s2 = threading.Event(); sth = threading.Thread(target=sampler, args=(ring_getter, s2, samples), daemon=True)
    sth.start()
    t0 = time.perf_counter(); res = fn(); dt = time.perf_counter() - t0
    s2.set(); sth.join(); stop.set(); th.join()
    w = out["w"]
    return dt, w.bytes / w.seconds / 1e9, res, (statistics.mean(samples) if samples else float("nan"))


made = {}  # the raw reader's ring, to sample its occupancy
orig = engine.ring
def ring(label, **kw):
    r = orig(label, **kw); made[label] = r; return r
engine.ring = ring

sc = _store_config(cfg)
if len(sys.argv) > 3:
    sc["memory_bytes"] = int(sys.argv[3]) << 20
with kvstream.open_store(sc, engine=engine) as store:
    _fill(store, keys, cfg.chunk_bytes)
    files = [str(store.tiers[0].path_for(k)) for k in keys]
    total = sum(store.tiers[0].file_size(k) for k in keys)
    for _ in range(2):
        store.evict_memory(); list(store.read_iter(keys))
    R, S = [], []
    for rep in range(int(os.environ.get("ROUNDS", "5"))):
        dt, wg, res, occ = with_writer(lambda: read_files(files, engine=engine, depth=cfg.depth, latencies=True),
                                       lambda: made.get("rawread"))
        lat = res.latencies
        R.append(total / dt / 1e9)
        print(f"raw   read {R[-1]:.3f} GB/s, writer {wg:.3f}, op latency mean {statistics.mean(lat)*1e3:.1f} ms "
              f"p50 {statistics.median(lat)*1e3:.1f}, admitted ops {occ:.2f}")
        store.evict_memory()
        store.tiers[0].counters.latencies.clear()
        ring0 = store.tiers[0].read_ring
        dt, wg, _, occ = with_writer(lambda: sum(1 for _ in store.read_iter(keys)), lambda: ring0)
        lat = list(store.tiers[0].counters.latencies)
        S.append(total / dt / 1e9)
        print(f"store read {S[-1]:.3f} GB/s, writer {wg:.3f}, op latency mean {statistics.mean(lat)*1e3:.1f} ms "
              f"p50 {statistics.median(lat)*1e3:.1f}, admitted ops {occ:.2f}")
        store.evict_memory()
    print(f"MEDIAN raw {statistics.median(R):.3f} store {statistics.median(S):.3f} "
          f"raw/store {statistics.median(R) / statistics.median(S):.3f}")
shutil.rmtree(scratch, ignore_errors=True)
