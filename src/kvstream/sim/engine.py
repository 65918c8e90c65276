"""The discrete-event clock: one heap, one ordering key.

Every event is ordered by ``(time, priority, seq)`` and by nothing else:

- ``time``: simulated seconds;
- ``priority``: at equal times, lower first. The rule: storage completions (:data:`PRIO_IO`) are applied
  before GPU step completions (:data:`PRIO_STEP`), and both before new arrivals (:data:`PRIO_ARRIVAL`), so a
  request arriving at the instant a step ends is planned with that step's results already in; background
  bandwidth changes (:data:`PRIO_ENV`) come first of all, so I/O finishing at that instant already saw them;
  samplers (:data:`PRIO_SAMPLE`) observe last;
- ``seq``: a per-loop counter, so equal (time, priority) events run in the order they were scheduled.

This is our own heap loop rather than simpy: the serving loop and the storage model schedule plain callbacks
(no generator per process), and a timeout costs 0.66 µs here against 0.92 µs in simpy (1.4x; measured by
``bench/sim_loop_vs_simpy.py``, BENCHMARKS §6.2).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

__all__ = ["EventLoop", "PRIO_ENV", "PRIO_IO", "PRIO_STEP", "PRIO_ARRIVAL", "PRIO_SAMPLE"]

PRIO_ENV = 0  # bandwidth changes of shared tiers (other tenants)
PRIO_IO = 1  # storage op completions, load completions
PRIO_STEP = 2  # GPU step completions
PRIO_ARRIVAL = 3  # request arrivals
PRIO_SAMPLE = 4  # periodic samplers


class EventLoop:
    """Runs callbacks in ``(time, priority, seq)`` order. Time never goes backwards."""

    __slots__ = ("now", "_heap", "_seq", "events_run", "_stopped")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0
        self._stopped = False

    def stop(self) -> None:
        """End :meth:`run` after the current event (background processes never run out of events)."""
        self._stopped = True

    def at(self, time: float, priority: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at ``time`` (>= now)."""
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        self._seq += 1
        heapq.heappush(self._heap, (time, priority, self._seq, fn, args))

    def after(self, delay: float, priority: int, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, priority, fn, *args)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        pop = heapq.heappop
        n = 0
        self._stopped = False
        while heap and not self._stopped:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            t, _, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
        self.events_run += n

    def pending(self) -> int:
        return len(self._heap)
