"""A single daemon thread that runs callbacks at due times (``time.monotonic()``).

Used wherever a completion must be held back: the fault injector's delays and stalls
(:mod:`kvstream.io.faults`) and the bandwidth emulation (:mod:`kvstream.io.throttle`). The thread exits after a
second idle and is restarted on demand, so an unused timer costs nothing. A callback that raises is logged and
the timer keeps going: one bad callback must not strand every completion queued behind it.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

__all__ = ["DueTimer"]

log = logging.getLogger(__name__)


class DueTimer:
    """Runs each ``fn`` once, no earlier than its ``due`` time, in due order (ties: in call order)."""

    def __init__(self, name: str = "kvs-timer") -> None:
        self.name = name
        self._lock = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def call_at(self, due: float, fn: Callable[[], None]) -> None:
        with self._lock:
            heapq.heappush(self._heap, (due, next(self._seq), fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._lock.notify()

    def fire_all(self) -> None:
        """Make every held callback due now (a stall ends)."""
        with self._lock:
            self._heap = [(0.0, s, fn) for _, s, fn in self._heap]
            heapq.heapify(self._heap)
            self._lock.notify()

    def _run(self) -> None:
        while True:
            with self._lock:
                while True:
                    if not self._heap:
                        if not self._lock.wait(timeout=1.0) and not self._heap:
                            self._thread = None
                            return
                        continue
                    due = self._heap[0][0]
                    now = time.monotonic()
                    if due <= now:
                        _, _, fn = heapq.heappop(self._heap)
                        break
                    self._lock.wait(timeout=due - now)
            try:
                fn()
            except Exception:  # noqa: BLE001 - see the module docstring
                log.exception("%s: a held-back callback raised", self.name)
