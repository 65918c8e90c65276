"""Per-tier circuit breaker (sans-I/O): take a failing tier out of routing, probe it back in later.

States: ``closed`` (healthy, used), ``open`` (failing, not used until ``retry_at``), ``half-open`` (cool-down
over: the tier is used again, and its next result decides: a success closes the breaker, a failure reopens it
with twice the cool-down, up to ``max_cooldown_s``), ``down`` (the tier could not be opened: never used, never
probed, for the life of the store; final). ``threshold`` consecutive failures open a closed breaker.
Time is passed in; nothing here sleeps or reads a clock.

What is a failure: an error (:meth:`on_failure`: EIO, EROFS, a failed open), or a *stall* (:meth:`on_stall`: a
read still in flight past the hedge deadline) that is really one. A stall is judged by wall time, and wall time
includes every moment the process was not scheduled: on a CPU-starved host (busy neighbours, more runnable
threads than cores) a healthy disk's reads are reaped late, and with the hedge deadline as the rule (50 ms in
the load test) the local tier's breaker opened 361 times in one soak, which then skipped its copies. So a stall
counts only if the read has been out at least ``stall_floor_s`` *and* the tier has delivered nothing since the
read was issued (``last_success``: a read a step used, a published copy, a probe answered): a hung device
delivers nothing; a healthy one in a starved process keeps delivering its share of every step. (A tier so slow
that it loses every race, so that no step ever uses what it reads, still opens its breaker once its reads are
out past the floor: taking it out costs nothing and saves its bandwidth.) Measured: the reads a step used had at
most 0.52 s from submission to completion with 8 CPU hogs on this 2-core VM, hence the 1 s floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["CircuitBreaker"]


@dataclass
class CircuitBreaker:
    threshold: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 2.0  # first open period
    max_cooldown_s: float = 60.0
    stall_floor_s: float = 1.0  # a read out less long than this is never a failure (hedging covers it)
    state: str = "closed"
    failures: int = 0  # consecutive
    retry_at: float = 0.0
    opened: int = 0  # times it opened (a counter for operators)
    last_success: float = -math.inf  # when the tier last delivered (the time passed to on_success)
    stalls_ignored: int = 0  # stalls not counted as failures (the tier delivered something meanwhile, or short)
    _current_cooldown: float = 0.0

    def mark_down(self) -> None:
        """The tier could not be opened: out of routing and writes for good (no half-open probe: its folder,
        index and lease were never set up)."""
        self.state = "down"

    def usable(self, now: float) -> bool:
        """True if the tier may be used now (moves open -> half-open once the cool-down is over)."""
        if self.state == "open" and now >= self.retry_at:
            self.state = "half-open"
        return self.state not in ("open", "down")

    def on_success(self, now: float | None = None) -> bool:
        """An operation succeeded (at ``now``, when given: it is what :meth:`on_stall` compares with). Returns
        True if that closed an open or half-open breaker (the tier recovered: what was measured of it while it
        failed, such as its read bandwidth, no longer describes it)."""
        if now is not None and now > self.last_success:
            self.last_success = now
        self.failures = 0
        if self.state == "down":
            return False
        if self.state != "closed":
            self.state = "closed"
            self._current_cooldown = 0.0
            return True
        return False

    def on_failure(self, now: float) -> None:
        if self.state == "down":
            return
        self.failures += 1
        if self.state == "half-open" or (self.state == "closed" and self.failures >= self.threshold):
            self._current_cooldown = min(self.max_cooldown_s,
                                         self._current_cooldown * 2 if self._current_cooldown else self.cooldown_s)
            self.state = "open"
            self.retry_at = now + self._current_cooldown
            self.opened += 1

    def on_stall(self, now: float, since: float) -> bool:
        """A read issued at ``since`` is still in flight at ``now`` (past the hedge deadline). A failure only if
        it has been out ``stall_floor_s`` or more and the tier has delivered nothing since ``since`` (module
        docstring); else ignored (counted in ``stalls_ignored``). Returns True if it counted as a failure."""
        if now - since < self.stall_floor_s or self.last_success >= since:
            self.stalls_ignored += 1
            return False
        self.on_failure(now)
        return True
