"""A harness for tests of the LMCache plugin (:mod:`kvstream.integrations.lmcache`) through LMCache's own
StorageManager and ChunkedTokenDatabase, on the CPU: an engine configuration that loads the plugin, a manager
that is always closed, token chunks with reference tensors, put/get/wait helpers and the async lookup path.

Needs lmcache (0.5.6) and torch. Importing this module sets ``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``
and ``HF_HUB_OFFLINE=1`` before it imports LMCache (LMCache reports usage over the network by default), so import
it before anything that imports LMCache.

The model: ``LAYERS`` layers, ``HEADS`` heads of ``HEAD_DIM``, chunks of ``CHUNK`` tokens (512 KiB per bf16
chunk).
"""

from __future__ import annotations

import os

for _k, _v in {"LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ[_k] = _v  # before LMCache is imported: it reports usage over the network by default

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager, EventStatus, EventType
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.storage_manager import StorageManager
from lmcache.v1.token_database import ChunkedTokenDatabase
from prometheus_client import REGISTRY

from kvstream.integrations.lmcache import KVStreamBackend

__all__ = ["LAYERS", "HEADS", "HEAD_DIM", "CHUNK", "PLUGIN", "engine_config", "lmcache_metadata", "tiers_extra",
           "manager", "make_chunks", "put_chunks", "get_chunks", "plugin_of", "release_all", "wait_stored",
           "metric_total", "FakeScheduler", "prefetch", "collect"]

LAYERS, HEADS, HEAD_DIM, CHUNK = 4, 2, 64, 256  # 512 KiB per bf16 chunk
PLUGIN = "kvstream"


def engine_config(extra: dict[str, Any], *, local_disk: str | None = None,
                  async_loading: bool = False) -> LMCacheEngineConfig:
    """An LMCache engine configuration that loads the plugin (``extra``: its ``extra_config`` entries), with
    LMCache's own CPU tier off and, given ``local_disk``, its disk tier on (O_DIRECT)."""
    kw: dict[str, Any] = dict(
        chunk_size=CHUNK, local_cpu=False, max_local_cpu_size=0.06, save_unfull_chunk=True,
        enable_async_loading=async_loading, storage_plugins=[PLUGIN],
        extra_config={f"storage_plugin.{PLUGIN}.module_path": "kvstream.integrations.lmcache",
                      f"storage_plugin.{PLUGIN}.class_name": "KVStreamBackend", **extra})
    if local_disk is not None:
        kw.update(local_disk=local_disk, max_local_disk_size=0.1)
        kw["extra_config"]["use_odirect"] = True
    return LMCacheEngineConfig.from_defaults(**kw)


def lmcache_metadata(model: str = "test/model", world_size: int = 1, worker_id: int = 0) -> LMCacheMetadata:
    """LMCache's metadata of the test model (bf16 KV of ``LAYERS`` x ``CHUNK`` x ``HEADS`` x ``HEAD_DIM``)."""
    return LMCacheMetadata(model_name=model, world_size=world_size, local_world_size=world_size, worker_id=worker_id,
                           local_worker_id=worker_id, kv_dtype=torch.bfloat16,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM))


def tiers_extra(root: Path, two: bool = True) -> dict[str, Any]:
    """The plugin's ``extra_config`` for tiers under ``root``: ``local``, and ``shared`` unless ``two`` is false."""
    spec = f"local={root / 'local'}" + (f",shared={root / 'shared'}" if two else "")
    return {"kvstream.tiers": spec, "kvstream.capacity_bytes": "256MiB", "kvstream.memory_bytes": "16MiB"}


@contextlib.contextmanager
def manager(extra: dict[str, Any], **kw: Any) -> Iterator[StorageManager]:
    """A StorageManager with the plugin (``kw``: ``local_disk``, ``async_loading``, ``metadata``), closed on the way
    out (LMCache's threads would otherwise keep the process alive)."""
    cfg = engine_config(extra, **{k: v for k, v in kw.items() if k in ("local_disk", "async_loading")})
    PinMonitor.GetOrCreate(cfg)
    sm = StorageManager(cfg, kw.get("metadata") or lmcache_metadata(), EventManager())
    try:
        yield sm
    finally:
        sm.close()


def make_chunks(sm: StorageManager, n_tokens: int, seed: int = 0,
                request_configs: dict[str, Any] | None = None) -> tuple[list[Any], list[torch.Tensor]]:
    """(start, end, key) of a token sequence, and a reference tensor per chunk ([2, L, T, H*D], bf16)."""
    cfg, meta = sm.config, sm.metadata
    tokens = list(range(seed * 100_000, seed * 100_000 + n_tokens))
    infos = list(ChunkedTokenDatabase(cfg, meta).process_tokens(tokens=tokens, request_configs=request_configs))
    g = torch.Generator().manual_seed(seed)
    refs = [torch.randn((2, LAYERS, e - s, HEADS * HEAD_DIM), generator=g).to(torch.bfloat16) for s, e, _ in infos]
    return infos, refs


def put_chunks(sm: StorageManager, infos: list[Any], refs: list[torch.Tensor]) -> None:
    """Allocate an LMCache object per chunk, copy its reference in, and ``batched_put`` them all."""
    objs = []
    for (_, _, _), ref in zip(infos, refs):
        obj = sm.allocate(ref.shape, ref.dtype, MemoryFormat.KV_2LTD)
        assert obj is not None
        obj.tensor.copy_(ref)
        objs.append(obj)
    sm.batched_put([k for _, _, k in infos], objs)


def get_chunks(sm: StorageManager, keys: list[Any]) -> list[Any]:
    """The engine's own retrieve path: block mapping, then one batched_get per location."""
    mapping = sm.get_block_mapping([(k, 0, 0) for k in keys])
    out: list[Any] = []
    for location, blocks in mapping.items():
        assert location == PLUGIN
        out += sm.batched_get([k for k, _, _ in blocks], location=location)
    return out


def plugin_of(sm: StorageManager) -> KVStreamBackend:
    """The manager's kvstream backend."""
    backend = sm.storage_backends[PLUGIN]
    assert isinstance(backend, KVStreamBackend)
    return backend


def release_all(objs: list[Any]) -> None:
    """Drop a reference to every object that is not None."""
    for o in objs:
        if o is not None:
            o.ref_count_down()


def wait_stored(sm: StorageManager, keys: list[Any], timeout: float = 10.0) -> None:
    """Wait until no put of ``keys`` is pending in the plugin (fails after ``timeout`` seconds)."""
    plugin = plugin_of(sm)
    deadline = time.monotonic() + timeout
    while any(plugin.exists_in_put_tasks(k) for k in keys):
        assert time.monotonic() < deadline, "puts not stored in time"
        time.sleep(0.01)


def metric_total(name: str, **labels: str) -> float:
    """The sum of the default registry's samples ``name`` whose labels include ``labels``."""
    total = 0.0
    for m in REGISTRY.collect():
        for s in m.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


# -- async lookup and prefetch --------------------------------------------------------------------------------
class FakeScheduler:
    """Stands in for the scheduler's side of LMCache's async lookup server: keeps the responses."""

    def __init__(self) -> None:
        self.responses: dict[str, int] = {}

    def send_response_to_scheduler(self, lookup_id: str, n: int) -> None:
        self.responses[lookup_id] = n


def prefetch(sm: StorageManager, lookup_id: str, infos: list[Any], timeout: float = 20.0) -> None:
    """Start LMCache's async lookup and prefetch of ``infos`` (waits for it to be scheduled, not done)."""
    keys = [k for _, _, k in infos]
    cum = [0] + [e for _, e, _ in infos]
    asyncio.run_coroutine_threadsafe(sm.async_lookup_and_prefetch(lookup_id, keys, cum, None, pin=False),
                                     sm.loop).result(timeout)


def collect(sm: StorageManager, lookup_id: str, timeout: float = 20.0) -> tuple[int, list[Any]]:
    """The scheduler's response to ``lookup_id`` and the (key, object) pairs it loaded."""
    deadline = time.monotonic() + timeout
    while sm.async_lookup_server.responses.get(lookup_id) is None:
        assert time.monotonic() < deadline, "no response to the scheduler"
        time.sleep(0.005)
    if sm.event_manager.get_event_status(EventType.LOADING, lookup_id) == EventStatus.NOT_FOUND:
        return sm.async_lookup_server.responses[lookup_id], []  # nothing was hit, nothing loaded
    fut = sm.event_manager.get_event_future(EventType.LOADING, lookup_id)
    return sm.async_lookup_server.responses[lookup_id], [pair for tier in fut.result() for pair in tier]
