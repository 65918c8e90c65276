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
