"""Compute joins the meet-in-the-middle, in the simulator: the same read step and policy objects as replay.

Small runs of the ``compute`` scenario's systems (kvstream.sim.scenarios.compute_sweep): with a slow shared
tier kvstream+compute has lower mean and P99 TTFT than kvstream, recompute-only and load-only; with fast
tiers it is never worse than the best of them by more than 2 %. Without the mechanism (compute off) the
"+compute" column equals kvstream's, so the first test fails.
"""

from __future__ import annotations

import dataclasses


from kvstream.sim.scenarios import compute_sweep, compute_verdict, compute_systems
from kvstream.sim.driver import Hardware


def test_compute_beats_every_baseline_across_the_sweep():
    data = compute_sweep([(0.5, None), (6.0, None)], quick=True, seed=0)
    lower, close, worst = compute_verdict(data)
    assert lower and close, data
    for row in data.values():
        assert row["kvstream+compute"]["computed"] > 0
        assert row["kvstream+compute"]["mean"] < 0.9 * row["kvstream"]["mean"]


def test_fast_tiers_degrade_to_plain_kvstream():
    """Tiers far faster than the GPU's recompute (a 70B model, 50 GB/s shared tier): the policy plans little
    or nothing, and kvstream+compute is within 2 % of kvstream."""
    data = compute_sweep([(50.0, None)], quick=True, seed=0, hw=Hardware(gpu="a100", model="70b", tp=4,
                                                                          hbm_kv_bytes=16e9))
    (row,) = data.values()
    for m in ("mean", "p99"):
        assert row["kvstream+compute"][m] <= 1.02 * row["kvstream"][m]


def test_compute_systems_differ_only_in_the_mechanism():
    from kvstream.sim.scenarios import testbed_tiers

    s = compute_systems(testbed_tiers(1), 1e9)
    assert dataclasses.replace(s["kvstream+compute"], name="KVStream", compute=False) == s["kvstream"]
    assert not s["recompute-only"].read_disk and len(s["load-only"].tiers) == 1
