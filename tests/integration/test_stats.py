"""Store.stats() is a typed, frozen StoreStats whose JSON form keeps the keys of the old dict; each tier's
write latency is timed from hand-over to publish, reported as p50/p99 and to an observer."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest

import kvstream
from kvstream.stats import MemoryStats, StoreStats, TierStats, percentiles

# The keys Store.stats() returned as a dict before it was typed: JSON output (--json, replay records, bench
# results) must keep every one of them.
OLD_TOP = {"io_engine", "router", "replication", "puts", "put_bytes", "put_file_bytes", "puts_duplicate",
           "puts_dropped_no_memory", "get_chunks", "memory_hits", "disk_hits", "misses", "lost_chunks", "read_steps",
           "read_seconds", "verify_seconds", "hedged_reads", "copies_ordered", "flushes", "stalled_reads",
           "read_into_direct", "read_into_copied", "read_into_abandoned", "write_amplification", "catch_up_copies",
           "catch_up_reads", "memory", "tiers"}
OLD_MEMORY = {"capacity_bytes", "used_bytes", "chunks", "hits", "evictions", "overflow_buffers", "buffer_allocations",
              "buffer_reuses"}
OLD_TIER = {"path", "direct_io", "chunks", "used_bytes", "capacity_bytes", "read_bytes", "read_chunks", "read_busy_s",
            "read_window_bytes", "read_gbps_estimate", "read_gbps", "duplicate_chunks", "read_errors",
            "corrupt_chunks", "missing_files", "write_bytes", "write_chunks", "write_errors", "write_skipped_full",
            "write_skipped_unhealthy", "write_skipped_backlog", "write_backlog_bytes", "already_present",
            "write_retried_nospace", "evicted_chunks", "evicted_bytes", "read_latency_p50_s", "read_latency_p99_s",
            "circuit", "circuit_opened", "index_load_s", "removed_temporaries", "replicas_owed"}


def _cfg(root: Path) -> dict:
    return {"tiers": [{"name": "local", "path": str(root / "l"), "capacity_bytes": "64MiB"},
                      {"name": "shared", "path": str(root / "s"), "capacity_bytes": "64MiB"}],
            "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads"}


def test_stats_are_typed_frozen_and_keep_their_json_keys(disk_tmp: Path) -> None:
    with kvstream.open_store(_cfg(disk_tmp)) as s:
        st0 = s.stats()
        for i in range(6):
            assert s.put(bytes([i]) * 16, bytes([i]) * 10000)
        s.flush()
        assert s.drain(10)
        s.evict_memory()
        assert all(p is not None for p in s.get_many([bytes([i]) * 16 for i in range(6)]))
        st = s.stats()
    assert isinstance(st, StoreStats) and isinstance(st.memory, MemoryStats)
    assert list(st.tiers) == ["local", "shared"] and all(isinstance(t, TierStats) for t in st.tiers.values())
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.puts = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        st.tiers["other"] = st.tiers["local"]  # type: ignore[index]
    assert st.puts == 6 and st.disk_hits == 6 and st.write_amplification == pytest.approx(2.0)
    assert st.tiers["local"].write_chunks == st.tiers["shared"].write_chunks == 6
    # a snapshot: what happened after it is not in it
    assert st0.puts == 0 and st0.tiers["local"].write_chunks == 0

    d = st.as_dict()
    assert OLD_TOP <= d.keys() and OLD_MEMORY <= d["memory"].keys()
    for t in d["tiers"].values():
        assert OLD_TIER <= t.keys()
        assert {"write_latency_p50_s", "write_latency_p99_s"} <= t.keys()
    assert json.loads(json.dumps(d)) == d  # plain JSON all the way down
    assert d["tiers"]["local"]["write_chunks"] == 6 and d["memory"]["capacity_bytes"] == 8 << 20


def test_write_latency_per_tier_from_hand_over_to_publish(disk_tmp: Path) -> None:
    seen: list[tuple[str, float, str]] = []
    with kvstream.open_store(_cfg(disk_tmp)) as s:
        st = s.stats()
        assert st.tiers["local"].write_latency_p50_s is None and st.tiers["local"].write_latency_p99_s is None
        s.observe_writes(lambda tier, sec: seen.append((tier, sec, threading.current_thread().name)))
        for i in range(8):
            s.put(bytes([i + 1]) * 16, bytes([i]) * 20000)
        s.flush()
        assert s.drain(10)
        st = s.stats()
        s.observe_writes(None)
        s.put(b"z" * 16, b"z" * 100)
        s.flush()
        assert s.drain(10)
    assert len(seen) == 16  # one per published copy: 8 chunks x 2 tiers; none after the listener was removed
    assert {t for t, _, _ in seen} == {"local", "shared"}
    assert all(name.startswith("kvs-publish") for _, _, name in seen)  # on the publisher thread
    for name in ("local", "shared"):
        t = st.tiers[name]
        lat = sorted(sec for tier, sec, _ in seen if tier == name)
        assert t.write_latency_p50_s is not None and t.write_latency_p99_s is not None
        assert 0 < t.write_latency_p50_s <= t.write_latency_p99_s < 10
        assert (t.write_latency_p50_s, t.write_latency_p99_s) == percentiles(lat)


def test_write_busy_time_covers_each_tiers_unfinished_copies(disk_tmp: Path) -> None:
    # Busy from the first copy handed to a tier's writer until its last one is finished, summed over idle gaps:
    # positive, never more than the time the writes took, and the bytes over it give write_gbps.
    import time

    with kvstream.open_store(_cfg(disk_tmp)) as s:
        assert s.stats().tiers["local"].write_busy_s == 0.0 and s.stats().tiers["local"].write_gbps == 0.0
        t0 = time.perf_counter()
        for i in range(8):
            s.put(bytes([i + 1]) * 16, bytes([i]) * 200000)
        s.flush()
        assert s.drain(10)
        first = time.perf_counter() - t0
        mid = s.stats()
        time.sleep(0.3)  # idle: not counted
        s.put(b"y" * 16, b"y" * 200000)
        s.flush()
        assert s.drain(10)
        st = s.stats()
        wall = time.perf_counter() - t0
    for name in ("local", "shared"):
        m, t = mid.tiers[name], st.tiers[name]
        assert 0 < m.write_busy_s <= first
        assert m.write_busy_s < t.write_busy_s <= wall - 0.3
        assert t.write_gbps == pytest.approx(t.write_bytes / t.write_busy_s / 1e9)


def test_write_busy_time_includes_the_stretch_still_open(disk_tmp: Path) -> None:
    # While a tier's writes are stalled its busy time keeps growing in every snapshot, not only once its backlog
    # empties (what replay's load records and a Prometheus rate() read mid-stretch).
    import time

    from kvstream.io.engine import make_engine
    from kvstream.io.faults import Fault, FaultPlan, FaultyEngine

    engine = FaultyEngine(make_engine("threads"), FaultPlan([Fault(kind="delay", rings="local-w", delay_s=1.5)],
                                                            seed=1))
    with kvstream.open_store(_cfg(disk_tmp), engine=engine) as s:
        s.put(b"z" * 16, b"z" * 200000)
        s.flush()
        time.sleep(0.2)
        a = s.stats().tiers["local"].write_busy_s
        time.sleep(0.4)
        b = s.stats().tiers["local"].write_busy_s
        assert s.write_busy_seconds()["local"] >= b
        assert 0.1 < a < b and b - a >= 0.3  # grew with the stalled write (before: 0 until it finished)
        assert s.drain(10)
        done = s.stats().tiers["local"].write_busy_s
        time.sleep(0.1)
        assert s.stats().tiers["local"].write_busy_s == done >= b  # closed: no longer grows


def test_percentiles() -> None:
    assert percentiles([]) == (None, None)
    assert percentiles([3.0]) == (3.0, 3.0)
    assert percentiles(float(i) for i in range(100, 0, -1)) == (51.0, 100.0)


def test_every_exported_figure_names_a_stats_field() -> None:
    """The Prometheus collector and the LMCache plugin read fields by name: a renamed field fails here."""
    from kvstream import metrics
    from kvstream.integrations import _lmcache_metrics as plugin

    store = {f.name for f in dataclasses.fields(StoreStats)}
    tier = {f.name for f in dataclasses.fields(TierStats)}
    memory = {f.name for f in dataclasses.fields(MemoryStats)}
    assert set(metrics._STORE_SERIES) <= store
    assert set(metrics._TIER_SERIES) <= tier
    assert set(metrics._MEMORY_SERIES) <= memory
    assert set(plugin._TIER_STATS) <= tier and set(plugin._MEMORY_STATS) <= memory
    assert set(plugin._GAUGE_STATS.values()) <= tier & memory
