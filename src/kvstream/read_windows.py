"""Per-tier read windows (sans-I/O): how many bytes each tier may have in flight during a step's read.

Meet in the middle balances *which* tier reads *which* chunk, but a tier's reads already submitted cannot be
taken back: when the step's pool of unclaimed chunks runs dry, every tier still has its whole window in flight,
and the step waits for the slowest window (or the fast tier re-reads it, paying twice). A window of the same
*bytes* on every tier therefore leaves a tail of ``window / bandwidth`` on the slowest tier — 90 ms for a
32 MiB window on a 0.4 GB/s shared file system, against 20 ms on the 1.5 GB/s local disk — and the slow tier's
stale reads then delay its share of the *next* step as well.

:class:`BandwidthBalancedWindows` sizes the windows so that every tier's window takes about the same time to
drain: the tier that is fastest (by a running estimate of its busy-time throughput) keeps its configured
window; tier ``t`` gets ``bw_t / bw_fastest`` of the fastest tier's window, never more than its own configured
window and never less than ``min_bytes`` (the driver always keeps at least one read in flight anyway). Until
every tier has been observed, each uses its configured window. A tier that was busy for a whole step without
landing anything is observed at zero speed and drops to the floor; the floor read then measures it again.

:class:`FixedWindows` is the baseline: configured windows, never changed.

The estimate is the ratio of bytes to *busy* seconds (time with at least one read in flight) over a step, an
exponentially weighted mean across steps. It is driven by the real store and by the simulator alike::

    windows.window(t) -> bytes           # before claiming for tier t
    windows.observe(t, nbytes, busy_s)   # after a step: what tier t delivered and how long it was busy
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ReadWindows", "FixedWindows", "BandwidthBalancedWindows", "make_read_windows", "READ_WINDOW_POLICIES"]

READ_WINDOW_POLICIES = ("balanced", "fixed")


class ReadWindows:
    """Configured per-tier windows; subclasses adapt them. ``window(t)`` is always in ``[min_bytes, budget_t]``."""

    name = "fixed"

    def __init__(self, budgets: Sequence[int], *, min_bytes: int = 0) -> None:
        if not budgets:
            raise ValueError("read windows need at least one tier")
        if any(b < 0 for b in budgets):
            raise ValueError(f"read window budgets must be >= 0, got {list(budgets)}")
        self.budgets = [int(b) for b in budgets]
        self.min_bytes = max(int(min_bytes), 0)

    def window(self, tier: int) -> int:
        return self.budgets[tier]

    def windows(self) -> list[int]:
        return [self.window(t) for t in range(len(self.budgets))]

    def observe(self, tier: int, nbytes: int, busy_s: float) -> None:
        """Tier ``tier`` delivered ``nbytes`` while busy for ``busy_s`` seconds in one step (fixed: ignored)."""

    def bandwidth_estimate(self, tier: int) -> float | None:
        """The policy's current estimate of the tier's read bytes per busy second (None: none kept)."""
        return None

    def forget(self, tier: int) -> None:
        """The tier recovered from a fault: drop what was measured of it (fixed: nothing kept)."""


class FixedWindows(ReadWindows):
    """The configured windows, whatever the tiers' speeds (the paper's fixed per-tier in-flight depth)."""


class BandwidthBalancedWindows(ReadWindows):
    """Windows proportional to each tier's measured throughput, so all drain in about the same time."""

    name = "balanced"

    def __init__(self, budgets: Sequence[int], *, min_bytes: int = 0, alpha: float = 0.3,
                 min_sample_bytes: int = 1) -> None:
        super().__init__(budgets, min_bytes=min_bytes)
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_sample_bytes = max(int(min_sample_bytes), 1)
        self.bandwidth: list[float | None] = [None] * len(self.budgets)  # bytes per busy second, EWMA

    def observe(self, tier: int, nbytes: int, busy_s: float) -> None:
        # A tier busy for a whole step without landing a byte is a real sample (its window was too deep to
        # finish anything before the others were done): it counts as zero, so its window shrinks to the floor.
        # A short step that moved a few bytes says more about latency than bandwidth: skipped.
        if not busy_s >= 1e-6 or 0 < nbytes < self.min_sample_bytes:  # below a microsecond is clock noise
            return
        bw = nbytes / busy_s
        old = self.bandwidth[tier]
        self.bandwidth[tier] = bw if old is None else old + self.alpha * (bw - old)

    def bandwidth_estimate(self, tier: int) -> float | None:
        return self.bandwidth[tier]

    def forget(self, tier: int) -> None:
        # A stall or an EIO storm pulls the estimate toward zero, and the EWMA would take many steps to climb
        # back: meanwhile the other tier steals the recovered tier's chunks. Unmeasured, the tier gets its full
        # window and its next step's sample sets the estimate afresh.
        self.bandwidth[tier] = None

    def window(self, tier: int) -> int:
        bws = [b for b in self.bandwidth if b is not None]
        if len(self.bandwidth) == 1 or len(bws) < len(self.bandwidth):
            return self.budgets[tier]
        # The drain time every window is sized to: the fastest tier's full window.
        fastest = max(range(len(bws)), key=lambda t: bws[t])
        if not bws[fastest]:
            return self.budgets[tier]  # nothing measured moving yet
        drain_s = self.budgets[fastest] / bws[fastest]
        want = int(bws[tier] * drain_s)
        return max(min(want, self.budgets[tier]), min(self.min_bytes, self.budgets[tier]))


def make_read_windows(policy: str, budgets: Sequence[int], *, min_bytes: int = 0) -> ReadWindows:
    """``"balanced"`` (default in the store) or ``"fixed"``."""
    if policy == "balanced":
        return BandwidthBalancedWindows(budgets, min_bytes=min_bytes)
    if policy == "fixed":
        return FixedWindows(budgets, min_bytes=min_bytes)
    raise ValueError(f"unknown read window policy {policy!r}; known: {', '.join(READ_WINDOW_POLICIES)}")
