"""Prometheus metrics reflect the store's counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

import kvstream
from kvstream.metrics import register


def test_metrics_follow_reads_and_writes(disk_tmp):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "l"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "s"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "8MiB", "create_dirs": True}
    with kvstream.open_store(cfg) as s:
        reg = CollectorRegistry()
        register(s, registry=reg, labels={"model": "m"})
        for i in range(4):
            s.put(bytes([i]) * 16, bytes([i]) * 10000)
        s.flush()
        s.drain()
        s.evict_memory()
        s.get_many([bytes([i]) * 16 for i in range(4)] + [b"z" * 16])
        text = generate_latest(reg).decode()
    assert 'kvstream_tier_write_chunks_total{model="m",tier="local"} 4.0' in text
    assert 'kvstream_tier_write_chunks_total{model="m",tier="shared"} 4.0' in text
    assert 'kvstream_disk_hits_total{model="m"} 4.0' in text
    assert 'kvstream_misses_total{model="m"} 1.0' in text
    assert 'kvstream_write_amplification{model="m"} 2.0' in text
    # per-tier write latency (hand-over to publish), like the read latency: a finite number of seconds
    for tier in ("local", "shared"):
        for q in ("p50", "p99"):
            line = next(ln for ln in text.splitlines()
                        if ln.startswith(f'kvstream_tier_write_latency_{q}_seconds{{model="m",tier="{tier}"}}'))
            assert 0 < float(line.rsplit(" ", 1)[1]) < 10, line


def _samples(reg: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The registry as a scrape reads it: the text exposition parsed back, (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(generate_latest(reg).decode()) for s in fam.samples}


def test_capacity_usage_and_evictions_per_tier(disk_tmp):
    """A tier too small for every chunk evicts; the scrape shows each tier's capacity, used bytes, chunks and
    evictions, and the host-memory tier's, equal to the store's own figures."""
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "l"), "capacity_bytes": "64KiB"},
                     {"name": "shared", "path": str(disk_tmp / "s"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "8MiB", "create_dirs": True}
    with kvstream.open_store(cfg) as s:
        reg = CollectorRegistry()
        register(s, registry=reg)
        for i in range(24):  # 8 KiB files (header + payload): local holds 8; one write at a time, so the
            s.put(bytes([i]) * 16, bytes([i]) * 4000)  # published ones can be evicted for the next
            s.flush()
            s.drain()
        st = s.stats()
        got = _samples(reg)
    for tier in ("local", "shared"):
        t = st.tiers[tier]
        lab = (("tier", tier),)
        assert got[("kvstream_tier_capacity_bytes", lab)] == t.capacity_bytes
        assert got[("kvstream_tier_used_bytes", lab)] == t.used_bytes
        assert got[("kvstream_tier_chunks", lab)] == t.chunks
        assert got[("kvstream_tier_evicted_chunks_total", lab)] == t.evicted_chunks
        assert got[("kvstream_tier_evicted_bytes_total", lab)] == t.evicted_bytes
    assert st.tiers["local"].capacity_bytes == 64 << 10
    assert 0 < st.tiers["local"].used_bytes <= 64 << 10 and st.tiers["local"].evicted_chunks >= 16
    assert st.tiers["shared"].chunks == 24 and st.tiers["shared"].evicted_chunks == 0
    assert got[("kvstream_memory_capacity_bytes", ())] == 8 << 20
    assert got[("kvstream_memory_used_bytes", ())] == st.memory.used_bytes
    assert got[("kvstream_memory_chunks", ())] == st.memory.chunks > 0
    assert got[("kvstream_memory_evictions_total", ())] == st.memory.evictions


_WORKER = """
import sys
import kvstream
from kvstream.integrations._lmcache_metrics import PluginMetrics, TimedPuts

root = sys.argv[1]
cfg = {"tiers": [{"name": "local", "path": root + "/l", "capacity_bytes": "64MiB"},
                 {"name": "shared", "path": root + "/s", "capacity_bytes": "32MiB"}],
       "memory_bytes": "8MiB", "create_dirs": True}
with kvstream.open_store(cfg) as s:
    m = PluginMetrics(model_name="m", worker_id=int(sys.argv[2]), role="worker", served_model_name=None)
    puts = TimedPuts(s, m)  # what the plugin hands its write queue
    for i in range(3):
        assert puts.put(bytes([i]) * 16, bytes([i]) * 5000)
    s.flush()
    assert puts.drain(10.0)  # anything else is the store's own
    m.sync_store(s.stats())
    m.chunk_landed("local", 5000, 0.002)
"""


def test_plugin_metrics_reach_a_scrape_through_prometheus_multiproc_dir(disk_tmp, tmp_path):
    """vLLM's workers are separate processes: their metrics reach /metrics only as prometheus_client's
    multiprocess files. Two worker processes write them; the collector vLLM's server uses reads them back."""
    import os
    import subprocess
    import sys

    from prometheus_client.multiprocess import MultiProcessCollector

    mp = tmp_path / "multiproc"
    mp.mkdir()
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(mp)}
    for worker in (0, 1):
        subprocess.run([sys.executable, "-c", _WORKER, str(disk_tmp / f"w{worker}"), str(worker)], env=env,
                       check=True, timeout=60)
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(mp))
    got = _samples(reg)
    p = "lmcache:kvstream_"

    def key(name: str, worker: str, **extra: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        lab = {"model_name": "m", "worker_id": worker, "role": "worker", "served_model_name": "", **extra}
        return name, tuple(sorted(lab.items()))

    for worker in ("0", "1"):
        assert got[key(p + "capacity_bytes", worker, tier="local")] == 64 << 20
        assert got[key(p + "capacity_bytes", worker, tier="shared")] == 32 << 20
        assert got[key(p + "chunks", worker, tier="shared")] == 3
        assert got[key(p + "num_written_chunks_total", worker, tier="local")] == 3
        assert got[key(p + "num_evicted_chunks_total", worker, tier="local")] == 0
        assert got[key(p + "num_hit_chunks_total", worker, tier="local")] == 1
        assert got[key(p + "time_to_put_count", worker)] == 3
        assert got[key(p + "time_to_chunk_bucket", worker, tier="local", le="0.0025")] == 1
