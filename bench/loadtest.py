"""Load test with faults on: many threads reading and writing one store for minutes; memory and file
descriptors must stay flat, and no wrong byte may ever be returned.

    flock /tmp/kvs-bench.lock .venv/bin/python bench/loadtest.py --seconds 180 --threads 8
    ... --faults "eio:local-r:0.02,flip:shared-r:0.01,delay:local-r:0.01:0.2,enospc:local-w:0.05,eio:shared-w:0.02"

Two tiers on the real disk (small capacities, so eviction runs all the time) under a seeded
:class:`kvstream.io.faults.FaultyEngine`. Each worker thread loops: put a few chunks (new or existing keys) and
flush, read a random step of keys and check every returned byte (a chunk's bytes are a function of its key),
look up a prefix, and now and then empty host memory so reads go to disk. A sampler prints, every
``--sample`` seconds, the process's RSS, open file descriptors, threads, the store's host-memory bytes and the
counters. At the end it compares the second half of the run with its first sample after warm-up:

- RSS may not grow by more than ``--rss-slack`` (default 64 MiB) after warm-up, and its trend (least-squares
  slope over the samples after warm-up) is printed in MiB per minute;
- open file descriptors: in-flight reads and writes each hold one, so the count moves with the load; the
  median of the last third of the run may not exceed the median of the first third after warm-up by more
  than ``--fd-slack`` (default 16), and once the workers have stopped and the writes drained, the count must
  be back to what it was before they started (± 2): a leak of even one descriptor per thousand operations fails;
- threads may not grow by more than 8; wrong bytes returned and exceptions on the serving path must be 0.

It stops by itself after ``--seconds`` (a watchdog ends the process if the workers do not stop within 60 s
more) and exits 1 if any check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import kvstream
from kvstream.config import size_arg
from kvstream.io.engine import make_engine
from kvstream.io.faults import FaultPlan, FaultyEngine, parse_faults

DEFAULT_FAULTS = "eio:local-r:0.02,flip:shared-r:0.01,delay:local-r:0.01:0.2,short:local-r:0.005," \
                 "enospc:local-w:0.05,eio:shared-w:0.02,delay:*-w:0.01:0.3"


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


class Payloads:
    """Chunk bytes as a function of the key, cached (generating them must not dominate the run)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._cache: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def __call__(self, key: bytes) -> bytes:
        with self._lock:
            v = self._cache.get(key)
        if v is None:
            v = np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(self.size)
            with self._lock:
                self._cache[key] = v
        return v


def worker(store: kvstream.Store, keys: list[bytes], payload: Payloads, stop: threading.Event, seed: int,
           totals: dict[str, int], lock: threading.Lock, step: int) -> None:
    rng = random.Random(seed)
    mine = {"ops": 0, "puts": 0, "reads": 0, "hits": 0, "wrong_bytes": 0, "errors": 0}
    while not stop.is_set():
        try:
            for k in rng.sample(keys, 3):
                if store.put(k, payload(k)):
                    mine["puts"] += 1
            store.flush()
            want = rng.sample(keys, step)
            for k, view in zip(want, store.get_many(want)):
                mine["reads"] += 1
                if view is not None:
                    mine["hits"] += 1
                    if bytes(view) != payload(k):
                        mine["wrong_bytes"] += int(np.count_nonzero(
                            np.frombuffer(bytes(view), np.uint8)[: payload.size] != np.frombuffer(payload(k), np.uint8)
                        )) if len(view) == payload.size else max(len(view), payload.size)
            store.lookup(want)
            if rng.random() < 0.05:
                store.evict_memory()
            mine["ops"] += 1
        except Exception as exc:  # anything escaping the store on the serving path is a failure
            mine["errors"] += 1
            print(f"worker {seed}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            time.sleep(0.1)
    with lock:
        for k, v in mine.items():
            totals[k] = totals.get(k, 0) + v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=180)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--keys", type=int, default=3000, help="distinct chunk keys (default 3000)")
    ap.add_argument("--size", type=size_arg, default=64 << 10, help="payload bytes per chunk (default 64K)")
    ap.add_argument("--step", type=int, default=16, help="chunks per read step (default 16)")
    ap.add_argument("--capacity", type=size_arg, default=96 << 20, help="each tier's capacity (default 96M)")
    ap.add_argument("--memory", type=size_arg, default=48 << 20, help="host-memory tier (default 48M)")
    ap.add_argument("--faults", default=DEFAULT_FAULTS, help="KIND:RINGS[:P[:DELAY_S]],... ('' for none)")
    ap.add_argument("--hedge-after", type=float, default=0.05)
    ap.add_argument("--sample", type=float, default=10.0, help="seconds between samples (default 10)")
    ap.add_argument("--warmup", type=float, default=0.2, help="fraction of the run before the baseline sample")
    ap.add_argument("--rss-slack", type=size_arg, default=64 << 20)
    ap.add_argument("--fd-slack", type=int, default=16)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--json", metavar="FILE", help="write the samples and the verdict as JSON")
    args = ap.parse_args(argv)

    import logging

    logging.basicConfig(level=logging.ERROR)  # thousands of injected faults are logged as warnings otherwise
    root = Path(tempfile.mkdtemp(prefix="kvs-load-", dir=args.dir))
    plan = FaultPlan(parse_faults(args.faults), seed=args.seed, log_size=1000)  # a bounded log: RSS must stay flat
    engine = FaultyEngine(make_engine("threads"), plan)
    cfg = {"tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": args.capacity},
                     {"name": "shared", "path": str(root / "shared"), "capacity_bytes": args.capacity}],
           "memory_bytes": args.memory, "create_dirs": True, "io_engine": "threads",
           "hedge_after_s": args.hedge_after or None}
    rng = random.Random(args.seed)
    keys = [rng.randbytes(16) for _ in range(args.keys)]
    payload = Payloads(args.size)
    for k in keys:  # warm the payload cache before the baseline, so it is not counted as growth
        payload(k)
    stop = threading.Event()
    totals: dict[str, int] = {}
    tlock = threading.Lock()
    samples: list[dict[str, float]] = []

    finished = threading.Event()  # set once every worker has stopped and the writes have drained

    def watchdog() -> None:
        stop.wait(args.seconds + 60)  # the sampler sets stop at the deadline
        if not finished.wait(60):
            print("watchdog: workers did not stop within 60 s of the end; exiting", file=sys.stderr, flush=True)
            os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    store = kvstream.open_store(cfg, engine=engine)
    idle_before = open_fds()
    t_start = time.monotonic()
    workers = [threading.Thread(target=worker, args=(store, keys, payload, stop, args.seed * 100 + i, totals, tlock,
                                                     args.step), name=f"load-{i}") for i in range(args.threads)]
    for w in workers:
        w.start()
    print(f"{'t_s':>6} {'rss_MiB':>8} {'fds':>5} {'threads':>7} {'mem_MiB':>8} {'disk_hits':>9} {'misses':>7} "
          f"{'corrupt':>7} {'reread':>6} {'read_err':>8} {'write_err':>9} {'nospace':>7} {'hedged':>6} {'faults':>7}",
          flush=True)
    try:
        while True:
            now = time.monotonic() - t_start
            st = store.stats().as_dict()
            s = {"t": now, "rss": rss_bytes(), "fds": open_fds(), "threads": threading.active_count(),
                 "mem": st["memory"]["used_bytes"], "disk_hits": st["disk_hits"], "misses": st["misses"],
                 "corrupt": sum(t["corrupt_chunks"] for t in st["tiers"].values()),
                 "reread": sum(t["read_transient"] for t in st["tiers"].values()),  # failed, read back intact
                 "read_errors": sum(t["read_errors"] for t in st["tiers"].values()),
                 "write_errors": sum(t["write_errors"] for t in st["tiers"].values()),
                 "nospace": sum(t["write_skipped_full"] + t["write_retried_nospace"] for t in st["tiers"].values()),
                 "hedged": st["hedged_reads"], "faults": plan.injected()}
            samples.append(s)
            print(f"{now:6.0f} {s['rss'] / 2**20:8.1f} {s['fds']:5d} {s['threads']:7d} {s['mem'] / 2**20:8.1f} "
                  f"{s['disk_hits']:9d} {s['misses']:7d} {s['corrupt']:7d} {s['reread']:6d} {s['read_errors']:8d} "
                  f"{s['write_errors']:9d} {s['nospace']:7d} {s['hedged']:6d} {s['faults']:7d}", flush=True)
            if now >= args.seconds:
                break
            time.sleep(min(args.sample, max(0.0, args.seconds - now)))
    finally:
        stop.set()
        for w in workers:
            w.join()
        engine.release_stalls()
        store.drain(60)
        for t in store.tiers:
            t.read_ring.drain(60)
        idle_after = open_fds()
        finished.set()
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    base = next((s for s in samples if s["t"] >= args.warmup * args.seconds), samples[0])
    late = [s for s in samples if s["t"] >= base["t"]]
    third = max(1, len(late) // 3)
    fd_first = statistics.median(s["fds"] for s in late[:third])
    fd_last = statistics.median(s["fds"] for s in late[-third:])
    growth = {"rss": max(s["rss"] for s in late) - base["rss"], "fds": fd_last - fd_first,
              "threads": max(s["threads"] for s in late) - base["threads"]}
    slope = 0.0
    if len(late) >= 2:
        ts = [s["t"] for s in late]
        mt, mr = statistics.fmean(ts), statistics.fmean(s["rss"] for s in late)
        den = sum((t - mt) ** 2 for t in ts)
        slope = sum((s["t"] - mt) * (s["rss"] - mr) for s in late) / den * 60 / 2**20 if den else 0.0
    checks = {
        f"RSS growth after warm-up {growth['rss'] / 2**20:.1f} MiB <= {args.rss_slack / 2**20:.0f} MiB "
        f"(trend {slope:+.2f} MiB/min)": growth["rss"] <= args.rss_slack,
        f"open fds, median of the last third {fd_last:.0f} vs first third {fd_first:.0f}: growth "
        f"{growth['fds']:.0f} <= {args.fd_slack}": growth["fds"] <= args.fd_slack,
        f"open fds when idle: {idle_after} after the run vs {idle_before} before (+-2)":
            abs(idle_after - idle_before) <= 2,
        f"thread growth {growth['threads']} <= 8": growth["threads"] <= 8,
        f"wrong bytes returned {totals.get('wrong_bytes', 0)} == 0": totals.get("wrong_bytes", 0) == 0,
        f"exceptions on the serving path {totals.get('errors', 0)} == 0": totals.get("errors", 0) == 0,
    }
    injected = {f"{ring}:{kind}": n for (ring, kind), n in sorted(plan.counts.items())}
    print(f"\n{args.threads} threads, {args.seconds:.0f} s: {totals.get('ops', 0)} loops, {totals.get('puts', 0)} puts, "
          f"{totals.get('reads', 0)} chunk reads ({totals.get('hits', 0)} hits); faults injected: {injected}")
    for text, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {text}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "samples": samples, "totals": totals,
                                               "injected": injected, "checks": checks}, indent=2))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
