"""Stand-in decision functions for the serving core's prefetch order.

Temporary: issue #3's ``kvstream.scheduling`` (FCFS, Bidaw ready/preparing + disk-HRRN, CachedAttention
look-ahead) will own these decisions; the core calls only :func:`pick_prefetch`, so swapping is one import.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["pick_prefetch", "hrrn_ratio"]


def hrrn_ratio(waiting_s: float, kv_bytes: int) -> float:
    """Bidaw's disk-HRRN response ratio: ``1 + waiting time / KV size`` (bytes; a tiny load goes first)."""
    return 1.0 + waiting_s / max(kv_bytes, 1)


def pick_prefetch(spec: str, preparing: Sequence[Any], fcfs: Sequence[Any], now: float) -> Any | None:
    """The next request to load in the background, or None.

    ``hrrn``: highest response ratio among the preparing requests (ties: earliest arrival).
    ``lookahead:W``: the first request among the first ``W`` of the arrival-order queue that is preparing.
    """
    kind, _, arg = spec.partition(":")
    if kind == "hrrn":
        best = None
        best_key = None
        for r in preparing:
            key = (hrrn_ratio(now - r.req.arrival, r.kv_bytes), -r.req.arrival)
            if best_key is None or key > best_key:
                best, best_key = r, key
        return best
    if kind == "lookahead":
        w = int(arg)
        for i, r in enumerate(fcfs):
            if i >= w:
                break
            if r.phase.value == "preparing":
                return r
        return None
    return None
