"""``kvstream replay``'s storage side: the real store behind the serving core's actions, and an emulated tier.

:class:`StoreBackend` maps the core's chunk ids to store keys (namespaced by model), answers ``lookup`` from
the store's index and host-memory tier, runs each :class:`StartLoad` as one ``read_chunks`` call on a worker
thread (the store routes it over the tiers), ``put``\\ s each :class:`WriteChunks` chunk (a synthetic payload
of the model's chunk size; its bytes do not matter, its size and the I/O do) and ``flush``\\ es at
:class:`Flush`. Reads carry each request's session and previous answer length (the load's ``metas``) to the
host-memory tier's eviction policy, and a queue-aware policy gets the serving loop's look-ahead window
(:meth:`StoreBackend.set_window`).

:class:`~kvstream.io.throttle.ThrottledEngine` (re-exported here) makes replay's *emulated* shared tier.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvstream.eviction import AccessMeta
from kvstream.io.throttle import ThrottledEngine
from kvstream.keys import ChunkKeyer, KeyNamespace
from kvstream.serving.core import LoadDone, StartLoad, WriteChunks
from kvstream.serving.realtime import RealtimeBackend

__all__ = ["StoreBackend", "ThrottledEngine"]

log = logging.getLogger(__name__)


class StoreBackend(RealtimeBackend):
    """The real store behind a real-time run (see the module docstring)."""

    def __init__(self, store: Any, *, model: str, chunk_bytes: int, workers: int = 2) -> None:
        import numpy as np

        self.store = store
        self.chunk_bytes = chunk_bytes
        self.keyer = ChunkKeyer(KeyNamespace(model=model, kv_dtype="bfloat16", extra="kvstream-replay"))
        self._keys: dict[Hashable, bytes] = {}
        # One payload for every chunk: the I/O is real, the contents are not the point.
        self.payload = np.random.default_rng(0).integers(0, 256, chunk_bytes, dtype=np.uint8).tobytes()
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvs-replay-load")
        self.load_s: list[float] = []
        self._lock = threading.Lock()
        self._staged: dict[bytes, tuple[bytearray, int]] = {}  # key -> (payload copy, pins); see _load
        # Staging buffers come back here when the core releases them: a fresh 7 MiB ``bytes`` per chunk cost
        # page faults on every copy (measured: the copy dominated a load's per-chunk time), while a real engine
        # copies into pinned buffers it keeps.
        self._free: list[bytearray] = []
        self._free_max = 256

    def key(self, c: Hashable) -> bytes:
        k = self._keys.get(c)
        if k is None:
            k = self._keys[c] = self.keyer.foreign(repr(c))
        return k

    def lookup(self, chunk_ids: Sequence[Hashable]) -> tuple[int, int]:
        keys = [self.key(c) for c in chunk_ids]
        n = self.store.lookup(keys)
        mem = self.store.memory
        return n, sum(1 for k in keys[:n] if k in mem)

    def start_load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        self._pool.submit(self._load, action, post)

    def _load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        t0 = time.perf_counter()
        keys: list[bytes] = []
        metas: list[AccessMeta | None] = []
        index: dict[bytes, int] = {}
        for j, (_, chunks) in enumerate(action.items):
            session, prev = action.metas[j] if j < len(action.metas) else (None, None)
            meta = AccessMeta(session=session, prev_answer_tokens=prev) if session is not None else None
            for c in chunks:
                k = self.key(c)
                if k not in index:
                    index[k] = len(keys)
                    keys.append(k)
                    metas.append(meta)
        got = [False] * len(keys)
        data: dict[bytes, bytes] = {}
        try:
            for i, chunk in self.store.read_chunks(keys, metas=metas):
                if chunk is not None:
                    got[i] = True
                    # The engine's own staging copy (pinned host buffer / the GPU): held until the core
                    # releases it, so a prefetched request keeps its KV even if the store evicts it meanwhile.
                    data[keys[i]] = self._stage_copy(chunk.payload)
        except Exception:  # a failing store must not hang the run: report what landed, and say why
            log.exception("replay: a load failed part-way; the chunks that landed are used, the rest recomputed")
        avail = []
        with self._lock:
            for rid, chunks in action.items:
                n = 0
                for c in chunks:
                    k = self.key(c)
                    if not got[index[k]]:
                        break
                    n += 1
                    held = self._staged.get(k)
                    if held is None:
                        self._staged[k] = (data.pop(k), 1)
                    else:
                        self._staged[k] = (held[0], held[1] + 1)
                avail.append((rid, n))
            for unused in data.values():  # landed after a missing chunk, or already staged by another load
                self._recycle_locked(unused)
        self.load_s.append(time.perf_counter() - t0)
        post(LoadDone(load_id=action.load_id, available=tuple(avail)))

    def write(self, action: WriteChunks) -> None:
        for j, c in enumerate(action.chunk_ids):
            self.store.put(self.key(c), self.payload, position=action.first_position + j)

    def flush(self) -> None:
        self.store.flush()

    @property
    def wants_window(self) -> bool:
        return self.store.memory.queue_aware

    def set_window(self, sessions: Sequence[Hashable]) -> None:
        self.store.memory.set_window(sessions)

    def release(self, chunk_ids: Sequence[Hashable]) -> None:
        with self._lock:
            for c in chunk_ids:
                k = self.key(c)
                payload, pins = self._staged[k]
                if pins > 1:
                    self._staged[k] = (payload, pins - 1)
                else:
                    del self._staged[k]
                    self._recycle_locked(payload)

    def _stage_copy(self, payload: memoryview) -> bytearray:
        n = len(payload)
        with self._lock:
            buf = next((b for b in reversed(self._free) if len(b) == n), None)
            if buf is not None:
                self._free.remove(buf)
        if buf is None:
            return bytearray(payload)
        buf[:] = payload  # same length: an in-place copy into memory already faulted in
        return buf

    def _recycle_locked(self, buf: bytearray) -> None:
        """Return a staging buffer to the free list; the caller holds ``self._lock``."""
        if len(self._free) < self._free_max:
            self._free.append(buf)

    @property
    def staged_bytes(self) -> int:
        with self._lock:
            return sum(len(p) for p, _ in self._staged.values())

    def sample(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for name, t in self.store.stats()["tiers"].items():
            out[f"{name}.read"] = int(t["read_bytes"])
            out[f"{name}.write"] = int(t["write_bytes"])
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
