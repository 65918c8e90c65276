"""The replay's verdicts (kvstream.benchmarks.verdict): a paired, two-level bootstrap interval of a TTFT ratio, and
ahead / level / behind only when the whole interval says so."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.benchmarks.verdict import ratio_interval, verdict


def _ttfts(rng, base, rounds, scale=1.0, noise=0.3, round_noise=0.0):
    """``rounds`` runs of one system over the requests ``base`` (their TTFTs when nothing else differs): each run
    is slowed as a whole by its own round noise (a neighbour's load), each request by its own noise."""
    return np.array([base * scale * (1.0 + rng.normal(0.0, round_noise)) * rng.lognormal(0.0, noise, size=base.size)
                     for _ in range(rounds)])


def _requests(rng, n):
    return rng.lognormal(0.0, 0.8, size=n)  # some short, some long: the same requests for every system


def test_a_clear_gain_is_ahead_and_its_mirror_behind():
    rng = np.random.default_rng(1)
    base = _requests(rng, 60)
    a = _ttfts(rng, base, 3, scale=0.7)
    b = _ttfts(rng, base, 3)
    r = ratio_interval(a, b)
    assert r.verdict == "ahead" and r.high < 1.0 and r.low <= r.ratio <= r.high
    assert ratio_interval(b, a).verdict == "behind"


@pytest.mark.parametrize("round_noise", [0.0, 0.3])
def test_the_same_system_twice_is_level_not_a_win(round_noise):
    # Three rounds of two equal systems, with no run-to-run noise and with 30 % of it (each system's run slowed
    # on its own): a 95 % interval calls them apart in about 1 trial of 20 (the round part's interval uses
    # Student's t: without it, 19 % of trials at 30 % noise gave a verdict).
    rng = np.random.default_rng(2)
    called = 0
    for seed in range(40):
        base = _requests(rng, 48)
        a = _ttfts(rng, base, 3, round_noise=round_noise)
        b = _ttfts(rng, base, 3, round_noise=round_noise)
        for stat in ("mean", "p99"):
            called += ratio_interval(a, b, statistic=stat, seed=seed, resamples=500).verdict != "level"
    assert called <= 6  # of 80; 4 expected at 95 %


def test_pairing_cancels_what_both_runs_of_a_request_share():
    # Requests differ by 10x among themselves; A is 5 % faster on every request. Paired, that is a clear win;
    # the request-to-request spread must not hide it.
    rng = np.random.default_rng(3)
    b = np.tile(rng.lognormal(0, 1.2, size=50), (3, 1))
    a = b * 0.95
    assert ratio_interval(a, b).verdict == "ahead"


def test_run_to_run_noise_widens_the_interval():
    rng = np.random.default_rng(4)
    base = _requests(rng, 48)
    quiet = ratio_interval(_ttfts(rng, base, 5, scale=0.9), _ttfts(rng, base, 5))
    noisy = ratio_interval(_ttfts(rng, base, 5, scale=0.9, round_noise=0.4), _ttfts(rng, base, 5, round_noise=0.4))
    assert noisy.high - noisy.low > quiet.high - quiet.low


@settings(max_examples=40, deadline=None)
@given(rounds=st.integers(1, 4), n=st.integers(1, 30), seed=st.integers(0, 1000),
       stat=st.sampled_from(["mean", "p99"]))
def test_the_interval_holds_the_measured_ratio_of_any_data(rounds, n, seed, stat):
    rng = np.random.default_rng(seed)
    a = rng.uniform(0.01, 10, size=(rounds, n))
    b = rng.uniform(0.01, 10, size=(rounds, n))
    r = ratio_interval(a, b, statistic=stat, resamples=300, seed=seed)
    assert r.low <= r.high and r.verdict == verdict(r.low, r.high)
    assert (r.rounds, r.requests) == (rounds, n)


@pytest.mark.parametrize("a,b,msg", [
    ([[1.0, 2.0]], [[1.0]], "one shape"),
    ([[1.0, float("nan")]], [[1.0, 2.0]], "finite"),
    ([[1.0]], [[0.0]], "not positive"),
    ([], [], "one shape"),
])
def test_bad_input_is_refused_with_the_rule(a, b, msg):
    with pytest.raises(ValueError, match=msg):
        ratio_interval(a, b)


# -- how the noise compares with what the tiers give directly -----------------------------------------------------------
def test_the_direct_read_effect_is_the_saved_load_time_over_the_summed_ttft():
    from kvstream.benchmarks.verdict import direct_read_effect

    # 8 s of loads at 2.8 GB/s; at 3.7 GB/s they take 8 * 2.8 / 3.7 s: 1.95 s saved of 48 x 0.8 s of TTFT.
    e = direct_read_effect(load_busy_s=8.0, ttft_sum_s=48 * 0.8, bound_slow_gbps=2.8, bound_fast_gbps=3.7)
    assert e == pytest.approx(8.0 * (1 - 2.8 / 3.7) / 38.4)
    # no faster bound, or nothing loaded: nothing to gain
    assert direct_read_effect(load_busy_s=8.0, ttft_sum_s=38.4, bound_slow_gbps=3.7, bound_fast_gbps=3.7) == 0.0
    assert direct_read_effect(load_busy_s=0.0, ttft_sum_s=38.4, bound_slow_gbps=2.8, bound_fast_gbps=3.7) == 0.0


def test_an_effect_below_the_noise_is_not_resolvable_and_more_rounds_are_named():
    from kvstream.benchmarks.verdict import RatioInterval, resolution

    iv = RatioInterval(statistic="mean", ratio=1.0, low=0.87, high=1.15, rounds=5, requests=48, verdict="level")
    r = resolution(iv, 0.05)
    assert not r.resolvable and r.half_width == pytest.approx(0.1495, abs=2e-3)
    assert r.rounds_to_resolve == math.ceil(5 * (r.half_width / 0.05) ** 2)  # ~45: noise shrinks as 1/sqrt(rounds)
    wide_effect = resolution(iv, 0.30)
    assert wide_effect.resolvable and wide_effect.rounds_to_resolve is not None and wide_effect.rounds_to_resolve < 5
    assert resolution(iv, 0.0).rounds_to_resolve is None
    broken = RatioInterval(statistic="mean", ratio=1.0, low=math.nan, high=math.nan, rounds=1, requests=1,
                           verdict="level")
    assert not resolution(broken, 0.05).resolvable


def test_replay_gives_the_read_effect_only_for_pairs_whose_read_bounds_differ():
    from kvstream.commands.replay import compare_systems

    rng = np.random.default_rng(7)
    base = _requests(rng, 20)

    def run(bound, busy, ttfts):
        return {"summary": {"load_bound_gbps": bound, "load_busy_s": busy, "ttft_mean_s": float(np.mean(ttfts)),
                            "completed": len(ttfts)}, "ttft_by_request": list(ttfts)}

    two = [run(3.7, 6.0, t) for t in _ttfts(rng, base, 3)]
    same = [run(3.7, 6.0, t) for t in _ttfts(rng, base, 3)]
    one = [run(2.8, 8.0, t) for t in _ttfts(rng, base, 3)]
    rows = {r["against"]: r for r in compare_systems({"kvstream": two, "kvstream-only": same, "bidaw-only": one},
                                                     ["kvstream", "kvstream-only", "bidaw-only"])}
    assert "resolution" not in rows["kvstream-only"]  # the same tiers: the pair differs in scheduling only
    res = rows["bidaw-only"]["resolution"]
    ttft_sum = [r["summary"]["ttft_mean_s"] * 20 for r in one]
    expect = sorted(8.0 * (1 - 2.8 / 3.7) / t for t in ttft_sum)[1]
    assert res["effect"] == pytest.approx(expect)


def test_the_table_caps_the_noise_and_rounds_two_rounds_can_blow_up():
    from kvstream.commands.replay import _resolution_text

    # The demo's own figures (2 rounds): an interval of 0.031-36.8 and an extrapolation to a million rounds.
    wild = {"effect": 0.047, "half_width": 33.607, "rounds": 2, "rounds_to_resolve": 1032739, "resolvable": False}
    assert _resolution_text(wild) == "4.7 % < ±>1000 % (>200 rounds)"
    usual = {"effect": 0.052, "half_width": 0.15, "rounds": 5, "rounds_to_resolve": 42, "resolvable": False}
    assert _resolution_text(usual) == "5.2 % < ±15.0 % (~42 rounds)"
    clear = {"effect": 0.3, "half_width": 0.1, "rounds": 5, "rounds_to_resolve": 1, "resolvable": True}
    assert _resolution_text(clear) == "30.0 % > ±10.0 %"
    assert _resolution_text(None) == "-"
