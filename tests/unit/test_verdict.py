"""The replay's verdicts (kvstream.benchmarks.verdict): a paired, two-level bootstrap interval of a TTFT ratio, and
ahead / level / behind only when the whole interval says so."""

from __future__ import annotations

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
