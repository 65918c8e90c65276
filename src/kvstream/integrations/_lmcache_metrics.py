"""Prometheus metrics of the LMCache plugin, named the way LMCache names its own.

LMCache registers ``lmcache:<name>`` metrics in the default ``prometheus_client`` registry, labelled
``model_name``, ``worker_id``, ``role``, ``served_model_name``; counters are ``num_*`` (exported with
``_total``), latency histograms ``time_to_*`` in seconds. vLLM serves worker metrics through
``PROMETHEUS_MULTIPROC_DIR``, which only carries real Counter/Gauge/Histogram objects, so everything here
is one (no custom collector) and is updated as events happen.

Names (each also labelled ``tier`` = a kvstream tier name or ``memory`` for the store's host-memory tier,
or ``reason`` / ``path`` where shown):

==========================================  =======================================================
``lmcache:kvstream_num_hit_chunks``          chunks handed to LMCache, by the tier that served them
``lmcache:kvstream_num_read_bytes``          payload bytes of those chunks, by tier
``lmcache:kvstream_time_to_chunk``           seconds from a batch read's start to each chunk landing, by tier
``lmcache:kvstream_time_to_get``             seconds per batch read, ``path`` = sync | prefetch
``lmcache:kvstream_num_miss_chunks``         chunks asked for and not returned, by ``reason``
``lmcache:kvstream_num_stored_chunks``       puts accepted into the store (before replication)
``lmcache:kvstream_num_stored_bytes``        their payload bytes
``lmcache:kvstream_num_dropped_puts``        puts not stored, by ``reason``
``lmcache:kvstream_num_written_bytes``       bytes written to each tier (replicas included), by tier
``lmcache:kvstream_num_written_chunks``      chunk files written to each tier, by tier
``lmcache:kvstream_num_corrupt_chunks``      files that failed verification (quarantined), by tier
``lmcache:kvstream_num_read_errors``         I/O errors and vanished files on reads, by tier
``lmcache:kvstream_pending_puts``            LMCache buffers held by puts not yet in the store (gauge)
``lmcache:kvstream_prefetches_in_flight``    async prefetches started and not yet collected (gauge)
==========================================  =======================================================

Per-tier write and error figures come from ``Store.stats()`` differences (:meth:`PluginMetrics.sync_store`),
so their totals are exact even when several batches run at once. Metric objects are created once per process
and shared by every plugin instance (tests build several managers in one process).
"""

from __future__ import annotations

import threading
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

__all__ = ["PluginMetrics", "LABELS"]

LABELS = ["model_name", "worker_id", "role", "served_model_name"]

_CHUNK_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_GET_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

_lock = threading.Lock()
_metrics: dict[str, Any] = {}

# (attribute, kind, name, documentation, extra labels[, buckets])
_SPECS: list[tuple[Any, ...]] = [
    ("hit_chunks", Counter, "lmcache:kvstream_num_hit_chunks", "Chunks kvstream returned to LMCache, by tier", ["tier"]),
    ("read_bytes", Counter, "lmcache:kvstream_num_read_bytes", "Payload bytes kvstream returned to LMCache, by tier", ["tier"]),
    ("time_to_chunk", Histogram, "lmcache:kvstream_time_to_chunk",
     "Seconds from a kvstream batch read's start to each chunk landing, by tier", ["tier"], _CHUNK_BUCKETS),
    ("time_to_get", Histogram, "lmcache:kvstream_time_to_get", "Seconds per kvstream batch read", ["path"], _GET_BUCKETS),
    ("miss_chunks", Counter, "lmcache:kvstream_num_miss_chunks", "Chunks asked of kvstream and not returned", ["reason"]),
    ("stored_chunks", Counter, "lmcache:kvstream_num_stored_chunks", "Puts accepted by kvstream", []),
    ("stored_bytes", Counter, "lmcache:kvstream_num_stored_bytes", "Payload bytes of puts accepted by kvstream", []),
    ("dropped_puts", Counter, "lmcache:kvstream_num_dropped_puts", "Puts kvstream did not store", ["reason"]),
    ("written_bytes", Counter, "lmcache:kvstream_num_written_bytes", "Bytes kvstream wrote to each tier", ["tier"]),
    ("written_chunks", Counter, "lmcache:kvstream_num_written_chunks", "Chunk files kvstream wrote to each tier", ["tier"]),
    ("corrupt_chunks", Counter, "lmcache:kvstream_num_corrupt_chunks", "kvstream chunk files that failed verification", ["tier"]),
    ("read_errors", Counter, "lmcache:kvstream_num_read_errors", "kvstream read I/O errors and vanished files", ["tier"]),
    ("pending_puts", Gauge, "lmcache:kvstream_pending_puts", "LMCache buffers held by kvstream puts not yet stored", []),
    ("prefetches", Gauge, "lmcache:kvstream_prefetches_in_flight", "kvstream async prefetches not yet collected", []),
]

# Store.stats()["tiers"][name] field -> metric attribute
_TIER_STATS = {
    "write_bytes": "written_bytes",
    "write_chunks": "written_chunks",
    "corrupt_chunks": "corrupt_chunks",
    "read_errors": "read_errors",
    "missing_files": "read_errors",
}


def _existing(name: str) -> Any:
    """A collector already registered under ``name`` (a re-imported module), or None."""
    names = getattr(REGISTRY, "_names_to_collectors", {})
    return names.get(name) or names.get(name + "_total")


def _get_metrics() -> dict[str, Any]:
    with _lock:
        if _metrics:
            return _metrics
        for spec in _SPECS:
            attr, kind, name, doc, extra = spec[:5]
            metric = _existing(name)
            if metric is None:
                kw: dict[str, Any] = {"labelnames": LABELS + extra}
                if kind is Histogram:
                    kw["buckets"] = spec[5]
                if kind is Gauge:
                    kw["multiprocess_mode"] = "livesum"
                metric = kind(name, doc, **kw)
            _metrics[attr] = metric
        return _metrics


class PluginMetrics:
    """One plugin instance's view of the shared metrics (its LMCache labels bound). Thread-safe."""

    def __init__(self, *, model_name: str, worker_id: int, role: str | None, served_model_name: str | None) -> None:
        self._m = _get_metrics()
        self._labels = {"model_name": str(model_name), "worker_id": str(worker_id), "role": str(role),
                        "served_model_name": served_model_name or ""}
        self._last: dict[tuple[str, str], float] = {}
        self._children: dict[str, tuple[Any, Any, Any]] = {}
        self._sync_lock = threading.Lock()

    def _l(self, metric: str, **extra: str) -> Any:
        return self._m[metric].labels(**self._labels, **extra)

    def _tier_children(self, tier: str) -> tuple[Any, Any, Any]:
        """The three per-chunk series of a tier, looked up once (this runs for every chunk read)."""
        ch = self._children.get(tier)
        if ch is None:
            ch = (self._l("hit_chunks", tier=tier), self._l("read_bytes", tier=tier),
                  self._l("time_to_chunk", tier=tier))
            self._children[tier] = ch
        return ch

    # -- reads ----------------------------------------------------------------------------------------------
    def chunk_landed(self, tier: str, nbytes: int, seconds: float) -> None:
        hits, nbytes_c, latency = self._tier_children(tier)
        hits.inc()
        nbytes_c.inc(nbytes)
        latency.observe(seconds)

    def batch_done(self, path: str, seconds: float) -> None:
        self._l("time_to_get", path=path).observe(seconds)

    def missed(self, reason: str, n: int = 1) -> None:
        if n:
            self._l("miss_chunks", reason=reason).inc(n)

    # -- writes ---------------------------------------------------------------------------------------------
    def stored(self, nbytes: int) -> None:
        self._l("stored_chunks").inc()
        self._l("stored_bytes").inc(nbytes)

    def dropped(self, reason: str, n: int = 1) -> None:
        if n:
            self._l("dropped_puts", reason=reason).inc(n)

    def pending_delta(self, d: int) -> None:
        self._l("pending_puts").inc(d)

    def prefetch_delta(self, d: int) -> None:
        self._l("prefetches").inc(d)

    # -- store counters -------------------------------------------------------------------------------------
    def sync_store(self, stats: dict[str, Any]) -> None:
        """Add what the store's per-tier counters gained since the last call (they only grow)."""
        with self._sync_lock:
            for tier, fields in (stats.get("tiers") or {}).items():
                for field, attr in _TIER_STATS.items():
                    v = fields.get(field)
                    if not isinstance(v, (int, float)):
                        continue
                    k = (str(tier), field)
                    d = v - self._last.get(k, 0)
                    self._last[k] = v
                    if d > 0:
                        self._l(attr, tier=str(tier)).inc(d)
