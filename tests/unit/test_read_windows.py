"""Per-tier read windows: sized by measured speed so every tier's window drains in about the same time."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from kvstream.read_windows import BandwidthBalancedWindows, FixedWindows, make_read_windows

MiB = 1 << 20


def test_unobserved_tiers_keep_their_configured_windows():
    w = BandwidthBalancedWindows([32 * MiB, 32 * MiB])
    assert w.windows() == [32 * MiB, 32 * MiB]
    w.observe(0, 100 * MiB, 0.1)  # only one tier seen: no ratio yet
    assert w.windows() == [32 * MiB, 32 * MiB]


def test_slow_tier_window_shrinks_by_the_speed_ratio():
    w = BandwidthBalancedWindows([32 * MiB, 32 * MiB], alpha=1.0)
    w.observe(0, 1500 * MiB, 1.0)  # 1.5 "GB/s"
    w.observe(1, 400 * MiB, 1.0)
    assert w.window(0) == 32 * MiB
    assert w.window(1) == pytest.approx(32 * MiB * 400 / 1500, rel=1e-6)
    # the drain times match: window / bandwidth equal on both tiers
    assert w.window(0) / 1500 == pytest.approx(w.window(1) / 400, rel=1e-6)


def test_floor_and_cap():
    w = BandwidthBalancedWindows([32 * MiB, 8 * MiB], alpha=1.0, min_bytes=7 * MiB)
    w.observe(0, 100 * MiB, 1.0)
    w.observe(1, 1 * MiB, 1.0)  # a hundred times slower: floor at one chunk
    assert w.window(1) == 7 * MiB
    w.observe(1, 10_000 * MiB, 1.0)  # now far faster: its own window caps it, and tier 0 shrinks instead
    assert w.window(1) == 8 * MiB
    assert w.window(0) < 32 * MiB


def test_small_or_idle_samples_are_ignored_and_estimate_is_smoothed():
    w = BandwidthBalancedWindows([32 * MiB, 32 * MiB], alpha=0.5, min_sample_bytes=MiB)
    w.observe(0, 10, 0.5)  # too few bytes to say anything about bandwidth
    w.observe(1, 10 * MiB, 0.0)  # no busy time
    assert w.bandwidth == [None, None]
    w.observe(1, 0, 0.5)  # busy a whole step, nothing landed: a zero-speed sample
    assert w.bandwidth[1] == 0.0
    w.observe(0, 100 * MiB, 1.0)
    w.observe(0, 300 * MiB, 1.0)
    assert w.bandwidth[0] == pytest.approx(200 * MiB)


def test_a_tier_that_lands_nothing_drops_to_the_floor_then_recovers():
    w = BandwidthBalancedWindows([32 * MiB, 32 * MiB], alpha=0.5, min_bytes=7 * MiB)
    w.observe(0, 90 * MiB, 0.06)
    w.observe(1, 0, 0.06)
    assert w.window(1) == 7 * MiB and w.window(0) == 32 * MiB
    for _ in range(20):
        w.observe(1, 400 * MiB, 1.0)
        w.observe(0, 1500 * MiB, 1.0)
    assert w.window(1) == pytest.approx(32 * MiB * 400 / 1500, rel=0.01)


def test_fixed_windows_never_move_and_names_are_checked():
    w = make_read_windows("fixed", [4 * MiB, 16 * MiB])
    assert isinstance(w, FixedWindows)
    w.observe(0, 100 * MiB, 1.0)
    w.observe(1, 1 * MiB, 1.0)
    assert w.windows() == [4 * MiB, 16 * MiB]
    with pytest.raises(ValueError, match="balanced"):
        make_read_windows("balance", [MiB])


@given(budgets=st.lists(st.integers(0, 1 << 30), min_size=1, max_size=4),
       samples=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 32), st.floats(0, 10)), max_size=30),
       floor=st.integers(0, 1 << 26))
def test_windows_stay_between_floor_and_budget(budgets, samples, floor):
    w = BandwidthBalancedWindows(budgets, min_bytes=floor)
    for t, nbytes, busy in samples:
        w.observe(t % len(budgets), nbytes, busy)
        for i, b in enumerate(budgets):
            assert min(floor, b) <= w.window(i) <= b


def test_a_recovered_tier_is_measured_afresh():
    """A stall drives a tier's estimate toward zero; once its breaker closes the estimate is dropped, so the
    tier gets its full window back instead of climbing out of the EWMA over many steps."""
    from kvstream.health import CircuitBreaker

    w = BandwidthBalancedWindows([8 << 20, 8 << 20], min_bytes=1 << 20)
    w.observe(0, 8 << 20, 0.01)
    w.observe(1, 8 << 20, 0.04)
    for _ in range(30):
        w.observe(0, 0, 1.0)  # stalled: busy whole steps, nothing landed
    assert w.window(0) == 1 << 20
    b = CircuitBreaker(threshold=1)
    b.on_failure(0.0)
    assert b.usable(b.retry_at) and b.state == "half-open"
    assert b.on_success() is True and b.on_success() is False  # only the first success is a recovery
    w.forget(0)
    assert w.bandwidth_estimate(0) is None and w.window(0) == 8 << 20
    w.observe(0, 8 << 20, 0.01)
    assert w.bandwidth_estimate(0) == pytest.approx((8 << 20) / 0.01)  # the first sample, not an EWMA step
