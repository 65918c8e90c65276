"""The plugin's write queue: LMCache's puts return at once; a thread hands them to the store, deferred.

Why a thread: ``Store.put`` copies the payload into the store's host-memory tier and checksums it (tens of
milliseconds for a 48 MiB chunk). LMCache calls ``batched_submit_put_task`` on the serving thread right after
a forward pass and expects it to return immediately, so the plugin only takes a reference on each buffer
(``ref_count_up``: LMCache drops its own as soon as the call returns) and queues it; the writer thread puts
it and releases the reference.

When writes reach the disks (``Store.flush``): KVStream defers them until the next forward pass has started,
so they do not compete with that step's reads. LMCache gives a plugin no step signal; the closest is "a read
for a step has finished" (the forward pass starts right after it), so the plugin calls :meth:`read_done`
after every batch read and the queue flushes then; a step that reads nothing is covered by a timer
(``flush_after_s`` after the oldest unflushed put). Replication (which tiers get a copy) is the store's policy.

Invariants:
- every buffer accepted by :meth:`submit` gets exactly one ``ref_count_down`` (after its put, or at close);
- ``pending(key)`` is true from ``submit`` until the store holds the chunk (or the put failed);
- bytes held never exceed ``max_pending_bytes``: a put beyond it is dropped and counted, never waited for;
- nothing here blocks the caller of ``submit`` except a short lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstream.format import ChunkMeta

__all__ = ["WriteItem", "WriteQueue"]

log = logging.getLogger("kvstream.lmcache")

_TICK_S = 1.0


@dataclass(slots=True, eq=False)
class WriteItem:
    key: bytes  # store key
    obj: Any  # LMCache MemoryObj; one reference held by the queue
    meta: ChunkMeta  # what LMCache needs to rebuild the object, kept in the chunk header
    nbytes: int  # payload bytes
    on_stored: Callable[[Any], None] | None = None  # LMCache's on_complete_callback, called with the LMCache key
    lmcache_key: Any = None
    queued_at: float = 0.0


class WriteQueue:
    """See the module docstring. ``payload_of(obj)`` gives the object's bytes as a buffer."""

    def __init__(self, store: Any, *, payload_of: Callable[[Any], Any], metrics: Any, flush_after_s: float,
                 max_pending_bytes: int, on_tick: Callable[[], None] | None = None) -> None:
        self._store = store
        self._payload_of = payload_of
        self._metrics = metrics
        self._flush_after_s = flush_after_s
        self._max_pending_bytes = max_pending_bytes
        self._on_tick = on_tick
        self._cv = threading.Condition(threading.Lock())
        self._queue: deque[WriteItem] = deque()
        self._pending: dict[bytes, int] = {}  # key -> items queued or being put
        self._pending_bytes = 0
        self._unflushed_since: float | None = None  # monotonic time of the oldest put not yet flushed
        self._flush_now = False
        self._closing = False
        self._busy = False  # the thread is putting items outside the lock
        self.flushes = 0
        self._thread = threading.Thread(target=self._run, name="kvstream-lmcache-writer", daemon=True)
        self._thread.start()

    # -- caller side ----------------------------------------------------------------------------------------
    def submit(self, items: list[WriteItem]) -> int:
        """Queue puts; returns how many were accepted. Takes one reference on each accepted object."""
        accepted = 0
        dropped_budget = dropped_closed = 0
        now = time.monotonic()
        with self._cv:
            for it in items:
                if self._closing:
                    dropped_closed += 1
                    continue
                if it.key in self._pending:
                    continue
                if self._pending_bytes + it.nbytes > self._max_pending_bytes and self._pending_bytes > 0:
                    dropped_budget += 1
                    continue
                it.obj.ref_count_up()
                it.queued_at = now
                self._queue.append(it)
                self._pending[it.key] = self._pending.get(it.key, 0) + 1
                self._pending_bytes += it.nbytes
                accepted += 1
            if accepted:
                self._cv.notify()
        if accepted:
            self._metrics.pending_delta(accepted)
        self._metrics.dropped("over_pending_budget", dropped_budget)
        self._metrics.dropped("closing", dropped_closed)
        return accepted

    def pending(self, key: bytes) -> bool:
        with self._cv:
            return key in self._pending

    def read_done(self) -> None:
        """A step's read finished: its forward pass is starting, so buffered writes may go now."""
        with self._cv:
            if self._unflushed_since is not None or self._queue:
                self._flush_now = True
                self._cv.notify()

    def close(self, timeout: float) -> bool:
        """Put everything queued, flush, and stop the thread. False if it did not finish within ``timeout``."""
        with self._cv:
            self._closing = True
            self._flush_now = True
            self._cv.notify()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.error("kvstream: %d queued puts not stored after %.0f s at close", len(self._queue), timeout)
            return False
        return True

    # -- writer thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        next_tick = time.monotonic() + _TICK_S
        while True:
            with self._cv:
                while True:
                    now = time.monotonic()
                    due = (self._unflushed_since is not None
                           and now - self._unflushed_since >= self._flush_after_s)
                    if self._queue or self._flush_now or due or self._closing or now >= next_tick:
                        break
                    wait = next_tick - now
                    if self._unflushed_since is not None:
                        wait = min(wait, self._unflushed_since + self._flush_after_s - now)
                    self._cv.wait(max(wait, 0.0005))
                batch = list(self._queue)
                self._queue.clear()
                closing = self._closing
            if batch:
                self._put(batch)
            with self._cv:
                now = time.monotonic()
                due = self._unflushed_since is not None and now - self._unflushed_since >= self._flush_after_s
                flush = self._unflushed_since is not None and (self._flush_now or due or closing)
                if flush:
                    self._unflushed_since = None
                self._flush_now = False
                done = closing and not self._queue
            if flush:
                self._flush()
            if now >= next_tick or done:
                next_tick = now + _TICK_S
                if self._on_tick is not None:
                    try:
                        self._on_tick()
                    except Exception:  # a metrics or housekeeping bug must not stop the writes
                        log.exception("kvstream: periodic task failed")
            if done:
                return

    def _put(self, batch: list[WriteItem]) -> None:
        for it in batch:
            ok = False
            try:
                ok = bool(self._store.put(it.key, self._payload_of(it.obj), meta=it.meta))
                if ok:
                    self._metrics.stored(it.nbytes)
                else:
                    self._metrics.dropped("store_refused")  # already stored, or its host memory all dirty
            except Exception as exc:  # a closed store, a full disk: count it; the caller recomputes later
                self._metrics.dropped("error")
                log.warning("kvstream: put failed: %s", exc)
            finally:
                it.obj.ref_count_down()
                with self._cv:
                    n = self._pending.get(it.key, 0) - 1
                    if n > 0:
                        self._pending[it.key] = n
                    else:
                        self._pending.pop(it.key, None)
                    self._pending_bytes -= it.nbytes
                    if ok and self._unflushed_since is None:
                        self._unflushed_since = it.queued_at
                self._metrics.pending_delta(-1)
            if ok and it.on_stored is not None:
                try:
                    it.on_stored(it.lmcache_key)
                except Exception as exc:  # LMCache's contract: callback errors are logged, not raised
                    log.warning("kvstream: on_complete_callback failed: %s", exc)

    def _flush(self) -> None:
        try:
            self._store.flush()
            self.flushes += 1
        except Exception as exc:
            log.warning("kvstream: flush failed: %s", exc)
