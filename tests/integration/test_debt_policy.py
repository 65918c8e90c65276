"""The write backlog valve (:class:`kvstream.debt_policy.BacklogValve`): one sans-I/O rule, asked by the store's
writer at every flush and by the simulator's storage model, so both skip (and owe) the same second copies."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvstream
from kvstream.config import write_backlog_limit
from kvstream.debt_policy import BacklogValve, ValveDecision
from kvstream.eviction import make_eviction_policy
from kvstream.replication import parse_replication
from kvstream.routing import parse_router
from kvstream.serving.core import WriteChunks
from kvstream.sim.devices import Device
from kvstream.sim.engine import EventLoop
from kvstream.sim.storage import SimStorage, SimTier

limits = st.one_of(st.none(), st.integers(min_value=0, max_value=1 << 40))


@given(limit=limits, copies=st.integers(min_value=0, max_value=4), backlog=st.integers(min_value=0, max_value=1 << 41))
def test_the_valve_skips_only_a_second_copy_into_a_full_backlog(limit: int | None, copies: int, backlog: int) -> None:
    v = BacklogValve([None, limit])
    got = v.decide(1, copies=copies, backlog=backlog)
    if copies == 0 or limit is None or backlog < limit:
        assert got is ValveDecision.WRITE  # a first copy, no valve, or room left: written
    elif limit == 0:
        assert got is ValveDecision.SKIP  # the operator wants one copy: skipped for good, not owed
    else:
        assert got is ValveDecision.OWE
    assert v.decide(0, copies=copies, backlog=backlog) is ValveDecision.WRITE  # tier 0 has no valve here


@given(limit=st.integers(min_value=1, max_value=1 << 30), sizes=st.lists(st.integers(1, 1 << 28), max_size=40))
def test_a_flush_never_skips_a_chunks_only_copy_and_keeps_each_backlog_below_limit_plus_one_copy(
        limit: int, sizes: list[int]) -> None:
    """A model of one flush with nothing finishing: in tier order, tier 0 always takes the first copy; tier 1's
    backlog passes its limit by at most the one copy that crossed it."""
    v = BacklogValve([limit, limit])
    backlog = [0, 0]
    for n in sizes:
        copies = 0
        for t in (0, 1):
            if v.decide(t, copies=copies, backlog=backlog[t]) is ValveDecision.WRITE:
                backlog[t] += n
                copies += 1
        assert copies >= 1
    assert backlog[1] < limit + max(sizes, default=0)


def test_the_stores_limits_default_to_half_of_host_memory_and_bad_limits_are_refused() -> None:
    v = BacklogValve([write_backlog_limit(b, 1 << 30) for b in (None, 1234, 0)])
    assert v.limits == [1 << 29, 1234, 0] and v.active
    assert not BacklogValve([None, None]).active
    with pytest.raises(ValueError, match="tier 1"):
        BacklogValve([None, -1])


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int, int, ValveDecision]]:
    """Wrap BacklogValve.decide: each call's (tier, copies, backlog, decision), whoever asked."""
    calls: list[tuple[int, int, int, ValveDecision]] = []
    real = BacklogValve.decide

    def decide(valve: BacklogValve, t: int, *, copies: int, backlog: int) -> ValveDecision:
        got = real(valve, t, copies=copies, backlog=backlog)
        calls.append((t, copies, backlog, got))
        return got

    monkeypatch.setattr(BacklogValve, "decide", decide)
    return calls


def test_the_store_and_the_simulator_ask_the_same_valve(disk_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _spy(monkeypatch)
    # The store: a second tier with a limit of 0 (first copies only): its copies are skipped by the valve.
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "l"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "s"), "capacity_bytes": "64MiB",
                      "write_backlog_bytes": 0}],
           "memory_bytes": "16MiB", "create_dirs": True}
    with kvstream.open_store(cfg) as s:
        assert isinstance(s._writer.valve, BacklogValve)
        for i in range(3):
            s.put(bytes([i + 1]) * 16, np.full(50_000, i, dtype=np.uint8))
        s.flush()
        assert s.drain(10)
        assert s.stats().tiers["shared"].write_skipped_backlog == 3
    store_calls = list(calls)
    assert [c[0] for c in store_calls] == [0, 1] * 3
    assert all(c[3] is ValveDecision.SKIP for c in store_calls if c[0] == 1)
    # The simulator: the same class, the same rule, asked at its flush.
    calls.clear()
    loop = EventLoop()
    tiers = [SimTier(name=f"t{i}", device=Device(loop, f"t{i}", read_bw=1e9, write_bw=1e9), read_window=1)
             for i in range(2)]
    sim = SimStorage(loop, tiers=tiers, router=parse_router("mitm", ["t0", "t1"]),
                     replication=parse_replication("full"), host_eviction=make_eviction_policy("lru"),
                     host_capacity_chunks=8, chunk_bytes=1 << 20, write_backlog_bytes=[None, 0])
    assert isinstance(sim.valve, BacklogValve) and sim.backlog_limit is sim.valve.limits
    sim.write(WriteChunks(request_id=1, chunk_ids=(1, 2, 3), first_position=0))
    sim.flush()
    loop.run(until=1e6)
    assert [c[0] for c in calls] == [0, 1] * 3
    assert all(c[3] is ValveDecision.SKIP for c in calls if c[0] == 1)
    assert sim.stats()["write_skipped_backlog_t1"] == 3
