"""``kvstream replay``'s storage side: the real store behind the serving core's actions, and an emulated tier.

:class:`StoreBackend` maps the core's chunk ids to store keys (namespaced by model), answers ``lookup`` from
the store's index and host-memory tier, runs each :class:`StartLoad` as one ``read_chunks`` call on a worker
thread (the store routes it over the tiers), ``put``\\ s each :class:`WriteChunks` chunk (a synthetic payload
of the model's chunk size; its bytes do not matter, its size and the I/O do) and ``flush``\\ es at
:class:`Flush`, both on one put thread, in order, off the serving loop. Reads carry each request's session,
turn and previous answer length and each chunk's position (the load's ``metas``) to the host-memory tier's
eviction policy (Bidaw's hit potential uses them), and a queue-aware policy gets the serving loop's look-ahead
window (:meth:`StoreBackend.set_window`).

Compute joins the meeting (``compute``: a :class:`kvstream.compute.ComputePolicy`): a load whose
:class:`StartLoad` carries ``compute_s`` runs as the store's own read step with a compute source (the store's
plan of the read, its :class:`~kvstream.reader.Reader` and its end-of-step accounting, given the policy's
:class:`~kvstream.read_step.ComputePlan` through ``Store.read_chunks(compute=...)``). Every request of the
load gets its own front/back split (:func:`kvstream.compute.split_load`): the keys go to the store in the
order that rule gives the step (the merged chain of the requests' fronts first), since the store's step keeps
the order it is given. The modelled GPU's recompute of a chunk is a timer of its modelled seconds on the
reader; computed chunks are reported in ``LoadDone.computed`` (per request, its leading run) and hold no
payload. The chain, the split and the per-item counts are :mod:`kvstream.compute`'s rules, the ones the
simulator's store applies.

No copies: a load keeps the store's payload views (each pins its buffer) until the core releases the chunks.
Each load is recorded (:class:`LoadRecord`) for replay's per-load GB/s (:func:`disk_load_gbps`).

:class:`~kvstream.io.throttle.ThrottledEngine` (re-exported here) makes replay's *emulated* shared tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvstream.eviction import AccessMeta
from kvstream.io.throttle import ThrottledEngine
from kvstream.keys import ChunkKeyer, KeyNamespace
from kvstream.read_step import ReadStep
from kvstream.serving.core import LoadDone, StartLoad, WriteChunks, staged_span
from kvstream.serving.staging import StagedPins
from kvstream.serving.backend import ServingBackend
from kvstream.store import RECOMPUTED, Chunk, ComputeRequest, Store

if TYPE_CHECKING:
    from kvstream.compute import ComputePolicy

__all__ = ["StoreBackend", "ThrottledEngine", "LoadRecord", "disk_load_gbps", "ComputeSource", "ReadChunks"]

# The GPU's part of a read step, as ``Store.read_chunks(compute=...)`` takes it.
ComputeSource = Callable[[list[bytes], list[list[int]]], "ComputeRequest | None"]


class ReadChunks(Protocol):
    """The read path a backend's loads go through: :meth:`kvstream.store.Store.read_chunks`'s signature."""

    def __call__(self, keys: Sequence[bytes], *, metas: Sequence[AccessMeta | None] | None = None,
                 compute: ComputeSource | None = None, background: bool = False
                 ) -> Iterator[tuple[int, Chunk | None]]: ...

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadRecord:
    """One load as the backend ran it: wall-clock start and end (``time.perf_counter``; the end is when its last
    chunk landed), payload bytes that came from the disk tiers and from host memory."""

    start: float
    end: float
    disk_bytes: int
    memory_bytes: int
    background: bool


def disk_load_gbps(loads: Sequence[LoadRecord]) -> tuple[float, float, int]:
    """``(GB/s, seconds, bytes)`` of the loads that read from disk: their disk bytes over the time at least one of
    them was in flight (overlapping loads share the devices, so their time is counted once). One load alone:
    its bytes over its duration."""
    spans = sorted((lo.start, lo.end) for lo in loads if lo.disk_bytes > 0)
    total = sum(lo.disk_bytes for lo in loads if lo.disk_bytes > 0)
    busy = 0.0
    cur_s = cur_e = 0.0
    started = False
    for s_, e_ in spans:
        if not started or s_ > cur_e:
            if started:
                busy += cur_e - cur_s
            cur_s, cur_e, started = s_, e_, True
        else:
            cur_e = max(cur_e, e_)
    if started:
        busy += cur_e - cur_s
    return (total / busy / 1e9 if busy > 0 else 0.0), busy, total


def _meta4(meta: Sequence[Any]) -> tuple[Hashable | None, int | None, int | None, int | None]:
    """A load's item metadata (session, previous answer tokens, turn, first chunk's position), padded."""
    m = tuple(meta) + (None,) * (4 - len(meta))
    return m[0], m[1], m[2], m[3]


class StoreBackend(ServingBackend):
    """The real store behind a real-time run (see the module docstring)."""

    def __init__(self, store: Store, *, model: str, chunk_bytes: int, workers: int = 2,
                 compute: ComputePolicy | None = None, read_disk: bool = True, read: ReadChunks | None = None) -> None:
        import numpy as np

        self.store = store
        # The loads' read path: the store's, or a wrapper of it (replay's crosscheck records each load's tier time).
        self.read_chunks: ReadChunks = read if read is not None else store.read_chunks
        self.compute = compute  # a kvstream.compute.ComputePolicy, or None: loads only
        self.computed_chunks = 0
        self.read_disk = read_disk  # False: the recompute-only baseline (lookups see host memory only)
        self.chunk_bytes = chunk_bytes
        self.keyer = ChunkKeyer(KeyNamespace(model=model, kv_dtype="bfloat16", extra="kvstream-replay"))
        self._keys: dict[Hashable, bytes] = {}
        # One payload for every chunk: the I/O is real, the contents are not the point.
        self.payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvs-replay-load")
        self.load_s: list[float] = []
        # One record per load (blocking or background): what replay's per-load GB/s is computed from.
        self.loads: list[LoadRecord] = []
        self.write_s = 0.0  # seconds spent in ``put`` (copy, checksum, waits for free memory), on the put thread
        self._writes = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-replay-put")
        self._lock = threading.Lock()
        # The staged chunks' pins (one per load item and chunk: the ledger the simulator's store keeps too) and, per
        # staged key, the store's payload view. Holding the view is the staging: it pins the store's buffer (host
        # memory, or the read's own buffer), which is never reused while a view of it lives, so a prefetched
        # request keeps its KV even if the store evicts the entry meanwhile, and nothing is copied (a real engine
        # hands the same host buffer to the host->GPU transfer). Both under _lock. See _load and release.
        self._pins: StagedPins[bytes] = StagedPins()
        self._views: dict[bytes, memoryview] = {}

    def key(self, c: Hashable) -> bytes:
        k = self._keys.get(c)
        if k is None:
            k = self._keys[c] = self.keyer.foreign(repr(c))
        return k

    def lookup(self, chunk_ids: Sequence[Hashable]) -> tuple[int, int]:
        keys = [self.key(c) for c in chunk_ids]
        mem = self.store.memory
        if not self.read_disk:
            n = next((i for i, k in enumerate(keys) if k not in mem), len(keys))
            return n, n
        n = self.store.lookup(keys)
        return n, sum(1 for k in keys[:n] if k in mem)

    def start_load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        self._pool.submit(self._load, action, post)

    def _load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        from kvstream.compute import compute_order_hint, leading_computed

        t0 = time.perf_counter()
        item_keys = [[self.key(c) for c in chunks] for _, chunks in action.items]
        by_key: dict[bytes, AccessMeta | None] = {}
        for j, ks in enumerate(item_keys):
            session, prev, turn, first = _meta4(action.metas[j] if j < len(action.metas) else ())
            for p, k in enumerate(ks):
                if k not in by_key:
                    # Per chunk: Bidaw's hit-potential eviction groups a session's chunks into visits (turn) and
                    # shrinks a prefix from its tail (position).
                    by_key[k] = (AccessMeta(session=session, prev_answer_tokens=prev, round_index=turn,
                                            position=None if first is None else first + p)
                                 if session is not None else None)
        with_compute = self.compute is not None and bool(action.compute_s)
        if with_compute:
            # The order split_load gives the read step (the merged chain of every item's front first): the
            # store's read step keeps the order of the keys it is given.
            mem = self.store.memory
            keys = compute_order_hint(item_keys, action.compute_s, {k for k in by_key if k in mem})
        else:
            keys = list(by_key)
        index = {k: i for i, k in enumerate(keys)}
        metas = [by_key[k] for k in keys]
        got = [False] * len(keys)
        data: dict[bytes, memoryview] = {}
        disk_bytes = mem_bytes = 0
        done: set[bytes] = set()  # keys the GPU recomputed
        try:
            compute = self._compute_request(action, item_keys) if with_compute else None
            for i, chunk in self.read_chunks(keys, metas=metas, compute=compute):
                if chunk is RECOMPUTED:
                    got[i] = True
                    done.add(keys[i])
                    continue
                if chunk is not None:
                    got[i] = True
                    if chunk.source == "memory":
                        mem_bytes += len(chunk.payload)
                    else:
                        disk_bytes += len(chunk.payload)
                    # Held (not copied) until the core releases it: see ``_views``.
                    data[keys[i]] = chunk.payload
        except Exception:  # a failing store must not hang the run: report what landed, and say why
            log.exception("replay: a load failed part-way; the chunks that landed are used, the rest recomputed")
        self.loads.append(LoadRecord(start=t0, end=time.perf_counter(), disk_bytes=disk_bytes,
                                     memory_bytes=mem_bytes, background=action.background))
        avail = []
        for ks in item_keys:
            n = 0
            while n < len(ks) and got[index[ks[n]]]:
                n += 1
            avail.append(n)
        # Per item, the leading run the GPU recomputed: on the GPU, nothing staged (kvstream.compute).
        counts = leading_computed(item_keys, done, avail)
        with self._lock:
            for ks, n, c in zip(item_keys, avail, counts):
                for k in staged_span(ks, n, c):
                    if k in done and k not in data:
                        # Recomputed behind a chunk a tier delivered: staged as if loaded (the core charges its
                        # host->GPU move; pessimistic, as the simulator's store is).
                        data[k] = memoryview(self.payload)
                    if self._pins.hold(k):  # its first pin: keep this load's view (a later pin keeps the first)
                        self._views[k] = data.pop(k)
        for unused in data.values():  # landed after a missing chunk, or already staged by another load
            unused.release()
        self.load_s.append(time.perf_counter() - t0)
        self.computed_chunks += len(done)
        post(LoadDone(load_id=action.load_id, available=tuple((rid, n) for (rid, _), n in zip(action.items, avail)),
                      computed=tuple((rid, c) for (rid, _), c in zip(action.items, counts) if c)))

    def _compute_request(self, action: StartLoad, item_keys: list[list[bytes]]
                         ) -> Callable[[list[bytes], list[list[int]]], ComputeRequest]:
        """The GPU's part of a load for ``Store.read_chunks(compute=...)``: every request's own front/back
        split (:func:`kvstream.compute.split_load`, the simulator's store's rule), over the chunks the store
        must read, in the order they were given (the keys came in :func:`~kvstream.compute.compute_order_hint`'s
        order, so the merged chain leads them unless host memory changed meanwhile)."""
        from kvstream.compute import split_load

        pol = self.compute
        assert pol is not None

        def request(disk_keys: list[bytes], holders: list[list[int]]) -> ComputeRequest:
            split = split_load(pol, item_keys, disk_keys, holders, action.compute_s, self.chunk_bytes,
                               reorder=False)
            on_disk = set(disk_keys)
            leave = frozenset(k for it, first in split.leave.items() for k in item_keys[it][first:] if k in on_disk)

            def observe(step: ReadStep) -> None:
                for t in range(len(step.tier_bytes)):
                    pol.observe(t, step.tier_bytes[t], step.busy_s[t])

            return ComputeRequest(leave=leave, plan=split.plan, on_step=observe)

        return request

    def write(self, action: WriteChunks) -> None:
        """Hand the chunks to the put thread and return: ``put`` copies and checksums each payload and may wait
        for host memory held by unwritten chunks, which must not stall the serving loop (an engine stores KV
        asynchronously, as LMCache does). Puts and flushes run in the order the core issued them."""
        keys = [(self.key(c), action.first_position + j) for j, c in enumerate(action.chunk_ids)]
        self._writes.submit(self._put, keys, action.session, action.prev_answer_tokens)

    def _put(self, keys: list[tuple[bytes, int]], session: Hashable | None, prev: int | None) -> None:
        t0 = time.perf_counter()
        try:
            for k, pos in keys:
                access = AccessMeta(session=session, prev_answer_tokens=prev, position=pos) \
                    if session is not None else None
                self.store.put(k, self.payload, position=pos, access=access)
        except Exception:  # a failing put loses a cache entry, never the run
            log.exception("replay: a put failed; the chunk will be recomputed when needed")
        self.write_s += time.perf_counter() - t0

    def flush(self) -> None:
        self._writes.submit(self.store.flush)

    def sync(self) -> None:
        """Wait until every write and flush handed over so far has run."""
        self._writes.submit(lambda: None).result()

    @property
    def wants_window(self) -> bool:
        return bool(self.store.memory.queue_aware)

    def set_window(self, sessions: Sequence[Hashable]) -> None:
        self.store.memory.set_window(sessions)

    def release(self, chunk_ids: Sequence[Hashable]) -> None:
        done: list[memoryview] = []
        with self._lock:
            for c in chunk_ids:
                k = self.key(c)
                if self._pins.release(k):
                    done.append(self._views.pop(k))
        for view in done:  # the store may reuse the buffer (or evict the entry's) from now on
            view.release()

    def staging_budget_chunks(self) -> int:
        """The prefetch budget (chunks) this store's host memory gives, leaving its puts their room
        (:func:`kvstream.serving.core.staging_budget_chunks`): host memory and the write backlog valve counted in
        the buffers a chunk's file image takes (header and payload, in the pool's size class: a 48 MiB chunk
        takes 56 MiB), the valve only when a chunk may get a second copy (more than one tier)."""
        from kvstream.format import file_size
        from kvstream.io.buffers import BufferPool
        from kvstream.serving.core import staging_budget_chunks

        store = self.store
        fsize = file_size(self.chunk_bytes)
        memory = store.config.memory_bytes
        backlog = 0
        if len(store.tiers) > 1:
            backlog = max(store.config.write_backlog_limit(t.cfg) for t in store.tiers[1:])
        backlog_chunks = -(-backlog // fsize)  # the valve takes a copy while the backlog is below its limit
        return staging_budget_chunks(memory // BufferPool.size_class(fsize), backlog_chunks)

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._views.values())

    def sample(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.store.stats().as_dict()["tiers"].items():
            out[f"{name}.read"] = int(t["read_bytes"])
            out[f"{name}.write"] = int(t["write_bytes"])
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._writes.shutdown(wait=True)
        with self._lock:
            left = list(self._views.values())
            self._views.clear()
            self._pins.clear()
        for view in left:
            view.release()
