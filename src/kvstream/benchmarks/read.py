"""``kvstream bench read``: a whole-step multi-tier read against the aggregate-bandwidth bound.

One run: fill the tiers with ``chunks`` chunks (full replication, skipped if already there), then ``repeat``
times, alternating so both see the same noise: (1) the bound — every tier's files read by the raw reader,
each tier alone and all tiers at once; the bound is ``bytes / Σ concurrent tier bandwidth``; (2) the store —
all chunks read in one call with the chosen router, host memory emptied first so every byte comes from disk.
Reports medians, ``over_bound = seconds / bound_seconds − 1``, per-tier bytes and duplicates.

Options that make the bound move: ``write_load`` keeps a concurrent write stream on the first tier during both
measurements; ``bandwidth_schedule`` rewrites a blkio throttle file at given offsets into each measurement
(the testbed's shared tier), and the bound is then integrated over time.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

import kvstream
from kvstream.errors import NothingMeasuredError
from kvstream.format import file_size
from kvstream.io import make_engine
from kvstream.io.rawread import read_files, read_tiers_concurrently, write_files

__all__ = ["ReadBenchConfig", "run_read_bench", "bench_keys", "BandwidthSchedule"]


def bench_keys(n: int, chunk_bytes: int) -> list[bytes]:
    """Deterministic keys, so a second run on the same folders reuses the chunks."""
    return [xxhash.xxh3_128_digest(f"kvstream-bench:{chunk_bytes}:{i}".encode()) for i in range(n)]


@dataclass(frozen=True)
class BandwidthSchedule:
    """Throttle changes during a measurement: ``[(offset_s, bytes_per_s), ...]`` written to ``control`` as
    ``"MAJ:MIN BPS"`` (a cgroup v1 ``blkio.throttle.read_bps_device`` file)."""

    control: str
    device: str  # "MAJ:MIN"
    steps: tuple[tuple[float, int], ...]

    @classmethod
    def parse(cls, control: str, device: str, text: str) -> "BandwidthSchedule":
        steps = []
        for part in text.split(","):
            at, _, bps = part.partition("=")
            steps.append((float(at), int(kvstream.config.parse_size(bps, "--bandwidth-schedule"))))
        return cls(control=control, device=device, steps=tuple(sorted(steps)))

    def bps_at(self, t: float) -> int:
        cur = self.steps[0][1]
        for at, bps in self.steps:
            if t >= at:
                cur = bps
        return cur

    def run(self, stop: threading.Event) -> None:
        t0 = time.perf_counter()
        for at, bps in self.steps:
            if stop.wait(max(0.0, at - (time.perf_counter() - t0))):
                return
            with open(self.control, "w") as f:
                f.write(f"{self.device} {bps}\n")

    def bytes_by(self, seconds: float) -> float:
        """Bytes the throttled tier can deliver in the first ``seconds`` of the schedule."""
        total = 0.0
        for k, (at, bps) in enumerate(self.steps):
            end = self.steps[k + 1][0] if k + 1 < len(self.steps) else float("inf")
            if seconds <= at:
                break
            total += bps * (min(seconds, end) - at)
        return total


@dataclass
class ReadBenchConfig:
    tiers: list[tuple[str, str]]  # (name, path)
    chunks: int = 64
    chunk_bytes: int = 4 << 20
    router: str = "mitm"
    repeat: int = 5
    # Untimed store reads first: the buffer pool's first use pays page faults (huge pages: a one-off several
    # times the read itself), and balanced read windows need a few steps to measure the tiers. A serving store
    # runs for hours; the steady state is what the bound is compared with.
    warmup: int = 3
    io_engine: str = "auto"
    # Per tier; None: depth × one chunk file, the raw reader's own bytes in flight, so the store and the bound
    # it is compared with keep the same amount of I/O queued (this disk needs ~16 x 4 MiB to reach its speed).
    inflight_bytes: int | None = None
    read_windows: str = "balanced"  # kvstream.read_windows policy
    depth: int = 16  # raw reader ops in flight (and ring depth)
    write_load: bool = False
    bandwidth_schedule: BandwidthSchedule | None = None
    scheduled_tier: str | None = None  # the tier the schedule throttles
    verify: bool = True
    keep: bool = True  # keep the chunks for the next run
    extra: dict[str, Any] = field(default_factory=dict)


def inflight_bytes_of(cfg: ReadBenchConfig) -> int:
    return cfg.inflight_bytes if cfg.inflight_bytes is not None else cfg.depth * file_size(cfg.chunk_bytes)


def _store_config(cfg: ReadBenchConfig) -> dict[str, Any]:
    total = cfg.chunks * file_size(cfg.chunk_bytes)
    return {
        "tiers": [{"name": n, "path": p, "capacity_bytes": max(total * 2, 1 << 30),
                   "read_inflight_bytes": inflight_bytes_of(cfg), "read_depth": cfg.depth} for n, p in cfg.tiers],
        "memory_bytes": total + (64 << 20), "router": cfg.router, "replication": "full",
        "io_engine": cfg.io_engine, "create_dirs": True, "verify_reads": cfg.verify,
        "read_windows": cfg.read_windows, "chunk_bytes": cfg.chunk_bytes,
    }


def _fill(store: kvstream.Store, keys: list[bytes], chunk_bytes: int) -> int:
    base = np.frombuffer(np.random.default_rng(7).bytes(chunk_bytes), dtype=np.uint8).copy()
    written = 0
    for i, k in enumerate(keys):
        missing = [t.name for t in store.tiers if not t.contains(k)]
        if not missing:
            continue
        base[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)  # every chunk differs (same key, same bytes)
        store.put(k, base, tiers=missing)  # a tier emptied since the last run gets its replica back
        written += 1
        if written % 8 == 0:
            store.flush()
            store.drain()
    store.flush()
    store.drain()
    store.evict_memory()
    return written


class _Load:
    """Background conditions held during one measurement: a write stream and/or a throttle schedule."""

    def __init__(self, cfg: ReadBenchConfig, engine: Any, scratch: Path | None) -> None:
        self.cfg, self.engine, self.scratch = cfg, engine, scratch
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.written = 0

    def __enter__(self) -> "_Load":
        if self.cfg.write_load and self.scratch is not None:
            paths = [self.scratch / f"load-{i}" for i in range(4)]

            def load() -> None:
                r = write_files(paths, 64 << 20, engine=self.engine, depth=4, sync=False, until=self.stop)
                self.written = r.bytes

            self.threads.append(threading.Thread(target=load, daemon=True))
        if self.cfg.bandwidth_schedule is not None:
            self.threads.append(threading.Thread(target=self.cfg.bandwidth_schedule.run, args=(self.stop,), daemon=True))
        for t in self.threads:
            t.start()
        if self.cfg.write_load:
            time.sleep(0.2)  # let the write stream reach steady state
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()
        sched = self.cfg.bandwidth_schedule
        if sched is not None:  # leave the throttle where the schedule started
            with open(sched.control, "w") as f:
                f.write(f"{sched.device} {sched.steps[0][1]}\n")


def _integrated_bound(total: int, gbps: dict[str, float], sched: BandwidthSchedule, tier: str) -> float:
    """Smallest T with Σ_other bw·T + throttled_bytes(T) ≥ total (bisection)."""
    other = sum(v for n, v in gbps.items() if n != tier) * 1e9
    lo, hi = 0.0, 1.0
    while other * hi + sched.bytes_by(hi) < total:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        if other * mid + sched.bytes_by(mid) >= total:
            hi = mid
        else:
            lo = mid
    return hi


def _tier_trouble(stats: Any) -> str:
    """Each tier's read errors, corrupt and missing chunks, for an error message."""
    return "; ".join(f"{name}: {t.read_errors} read errors, {t.corrupt_chunks} corrupt, {t.missing_files} missing"
                     for name, t in stats.tiers.items())


def run_read_bench(cfg: ReadBenchConfig, progress: Any = None) -> dict[str, Any]:
    keys = bench_keys(cfg.chunks, cfg.chunk_bytes)
    engine = make_engine(cfg.io_engine)
    runs: list[dict[str, Any]] = []
    scratch = Path(tempfile.mkdtemp(prefix="kvs-load-", dir=cfg.tiers[0][1])) if cfg.write_load else None
    try:
        with kvstream.open_store(_store_config(cfg)) as store:
            filled = _fill(store, keys, cfg.chunk_bytes)
            files = {t.name: [str(t.path_for(k)) for k in keys] for t in store.tiers}
            total = sum(store.tiers[0].file_size(k) or 0 for k in keys)
            alone = {}
            for name, fl in files.items():
                with _Load(cfg, engine, scratch):
                    alone[name] = read_files(fl, engine=engine, depth=cfg.depth).gbps
            for _ in range(cfg.warmup):
                store.evict_memory()
                for _ in store.read_iter(keys):
                    pass
            for rep in range(cfg.repeat):
                with _Load(cfg, engine, scratch):
                    conc = read_tiers_concurrently(files, engine=engine, depth=cfg.depth)
                gbps = {n: r.gbps for n, r in conc.tiers.items()}
                if cfg.bandwidth_schedule is not None and cfg.scheduled_tier in gbps:
                    bound = _integrated_bound(total, gbps, cfg.bandwidth_schedule, cfg.scheduled_tier)
                else:
                    bound = total / (sum(gbps.values()) * 1e9)
                store.evict_memory()
                before = store.stats()
                with _Load(cfg, engine, scratch):
                    t0 = time.perf_counter()
                    got = 0
                    for _, payload in store.read_iter(keys):
                        got += payload is not None
                    seconds = time.perf_counter() - t0
                after = store.stats()
                if got != len(keys):  # the time would be of a part of the step: not a figure to print
                    raise NothingMeasuredError(
                        f"only {got} of {len(keys)} chunks came back from the tiers ({_tier_trouble(after)}), so the "
                        "read time is not a whole step's; check the tier folders (kvstream verify) and rerun")
                per_tier = {}
                for name in files:
                    b, a = before.tiers[name], after.tiers[name]
                    nbytes = a.read_bytes - b.read_bytes
                    per_tier[name] = {"bytes": nbytes, "chunks": a.read_chunks - b.read_chunks,
                                      "duplicates": a.duplicate_chunks - b.duplicate_chunks,
                                      "gbps": nbytes / seconds / 1e9, "raw_concurrent_gbps": gbps[name]}
                runs.append({"seconds": seconds, "bound_seconds": bound, "over_bound": seconds / bound - 1,
                             "duplicate_chunks": sum(p["duplicates"] for p in per_tier.values()),
                             "verify_seconds": after.verify_seconds - before.verify_seconds,
                             "per_tier": per_tier})
                if progress is not None:
                    progress(rep + 1, cfg.repeat)
            engine_name = store.engine.name
            direct = {t.name: t.capabilities.direct_io for t in store.tiers}
        if not cfg.keep:
            for _, p in cfg.tiers:
                for sub in ("chunks", "index", "tmp", "quarantine"):
                    shutil.rmtree(Path(p) / sub, ignore_errors=True)
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    med = sorted(runs, key=lambda r: r["over_bound"])[len(runs) // 2]
    seconds = statistics.median(r["seconds"] for r in runs)
    return {
        "router": cfg.router, "read_windows": cfg.read_windows, "inflight_bytes": inflight_bytes_of(cfg),
        "depth": cfg.depth, "io_engine": engine_name, "direct_io": direct, "chunks": cfg.chunks,
        "chunk_bytes": cfg.chunk_bytes, "bytes": total, "filled_chunks": filled, "repeat": cfg.repeat, "warmup": cfg.warmup,
        "seconds": seconds, "gbps": total / seconds / 1e9,
        "bound_seconds": statistics.median(r["bound_seconds"] for r in runs),
        "over_bound": statistics.median(r["over_bound"] for r in runs),
        "over_bound_runs": [r["over_bound"] for r in runs],
        "duplicate_chunks": med["duplicate_chunks"],
        "verify_seconds": statistics.median(r["verify_seconds"] for r in runs),
        "tier_alone_gbps": alone,
        "per_tier": med["per_tier"], "write_load": cfg.write_load,
        "bandwidth_schedule": list(cfg.bandwidth_schedule.steps) if cfg.bandwidth_schedule else None,
        "runs": runs,
    }
