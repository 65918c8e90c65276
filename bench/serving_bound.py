#!/usr/bin/env python3
"""Issue 20, part 1: where the second tier's bandwidth goes under serving conditions.

The aggregate-bandwidth bound of DESIGN.md is "Σ tier bandwidths measured concurrently, under the same write
load". ``kvstream replay`` used to compare its loads with each tier read alone on a quiet machine; inside the
serving loop there is also the deferred write stream (to both tiers, when replicating) and a thread serving the
requests. This benchmark measures, on the same two tiers and under the same conditions, side by side:

- ``raw``: the engine's raw reader (:mod:`kvstream.io.rawread`, no format, no verification) on the store's own
  chunk files: the local tier alone, the shared tier alone, both at once (the bound: the sum of their rates
  while both read);
- ``store 2 tiers``: the store's meet-in-the-middle read of a step of chunks from both tiers (``read_chunks``,
  verification included), its wall-clock GB/s and each tier's rate while it had a read in flight;
- ``store 1 tier``: the same step read from the local tier only;

under three conditions: ``quiet``; ``writes`` (a second store on the same tiers puts and flushes chunks at
``--write-gbps``, replicated to both tiers: the replay's deferred writes); ``writes+serving`` (also a Python
thread that holds the GIL for ``--serving-busy-ms`` of every ``--serving-period-ms``, as a serving loop does).
For every store read it records each thread's CPU seconds and run-queue wait per GB loaded and the GIL wait
(:mod:`kvstream.io.cpuprobe`). Each cell is the median of ``--reps`` repetitions, conditions interleaved.

It also prices the emulated tier itself (``--emulate``: a RAM-backed folder throttled by
:class:`~kvstream.io.throttle.ThrottledEngine`, replay's default when there is one disk): CPU seconds per GB to
write fresh files into it and to read them, the first figure on pages the kernel had handed back to the
hypervisor (a VM with free page reporting) and again on pages just freed.

Run it alone: ``flock /tmp/kvs-bench.lock .venv/bin/python bench/serving_bound.py --json out.json``.
Real second tier: ``bench/testbed up`` then ``bench/testbed run -- .venv/bin/python bench/serving_bound.py
--shared /mnt/kvs-shared/sb`` (a path on its own device; no emulation).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kvstream.commands.probe import parse_size
from kvstream.io import make_engine
from kvstream.io.cpuprobe import ThreadCpuMeter
from kvstream.io.rawread import read_tiers_concurrently
from kvstream.io.throttle import ThrottledEngine
from kvstream.store import open_store

CONDITIONS = ("quiet", "writes", "writes+serving")


class WriteLoad:
    """Puts and flushes ``chunk``-byte chunks into ``store`` at ``gbps`` (new keys: the tier allocates, evicts and
    publishes as under serving), until stopped."""

    def __init__(self, store: Any, chunk: int, gbps: float) -> None:
        self.store, self.chunk, self.rate = store, chunk, gbps * 1e9
        self.payload = os.urandom(1 << 20) * (chunk >> 20) + os.urandom(chunk & ((1 << 20) - 1))
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-write-load", daemon=True)
        self.n = 0

    def _run(self) -> None:
        t0 = time.perf_counter()
        while not self.stop.is_set():
            self.store.put(f"wl-{os.getpid()}-{self.n}".encode(), self.payload)
            self.n += 1
            self.store.flush()
            ahead = self.n * self.chunk / self.rate - (time.perf_counter() - t0)
            if ahead > 0:
                self.stop.wait(ahead)

    def __enter__(self) -> "WriteLoad":
        self.thread.start()
        time.sleep(1.0)  # let the write stream reach its rate before the reads start
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


class ServingThread:
    """A thread that runs Python (holds the GIL) ``busy_ms`` of every ``period_ms``."""

    def __init__(self, busy_ms: float, period_ms: float) -> None:
        self.busy, self.period = busy_ms / 1e3, period_ms / 1e3
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="bench-serving", daemon=True)

    def _run(self) -> None:
        x = 0
        while not self.stop.is_set():
            end = time.perf_counter() + self.busy
            while time.perf_counter() < end:
                x += 1
            self.stop.wait(max(self.period - self.busy, 0.0))

    def __enter__(self) -> "ServingThread":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def _engine(emulate_gbps: float | None) -> Any:
    eng = make_engine("auto")
    if emulate_gbps:
        bw = emulate_gbps * 1e9
        eng = ThrottledEngine(eng, {"shared-r": bw, "shared-w": bw, "raw-shared": bw})
    return eng


def _store(local: Path, shared: Path, chunk: int, engine: Any, router: str, memory: int, cap: int = 8 << 30) -> Any:
    return open_store({"tiers": [{"name": "local", "path": str(local), "capacity_bytes": cap},
                                 {"name": "shared", "path": str(shared), "capacity_bytes": cap}],
                       "memory_bytes": memory, "read_overflow_bytes": 0, "router": router, "replication": "full",
                       "create_dirs": True, "chunk_bytes": chunk}, engine=engine)


def _files(folder: Path) -> list[str]:
    return sorted(str(p) for p in folder.rglob("*.kvc"))


def _store_read(store: Any, keys: list[bytes], chunk: int) -> dict[str, Any]:
    store.evict_memory()
    c0 = {t.name: (t.counters.read_bytes, t.counters.read_busy_s) for t in store.tiers}
    meter = ThreadCpuMeter(period_s=0.2).start()
    t0 = time.perf_counter()
    got = sum(1 for _, c in store.read_chunks(keys) if c is not None)
    dt = time.perf_counter() - t0
    cpu = meter.stop()
    if got != len(keys):
        raise RuntimeError(f"store read {got} of {len(keys)} chunks")
    gb = got * chunk / 1e9
    tiers = {}
    for t in store.tiers:
        nb = t.counters.read_bytes - c0[t.name][0]
        busy = t.counters.read_busy_s - c0[t.name][1]
        tiers[t.name] = {"gb": nb / 1e9, "busy_gbps": nb / busy / 1e9 if busy > 0 else 0.0}
    return {"gbps": gb / dt, "tiers": tiers, "gil_wait_share": meter.gil_wait_share,
            "cpu_s_per_gb": {k: v.cpu_s / gb for k, v in cpu.items() if v.cpu_s > 0.001},
            "runq_s_per_gb": {k: v.runq_s / gb for k, v in cpu.items() if v.runq_s > 0.001}}


def _raw(files: dict[str, list[str]], engine: Any, chunk: int, seconds: float, shared_direct: bool) -> dict[str, float]:
    specs: dict[str, Any] = {}
    fds: list[int] = []
    for name, paths in files.items():
        if name == "shared" and not shared_direct:
            opened = [(os.open(p, os.O_RDONLY), os.path.getsize(p)) for p in paths]
            fds += [fd for fd, _ in opened]
            specs[name] = opened
        else:
            specs[name] = paths
    try:
        # One whole chunk file per op and one op in flight per tier: the store's reads of 48 MiB chunks (its
        # window is at least one chunk).
        r = read_tiers_concurrently(specs, engine=engine, depth=1, seconds=seconds)
    finally:
        for fd in fds:
            os.close(fd)
    out = {k: v.gbps for k, v in r.tiers.items()}
    out["sum"] = r.sum_gbps
    return out


def emulation_cost(folder: Path, chunk: int, n: int) -> dict[str, float]:
    """CPU seconds per GB to write ``n`` fresh chunk files into the emulated tier's RAM folder and to read them,
    the write on memory the kernel had returned (after a pause) and again at once on just-freed memory."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    folder.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(chunk)
    gb = n * chunk / 1e9
    out = {}
    time.sleep(5)  # freed memory goes back to the hypervisor within seconds where the VM reports free pages
    for label in ("write_fresh_s_per_gb", "write_reused_s_per_gb"):
        c0 = cpu()
        for i in range(n):
            fd = os.open(folder / f"f{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.write(fd, buf)
            os.close(fd)
        out[label] = (cpu() - c0) / gb
        if label == "write_fresh_s_per_gb":
            for i in range(n):
                os.unlink(folder / f"f{i}")
    into = bytearray(chunk)  # one buffer, touched before the clock starts: the read's cost, not the buffer's
    into[::4096] = b"\1" * len(into[::4096])
    c0 = cpu()
    for i in range(n):
        with open(folder / f"f{i}", "rb", buffering=0) as f:
            f.readinto(into)
    out["read_s_per_gb"] = (cpu() - c0) / gb
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--local", default="/var/tmp", help="folder on the local disk (default /var/tmp)")
    ap.add_argument("--shared", default=None, help="folder on a second device (default: an emulated RAM tier)")
    ap.add_argument("--emulate-gbps", type=float, default=None,
                    help="emulated tier bandwidth, GB/s (default: the local tier's raw rate / 3, as replay)")
    ap.add_argument("--chunk", default="48MiB")
    ap.add_argument("--chunks", type=int, default=24, help="chunks per store read (one step)")
    ap.add_argument("--write-gbps", type=float, default=0.2, help="write load, GB/s (replay's default: ~0.2)")
    ap.add_argument("--serving-busy-ms", type=float, default=2.0)
    ap.add_argument("--serving-period-ms", type=float, default=10.0)
    ap.add_argument("--seconds", type=float, default=5.0, help="raw read window")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    chunk = parse_size(args.chunk)
    base_l = Path(tempfile.mkdtemp(prefix="kvs-sb-", dir=args.local))
    emulated = args.shared is None
    base_s = Path(tempfile.mkdtemp(prefix="kvs-sb-", dir="/dev/shm" if emulated else args.shared))
    results: dict[str, Any] = {"args": vars(args), "emulated": emulated, "cells": {}}
    try:
        # Data: the step's chunks on both tiers (full replication), written by the store itself.
        seed = _store(base_l / "data-l", base_s / "data-s", chunk, make_engine("auto"), "mitm",
                      (args.chunks + 2) * chunk)
        keys = [f"sb-{i}".encode() for i in range(args.chunks)]
        payload = os.urandom(chunk)
        for k in keys:
            seed.put(k, payload)
        seed.flush()
        seed.drain(timeout=600)
        seed.close()
        files = {"local": _files(base_l / "data-l"), "shared": _files(base_s / "data-s")}
        plain = make_engine("auto")
        local_raw = _raw({"local": files["local"]}, plain, chunk, args.seconds, True)["local"]
        emu = args.emulate_gbps or (round(local_raw / 3, 3) if emulated else None)
        results["emulate_gbps"] = emu if emulated else None
        print(f"serving_bound: local raw {local_raw:.2f} GB/s; shared "
              + (f"EMULATED at {emu} GB/s" if emulated else f"on {args.shared}"), file=sys.stderr)
        engine = _engine(emu if emulated else None)
        # Host memory: the step's chunks and a little more for each reader (prefaulted, as replay does), 1 GiB of
        # write buffers for the write load (the replay's backlog limit is half its 2 GiB host memory).
        step = (args.chunks + 2) * chunk
        two = _store(base_l / "data-l", base_s / "data-s", chunk, engine, "mitm", step)
        one = _store(base_l / "data-l", base_s / "data-s", chunk, engine, "single:local", step)
        # The write load's tiers are kept at 3 GiB: it evicts as it writes, so the RAM tier allocates and frees pages
        # as a serving store's does, and RAM stays bounded.
        writer = _store(base_l / "wl-l", base_s / "wl-s", chunk, engine, "mitm", 1 << 30, cap=3 << 30)
        for s in (two, one):
            s.prefault_memory(chunk)
        cells: dict[str, dict[str, list[Any]]] = {c: {} for c in CONDITIONS}
        for rep in range(args.reps):
            for cond in CONDITIONS[rep % 3:] + CONDITIONS[:rep % 3]:
                ctx = []
                if cond != "quiet":
                    ctx.append(WriteLoad(writer, chunk, args.write_gbps))
                if cond == "writes+serving":
                    ctx.append(ServingThread(args.serving_busy_ms, args.serving_period_ms))
                for c in ctx:
                    c.__enter__()
                try:
                    row = cells[cond]
                    row.setdefault("raw local alone", []).append(
                        _raw({"local": files["local"]}, engine, chunk, args.seconds, True))
                    row.setdefault("raw shared alone", []).append(
                        _raw({"shared": files["shared"]}, engine, chunk, args.seconds, not emulated))
                    row.setdefault("raw both", []).append(_raw(files, engine, chunk, args.seconds, not emulated))
                    row.setdefault("store 2 tiers", []).append(_store_read(two, keys, chunk))
                    row.setdefault("store 1 tier", []).append(_store_read(one, keys, chunk))
                finally:
                    for c in reversed(ctx):
                        c.__exit__(None, None, None)
                print(f"serving_bound: rep {rep + 1}/{args.reps} {cond} done", file=sys.stderr)
        for s in (two, one, writer):
            s.close(timeout=120)
        results["cells"] = cells
        if emulated:
            results["emulation_cost"] = emulation_cost(base_s / "cost", chunk, 16)
    finally:
        shutil.rmtree(base_l, ignore_errors=True)
        shutil.rmtree(base_s, ignore_errors=True)
    summary = summarize(results)
    results["summary"] = summary
    print_table(summary, results)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    return 0


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Per condition, the medians over repetitions: the raw bound (both tiers at once), each tier raw alone and
    within the bound, the store's two-tier and one-tier reads, their ratios to the bound, and the local tier's rate
    in the store's two-tier read against its one-tier read (does reading the shared tier slow it?)."""
    out = {}
    for cond, row in results["cells"].items():
        if not row:
            continue
        bound = _med([r["sum"] for r in row["raw both"]])
        two = _med([r["gbps"] for r in row["store 2 tiers"]])
        one = _med([r["gbps"] for r in row["store 1 tier"]])
        l2 = _med([r["tiers"]["local"]["busy_gbps"] for r in row["store 2 tiers"]])
        l1 = _med([r["tiers"]["local"]["busy_gbps"] for r in row["store 1 tier"]])
        cpu: dict[str, list[float]] = {}
        for r in row["store 2 tiers"]:
            for k, v in r["cpu_s_per_gb"].items():
                cpu.setdefault(k, []).append(v)
        out[cond] = {
            "raw_local_alone": _med([r["local"] for r in row["raw local alone"]]),
            "raw_shared_alone": _med([r["shared"] for r in row["raw shared alone"]]),
            "raw_both_local": _med([r["local"] for r in row["raw both"]]),
            "raw_both_shared": _med([r["shared"] for r in row["raw both"]]),
            "bound": bound, "store_two": two, "store_one": one,
            "store_two_of_bound": two / bound if bound else float("nan"),
            "store_one_of_local_raw": one / _med([r["local"] for r in row["raw local alone"]]),
            "local_busy_two": l2, "local_busy_one": l1, "local_two_over_one": l2 / l1 if l1 else float("nan"),
            "gil_wait_share_two": _med([r["gil_wait_share"] for r in row["store 2 tiers"]]),
            "cpu_s_per_gb_two": {k: _med(v) for k, v in sorted(cpu.items(), key=lambda kv: -_med(kv[1]))},
        }
    return out


def print_table(summary: dict[str, Any], results: dict[str, Any]) -> None:
    print(f"{'condition':15s} {'raw L':>6s} {'raw S':>6s} {'both L':>6s} {'both S':>6s} {'bound':>6s} "
          f"{'store2':>6s} {'of bnd':>6s} {'store1':>6s} {'L 2/1':>6s} {'GIL':>5s}")
    for cond, s in summary.items():
        print(f"{cond:15s} {s['raw_local_alone']:6.2f} {s['raw_shared_alone']:6.2f} {s['raw_both_local']:6.2f} "
              f"{s['raw_both_shared']:6.2f} {s['bound']:6.2f} {s['store_two']:6.2f} "
              f"{100 * s['store_two_of_bound']:5.0f}% {s['store_one']:6.2f} {100 * s['local_two_over_one']:5.0f}% "
              f"{100 * s['gil_wait_share_two']:4.0f}%")
        top = list(s["cpu_s_per_gb_two"].items())[:6]
        print("    CPU s per GB loaded (two tiers): " + ", ".join(f"{k} {v:.3f}" for k, v in top))
    if "emulation_cost" in results:
        c = results["emulation_cost"]
        print(f"emulated tier's own cost, CPU s per GB: write to fresh memory {c['write_fresh_s_per_gb']:.2f}, to "
              f"just-freed memory {c['write_reused_s_per_gb']:.2f}, read {c['read_s_per_gb']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
