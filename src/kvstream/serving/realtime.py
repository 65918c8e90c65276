"""The real-time driver: the same :class:`~kvstream.serving.core.ServingCore` as the simulator, against a real
store, on a real clock. Only the GPU is modelled: each forward step is *waited for* for its modelled duration,
so every second of storage time in a run is real I/O.

Event delivery follows the simulator's ordering rule exactly (:mod:`kvstream.sim.engine`): events due by now
are handed to the core in ``(time, priority, seq)`` order — storage completions before step completions before
arrivals — and each with its own time as ``now`` (an arrival at its scheduled time, a step at its modelled end,
a load at the moment its last chunk landed), not the instant the loop noticed it. So identical event sequences
give identical decisions in both drivers (tested with a virtual clock: ``tests/integration/test_replay_driver.py``).

Backends (what the core's actions are carried out on) implement :class:`~kvstream.serving.backend.ServingBackend`,
as the simulator's modelled store does, and the actions are carried out by the one
:func:`~kvstream.serving.backend.dispatch` both drivers use; loads run on the backend's own threads and report
through :meth:`RealtimeDriver.post`. A forward step is a deadline on this driver's clock.

Queue-aware eviction: when the backend's host-memory policy takes a look-ahead window
(:attr:`ServingBackend.wants_window`), the core's window (:meth:`ServingCore.window_sessions`, the scheduling
policy's serving order) is handed to it after every event (:func:`~kvstream.serving.backend.deliver`), as in the
simulator.
"""

from __future__ import annotations

import dataclasses
import heapq
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

from kvstream.serving.backend import Record, ServingBackend, deliver, dispatch, window_wanted
from kvstream.serving.core import Action, Arrival, Event, LoadDone, ServingCore, StartStep, StepDone
from kvstream.sim.engine import PRIO_ARRIVAL, PRIO_IO, PRIO_STEP
from kvstream.workload.request import Request

__all__ = ["Clock", "WallClock", "RealtimeDriver"]


class Clock(ABC):
    """Seconds since the run started, and a way to sleep that a posted completion can cut short."""

    @abstractmethod
    def now(self) -> float: ...

    @abstractmethod
    def wait(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds, or until :meth:`wake` is called."""

    @abstractmethod
    def wake(self) -> None: ...


class WallClock(Clock):
    def __init__(self) -> None:
        self._t0 = time.monotonic()
        self._cv = threading.Condition()
        self._flag = False

    def now(self) -> float:
        return time.monotonic() - self._t0

    def wait(self, timeout: float) -> None:
        with self._cv:
            if not self._flag and timeout > 0:
                self._cv.wait(timeout)
            self._flag = False

    def wake(self) -> None:
        with self._cv:
            self._flag = True
            self._cv.notify_all()


class RealtimeDriver:
    """Runs one core against a backend in real time. ``speed`` compresses the arrival times: the requests are
    re-timed once, up front (arrival / speed), so the core sees one time line: the arrival it is given, the
    time it is delivered, TTFT, queueing time and the scheduler's waiting time (HRRN) all use the compressed
    arrival (:attr:`requests` holds the re-timed requests)."""

    def __init__(self, core: ServingCore, backend: ServingBackend, requests: Sequence[Request], *,
                 clock: Clock | None = None, speed: float = 1.0, sample_every_s: float = 0.5,
                 on_progress: Callable[[int, int], None] | None = None, record: Record | None = None) -> None:
        self.core = core
        self.backend = backend
        if speed <= 0 or speed != speed:
            raise ValueError(f"speed must be a positive number, got {speed}")
        self.requests = [r if speed == 1.0 else dataclasses.replace(r, arrival=r.arrival / speed) for r in requests]
        self.clock = clock or WallClock()
        self.speed = speed
        self.sample_every_s = sample_every_s
        self.on_progress = on_progress
        self.record = record
        self._posted: list[tuple[float, int, int, Event]] = []  # guarded by _lock
        self._lock = threading.Lock()
        self._seq = 0
        self._step: tuple[float, int] | None = None  # (modelled end, step id)
        self.lag_s = 0.0  # worst delay between an event's time and its delivery (driver overhead)
        self._window = window_wanted(core, backend)

    def post(self, ev: LoadDone) -> None:
        """Called by the backend (any thread) when a load has finished."""
        with self._lock:
            # Stamped under the lock the driver reads its clock under (``_next_due``): a completion stamped
            # before the driver's ``now`` is always in ``_posted`` when the driver looks, so no event is ever
            # delivered with a time earlier than one already delivered (a stamp taken outside the lock could be
            # pushed after a later arrival was handed over: that load's follow-up decisions then ran "before"
            # the arrival, and the requests they started showed negative queueing times).
            t = self.clock.now()
            self._seq += 1
            heapq.heappush(self._posted, (t, PRIO_IO, self._seq, ev))
        self.clock.wake()

    def _start_step(self, a: StartStep, now: float) -> None:
        self._step = (now + a.duration, a.step_id)

    def _dispatch(self, actions: Sequence[Action], now: float) -> None:
        dispatch(actions, self.backend, post=self.post, start_step=lambda a: self._start_step(a, now))

    def _deliver(self, t: float, ev: Event) -> None:
        deliver(self.core, self.backend, ev, t, post=self.post, start_step=lambda a: self._start_step(a, t),
                window=self._window, record=self.record)

    def _next_due(self, i: int) -> tuple[float, tuple[float, int, Event] | None]:
        """``(now, event)``: the clock, read under the posting lock, and the earliest event due by then in
        ``(time, priority, seq)`` order, or None."""
        best: tuple[float, int, int] | None = None
        kind = ""
        with self._lock:
            now = self.clock.now()
            if self._posted and self._posted[0][0] <= now:
                best = self._posted[0][:3]
                kind = "io"
        if self._step is not None and self._step[0] <= now:
            key = (self._step[0], PRIO_STEP, 0)
            if best is None or key < best:
                best, kind = key, "step"
        if i < len(self.requests):
            t = self.requests[i].arrival
            if t <= now:
                key = (t, PRIO_ARRIVAL, 0)
                if best is None or key < best:
                    best, kind = key, "arrival"
        if best is None:
            return now, None
        if kind == "io":
            with self._lock:
                t, prio, _, ev = heapq.heappop(self._posted)
            return now, (t, prio, ev)
        if kind == "step":
            assert self._step is not None
            t, sid = self._step
            self._step = None
            return now, (t, PRIO_STEP, StepDone(step_id=sid))
        return now, (best[0], PRIO_ARRIVAL, Arrival(request=self.requests[i]))

    def run(self) -> None:
        reqs = self.requests
        i = 0
        n = len(reqs)
        done_prev = -1
        next_sample = 0.0
        while True:
            now, nxt = self._next_due(i)
            if now >= next_sample:
                self.core.metrics.tier_series.append((now, self.backend.sample()))
                next_sample = now + self.sample_every_s
            if nxt is not None:
                t, prio, ev = nxt
                if prio == PRIO_ARRIVAL:
                    i += 1
                self.lag_s = max(self.lag_s, now - t)
                self._deliver(t, ev)
                if self.on_progress is not None:
                    done = self.core.finished
                    if done != done_prev:
                        self.on_progress(done, n)
                        done_prev = done
                continue
            if i >= n and self.core.idle and self._step is None:
                with self._lock:
                    if not self._posted:
                        break
            # Sleep until the next arrival or step end, or until a load posts.
            wake_at = min(
                reqs[i].arrival if i < n else float("inf"),
                self._step[0] if self._step is not None else float("inf"),
                next_sample,
            )
            with self._lock:
                if self._posted:
                    wake_at = min(wake_at, self._posted[0][0])
            self.clock.wait(max(wake_at - self.clock.now(), 0.0))
        self._dispatch(self.core.flush_writes(), self.clock.now())
        self.core.metrics.tier_series.append((self.clock.now(), self.backend.sample()))
