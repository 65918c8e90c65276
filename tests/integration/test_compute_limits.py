"""Issue 21 item 10: a compute plan's costs are never trusted. A cost that is infinite, NaN, negative or huge
cannot be recomputed: the compute chain ends before it, so a read step never waits on it (an infinite cost
held ``Store.read_chunks`` for ever: its timer never fired)."""

from __future__ import annotations

import math
import threading
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

import kvstream
from kvstream.compute import MAX_CHUNK_COST_S, ComputePolicy, checked_plan, loaded_prefix, usable_chain
from kvstream.read_step import ComputePlan
from kvstream.store import RECOMPUTED, ComputeRequest

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
COSTS = st.lists(st.one_of(ANY_FLOAT, st.floats(0, 1), st.sampled_from([math.inf, math.nan, 1e9, -1.0])),
                 max_size=12)
BANDWIDTH = st.one_of(st.none(), ANY_FLOAT, st.floats(1e6, 1e10))


def _ok_cost(c: float) -> bool:
    return math.isfinite(c) and 0 <= c <= MAX_CHUNK_COST_S


@settings(max_examples=400, deadline=None)
@given(costs=COSTS, bws=st.lists(BANDWIDTH, min_size=2, max_size=2), samples=st.lists(
    st.tuples(st.integers(0, 1), ANY_FLOAT, ANY_FLOAT), max_size=4))
def test_a_plan_only_ever_holds_finite_bounded_costs(costs, bws, samples):
    policy = ComputePolicy(n_tiers=2, bandwidth=list(bws))
    for t, nbytes, busy in samples:
        policy.observe(t, nbytes, busy)  # a NaN or infinite sample must not poison the estimate
    assert all(b is None or (math.isfinite(b) and b >= 0) for b in policy.bandwidth)
    nbytes = [1 << 20] * (len(costs) + 2)
    plan = policy.plan(costs, nbytes)
    chain = usable_chain(costs)
    assert len(chain) <= len(costs) and all(_ok_cost(c) for c in chain)
    if plan is not None:
        assert all(_ok_cost(c) for c in plan.cost_s) and len(plan.cost_s) <= len(chain)
        assert 0 <= plan.front <= len(plan.cost_s)
        assert all(math.isfinite(b) and b >= 0 for b in plan.bandwidth)
    assert 0 <= policy.estimate(costs, nbytes) <= len(chain)
    policy.skip(costs, 1 << 20, [0, 1])  # never raises


@settings(max_examples=300, deadline=None)
@given(costs=COSTS, bws=st.lists(ANY_FLOAT, max_size=3), front=st.integers(-5, 20), margin=ANY_FLOAT,
       n=st.integers(0, 12))
def test_checked_plan_makes_any_plan_safe_for_the_step(costs, bws, front, margin, n):
    plan = checked_plan(ComputePlan(cost_s=tuple(costs), bandwidth=tuple(bws), front=front, margin=margin), n)
    if plan is None:
        assert not usable_chain(costs)[:n]
        return
    assert 0 < len(plan.cost_s) <= n and all(_ok_cost(c) for c in plan.cost_s)
    assert plan.cost_s == usable_chain(costs)[:n]
    assert 0 <= plan.front <= len(plan.cost_s) and math.isfinite(plan.margin) and plan.margin >= 0
    assert all(math.isfinite(b) and b >= 0 for b in plan.bandwidth)


@settings(max_examples=300, deadline=None)
@given(pairs=st.lists(st.tuples(st.one_of(ANY_FLOAT, st.floats(0, 1)), st.one_of(ANY_FLOAT, st.floats(0, 1))),
                      max_size=10))
def test_loaded_prefix_answers_inside_the_prefix_for_any_input(pairs):
    load, cost = [p[0] for p in pairs], [p[1] for p in pairs]
    k = loaded_prefix(load, cost)
    assert 0 <= k <= len(pairs)
    # Never past a chunk no tier can deliver (a load time that is not a number >= 0).
    bad = next((j for j, x in enumerate(load) if not (x >= 0 and math.isfinite(x))), len(pairs))
    assert k <= bad


def test_a_plan_with_an_infinite_nan_or_huge_cost_never_holds_read_chunks(disk_tmp: Path):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads"}
    keys = [bytes([i]) * 16 for i in range(4)]
    with kvstream.open_store(cfg) as s:
        for k in keys:
            s.put(k, k * 4096)
        s.flush()
        assert s.drain(10)
        for cost in (math.inf, math.nan, 1e9, -1.0):
            s.evict_memory()
            got: list = []
            req = ComputeRequest(plan=ComputePlan(cost_s=(cost, 0.001), bandwidth=(0.0,), front=1))

            def run() -> None:
                got.extend(s.read_chunks(keys, compute=lambda ks, hs: req))  # noqa: B023

            th = threading.Thread(target=run, daemon=True)
            th.start()
            th.join(10)
            assert not th.is_alive(), f"read_chunks hung on a plan costing {cost} s"
            # The chain ends before the bad cost: nothing is recomputed, every chunk is read.
            assert sorted(i for i, _ in got) == [0, 1, 2, 3]
            assert all(c is not None and c is not RECOMPUTED and bytes(c.payload) == keys[i] * 4096
                       for i, c in got)
