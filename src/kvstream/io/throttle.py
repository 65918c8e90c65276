"""Bandwidth emulation: an I/O engine wrapper whose chosen rings never complete faster than a set rate.

With a tier on a RAM-backed folder this makes an *emulated* independent channel of known speed when the
machine has only one real device (``kvstream replay``'s default shared tier, and tests of back-pressure).
Its bandwidth is set, not measured: every report that uses it says so, and no speed claim rests on it alone.

The I/O itself is real and runs at the inner engine's speed; only the completion is held back, by a FIFO
token bucket reserved at submit (``free_at = max(free_at, now) + bytes / bw``), so a ring behaves like a
channel of that bandwidth serving its ops in order — including ops nobody waits for any more.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from collections.abc import Callable, Sequence

from kvstream.io.engine import DEFAULT_DEPTH, DEFAULT_MAX_BYTES, IOEngine, IOOp, Ring
from kvstream.io.timer import DueTimer

__all__ = ["ThrottledEngine"]


class _ThrottledRing(Ring):
    """Completions leave no faster than ``bw`` bytes/s (a FIFO token bucket reserved at submit)."""

    def __init__(self, inner: Ring, bw: float, timer: DueTimer) -> None:
        self.inner = inner
        self.bw = bw
        self.timer = timer
        self.engine_name = f"{inner.engine_name}+throttle"
        self._lock = threading.Lock()
        self._free_at = 0.0
        self._pending = 0
        self._drained = threading.Condition(self._lock)

    def submit(self, ops: Sequence[IOOp]) -> None:
        with self._lock:
            now = time.monotonic()
            for op in ops:
                self._free_at = max(self._free_at, now) + op.length / self.bw
                op.callback = self._wrap(op.callback, self._free_at)
                self._pending += 1
        self.inner.submit(ops)

    def _wrap(self, user_cb: Callable[[IOOp], None], due: float) -> Callable[[IOOp], None]:
        def deliver(op: IOOp) -> None:
            op.callback = user_cb
            try:
                user_cb(op)
            finally:
                with self._lock:
                    self._pending -= 1
                    self._drained.notify_all()

        def on_complete(op: IOOp) -> None:
            if time.monotonic() >= due:
                deliver(op)
            else:
                self.timer.call_at(due, lambda: deliver(op))

        return on_complete

    def inflight(self) -> int:
        with self._lock:
            return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._drained.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.drain()
        self.inner.close()


class ThrottledEngine(IOEngine):
    """Wraps ``inner``; rings whose label matches a pattern in ``limits`` (``"shared-r"``, ``"shared-*"``) are
    held to that many bytes/s."""

    def __init__(self, inner: IOEngine, limits: dict[str, float]) -> None:
        self.inner = inner
        self.limits = dict(limits)
        self.name = f"{inner.name}+throttle"
        self._timer = DueTimer(name="kvs-throttle")

    def ring(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> Ring:
        r = self.inner.ring(label, depth=depth, max_bytes=max_bytes)
        for pat, bw in self.limits.items():
            if fnmatch.fnmatchcase(label, pat):
                return _ThrottledRing(r, bw, self._timer)
        return r
