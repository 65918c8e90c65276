"""Read routers, driven by hand-made event sequences and by hypothesis."""

from __future__ import annotations

import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.errors import ConfigError
from kvstream.routing import FixedSplit, MeetInTheMiddle, SingleTier, order_for_tiers, parse_router


def drive(router, holders, speeds, *, window=4, fail=frozenset(), seed=0, jitter=0.0, check_peek=False):
    """Event-driven run: each tier serves its reads one after another at ``speeds[t]`` chunks/s, keeping up to
    ``window`` chunks claimed. ``fail`` holds (tier, chunk) pairs that fail. Returns (finish time, schedule, log).
    ``check_peek``: every claim of chunks nobody has claimed yet is what ``peek`` foretold just before it."""
    rng = random.Random(seed)
    n_t = len(speeds)
    s = router.schedule(holders, n_t)
    claimed_by: dict[int, set[int]] = {}
    log = []
    ev: list = []
    free_at = [0.0] * n_t
    inflight = [0] * n_t
    seq = 0
    ever_claimed: set[int] = set()

    def fill(t, now):
        nonlocal seq
        while inflight[t] < window:
            ahead = s.peek(t, 8) if check_peek else []
            claim = s.next_claim(t)
            if not claim:
                return
            if check_peek and not any(claimed_by.get(i) for i in claim) and not s._retry:
                assert claim == ahead[: len(claim)], f"tier {t} claimed {claim}, peek said {ahead}"
            for i in claim:
                assert t in holders[i], f"tier {t} given chunk {i} it does not hold"
                unclaimed_held = [c for c in range(len(holders)) if t in holders[c] and c not in ever_claimed]
                if claimed_by.get(i):
                    log.append(("dup", t, i, bool(unclaimed_held)))
                ever_claimed.add(i)
                claimed_by.setdefault(i, set()).add(t)
                start = max(now, free_at[t])
                free_at[t] = start + (1 + rng.uniform(-jitter, jitter)) / speeds[t]
                inflight[t] += 1
                seq += 1
                heapq.heappush(ev, (free_at[t], seq, t, i))

    for t in range(n_t):
        fill(t, 0.0)
    landed: dict[int, int] = {}
    now = 0.0
    while ev and not s.finished:
        now, _, t, i = heapq.heappop(ev)
        inflight[t] -= 1
        if (t, i) in fail:
            s.on_failed(t, i)
        elif s.on_landed(t, i):
            assert i not in landed, f"chunk {i} delivered twice"
            landed[i] = t
        for u in range(n_t):
            fill(u, now)
    return now, s, landed, log


def test_two_tiers_meet_where_speeds_put_them():
    t, s, landed, _ = drive(MeetInTheMiddle(), [{0, 1}] * 100, [3.0, 1.0], window=1)
    assert sorted(landed) == list(range(100))
    assert abs(t - 25.0) <= 1.0  # bound: 100 chunks / 4 chunks per second
    assert s.stats[0].landed == 75 and s.stats[1].landed == 25
    # tier 0 read a front run, tier 1 a back run
    assert all(landed[i] == 0 for i in range(70)) and all(landed[i] == 1 for i in range(80, 100))


def test_fixed_split_only_matches_when_ratio_matches_speeds():
    good, *_ = drive(FixedSplit((0.75,)), [{0, 1}] * 100, [3.0, 1.0], window=1)
    bad, *_ = drive(FixedSplit((0.5,)), [{0, 1}] * 100, [3.0, 1.0], window=1)
    mitm, *_ = drive(MeetInTheMiddle(), [{0, 1}] * 100, [3.0, 1.0], window=1)
    assert good == pytest.approx(25.0, abs=0.5)
    assert bad == pytest.approx(50.0, abs=0.5)
    assert mitm <= good + 0.5


def test_slowdown_moves_the_meeting_point():
    fast, s1, *_ = drive(MeetInTheMiddle(), [{0, 1}] * 60, [2.0, 1.0], window=1)
    slowed, s2, *_ = drive(MeetInTheMiddle(), [{0, 1}] * 60, [1.0, 1.0], window=1)
    assert s1.stats[0].landed > s2.stats[0].landed


def test_order_puts_front_only_first_and_back_only_last():
    holders = [{1}, {0, 1}, {0}, {1}, {0}, {0, 1}]
    order = order_for_tiers(holders, 2)
    assert [holders[i] for i in order] == [{0}, {0}, {0, 1}, {0, 1}, {1}, {1}]


def test_single_holder_chunks_go_to_their_holder():
    holders = [{0}] * 5 + [{0, 1}] * 10 + [{1}] * 5
    _, s, landed, _ = drive(MeetInTheMiddle(), holders, [1.0, 1.0], window=2)
    assert all(landed[i] == 0 for i in range(5)) and all(landed[i] == 1 for i in range(15, 20))


def test_steal_happens_only_in_the_meeting_region_and_cuts_the_tail():
    with_steal, s, _, log = drive(MeetInTheMiddle(), [{0, 1}] * 20, [4.0, 1.0], window=6)
    no_steal, *_ = drive(MeetInTheMiddle(steal=False), [{0, 1}] * 20, [4.0, 1.0], window=6)
    assert with_steal < no_steal
    assert log and all(not had_unclaimed for (_, _, _, had_unclaimed) in log)


def test_a_tier_reading_a_stolen_chunk_may_steal_the_next_one():
    """Steals are bounded by the driver's read window, not one at a time: a tier whose in-flight read is a
    stolen chunk is offered the next one (the store's read loop relies on this: it refills a tier once per
    landed read, before telling the schedule the read landed)."""
    s = MeetInTheMiddle().schedule([{0, 1}] * 4, 2)
    assert (s.next_claim(1), s.next_claim(1)) == ([3], [2])
    assert (s.next_claim(0), s.next_claim(0)) == ([0], [1])
    assert s.on_landed(0, 0) and s.on_landed(0, 1)
    assert s.next_claim(0) == [2]  # tier 1's latest claim, nearest tier 0's home
    assert s.next_claim(0) == [3]  # and the next, while the first steal is still in flight
    assert s.next_claim(0) == []  # each chunk is read at most twice


def test_failed_chunk_is_read_from_the_other_replica():
    _, s, landed, _ = drive(MeetInTheMiddle(), [{0, 1}] * 10, [1.0, 1.0], window=1, fail={(0, 0), (1, 9)})
    assert sorted(landed) == list(range(10))
    assert landed[0] == 1 and landed[9] == 0
    assert s.lost() == []


def test_chunk_failed_by_its_only_holder_is_lost():
    _, s, landed, _ = drive(MeetInTheMiddle(), [{0}, {0, 1}, {1}], [1.0, 1.0], window=1, fail={(0, 0)})
    assert s.lost() == [0] and sorted(landed) == [1, 2] and s.finished


def test_chunk_with_no_holder_is_lost_at_once():
    s = MeetInTheMiddle().schedule([set(), {0}], 1)
    assert s.lost() == [0] and not s.finished


def test_three_tiers_each_start_at_their_home():
    s = MeetInTheMiddle().schedule([{0, 1, 2}] * 9, 3)
    assert (s.next_claim(0), s.next_claim(1), s.next_claim(2)) == ([0], [4], [8])
    t, s, landed, _ = drive(MeetInTheMiddle(), [{0, 1, 2}] * 99, [3.0, 1.0, 2.0], window=1)
    assert t == pytest.approx(99 / 6, rel=0.05)


def test_hedge_duplicates_a_stuck_chunk_once():
    s = MeetInTheMiddle().schedule([{0, 1}] * 4, 2)
    a = s.next_claim(0)
    assert s.hedge(1, a) == a
    assert s.hedge(1, a) == []  # already reading it
    assert s.on_landed(1, a[0]) is True and s.on_landed(0, a[0]) is False
    assert s.duplicates() == 1


def test_reporting_an_unclaimed_chunk_is_an_error():
    s = MeetInTheMiddle().schedule([{0, 1}] * 4, 2)
    with pytest.raises(ValueError, match="was not reading"):
        s.on_landed(0, 3)


@pytest.mark.parametrize(
    "spec,expect",
    [("mitm", MeetInTheMiddle(batch=1)), ("mitm:4", MeetInTheMiddle(batch=4)),
     ("fixed:0.7", FixedSplit((0.7,))), ("single:shared", SingleTier(tier=1))],
)
def test_parse_router(spec, expect):
    assert parse_router(spec, ["local", "shared"]) == expect


@pytest.mark.parametrize("spec", ["mitm:0", "fixed", "fixed:x", "single:nope", "roundrobin", "fixed:0.8,0.8"])
def test_parse_router_rejects_bad_specs_naming_the_field(spec):
    with pytest.raises(ConfigError, match="router"):
        parse_router(spec, ["local", "shared"])


holders_st = st.integers(2, 3).flatmap(
    lambda n_t: st.tuples(
        st.just(n_t),
        st.lists(st.sets(st.integers(0, n_t - 1), min_size=0, max_size=n_t), min_size=0, max_size=40),
        st.lists(st.floats(0.2, 5.0), min_size=n_t, max_size=n_t),
    )
)


@settings(max_examples=150, deadline=None)
@given(holders_st, st.integers(1, 4), st.integers(1, 6), st.sampled_from(["mitm", "fixed", "single"]),
       st.sets(st.tuples(st.integers(0, 2), st.integers(0, 39)), max_size=10), st.integers(0, 10**6))
def test_every_chunk_delivered_once_or_lost(params, batch, window, kind, fail, seed):
    n_t, holders, speeds = params
    router = {"mitm": MeetInTheMiddle(batch=batch), "fixed": FixedSplit((0.6,), batch=batch),
              "single": SingleTier(tier=0, batch=batch)}[kind]
    _, s, landed, log = drive(router, holders, speeds, window=window, fail=fail, seed=seed, jitter=0.5)
    assert s.finished
    lost = set(s.lost())
    assert set(landed) | lost == set(range(len(holders))) and not set(landed) & lost
    for i in lost:  # lost only when every holder failed it (or there was none)
        assert all((t, i) in fail for t in holders[i])
    if not fail:  # second claims of a chunk only once the claiming tier had nothing unclaimed left
        assert all(not had_unclaimed for (_, _, _, had_unclaimed) in log)
        assert kind == "mitm" or not log  # the baselines never read a chunk twice


@settings(max_examples=100, deadline=None)
@given(holders_st, st.integers(1, 4), st.integers(1, 6), st.sampled_from(["mitm", "fixed", "single"]),
       st.integers(0, 10**6))
def test_peek_foretells_the_next_fresh_claims_and_changes_nothing(params, batch, window, kind, seed):
    n_t, holders, speeds = params
    def router():
        return {"mitm": MeetInTheMiddle(batch=batch), "fixed": FixedSplit((0.6,), batch=batch),
                "single": SingleTier(tier=0, batch=batch)}[kind]
    t1, s1, landed1, log1 = drive(router(), holders, speeds, window=window, seed=seed, jitter=0.5, check_peek=True)
    t2, s2, landed2, log2 = drive(router(), holders, speeds, window=window, seed=seed, jitter=0.5)
    assert (t1, landed1, log1) == (t2, landed2, log2)  # peeking left the schedule as it was


def test_peek_on_a_fresh_mitm_schedule_walks_from_each_tier_home():
    s = MeetInTheMiddle(batch=2).schedule([{0, 1}] * 6, 2)
    assert s.peek(0, 3) == [0, 1, 2] and s.peek(1, 3) == [5, 4, 3]
    assert s.next_claim(0) == [0, 1] and s.peek(0, 2) == [2, 3] and s.peek(1, 10) == [5, 4, 3, 2]


@settings(max_examples=60, deadline=None)
@given(st.integers(20, 80), st.floats(2.0, 6.0), st.integers(1, 4))
def test_faster_tier_reads_more_and_time_is_near_the_bound(n, ratio, batch):
    t, s, _, _ = drive(MeetInTheMiddle(batch=batch), [{0, 1}] * n, [ratio, 1.0], window=batch)
    assert s.stats[0].landed > s.stats[1].landed
    assert t <= n / (ratio + 1.0) + 2 * batch  # within the last batch of the bound
