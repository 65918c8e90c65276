"""``kvstream bench write``: deferred, replicated writes and their interference with reads.

Part 1, writes alone: ``chunks`` new chunks put and flushed with the chosen replication policy; reports the
seconds until all are published, bytes written per tier and the write amplification, beside the raw writer's
bandwidth on the same tiers measured in the same run (all tiers at once).

Part 2, a serving loop of ``steps`` steps: each step reads ``read_chunks`` existing chunks (host memory
emptied, so from disk), then "computes" for ``compute_s`` seconds and produces ``write_chunks`` new chunks.
``deferred`` flushes the new chunks when the next forward pass starts (at the start of compute, after the
read), KVStream's choice; ``eager`` flushes each chunk as it is put, so writes overlap the next step's read.
Reports the read time per step in both modes and alone (no writes): the interference deferral avoids.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

import kvstream
from kvstream.errors import NothingMeasuredError
from kvstream.format import file_size
from kvstream.io import make_engine
from kvstream.io.rawread import write_files

__all__ = ["WriteBenchConfig", "run_write_bench"]


@dataclass
class WriteBenchConfig:
    tiers: list[tuple[str, str]]
    chunks: int = 64
    chunk_bytes: int = 4 << 20
    replication: str = "full"
    io_engine: str = "auto"
    steps: int = 8
    read_chunks: int = 16
    write_chunks: int = 4
    compute_s: float = 0.1
    router: str = "mitm"


def _keys(tag: str, n: int, start: int = 0) -> list[bytes]:
    return [xxhash.xxh3_128_digest(f"kvstream-wbench:{tag}:{i}".encode()) for i in range(start, start + n)]


def _open(cfg: WriteBenchConfig, root_tag: str, replication: str | None = None) -> kvstream.Store:
    total = (cfg.chunks + cfg.steps * (cfg.read_chunks + cfg.write_chunks)) * file_size(cfg.chunk_bytes)
    return kvstream.open_store({
        "tiers": [{"name": n, "path": f"{p}/{root_tag}", "capacity_bytes": max(2 * total, 1 << 30)} for n, p in cfg.tiers],
        "memory_bytes": total + (64 << 20), "replication": replication or cfg.replication, "router": cfg.router,
        "io_engine": cfg.io_engine, "create_dirs": True,
    })


def _payload(cfg: WriteBenchConfig, i: int, base: np.ndarray) -> np.ndarray:
    base[:8] = np.frombuffer(i.to_bytes(8, "little"), dtype=np.uint8)
    return base


def _check_written(st: Any, chunks: int) -> None:
    """Part 1 timed the publishing of ``chunks`` chunks: refuse the figure if a tier failed writes or the primary
    tier (which every replication policy writes every chunk to) did not publish them all (raises
    :class:`NothingMeasuredError` naming the tiers)."""
    failed = {n: t.write_errors for n, t in st.tiers.items() if t.write_errors}
    primary = next(iter(st.tiers.values()), None)
    if failed or primary is None or primary.write_chunks < chunks:
        detail = ", ".join(f"{n}: {t.write_chunks} written, {t.write_errors} write errors, {t.write_skipped_full} "
                           f"skipped as full" for n, t in st.tiers.items())
        raise NothingMeasuredError(f"part 1 did not publish its {chunks} chunks ({detail}), so its time is not "
                                   "the writes' time; check the tier folders' free space and rerun")


def run_write_bench(cfg: WriteBenchConfig, progress: Any = None) -> dict[str, Any]:
    import shutil

    engine = make_engine(cfg.io_engine)
    base = np.frombuffer(np.random.default_rng(3).bytes(cfg.chunk_bytes), dtype=np.uint8).copy()
    out: dict[str, Any] = {"replication": cfg.replication, "chunks": cfg.chunks, "chunk_bytes": cfg.chunk_bytes}
    tag = f"wb-{time.time_ns()}"
    try:
        # -- part 1: writes alone ---------------------------------------------------------------------------
        store = _open(cfg, tag)
        keys = _keys("w", cfg.chunks)
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            store.put(k, _payload(cfg, i, base), position=i)
        store.flush()
        store.drain()
        seconds = time.perf_counter() - t0
        st = store.stats()
        store.close()
        _check_written(st, cfg.chunks)
        put_bytes = cfg.chunks * file_size(cfg.chunk_bytes)
        raw_paths = {n: [f"{p}/{tag}/raw-{j}" for j in range(4)] for n, p in cfg.tiers}
        per_file = max(4096, put_bytes // 4 // 4096 * 4096)
        import threading

        raw: dict[str, Any] = {}

        def one(name: str) -> None:
            raw[name] = write_files(raw_paths[name], per_file, engine=engine, depth=4, sync=False)

        threads = [threading.Thread(target=one, args=(n,)) for n in raw_paths]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["write"] = {
            "seconds": seconds, "put_bytes": put_bytes,
            "write_amplification": st.write_amplification,
            "per_tier": {n: {"bytes": t.write_bytes, "chunks": t.write_chunks} for n, t in st.tiers.items()},
            "raw_concurrent_write_gbps": {n: r.gbps for n, r in raw.items()},
            # the fastest the replicated writes could go: each tier's bytes at its raw concurrent bandwidth
            "bound_seconds": max(st.tiers[n].write_bytes / (raw[n].gbps * 1e9) for n in raw if raw[n].gbps > 0),
        }
        out["write"]["over_bound"] = seconds / out["write"]["bound_seconds"] - 1
        for paths in raw_paths.values():
            for p in paths:
                try:
                    import os

                    os.unlink(p)
                except FileNotFoundError:
                    pass
        # -- part 2: the step loop ----------------------------------------------------------------------------
        modes: dict[str, Any] = {}
        for mode in ("alone", "eager", "deferred"):
            store = _open(cfg, f"{tag}-{mode}")
            pool = _keys(f"pool-{mode}", cfg.steps * cfg.read_chunks)
            for i, k in enumerate(pool):
                store.put(k, _payload(cfg, i, base))
                if i % 8 == 7:
                    store.flush()
                    store.drain()
            store.flush()
            store.drain()
            store.evict_memory()
            new = _keys(f"new-{mode}", cfg.steps * cfg.write_chunks)
            read_times = []
            n_new = 0
            for s in range(cfg.steps):
                step_keys = pool[s * cfg.read_chunks : (s + 1) * cfg.read_chunks]
                t0 = time.perf_counter()
                got = sum(1 for _, p in store.read_iter(step_keys) if p is not None)
                read_times.append(time.perf_counter() - t0)
                if got != len(step_keys):  # a step that read part of its chunks has no read time to compare
                    raise NothingMeasuredError(f"part 2 ({mode}): only {got} of {len(step_keys)} chunks of step {s} "
                                               "came back from the tiers; check them (kvstream verify) and rerun")
                if mode == "deferred":
                    store.flush()  # the forward pass has started: last step's writes go out now
                time.sleep(cfg.compute_s)  # the forward pass
                if mode != "alone":
                    for _ in range(cfg.write_chunks):
                        store.put(new[n_new], _payload(cfg, 10**6 + n_new, base))
                        n_new += 1
                        if mode == "eager":
                            store.flush()
                store.evict_memory()
                if progress is not None:
                    progress()
            store.flush()
            store.drain()
            modes[mode] = {"read_seconds_per_step_median": statistics.median(read_times),
                           "read_seconds_total": sum(read_times)}
            store.close()
        out["steps"] = {"steps": cfg.steps, "read_chunks": cfg.read_chunks, "write_chunks": cfg.write_chunks,
                        "compute_s": cfg.compute_s, **modes}
        a = modes["alone"]["read_seconds_total"]
        out["steps"]["eager_read_slowdown"] = modes["eager"]["read_seconds_total"] / a - 1
        out["steps"]["deferred_read_slowdown"] = modes["deferred"]["read_seconds_total"] / a - 1
        out["io_engine"] = engine.name
    finally:
        for _, p in cfg.tiers:
            for suffix in ("", "-alone", "-eager", "-deferred"):
                shutil.rmtree(f"{p}/{tag}{suffix}", ignore_errors=True)
    return out
