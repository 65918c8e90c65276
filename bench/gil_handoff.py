#!/usr/bin/env python3
"""Issue 20: what Python's thread switch interval costs a store's reads while another thread runs Python.

Every chunk a step reads passes the GIL between threads several times (the ring's reaper, a tier's open thread,
the consumer that checks it); a thread waiting for the GIL while another runs Python waits up to the switch
interval (``sys.getswitchinterval()``, 5 ms unless changed). This reads ``--chunks`` chunks of ``--chunk-mib``
through a :class:`kvstream.store.Store`, in steps of 8 (a serving load's size), from

- ``one``: the local disk alone (``--dir``, O_DIRECT), and
- ``two``: the same disk and an emulated second tier (a RAM folder behind the engine's throttle at
  ``--shared-gbps``; the replay's default stand-in), met in the middle;

each ``quiet`` and ``busy`` (one more Python thread running a loop the whole time: a serving thread that is
never idle, the worst case), under each switch interval of ``--intervals-ms``. The interval is process-wide, so
each interval runs in its own process, and the processes alternate (``--rounds``). The bound, in the same
process and on the same chunk files: the engine's raw reader (io_uring, no checks) on the local tier's files,
quiet; and for ``two`` that plus ``--shared-gbps``. Each cell: the median over rounds x ``--reps`` passes, GB/s
of payload delivered. Nothing here is a test.

Run it alone: ``flock /tmp/kvs-bench.lock .venv/bin/python bench/gil_handoff.py --dir /var/tmp/kvs-gil``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from serving_bound import ServingThread  # bench/ is this script's folder, so its first import path


def child(args: argparse.Namespace) -> dict[str, list[float]]:
    """One process, one switch interval: every cell's passes, GB/s."""
    from kvstream.io import make_engine
    from kvstream.io.rawread import read_files
    from kvstream.io.throttle import ThrottledEngine
    from kvstream.store import open_store

    sys.setswitchinterval(args.interval_ms / 1e3)
    chunk, n = args.chunk_mib << 20, args.chunks
    cap = (n + 4) * (chunk + (1 << 20))
    payload = bytes(chunk)
    keys = [f"k{i}".encode() for i in range(n)]
    base, shm = Path(args.dir), Path(tempfile.mkdtemp(prefix="kvs-gil-", dir="/dev/shm"))
    out: dict[str, list[float]] = {}
    stores = {}
    try:
        for mode in ("one", "two"):
            tiers = [{"name": "local", "path": str(base / mode), "capacity_bytes": cap}]
            if mode == "two":
                tiers.append({"name": "shared", "path": str(shm / mode), "capacity_bytes": cap})
            shutil.rmtree(base / mode, ignore_errors=True)
            bw = args.shared_gbps * 1e9
            engine = ThrottledEngine(make_engine("auto"), {"shared-r": bw, "shared-w": bw})
            store = open_store({"tiers": tiers, "memory_bytes": cap, "create_dirs": True,
                                "router": "mitm" if mode == "two" else "single:local",
                                "replication": "full" if mode == "two" else "single"}, engine=engine)
            for k in keys:
                store.put(k, payload)
            store.flush()
            store.drain(timeout=300)
            stores[mode] = store
        files = sorted(p for p in (base / "one").rglob("*") if p.is_file() and p.stat().st_size >= chunk)
        raw_engine = make_engine("auto")
        for _ in range(args.reps):
            raw = read_files(files, engine=raw_engine, depth=4, op_bytes=8 << 20)
            out.setdefault("raw", []).append(raw.gbps)
            for busy in (False, True):
                for mode, store in stores.items():
                    store.evict_memory()
                    # busy: serving_bound's serving thread, holding the GIL all of every period
                    with ServingThread(busy_ms=50, period_ms=50) if busy else contextlib.nullcontext():
                        t0, got = time.perf_counter(), 0
                        for b in range(0, n, 8):
                            got += sum(1 for _, c in store.read_chunks(keys[b:b + 8]) if c is not None)
                        dt = time.perf_counter() - t0
                    if got != n:
                        raise SystemExit(f"{mode}: {n - got} of {n} chunks missed")
                    out.setdefault(f"{mode}-{'busy' if busy else 'quiet'}", []).append(got * chunk / dt / 1e9)
    finally:
        for store in stores.values():
            store.close()
        shutil.rmtree(base / "one", ignore_errors=True)
        shutil.rmtree(base / "two", ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="a folder on the local disk (O_DIRECT)")
    ap.add_argument("--chunk-mib", type=int, default=48)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--shared-gbps", type=float, default=1.1)
    ap.add_argument("--intervals-ms", default="5,1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--interval-ms", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        json.dump(child(args), sys.stdout)
        return 0
    intervals = [float(x) for x in args.intervals_ms.split(",")]
    cells: dict[float, dict[str, list[float]]] = {i: {} for i in intervals}
    for rnd in range(args.rounds):
        for iv in intervals if rnd % 2 == 0 else intervals[::-1]:
            cmd = [sys.executable, __file__, "--child", "--interval-ms", str(iv), "--dir", args.dir,
                   "--chunk-mib", str(args.chunk_mib), "--chunks", str(args.chunks),
                   "--shared-gbps", str(args.shared_gbps), "--reps", str(args.reps)]
            got = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
            for k, v in got.items():
                cells[iv].setdefault(k, []).extend(v)
            print(f"round {rnd + 1}/{args.rounds}, {iv:g} ms: done", file=sys.stderr)
    result = {"command": sys.argv, "chunk_mib": args.chunk_mib, "chunks": args.chunks,
              "shared_gbps": args.shared_gbps, "medians_gbps": {}, "passes_gbps": {}}
    print(f"{'interval':>9} {'raw':>6} {'one quiet':>10} {'one busy':>9} {'two quiet':>10} {'two busy':>9}"
          f"   (GB/s; two's bound: raw + {args.shared_gbps:g})")
    for iv in intervals:
        med = {k: statistics.median(v) for k, v in cells[iv].items()}
        result["medians_gbps"][f"{iv:g}ms"] = med
        result["passes_gbps"][f"{iv:g}ms"] = cells[iv]
        print(f"{iv:>7g}ms {med['raw']:6.2f} {med['one-quiet']:10.2f} {med['one-busy']:9.2f} "
              f"{med['two-quiet']:10.2f} {med['two-busy']:9.2f}   "
              f"busy/raw one {med['one-busy'] / med['raw']:.2f}, "
              f"two {med['two-busy'] / (med['raw'] + args.shared_gbps):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
