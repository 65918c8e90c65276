"""Prometheus metrics for operators, read from :meth:`Store.stats` at scrape time.

A custom collector, not counters updated on the hot path: the store already keeps its own counts, so a
scrape costs one ``stats()`` call and the read loop pays nothing. Names are ``kvstream_*`` (snake case,
counters exported with ``_total``); per-tier series carry a ``tier`` label. This is for the Python API; under
LMCache the plugin exports its own ``lmcache:kvstream_*`` series instead
(:mod:`kvstream.integrations._lmcache_metrics`), because vLLM's worker processes reach ``/metrics`` only
through ``PROMETHEUS_MULTIPROC_DIR``, which carries Counter/Gauge/Histogram objects and no custom collector.

    from prometheus_client import REGISTRY, start_http_server
    kvstream.metrics.register(store)          # once per store
    start_http_server(9400)                   # or LMCache's own metrics endpoint, which serves REGISTRY
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, CollectorRegistry

from kvstream.stats import StoreStats

__all__ = ["StoreCollector", "register"]

_PREFIX = "kvstream_"

# TierStats field -> (metric suffix, help, kind)
_TIER_SERIES = {
    "read_bytes": ("tier_read_bytes", "Bytes read from the tier (verified, duplicates included)", "counter"),
    "read_chunks": ("tier_read_chunks", "Chunks read from the tier", "counter"),
    "read_busy_s": ("tier_read_busy_seconds", "Seconds the tier had reads in flight", "counter"),
    "duplicate_chunks": ("tier_duplicate_chunks", "Chunks read from the tier after another tier had delivered them", "counter"),
    "read_errors": ("tier_read_errors", "Reads that failed with an I/O error", "counter"),
    "corrupt_chunks": ("tier_corrupt_chunks", "Chunks that failed verification twice (read and re-read) and were "
                       "quarantined", "counter"),
    "read_retried": ("tier_read_retried", "Reads that failed verification and were read again", "counter"),
    "read_transient": ("tier_read_transient", "Reads that failed verification and read back intact (kept)", "counter"),
    "write_refused_pinned": ("tier_write_refused_pinned", "Copies refused: only evicting pinned chunks would make "
                             "room (retryable)", "counter"),
    "pinned_chunks": ("tier_pinned_chunks", "Chunks pinned on the tier (never evicted while pinned)", "gauge"),
    "publish_conflicts": ("tier_publish_conflicts", "Links that won although another writer's file held the name "
                          "(two links won: GlusterFS); resolved to one file", "counter"),
    "orphans_listed": ("tier_orphans_listed", "Published chunks a killed writer never logged, listed at open from "
                       "its temporary", "counter"),
    "index_damaged_records": ("tier_index_damaged_records", "Index log records skipped as damaged at open or refresh",
                              "counter"),
    "missing_files": ("tier_missing_files", "Indexed chunks whose file was gone", "counter"),
    "write_bytes": ("tier_write_bytes", "Bytes written to the tier", "counter"),
    "write_busy_s": ("tier_write_busy_seconds", "Seconds the tier had copies handed to its writer and not finished",
                     "counter"),
    "write_chunks": ("tier_write_chunks", "Chunks published on the tier", "counter"),
    "write_errors": ("tier_write_errors", "Writes that failed", "counter"),
    "write_skipped_full": ("tier_write_skipped_full", "Copies skipped because the tier was full", "counter"),
    "write_skipped_unhealthy": ("tier_write_skipped_unhealthy", "Copies skipped because the tier's circuit was open", "counter"),
    "write_skipped_backlog": ("tier_write_skipped_backlog", "Second copies skipped because the tier's write backlog was full", "counter"),
    "evicted_chunks": ("tier_evicted_chunks", "Chunks evicted to stay within capacity", "counter"),
    "evicted_bytes": ("tier_evicted_bytes", "Bytes of chunk files evicted to stay within capacity", "counter"),
    "chunks": ("tier_chunks", "Chunks the tier holds", "gauge"),
    "used_bytes": ("tier_used_bytes", "Bytes of chunk files on the tier", "gauge"),
    "capacity_bytes": ("tier_capacity_bytes", "Configured capacity of the tier", "gauge"),
    "read_latency_p50_s": ("tier_read_latency_p50_seconds", "Median per-chunk read latency (recent reads)", "gauge"),
    "read_latency_p99_s": ("tier_read_latency_p99_seconds", "P99 per-chunk read latency (recent reads)", "gauge"),
    "write_latency_p50_s": ("tier_write_latency_p50_seconds",
                            "Median per-chunk write latency, hand-over to publish (recent writes)", "gauge"),
    "write_latency_p99_s": ("tier_write_latency_p99_seconds",
                            "P99 per-chunk write latency, hand-over to publish (recent writes)", "gauge"),
    "read_window_bytes": ("tier_read_window_bytes", "Bytes of reads the tier may have in flight in a step (read_windows)", "gauge"),
    "write_backlog_bytes": ("tier_write_backlog_bytes", "Bytes of the tier's writes submitted and not finished", "gauge"),
    "replicas_owed": ("tier_replicas_owed", "Copies the replication policy wants on the tier that are not written yet "
                      "(skipped at a backlog, an open breaker or an I/O error; the catch-up writes them)", "gauge"),
}
# StoreStats field -> (metric suffix, help, kind)
_STORE_SERIES = {
    "puts": ("puts", "Chunks put", "counter"),
    "put_bytes": ("put_bytes", "Payload bytes put", "counter"),
    "puts_dropped_no_memory": ("puts_dropped_no_memory", "Puts dropped because host memory was all unwritten", "counter"),
    "puts_dropped_unstored": ("puts_dropped_unstored",
                              "Puts refused because half of host memory held puts no tier could take", "counter"),
    "unstored_chunks": ("unstored_chunks", "Acknowledged puts with no copy on any tier (kept in host memory until "
                        "one lands)", "gauge"),
    "unstored_bytes": ("unstored_bytes", "Chunk-file bytes of acknowledged puts with no copy on any tier", "gauge"),
    "memory_hits": ("memory_hits", "Chunks served from host memory", "counter"),
    "disk_hits": ("disk_hits", "Chunks served from a disk tier", "counter"),
    "misses": ("misses", "Chunks asked for and not found (or lost to errors)", "counter"),
    "lost_chunks": ("lost_chunks", "Chunks every holder failed to deliver", "counter"),
    "read_steps": ("read_steps", "Multi-tier read calls", "counter"),
    "read_seconds": ("read_seconds", "Seconds spent in read calls", "counter"),
    "verify_seconds": ("verify_seconds", "Seconds spent verifying payload checksums", "counter"),
    "hedged_reads": ("hedged_reads", "Reads re-issued on another tier after a deadline", "counter"),
    "stalled_reads": ("stalled_reads", "Reads still in flight past the hedge deadline when the next step began", "counter"),
    "write_amplification": ("write_amplification", "Bytes written to all tiers / bytes put", "gauge"),
    "catch_up_copies": ("catch_up_copies", "Owed replicas the catch-up started writing", "counter"),
    "catch_up_reads": ("catch_up_reads", "Owed replicas read back from another tier before their copy", "counter"),
    "catch_up_reads_deferred": ("catch_up_reads_deferred",
                                "Catch-up read-backs put off because a serving read step was in flight", "counter"),
    "catch_up_reads_waited": ("catch_up_reads_waited",
                              "Catch-up read-backs put off: host memory had no room to keep them, or backing off",
                              "counter"),
    "catch_up_reads_wasted": ("catch_up_reads_wasted", "Catch-up read-backs host memory did not keep", "counter"),
    "catch_up_gave_up": ("catch_up_gave_up", "Owed copies no longer read back in this process (each read back "
                         "max_read_backs times without being kept)", "counter"),
}

# MemoryStats field -> (metric suffix, help, kind)
_MEMORY_SERIES = {
    "used_bytes": ("memory_used_bytes", "Host-memory tier bytes held", "gauge"),
    "capacity_bytes": ("memory_capacity_bytes", "Configured size of the host-memory tier", "gauge"),
    "chunks": ("memory_chunks", "Chunks the host-memory tier holds", "gauge"),
    "evictions": ("memory_evictions", "Chunks evicted from the host-memory tier", "counter"),
    "overflow_buffers": ("memory_overflow_buffers", "Reads that landed outside the host-memory tier (it had no room)",
                         "counter"),
    "overflow_kept_bytes": ("memory_overflow_kept_bytes",
                            "Host memory kept in spare buffers for such reads (at most read_overflow_bytes)", "gauge"),
}


class _HasStats(Protocol):
    def stats(self) -> StoreStats: ...


def _family(kind: str, name: str, doc: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(_PREFIX + name, doc, labels=labels)


def _value(v: object) -> float:
    """A figure as a sample value: None (no reading yet, e.g. a latency before the first read) is NaN."""
    return float(v) if isinstance(v, (int, float)) else float("nan")


class StoreCollector:
    """Collects one store's ``stats()`` into metric families; ``labels`` are added to every series."""

    def __init__(self, store: _HasStats, labels: dict[str, str] | None = None) -> None:
        self.store = store
        self.labels = dict(labels or {})

    def describe(self) -> list[Metric]:
        return []  # generated at collect time; no fixed description needed

    def collect(self) -> Iterator[Metric]:
        if getattr(self.store, "_closed", False):
            return
        st = self.store.stats()
        lk = list(self.labels)
        lv = list(self.labels.values())
        for key, (name, doc, kind) in _STORE_SERIES.items():
            fam = _family(kind, name, doc, lk)
            fam.add_metric(lv, _value(getattr(st, key)))
            yield fam
        for key, (name, doc, kind) in _MEMORY_SERIES.items():
            fam = _family(kind, name, doc, lk)
            fam.add_metric(lv, _value(getattr(st.memory, key)))
            yield fam
        for key, (name, doc, kind) in _TIER_SERIES.items():
            fam = _family(kind, name, doc, lk + ["tier"])
            for tier, t in st.tiers.items():
                fam.add_metric(lv + [tier], _value(getattr(t, key)))
            yield fam
        circuit = GaugeMetricFamily(_PREFIX + "tier_circuit_open", "1 while the tier's circuit breaker is open",
                                    labels=lk + ["tier"])
        for tier, t in st.tiers.items():
            circuit.add_metric(lv + [tier], 1.0 if t.circuit == "open" else 0.0)
        yield circuit
        down = GaugeMetricFamily(_PREFIX + "tier_down", "1 while the tier could not be opened (the store runs "
                                 "without it; see the log for why)", labels=lk + ["tier"])
        for tier, t in st.tiers.items():
            down.add_metric(lv + [tier], 1.0 if t.down else 0.0)
        yield down


def register(store: _HasStats, *, registry: CollectorRegistry = REGISTRY, labels: dict[str, str] | None = None
             ) -> StoreCollector:
    """Register a collector for ``store``; returns it (``registry.unregister(c)`` to remove)."""
    c = StoreCollector(store, labels)
    registry.register(c)
    return c
