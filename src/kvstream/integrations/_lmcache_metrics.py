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
``lmcache:kvstream_num_declined_chunks``     held chunks a lookup reported as misses: recomputing them was
                                             cheaper than loading them (``kvstream.recompute_model``)
``lmcache:kvstream_num_stored_chunks``       puts accepted into the store (before replication)
``lmcache:kvstream_num_stored_bytes``        their payload bytes
``lmcache:kvstream_num_dropped_puts``        puts not stored, by ``reason``
``lmcache:kvstream_num_written_bytes``       bytes written to each tier (replicas included), by tier
``lmcache:kvstream_num_written_chunks``      chunk files written to each tier, by tier
``lmcache:kvstream_num_corrupt_chunks``      files that failed verification twice (quarantined), by tier
``lmcache:kvstream_num_read_errors``         I/O errors and vanished files on reads, by tier
``lmcache:kvstream_pending_puts``            LMCache buffers held by puts not yet in the store (gauge)
``lmcache:kvstream_prefetches_in_flight``    async prefetches started and not yet collected (gauge)
``lmcache:kvstream_time_to_put``             seconds per put into the store (copy into host memory, checksum)
``lmcache:kvstream_capacity_bytes``          configured capacity, by tier (gauge)
``lmcache:kvstream_used_bytes``              bytes held, by tier (gauge)
``lmcache:kvstream_chunks``                  chunks held, by tier (gauge)
``lmcache:kvstream_tier_circuit_open``       1 while the tier's circuit breaker is open, by tier (gauge)
``lmcache:kvstream_tier_down``               1 while the tier could not be opened: kvstream runs without it (gauge)
``lmcache:kvstream_num_transient_read_faults`` reads that failed verification and read back intact (file kept)
``lmcache:kvstream_num_refused_pinned``      copies refused: only evicting pinned chunks would make room, by tier
``lmcache:kvstream_tier_replicas_owed``      copies owed to the tier, not written yet, by tier (gauge)
``lmcache:kvstream_num_evicted_chunks``      chunks evicted to stay within capacity, by tier
``lmcache:kvstream_num_evicted_bytes``       their bytes, by disk tier
``lmcache:kvstream_num_write_errors``        copies that failed to write, by tier
``lmcache:kvstream_num_skipped_copies``      copies not written, by tier and ``reason`` = full | unhealthy | backlog
``lmcache:kvstream_time_to_write``           seconds per chunk copy, hand-over to the tier's writer to publish, by tier
==========================================  =======================================================

Write latencies are observed as each copy is published (``Store.observe_writes``, on the store's publisher
thread: :meth:`PluginMetrics.chunk_written`). Per-tier write, eviction and error figures and the capacity
gauges come from ``Store.stats()``
(:meth:`PluginMetrics.sync_store`: when the plugin starts, once a second on its writer thread, and at close):
counters take the differences, so their totals are exact even when several batches run at once, and exist at 0
from the first call. Metric objects are created once per process and shared by every plugin instance (tests
build several managers in one process).

Gauges in prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``), where processes that report the
same labels are merged: the in-flight counts are summed; the capacity and usage gauges keep the largest value
(one folder seen by two processes is not twice the bytes). Every TP worker opens the same tier folders and
reports them under its own ``worker_id``, so dashboards take ``max by (tier)`` over workers, not the sum.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prometheus_client import REGISTRY, Counter, Gauge, Histogram

from kvstream.stats import MemoryStats, StoreStats, TierStats

__all__ = ["PluginMetrics", "TimedPuts", "LABELS", "MEMORY_TIER"]

LABELS = ["model_name", "worker_id", "role", "served_model_name"]

_CHUNK_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
_GET_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
# A put copies and checksums one chunk in host memory: ~0.1 ms for 1 MiB, tens of ms for 48 MiB.
_PUT_BUCKETS = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0]
# A copy's write: from ~1 ms (small chunk, idle NVMe) to seconds (48 MiB behind a backlog on a busy PFS).
_WRITE_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]

MEMORY_TIER = "memory"  # the ``tier`` label of the store's host-memory tier

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
    ("declined_chunks", Counter, "lmcache:kvstream_num_declined_chunks",
     "Held chunks a kvstream lookup reported as misses because recomputing them is cheaper than loading them", []),
    ("stored_chunks", Counter, "lmcache:kvstream_num_stored_chunks", "Puts accepted by kvstream", []),
    ("stored_bytes", Counter, "lmcache:kvstream_num_stored_bytes", "Payload bytes of puts accepted by kvstream", []),
    ("dropped_puts", Counter, "lmcache:kvstream_num_dropped_puts", "Puts kvstream did not store", ["reason"]),
    ("written_bytes", Counter, "lmcache:kvstream_num_written_bytes", "Bytes kvstream wrote to each tier", ["tier"]),
    ("written_chunks", Counter, "lmcache:kvstream_num_written_chunks", "Chunk files kvstream wrote to each tier", ["tier"]),
    ("corrupt_chunks", Counter, "lmcache:kvstream_num_corrupt_chunks", "kvstream chunk files that failed verification", ["tier"]),
    ("read_errors", Counter, "lmcache:kvstream_num_read_errors", "kvstream read I/O errors and vanished files", ["tier"]),
    ("pending_puts", Gauge, "lmcache:kvstream_pending_puts", "LMCache buffers held by kvstream puts not yet stored", [],
     "livesum"),
    ("prefetches", Gauge, "lmcache:kvstream_prefetches_in_flight", "kvstream async prefetches not yet collected", [],
     "livesum"),
    ("time_to_put", Histogram, "lmcache:kvstream_time_to_put",
     "Seconds per put into kvstream (copy into host memory and checksum; disk writes follow later)", [], _PUT_BUCKETS),
    ("capacity_bytes", Gauge, "lmcache:kvstream_capacity_bytes", "Configured capacity of each kvstream tier", ["tier"],
     "livemax"),
    ("used_bytes", Gauge, "lmcache:kvstream_used_bytes", "Bytes each kvstream tier holds", ["tier"], "livemax"),
    ("chunks", Gauge, "lmcache:kvstream_chunks", "Chunks each kvstream tier holds", ["tier"], "livemax"),
    ("circuit_open", Gauge, "lmcache:kvstream_tier_circuit_open", "1 while the kvstream tier's circuit breaker is open",
     ["tier"], "livemax"),
    ("tier_down", Gauge, "lmcache:kvstream_tier_down",
     "1 while the kvstream tier could not be opened (kvstream runs without it; the log says why)", ["tier"], "livemax"),
    ("read_transient", Counter, "lmcache:kvstream_num_transient_read_faults",
     "kvstream reads that failed verification and read back intact (the file kept), by tier", ["tier"]),
    ("refused_pinned", Counter, "lmcache:kvstream_num_refused_pinned",
     "kvstream copies refused because only evicting pinned chunks would have made room (retryable)", ["tier"]),
    ("replicas_owed", Gauge, "lmcache:kvstream_tier_replicas_owed",
     "Copies kvstream's replication policy wants on the tier that are not written yet (the catch-up writes them)",
     ["tier"], "livemax"),
    ("evicted_chunks", Counter, "lmcache:kvstream_num_evicted_chunks",
     "Chunks kvstream evicted to stay within each tier's capacity", ["tier"]),
    ("evicted_bytes", Counter, "lmcache:kvstream_num_evicted_bytes", "Bytes kvstream evicted from each disk tier",
     ["tier"]),
    ("write_errors", Counter, "lmcache:kvstream_num_write_errors", "kvstream copies that failed to write", ["tier"]),
    ("skipped_copies", Counter, "lmcache:kvstream_num_skipped_copies",
     "kvstream copies not written: the tier was full, its circuit open, or its write backlog full", ["tier", "reason"]),
    ("time_to_write", Histogram, "lmcache:kvstream_time_to_write",
     "Seconds per kvstream chunk copy, from hand-over to the tier's writer to publish, by tier", ["tier"],
     _WRITE_BUCKETS),
]

# TierStats counter field -> (metric attribute, extra labels besides ``tier``)
_TIER_STATS: dict[str, tuple[str, dict[str, str]]] = {
    "write_bytes": ("written_bytes", {}),
    "write_chunks": ("written_chunks", {}),
    "corrupt_chunks": ("corrupt_chunks", {}),
    "read_transient": ("read_transient", {}),
    "write_refused_pinned": ("refused_pinned", {}),
    "read_errors": ("read_errors", {}),
    "missing_files": ("read_errors", {}),
    "evicted_chunks": ("evicted_chunks", {}),
    "evicted_bytes": ("evicted_bytes", {}),
    "write_errors": ("write_errors", {}),
    "write_skipped_full": ("skipped_copies", {"reason": "full"}),
    "write_skipped_unhealthy": ("skipped_copies", {"reason": "unhealthy"}),
    "write_skipped_backlog": ("skipped_copies", {"reason": "backlog"}),
}
# MemoryStats counter field -> metric attribute (labelled tier="memory")
_MEMORY_STATS = {"evictions": "evicted_chunks"}
# gauge attribute -> the stats field it shows, for disk tiers and the host-memory tier alike
_GAUGE_STATS = {"capacity_bytes": "capacity_bytes", "used_bytes": "used_bytes", "chunks": "chunks"}


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
                    kw["multiprocess_mode"] = spec[5]
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
        self._write_children: dict[str, Any] = {}
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

    def declined(self, n: int) -> None:
        """A lookup left ``n`` held chunks to the GPU (reported a shorter hit)."""
        if n:
            self._l("declined_chunks").inc(n)

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

    def put_done(self, seconds: float) -> None:
        self._l("time_to_put").observe(seconds)

    def chunk_written(self, tier: str, seconds: float) -> None:
        """A copy was published on ``tier`` (``Store.observe_writes``' listener, on the publisher thread)."""
        child = self._write_children.get(tier)
        if child is None:
            child = self._write_children[tier] = self._l("time_to_write", tier=tier)
        child.observe(seconds)

    # -- store counters -------------------------------------------------------------------------------------
    def sync_store(self, stats: StoreStats) -> None:
        """Publish ``Store.stats()``: set the per-tier gauges, and add what the store's counters (which only
        grow) gained since the last call."""
        with self._sync_lock:
            for name, t in stats.tiers.items():
                tier = str(name)
                for field, (attr, extra) in _TIER_STATS.items():
                    self._add(attr, (tier, field), getattr(t, field), tier=tier, **extra)
                self._set_gauges(tier, t)
                self._l("circuit_open", tier=tier).set(1.0 if t.circuit == "open" else 0.0)
                self._l("tier_down", tier=tier).set(1.0 if t.down else 0.0)
                self._l("replicas_owed", tier=tier).set(float(t.replicas_owed))
                self._write_children.setdefault(tier, self._l("time_to_write", tier=tier))  # exists from the start
            for field, attr in _MEMORY_STATS.items():
                self._add(attr, (MEMORY_TIER, field), getattr(stats.memory, field), tier=MEMORY_TIER)
            self._set_gauges(MEMORY_TIER, stats.memory)

    def _add(self, attr: str, key: tuple[str, str], value: int | float, **labels: str) -> None:
        """Increment ``attr`` by what the counter ``key`` gained since the last call. The series exists from
        the first call on, at 0 if nothing happened yet: ``rate()`` and alerts see 0, not an absent series."""
        d = value - self._last.get(key, 0)
        self._last[key] = value
        child = self._l(attr, **labels)
        if d > 0:
            child.inc(d)

    def _set_gauges(self, tier: str, fields: TierStats | MemoryStats) -> None:
        for attr, field in _GAUGE_STATS.items():
            self._l(attr, tier=tier).set(getattr(fields, field))


class TimedPuts:
    """The store as the plugin's write queue sees it: each ``put`` is timed into
    ``lmcache:kvstream_time_to_put``; everything else is the store's own attribute.

    Why a wrapper: the put (a copy into host memory plus a checksum, on the writer thread) is what a backed-up
    write queue waits for, and timing it here keeps the queue free of metrics code."""

    def __init__(self, store: Any, metrics: PluginMetrics) -> None:
        self._store = store
        self._metrics = metrics

    def put(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self._store.put(*args, **kwargs)
        finally:
            self._metrics.put_done(time.perf_counter() - t0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
