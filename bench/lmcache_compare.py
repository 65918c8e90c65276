#!/usr/bin/env python3
"""Benchmark: LMCache's own LocalDiskBackend vs the kvstream plugin, through LMCache's StorageManager.

Three LMCache ``StorageManager``s live side by side in one process, hold the same chunks (same keys, same
bytes, written through ``batched_put``) and are read with the same calls:

- ``lmcache-disk``: LMCache's ``LocalDiskBackend`` on the local disk, ``use_odirect: true``, its read pool
  (``disk_io_threads``) tuned first by a sweep, best size kept (the sweep is printed);
- ``kvstream-1``: the kvstream plugin on one tier, the same local disk;
- ``kvstream-2``: the kvstream plugin on two tiers, the local disk and a throttled "shared" tier (a loop
  device on tmpfs, blkio-throttled, TESTBED.md recipe 1, set up and torn down here), ``replication: full``.

Sync path: ``StorageManager.batched_get(keys_of_one_request, location=...)`` for each request in turn (what
LMCache's retrieve does). Async path: every request's ``async_lookup_and_prefetch`` issued at once (the
scheduler's lookups of a step), timed until LMCache has answered the last one. Each round drops the page
cache and empties kvstream's own host-memory tier first (all reads come from the devices; every path uses
O_DIRECT), and rotates the order of the systems; figures are medians over ``--runs`` rounds, with ratios
to LMCache's disk tier computed per round (paired).

Bounds printed beside them, measured in the same run on the same files: the raw O_DIRECT reader
(``kvstream.io.rawread``) on LMCache's files and on each kvstream tier alone, and both kvstream tiers read
at once (the aggregate-bandwidth bound); ``expected 2-tier ratio = Σ concurrent tier GB/s / local GB/s``.

``--breakdown`` also reads kvstream-1's chunks with ``Store.read_chunks`` alone (with and without checksum
verification) in every round, times the per-chunk copy and checksum, and adds the raw reader into 4 KiB-page
buffers to the bounds: where the plugin's time goes beyond the device.

Run it alone, as root (drop_caches, loop device, cgroup): ``flock /tmp/kvs-bench.lock .venv/bin/python
bench/lmcache_compare.py``. Data: ``--requests × --chunks`` chunks per model preset (≈1.9 GiB for ``14b``,
1 GiB for ``small``) under ``--dir`` (default /var/tmp, on the root disk) and the shared tier; all removed
at the end. Needs torch 2.13.0 and lmcache 0.5.6 (scripts/setup.sh test). Writes ``--json`` if asked.
"""

from __future__ import annotations

import os

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               "LMCACHE_LOG_LEVEL": os.environ.get("LMCACHE_LOG_LEVEL", "WARNING")}.items():
    os.environ[_k] = _v

import argparse
import asyncio
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash
import yaml
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager, EventStatus, EventType
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase

from kvstream.io import buffers as _buffers
from kvstream.io import make_engine
from kvstream.io.rawread import read_files, read_tiers_concurrently

GiB, MiB = 1 << 30, 1 << 20
CHUNK_TOKENS = 256
PLUGIN = "kvstream"

# name -> (layers, kv heads, head dim): bf16, 256 tokens, K and V
PRESETS = {
    "14b": (48, 8, 128),  # 48 MiB per chunk (a 14B GQA model, e.g. Qwen2.5-14B)
    "small": (8, 2, 64),  # 1 MiB per chunk
}
DEFAULT_SHAPE = {"14b": (5, 8), "small": (8, 128)}  # requests, chunks per request


# ── the throttled shared tier (TESTBED.md recipe 1) ───────────────────────────────────────────────────────
class ThrottledTier:
    """A loop device on a tmpfs file, ext4, mounted, reads blkio-throttled for this process. Torn down on exit."""

    CGROUP = Path("/sys/fs/cgroup/blkio/kvstream-lmcache-bench")

    def __init__(self, image_bytes: int, read_bps: int, mount: Path, image: Path,
                 local_dir: Path | None = None, local_read_bps: int = 0) -> None:
        self.image_bytes, self.read_bps, self.mount, self.image = image_bytes, read_bps, mount, image
        self.local_dir, self.local_read_bps = local_dir, local_read_bps  # optional throttle of the local disk too
        self.loop: str | None = None
        self.mounted = False
        self.cgroup_made = False

    def __enter__(self) -> "ThrottledTier":
        if os.geteuid() != 0:
            raise SystemExit("the two-tier run needs root (loop device, mount, blkio cgroup); use --no-shared")
        if not Path("/sys/fs/cgroup/blkio").is_dir():
            raise SystemExit("cgroup v1 blkio is not mounted at /sys/fs/cgroup/blkio: cannot throttle")
        try:
            self.image.parent.mkdir(parents=True, exist_ok=True)
            with open(self.image, "wb") as f:
                f.truncate(self.image_bytes)
            self.loop = _sh("losetup", "-f", "--show", "--direct-io=on", str(self.image)).strip()
            _sh("mkfs.ext4", "-q", "-F", self.loop)
            self.mount.mkdir(parents=True, exist_ok=True)
            _sh("mount", self.loop, str(self.mount))
            self.mounted = True
            mm = _sh("lsblk", "-no", "MAJ:MIN", self.loop).strip()
            self.CGROUP.mkdir(exist_ok=True)
            self.cgroup_made = True
            (self.CGROUP / "blkio.throttle.read_bps_device").write_text(f"{mm} {self.read_bps}\n")
            if self.local_dir is not None and self.local_read_bps:
                (self.CGROUP / "blkio.throttle.read_bps_device").write_text(
                    f"{disk_of(self.local_dir)} {self.local_read_bps}\n")
            (self.CGROUP / "cgroup.procs").write_text(f"{os.getpid()}\n")
            mine = Path("/proc/self/cgroup").read_text()
            if "kvstream-lmcache-bench" not in mine:
                raise SystemExit("could not move this process into the blkio cgroup: the tier would be unthrottled")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.cgroup_made:
            try:
                Path("/sys/fs/cgroup/blkio/cgroup.procs").write_text(f"{os.getpid()}\n")
                self.CGROUP.rmdir()
            except OSError as e:
                print(f"teardown: cgroup: {e}", file=sys.stderr)
        if self.mounted:
            subprocess.run(["umount", str(self.mount)], check=False)
        if self.loop:
            subprocess.run(["losetup", "-d", self.loop], check=False)
        self.image.unlink(missing_ok=True)
        try:
            self.image.parent.rmdir()
        except OSError:
            pass


def disk_of(path: Path) -> str:
    """MAJ:MIN of the whole disk holding ``path`` (blkio throttles whole disks, not partitions)."""
    st = os.stat(path)
    node = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    if (node / "partition").exists():
        node = node.resolve().parent
    return (node / "dev").read_text().strip()


def _sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


DROP_CACHES = "1"  # 1: page cache only (file metadata stays cached, as on a serving node); 3: also dentries/inodes


def drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text(f"{DROP_CACHES}\n")
    except OSError as e:  # not root: O_DIRECT still bypasses the cache for every reader here
        print(f"(cannot drop caches: {e})", file=sys.stderr)


# ── LMCache managers ─────────────────────────────────────────────────────────────────────────────────────
@dataclass
class System:
    name: str
    sm: StorageManager
    location: str
    kind: str  # "lmcache" | "kvstream"
    notes: str = ""
    files: dict[str, list[Path]] = field(default_factory=dict)  # tier -> chunk files (for the raw bound)


def _metadata(layers: int, heads: int, dim: int) -> LMCacheMetadata:
    return LMCacheMetadata(model_name="bench/model", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16,
                           kv_shape=(layers, 2, CHUNK_TOKENS, heads, dim))


def _manager(extra: dict[str, Any], meta: LMCacheMetadata, cpu_gb: float, **kw: Any) -> StorageManager:
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK_TOKENS, local_cpu=False, max_local_cpu_size=cpu_gb,
                                            enable_async_loading=True, save_unfull_chunk=False,
                                            extra_config=extra, **kw)
    PinMonitor.GetOrCreate(cfg)
    return StorageManager(cfg, meta, EventManager())


def build_systems(args: argparse.Namespace, root: Path, shared: Path | None, meta: LMCacheMetadata,
                  data_bytes: int, chunk_bytes: int) -> list[System]:
    cpu_gb = round((data_bytes + 8 * chunk_bytes) / GiB + 0.25, 2)  # the async run holds every chunk at once
    systems = []
    lmc_dir = root / "lmcache-disk"
    sm = _manager({"use_odirect": True, "disk_io_threads": 4}, meta, cpu_gb, local_disk=str(lmc_dir),
                  max_local_disk_size=data_bytes * 1.5 / GiB)
    systems.append(System("lmcache-disk", sm, "LocalDiskBackend", "lmcache"))

    def kvs(name: str, tiers: list[tuple[str, Path]]) -> System:
        read_budget = max(args.inflight_mib * MiB, chunk_bytes)
        conf = {
            "tiers": [{"name": n, "path": str(p), "capacity_bytes": int(data_bytes * 1.5),
                       "read_inflight_bytes": read_budget, "read_depth": 64} for n, p in tiers],
            "memory_bytes": int(min(data_bytes, 4 * GiB) + 64 * MiB),
            "replication": "full", "router": args.router, "io_engine": args.io_engine, "create_dirs": True,
        }
        if args.read_windows:
            conf["read_windows"] = args.read_windows
        cfile = root / f"{name}.yaml"
        cfile.write_text(yaml.safe_dump(conf))
        extra = {f"storage_plugin.{PLUGIN}.module_path": "kvstream.integrations.lmcache",
                 f"storage_plugin.{PLUGIN}.class_name": "KVStreamBackend",
                 "kvstream.config_file": str(cfile), "kvstream.load_threads": 8,
                 "kvstream.read_into": args.read_path == "into"}
        sm = _manager(extra, meta, cpu_gb, storage_plugins=[PLUGIN])
        if PLUGIN not in sm.storage_backends:
            sm.close()
            raise SystemExit(f"{name}: the kvstream plugin did not load (see LMCache's error above)")
        store = sm.storage_backends[PLUGIN].store
        return System(name, sm, PLUGIN, "kvstream",
                      notes=f"router {args.router}, inflight {read_budget >> 20} MiB, read_windows "
                            f"{store.config.read_windows}, huge-page buffers {'on' if _buffers.HUGEPAGES else 'off'}, "
                            f"verify_reads {store.config.verify_reads}, read path {args.read_path}")

    systems.append(kvs("kvstream-1", [("local", root / "kvs1")]))
    if shared is not None:
        systems.append(kvs("kvstream-2", [("local", root / "kvs2"), ("shared", shared / "kvs2")]))
    return systems


# ── data ──────────────────────────────────────────────────────────────────────────────────────────────────
def request_keys(sm: StorageManager, n_requests: int, chunks: int) -> list[list[Any]]:
    db = ChunkedTokenDatabase(sm.config, sm.metadata)
    out = []
    for r in range(n_requests):
        tokens = list(range(r * 10_000_000, r * 10_000_000 + chunks * CHUNK_TOKENS))
        out.append([k for _, _, k in db.process_tokens(tokens=tokens)])
    return out


def populate(systems: list[System], reqs: list[list[Any]], shape: torch.Size) -> dict[Any, int]:
    """Write every chunk through each manager's batched_put; wait until every backend has it on disk."""
    rng = np.random.default_rng(1234)
    sums: dict[Any, int] = {}
    nbytes = shape.numel() * 2
    for keys in reqs:
        for key in keys:
            data = rng.integers(0, 256, nbytes, dtype=np.uint8)
            sums[key] = xxhash.xxh3_64_intdigest(data)
            for s in systems:
                obj = s.sm.allocate(shape, torch.bfloat16, MemoryFormat.KV_2LTD)
                assert obj is not None, f"{s.name}: CPU pool too small"
                np.copyto(np.frombuffer(obj.byte_array, dtype=np.uint8), data)
                s.sm.batched_put([key], [obj])
        for s in systems:
            wait_written(s, keys)
    for s in systems:
        wait_written(s, [k for ks in reqs for k in ks])
    return sums


def wait_written(s: System, keys: list[Any], timeout: float = 600.0) -> None:
    backend = s.sm.storage_backends[s.location]
    deadline = time.monotonic() + timeout
    while any(backend.exists_in_put_tasks(k) for k in keys):
        if time.monotonic() > deadline:
            raise SystemExit(f"{s.name}: writes did not finish")
        time.sleep(0.02)
    if s.kind == "kvstream":
        backend.store.flush()
        backend.store.drain()
    else:
        deadline = time.monotonic() + timeout
        while backend.batched_contains(keys) < len(keys):
            if time.monotonic() > deadline:
                raise SystemExit(f"{s.name}: writes did not land")
            time.sleep(0.02)


def chunk_files(s: System, keys: list[Any]) -> dict[str, list[Path]]:
    backend = s.sm.storage_backends[s.location]
    if s.kind == "lmcache":
        return {"local": [Path(backend._key_to_path(k)) for k in keys]}
    out: dict[str, list[Path]] = {}
    for tier in backend.store.tiers:
        out[tier.name] = [tier.path_for(backend._keys(k)) for k in keys]
    return out


def cold(systems: list[System], keys: list[Any]) -> None:
    """Page cache dropped and kvstream's own host-memory tier emptied: every read comes from a device."""
    for s in systems:
        if s.kind == "kvstream":
            backend = s.sm.storage_backends[s.location]
            for k in keys:
                backend.store.memory.discard(backend._keys(k))
    drop_caches()


def release(objs: list[Any]) -> None:
    for o in objs:
        if o is None:
            continue
        if o.is_pinned:
            o.unpin()
        o.ref_count_down()


# ── the measured paths ───────────────────────────────────────────────────────────────────────────────────
def run_sync(s: System, reqs: list[list[Any]], sums: dict[Any, int] | None) -> float:
    """One batched_get per request, in turn. Returns seconds; checks every byte when ``sums`` is given."""
    total = 0.0
    for keys in reqs:
        t0 = time.perf_counter()
        objs = s.sm.batched_get(keys, location=s.location)
        total += time.perf_counter() - t0
        try:
            missing = sum(o is None for o in objs)
            if missing:
                raise SystemExit(f"{s.name}: {missing} of {len(keys)} chunks missing in a sync read")
            if sums is not None:
                for k, o in zip(keys, objs):
                    if xxhash.xxh3_64_intdigest(o.byte_array) != sums[k]:
                        raise SystemExit(f"{s.name}: wrong bytes for a chunk")
        finally:
            release(objs)
    return total


def run_store_only(s: System, reqs: list[list[Any]], verify: bool = True) -> float:
    """Breakdown: the same requests read with ``Store.read_chunks`` alone (what the plugin calls), each chunk
    dropped as it lands: no LMCache object, no copy. ``verify=False`` also skips the payload checksum."""
    backend = s.sm.storage_backends[s.location]
    store = backend.store
    saved = store.config.verify_reads
    object.__setattr__(store.config, "verify_reads", verify)  # frozen dataclass; a diagnostic switch only
    try:
        total = 0.0
        for keys in reqs:
            skeys = backend._keys.many(list(keys))
            t0 = time.perf_counter()
            got = 0
            for _, chunk in store.read_chunks(skeys):
                got += chunk is not None
                del chunk
            total += time.perf_counter() - t0
            if got != len(keys):
                raise SystemExit(f"{s.name}: store-only read found {got} of {len(keys)} chunks")
        return total
    finally:
        object.__setattr__(store.config, "verify_reads", saved)


def cpu_costs(s: System, key: Any, reps: int = 5) -> dict[str, float]:
    """Breakdown: single-thread CPU cost per chunk, warm, of what the plugin adds to a read: the payload
    checksum (xxh3, the store's verification) and the copy from the store's buffer into an LMCache object."""
    from kvstream.integrations.lmcache import _copy_into

    backend = s.sm.storage_backends[s.location]
    chunk = next(c for _, c in backend.store.read_chunks([backend._keys(key)]))
    payload = chunk.payload
    obj = s.sm.allocate(s.sm.metadata.get_shapes()[0], torch.bfloat16, MemoryFormat.KV_2LTD)
    try:
        def best(fn: Any) -> float:
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return min(ts)
        copy_s = best(lambda: _copy_into(obj, payload))
        hash_s = best(lambda: xxhash.xxh3_64_intdigest(payload))
    finally:
        release([obj])
        del payload, chunk
    n = s.sm.metadata.get_shapes()[0].numel() * 2
    return {"copy_ms": copy_s * 1e3, "copy_gbps": n / copy_s / 1e9, "xxh3_ms": hash_s * 1e3,
            "xxh3_gbps": n / hash_s / 1e9}


def anon_huge_mib() -> float:
    """This process's anonymous memory on transparent huge pages (MiB), from /proc/self/smaps_rollup."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


class _Answers:
    def __init__(self) -> None:
        self.got: dict[str, int] = {}
        self.cv = threading.Condition()

    def send_response_to_scheduler(self, lookup_id: str, n: int) -> None:
        with self.cv:
            self.got[lookup_id] = n
            self.cv.notify_all()


def run_async(s: System, reqs: list[list[Any]], tag: str, sums: dict[Any, int] | None) -> float:
    """Every request's lookup+prefetch issued at once; seconds until LMCache answered the last one."""
    answers = _Answers()
    s.sm.async_lookup_server = answers
    ids = [f"{tag}-{i}" for i in range(len(reqs))]
    t0 = time.perf_counter()
    futs = [asyncio.run_coroutine_threadsafe(
        s.sm.async_lookup_and_prefetch(lid, keys, [i * CHUNK_TOKENS for i in range(len(keys) + 1)], None, False),
        s.sm.loop) for lid, keys in zip(ids, reqs)]
    with answers.cv:
        if not answers.cv.wait_for(lambda: len(answers.got) == len(ids), timeout=600):
            raise SystemExit(f"{s.name}: async lookups not answered")
    elapsed = time.perf_counter() - t0
    for f in futs:
        f.result(timeout=10)
    for lid, keys in zip(ids, reqs):
        want = len(keys) * CHUNK_TOKENS
        if answers.got[lid] != want:
            raise SystemExit(f"{s.name}: async lookup {lid} found {answers.got[lid]} of {want} tokens")
        if s.sm.event_manager.get_event_status(EventType.LOADING, lid) != EventStatus.DONE:
            raise SystemExit(f"{s.name}: no loaded objects for {lid}")
        pairs = [p for tier in s.sm.event_manager.get_event_future(EventType.LOADING, lid).result() for p in tier]
        try:
            if sums is not None:
                for k, o in pairs:
                    if xxhash.xxh3_64_intdigest(o.byte_array) != sums[k]:
                        raise SystemExit(f"{s.name}: wrong bytes for a prefetched chunk")
        finally:
            release([o for _, o in pairs])
    return elapsed


def tune_lmcache_threads(s: System, reqs: list[list[Any]], sweep: list[int], everyone: list[System]) -> tuple[int, dict[int, float]]:
    """Pick LocalDiskBackend's disk_io_threads: its read pool is rebuilt with each size (as the config would)."""
    backend = s.sm.storage_backends[s.location]
    nbytes = sum(len(k) for k in reqs) * reqs_bytes(s, reqs)
    res: dict[int, float] = {}
    for n in sweep:
        backend._read_thread_pool.shutdown(wait=True)
        backend._read_thread_pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="disk-read")
        cold(everyone, [k for ks in reqs for k in ks])
        res[n] = nbytes / run_sync(s, reqs, None) / 1e9
    best = max(res, key=res.get)  # type: ignore[arg-type]
    backend._read_thread_pool.shutdown(wait=True)
    backend._read_thread_pool = ThreadPoolExecutor(max_workers=best, thread_name_prefix="disk-read")
    return best, res


def reqs_bytes(s: System, reqs: list[list[Any]]) -> int:
    shape = s.sm.metadata.get_shapes()[0]
    return shape.numel() * 2


def raw_bounds(systems: list[System], everyone: list[System], chunk_bytes: int,
               small_pages: bool = False) -> dict[str, Any]:
    """The raw reader's GB/s on each system's files (huge-page buffers, as rawread does by default); with
    ``small_pages`` also on LMCache's and kvstream-1's files into 4 KiB-page buffers (``--breakdown``)."""
    engine = make_engine("auto")
    depth = 4 if chunk_bytes >= 16 * MiB else 32
    out: dict[str, Any] = {"engine": engine.name, "depth": depth}
    if True:
        for s in systems:
            for tier, files in s.files.items():
                cold(everyone, [])
                out[f"{s.name}/{tier}"] = read_files(files, engine=engine, depth=depth).gbps
                if small_pages and s.name in ("lmcache-disk", "kvstream-1"):
                    cold(everyone, [])
                    out[f"{s.name}/{tier} 4KiB-page buffers"] = read_files(files, engine=engine, depth=depth,
                                                                           hugepages=False).gbps
        two = next((s for s in systems if s.name == "kvstream-2"), None)
        if two is not None:
            cold(everyone, [])
            r = read_tiers_concurrently(two.files, engine=engine, depth=depth)
            out["concurrent"] = {t: v.gbps for t, v in r.tiers.items()}
            out["concurrent_sum"] = sum(v.gbps for v in r.tiers.values())
            out["concurrent_aggregate"] = r.gbps
    return out


# ── one preset ───────────────────────────────────────────────────────────────────────────────────────────
def run_preset(args: argparse.Namespace, preset: str, shared: Path | None) -> dict[str, Any]:
    layers, heads, dim = PRESETS[preset]
    n_req, n_chunks = args.requests or DEFAULT_SHAPE[preset][0], args.chunks or DEFAULT_SHAPE[preset][1]
    meta = _metadata(layers, heads, dim)
    shape = meta.get_shapes()[0]
    chunk_bytes = shape.numel() * 2
    data_bytes = chunk_bytes * n_req * n_chunks
    root = Path(args.dir) / f"lmcache-compare-{preset}"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    if shared is not None:
        shutil.rmtree(shared / "kvs2", ignore_errors=True)
    print(f"\n== {preset}: {n_req} requests x {n_chunks} chunks of {chunk_bytes / MiB:g} MiB "
          f"({layers} layers, {heads} kv heads, {dim} dims, {CHUNK_TOKENS} tokens, bf16) = {data_bytes / GiB:.2f} GiB")
    systems = build_systems(args, root, shared, meta, data_bytes, chunk_bytes)
    result: dict[str, Any] = {"preset": preset, "chunk_bytes": chunk_bytes, "requests": n_req,
                              "chunks_per_request": n_chunks, "data_bytes": data_bytes}
    try:
        reqs = request_keys(systems[0].sm, n_req, n_chunks)
        all_keys = [k for ks in reqs for k in ks]
        t0 = time.perf_counter()
        sums = populate(systems, reqs, shape)
        print(f"written to every system in {time.perf_counter() - t0:.1f} s")
        for s in systems:
            s.files = chunk_files(s, all_keys)
        bounds = raw_bounds(systems, systems, chunk_bytes, small_pages=args.breakdown)
        result["raw_gbps"] = bounds
        print(f"bound: raw O_DIRECT reader ({bounds['engine']}, depth {bounds['depth']}) on the same files:")
        for k, v in bounds.items():
            if "/" in k:
                print(f"  {k:<42} {v:6.2f} GB/s")
        if "concurrent" in bounds:
            c = bounds["concurrent"]
            print(f"  kvstream-2 both at once  " + " + ".join(f"{t} {v:.2f}" for t, v in c.items())
                  + f" = {bounds['concurrent_sum']:.2f} GB/s")
            result["expected_2tier_ratio"] = bounds["concurrent_sum"] / bounds["kvstream-2/local"]
            print(f"  expected 2-tier ratio = {bounds['concurrent_sum']:.2f} / {bounds['kvstream-2/local']:.2f} "
                  f"= {result['expected_2tier_ratio']:.2f}x")
        lmc = systems[0]
        best, sweep = tune_lmcache_threads(lmc, reqs, args.threads_sweep, systems)
        result["lmcache_threads_sweep_gbps"] = sweep
        result["lmcache_disk_io_threads"] = best
        print("LocalDiskBackend disk_io_threads sweep (sync GB/s): "
              + ", ".join(f"{n}: {g:.2f}" for n, g in sweep.items()) + f" -> using {best}")

        brk: dict[str, list[float]] = {"store": [], "store-noverify": [], "verify_cpu_s": []}
        sync: dict[str, list[float]] = {s.name: [] for s in systems}
        asyn: dict[str, list[float]] = {s.name: [] for s in systems}
        for rnd in range(args.runs):
            order = systems[rnd % len(systems):] + systems[: rnd % len(systems)]
            for s in order:
                cold(systems, all_keys)
                sync[s.name].append(run_sync(s, reqs, sums if rnd == 0 else None))
            if args.breakdown:
                for s in order:
                    if s.name != "kvstream-1":
                        continue
                    st0 = s.sm.storage_backends[s.location].store.stats().as_dict()
                    cold(systems, all_keys)
                    brk["store"].append(run_store_only(s, reqs, verify=True))
                    st1 = s.sm.storage_backends[s.location].store.stats().as_dict()
                    cold(systems, all_keys)
                    brk["store-noverify"].append(run_store_only(s, reqs, verify=False))
                    brk["verify_cpu_s"].append(st1["verify_seconds"] - st0["verify_seconds"])
            if not args.no_async:
                for s in order:
                    cold(systems, all_keys)
                    asyn[s.name].append(run_async(s, reqs, f"{s.name}-{rnd}", sums if rnd == 0 else None))
            print(f"round {rnd + 1}/{args.runs}: " + ", ".join(
                f"{n} sync {data_bytes / sync[n][-1] / 1e9:.2f}"
                + (f" async {data_bytes / asyn[n][-1] / 1e9:.2f}" if asyn[n] else "") for n in sync) + " GB/s")
        result["sync"] = _summary(sync, data_bytes)
        if not args.no_async:
            result["async"] = _summary(asyn, data_bytes)
        result["notes"] = {s.name: s.notes for s in systems}
        result["anon_huge_pages_mib"] = anon_huge_mib()
        if args.breakdown and brk["store"]:
            k1 = next(s for s in systems if s.name == "kvstream-1")
            plugin = sync["kvstream-1"]
            lmc_t = sync["lmcache-disk"]
            result["breakdown"] = {
                "kvstream-1 plugin sync_gbps": data_bytes / statistics.median(plugin) / 1e9,
                "store-only sync_gbps": data_bytes / statistics.median(brk["store"]) / 1e9,
                "store-only no-verify sync_gbps": data_bytes / statistics.median(brk["store-noverify"]) / 1e9,
                "store-only / lmcache (paired)": statistics.median(b / t for b, t in zip(lmc_t, brk["store"])),
                "store-only no-verify / lmcache (paired)":
                    statistics.median(b / t for b, t in zip(lmc_t, brk["store-noverify"])),
                "plugin time over store-only (paired)": statistics.median(p / t for p, t in zip(plugin, brk["store"])),
                "store-only time over no-verify (paired)":
                    statistics.median(a / b for a, b in zip(brk["store"], brk["store-noverify"])),
                "verify CPU s per run (median)": statistics.median(brk["verify_cpu_s"]),
                "runs_s": brk,
                "cpu_per_chunk": cpu_costs(k1, reqs[0][0]),
            }
        for s in systems:
            if s.kind == "kvstream":
                st = s.sm.storage_backends[s.location].store.stats().as_dict()
                result.setdefault("kvstream_tier_reads", {})[s.name] = {
                    t: {"read_chunks": v["read_chunks"], "duplicate_chunks": v["duplicate_chunks"]}
                    for t, v in st["tiers"].items()}
        _print_summary(result)
    finally:
        for s in systems:
            s.sm.close()
        shutil.rmtree(root, ignore_errors=True)
        if shared is not None:
            shutil.rmtree(shared / "kvs2", ignore_errors=True)
    return result


def _summary(times: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    base = times["lmcache-disk"]
    out: dict[str, Any] = {}
    for name, ts in times.items():
        out[name] = {
            "median_s": statistics.median(ts), "runs_s": ts,
            "median_gbps": nbytes / statistics.median(ts) / 1e9,
            "median_ratio_vs_lmcache": statistics.median(b / t for b, t in zip(base, ts)),
        }
    return out


def _print_summary(r: dict[str, Any]) -> None:
    for path in ("sync", "async"):
        if path not in r:
            continue
        print(f"{path} path, median of {len(next(iter(r[path].values()))['runs_s'])} runs "
              f"(ratio: LMCache LocalDiskBackend time / this time, paired per round):")
        for name, v in r[path].items():
            print(f"  {name:<14} {v['median_s']:7.3f} s  {v['median_gbps']:6.2f} GB/s  "
                  f"{v['median_ratio_vs_lmcache']:5.2f}x")
    if "breakdown" in r:
        b = r["breakdown"]
        print("breakdown, kvstream-1 sync path (same rounds, medians; ratios paired per round):")
        for k, v in b.items():
            if k == "runs_s":
                continue
            if isinstance(v, dict):
                print(f"  {k}: " + ", ".join(f"{kk} {vv:.2f}" for kk, vv in v.items()))
            else:
                print(f"  {k:<42} {v:6.3f}")
    if "anon_huge_pages_mib" in r:
        print(f"  this process's AnonHugePages after the runs: {r['anon_huge_pages_mib']:.0f} MiB")
    if "expected_2tier_ratio" in r and "sync" in r and "kvstream-2" in r["sync"]:
        k1, k2 = r["sync"]["kvstream-1"]["median_gbps"], r["sync"]["kvstream-2"]["median_gbps"]
        print(f"  kvstream 2 tiers / 1 tier: {k2 / k1:.2f}x (expected {r['expected_2tier_ratio']:.2f}x from the "
              f"raw concurrent bound)")


def _thp_store_buffers() -> None:
    """Diagnostic only: madvise(MADV_HUGEPAGE) on every AlignedBuffer the store creates from now on."""
    from kvstream.io import buffers
    from kvstream.io.rawread import advise_hugepages

    original = buffers.AlignedBuffer.__init__

    def init(self: Any, capacity: int, *a: Any, **kw: Any) -> None:
        original(self, capacity, *a, **kw)
        advise_hugepages(self)

    buffers.AlignedBuffer.__init__ = init  # type: ignore[method-assign]
    print("diagnostic: the store's aligned buffers are backed by transparent huge pages (--thp-store-buffers)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="14b,small", help="comma list of: " + ", ".join(PRESETS))
    p.add_argument("--requests", type=int, default=0, help="requests per preset (default: per preset)")
    p.add_argument("--chunks", type=int, default=0, help="chunks per request (default: per preset)")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", default="/var/tmp", help="folder on the local disk for LMCache's and kvstream's files")
    p.add_argument("--no-shared", action="store_true", help="skip the two-tier system (no root needed)")
    p.add_argument("--shared-dir", default=None, help="use this folder as the shared tier instead of setting one up")
    p.add_argument("--shared-mbps", type=int, default=400, help="read throttle of the shared tier, MB/s")
    p.add_argument("--shared-image-gib", type=float, default=2.5)
    p.add_argument("--local-mbps", type=int, default=0,
                   help="also throttle reads of the local disk (this process only), MB/s; 0 = not throttled. "
                        "This VM's disk reads recently written data from the host's cache at 3-4 GB/s; "
                        "1200 gives the ~1.2 GB/s disk of TESTBED.md and a stable local:shared ratio")
    p.add_argument("--threads-sweep", default="4,8,16,32")
    p.add_argument("--router", default="mitm")
    p.add_argument("--io-engine", default="auto")
    p.add_argument("--inflight-mib", type=int, default=32,
                   help="kvstream read bytes in flight per tier (the store's default; at least one chunk)")
    p.add_argument("--no-async", action="store_true")
    p.add_argument("--read-path", choices=["into", "copy"], default="into",
                   help="plugin reads: into = Store.read_into (O_DIRECT into LMCache's objects, the default); "
                        "copy = Store.read_chunks, then a copy")
    p.add_argument("--drop-caches", choices=["1", "3"], default="1",
                   help="what to drop before each run: 1 = page cache (default), 3 = also dentries and inodes")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--thp-store-buffers", action="store_true",
                   help="diagnostic from before the store did this itself: madvise(MADV_HUGEPAGE) every aligned "
                        "buffer. The store now backs buffers >= 2 MiB with huge pages by default "
                        "(KVSTREAM_HUGEPAGES=0 turns that off), so this only adds the hint on smaller ones")
    p.add_argument("--read-windows", choices=["balanced", "fixed"], default=None,
                   help="kvstream read-window policy (default: the store's default, balanced)")
    p.add_argument("--breakdown", action="store_true",
                   help="also read kvstream-1's chunks with Store.read_chunks alone (with and without checksum "
                        "verification) in every round, time the per-chunk copy and checksum, and add the raw "
                        "reader into 4 KiB-page buffers to the bounds: where the plugin's time goes")
    args = p.parse_args(argv)
    global DROP_CACHES
    DROP_CACHES = args.drop_caches
    if args.thp_store_buffers:
        _thp_store_buffers()
    args.threads_sweep = [int(x) for x in args.threads_sweep.split(",") if x]
    presets = [x for x in args.presets.split(",") if x]
    for x in presets:
        if x not in PRESETS:
            p.error(f"unknown preset {x!r}")
    results = []
    if args.no_shared:
        results = [run_preset(args, x, None) for x in presets]
    elif args.shared_dir:
        results = [run_preset(args, x, Path(args.shared_dir)) for x in presets]
    else:
        with ThrottledTier(int(args.shared_image_gib * GiB), args.shared_mbps * 1_000_000,
                           Path("/mnt/kvs-lmc-shared"), Path("/dev/shm/kvs-lmc/img"),
                           local_dir=Path(args.dir), local_read_bps=args.local_mbps * 1_000_000) as tier:
            print(f"shared tier: {tier.loop} on tmpfs, ext4 at {tier.mount}, reads throttled to {args.shared_mbps} MB/s"
                  + (f"; local disk {disk_of(Path(args.dir))} reads throttled to {args.local_mbps} MB/s"
                     if args.local_mbps else "; local disk not throttled"))
            results = [run_preset(args, x, tier.mount) for x in presets]
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
