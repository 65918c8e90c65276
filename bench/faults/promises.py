"""Issue 21 (round 3): does every acknowledgement keep its promise? One scenario per defect found, each
printing one JSON line with what the store said and what was true.

    flock /tmp/kvs-bench.lock .venv/bin/python bench/faults/promises.py all
    ... promises.py starved --hogs 4 --seconds 20 --engine threads      # one scenario

To compare with older code, run the same script with an export of that tree first on ``PYTHONPATH``
(``git archive REV src | tar -x -C /tmp/old && PYTHONPATH=/tmp/old/src .venv/bin/python bench/faults/...``):
the script uses only the public API and attributes every version has, and prints ``null`` for figures a version
does not keep.

Scenarios (two tiers on the real disk, full replication):

- ``breakers-open``: every tier's breaker open, 20 puts of 64 KiB, flush, ``drain(5)``, host memory emptied:
  how many of the 20 acknowledged chunks a read returns.
- ``close-48``: 48 puts of 1 MiB into 64 MiB of host memory (the shared tier's write backlog, half of it,
  skips later second copies: owed), then ``close()`` with the background catch-up stopped: the report, and the
  second copies on the shared tier after a reopen.
- ``freeze-87``: every shared write held back 5 s (a frozen file system), 87 puts, ``close(timeout=0.5)``: how
  many of the 87 copies in flight the journal owes before they land.
- ``journal-66``: a journal of 50 live debts around a 66 MiB junk line: how many are owed after open.
- ``journal-growth``: 4 threads put, flush, read and evict for ``--seconds`` (60) while 5 % of shared writes
  fail (debts owed and paid): the journal's size every 10 s.
- ``no-room``: 6 debts whose chunks must be read back while a caller's views pin all of host memory, for
  ``--seconds`` (30): read-backs and copies.
- ``starved``: 8 threads read (and put) while ``--hogs`` busy processes starve the CPU, ``hedge_after_s`` 0.05,
  for ``--seconds`` (20): breaker openings per tier on a healthy disk, and the per-read latency (submission to
  completion) of the reads steps used.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

import kvstream
from kvstream.io import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.replica_debt import OwedReplicas

MIB = 1 << 20


def config(root: Path, **kw: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": "1GiB"},
                                   {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "1GiB"}],
                         "memory_bytes": "64MiB", "create_dirs": True, "io_engine": "threads", "node_id": "n1"}
    c.update(kw)
    return c


def payload(key: bytes, n: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(n)


def breakers_open(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = kvstream.open_store(config(root))
    now = time.monotonic()
    for h in s.health:
        h.cooldown_s = 3600
        for _ in range(h.threshold):
            h.on_failure(now)
    keys = [bytes([i]) * 16 for i in range(20)]
    acked = sum(bool(s.put(k, payload(k, 64 << 10))) for k in keys)
    s.flush()
    drained = s.drain(5)
    s.evict_memory()
    readable = sum(v is not None for v in s.get_many(keys))
    s.close(timeout=1)
    return {"acked": acked, "drain": drained, "readable_after_evict": readable}


def close_48(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    s = kvstream.open_store(config(root))
    s._catch_up.stop()  # only close may pay
    keys = [bytes([1, i]) * 8 for i in range(48)]
    for k in keys:
        s.put(k, payload(k, MIB))
    s.flush()
    s.drain(30)
    owed = s.owed.counts()["shared"]
    rep = s.close()
    with kvstream.open_store(config(root)) as again:
        on_shared = sum(again.tiers[1].contains(k) for k in keys)
        left = again.owed.counts()["shared"]
    return {"owed_before_close": owed, "report_true": bool(rep), "report": repr(rep), "on_shared_after": on_shared,
            "journal_owed_after": left}


def freeze_87(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    plan = FaultPlan(seed=3)
    plan.add(Fault(kind="delay", rings="shared-w", delay_s=5.0))
    engine = FaultyEngine(make_engine("threads"), plan)
    s = kvstream.open_store(config(root), engine=engine)
    keys = [bytes([2, i]) * 8 for i in range(87)]
    for k in keys:
        s.put(k, payload(k, 64 << 10))
    rep = s.close(timeout=0.5)
    owed = OwedReplicas(root / "local" / "owed", "n1", ["local", "shared"])  # what the next open would read
    journalled = owed.counts()["shared"]
    owed.close()
    engine.release_stalls()
    time.sleep(1)  # the background closer ends once the released writes land
    return {"in_flight_at_close": len(keys), "journalled_owed": journalled, "report": repr(rep)}


def journal_66(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    folder = root / "owed"
    folder.mkdir()

    def key(i: int) -> bytes:
        return i.to_bytes(4, "big") * 4

    with open(folder / "n1.log", "wb") as f:
        f.write(b"+shared " + key(0).hex().encode() + b"\n")
        f.write(b"x" * (66 << 20) + b"\n")
        for i in range(1, 50):
            f.write(b"+shared " + key(i).hex().encode() + b"\n")
    t0 = time.perf_counter()
    owed = OwedReplicas(folder, "n1", ["local", "shared"])
    took = time.perf_counter() - t0
    n = owed.counts()["shared"]
    owed.close()
    return {"live_in_file": 50, "owed_after_open": n, "open_s": round(took, 3)}


def journal_growth(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    plan = FaultPlan(seed=9)
    plan.add(Fault(kind="eio", rings="shared-w", p=0.05))
    tiers = [{"name": "local", "path": str(root / "local"), "capacity_bytes": "96MiB"},
             {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "96MiB"}]
    s = kvstream.open_store(config(root, memory_bytes="32MiB", tiers=tiers),
                            engine=FaultyEngine(make_engine("threads"), plan))
    for h in s.health:
        h.cooldown_s = 0.2
    stop = threading.Event()
    rng = random.Random(1)
    keys = [rng.randbytes(16) for _ in range(3000)]
    data = {k: payload(k, 64 << 10) for k in keys}

    def work(seed: int) -> None:
        r = random.Random(seed)
        while not stop.is_set():
            for k in r.sample(keys, 3):
                s.put(k, data[k])
            s.flush()
            s.get_many(r.sample(keys, 16))
            if r.random() < 0.05:
                s.evict_memory()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    sizes = []
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.seconds:
        time.sleep(10)
        path = s.owed.path
        sizes.append((round(time.monotonic() - t0), path.stat().st_size if path else None))
    stop.set()
    for t in threads:
        t.join()
    st = s.stats()
    out = {"seconds": args.seconds, "journal_bytes_every_10s": sizes, "puts": st.puts,
           "compactions": getattr(st, "owed_journal_compactions", None)}
    s.close(timeout=10)
    return out


def no_room(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    size = 512 << 10
    rng = np.random.default_rng(2)
    owed_keys = [bytes([1, i]) * 8 for i in range(6)]
    held_keys = [bytes([2, i]) * 8 for i in range(7)]
    data = {k: rng.bytes(size) for k in owed_keys + held_keys}
    with kvstream.open_store(config(root, memory_bytes="4MiB")) as s:
        for k in owed_keys + held_keys:
            s.put(k, data[k], tiers=["local"])
            s.flush()
            s.drain(10)
        s.evict_memory()
        views = s.get_many(held_keys)  # a caller pins all of host memory
        for k in owed_keys:
            s.owed.owe("shared", k)
        time.sleep(args.seconds)
        st = s.stats()
        out = {"seconds": args.seconds, "debts": len(owed_keys), "read_backs": st.catch_up_reads,
               "copies": st.catch_up_copies, "still_owed": st.tiers["shared"].replicas_owed}
        del views
    return out


def _hog(stop: Any) -> None:
    while not stop.is_set():
        x = 0
        for i in range(100_000):
            x += i


def starved(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from kvstream import reader

    latencies: list[float] = []
    check = reader.Reader._check

    def timed_check(self: Any, call: Any, tag: Any) -> bool:
        ok = check(self, call, tag)
        if ok:
            latencies.append(tag.latency)
        return ok

    reader.Reader._check = timed_check  # type: ignore[method-assign]
    ctx = mp.get_context("fork")
    stop_hogs = ctx.Event()
    hogs = [ctx.Process(target=_hog, args=(stop_hogs,)) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    tiers = [{"name": "local", "path": str(root / "local"), "capacity_bytes": "96MiB"},
             {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "96MiB"}]
    s = kvstream.open_store(config(root, tiers=tiers, memory_bytes="48MiB", io_engine=args.engine,
                                   hedge_after_s=0.05))
    rng = random.Random(1)
    keys = [rng.randbytes(16) for _ in range(3000)]
    data = {k: payload(k, 64 << 10) for k in keys}
    halt = threading.Event()
    wrong = [0]

    def work(seed: int) -> None:
        r = random.Random(seed)
        while not halt.is_set():
            for k in r.sample(keys, 3):
                s.put(k, data[k])
            s.flush()
            want = r.sample(keys, 16)
            for k, v in zip(want, s.get_many(want)):
                if v is not None and bytes(v) != data[k]:
                    wrong[0] += 1
            if r.random() < 0.05:
                s.evict_memory()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    try:
        for t in threads:
            t.start()
        time.sleep(args.seconds)
    finally:
        halt.set()
        for t in threads:
            t.join()
        stop_hogs.set()
        for h in hogs:
            h.join()
        reader.Reader._check = check  # type: ignore[method-assign]
    st = s.stats()
    lat = np.array(latencies) if latencies else np.zeros(1)
    out = {"seconds": args.seconds, "hogs": args.hogs, "engine": args.engine,
           "breaker_opened": {n: t.circuit_opened for n, t in st.tiers.items()},
           "stalled_reads": st.stalled_reads, "disk_hits": st.disk_hits, "wrong_bytes": wrong[0],
           "stalls_ignored": [getattr(h, "stalls_ignored", None) for h in s.health],
           "read_latency_s": {"p50": round(float(np.percentile(lat, 50)), 4),
                              "p99": round(float(np.percentile(lat, 99)), 4), "max": round(float(lat.max()), 4)}}
    s.close(timeout=10)
    return out


SCENARIOS: dict[str, Callable[[Path, argparse.Namespace], dict[str, Any]]] = {
    "breakers-open": breakers_open, "close-48": close_48, "freeze-87": freeze_87, "journal-66": journal_66,
    "journal-growth": journal_growth, "no-room": no_room, "starved": starved,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=[*SCENARIOS, "all"])
    ap.add_argument("--seconds", type=float, default=None, help="journal-growth 60, no-room 30, starved 20")
    ap.add_argument("--hogs", type=int, default=4, help="busy processes beside the store (starved)")
    ap.add_argument("--engine", default="threads", help="io engine (starved)")
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.ERROR)  # the scenarios make the store warn on purpose
    defaults = {"journal-growth": 60.0, "no-room": 30.0, "starved": 20.0}
    for name in (SCENARIOS if args.scenario == "all" else [args.scenario]):
        root = Path(tempfile.mkdtemp(prefix="kvs-promises-", dir=args.dir))
        run_args = argparse.Namespace(**{**vars(args), "seconds": args.seconds or defaults.get(name, 0.0)})
        try:
            print(json.dumps({"scenario": name, **SCENARIOS[name](root, run_args)}), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
