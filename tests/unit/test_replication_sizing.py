"""partial_fraction: how much of each prefix gets a second copy when the second tier reads slower than the first,
and the replay's ``kvstream`` system resolving it from the run's measured bandwidths."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from kvstream.commands.replay import _replication
from kvstream.replication import PartialReplication, WriteIntent, parse_replication, partial_fraction

bw = st.floats(min_value=1e6, max_value=1e11, allow_nan=False)


@given(bw, bw, st.floats(min_value=1.01, max_value=3.0))
def test_the_fraction_is_bounded_and_grows_with_the_second_tiers_bandwidth(local, shared, faster):
    f = partial_fraction([local, shared])
    assert 0.2 <= f <= 1.0
    assert partial_fraction([local, shared * faster]) >= f  # a faster second tier reads more of each step
    assert partial_fraction([local * faster, shared]) <= f
    share = shared / (local + shared)
    assert math.isclose(f, min(1.0, max(0.2, 1.5 * share)))


def test_figures_of_this_machine_and_the_edges():
    assert math.isclose(partial_fraction([1.6e9, 0.5e9]), 1.5 * 0.5 / 2.1)  # the default replay: about 0.36
    assert partial_fraction([1.35e9, 2.7e9]) == 1.0  # twice as fast: full replication
    assert math.isclose(partial_fraction([2.7e9, 2.7e9]), 0.75)  # level tiers: the back three quarters
    assert partial_fraction([2.7e9, 1.35e9]) == 0.5
    assert partial_fraction([2.7e9, 1e6]) == 0.2  # a near-dead second tier still keeps a meeting region
    assert partial_fraction([2.7e9]) == 1.0 and partial_fraction([0.0, 0.0]) == 1.0
    assert partial_fraction([2.7e9, float("nan")]) == 1.0


def test_the_replay_resolves_measured_into_a_spec_the_store_parses():
    spec = _replication("measured", [1.6e9, 0.5e9])
    assert spec == "partial:0.36"
    pol = parse_replication(spec)
    assert isinstance(pol, PartialReplication) and pol.fraction == 0.36
    # about 36 % of a prefix's chunks get the second copy, spread along it
    dual = sum(1 for i in range(1000) if len(pol.targets(WriteIntent(key=b"k%d" % i, nbytes=1, position=i), 2)) == 2)
    assert 320 <= dual <= 400
    assert _replication("measured", [1.3e9, 2.7e9]) == "full"
    assert _replication("full", [2.7e9, 0.4e9]) == "full" and _replication("single", [1.0]) == "single"
