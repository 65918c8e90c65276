"""Arrival processes with a target burstiness: correlated bursts from a Markov-modulated Poisson process.

The CV of inter-arrival gaps (std / mean) is the papers' measure of burstiness. A gamma *renewal* process
(:func:`kvstream.workload.synthetic.arrival_gaps`) reaches any CV with independent gaps: a long gap is not
followed by another long gap more often than chance. Production bursts are not like that: traffic is high for
a while, then low for a while, so short gaps come in runs. A two-state **MMPP** (Markov-modulated Poisson
process) models exactly that: a hidden state switches between *high* (rate ``rate_hi``) and *low* (rate
``rate_lo``) after exponential dwell times, and arrivals are Poisson at the current state's rate. Its gaps are
positively correlated (lag-1 autocorrelation > 0), unlike a renewal process's (0).

Invariants:
- :meth:`MMPP2.cv` is the exact stationary CV of the gaps (phase-type moments, no sampling).
- :func:`mmpp_for_cv` returns a process whose :meth:`MMPP2.cv` equals the target to 1e-4 relative, with the
  given burst ratio and time share in the high state; only the dwell times are searched (CV grows
  monotonically with them, from 1 when the state switches infinitely fast to the hyperexponential limit
  when it never switches).
- :func:`mmpp_gaps` with ``exact=True`` has sample CV equal to the target (the same monotone power
  calibration as the gamma generator, which keeps the gaps' order, hence their runs); the mean is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["MMPP2", "mmpp_for_cv", "mmpp_gaps", "sample_cv", "calibrate_cv", "lag1_autocorr"]


def sample_cv(x: np.ndarray) -> float:
    """std / mean (population std, as the papers define the CV of inter-arrival gaps)."""
    m = float(np.mean(x)) if len(x) else 0.0
    return float(np.std(x)) / m if m > 0 else 0.0


def calibrate_cv(g: np.ndarray, target: float) -> np.ndarray:
    """``g ** a`` (after ``g / max(g)``) with ``a`` chosen so the sample CV equals ``target`` (to 1e-4 relative).

    ``x ** a`` keeps the order of the gaps and spreads them monotonically in ``a``, so bisection finds ``a``.
    """
    pos = g[g > 0]
    if len(pos) < 2 or np.all(pos == pos[0]):
        return g
    # Work on g / max(g) so powers stay in (0, 1] and never overflow.
    base = g / g.max()
    lo, hi = 1e-3, 1.0
    while sample_cv(base**hi) < target and hi < 1e3:
        hi *= 2
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        if sample_cv(base**mid) < target:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-9:
            break
    scaled: np.ndarray = base ** math.sqrt(lo * hi)
    return scaled


def lag1_autocorr(x: np.ndarray) -> float:
    """Pearson correlation of consecutive values (0 for a renewal process, > 0 for runs of short gaps)."""
    if len(x) < 3:
        return 0.0
    a, b = x[:-1], x[1:]
    sa, sb = float(np.std(a)), float(np.std(b))
    if sa == 0 or sb == 0:
        return 0.0
    return float(np.mean((a - a.mean()) * (b - b.mean())) / (sa * sb))


@dataclass(frozen=True, slots=True, kw_only=True)
class MMPP2:
    """Two-state MMPP: Poisson at ``rate_hi`` / ``rate_lo`` arrivals per second while the hidden state is high /
    low; the state stays high for Exp(``dwell_hi``) seconds, low for Exp(``dwell_lo``) seconds."""

    rate_hi: float
    rate_lo: float
    dwell_hi: float  # mean seconds in the high state
    dwell_lo: float  # mean seconds in the low state

    def __post_init__(self) -> None:
        if min(self.rate_hi, self.dwell_hi, self.dwell_lo) <= 0 or self.rate_lo < 0:
            raise ValueError(f"bad MMPP2 {self}")

    @property
    def high_share(self) -> float:
        """Long-run share of time in the high state."""
        return self.dwell_hi / (self.dwell_hi + self.dwell_lo)

    @property
    def mean_rate(self) -> float:
        p = self.high_share
        return p * self.rate_hi + (1 - p) * self.rate_lo

    def gap_moments(self) -> tuple[float, float]:
        """(E[X], E[X²]) of the stationary gap: X is phase-type with D0 = Q - Λ, started in the state an arrival
        leaves behind (π Λ / π λ); E[X^k] = k! α (-D0)^-k 1."""
        a, b = 1.0 / self.dwell_hi, 1.0 / self.dwell_lo
        lam = np.array([self.rate_hi, self.rate_lo])
        q = np.array([[-a, a], [b, -b]])
        pi = np.array([b, a]) / (a + b)
        alpha = pi * lam / float(pi @ lam)
        m = np.linalg.inv(np.diag(lam) - q)  # (-D0)^-1
        one = np.ones(2)
        m1 = float(alpha @ m @ one)
        m2 = 2.0 * float(alpha @ m @ m @ one)
        return m1, m2

    def cv(self) -> float:
        m1, m2 = self.gap_moments()
        return math.sqrt(max(m2 / (m1 * m1) - 1.0, 0.0))

    def limit_cv(self) -> float:
        """CV if the state never switched (the hyperexponential limit of slow switching): the supremum of
        :meth:`cv` over dwell scales with this burst ratio and high share."""
        p = self.high_share
        w_hi = p * self.rate_hi / self.mean_rate
        w_lo = 1.0 - w_hi
        if self.rate_lo == 0:
            return math.inf
        m1 = w_hi / self.rate_hi + w_lo / self.rate_lo
        m2 = 2.0 * (w_hi / self.rate_hi**2 + w_lo / self.rate_lo**2)
        return math.sqrt(m2 / (m1 * m1) - 1.0)

    def scaled(self, s: float) -> "MMPP2":
        """The same rates with both dwell times multiplied by ``s`` (same high share, burst ratio, mean rate)."""
        return MMPP2(rate_hi=self.rate_hi, rate_lo=self.rate_lo, dwell_hi=self.dwell_hi * s, dwell_lo=self.dwell_lo * s)


_RATIOS = (10.0, 30.0, 100.0, 300.0, 1000.0, 3000.0, 10000.0)


def mmpp_for_cv(cv: float, *, mean_gap: float = 1.0, high_share: float = 0.1, burst_ratio: float | None = None) -> MMPP2:
    """An MMPP2 with gap mean ``mean_gap`` and exact stationary CV ``cv`` (> 1: bursts make gaps more variable
    than Poisson's). ``burst_ratio`` = rate_hi / rate_lo; None picks the smallest of 10, 30, 100, ... whose
    hyperexponential limit is at least 1.25 x ``cv`` (so the dwell times stay finite and moderate).
    ``high_share`` is the share of *time* spent in the high state."""
    if cv <= 1.0:
        raise ValueError(f"an MMPP's gaps are at least as variable as Poisson's: cv must be > 1, got {cv}")
    if not 0 < high_share < 1 or mean_gap <= 0:
        raise ValueError("high_share must be in (0, 1) and mean_gap positive")

    def base(ratio: float) -> MMPP2:
        # Rates for a mean rate of 1 / mean_gap; dwell times are rescaled below.
        lo = (1.0 / mean_gap) / (high_share * ratio + 1 - high_share)
        return MMPP2(rate_hi=ratio * lo, rate_lo=lo, dwell_hi=high_share * mean_gap, dwell_lo=(1 - high_share) * mean_gap)

    if burst_ratio is None:
        for r in _RATIOS:
            if base(r).limit_cv() >= 1.25 * cv:
                burst_ratio = r
                break
        else:
            raise ValueError(f"cv {cv} is beyond a burst ratio of {_RATIOS[-1]:g}; pass burst_ratio")
    b = base(burst_ratio)
    if b.limit_cv() <= cv:
        raise ValueError(f"burst ratio {burst_ratio} reaches at most CV {b.limit_cv():.2f} < {cv}")
    lo, hi = 1e-6, 1.0
    while b.scaled(hi).cv() < cv:
        hi *= 4
    for _ in range(200):
        mid = math.sqrt(lo * hi)
        if b.scaled(mid).cv() < cv:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-10:
            break
    return b.scaled(math.sqrt(lo * hi))


def _sample_times(proc: MMPP2, rng: np.random.Generator, n: int) -> np.ndarray:
    """The first ``n`` arrival times of ``proc`` from a stationary start."""
    out: list[np.ndarray] = []
    got = 0
    t = 0.0
    high = bool(rng.random() < proc.high_share)
    # Segments per block: about enough for n arrivals, so a few blocks suffice whatever the dwell times.
    per_cycle = proc.rate_hi * proc.dwell_hi + proc.rate_lo * proc.dwell_lo
    block = int(min(max(2 * n / max(per_cycle, 1e-9), 64), 1 << 20))
    while got < n:
        states = (np.arange(block) + (0 if high else 1)) % 2 == 0  # alternate high, low, high, ...
        dwell = rng.exponential(1.0, block) * np.where(states, proc.dwell_hi, proc.dwell_lo)
        rate = np.where(states, proc.rate_hi, proc.rate_lo)
        counts = rng.poisson(rate * dwell)
        starts = t + np.concatenate(([0.0], np.cumsum(dwell)[:-1]))
        k = int(counts.sum())
        if k:
            seg = np.repeat(np.arange(block), counts)
            times = starts[seg] + rng.random(k) * dwell[seg]
            # Within a segment the uniform points must be sorted; segments are already in order.
            order = np.lexsort((times, seg))
            out.append(times[order])
            got += k
        t = float(starts[-1] + dwell[-1])
        high = not bool(states[-1])
    return np.concatenate(out)[:n]


def mmpp_gaps(rng: np.random.Generator, n: int, *, mean: float, cv: float, exact: bool = True,
              high_share: float = 0.1, burst_ratio: float | None = None) -> np.ndarray:
    """``n`` inter-arrival gaps of the MMPP2 that :func:`mmpp_for_cv` fits to ``cv``, scaled to mean ``mean``.

    ``exact``: calibrate the sample's CV to the target (a finite sample of a bursty process scatters widely:
    a run of 2,000 gaps holds only tens of bursts).
    """
    if n <= 0:
        return np.zeros(0)
    proc = mmpp_for_cv(cv, mean_gap=mean, high_share=high_share, burst_ratio=burst_ratio)
    times = _sample_times(proc, rng, n + 1)
    g = np.diff(times)
    if exact and n >= 2:
        g = calibrate_cv(g, cv)
    m = g.mean()
    return g * (mean / m) if m > 0 else np.full(n, mean)
