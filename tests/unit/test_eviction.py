"""Eviction policies: the protocol's invariants, reference models, hand-made sequences and Belady's bound."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.eviction import (
    AccessMeta,
    BeladyPolicy,
    EvictionPolicy,
    FIFOPolicy,
    HitPotentialConfig,
    HitPotentialPolicy,
    InclusivePolicy,
    LFUPolicy,
    LRUPolicy,
    NextUseOracle,
    QueueAwarePolicy,
    ReuseDistanceTracker,
    _GhostBelady,
    eviction_policy_names,
    make_eviction_policy,
)

ONLINE = ["lru", "fifo", "lfu", "queue-aware", "inclusive", "hit-potential"]


def _make(name: str, capacity: int = 10, future: list[Hashable] | None = None) -> EvictionPolicy:
    if name == "belady":
        return make_eviction_policy("belady", next_use=NextUseOracle.from_sequence(future or []))
    if name == "hit-potential":
        return make_eviction_policy("hit-potential", capacity_bytes=capacity)
    return make_eviction_policy(name)


# ---------------------------------------------------------------------------------------------------------------
# registry


def test_registry_names_and_errors() -> None:
    assert set(eviction_policy_names()) == {"lru", "fifo", "lfu", "queue-aware", "inclusive", "belady", "hit-potential"}
    with pytest.raises(KeyError, match="known: .*belady.*hit-potential.*lru"):
        make_eviction_policy("arc")
    with pytest.raises(TypeError, match="next_use"):
        make_eviction_policy("belady")
    with pytest.raises(TypeError, match="capacity_bytes"):
        make_eviction_policy("hit-potential")
    with pytest.raises(TypeError, match="takes no options"):
        make_eviction_policy("lru", capacity_bytes=3)
    assert isinstance(make_eviction_policy("lru"), LRUPolicy)  # the original signature still works


# ---------------------------------------------------------------------------------------------------------------
# protocol invariants, every policy, random operation sequences

ops = st.lists(
    st.tuples(st.sampled_from(["insert", "access", "remove", "victim"]), st.integers(0, 7), st.integers(1, 5)),
    max_size=60,
)


@pytest.mark.parametrize("name", [*ONLINE, "belady"])
@settings(max_examples=60, deadline=None)
@given(seq=ops)
def test_protocol_invariants(name: str, seq: list[tuple[str, int, int]]) -> None:
    policy = _make(name, capacity=8, future=[k for _op, k, _s in seq])
    resident: set[int] = set()
    for i, (op, key, size) in enumerate(seq):
        meta = AccessMeta(session=key % 3, prev_answer_tokens=size * 10, round_index=i, position=key)
        if op == "insert":
            policy.on_insert(key, size, now=float(i), meta=meta)
            resident.add(key)
        elif op == "access":
            policy.on_access(key, now=float(i), meta=meta)  # ignored when not resident
        elif op == "remove":
            policy.on_remove(key)
            resident.discard(key)
        v = policy.victim(now=float(i))
        assert policy.victim(now=float(i)) == v  # no side effect
        assert (v is None) == (not resident)
        assert v is None or v in resident
        assert len(policy) == len(resident)
        assert all(k in policy for k in resident)


# ---------------------------------------------------------------------------------------------------------------
# reference models


class _RefLRU:
    def __init__(self) -> None:
        self.order: list[int] = []

    def touch(self, k: int) -> None:
        if k in self.order:
            self.order.remove(k)
        self.order.append(k)

    def remove(self, k: int) -> None:
        if k in self.order:
            self.order.remove(k)

    def victim(self) -> int | None:
        return self.order[0] if self.order else None


@settings(max_examples=80, deadline=None)
@given(seq=ops)
def test_lru_fifo_lfu_match_reference_models(seq: list[tuple[str, int, int]]) -> None:
    lru, fifo, lfu = LRUPolicy(), FIFOPolicy(), LFUPolicy()
    ref_lru = _RefLRU()
    fifo_order: list[int] = []
    counts: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for i, (op, key, size) in enumerate(seq):
        if op == "insert":
            for p in (lru, fifo, lfu):
                p.on_insert(key, size)
            ref_lru.touch(key)
            if key not in fifo_order:
                fifo_order.append(key)
            counts[key] = counts.get(key, 0) + 1
            last_use[key] = i
        elif op == "access":
            for p in (lru, fifo, lfu):
                p.on_access(key)
            if key in counts:
                ref_lru.touch(key)
                counts[key] += 1
                last_use[key] = i
        elif op == "remove":
            for p in (lru, fifo, lfu):
                p.on_remove(key)
            ref_lru.remove(key)
            if key in fifo_order:
                fifo_order.remove(key)
            counts.pop(key, None)
            last_use.pop(key, None)
        assert lru.victim() == ref_lru.victim()
        assert fifo.victim() == (fifo_order[0] if fifo_order else None)
        want = min(counts, key=lambda k: (counts[k], last_use[k])) if counts else None
        assert lfu.victim() == want


def test_fifo_ignores_hits_but_lru_does_not() -> None:
    lru, fifo = LRUPolicy(), FIFOPolicy()
    for p in (lru, fifo):
        p.on_insert("a", 1)
        p.on_insert("b", 1)
        p.on_access("a")
        p.on_insert("a", 2)  # a grown entry re-inserted: FIFO keeps its place
    assert fifo.victim() == "a"
    assert lru.victim() == "b"


# ---------------------------------------------------------------------------------------------------------------
# queue-aware and inclusive


def test_conversation_inside_lookahead_window_is_not_evicted() -> None:
    qa = QueueAwarePolicy()
    for i, user in enumerate(["alice", "bob", "carol"]):
        qa.on_insert(f"{user}/0", 1, now=i, meta=AccessMeta(session=user))
        qa.on_insert(f"{user}/1", 1, now=i, meta=AccessMeta(session=user))
    assert qa.victim() == "alice/0"  # plain LRU
    qa.set_window(["alice", "carol"])  # the waiting queue's look-ahead window needs alice and carol
    evicted = []
    while (v := qa.victim()) is not None and not qa.is_protected(v):
        evicted.append(v)
        qa.on_remove(v)
    assert evicted == ["bob/0", "bob/1"]
    # Only protected entries are left: the policy must still name one (least recent first), never None.
    assert qa.victim() == "alice/0"
    qa.set_window(["carol"])  # alice left the window: she is back at her LRU place, ahead of carol
    assert qa.victim() == "alice/0"
    qa.set_window([])
    qa.on_access("alice/0")
    assert qa.victim() == "alice/1"


def test_queue_aware_protection_is_reference_counted() -> None:
    qa = QueueAwarePolicy()
    qa.on_insert("x", 1, meta=AccessMeta(session="s"))
    qa.on_insert("y", 1)
    qa.protect(session="s")
    qa.protect(session="s")  # the same conversation queued twice
    qa.release(session="s")
    assert qa.victim() == "y"  # still protected once
    qa.release(session="s")
    assert qa.victim() == "x"
    with pytest.raises(ValueError, match="released"):
        qa.release(session="s")


def test_inclusive_keeps_entries_held_by_the_upper_level() -> None:
    inc = InclusivePolicy()
    for k in "abc":
        inc.on_insert(k, 1)
    inc.hold_upper("a")  # "a" is also in GPU memory: evicting it from host would break inclusion
    assert inc.victim() == "b"
    inc.release_upper("a")
    assert inc.victim() == "a"


# ---------------------------------------------------------------------------------------------------------------
# Belady's bound


def _misses(policy: EvictionPolicy, seq: list[int], capacity: int) -> int:
    misses = 0
    for i, k in enumerate(seq):
        meta = AccessMeta(session=k, prev_answer_tokens=(k * 37) % 300, round_index=i)
        if k in policy:
            policy.on_access(k, now=float(i), meta=meta)
        else:
            misses += 1
            policy.on_insert(k, 1, now=float(i), meta=meta)
            while len(policy) > capacity:
                policy.on_remove(policy.victim(now=float(i)))
    return misses


@settings(max_examples=150, deadline=None)
@given(seq=st.lists(st.integers(0, 9), min_size=1, max_size=80), capacity=st.integers(1, 6))
def test_belady_never_misses_more_than_any_policy(seq: list[int], capacity: int) -> None:
    best = _misses(_make("belady", future=seq), seq, capacity)
    for name in ONLINE:
        assert best <= _misses(_make(name, capacity=capacity), seq, capacity), name


def test_belady_evicts_farthest_next_use_and_never_used_first() -> None:
    seq = ["a", "b", "c", "a", "b", "a"]
    bel = BeladyPolicy(NextUseOracle.from_sequence(seq))
    for i, k in enumerate(seq[:3]):
        bel.on_insert(k, 1, now=float(i))
    assert bel.victim() == "c"  # never used again
    bel.on_remove("c")
    assert bel.victim() == "b"  # next used at 4, after a at 3


def test_next_use_oracle() -> None:
    o = NextUseOracle({"k": [1.0, 5.0, 9.0]})
    assert o("k", 0.0) == 1.0
    assert o("k", 1.0) == 5.0
    assert o("k", 9.0) == math.inf
    assert o("other", 0.0) == math.inf
    with pytest.raises(ValueError, match="not sorted"):
        NextUseOracle({"k": [3.0, 1.0]})


# ---------------------------------------------------------------------------------------------------------------
# weighted reuse distance


@settings(max_examples=60, deadline=None)
@given(
    visits=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 50)), max_size=120),
    forget_at=st.sets(st.integers(0, 119), max_size=5),
)
def test_reuse_distance_tracker_matches_brute_force(visits: list[tuple[int, int]], forget_at: set[int]) -> None:
    tracker = ReuseDistanceTracker(capacity=16)  # small, so compaction happens
    history: list[tuple[int, int]] = []  # (group, weight), forgotten groups' rows dropped
    for i, (g, w) in enumerate(visits):
        if i in forget_at and g in tracker:
            tracker.forget(g)
            history = [(gg, ww) for gg, ww in history if gg != g]
        d = tracker.visit(g, w)
        prev = max((j for j, (gg, _) in enumerate(history) if gg == g), default=None)
        if prev is None:
            assert d is None
        else:
            latest: dict[int, int] = {}
            for gg, ww in history[prev + 1 :]:
                latest[gg] = ww
            assert d == sum(latest.values())
        history.append((g, w))
        assert tracker.total() == sum({gg: ww for gg, ww in history}.values())


def test_tracker_accumulates_a_visits_bytes() -> None:
    t = ReuseDistanceTracker()
    t.visit("a", 10)
    t.visit("b", 5)
    t.add_bytes("b", 7)  # b's visit touched more chunks
    assert t.elapsed("a") == 12
    assert t.visit("a", 1) == 12
    with pytest.raises(KeyError):
        t.add_bytes("nobody", 1)


# ---------------------------------------------------------------------------------------------------------------
# hit potential


def _train(policy: HitPotentialPolicy, rounds: int = 60, seed: int = 0) -> None:
    """Conversations whose next visit comes soon after a short answer and late after a long one.

    Each step visits every "short" conversation (answer 10 tokens) and, every 8th step, every "long" one (answer
    300 tokens), so short conversations return after a small distance and long ones after a large one.
    """
    rng = random.Random(seed)
    rnd: dict[str, int] = {}
    shorts = [f"s{i}" for i in range(6)]
    longs = [f"l{i}" for i in range(6)]
    for step in range(rounds):
        batch = list(shorts) + (list(longs) if step % 8 == 0 else [])
        rng.shuffle(batch)
        for conv in batch:
            rnd[conv] = rnd.get(conv, -1) + 1
            ans = 10 if conv.startswith("s") else 300
            key = conv
            if key in policy:
                policy.on_access(key, meta=AccessMeta(session=conv, prev_answer_tokens=ans, round_index=rnd[conv]))
            else:
                policy.on_insert(key, 1, meta=AccessMeta(session=conv, prev_answer_tokens=ans, round_index=rnd[conv]))


def test_hit_potential_learns_answer_length_and_evicts_long_answers_first() -> None:
    cfg = HitPotentialConfig(min_samples=4, refresh_every=1)
    hp = HitPotentialPolicy(capacity_bytes=8, config=cfg)  # 12 one-byte conversations, room for 8
    _train(hp)
    pots = hp.bin_potentials()
    short_bin = hp._answer_bin(10)
    long_bin = hp._answer_bin(300)
    assert pots[short_bin] > pots[long_bin]
    # A fresh long-answer conversation and an older short-answer one: LRU would evict the older (short) one,
    # hit potential evicts the long one.
    hp2 = HitPotentialPolicy(capacity_bytes=8, config=cfg)
    _train(hp2)
    for k in list(hp2._key_group):
        hp2.on_remove(k)
    hp2.on_insert("old-short", 1, meta=AccessMeta(session="old-short", prev_answer_tokens=10, round_index=0))
    hp2.on_insert("new-long", 1, meta=AccessMeta(session="new-long", prev_answer_tokens=300, round_index=0))
    assert hp2.victim() == "new-long"
    lru = LRUPolicy()
    lru.on_insert("old-short", 1)
    lru.on_insert("new-long", 1)
    assert lru.victim() == "old-short"


def test_hit_potential_drops_conversations_that_stay_away() -> None:
    cfg = HitPotentialConfig(min_samples=4, refresh_every=1)
    hp = HitPotentialPolicy(capacity_bytes=8, config=cfg)
    _train(hp)
    # A short-answer conversation that then stays away while lots of others are visited: beyond its bin's
    # observed returns it reaches the extreme range and goes before a just-visited long-answer conversation.
    hp.on_insert("gone", 1, meta=AccessMeta(session="gone", prev_answer_tokens=10, round_index=0))
    assert hp.potential("gone") == pytest.approx(hp.bin_potentials()[hp._answer_bin(10)])
    for j in range(200):
        hp.on_insert(f"x{j}", 1, meta=AccessMeta(session=f"x{j}", prev_answer_tokens=300, round_index=0))
        hp.on_remove(f"x{j}")
    hp.on_insert("fresh-long", 1, meta=AccessMeta(session="fresh-long", prev_answer_tokens=300, round_index=0))
    assert hp.potential("gone") == 0.0
    for k in [k for k in hp._key_group if k not in ("gone", "fresh-long")]:
        hp.on_remove(k)
    assert hp.victim() == "gone"


def test_hit_potential_evicts_a_conversations_tail_chunk_first() -> None:
    hp = HitPotentialPolicy(capacity_bytes=100)
    for pos in (0, 1, 2):
        hp.on_insert(("c", pos), 1, meta=AccessMeta(session="c", prev_answer_tokens=5, round_index=0, position=pos))
    assert hp.victim() == ("c", 2)
    hp.on_remove(("c", 2))
    assert hp.victim() == ("c", 1)


def test_hit_potential_groups_chunk_events_into_visits() -> None:
    hp = HitPotentialPolicy(capacity_bytes=100)
    for r in range(3):  # three rounds of conversation "a", interleaved with "b", each touching two chunks
        for conv in ("a", "b"):
            for pos in range(2):
                hp.on_insert((conv, r, pos), 4, meta=AccessMeta(session=conv, prev_answer_tokens=50, round_index=r, position=pos))
    # Each round of "a" saw one visit of "b" in between, weighing its two chunks: 8 bytes.
    assert hp._tracker.elapsed("a") == 8
    assert sum(sum(row) for row in hp.histogram()) == 4  # re-visits: a twice, b twice


def test_ghost_cache_hits_match_offline_belady() -> None:
    rng = random.Random(3)
    seq = [rng.randrange(12) for _ in range(400)]
    ghost = _GhostBelady(capacity=5, horizon=10**9, n_buckets=1, half_life=10**9)
    for g in seq:
        rec = ghost.add_visit(g, 0, 0)
        ghost.add_bytes(rec, 1)
    ghost.flush()
    first_visits = len(set(seq))
    bel_misses = _misses(_make("belady", future=seq), seq, 5)
    assert ghost.total[0] == len(seq)
    assert ghost.hits[0] == len(seq) - bel_misses
    assert first_visits <= bel_misses


def test_hit_potential_config_validation() -> None:
    with pytest.raises(ValueError, match="answer_edges"):
        HitPotentialConfig(answer_edges=(10, 5))
    with pytest.raises(ValueError, match="capacity_bytes"):
        HitPotentialPolicy(capacity_bytes=0)


def _departure_run(one_offs: bool) -> HitPotentialPolicy:
    """Conversations "b0".."b3" (answer 300) return every 16 steps; with ``one_offs``, other answer-300
    conversations appear once and never return. Conversations "a0".."a3" (answer 10) return every 4 steps."""
    cfg = HitPotentialConfig(min_samples=2, refresh_every=1)
    hp = HitPotentialPolicy(capacity_bytes=4, config=cfg)
    rnd: dict[str, int] = {}
    for step in range(400):
        convs = [(f"a{step % 4}", 10)]
        if step % 16 < 4:
            convs.append((f"b{step % 4}", 300))
        elif one_offs:
            convs.append((f"once{step}", 300))
        for conv, ans in convs:
            rnd[conv] = rnd.get(conv, -1) + 1
            hp.on_insert(conv, 1, meta=AccessMeta(session=conv, prev_answer_tokens=ans, round_index=rnd[conv]))
            hp.on_remove(conv)  # nothing stays resident; only the model is exercised
    return hp


def test_departed_conversations_lower_their_bins_potential() -> None:
    # Conversations that never come back are counted as departed once they have been away beyond the last
    # distance edge: the answer-300 bin's potential drops, its returning conversations' distances unchanged.
    with_departures, without = _departure_run(True), _departure_run(False)
    long_bin = with_departures._answer_bin(300)
    assert with_departures._departed[long_bin] > 0 and without._departed[long_bin] == 0
    assert with_departures.bin_potentials()[long_bin] < without.bin_potentials()[long_bin]
    assert len(with_departures._groups) < 120  # of 308 seen: departed ones with nothing resident were forgotten
