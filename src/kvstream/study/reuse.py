"""Weighted reuse distance of conversation KV, and its correlation with the previous answer's length.

Definitions follow the trace authors' analysis scripts (``weighted_reuse_distance.py`` and
``output_rd_relation_*.py`` in their repository), restated here so the numbers can be checked:

- A request of round ``r >= 1`` *reuses* its user's KV; its size is the user's history before the round,
  ``min(history_tokens, context_cap) * bytes_per_token`` (OPT: 2048 tokens x 800 KiB).
- Its **weighted reuse distance** is the sum, over the distinct other users with a request between this one and
  the same user's previous one, of the size of each such user's latest request (bytes). This is an LRU stack
  distance in bytes (:class:`~kvstream.eviction.ReuseDistanceTracker`).
- **Hourly windows** (Bidaw's 12 windows, 8:00 to 19:00; the trace starts at 7:00): the *cohort* is the users
  whose first round falls within one hour, thinned to a fraction (every user ``i`` of the sorted ids with
  ``i % 10 < 10 * fraction``); only the cohort's requests exist for the analysis; distances are measured inside a
  10-minute window that starts 20 (or 25, or 50) minutes into the hour, from each user's first request inside it.
- The **lower bound** for one previous-answer length is the smallest distance among the samples with that
  length, after dropping low outliers below ``Q1 - 1.5 IQR`` (quartiles by index, ``v[int(0.25 n)]``). The
  correlation is Spearman's rho between the lengths and their lower bounds (one point per distinct length).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from kvstream.eviction import ReuseDistanceTracker
from kvstream.workload.bidaw import BidawTrace

__all__ = [
    "weighted_reuse_distances",
    "WindowSpec",
    "CorrelationWindow",
    "authors_windows",
    "hourly_windows",
    "answer_distance_correlation",
    "lower_bounds",
    "AUTHORS_WINDOWS",
]

TRACE_START_CLOCK = 7  # hour of day at trace time 0 (their "8:00-9:00" window starts at 3600 s)


def weighted_reuse_distances(users: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted reuse distance of every access (NaN for a user's first), accesses in the order given.

    ``weights[i]`` is the size access ``i`` leaves as that user's latest (see the module docstring).
    """
    tracker = ReuseDistanceTracker(capacity=max(1024, 2 * int(users.shape[0])))
    out = np.full(users.shape[0], np.nan)
    visit = tracker.visit
    for i, (u, w) in enumerate(zip(users.tolist(), weights.tolist(), strict=True)):
        d = visit(u, w)
        if d is not None:
            out[i] = d
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowSpec:
    """One correlation window, in trace seconds."""

    label: str  # e.g. "8:00" (clock time of the cohort's hour)
    source: str  # file name of the trace part it reads (e.g. "total_traces_part1.txt")
    cohort_start: float  # users whose round 0 is in [cohort_start, cohort_start + 3600] form the cohort
    fraction: float  # share of the cohort kept (multiple of 0.1)
    window_start: float  # distances are measured in [window_start, window_start + window_len]
    window_len: float = 600.0


# The trace authors' 12 windows: (label, part, cohort hour offset, fraction, window offset into the hour, s).
AUTHORS_WINDOWS: tuple[tuple[str, int, int, float, int], ...] = (
    ("8:00", 1, 1, 0.3, 1200),
    ("9:00", 2, 2, 0.3, 3000),
    ("10:00", 2, 3, 0.5, 1200),
    ("11:00", 3, 4, 0.3, 1200),
    ("12:00", 3, 5, 0.3, 1500),
    ("13:00", 3, 6, 0.3, 1200),
    ("14:00", 4, 7, 0.4, 1200),
    ("15:00", 4, 8, 0.5, 1200),
    ("16:00", 5, 9, 0.5, 1500),
    ("17:00", 5, 10, 0.3, 1200),
    ("18:00", 5, 11, 0.3, 1500),
    ("19:00", 6, 12, 0.3, 1200),
)


def _part_name(part: int) -> str:
    return f"total_traces_part{part}.txt"


def authors_windows(trace: BidawTrace) -> tuple[list[WindowSpec], list[str]]:
    """The authors' windows whose trace part is loaded, and the labels of those that are not."""
    names = {_basename(s) for s in trace.sources}
    have: list[WindowSpec] = []
    missing: list[str] = []
    for label, part, hour, frac, offset in AUTHORS_WINDOWS:
        if _part_name(part) in names:
            have.append(WindowSpec(label=label, source=_part_name(part), cohort_start=3600.0 * hour, fraction=frac,
                                   window_start=3600.0 * hour + offset))  # fmt: skip
        else:
            missing.append(f"{label} ({_part_name(part)})")
    return have, missing


def hourly_windows(
    trace: BidawTrace, *, fraction: float = 0.3, offset: float = 1200.0, min_cohort: int = 500
) -> list[WindowSpec]:
    """The authors' recipe applied to every hour in which at least ``min_cohort`` users of a part start (the parts
    are split by user, each holding the users who start within a few given hours, so other hours have no cohort)."""
    out: list[WindowSpec] = []
    for idx, src in enumerate(trace.sources):
        first = (trace.part == idx) & (trace.round_index == 0)
        hours, counts = np.unique((trace.time[first] // 3600).astype(np.int64), return_counts=True)
        for h, c in zip(hours.tolist(), counts.tolist(), strict=True):
            if c >= min_cohort:
                out.append(WindowSpec(label=f"{(TRACE_START_CLOCK + h) % 24}:00", source=_basename(src),
                                      cohort_start=3600.0 * h, fraction=fraction, window_start=3600.0 * h + offset))  # fmt: skip
    return out


def _basename(path: str) -> str:
    return path.replace("\\", "/").rsplit("/", 1)[-1]


@dataclass(frozen=True, slots=True, kw_only=True)
class CorrelationWindow:
    """Result of one window."""

    spec: WindowSpec
    samples: int  # (previous answer length, distance) pairs measured
    points: int  # distinct answer lengths (points of the correlation)
    rho: float  # Spearman's rho of answer length vs distance lower bound; NaN with < 3 points
    pvalue: float
    answer_lengths: np.ndarray  # the points' x (tokens)
    lower_bounds: np.ndarray  # the points' y (bytes)
    sample_rho: float  # Spearman's rho over all samples, not lower bounds (for contrast)


def lower_bounds(answers: np.ndarray, distances: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per distinct answer length: the smallest distance after dropping values below ``Q1 - 1.5 IQR``."""
    groups: defaultdict[int, list[float]] = defaultdict(list)
    for a, d in zip(answers.tolist(), distances.tolist(), strict=True):
        groups[a].append(d)
    xs, ys = [], []
    for a in sorted(groups):
        v = sorted(groups[a])
        n = len(v)
        q1, q3 = v[int(n * 0.25)], v[int(n * 0.75)]
        lb = q1 - 1.5 * (q3 - q1)
        kept = [x for x in v if x >= lb]
        xs.append(a)
        ys.append(min(kept))
    return np.asarray(xs, dtype=np.int64), np.asarray(ys, dtype=np.float64)


def answer_distance_correlation(
    trace: BidawTrace, spec: WindowSpec, *, bytes_per_token: int, context_cap: int | None = 2048
) -> CorrelationWindow:
    """Measure one window (see the module docstring); ``trace`` must contain ``spec.source``."""
    from scipy.stats import spearmanr  # scipy is needed by the studies only

    try:
        part = [_basename(s) for s in trace.sources].index(spec.source)
    except ValueError:
        raise ValueError(f"window {spec.label}: trace part {spec.source} is not loaded") from None
    rows = trace.part == part
    first_round = rows & (trace.round_index == 0)
    t0 = trace.time[first_round]
    cohort = np.unique(trace.user[first_round][(t0 >= spec.cohort_start) & (t0 <= spec.cohort_start + 3600.0)])
    keep_per_10 = round(10 * spec.fraction)
    cohort = cohort[np.arange(cohort.shape[0]) % 10 < keep_per_10]
    sel = rows & np.isin(trace.user, cohort)
    sel &= (trace.time >= spec.window_start) & (trace.time <= spec.window_start + spec.window_len)
    hist = trace.history_tokens[sel]
    if context_cap is not None:
        hist = np.minimum(hist, context_cap)
    dist = weighted_reuse_distances(trace.user[sel], hist * bytes_per_token)
    answers = trace.prev_response[sel]
    ok = ~np.isnan(dist)
    answers, dist = answers[ok], dist[ok]
    xs, ys = lower_bounds(answers, dist)
    if xs.size >= 3 and np.ptp(ys) > 0:
        res = spearmanr(xs, ys)
        rho, p = float(res.statistic), float(res.pvalue)
    else:
        rho = p = float("nan")
    ok_samples = answers.size >= 3 and np.ptp(answers) > 0 and np.ptp(dist) > 0
    sample_rho = float(spearmanr(answers, dist).statistic) if ok_samples else float("nan")
    return CorrelationWindow(spec=spec, samples=int(answers.size), points=int(xs.size), rho=rho, pvalue=p,
                             answer_lengths=xs, lower_bounds=ys, sample_rho=sample_rho)  # fmt: skip
