"""kvstream.compute.loaded_prefix: the shorter hit a serial loader (LMCache) reports, against brute force.

Values are whole numbers (as floats), so every sum is exact and a tie is a real tie.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.compute import loaded_prefix

_loads = st.integers(0, 1000).map(float) | st.just(math.inf)  # inf: a tier measured delivering nothing
_costs = st.integers(0, 1000).map(float)


def _total(load_s: list[float], cost_s: list[float], k: int) -> float:
    return sum(load_s[:k]) + sum(cost_s[k:])


def _brute(load_s: list[float], cost_s: list[float]) -> int:
    totals = [_total(load_s, cost_s, k) for k in range(len(load_s) + 1)]
    best = min(totals)
    return max(k for k, t in enumerate(totals) if t == best)  # ties: the larger k


@st.composite
def _case(draw: st.DrawFn) -> tuple[list[float], list[float]]:
    n = draw(st.integers(0, 12))
    load_s = draw(st.lists(_loads, min_size=n, max_size=n))
    if draw(st.booleans()):  # costs growing with position, as a prefill's do
        steps = draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
        cost_s = [float(sum(steps[: j + 1])) for j in range(n)]
    else:
        cost_s = draw(st.lists(_costs, min_size=n, max_size=n))
    return load_s, cost_s


@settings(max_examples=600, deadline=None)
@given(_case())
def test_loaded_prefix_is_the_optimum_ties_to_the_larger_k(case: tuple[list[float], list[float]]) -> None:
    load_s, cost_s = case
    k = loaded_prefix(load_s, cost_s)
    assert 0 <= k <= len(load_s)
    assert k == _brute(load_s, cost_s)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 1000), st.integers(0, 1000)), max_size=12))
def test_every_chunk_loading_no_slower_than_recomputing_loads_all(pairs: list[tuple[int, int]]) -> None:
    load_s = [float(min(a, b)) for a, b in pairs]
    cost_s = [float(max(a, b)) for a, b in pairs]
    assert loaded_prefix(load_s, cost_s) == len(pairs)


@settings(max_examples=600, deadline=None)
@given(_case(), st.data())
def test_a_slower_load_never_lengthens_the_prefix(case: tuple[list[float], list[float]], data: st.DataObject
                                                  ) -> None:
    load_s, cost_s = case
    if not load_s:
        return
    j = data.draw(st.integers(0, len(load_s) - 1))
    slower = list(load_s)
    slower[j] += data.draw(st.integers(1, 2000).map(float) | st.just(math.inf))
    assert loaded_prefix(slower, cost_s) <= loaded_prefix(load_s, cost_s)


def test_equal_loads_and_growing_costs_are_all_or_nothing() -> None:
    cost_s = [1.0 + j for j in range(8)]  # 1..8: sum 36
    for load in (0.5, 3.0, 4.0, 4.5, 5.0, 9.0):
        assert loaded_prefix([load] * 8, cost_s) in (0, 8)
    assert loaded_prefix([4.5] * 8, cost_s) == 8  # 36 == 36: a tie, the larger k
    assert loaded_prefix([4.6] * 8, cost_s) == 0


def test_fast_front_slow_tail_stops_where_the_slow_chunks_begin() -> None:
    cost_s = [1.0 + j for j in range(8)]
    load_s = [0.0, 0.0, 0.1, 0.1, 50.0, 50.0, 50.0, 50.0]  # memory, memory, fast tier, fast tier, slow tier...
    assert loaded_prefix(load_s, cost_s) == 4
    assert loaded_prefix(load_s[:4] + [math.inf] * 4, cost_s) == 4
    assert loaded_prefix([], []) == 0


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="2 load times but 1 costs"):
        loaded_prefix([0.0, 1.0], [1.0])
