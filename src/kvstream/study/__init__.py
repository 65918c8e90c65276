"""Trace studies behind ``kvstream study``: cache-only replays of KV accesses and reuse-distance analysis.

The policies themselves live in :mod:`kvstream.eviction`; this package only turns a trace into accesses and
drives them. Nothing here does I/O except reading the trace.
"""

from kvstream.study.cache_replay import AccessStream, ReplayResult, build_accesses, replay, replay_many
from kvstream.study.reuse import (
    CorrelationWindow,
    WindowSpec,
    answer_distance_correlation,
    authors_windows,
    hourly_windows,
    weighted_reuse_distances,
)

__all__ = [
    "AccessStream",
    "ReplayResult",
    "build_accesses",
    "replay",
    "replay_many",
    "CorrelationWindow",
    "WindowSpec",
    "answer_distance_correlation",
    "authors_windows",
    "hourly_windows",
    "weighted_reuse_distances",
]
