"""kvstream as an LMCache (0.5.6) storage plugin: ``KVStreamBackend``.

Configure LMCache with::

    storage_plugins: ["kvstream"]
    extra_config:
      storage_plugin.kvstream.module_path: kvstream.integrations.lmcache
      storage_plugin.kvstream.class_name: KVStreamBackend
      kvstream.tiers: "local=/nvme/kvstream,shared=/lustre/kvstream"
      kvstream.capacity_bytes: "local=2TiB,shared=10TiB"
      kvstream.shared_tiers: shared   # one folder for every node (docs/shared-tier.md)

(or ``kvstream.config_file: /etc/kvstream.yaml``; every key is listed in
:mod:`kvstream.integrations._lmcache_config`). LMCache asks its own CPU and disk tiers first and this plugin
last; what it finds here it copies into its CPU tier.

How each LMCache call is served (facts about LMCache in docs/lmcache-notes.md):

- keys: each ``CacheEngineKey`` becomes a 16-byte store key (:mod:`._lmcache_keys`: model, world size,
  worker, chunk hash, dtype, request tags, layer), and each chunk's header keeps its dtype, shape and
  ``MemoryFormat``, so a new process rebuilds the ``MemoryObj`` from the files alone: the cache survives a
  restart (LMCache's LocalDiskBackend keeps that in RAM and loses it).
- ``batched_get_blocking``: one ``Store.read_chunks`` call for the whole batch (the store routes it over all
  tiers at once); each chunk is copied, as it lands, into a ``MemoryObj`` allocated from LMCache's CPU
  backend with the header's shape and dtype. Only the held prefix is read; the result is a prefix too (after
  the first miss everything is ``None``), which is how LMCache uses it.
- async path: LMCache runs every backend's ``batched_get_non_blocking`` under one global asyncio lock, and
  only ``batched_async_contains`` outside it; so the load starts in ``batched_async_contains`` (on a small
  thread pool, one store read per request, several at once) and ``batched_get_non_blocking`` only awaits it.
  Nothing here runs blocking work on LMCache's event-loop thread.
- puts: :mod:`._lmcache_writer` (returns at once, references held until the store has the bytes, deferred
  flush, replication by the store's policy).
- lookups (``batched_contains``, ``batched_async_contains``): the held prefix, or, with
  ``kvstream.recompute_model`` and ``kvstream.recompute_gpu`` set, a shorter one when the GPU recomputes the
  held chunks after it sooner than the tiers load them (:meth:`KVStreamBackend._reported_prefix`). LMCache
  cannot overlap a load with vLLM's prefill (the prefill needs the loaded prefix first), so a shorter hit is the
  only split the plugin can express: :func:`kvstream.compute.loaded_prefix` picks it from each chunk's load time
  (0 in host memory, else its bytes over the summed read-bandwidth estimates of the usable tiers holding it) and
  its recompute cost at its position (:class:`kvstream.serving.gpu.CostModel`). Declined chunks are counted in
  ``lmcache:kvstream_num_declined_chunks``. ``contains`` (one key) always answers whether the chunk is held.
- misses are never errors: an absent, corrupted or truncated chunk file, or no CPU memory for the target,
  is a ``None`` (counted in ``lmcache:kvstream_num_miss_chunks`` by reason).
- start: LMCache catches any ``Exception`` from a plugin's constructor, logs it and serves without the plugin.
  That stays the default (a warning of ours says so first); with ``kvstream.strict: true`` a failure to open
  the store raises :class:`StrictStartError` instead, a ``BaseException`` so that LMCache's ``except Exception``
  lets it through and LMCache does not start (we also stop the event loop of the half-built StorageManager,
  whose thread would otherwise keep the failed process alive).
- logs: ours go through LMCache's ``init_logger`` (its format, its ``LMCACHE_LOG_LEVEL``); the store's own
  loggers (``kvstream.store``, ``kvstream.tier``, ...) get the same format when nothing else takes their
  records (no handler up to the root logger), instead of Python's bare last-resort output.

Invariants: every ``MemoryObj`` handed to LMCache carries exactly one reference, owned by LMCache; every
object this module allocated and does not hand over is released exactly once (prefetches no one collects are
released after ``kvstream.prefetch_ttl_s``, at ``cancel_request`` or at ``close``).
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import logging
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Sequence, cast

import numpy as np
import torch
from lmcache.logging import CustomFormatter, get_log_level, init_logger
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.abstract_backend import StoragePluginInterface

from kvstream.compute import loaded_prefix
from kvstream.errors import ConfigError, KVStreamError, StoreClosedError
from kvstream.format import ChunkMeta
from kvstream.integrations._lmcache_config import (
    PluginOptions,
    RecomputeOptions,
    attribute_error,
    flatten,
    parse_extra_config,
    pending_write_default,
    strict_mode,
)
from kvstream.integrations._lmcache_keys import KeyMapper
from kvstream.integrations._lmcache_metrics import PluginMetrics, TimedPuts
from kvstream.integrations._lmcache_writer import WriteItem, WriteQueue
from kvstream.store import ChunkPlace, Store, open_store

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    from kvstream.serving.gpu import CostModel

__all__ = ["KVStreamBackend", "StrictStartError"]

logger = init_logger("kvstream.lmcache")  # LMCache's log format, so our lines sit with LMCache's


class StrictStartError(BaseException):
    """``kvstream.strict`` is set and the plugin could not start: LMCache must not start either.

    A ``BaseException`` (like ``KeyboardInterrupt``) on purpose: LMCache builds plugins inside ``except
    Exception`` and would log an ``Exception`` and serve without kvstream. The cause is chained (``__cause__``)."""


def _route_library_logs() -> None:
    """Give kvstream's library loggers LMCache's format when their records would otherwise reach Python's
    last-resort handler (bare text): no handler on ``kvstream`` or above it. A logging configuration of the
    application's own (a root handler, or one on ``kvstream``) is left alone. Idempotent."""
    lib = logging.getLogger("kvstream")
    if lib.hasHandlers():
        return
    handler = logging.StreamHandler()
    handler.setLevel(get_log_level())
    handler.setFormatter(CustomFormatter())
    lib.addHandler(handler)


def _stop_loop(loop: Optional[asyncio.AbstractEventLoop]) -> None:
    """Stop the event loop of a StorageManager whose construction we are about to fail (strict mode): its
    thread is not a daemon and nothing else would ever stop it."""
    if loop is not None and loop.is_running():
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # already closed
            pass

_COPY_THREADS = 2  # copies overlap the store's reads; two keep up with ~10 GB/s of landing chunks
_COPY_OFFLOAD_BYTES = 4 << 20  # smaller chunks are copied on the reading thread


def _torch_dtype(name: str) -> torch.dtype | None:
    dt = getattr(torch, name, None)
    return dt if isinstance(dt, torch.dtype) else None


def _memory_format(name: str) -> MemoryFormat | None:
    try:
        return MemoryFormat[name]
    except KeyError:
        return None


def chunk_meta_of(obj: MemoryObj) -> ChunkMeta | None:
    """The header metadata for an LMCache object, or None if it cannot be described by one dtype and shape
    (a hybrid model's multi-group object) or its bytes do not match its shape."""
    shapes = getattr(obj.meta, "shapes", None)
    if shapes is not None and len(shapes) != 1:
        return None
    dtype = obj.get_dtype()
    if dtype is None:
        return None
    try:
        meta = ChunkMeta(dtype=str(dtype).removeprefix("torch."), shape=tuple(int(d) for d in obj.get_shape()),
                         fmt=obj.get_memory_format().name)
    except ValueError:
        return None
    if math.prod(meta.shape) * dtype.itemsize != obj.get_size():
        return None
    return meta


class _RecomputeCost:
    """What recomputing a held chunk costs (``kvstream.recompute_*``), per position, and the chunk size to assume
    where the store's index has none. ``cost_s(n)``: the GPU seconds of chunks ``0..n-1``, chunk ``j`` at
    ``j * chunk_tokens`` tokens of context: ``CostModel.recompute_chunk_s``, the marginal compute time of one
    chunk at that position (``prefill_time`` of the longer prefix minus that of the shorter one, without the
    step's fixed overhead, which the prefill pays anyway)."""

    def __init__(self, opts: RecomputeOptions, chunk_tokens: int, chunk_bytes: int) -> None:
        from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape  # only when the keys are set

        self.model: "CostModel" = CostModel(get_gpu(opts.gpu), get_model_shape(opts.model), opts.tp)
        self.chunk_tokens = max(int(chunk_tokens), 1)
        self.chunk_bytes = chunk_bytes
        self._costs: tuple[float, ...] = ()  # grown on demand; replaced whole, so readers need no lock

    def cost_s(self, n: int) -> tuple[float, ...]:
        costs = self._costs
        if len(costs) < n:
            t = self.chunk_tokens
            costs = costs + tuple(self.model.recompute_chunk_s(j * t, t) for j in range(len(costs), n))
            self._costs = costs
        return costs[:n]


def _lmcache_chunk_bytes(metadata: "LMCacheMetadata") -> int:
    """Bytes of one full LMCache chunk (``kv_shape`` x ``kv_dtype``), 0 if the metadata does not say."""
    try:
        return int(math.prod(int(d) for d in metadata.kv_shape) * metadata.kv_dtype.itemsize)
    except (AttributeError, TypeError, ValueError):
        return 0


@dataclass(eq=False)
class _Prefetch:
    keys: list[CacheEngineKey]
    future: "Future[list[Optional[MemoryObj]]]"
    started: float = field(default_factory=time.monotonic)


@functools.lru_cache(maxsize=256)
def _byte_array_type(n: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    return ctypes.c_ubyte * n  # cached: ctypes builds (and keeps) a new type per length otherwise


def _physical_view(obj: MemoryObj) -> memoryview:
    """A writable view of the object's whole allocation (its 4 KiB-rounded physical size), for O_DIRECT reads."""
    n = obj.get_physical_size()
    return memoryview(_byte_array_type(n).from_address(obj.data_ptr)).cast("B")


def _copy_into(obj: MemoryObj, payload: memoryview) -> None:
    """Copy a verified payload into an LMCache object (numpy releases the GIL for the copy)."""
    np.copyto(np.frombuffer(obj.byte_array, dtype=np.uint8), np.frombuffer(payload, dtype=np.uint8))


def _release_all(objs: Sequence[Optional[MemoryObj]]) -> None:
    for o in objs:
        if o is not None:
            o.ref_count_down()


def _release_when_done(fut: "Future[list[Optional[MemoryObj]]]") -> None:
    def _done(f: "Future[list[Optional[MemoryObj]]]") -> None:
        if not f.cancelled() and f.exception() is None:
            _release_all(f.result())

    fut.add_done_callback(_done)


def _no_cpu_backend(config: "LMCacheEngineConfig", metadata: "LMCacheMetadata") -> ConfigError:
    """Why LMCache built this plugin without its CPU backend, and what to change.

    LMCache builds storage backends in its *scheduler* process too when ``enable_scheduler_bypass_lookup`` is
    set (``vllm_service_factory``: the scheduler then answers lookups from its own engine instead of asking the
    workers), and there it creates no ``LocalCPUBackend`` (``storage_backend.CreateStorageBackends``: "for
    scheduler role, local_cpu_backend is None"). kvstream cannot serve from there: it reads into LMCache's CPU
    backend, and a second store opened in the scheduler would answer from its own index, not from what the
    worker processes write and evict. So the scheduler role gets its own message (the worker's "set
    max_local_cpu_size > 0" would send the operator the wrong way: that setting is not what is missing)."""
    role = getattr(metadata, "role", None)
    if role == "scheduler":
        bypass = getattr(config, "enable_scheduler_bypass_lookup", None)
        return ConfigError("enable_scheduler_bypass_lookup", (
            f"LMCache is building its storage backends in the vLLM scheduler process (LMCache role "
            f"'scheduler'; enable_scheduler_bypass_lookup is {bypass}), where it creates no CPU backend. kvstream "
            "serves from the worker processes only (it reads into their CPU backend, and its index there is the one "
            "their writes update): set enable_scheduler_bypass_lookup: false (LMCache's default), so the scheduler "
            "asks the workers, which run kvstream"))
    return ConfigError("max_local_cpu_size", (
        f"the kvstream plugin needs LMCache's CPU backend as its allocator, and this {role or 'worker'} process "
        f"has none (max_local_cpu_size is {getattr(config, 'max_local_cpu_size', None)}): set "
        "max_local_cpu_size > 0"))


class KVStreamBackend(StoragePluginInterface):  # type: ignore[misc]  # LMCache has no type hints: its base is Any
    """An LMCache storage plugin over a kvstream :class:`~kvstream.store.Store` (see the module docstring)."""

    def __init__(
        self,
        dst_device: str = "cpu",
        config: Optional["LMCacheEngineConfig"] = None,
        metadata: Optional["LMCacheMetadata"] = None,
        local_cpu_backend: Optional["LocalCPUBackend"] = None,
        loop: Optional[asyncio.AbstractEventLoop] = None,
    ) -> None:
        super().__init__(dst_device=dst_device, config=config, metadata=metadata,
                         local_cpu_backend=local_cpu_backend, loop=loop)
        _route_library_logs()
        extra = (config.extra_config if config is not None else None) or {}
        try:
            strict = strict_mode(extra)
        except ConfigError as exc:  # written but unreadable: not a reason to serve without kvstream
            _stop_loop(loop)
            logger.error("kvstream: %s; not starting", exc)
            raise StrictStartError(f"kvstream: {exc}") from exc
        try:
            self._start(config, metadata, local_cpu_backend)
        except Exception as exc:
            if strict:
                _stop_loop(loop)
                logger.error("kvstream: could not start: %s; kvstream.strict is set, so LMCache does not start "
                             "either", exc)
                raise StrictStartError(f"kvstream could not start (kvstream.strict is set): {exc}") from exc
            logger.warning("kvstream: could not start: %s; LMCache serves WITHOUT kvstream (set kvstream.strict: "
                           "true to stop LMCache's start instead)", exc)
            raise

    def _start(self, config: Optional["LMCacheEngineConfig"], metadata: Optional["LMCacheMetadata"],
               local_cpu_backend: Optional["LocalCPUBackend"]) -> None:
        if config is None or metadata is None:
            raise ConfigError("storage_plugins", "KVStreamBackend is built by LMCache's StorageManager "
                                                 "(it needs LMCache's config and metadata)")
        if local_cpu_backend is None:
            raise _no_cpu_backend(config, metadata)
        extra = config.extra_config or {}
        self.options: PluginOptions = parse_extra_config(
            extra, default_pending_bytes=pending_write_default(config.max_local_cpu_size))
        try:
            self.store: Store = open_store(self.options.store)
        except ConfigError as exc:
            raise attribute_error(exc, flatten(extra)) from None
        self._recompute: _RecomputeCost | None = None
        self._closed = False  # no new work accepted (set by _quiesce)
        self._store_closed = False
        self._writer_ok = True
        self._close_lock = threading.Lock()
        try:
            rc = self.options.recompute
            if rc is not None:
                self._recompute = _RecomputeCost(rc, int(getattr(config, "chunk_size", 0) or metadata.kv_shape[2]),
                                                 _lmcache_chunk_bytes(metadata))
            self._keys = KeyMapper(self.options.namespace, tenant_salt=self.options.tenant_salt)
            self.metrics = PluginMetrics(model_name=metadata.model_name, worker_id=metadata.worker_id,
                                         role=metadata.role, served_model_name=metadata.served_model_name)
            self._lock = threading.Lock()  # guards _prefetch; never held across I/O
            self._prefetch: dict[str, _Prefetch] = {}
            self._loader = ThreadPoolExecutor(max_workers=self.options.load_threads,
                                              thread_name_prefix="kvstream-lmcache-load")
            self._copier = ThreadPoolExecutor(max_workers=_COPY_THREADS, thread_name_prefix="kvstream-lmcache-copy")
            self._writer = WriteQueue(TimedPuts(self.store, self.metrics),  # each put timed into the metrics
                                      payload_of=lambda o: o.byte_array.cast("B"), metrics=self.metrics,
                                      flush_after_s=self.options.flush_after_s,
                                      max_pending_bytes=self.options.max_pending_write_bytes, on_tick=self._tick)
            self.store.observe_writes(self.metrics.chunk_written)  # per-tier write latency histogram
        except BaseException:
            self.store.close()
            raise
        self._quiesced = False
        # Zero-copy reads when the store offers them (see docs/lmcache-notes.md, "What the plugin needs").
        self._zero_copy = self.options.read_into and callable(getattr(self.store, "get_meta", None)) and callable(
            getattr(self.store, "read_into", None))
        self._hook_cpu_backend_close()
        try:
            self._log_ready()
            self.metrics.sync_store(self.store.stats())  # capacity and usage on /metrics from the start
        except BaseException:
            self.close()  # unhooks LMCache's CPU backend, stops the queues, closes the store
            raise

    def _hook_cpu_backend_close(self) -> None:
        """Quiesce before LMCache frees its CPU arena.

        ``StorageManager.close()`` closes the LocalCPUBackend (which frees the pinned arena every ``MemoryObj``
        lives in) *before* it closes plugins, so queued puts and loaded prefetches would point into freed
        memory by the time our ``close()`` runs. We wrap that one instance's ``close`` to store our queued puts
        and release our objects first. Removed again if we close first.
        """
        cpu = self.local_cpu_backend
        original = cpu.close

        def close_after_kvstream() -> None:
            self._quiesce()
            original()

        self._cpu_close_hook = close_after_kvstream
        self._cpu_close_original = original
        cpu.close = close_after_kvstream

    def __str__(self) -> str:
        return "KVStreamBackend"

    def _log_ready(self) -> None:
        st = self.store.stats()
        tiers = ", ".join(
            f"{name}={t.path} ({t.chunks} chunks, {t.used_bytes / 1e9:.2f}/{t.capacity_bytes / 1e9:.0f} GB,"
            f" O_DIRECT {'on' if t.direct_io else 'off'})"
            for name, t in st.tiers.items())
        logger.info("kvstream: plugin ready (%s%s): tiers %s; router %s, replication %s, io engine %s",
                    self.options.store_source, ", strict" if self.options.strict else "", tiers, st.router,
                    st.replication, st.io_engine)
        if self._recompute is not None:
            logger.info("kvstream: lookups may leave held chunks to the GPU when it recomputes them sooner than the "
                        "tiers load them (%s, %d-token chunks)", self._recompute.model.describe(),
                        self._recompute.chunk_tokens)

    # -- lookups --------------------------------------------------------------------------------------------
    def _held_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        try:
            return self.store.lookup(self._keys.many(list(keys)))
        except StoreClosedError:
            return 0

    def _pin_keys(self, keys: Sequence[CacheEngineKey]) -> None:
        """One pin on each key (LMCache's lookups with ``pin=True``): the store keeps them out of every tier's
        eviction until LMCache unpins them (:mod:`kvstream.tiers.pins`)."""
        try:
            for k in keys:
                self.store.pin(self._keys(k))
        except StoreClosedError:
            pass

    def _reported_prefix(self, keys: Sequence[CacheEngineKey]) -> int:
        """The hit a lookup reports: the held prefix, or (``kvstream.recompute_*`` set) the first ``k`` of its
        chunks, when loading those and letting vLLM's prefill recompute the rest takes less time than loading
        all of them (:func:`kvstream.compute.loaded_prefix`). Never shortened while a tier holding one of the
        chunks has no bandwidth estimate yet, nor for per-layer keys (LMCache's layerwise lookups ask about one
        chunk's layers: there is no prefix to split).

        Positions count from the first key asked about: when LMCache's own CPU or disk tier holds a front of the
        prompt, it asks this plugin about the rest only, so the costs are those of a prefix that many chunks
        shorter (a lower bound: attention only gets dearer further in)."""
        rc = self._recompute
        if rc is None or not keys or isinstance(keys[0], LayerCacheEngineKey):
            return self._held_prefix(keys)
        try:
            places = self.store.locate_prefix(self._keys.many(list(keys)))
        except StoreClosedError:
            return 0
        n = len(places)
        load_s = self._load_times(places, rc.chunk_bytes)
        if load_s is None:
            return n
        cost_s = rc.cost_s(n)
        k = loaded_prefix(load_s, cost_s)
        if k < n:
            self.metrics.declined(n - k)
            logger.debug("kvstream: lookup reports %d of %d held chunks; the GPU recomputes the other %d sooner "
                         "(%.4f s) than the tiers load them (%.4f s)", k, n, n - k, math.fsum(cost_s[k:]),
                         math.fsum(load_s[k:]))
        return k

    def _load_times(self, places: Sequence[ChunkPlace], default_bytes: int) -> list[float] | None:
        """Seconds to load each held chunk: 0 in host memory, else its bytes over the summed bandwidth estimates
        of the usable tiers that hold it (``inf`` when they were measured delivering nothing). None when an
        estimate needed is unknown: nothing to decide on yet."""
        out: list[float] = []
        bw: dict[int, float | None] = {}
        for p in places:
            if p.memory:
                out.append(0.0)
                continue
            for t in p.tiers:
                if t not in bw:
                    bw[t] = self.store.read_bandwidth(t)
            got = [bw[t] for t in p.tiers]
            if not got or any(b is None for b in got):
                return None
            total = math.fsum(b for b in got if b is not None)
            nbytes = p.file_bytes or default_bytes
            out.append(nbytes / total if total > 0 else math.inf)
        return out

    def contains(self, key: CacheEngineKey, pin: bool = False) -> bool:
        found = self._held_prefix([key]) == 1
        if found and pin:
            self._pin_keys([key])
        return found

    def batched_contains(self, keys: List[CacheEngineKey], pin: bool = False) -> int:
        n = self._reported_prefix(keys)
        if pin and n:
            self._pin_keys(keys[:n])
        return n

    def exists_in_put_tasks(self, key: CacheEngineKey) -> bool:
        return self._writer.pending(self._keys(key))

    # -- writes ---------------------------------------------------------------------------------------------
    def batched_submit_put_task(
        self,
        keys: Sequence[CacheEngineKey],
        objs: List[MemoryObj],
        transfer_spec: Any = None,
        on_complete_callback: Optional[Callable[[CacheEngineKey], None]] = None,
    ) -> None:
        """Queue the objects for the store and return at once (one reference held per queued object)."""
        if self._closed:
            self.metrics.dropped("closing", len(keys))
            return None
        items = []
        unsupported = 0
        for key, obj in zip(keys, objs, strict=False):
            sk = self._keys(key)
            try:
                if self.store.contains(sk):
                    continue
            except StoreClosedError:
                return None
            meta = chunk_meta_of(obj)
            if meta is None:
                unsupported += 1
                continue
            items.append(WriteItem(key=sk, obj=obj, meta=meta, nbytes=obj.get_size(),
                                   on_stored=on_complete_callback, lmcache_key=key))
        if unsupported:
            self.metrics.dropped("unsupported_object", unsupported)
        if items:
            self._writer.submit(items)
        return None

    # -- reads ----------------------------------------------------------------------------------------------
    def _target_for(self, chunk: Any) -> tuple[Optional[MemoryObj], str]:
        """A new CPU object shaped as ``chunk``'s header says, or (None, reason)."""
        meta: ChunkMeta = chunk.meta
        dtype = _torch_dtype(meta.dtype)
        fmt = _memory_format(meta.fmt)
        if dtype is None or fmt is None or not meta.shape:
            return None, "foreign_chunk"
        if math.prod(meta.shape) * dtype.itemsize != len(chunk.payload):
            return None, "foreign_chunk"
        obj = self.local_cpu_backend.allocate(torch.Size(meta.shape), dtype, fmt, eviction=True, busy_loop=False)
        if obj is None:
            return None, "no_cpu_memory"
        return obj, ""

    def _read_batch(self, keys: Sequence[CacheEngineKey], path: str) -> list[Optional[MemoryObj]]:
        """One multi-tier read of the held prefix of ``keys``; a prefix of objects, then ``None``s.

        Chunks are copied into their LMCache objects on the copy pool while the store keeps reading (the
        store's verified payload view stays valid while we hold it: its buffer is not reused before).
        """
        t0 = time.perf_counter()
        n = len(keys)
        out: list[Optional[MemoryObj]] = [None] * n
        if n == 0:
            return out
        skeys = self._keys.many(list(keys))
        if self._zero_copy:
            return self._finish_batch(self._read_into_batch(skeys, t0), path, t0)
        copies: list[tuple[int, MemoryObj, Future[None], str, int, float]] = []
        try:
            held = self.store.lookup(skeys)
            self.metrics.missed("absent", n - held)
            if held:
                for i, chunk in self.store.read_chunks(skeys[:held]):
                    if chunk is None:  # corrupt, truncated, vanished or unreadable on every replica
                        self.metrics.missed("unreadable")
                        continue
                    landed = time.perf_counter() - t0
                    obj, reason = self._target_for(chunk)
                    if obj is None:
                        self.metrics.missed(reason)
                        continue
                    if len(chunk.payload) >= _COPY_OFFLOAD_BYTES:
                        fut = self._copier.submit(_copy_into, obj, chunk.payload)
                    else:  # a small copy costs less than a hand-off to another thread
                        fut = Future()
                        _copy_into(obj, chunk.payload)
                        fut.set_result(None)
                    copies.append((i, obj, fut, chunk.source, len(chunk.payload), landed))
                    del chunk
            for i, obj, fut, source, nbytes, landed in copies:
                fut.result()
                out[i] = obj
                self.metrics.chunk_landed(source, nbytes, landed)
        except BaseException as exc:
            for _, obj, fut, *_ in copies:  # every object we allocated is in ``copies``: release each once
                try:
                    fut.result()
                except BaseException:
                    pass
                obj.ref_count_down()
            if isinstance(exc, StoreClosedError):
                return [None] * n
            raise
        return self._finish_batch(out, path, t0)

    def _finish_batch(self, out: list[Optional[MemoryObj]], path: str, t0: float) -> list[Optional[MemoryObj]]:
        # LMCache uses a prefix: release what follows the first gap now rather than through LMCache.
        n = len(out)
        gap = next((i for i, o in enumerate(out) if o is None), n)
        after = [o for o in out[gap:] if o is not None]
        if after:
            self.metrics.missed("after_gap", len(after))
            _release_all(after)
            out[gap:] = [None] * (n - gap)
        self.metrics.batch_done(path, time.perf_counter() - t0)
        self._writer.read_done()
        return out

    def _read_into_batch(self, skeys: list[bytes], t0: float) -> list[Optional[MemoryObj]]:
        """Zero-copy read (stores with ``get_meta`` and ``read_into``): targets are allocated in prefix order
        from the header metadata in the store's index, then the store reads each payload straight into its
        object (O_DIRECT into LMCache's CPU pool) and verifies it there."""
        n = len(skeys)
        out: list[Optional[MemoryObj]] = [None] * n
        targets: list[MemoryObj] = []
        busy: set[int] = set()
        try:
            held = self.store.lookup(skeys)
            self.metrics.missed("absent", n - held)
            metas = self.store.get_meta(skeys[:held])
            for i, m in enumerate(metas):
                if m is None:  # held, but its header could not be read intact (the file is gone or damaged)
                    self.metrics.missed("unreadable", held - i)
                    break
                meta, payload_len = m
                dtype, fmt = _torch_dtype(meta.dtype), _memory_format(meta.fmt)
                if dtype is None or fmt is None or not meta.shape or math.prod(meta.shape) * dtype.itemsize != payload_len:
                    self.metrics.missed("foreign_chunk", held - i)
                    break
                obj = self.local_cpu_backend.allocate(torch.Size(meta.shape), dtype, fmt, eviction=True,
                                                      busy_loop=False)
                if obj is None:
                    self.metrics.missed("no_cpu_memory", held - i)
                    break
                targets.append(obj)
            if targets:
                # yields (index, result) as each chunk lands; result.ok, result.source (tier or "memory")
                for i, res in self.store.read_into(skeys[: len(targets)], [_physical_view(o) for o in targets],
                                                   on_target_free=lambda i: targets[i].ref_count_down()):
                    if res.ok:
                        out[i] = targets[i]
                        self.metrics.chunk_landed(str(res.source), targets[i].get_size(),
                                                  time.perf_counter() - t0)
                    else:
                        if res.busy:  # a stalled read still writes into it: the store releases it when done
                            busy.add(i)
                        self.metrics.missed(res.reason or "unreadable")
        except BaseException as exc:
            _release_all([o for i, o in enumerate(targets) if i not in busy])
            if isinstance(exc, StoreClosedError):
                return [None] * n
            raise
        _release_all([o for i, o in enumerate(targets) if out[i] is None and i not in busy])
        return out

    def get_blocking(self, key: CacheEngineKey) -> Optional[MemoryObj]:
        return self._read_batch([key], "sync")[0]

    def batched_get_blocking(self, keys: List[CacheEngineKey]) -> List[Optional[MemoryObj]]:
        if self._closed:
            return [None] * len(keys)
        return self._read_batch(keys, "sync")

    def get_non_blocking(
        self, key: CacheEngineKey, location: Optional[str] = None
    ) -> Optional[Future[Optional[MemoryObj]]]:
        if self._closed or not self.contains(key):
            return None
        try:
            return self._loader.submit(lambda: self._read_batch([key], "prefetch")[0])
        except RuntimeError:  # closing
            return None

    # -- async lookup and prefetch --------------------------------------------------------------------------
    def _start_prefetch(self, lookup_id: str, keys: list[CacheEngineKey]) -> _Prefetch:
        try:
            fut = self._loader.submit(self._read_batch, keys, "prefetch")
        except RuntimeError:  # closing: the pool takes no new work; report a miss
            fut = Future()
            fut.set_result([None] * len(keys))
        self.metrics.prefetch_delta(1)
        return _Prefetch(keys=keys, future=fut)

    def _discard(self, pf: _Prefetch) -> None:
        self.metrics.prefetch_delta(-1)
        _release_when_done(pf.future)

    async def batched_async_contains(self, lookup_id: str, keys: List[CacheEngineKey], pin: bool = False) -> int:
        """Count the prefix to report (as ``batched_contains``) and start loading it now (LMCache serialises the
        later get, not this)."""
        n = self._reported_prefix(keys)
        if pin and n:
            self._pin_keys(keys[:n])
        if n and not self._closed:
            pf = self._start_prefetch(lookup_id, list(keys[:n]))
            with self._lock:
                old = self._prefetch.pop(lookup_id, None)
                self._prefetch[lookup_id] = pf
            if old is not None:
                self._discard(old)
        return n

    async def batched_get_non_blocking(self, lookup_id: str, keys: list[CacheEngineKey],
                                       transfer_spec: Any = None) -> list[MemoryObj]:
        """The objects of the prefetch started for ``lookup_id`` (a prefix of ``keys``)."""
        keys = list(keys)
        with self._lock:
            pf = self._prefetch.pop(lookup_id, None)
        if pf is not None and pf.keys[: len(keys)] != keys:
            self._discard(pf)
            pf = None
        if pf is None:
            if self._closed:
                return []
            pf = self._start_prefetch(lookup_id, keys)
        try:
            objs = await asyncio.wrap_future(pf.future)
        except asyncio.CancelledError:
            self._discard(pf)
            raise
        self.metrics.prefetch_delta(-1)
        _release_all(objs[len(keys):])
        objs = objs[: len(keys)]
        gap = next((i for i, o in enumerate(objs) if o is None), len(objs))
        _release_all(objs[gap:])  # _read_batch already cut at the first gap; this only guards the invariant
        return cast("list[MemoryObj]", objs[:gap])  # no None before the first gap

    def cancel_request(self, req_id: str) -> None:
        with self._lock:
            pf = self._prefetch.pop(req_id, None)
        if pf is not None:
            self._discard(pf)

    def _tick(self) -> None:
        """Once a second on the writer thread: drop uncollected prefetches, publish the store's counters."""
        now = time.monotonic()
        ttl = self.options.prefetch_ttl_s
        with self._lock:
            stale = [lid for lid, pf in self._prefetch.items() if now - pf.started > ttl]
            stale_pf = [self._prefetch.pop(lid) for lid in stale]
        for pf in stale_pf:
            logger.warning("kvstream: prefetch of %d chunks was never collected; released", len(pf.keys))
            self._discard(pf)
        try:
            self.metrics.sync_store(self.store.stats())
        except StoreClosedError:
            pass

    # -- pins and removal -----------------------------------------------------------------------------------
    def pin(self, key: CacheEngineKey) -> bool:
        """LMCache's ``pin``: one more pin on a held chunk (False if kvstream does not hold it). Counted per key,
        as LMCache's own backends count them: pinned twice, it stays pinned until unpinned twice."""
        try:
            return self.store.pin(self._keys(key))
        except StoreClosedError:
            return False

    def unpin(self, key: CacheEngineKey) -> bool:
        try:
            return self.store.unpin(self._keys(key))
        except StoreClosedError:
            return False

    def remove(self, key: CacheEngineKey, force: bool = True) -> bool:
        """A forced remove (LMCache's default) removes a pinned chunk too, and its pins; ``force=False`` (an
        eviction by LMCache) leaves a pinned chunk alone."""
        sk = self._keys(key)
        try:
            if not force and self.store.pins.pinned(sk):
                return False
            return self.store.remove(sk)
        except StoreClosedError:
            return False

    def get_allocator_backend(self) -> "LocalCPUBackend":
        return self.local_cpu_backend

    def touch_cache(self) -> None:
        return None

    # -- shutdown -------------------------------------------------------------------------------------------
    def _quiesce(self) -> None:
        """Stop taking work, store every queued put, release every object we hold. Idempotent."""
        with self._close_lock:
            self._closed = True
            if self._quiesced:
                return
            self._quiesced = True
        self._writer_ok = self._writer.close(self.options.close_timeout_s)
        self._loader.shutdown(wait=True, cancel_futures=True)  # loads finish; their objects are released below
        self._copier.shutdown(wait=True)
        with self._lock:
            pending = list(self._prefetch.values())
            self._prefetch.clear()
        for pf in pending:
            self._discard(pf)

    def close(self) -> None:
        """Store every queued put, flush, wait for the writes, release prefetches and close the store."""
        with self._close_lock:
            if self._store_closed:
                return
            self._store_closed = True
        self._quiesce()
        cpu = self.local_cpu_backend
        if cpu.__dict__.get("close") is self._cpu_close_hook:
            del cpu.close  # back to the class's method
        ok = self._writer_ok
        try:
            self.store.close()
            st = self.store.stats()
            self.metrics.sync_store(st)
            logger.info("kvstream: closed%s; %d puts stored, write amplification %.2f, %d chunks read from disk, "
                        "%d misses", "" if ok else " (some queued puts were not stored)", st.puts,
                        st.write_amplification, st.disk_hits, st.misses)
        except KVStreamError as exc:
            logger.error("kvstream: close failed: %s", exc)
