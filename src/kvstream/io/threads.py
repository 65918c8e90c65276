"""The fallback engine: a thread pool doing blocking ``preadv``/``pwritev`` (the GIL is released in the call).

Used where io_uring is not available (old kernels, seccomp'd containers) and as the cross-check that the
io_uring engine returns identical bytes. Each ring has its own worker threads (``depth`` of them), so a tier's
read ring and write ring never wait on each other.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from kvstream.errors import StoreClosedError
from kvstream.io.engine import (
    DEFAULT_DEPTH,
    DEFAULT_MAX_BYTES,
    IOEngine,
    IOOp,
    OpKind,
    Ring,
    _LimitedBacklog,
    errno_of,
    pread_full,
    pwrite_full,
)

__all__ = ["ThreadPoolEngine", "ThreadPoolRing"]

log = logging.getLogger(__name__)


class ThreadPoolRing(Ring):
    """A :class:`~kvstream.io.engine.Ring` served by ``depth`` worker threads of its own.

    Invariants (under ``_lock``):
    - ``_pending`` = len(backlog) + len(ready) + ops taken by a worker whose callback has not returned yet;
    - a worker exits only when the ring is closed and ``_pending == 0``, so every submitted op is called back;
    - a callback's exception is logged and dropped: it never ends a worker, or the ring would lose capacity
      (with ``depth == 1``, all of it) and ops still queued would never complete.
    """

    engine_name = "threads"

    def __init__(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.label = label
        self._limits = _LimitedBacklog(depth, max_bytes)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._drained = threading.Condition(self._lock)
        self._backlog: deque[IOOp] = deque()  # waiting for room under the limits
        self._ready: deque[IOOp] = deque()  # admitted, waiting for a worker
        self._pending = 0  # backlog + ready + running
        self._closed = False
        self._workers = [
            threading.Thread(target=self._worker, name=f"kvs-{label}-{i}", daemon=True) for i in range(depth)
        ]
        self._worker_set = frozenset(self._workers)  # for close(): is the caller one of ours?
        for t in self._workers:
            t.start()

    def submit(self, ops: Sequence[IOOp]) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise StoreClosedError(f"ring '{self.label}' is closed")
            for op in ops:
                op.submitted_at = now
                self._backlog.append(op)
                self._pending += 1
            self._admit_locked()

    def _admit_locked(self) -> None:
        while self._backlog and self._limits.fits(self._backlog[0]):
            op = self._backlog.popleft()
            self._limits.start(op)
            self._ready.append(op)
            self._work.notify()

    def inflight(self) -> int:
        return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._drained.wait_for(lambda: self._pending == 0, timeout)

    def _worker(self) -> None:
        while True:
            with self._lock:
                while not self._ready and not (self._closed and self._pending == 0):
                    self._work.wait()
                if not self._ready:
                    return
                op = self._ready.popleft()
            view = op.buf.view(op.buf_offset, op.buf_offset + op.length)
            try:
                if op.kind is OpKind.READ:
                    op.result = pread_full(op.fd, view, op.offset)
                else:
                    op.result = pwrite_full(op.fd, view, op.offset)
            except OSError as exc:
                op.result = -errno_of(exc)
            finally:
                view.release()
            op.completed_at = time.monotonic()
            try:
                op.callback(op)
            except Exception:
                log.exception("ring '%s': callback for %s op at offset %d raised", self.label, op.kind.value, op.offset)
            finally:
                with self._lock:
                    self._limits.finish(op)
                    self._pending -= 1
                    self._admit_locked()
                    if self._pending == 0:
                        self._drained.notify_all()
                        if self._closed:
                            self._work.notify_all()

    def close(self) -> None:
        """Refuse new ops, wait for every submitted op's callback, then let the workers end. Idempotent.

        Called from one of this ring's own callbacks, it returns at once without waiting: the other workers
        wait for ``_pending == 0``, which needs the calling callback to return first. The workers then finish
        the remaining ops and exit by themselves. Called again from any other thread (a second close, too),
        it waits for them, so a close that returns from outside the ring always means "all done".
        """
        with self._lock:
            self._closed = True
            self._work.notify_all()
        if threading.current_thread() in self._worker_set:
            return
        for t in self._workers:
            t.join()


class ThreadPoolEngine(IOEngine):
    name = "threads"

    def ring(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> Ring:
        return ThreadPoolRing(label, depth=depth, max_bytes=max_bytes)


_ = os
