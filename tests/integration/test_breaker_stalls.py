"""Issue 21 item 1: the circuit breaker judged a stall (a read past the hedge deadline) by wall time, which
includes every moment the process was not scheduled: on a CPU-starved host a healthy tier's breaker opened
whenever its reads were reaped a few hedge periods late (local 361 times in a soak), and with every breaker open
puts had no tier to go to. A stall is a failure now only past ``stall_floor_s`` and with nothing delivered by the
tier since the read was issued; errors count as before."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvstream
from kvstream.health import CircuitBreaker
from kvstream.io import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.testing.store import engines, payload_for

SIZE = 64 * 1024  # bytes of every payload put


def test_a_stall_is_a_failure_only_past_the_floor_with_nothing_delivered_since():
    b = CircuitBreaker(stall_floor_s=1.0)
    # A healthy tier in a starved process: its reads come back late, but it keeps delivering.
    b.on_success(0.0)
    for i in range(20):
        since = 1.0 + i
        b.on_success(since + 0.3)  # another read of the tier delivered after this one was issued
        assert not b.on_stall(since + 1.5, since)
    assert b.state == "closed" and b.opened == 0 and b.stalls_ignored == 20
    # Short stalls never count, delivered or not (hedging covers them).
    assert not b.on_stall(30.5, 30.0) and b.failures == 0
    # A hung tier: nothing delivered since its read was issued, out past the floor: three stalls open it.
    for now in (41.0, 41.05, 41.1):
        assert b.on_stall(now, 40.0)
    assert b.state == "open" and b.opened == 1
    # Errors still count as they did.
    b2 = CircuitBreaker()
    for _ in range(3):
        b2.on_failure(0.0)
    assert b2.state == "open"


@pytest.mark.parametrize("engine", engines())
def test_reads_that_come_back_late_but_whole_never_open_a_breaker(disk_tmp: Path, engine: str):
    """What a CPU-starved process sees: every read's completion comes back 0.25 s late (five hedge periods)
    on both tiers, yet each tier keeps delivering. The old rule counted a failure per hedge period of a late read
    and opened both breakers within a step; then puts had no tier to go to."""
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "32MiB", "create_dirs": True, "io_engine": engine, "hedge_after_s": 0.05}
    keys = [bytes([i]) * 16 for i in range(8)]
    with kvstream.open_store(cfg) as s:
        for k in keys:
            s.put(k, payload_for(k, SIZE))
        s.flush()
        assert s.drain(10)
    plan = FaultPlan(seed=1)
    plan.add(Fault(kind="delay", rings="*-r", delay_s=0.25))
    engine_ = FaultyEngine(make_engine(engine), plan)
    s = kvstream.open_store(cfg, engine=engine_)
    try:
        for _ in range(8):
            s.evict_memory()
            got = s.get_many(keys)
            assert all(g is not None and bytes(g) == payload_for(k, SIZE) for k, g in zip(keys, got))
        st = s.stats()
        assert st.stalled_reads > 0  # the reads were late: stalls were seen ...
        assert [t.circuit_opened for t in st.tiers.values()] == [0, 0]  # ... and none opened a breaker
        assert all(h.stalls_ignored > 0 for h in s.health)
    finally:
        engine_.release_stalls()
        s.close()
