"""Per-tier circuit breaker (sans-I/O): take a failing tier out of routing, probe it back in later.

States: ``closed`` (healthy, used), ``open`` (failing, not used until ``retry_at``), ``half-open`` (cool-down
over: the tier is used again, and its next result decides: a success closes the breaker, a failure reopens it
with twice the cool-down, up to ``max_cooldown_s``), ``down`` (the tier could not be opened: never used, never
probed, for the life of the store; final). ``threshold`` consecutive failures open a closed breaker.
Time is passed in; nothing here sleeps or reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CircuitBreaker"]


@dataclass
class CircuitBreaker:
    threshold: int = 3  # consecutive failures that open the breaker
    cooldown_s: float = 2.0  # first open period
    max_cooldown_s: float = 60.0
    state: str = "closed"
    failures: int = 0  # consecutive
    retry_at: float = 0.0
    opened: int = 0  # times it opened (a counter for operators)
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

    def on_success(self) -> bool:
        """A read succeeded. Returns True if that closed an open or half-open breaker (the tier recovered: what
        was measured of it while it failed, such as its read bandwidth, no longer describes it)."""
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
