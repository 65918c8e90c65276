"""The replay's bound under a run's own write load (kvstream.commands.replay.in_run_bound): each load's best is the
sum over its tiers of each tier's rate in its conditions (alone, or beside its writes, by the share of the load's
time the tier was writing); the run's bound is the loads' bytes over the time each would take at its best."""

from __future__ import annotations

import math

import pytest

from kvstream.commands.replay import above_in_run_bound, in_run_bound, tier_rates

LOCAL = {"read_bw": 2.0e9, "mixed_read_bw": 0.5e9}
SHARED = {"read_bw": 1.0e9, "mixed_read_bw": 0.8e9}


def _load(s: float, nbytes: list[float], write_s: list[float]) -> dict:
    return {"s": s, "busy_s": [s] * len(nbytes), "bytes": nbytes, "chunks": [1] * len(nbytes), "write_s": write_s}


def test_no_writes_is_the_sum_of_the_tiers_alone() -> None:
    gbps, beside = in_run_bound([_load(1.0, [2e9, 1e9], [0.0, 0.0])], [LOCAL, SHARED])
    assert gbps == pytest.approx(3.0) and beside == 0.0


def test_writes_all_along_is_the_sum_beside_writes() -> None:
    gbps, beside = in_run_bound([_load(1.0, [1e9, 1e9], [1.0, 1.0])], [LOCAL, SHARED])
    assert gbps == pytest.approx(1.3) and beside == pytest.approx(1.0)


def test_a_load_weighs_each_tier_by_its_own_write_overlap() -> None:
    # local wrote half the load's time, shared not at all: 0.5 x 2 + 0.5 x 0.5 + 1.0 = 2.25 GB/s
    gbps, beside = in_run_bound([_load(2.0, [1e9, 1e9], [1.0, 0.0])], [LOCAL, SHARED])
    assert gbps == pytest.approx(2.25) and beside == pytest.approx(0.25)
    # a write overlap longer than the load (a stretch counted from before it) is capped at the whole load; and
    # a load that read one tier only could still have read both (the bound is of the tiers, not of the split)
    assert in_run_bound([_load(1.0, [1e9, 0.0], [5.0, 0.0])], [LOCAL, SHARED])[0] == pytest.approx(1.5)


def test_the_run_is_a_bytes_weighted_harmonic_mean_of_its_loads() -> None:
    # 3 GB at 3 GB/s (1 s) and 2.6 GB at 1.3 GB/s (2 s): 5.6 GB in 3 s, not the mean of the two rates
    loads = [_load(1.0, [2e9, 1e9], [0.0, 0.0]), _load(2.0, [1.3e9, 1.3e9], [2.0, 2.0])]
    gbps, _ = in_run_bound(loads, [LOCAL, SHARED])
    assert gbps == pytest.approx(5.6 / 3.0)
    assert gbps != pytest.approx((3.0 + 1.3) / 2)


def test_one_tier_system_uses_its_tier_only_and_loads_without_disk_bytes_are_left_out() -> None:
    loads = [_load(1.0, [1e9], [0.5]), _load(0.3, [0.0], [0.0])]
    gbps, _ = in_run_bound(loads, [LOCAL])
    assert gbps == pytest.approx(1.25)


def test_nothing_to_say_without_disk_loads_or_without_a_mixed_probe() -> None:
    assert all(math.isnan(v) for v in in_run_bound([], [LOCAL, SHARED]))
    assert all(math.isnan(v) for v in in_run_bound([_load(1.0, [1e9, 1e9], [0.0, 0.0])],
                                                   [{"read_bw": 2e9}, SHARED]))


def test_a_multi_tier_system_is_held_to_its_tiers_read_at_once() -> None:
    # Two tiers that share a device or the CPUs: each reads slower while the other is read (the probe's joint
    # figures). A two-tier load is held to those, and beside writes to the alone rate scaled by the same share.
    local = {**LOCAL, "joint_read_bw": 1.5e9}  # keeps 75 %
    shared = {**SHARED, "joint_read_bw": 0.9e9}  # keeps 90 %
    assert tier_rates([local, shared]) == [pytest.approx((1.5e9, 0.375e9)), pytest.approx((0.9e9, 0.72e9))]
    assert in_run_bound([_load(1.0, [1e9, 1e9], [0.0, 0.0])], [local, shared])[0] == pytest.approx(2.4)
    assert in_run_bound([_load(1.0, [1e9, 1e9], [1.0, 1.0])], [local, shared])[0] == pytest.approx(1.095)
    # one tier of the same probe: that tier alone (its joint figure is of no use to a one-tier system)
    assert tier_rates([local]) == [(2.0e9, 0.5e9)]
    assert in_run_bound([_load(1.0, [1e9], [0.0])], [local])[0] == pytest.approx(2.0)
    # a probe without joint figures (one of the tiers lacks them): each tier alone
    assert tier_rates([local, SHARED]) == [(2.0e9, 0.5e9), (1.0e9, 0.8e9)]
    # a joint figure above the alone one is the probe's noise: capped at the alone figures
    noisy = {**LOCAL, "joint_read_bw": 2.5e9}
    assert tier_rates([noisy, shared]) == [pytest.approx((2.0e9, 0.5e9)), pytest.approx((0.9e9, 0.72e9))]


def test_loads_above_the_in_run_bound_are_named_and_the_rest_are_not() -> None:
    results = [{"system": "kvstream", "summary": {"load_of_bound_in_run": 1.40}},
               {"system": "bidaw-only", "summary": {"load_of_bound_in_run": 1.05}},  # at the margin: not named
               {"system": "lmcache-like", "summary": {"load_of_bound_in_run": math.nan}},
               {"system": "kvstream-only", "summary": {}}]
    assert above_in_run_bound(results) == [("kvstream", pytest.approx(1.40))]
