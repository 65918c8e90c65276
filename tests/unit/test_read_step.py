"""The read-step machine (kvstream.read_step) against a model, with hypothesis.

A random step (chunks held by random tiers, random sizes, targets that may take a read in place) is driven by
random events in any order a driver could produce: opens that succeed or fail, reads that land, checks that pass
or fail, time passing (hedging, busy targets), and the consumer closing early. What must hold at every point and
at the end:

- every chunk is resolved at most once (Deliver, Lost or Busy), and exactly once when the step runs to its end;
- a delivered read is of a tier that holds the chunk, and was checked ok;
- every read that was opened (holds a descriptor and then a buffer) is released or delivered exactly once;
- no two reads go into one target at once; a chunk is delivered only when no read into its target is in
  flight (unless it was reported busy);
- a tier's bytes in flight (hedged reads aside) stay within its window plus one read;
- an illegal event raises ReadStepError.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream.read_step import (
    Busy, Deliver, Lost, Open, ReadState, ReadStep, ReadStepError, Release, Stalled, Submit,
)
from kvstream.routing import FixedSplit, MeetInTheMiddle, SingleTier

HEADER = 4096


class ReadStepModel(RuleBasedStateMachine):
    @initialize(
        holders=st.lists(st.sampled_from([{0, 1}, {0, 1}, {0, 1}, {0}, {1}, set()]), min_size=1, max_size=5),
        sizes=st.lists(st.sampled_from([8192, 12288, 40960]), min_size=10, max_size=10),
        router=st.sampled_from(["mitm", "fixed", "single"]),
        window=st.sampled_from([8192, 20000, 65536]),
        in_place=st.sampled_from([True, True, True, False]),
        report_busy=st.booleans(),
    )
    def setup(self, holders, sizes, router, window, in_place, report_busy):
        self.holders = [frozenset(h) for h in holders]
        n = len(self.holders)
        self.sizes = sizes[:n]
        r = {"mitm": MeetInTheMiddle(batch=1), "fixed": FixedSplit((0.5, 0.5)), "single": SingleTier(0)}[router]
        self.windows = [window, window]
        # a target per chunk, too small for the largest files (those are read into a buffer and copied)
        self.caps = [36864 if in_place else 0 for _ in self.sizes]
        self.step = ReadStep(r.schedule(self.holders, 2), self.sizes, self.windows, hedge_after_s=1.0,
                             in_place=self.caps if in_place else None, in_place_tier=0 if in_place else -1,
                             report_busy=report_busy, header_bytes=HEADER)
        self.now = 0.0
        self.opening: dict[int, Open] = {}
        self.inflight: dict[int, Open] = {}
        self.landed: dict[int, Open] = {}
        self.reads: dict[int, Open] = {}
        self.held: set[int] = set()  # opened, not yet released or delivered
        self.ended: set[int] = set()  # released or delivered
        self.checked_ok: set[int] = set()
        self.in_place_inflight: dict[int, int] = {}  # chunk -> read writing into its target
        self.in_place_reads: set[int] = set()
        self.busy_reads: set[int] = set()
        self.resolved: dict[int, str] = {}
        self.hedged: set[int] = set()
        self.skipped: set[int] = set()  # reads the driver did not open (not needed any more)
        self.apply(self.step.start(self.now))

    # -- the driver -----------------------------------------------------------------------------------------
    def apply(self, acts):
        for a in acts:
            if isinstance(a, Open):
                assert a.tier in self.holders[a.chunk], f"tier {a.tier} does not hold chunk {a.chunk}"
                assert a.read not in self.reads
                self.reads[a.read] = a
                self.opening[a.read] = a
                if a.hedged:
                    self.hedged.add(a.read)
            elif isinstance(a, Submit):
                o = self.reads[a.read]
                assert o.chunk not in self.resolved, f"a read of chunk {o.chunk} issued after it was resolved"
                self.inflight[a.read] = o
                if a.in_place:
                    assert o.chunk not in self.in_place_inflight, "two reads into one target"
                    assert self.caps[o.chunk] and a.nbytes <= HEADER + self.caps[o.chunk]
                    self.in_place_inflight[o.chunk] = a.read
                    self.in_place_reads.add(a.read)
            elif isinstance(a, Deliver):
                o = self.reads[a.read]
                assert o.chunk == a.chunk
                assert a.read in self.checked_ok, "delivered a read that was not checked ok"
                assert a.chunk not in self.resolved, f"chunk {a.chunk} resolved twice"
                assert a.chunk not in self.in_place_inflight, "delivered while a read into its target is in flight"
                self.resolved[a.chunk] = "delivered"
                self.end(a.read)
            elif isinstance(a, Release):
                self.end(a.read)
            elif isinstance(a, Lost):
                assert a.chunk not in self.resolved, f"chunk {a.chunk} resolved twice"
                self.resolved[a.chunk] = "lost"
            elif isinstance(a, Busy):
                assert a.chunk not in self.resolved
                assert self.in_place_inflight.get(a.chunk) == a.read
                self.resolved[a.chunk] = "busy"
                self.busy_reads.add(a.read)
            else:
                assert isinstance(a, Stalled)

    def end(self, rid):
        assert rid not in self.ended, f"read {rid} released or delivered twice"
        if rid in self.skipped:  # never opened: its Release frees nothing, once
            self.ended.add(rid)
            return
        assert rid in self.held, f"read {rid} released without holding anything"
        self.held.discard(rid)
        self.ended.add(rid)

    # -- events ---------------------------------------------------------------------------------------------
    @precondition(lambda self: self.opening)
    @rule(data=st.data(), ok=st.booleans())
    def open_done(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.opening)))
        o = self.opening.pop(rid)
        if ok:
            self.held.add(rid)
            self.apply(self.step.opened(rid, self.now, self.sizes[o.chunk]))
        else:
            self.apply(self.step.open_failed(rid, self.now))

    @precondition(lambda self: self.opening)
    @rule(data=st.data())
    def skip_unneeded_open(self, data):
        """The driver's open thread asks before opening; a read whose chunk is resolved is not opened."""
        rid = data.draw(st.sampled_from(sorted(self.opening)))
        if self.step.needed(rid):
            return
        assert self.step.reads[rid].state is ReadState.ABANDONED or self.reads[rid].chunk in self.resolved
        del self.opening[rid]
        self.skipped.add(rid)
        self.apply(self.step.not_needed(rid, self.now))

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def land(self, data):
        self._land(data.draw(st.sampled_from(sorted(self.inflight))))

    def _land(self, rid):
        o = self.inflight.pop(rid)
        if self.in_place_inflight.get(o.chunk) == rid:
            del self.in_place_inflight[o.chunk]
        acts = self.step.landed(rid, self.now)
        if self.step.reads[rid].state is ReadState.LANDED:
            self.landed[rid] = o
        self.apply(acts)

    @precondition(lambda self: self.landed and not self.step.closed)
    @rule(data=st.data(), ok=st.booleans())
    def check(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.landed)))
        del self.landed[rid]
        if ok:
            self.checked_ok.add(rid)
        self.apply(self.step.checked(rid, self.now, ok))

    @rule(dt=st.sampled_from([0.1, 0.6, 1.5]))
    def tick(self, dt):
        self.now += dt
        self.apply(self.step.tick(self.now, usable=[0, 1]))

    @precondition(lambda self: not self.step.closed)
    @rule(roll=st.integers(0, 7))
    def close_early(self, roll):
        if roll:  # rare: a step closed at once would leave every other rule nothing to do
            return
        self.landed.clear()  # released by close
        self.apply(self.step.close(self.now))

    @rule()
    def illegal_events_raise(self):
        for rid, r in self.step.reads.items():
            if r.state in (ReadState.DELIVERED, ReadState.DUPLICATE, ReadState.FAILED, ReadState.RELEASED):
                with pytest.raises(ReadStepError, match=f"read {rid}"):
                    self.step.landed(rid, self.now)
                with pytest.raises(ReadStepError):
                    self.step.checked(rid, self.now, True)
                return

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def windows_hold(self):
        for t in range(2):
            plain = sum(self.sizes[o.chunk] for rid, o in list(self.opening.items()) + list(self.inflight.items())
                        if o.tier == t and rid not in self.hedged and rid not in self.busy_reads
                        and self.step.reads[rid].state in (ReadState.OPENING, ReadState.IN_FLIGHT))
            assert plain <= self.windows[t] + max(self.sizes)

    def teardown(self):
        if not hasattr(self, "step"):
            return
        # Run the step to its end: every event the driver still owes, in order, then close.
        for _ in range(1000):
            if self.opening:
                rid = min(self.opening)
                o = self.opening.pop(rid)
                self.held.add(rid)
                self.apply(self.step.opened(rid, self.now, self.sizes[o.chunk]))
            elif self.inflight:
                self._land(min(self.inflight))
            elif self.landed and not self.step.closed:
                rid = min(self.landed)
                del self.landed[rid]
                self.checked_ok.add(rid)
                self.apply(self.step.checked(rid, self.now, True))
            else:
                break
        if not self.step.closed:
            assert self.step.done, "nothing left to happen, yet the step is not done"
            assert len(self.resolved) == len(self.holders), "a chunk was never resolved"
        self.apply(self.step.close(self.now))
        assert not self.held, f"reads never released: {sorted(self.held)}"
        for j, how in self.resolved.items():
            if how == "lost":
                pass  # every holder failed it, or it has none
        for j, h in enumerate(self.holders):
            if not h:
                assert self.resolved.get(j) in (None, "lost")


TestReadStep = pytest.mark.slow(ReadStepModel.TestCase)
TestReadStep.settings = settings(max_examples=400, stateful_step_count=60, deadline=None,
                                 suppress_health_check=[HealthCheck.too_slow])


def test_a_slow_open_is_hedged_like_a_slow_read():
    """An open that does not come back (a FIFO, cold metadata on a throttled device) is stuck like a read:
    the tier is reported stalled and the other holder reads the chunk."""
    step = ReadStep(SingleTier(0).schedule([{0, 1}], 2), [8192], [8192, 8192], hedge_after_s=0.05)
    acts = step.start(0.0)
    opens = [a for a in acts if isinstance(a, Open)]
    assert [o.tier for o in opens] == [0]  # tier 0 reads it; tier 1 only if tier 0 fails or stalls
    acts = step.tick(0.1, usable=[0, 1])
    assert Stalled(0) in acts
    hedge = [a for a in acts if isinstance(a, Open)]
    assert len(hedge) == 1 and hedge[0].tier == 1 and hedge[0].hedged
    acts = step.opened(hedge[0].read, 0.1, 8192)
    assert acts == [Submit(hedge[0].read, 8192, False)]
    step.landed(hedge[0].read, 0.11)
    acts = step.checked(hedge[0].read, 0.12, True)
    assert Deliver(hedge[0].read, 0) in acts and step.done
    # the stuck open comes back after the step: its descriptor is released, nothing else happens
    step.close(0.12)
    assert step.opened(opens[0].read, 5.0, 8192) == [Release(opens[0].read, late=True)]


def test_an_illegal_event_names_the_read_the_event_and_the_state():
    step = ReadStep(SingleTier(0).schedule([{0}], 1), [8192], [8192])
    (o,) = step.start(0.0)
    with pytest.raises(ReadStepError, match=r"read 0 \(chunk 0, tier 0\): event 'landed' in state 'opening'"):
        step.landed(o.read, 0.0)
    with pytest.raises(ReadStepError, match="not a read of this step"):
        step.opened(99, 0.0, 1)


def test_a_copy_that_wins_waits_for_the_read_into_its_target():
    """read_into: tier 0 reads chunk 0 straight into its target, tier 1 steals it and lands first. The
    target is still being written, so tier 1's copy waits; tier 0's good read is then used and the copy
    dropped (or, had tier 0's read failed, the copy goes in)."""
    for target_read_ok in (True, False):
        step = ReadStep(MeetInTheMiddle(batch=1).schedule([{0, 1}], 2), [12288], [12288, 12288],
                        in_place=[8192], in_place_tier=0, header_bytes=HEADER)
        opens = {o.tier: o for o in step.start(0.0) if isinstance(o, Open)}
        assert set(opens) == {0, 1}
        assert step.opened(opens[0].read, 0.0, 12288) == [Submit(opens[0].read, 12288, True)]
        assert step.opened(opens[1].read, 0.0, 12288) == [Submit(opens[1].read, 12288, False)]
        step.landed(opens[1].read, 0.01)
        acts = step.checked(opens[1].read, 0.01, True)
        assert not any(isinstance(a, Deliver) for a in acts) and not step.done
        assert step.reads[opens[1].read].state is ReadState.WAITING
        step.landed(opens[0].read, 0.02)
        acts = step.checked(opens[0].read, 0.02, target_read_ok)
        winner = opens[0].read if target_read_ok else opens[1].read
        loser = opens[1].read if target_read_ok else opens[0].read
        assert Deliver(winner, 0) in acts and Release(loser) in acts and step.done


def test_a_steal_that_cannot_land_first_is_declined():
    """Two tiers of measured bandwidth: an idle fast tier steals the slow tier's read (it lands first); an
    idle tier as slow as the owner does not steal a read the owner is about to finish."""
    def step_with(bw):
        sched = MeetInTheMiddle(batch=1).schedule([{0, 1}] * 2, 2)
        return ReadStep(sched, [4 << 20] * 2, [4 << 20, 4 << 20], bandwidth=bw)

    # equal tiers: each claims one chunk; when tier 0's lands, stealing tier 1's read (started at 0, 4 ms left
    # of 4 ms) would take tier 0 as long: declined
    step = step_with([1e9, 1e9])
    opens = {o.tier: o for o in step.start(0.0) if isinstance(o, Open)}
    for o in opens.values():
        step.opened(o.read, 0.0, 4 << 20)
    acts = step.landed(opens[0].read, 0.0041)
    assert not any(isinstance(a, Open) for a in acts) and step.steals_declined >= 1
    # a slow owner: tier 1 at 0.1 GB/s has 42 ms left, tier 0 at 1 GB/s needs 4 ms: the steal pays
    step = step_with([1e9, 1e8])
    opens = {o.tier: o for o in step.start(0.0) if isinstance(o, Open)}
    for o in opens.values():
        step.opened(o.read, 0.0, 4 << 20)
    acts = step.landed(opens[0].read, 0.0041)
    stolen = [a for a in acts if isinstance(a, Open)]
    assert len(stolen) == 1 and stolen[0].tier == 0 and stolen[0].chunk == opens[1].chunk
    # unmeasured tiers (no bandwidth yet): every steal is allowed, as before
    step = step_with([None, None])
    opens = {o.tier: o for o in step.start(0.0) if isinstance(o, Open)}
    for o in opens.values():
        step.opened(o.read, 0.0, 4 << 20)
    assert any(isinstance(a, Open) for a in step.landed(opens[0].read, 0.0041))


def test_random_walks_keep_every_invariant():
    """The same model, driven by 800 seeded random walks (hypothesis explores the rules above broadly but
    rarely strings together the long orderings some defects need: a steal that opens after its chunk was
    delivered, a copy that lands while the read into its target is in flight)."""
    import random

    class Pick:
        def __init__(self, rng, pool):
            self.rng, self.pool = rng, pool

        def draw(self, _strategy):
            return self.rng.choice(sorted(self.pool))

    for seed in range(800):
        rng = random.Random(seed)
        m = ReadStepModel()
        m.setup(holders=[rng.choice([{0, 1}, {0, 1}, {0}, {1}, set()]) for _ in range(rng.randint(1, 5))],
                sizes=[rng.choice([8192, 12288, 40960]) for _ in range(10)],
                router=rng.choice(["mitm", "mitm", "fixed", "single"]), window=rng.choice([8192, 20000, 65536]),
                in_place=rng.random() < 0.7, report_busy=rng.random() < 0.5)
        for _ in range(60):
            moves = []
            if m.opening:
                moves += [lambda: m.open_done(Pick(rng, m.opening), rng.random() < 0.9),
                          lambda: m.skip_unneeded_open(Pick(rng, m.opening))]
            if m.inflight:
                moves += [lambda: m.land(Pick(rng, m.inflight))] * 2
            if m.landed and not m.step.closed:
                moves += [lambda: m.check(Pick(rng, m.landed), rng.random() < 0.9)] * 2
            moves.append(lambda: m.tick(rng.choice([0.1, 0.6, 1.5])))
            if rng.random() < 0.02 and not m.step.closed:
                moves.append(lambda: m.close_early(0))
            rng.choice(moves)()
            m.windows_hold()
        m.teardown()
