"""The read step's compute source (compute joins the meet-in-the-middle), against a model, with hypothesis.

A random step (chunks held by random tiers, a compute chain over its first chunks with random per-chunk GPU
costs, measured or unknown tier bandwidths, any router and any expected meeting point) is driven by random
events in any order a driver could produce: opens that succeed or fail, reads that land and are checked ok or
bad, the GPU finishing its chunk, and the consumer closing early. What must hold:

- compute claims chunks strictly in prefix order, one at a time, and claims chunk j only once every chain chunk
  before it is resolved (recomputed by it, or delivered by a tier): a chunk can only be recomputed after the
  ones before it;
- a chunk taken for compute (not a hedge of a tier's read) is never opened by a tier afterwards;
- each chunk is resolved by exactly one source (one Deliver, one Lost, or one ``computed`` that recomputed it),
  and every chunk is resolved when the step runs to its end;
- the split point (the leading run of recomputed chunks) lies inside the chain;
- an event the compute lifecycle does not allow raises.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstream.compute import ComputePolicy, best_split, gpu_share
from kvstream.read_step import (
    ChunkState, Compute, ComputePlan, ComputeState, Deliver, Lost, Open, ReadState, ReadStep, ReadStepError,
    Release, Submit,
)
from kvstream.routing import FixedSplit, MeetInTheMiddle, SingleTier
from kvstream.testing.read_step import run_on_ideal_clock

CHUNK = 8192


class ComputeSourceModel(RuleBasedStateMachine):
    @initialize(
        holders=st.lists(st.sampled_from([{0, 1}, {0, 1}, {0, 1}, {0}, {1}, set()]), min_size=1, max_size=8),
        chain=st.integers(0, 8),
        costs=st.lists(st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]), min_size=8, max_size=8),
        bandwidth=st.sampled_from([(0.0, 0.0), (1e6, 1e6), (1e8, 1e7), (1e9, 1e9)]),
        router=st.sampled_from(["mitm", "mitm2", "fixed", "single"]),
        front=st.integers(0, 8),
        window=st.sampled_from([CHUNK, 2 * CHUNK, 4 * CHUNK]),
    )
    def setup(self, holders, chain, costs, bandwidth, router, front, window):
        self.holders = [frozenset(h) for h in holders]
        n = len(self.holders)
        self.chain = min(chain, n)
        r = {"mitm": MeetInTheMiddle(batch=1), "mitm2": MeetInTheMiddle(batch=2), "fixed": FixedSplit((0.5, 0.5)),
             "single": SingleTier(0)}[router]
        self.plan = ComputePlan(cost_s=tuple(costs[: self.chain]), bandwidth=bandwidth, front=min(front, self.chain))
        self.step = ReadStep(r.schedule(self.holders, 2, front=self.plan.front), [CHUNK] * n, [window, window],
                             compute=self.plan)
        self.now = 0.0
        self.opening: dict[int, Open] = {}
        self.inflight: dict[int, Open] = {}
        self.landed: dict[int, Open] = {}
        self.reads: dict[int, Open] = {}
        self.opened_chunks: set[int] = set()  # chunks a tier has opened a read of
        self.computing: int | None = None
        self.compute_claims: list[int] = []
        self.taken: set[int] = set()  # chunks compute claimed that no tier had opened: never opened after
        self.resolved: dict[int, str] = {}
        self.apply(self.step.start(self.now))

    # -- the driver -----------------------------------------------------------------------------------------
    def apply(self, acts):
        for a in acts:
            if isinstance(a, Open):
                assert a.tier in self.holders[a.chunk]
                assert a.chunk not in self.taken, f"chunk {a.chunk} was taken for compute, then opened by a tier"
                self.reads[a.read] = a
                self.opening[a.read] = a
                self.opened_chunks.add(a.chunk)
            elif isinstance(a, Submit):
                self.inflight[a.read] = self.reads[a.read]
            elif isinstance(a, Deliver):
                assert a.chunk not in self.resolved, f"chunk {a.chunk} resolved twice"
                self.resolved[a.chunk] = "delivered"
            elif isinstance(a, Lost):
                assert a.chunk not in self.resolved, f"chunk {a.chunk} resolved twice"
                self.resolved[a.chunk] = "lost"
            elif isinstance(a, Compute):
                j = a.chunk
                assert self.computing is None, "two chunks computed at once"
                assert j < self.chain, f"compute claimed chunk {j} past its chain of {self.chain}"
                assert not self.compute_claims or j > self.compute_claims[-1], "compute went backwards"
                assert a.seconds == self.plan.cost_s[j]
                for i in range(j):  # strictly in prefix order: everything before it is there
                    assert self.resolved.get(i) in ("computed", "delivered"), \
                        f"chunk {j} recomputed while chunk {i} is {self.resolved.get(i, 'missing')}"
                assert j not in self.resolved
                if j not in self.opened_chunks:
                    self.taken.add(j)
                self.computing = j
                self.compute_claims.append(j)
            else:
                assert isinstance(a, Release)

    # -- events ---------------------------------------------------------------------------------------------
    @precondition(lambda self: self.opening)
    @rule(data=st.data(), ok=st.booleans())
    def open_done(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.opening)))
        self.opening.pop(rid)
        if ok:
            self.apply(self.step.opened(rid, self.now, CHUNK))
        else:
            self.apply(self.step.open_failed(rid, self.now))

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def land(self, data):
        self._land(data.draw(st.sampled_from(sorted(self.inflight))))

    def _land(self, rid):
        o = self.inflight.pop(rid)
        acts = self.step.landed(rid, self.now)
        if self.step.reads[rid].state is ReadState.LANDED:
            self.landed[rid] = o
        self.apply(acts)

    @precondition(lambda self: self.landed and not self.step.closed)
    @rule(data=st.data(), ok=st.sampled_from([True, True, True, False]))
    def check(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.landed)))
        del self.landed[rid]
        self.apply(self.step.checked(rid, self.now, ok))

    @precondition(lambda self: self.computing is not None)
    @rule(dt=st.sampled_from([0.0, 1e-4, 1e-2]))
    def gpu_done(self, dt):
        self._gpu_done(dt)

    def _gpu_done(self, dt=0.0):
        j, self.computing = self.computing, None
        self.now += dt
        before = self.step.chunks[j]
        acts = self.step.computed(j, self.now)
        if before is ChunkState.PENDING and self.step.chunks[j] is ChunkState.COMPUTED:
            assert j not in self.resolved, f"chunk {j} resolved twice"
            self.resolved[j] = "computed"
        self.apply(acts)

    @precondition(lambda self: not self.step.closed)
    @rule(roll=st.integers(0, 9))
    def close_early(self, roll):
        if roll:
            return
        self.landed.clear()
        self.apply(self.step.close(self.now))

    @rule()
    def illegal_compute_events_raise(self):
        other = next((j for j in range(len(self.holders)) if j != self.computing), None)
        if other is not None:
            with pytest.raises(ReadStepError, match="compute"):
                self.step.computed(other, self.now)

    # -- invariants -----------------------------------------------------------------------------------------
    @invariant()
    def one_source_per_chunk(self):
        for j, state in enumerate(self.step.chunks):
            how = self.resolved.get(j)
            expect = {ChunkState.PENDING: None, ChunkState.DELIVERED: "delivered", ChunkState.LOST: "lost",
                      ChunkState.COMPUTED: "computed"}[state]
            assert how == expect, f"chunk {j}: step says {state.value}, the driver saw {how}"

    @invariant()
    def split_inside_the_chain(self):
        done = self.step.computed_chunks
        assert all(j < self.chain for j in done) and done == sorted(done)

    def teardown(self):
        if not hasattr(self, "step"):
            return
        for _ in range(2000):
            if self.computing is not None:
                self._gpu_done()
            elif self.opening:
                rid = min(self.opening)
                self.opening.pop(rid)
                self.apply(self.step.opened(rid, self.now, CHUNK))
            elif self.inflight:
                self._land(min(self.inflight))
            elif self.landed and not self.step.closed:
                rid = min(self.landed)
                del self.landed[rid]
                self.apply(self.step.checked(rid, self.now, True))
            else:
                break
        if not self.step.closed:
            assert self.step.done, "nothing left to happen, yet the step is not done"
            assert len(self.resolved) == len(self.holders), "a chunk was never resolved"
            for j, h in enumerate(self.holders):
                if not h:  # no tier holds it: only compute can bring it, else it is lost
                    assert self.resolved[j] in ("computed", "lost")
        self.apply(self.step.close(self.now))
        assert self.step.compute_state in (ComputeState.STOPPED, ComputeState.ABANDONED)


TestComputeSource = pytest.mark.slow(ComputeSourceModel.TestCase)
TestComputeSource.settings = settings(max_examples=300, stateful_step_count=50, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])


# -- the meeting, step by step --------------------------------------------------------------------------------
def test_slow_tier_compute_takes_the_front_and_they_meet():
    """One tier reading a chunk in 10 ms, the GPU recomputing one in 2-4 ms: compute takes the front, the tier
    the back, and the step ends where they meet, sooner than either alone (20 chunks: 200 ms reading, 60 ms
    computing... the meeting: about 3/4 computed). Without the compute source every chunk is read (200 ms)."""
    n = 20
    cost = tuple(0.002 + 0.0001 * j for j in range(n))  # cost grows with position
    holders = [{0}] * n
    pol = ComputePolicy(n_tiers=1, bandwidth=[CHUNK / 0.010])
    plan = pol.plan(cost, [CHUNK] * n)
    assert plan is not None and 0 < plan.front < n
    step = ReadStep(SingleTier(0).schedule(holders, 1, front=plan.front), [CHUNK] * n, [CHUNK], compute=plan)
    computed, read, end = run_on_ideal_clock(step, 0.010)
    assert computed == list(range(len(computed))) and len(computed) >= n // 2
    assert set(read) | set(computed) == set(range(n)) and not set(read) & set(computed)
    assert min(read) == len(computed), "the tier reads from the back, compute from the front: they meet"
    assert end < 0.5 * n * 0.010 and end < sum(cost)
    # the mechanism removed: the same step reads everything
    plain = ReadStep(SingleTier(0).schedule(holders, 1), [CHUNK] * n, [CHUNK])
    computed0, read0, end0 = run_on_ideal_clock(plain, 0.010)
    assert computed0 == [] and end0 == pytest.approx(n * 0.010) and end < 0.6 * end0


def test_fast_tiers_leave_compute_idle():
    """Tiers far faster than the GPU: the policy plans no compute at all (the step is exactly the plain one),
    and a plan forced on the step still computes nothing (its claim rule): kvstream+compute degrades to
    plain kvstream."""
    n = 16
    cost = (0.05,) * n
    pol = ComputePolicy(n_tiers=2, bandwidth=[1e9, 1e9])
    assert pol.plan(cost, [CHUNK] * n) is None and pol.declined == 1
    forced = ComputePlan(cost_s=cost, bandwidth=(1e9, 1e9), front=0)
    step = ReadStep(MeetInTheMiddle(batch=1).schedule([{0, 1}] * n, 2), [CHUNK] * n, [CHUNK, CHUNK],
                    compute=forced)
    computed, _, _ = run_on_ideal_clock(step, 0.00001)
    assert computed == [] and step.compute_state is ComputeState.STOPPED


def test_a_hedged_chunk_is_resolved_once_and_a_late_tier_copy_is_a_duplicate():
    """Compute reaches a chunk a tier is reading (the meeting region) and recomputes it too; it finishes first,
    so the tier's copy, when it lands, is a duplicate: released, not delivered."""
    plan = ComputePlan(cost_s=(0.001, 0.001), bandwidth=(0.0,), front=1)
    step = ReadStep(SingleTier(0).schedule([{0}, {0}], 1, front=1), [CHUNK] * 2, [CHUNK], compute=plan)
    acts = step.start(0.0)
    comp = [a for a in acts if isinstance(a, Compute)]
    opens = [a for a in acts if isinstance(a, Open)]
    assert [c.chunk for c in comp] == [0] and [o.chunk for o in opens] == [1]
    step.opened(opens[0].read, 0.0, CHUNK)
    acts = step.computed(0, 0.001)
    assert [a.chunk for a in acts if isinstance(a, Compute)] == [1] and step.compute_hedges == 1
    step.computed(1, 0.002)
    assert step.done and step.chunks == [ChunkState.COMPUTED, ChunkState.COMPUTED]
    acts = step.landed(opens[0].read, 0.5)
    acts += step.checked(opens[0].read, 0.5, True)
    assert not any(isinstance(a, Deliver) for a in acts) and Release(opens[0].read) in acts
    assert step.reads[opens[0].read].state is ReadState.DUPLICATE


def test_compute_lifecycle_is_one_table():
    plan = ComputePlan(cost_s=(1.0,), bandwidth=(0.0,))
    step = ReadStep(SingleTier(0).schedule([{0}, {0}], 1, front=1), [CHUNK] * 2, [CHUNK], compute=plan)
    step.start(0.0)
    assert step.compute_state is ComputeState.BUSY
    with pytest.raises(ReadStepError, match="compute: chunk 1 reported computed"):
        step.computed(1, 0.1)
    step.close(0.1)
    assert step.compute_state is ComputeState.ABANDONED
    assert step.computed(0, 1.0) == [] and step.chunks[0] is ChunkState.PENDING  # the result is not used
    assert step.compute_state is ComputeState.STOPPED
    with pytest.raises(ReadStepError, match="'computed' in state 'stopped'"):
        step._c_busy = 0  # a driver reporting a chunk it never got
        step.computed(0, 1.0)


# -- the policy -------------------------------------------------------------------------------------------------
@given(cost=st.lists(st.floats(1e-4, 1.0), min_size=1, max_size=12),
       extra=st.integers(0, 6), bw=st.floats(1e3, 1e9))
def test_best_split_minimizes_the_step(cost, extra, bw):
    nbytes = [CHUNK] * (len(cost) + extra)

    def step_time(m):
        return max(sum(cost[:m]), sum(nbytes[m:]) / bw)

    m = best_split(cost, nbytes, bw)
    assert 0 <= m <= len(cost)
    assert step_time(m) <= min(step_time(k) for k in range(len(cost) + 1)) + 1e-9


def test_policy_adapts_to_measured_bandwidth():
    """The same chain, two measured bandwidths: a slow tier gets a larger recomputed front; measurements move
    the estimate (an exponential average), and a tier never measured gives the plain race (no claim rule)."""
    cost = tuple(0.002 + 0.0001 * j for j in range(40))
    pol = ComputePolicy(n_tiers=1, bandwidth=[CHUNK / 0.002])
    fast = pol.plan(cost, [CHUNK] * 40)
    for _ in range(20):
        pol.observe(0, CHUNK, 0.02)  # ten times slower than thought
    slow = pol.plan(cost, [CHUNK] * 40)
    assert slow is not None and (fast is None or slow.front > fast.front)
    assert pol.bandwidth[0] == pytest.approx(CHUNK / 0.02, rel=0.01)
    race = ComputePolicy(n_tiers=2).plan(cost, [CHUNK] * 40)
    assert race is not None and race.bandwidth == (0.0, 0.0) and race.front == 20


def test_gpu_share_backs_off_under_a_full_batch():
    assert gpu_share(200, 256, blocking=True) == 1.0  # the GPU waits for this load anyway
    assert gpu_share(0, 256, blocking=False) == 1.0
    assert gpu_share(128, 256, blocking=False) == 0.5
    assert gpu_share(256, 256, blocking=False) == 0.0
    assert gpu_share(0, 256, blocking=False, busy=0.75) == 0.25  # the GPU's recent idle share
    assert gpu_share(0, 256, blocking=False, busy=1.0) == 0.0  # steps back to back: no room for recompute
    assert gpu_share(0, 256, blocking=True, busy=1.0) == 1.0


def test_skip_recomputes_a_whole_item_only_when_reading_it_is_slower():
    pol = ComputePolicy(n_tiers=1, bandwidth=[1e6])
    assert pol.skip([0.001] * 10, 10 * CHUNK, [0])  # 10 ms of GPU vs 82 ms of reading
    pol.bandwidth[0] = 1e9
    assert not pol.skip([0.001] * 10, 10 * CHUNK, [0])
    assert not ComputePolicy(n_tiers=1).skip([0.001] * 10, 10 * CHUNK, [0])  # unmeasured: read it


def test_plan_dataclass_is_frozen():
    plan = ComputePlan(cost_s=(1.0,), bandwidth=(1.0,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.front = 3  # type: ignore[misc]
