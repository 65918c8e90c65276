"""The serving loop on tiny hand-made workloads whose TTFTs are computed by hand (LinearCost: 0.1 s a step +
1 ms per prompt token computed + 10 ms per decoding sequence)."""

from __future__ import annotations

import pytest

from kvstream.errors import UsageError
from kvstream.serving.core import (
    Arrival,
    ServingConfig,
    ServingCore,
    StartLoad,
    StartStep,
    StepDone,
    WriteChunks,
)
from kvstream.serving.hbm import HbmCache
from kvstream.testing.serving import FakeStorage, LinearCost, req, run


def test_two_requests_fcfs_no_cache():
    recs, core, _ = run([req(0, 0.0, 1000), req(1, 0.5, 500)])
    assert recs[0].ttft == pytest.approx(1.1)  # 0.1 + 1000 ms
    assert recs[1].ttft == pytest.approx(1.7 - 0.5)  # waits for step 0, then 0.1 + 0.5
    assert recs[1].queue_s == pytest.approx(0.6)
    assert core.idle


def test_decode_joins_continuous_batch():
    # A: prefill to 1.1, decode step 1.1-1.21; B arrives 1.15 and joins the next step with A's last decode.
    recs, _, _ = run([req(0, 0.0, 1000, out=3), req(1, 1.15, 500)])
    assert recs[0].ttft == pytest.approx(1.1)
    assert recs[1].first_token == pytest.approx(1.21 + 0.1 + 0.5 + 0.01)
    assert recs[0].finished == pytest.approx(1.82)


def test_blocking_load_then_compute():
    b = req(1, 0.5, 1024)
    recs, _, st = run([req(0, 0.0, 1000), b], disk=b.chunk_ids[:2], per_chunk=0.15)
    # step 1 starts at 1.1, loads 2 chunks (0.3 s), computes 1024 - 512 = 512 tokens (0.612 s)
    assert recs[1].first_token == pytest.approx(1.1 + 0.3 + 0.612)
    assert recs[1].disk_chunks == 2 and recs[1].recomputed_tokens == 512
    # the two loaded chunks were released after the step, the other two written
    assert st.released == [b.chunk_ids[:2]]
    assert [w.chunk_ids for _, w in st.writes if w.request_id == 1] == [b.chunk_ids[2:]]


def test_step_mode_reads_the_step_at_once_request_mode_one_after_another():
    a, b = req(0, 0.0, 1024), req(1, 0.0, 1024)
    disk = a.chunk_ids[:2] + b.chunk_ids[:2]
    step, _, st1 = run([a, b], ServingConfig(load_mode="step"), disk=disk, fixed=0.05, per_chunk=0.1)
    seq, _, st2 = run([a, b], ServingConfig(load_mode="request"), disk=disk, fixed=0.05, per_chunk=0.1)
    # At t=0 only A has arrived when the first step is planned (B arrives at the same instant but after).
    assert len(st1.loads) == 2 and len(st2.loads) == 2
    # Put both in one step: B arrives while A computes.
    a2, b2 = req(0, 0.0, 1000), req(1, 0.01, 1024)
    c2 = req(2, 0.02, 1024)
    disk = b2.chunk_ids[:2] + c2.chunk_ids[:2]
    step, _, st1 = run([a2, b2, c2], ServingConfig(load_mode="step"), disk=disk, fixed=0.05, per_chunk=0.1)
    seq, _, st2 = run([a2, b2, c2], ServingConfig(load_mode="request"), disk=disk, fixed=0.05, per_chunk=0.1)
    assert len(st1.loads) == 1 and len(st1.loads[0][2]) == 2
    assert len(st2.loads) == 2
    # step: 1.1 + (0.05 + 0.4) + compute(0.1 + 512 + 512 ms); request: one more fixed latency
    assert step[1].first_token == pytest.approx(1.1 + 0.45 + 1.124)
    assert seq[1].first_token == pytest.approx(1.1 + 0.5 + 1.124)


def test_hbm_prefix_hit_skips_compute_and_load():
    a = req(0, 0.0, 1024)
    b = req(1, 5.0, 1280, chunks=a.chunk_ids + ("b4",))
    recs, _, st = run([a, b], disk=a.chunk_ids)
    assert recs[1].hbm_chunks == 4
    assert recs[1].ttft == pytest.approx(0.1 + 0.256)
    assert len(st.loads) == 1  # only A's own disk chunks; B found everything in HBM


def test_writes_put_at_step_end_flushed_when_next_step_starts():
    recs, core, st = run([req(0, 0.0, 1024, out=3)])
    # A's chunks are put when step 0 ends (1.124) and flushed to the tiers when step 1 (a decode) starts then.
    assert [t for t, _ in st.writes] == [pytest.approx(1.124)]
    assert st.flushes == [pytest.approx(1.124)]
    # B arrives during A's decode steps; B's chunks (step ends 1.134 + 0.1 + 0.512 + 0.01) flush at the next start
    recs, core, st = run([req(0, 0.0, 1024, out=4), req(1, 1.13, 512)])
    b_put = [t for t, w in st.writes if w.request_id == 1][0]
    assert b_put == pytest.approx(recs[1].first_token)
    assert st.flushes[-1] == pytest.approx(b_put)  # A still decodes: the next step starts at once
    recs, core, st = run([req(0, 0.0, 1024, out=3)], ServingConfig(defer_writes=False))
    assert st.flushes == [pytest.approx(1.124)]
    # with one output token the GPU goes idle right away; the deferred flush happens then
    recs, core, st = run([req(0, 0.0, 1024, out=1), req(1, 10.0, 512)])
    assert st.flushes[0] == pytest.approx(1.124)


def test_prefix_computed_by_a_decoding_request_is_hit_at_once():
    a = req(0, 0.0, 1024, out=50)
    b = req(1, 1.2, 1280, chunks=a.chunk_ids + ("b4",))
    recs, _, _ = run([a, b])
    assert recs[1].hbm_chunks == 4  # A still decodes, its prompt chunks are shared (prefix caching)


def test_bidaw_ready_queue_lets_host_requests_pass():
    a = req(0, 0.0, 1024)  # all 4 chunks on disk: 0.4 s background load
    b = req(1, 0.01, 512)  # nothing to load
    cfg = ServingConfig(admit="ready", prefetch="hrrn")
    recs, _, _ = run([a, b], cfg, disk=a.chunk_ids, per_chunk=0.1)
    # B runs at 0.01 (0.1 + 0.512 s); A is ready at 0.4 and runs after B's step ends at 0.622.
    assert recs[1].ttft == pytest.approx(0.612)
    assert recs[0].first_token == pytest.approx(0.622 + 0.1 + 0.001)
    # FCFS makes B wait behind A's blocking load
    recs, _, _ = run([a, b], ServingConfig(), disk=a.chunk_ids, per_chunk=0.1)
    assert recs[0].first_token == pytest.approx(0.4 + 0.101)
    assert recs[1].first_token == pytest.approx(0.501 + 0.612)


def test_hrrn_prefers_small_loads_but_ages():
    first = req(0, 0.0, 256)  # takes the loader from t=0 to 0.1
    big = req(1, 0.0, 4096)
    small = req(2, 0.0, 512)
    cfg = ServingConfig(admit="ready", prefetch="hrrn")
    recs, _, st = run([first, big, small], cfg, disk=first.chunk_ids + big.chunk_ids + small.chunk_ids)
    # At 0.1 both have waited 0.1 s: 1 + 0.1/2 chunks beats 1 + 0.1/16 chunks.
    assert [items[0][0] for _, _, items in st.loads[:3]] == [0, 2, 1]
    assert recs[2].first_token < recs[1].first_token


def test_lookahead_prefetch_keeps_fcfs_order():
    a = req(0, 0.0, 1024)
    b = req(1, 0.01, 512)
    recs, _, _ = run([a, b], ServingConfig(prefetch="lookahead:4"), disk=a.chunk_ids, per_chunk=0.1)
    # B (nothing to load) waits behind A's prefetch, then both share the step: 0.1 + 1 + 512 ms.
    assert recs[0].first_token == pytest.approx(0.4 + 0.613)
    assert recs[1].first_token == pytest.approx(0.4 + 0.613)


def test_core_rejects_bad_events_and_configs():
    with pytest.raises(UsageError, match="admit"):
        ServingConfig(admit="lifo")
    with pytest.raises(UsageError, match="needs a prefetch"):
        ServingConfig(admit="ready")

    core = ServingCore(LinearCost(), lambda ids: (0, 0), chunk_bytes=1)
    acts = core.handle(Arrival(request=req(0, 0.0, 512)), 0.0)
    assert [type(a) for a in acts] == [StartStep]
    with pytest.raises(UsageError, match="StepDone for step 5"):
        core.handle(StepDone(step_id=5), 1.0)
    with pytest.raises(UsageError, match="arrived twice"):
        core.handle(Arrival(request=req(0, 0.0, 512)), 0.0)


def test_same_events_same_decisions():
    """The core is deterministic: replaying its recorded input events gives the same actions."""
    log = []
    reqs = [req(i, 0.05 * i, 256 * (1 + i % 5), out=1 + i % 3) for i in range(30)]
    disk = [c for r in reqs[::2] for c in r.chunk_ids[:2]]
    run(reqs, ServingConfig(admit="ready", prefetch="hrrn"), disk=disk, record=log)
    from kvstream.sim.engine import EventLoop

    st = FakeStorage(EventLoop(), disk=set(disk))
    core = ServingCore(LinearCost(), st.lookup, ServingConfig(admit="ready", prefetch="hrrn"), chunk_bytes=1)
    for now, ev, actions in log:
        assert tuple(core.handle(ev, now)) == actions


def test_hbm_cache_accounting():
    h = HbmCache(capacity_tokens=2048)
    assert h.admit(1, ("a", "b"), 0, 1024)
    assert h.used == 1024
    h.finish(1, ("a", "b"))
    assert h.used == 512 and h.match(("a", "b", "c")) == 2
    assert h.admit(2, ("a", "b", "c"), 2, 1000)  # pins a, b; reserves 488
    assert h.used == 512 + 488
    assert not h.admit(3, ("x",), 0, 1500)  # only 1048 free, a and b are pinned
    assert h.used == 1000
    h.finish(2, ("a", "b", "c"))
    assert h.match(("a", "b", "c")) == 3
    assert h.admit(3, ("x",), 0, 2048)  # evicts all three
    assert h.match(("a",)) == 0 and h.evictions == 3


def test_request_longer_than_the_gpu_runs_alone_and_is_counted():
    from kvstream.sim.driver import SimNode
    from kvstream.sim.engine import EventLoop

    loop = EventLoop()
    st = FakeStorage(loop)
    core = ServingCore(LinearCost(), st.lookup, ServingConfig(hbm_capacity_tokens=1000), chunk_bytes=1)
    node = SimNode(loop, core, st, [req(0, 0.0, 512), req(1, 0.0, 2048), req(2, 0.0, 256)])
    node.start()
    loop.run()
    assert core.finished == 3 and core.metrics.counters["oversize_requests"] == 1
    assert core.hbm.used <= core.hbm.capacity


def test_hbm_never_exceeds_capacity_after_an_oversize_request():
    h = HbmCache(capacity_tokens=700)
    ids = tuple(range(15))
    assert h.admit(1, ids, 0, 700)  # clamped reservation
    h.publish(1, ids)
    assert h.used <= 700 and h.match(ids) == 2
    h.finish(1, ids)
    assert h.used <= 700
    assert h.admit(2, ids, h.match(ids), 700)


def test_hbm_invariants_under_random_use():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 5), st.integers(1, 12), st.integers(0, 3000), st.booleans()), max_size=40))
    def check(ops):
        h = HbmCache(capacity_tokens=2048)
        running: dict[int, tuple] = {}
        for rid, (prefix, n, tokens, finish) in enumerate(ops):
            if finish and running:
                k = next(iter(running))
                h.finish(k, running.pop(k))
            ids = tuple((prefix, i) for i in range(n))
            hit = h.match(ids)
            if h.admit(rid, ids, hit, max(tokens, hit * 256)):
                h.publish(rid, ids)
                running[rid] = ids
            assert h.used <= h.capacity
        for k, ids in running.items():
            h.finish(k, ids)
        assert h.used <= h.capacity and h.running() == 0

    check()


def test_the_core_admits_what_its_scheduling_policy_decides():
    """The batch order is the policy object's: a last-come-first-served policy reverses it, and the core's
    queries reach the policy (it would fail if the core kept decisions of its own)."""
    from kvstream.scheduling import BidawScheduler, CachedAttentionScheduler, FCFSScheduler
    from kvstream.serving.core import scheduler_config
    from kvstream.sim.driver import SimNode
    from kvstream.sim.engine import EventLoop

    class LastComeFirst(FCFSScheduler):
        asked: list = []

        def _enqueue(self, rid):
            arrival, seq = self._order[rid]
            self._queue[(-arrival, -seq)] = rid

        def schedule(self, *, now, admit=True, check=None, reserve=None):
            if admit and self._queue and check is not None:
                self.asked.append(self._queue.peekitem(0)[1])
            return super().schedule(now=now, admit=admit, check=check, reserve=reserve)

    cfg = ServingConfig(max_batch_tokens=256)  # one 512-token prompt per step

    def first_tokens(scheduler):
        loop = EventLoop()
        st = FakeStorage(loop)
        core = ServingCore(LinearCost(), st.lookup, cfg, chunk_bytes=1, scheduler=scheduler)
        node = SimNode(loop, core, st, [req(0, 0.0, 512)] + [req(i, 0.1 * i, 512) for i in (1, 2, 3)])
        node.start()
        loop.run()
        assert core.finished == 4
        return sorted((r.first_token, r.request_id) for r in core.metrics.requests)

    assert [rid for _, rid in first_tokens(None)] == [0, 1, 2, 3]  # the configured FCFS policy
    lcfs = LastComeFirst(scheduler_config(cfg, chunk_bytes=1))
    assert [rid for _, rid in first_tokens(lcfs)] == [0, 3, 2, 1]
    assert lcfs.asked[:4] == [0, 3, 2, 1] and lcfs.running == frozenset()
    # The configuration names the policy object the core drives.
    for c, cls in ((ServingConfig(), FCFSScheduler), (ServingConfig(prefetch="lookahead:4"), CachedAttentionScheduler),
                   (ServingConfig(admit="ready", prefetch="hrrn"), BidawScheduler)):
        core = ServingCore(LinearCost(), lambda ids: (0, 0), c, chunk_bytes=1)
        assert type(core.scheduler) is cls
    assert ServingCore(LinearCost(), lambda ids: (0, 0), ServingConfig(prefetch="lookahead:4"),
                       chunk_bytes=1).scheduler.config.window == 4
    with pytest.raises(UsageError, match="admit='ready'"):
        ServingConfig(prefetch="hrrn")


def test_bidaw_ready_request_whose_host_kv_was_evicted_goes_back_to_preparing():
    """The policy decides (Bidaw: back to the preparing queue, loaded in the background); the core only reports
    that the candidate now needs disk."""
    from kvstream.scheduling import RequestState
    from kvstream.sim.engine import EventLoop

    def evicted_while_waiting(max_wait_s: float) -> tuple[ServingCore, list[StartLoad]]:
        b = req(1, 0.01, 512)  # in host memory at arrival
        st = FakeStorage(EventLoop(), disk=set(b.chunk_ids), host=set(b.chunk_ids))
        cfg = ServingConfig(admit="ready", prefetch="hrrn", max_wait_s=max_wait_s)
        core = ServingCore(LinearCost(), st.lookup, cfg, chunk_bytes=1)
        core.handle(Arrival(request=req(9, 0.0, 10_000)), 0.0)  # keeps the GPU busy for 10.1 s
        core.handle(Arrival(request=b), 0.01)
        assert core.scheduler.state_of(1) is RequestState.READY
        st.host.clear()  # evicted while it waited
        acts = core.handle(StepDone(step_id=0), 10.2)
        return core, [a for a in acts if isinstance(a, StartLoad)]

    core, loads = evicted_while_waiting(60.0)
    assert [(ld.background, ld.items[0][0]) for ld in loads] == [(True, 1)]
    assert core.scheduler.state_of(1) is RequestState.LOADING
    # The same request past the wait bound (it waited 10.19 s) is served next, with the step loading its KV
    core, loads = evicted_while_waiting(10.0)
    assert [(ld.background, ld.items[0][0]) for ld in loads] == [(False, 1)]
    assert core.scheduler.state_of(1) is RequestState.RUNNING
    assert core.metrics.counters["overdue_admits"] == 1


# -- compute joins the meet-in-the-middle ------------------------------------------------------------------------
class _ComputeCost(LinearCost):
    """LinearCost plus what compute needs: a recompute cost growing with position and a host->GPU cost."""

    def host_load_s(self, nbytes):
        return 0.01 * nbytes  # 10 ms a chunk (chunk_bytes=1)

    def recompute_chunk_s(self, context, chunk_tokens=256):
        return 0.001 * (1 + context / 256)


def test_a_recomputed_front_is_on_the_gpu_not_pinned_and_not_prefilled_again():
    from kvstream.serving.core import LoadDone, ReleaseChunks

    r = req(0, 0.0, 1024 + 10)  # 4 chunks on disk, 10 tokens to compute
    store = set(r.chunk_ids)

    def lookup(ids):
        n = next((i for i, c in enumerate(ids) if c not in store), len(ids))
        return n, 0

    core = ServingCore(_ComputeCost(), lookup, ServingConfig(compute=True), chunk_bytes=1)
    (load,) = [a for a in core.handle(Arrival(request=r), 0.0) if isinstance(a, StartLoad)]
    assert load.compute_s == ((0.001, 0.002, 0.003, 0.004),)  # its position's prefill cost, in prefix order
    acts = core.handle(LoadDone(load_id=load.load_id, available=((0, 4),), computed=((0, 2),)), 0.5)
    (step,) = [a for a in acts if isinstance(a, StartStep)]
    # prefill of the 10 new tokens only (the 2 recomputed chunks are cached on the GPU), host->GPU of 2 chunks
    assert step.duration == pytest.approx(0.1 + 0.010 + 2 * 0.01)
    acts = core.handle(StepDone(step_id=step.step_id), 0.5 + step.duration)
    released = [c for a in acts if isinstance(a, ReleaseChunks) for c in a.chunk_ids]
    assert released == list(r.chunk_ids[2:4])  # only what the load pinned in host memory
    rec = core.metrics.requests[0]
    assert (rec.computed_chunks, rec.disk_chunks) == (2, 2)
    assert not [a for a in acts if isinstance(a, WriteChunks)]  # recomputed chunks are stored already


def test_compute_off_sends_no_costs_and_a_bad_count_is_refused():
    from kvstream.serving.core import LoadDone

    r = req(0, 0.0, 1024)
    core = ServingCore(_ComputeCost(), lambda ids: (len(ids), 0), ServingConfig(), chunk_bytes=1)
    (load,) = [a for a in core.handle(Arrival(request=r), 0.0) if isinstance(a, StartLoad)]
    assert load.compute_s == ()
    with pytest.raises(UsageError, match="computed"):
        core.handle(LoadDone(load_id=load.load_id, available=((0, 2),), computed=((0, 3),)), 0.1)


# -- partly ready: Bidaw with compute ------------------------------------------------------------------------------
def _bidaw_compute_core(max_running=4):
    from kvstream.compute import ComputePolicy

    store = set()

    def lookup(ids):
        n = next((i for i, c in enumerate(ids) if c not in store), len(ids))
        return n, 0

    # a tier reading a chunk (1 byte) in 5 ms: the GPU's 1-4 ms a chunk beats it on the front
    pol = ComputePolicy(n_tiers=1, bandwidth=[1 / 0.005])
    core = ServingCore(_ComputeCost(), lookup, ServingConfig(admit="ready", prefetch="hrrn", compute=True,
                                                             max_running=max_running),
                       chunk_bytes=1, compute=pol)
    return core, store, pol


def test_bidaw_sees_a_request_whose_front_is_recomputed_as_partly_ready():
    """The driver's compute policy is asked at arrival: the scheduler learns the recomputable front (its
    disk-HRRN ranks the request by its back only); the background load carries the costs at the batch's free
    GPU share, and its recomputed front is on the GPU at admission (not moved from host memory)."""
    from kvstream.serving.core import LoadDone

    core, store, pol = _bidaw_compute_core()
    r = req(0, 0.0, 1024 + 10)  # 4 chunks on disk
    store.update(r.chunk_ids)
    acts = core.handle(Arrival(request=r), 0.0)
    sched = core.scheduler
    m = pol.estimate(tuple(0.001 * (1 + j) for j in range(4)), [1] * 4)
    assert m > 0 and sched._front[0] == m  # its front, in bytes (chunk_bytes=1)
    (load,) = [a for a in acts if isinstance(a, StartLoad)]
    assert load.background and load.compute_s == ((0.001, 0.002, 0.003, 0.004),)  # idle GPU: all of it
    assert sched.partly_ready(0)
    acts = core.handle(LoadDone(load_id=load.load_id, available=((0, 4),), computed=((0, 2),)), 0.02)
    (step,) = [a for a in acts if isinstance(a, StartStep)]
    # 10 new tokens; 2 chunks host->GPU; the recompute ran while the GPU was idle: it cost the steps nothing
    assert step.duration == pytest.approx(0.1 + 0.010 + 2 * 0.01)
    assert core.metrics.requests[0].computed_chunks == 2
    assert "background_compute_us" not in core.metrics.counters


def test_a_background_recompute_beside_a_step_is_charged_to_the_next_step():
    """The GPU ran a step through the whole background load: the recompute's GPU seconds (1 + 2 ms, at the
    whole GPU) were taken from the steps, so the next step is that much longer (the GPU's work is conserved)."""
    from kvstream.serving.core import LoadDone

    core, store, _ = _bidaw_compute_core(max_running=256)
    core.handle(Arrival(request=req(1, 0.0, 1000)), 0.0)  # step 0: 0 .. 1.1 s
    r = req(0, 0.0, 1024 + 10)
    store.update(r.chunk_ids)
    (load,) = [a for a in core.handle(Arrival(request=r), 0.0) if isinstance(a, StartLoad)]
    assert load.background and load.compute_s
    core.handle(LoadDone(load_id=load.load_id, available=((0, 4),), computed=((0, 2),)), 0.5)
    (step,) = [a for a in core.handle(StepDone(step_id=0), 1.1) if isinstance(a, StartStep)]
    assert step.duration == pytest.approx(0.1 + 0.010 + 2 * 0.01 + 0.003)
    assert core.metrics.counters["background_compute_us"] == 3000


def test_background_compute_backs_off_when_the_batch_is_full():
    """Two requests fill a batch of two while a third waits on the disk: its load gets no costs (the GPU has no
    share free for it) and the scheduler sees no recomputable front."""
    core, store, _ = _bidaw_compute_core(max_running=2)
    busy = [req(i, 0.0, 10_000, out=50) for i in (1, 2)]  # ready (nothing on disk), long decodes
    for b in busy:
        core.handle(Arrival(request=b), 0.0)
    core.handle(StepDone(step_id=0), 11.0)  # the second one joins the first's decodes
    assert len(core.scheduler.running) == 2
    r = req(0, 11.01, 1024 + 10)
    store.update(r.chunk_ids)
    acts = core.handle(Arrival(request=r), 11.01)
    (load,) = [a for a in acts if isinstance(a, StartLoad)]
    assert load.background and load.compute_s == ()
    assert not core.scheduler.partly_ready(0) and 0 not in core.scheduler._front
