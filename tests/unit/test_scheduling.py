"""Schedulers driven by hand-made event sequences, plus property tests of the lifecycle and the limits."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.errors import UsageError
from kvstream.scheduling import (
    Arrival,
    BidawScheduler,
    CachedAttentionScheduler,
    FCFSScheduler,
    KVEvicted,
    LoadFinished,
    RequestInfo,
    RequestState,
    SchedulerConfig,
    Split,
    StepFinished,
    disk_hrrn,
    make_scheduler,
)

GB = 1_000_000_000


def req(rid: Hashable, t: float, *, disk: int = 0, tokens: int = 100, session: Hashable | None = None) -> RequestInfo:
    return RequestInfo(request_id=rid, arrival=t, prompt_tokens=tokens, disk_bytes=disk, session=session)


def test_small_request_behind_large_disk_bound_one_runs_first() -> None:
    cfg = SchedulerConfig(max_running=8, staging_bytes=10 * GB)
    bidaw, fcfs = BidawScheduler(cfg), FCFSScheduler(cfg)
    for s in (bidaw, fcfs):
        s.on_arrival(req("large", 0.0, disk=8 * GB, tokens=4000), now=0.0)
        s.on_arrival(req("small", 0.1, tokens=50), now=0.1)
    d = bidaw.schedule(now=0.1)
    assert d.admit == ("small",)  # runs now, not blocked
    assert d.blocking == ()
    assert [lo.request_id for lo in d.loads] == ["large"]  # loading in the background
    assert bidaw.state_of("large") is RequestState.LOADING
    # FCFS (vLLM + LMCache): the large one goes first and the step waits for its load: the small one is blocked.
    f = fcfs.schedule(now=0.1)
    assert f.admit == ("large", "small")
    assert f.blocking == ("large",)
    # Bidaw: once its load lands, the large request becomes ready and runs.
    bidaw.on_load_finished("large", now=5.0)
    assert bidaw.schedule(now=5.0).admit == ("large",)


def test_disk_hrrn_prefers_small_loads_and_staging_bounds_them() -> None:
    s = BidawScheduler(SchedulerConfig(max_running=1, staging_bytes=1 * GB))
    s.on_arrival(req("busy", 0.0), now=0.0)
    assert s.schedule(now=0.0).admit == ("busy",)  # the batch is full from now on
    s.on_arrival(req("big", 0.0, disk=995_000_000), now=0.0)
    s.on_arrival(req("tiny", 0.0, disk=10_000_000), now=0.0)
    d = s.schedule(now=1.0)
    assert [lo.request_id for lo in d.loads] == ["tiny"]  # same wait, smaller KV: higher ratio; big does not fit
    assert d.loads[0].priority == pytest.approx(disk_hrrn(1.0, 10_000_000))
    assert s.schedule(now=1.5).loads == ()  # staging holds tiny's bytes
    s.on_load_finished("tiny", now=2.0)
    assert s.schedule(now=2.0).loads == ()  # tiny is ready but not admitted (batch full): its KV stays staged
    assert s.staging_used == 10_000_000
    s.on_step_finished(["busy"], now=3.0)
    d = s.schedule(now=3.0)
    assert d.admit == ("tiny",)
    assert [lo.request_id for lo in d.loads] == ["big"]  # admission freed the staging memory


def _drive_stream(scheduler: BidawScheduler, *, horizon: float) -> dict[Hashable, float]:
    """One serial disk at 1 GB/s. A burst of 20 small disk-bound requests (100 MB) at t=0, a 950 MB request at
    t=0.05, then one small request every 0.11 s (the disk is 91 % busy with them). Admitted requests run and
    finish at once. Returns when each request's load was started."""
    started: dict[Hashable, float] = {}
    disk: list[tuple[Hashable, int]] = []  # started loads, served in order
    busy_until = 0.0
    t, n, next_small = 0.0, 0, 0.0
    for _ in range(20):
        scheduler.on_arrival(req(n, 0.0, disk=100_000_000), now=0.0)
        n += 1
    large_in = False
    while t < horizon:
        if not large_in and t >= 0.05:
            scheduler.on_arrival(req("large", t, disk=950_000_000), now=t)
            large_in = True
        if t >= next_small:
            scheduler.on_arrival(req(n, t, disk=100_000_000), now=t)
            n += 1
            next_small = round(next_small + 0.11, 6)
        while disk and busy_until <= t:  # the disk finished its current load
            rid, _nbytes = disk.pop(0)
            scheduler.on_load_finished(rid, now=t)
            if disk:
                busy_until = t + disk[0][1] / GB
        d = scheduler.schedule(now=t)
        scheduler.on_step_finished(d.admit, now=t)
        for lo in d.loads:
            started[lo.request_id] = t
            if not disk:
                busy_until = t + lo.nbytes / GB
            disk.append((lo.request_id, lo.nbytes))
        t = round(t + 0.01, 6)
    return started


def test_long_waiting_large_request_is_eventually_loaded() -> None:
    # disk-HRRN alone (no wait bound): the ratio is what brings the large load in
    started = _drive_stream(BidawScheduler(SchedulerConfig(staging_bytes=1 * GB, max_wait_s=math.inf)), horizon=40.0)
    assert "large" in started
    t_large = started["large"]
    smalls_before = [k for k, v in started.items() if k != "large" and v <= t_large]
    assert len(smalls_before) >= 20  # the small loads went first (the whole burst) ...
    assert t_large < 20.0  # ... but the large one's ratio caught up well before the stream ends


def test_smallest_first_would_starve_the_large_request() -> None:
    # Same stream with the order key replaced by "smallest KV first": the large request never loads.
    s = BidawScheduler(SchedulerConfig(staging_bytes=1 * GB, max_wait_s=math.inf))
    q = s._preparing
    q.ratios = lambda now: np.where(q._valid, -q._size, -np.inf)  # type: ignore[method-assign]
    assert "large" not in _drive_stream(s, horizon=40.0)


def test_fcfs_admits_in_arrival_order_and_blocks_on_disk_loads() -> None:
    s = FCFSScheduler(SchedulerConfig(max_running=2))
    s.on_arrival(req("a", 0.0, disk=GB), now=0.0)
    s.on_arrival(req("b", 1.0), now=1.0)
    s.on_arrival(req("c", 2.0), now=2.0)
    d = s.schedule(now=2.0)
    assert d.admit == ("a", "b")
    assert d.blocking == ("a",)
    assert [lo.request_id for lo in d.loads] == ["a"]
    assert s.schedule(now=2.0).admit == ()  # batch full
    s.on_load_finished("a", now=3.0)  # a synchronous load completing is allowed and changes nothing
    s.on_step_finished(["a"], now=3.0)
    assert s.schedule(now=3.0).admit == ("c",)


def test_cachedattention_prefetches_the_lookahead_window_only() -> None:
    s = CachedAttentionScheduler(SchedulerConfig(max_running=1, window=2, staging_bytes=10 * GB))
    s.on_arrival(req("run", 0.0), now=0.0)
    for i in range(4):
        s.on_arrival(req(f"w{i}", 1.0 + i, disk=GB, session=f"user{i}"), now=1.0 + i)
    d = s.schedule(now=5.0)
    assert d.admit == ("run",)
    assert [lo.request_id for lo in d.loads] == ["w0", "w1"]  # the two requests in the window
    assert s.window_sessions() == ["user0", "user1"]
    s.on_load_finished("w0", now=6.0)
    s.on_step_finished(["run"], now=6.0)
    d = s.schedule(now=6.0)
    assert d.admit == ("w0",) and d.blocking == ()  # prefetched: no wait
    assert [lo.request_id for lo in d.loads] == ["w2"]  # the window moved on
    s.on_step_finished(["w0"], now=7.0)
    d = s.schedule(now=7.0)
    # w1's prefetch is still in flight: it waits for it, and nothing behind it passes (the step does not wait)
    assert d.admit == () and d.blocking == ()
    s.on_load_finished("w1", now=7.5)
    assert s.schedule(now=7.5).admit == ("w1",)


def test_cachedattention_head_that_can_never_be_staged_loads_synchronously() -> None:
    s = CachedAttentionScheduler(SchedulerConfig(max_running=1, window=4, staging_bytes=GB))
    s.on_arrival(req("run", 0.0), now=0.0)
    s.on_arrival(req("a", 1.0), now=1.0)  # KV in host memory at arrival
    s.on_arrival(req("b", 2.0, disk=GB), now=2.0)
    assert s.schedule(now=2.0).admit == ("run",)
    assert s.staging_used == GB  # b is staged behind a
    s.on_kv_evicted("a", disk_bytes=GB // 2, now=3.0)  # a's KV left host memory: it needs disk now
    s.on_step_finished(["run"], now=3.0)
    d = s.schedule(now=3.0)  # a cannot be staged while b holds the staging memory, and b waits behind a
    assert d.admit == ("a",) and d.blocking == ("a",) and [lo.request_id for lo in d.loads] == ["a"]
    none = CachedAttentionScheduler(SchedulerConfig(window=0))
    none.on_arrival(req("x", 0.0, disk=GB), now=0.0)
    assert none.schedule(now=0.0).blocking == ("x",)  # no window: FCFS


def test_driver_checks_candidates_and_reserves_its_own_resources() -> None:
    """check: the driver's fresh view (tokens, disk bytes now); reserve: resources the scheduler does not track."""
    from kvstream.scheduling import Candidate

    s = BidawScheduler(SchedulerConfig(max_prefill_tokens=1000))
    for i in range(4):
        s.on_arrival(req(i, float(i), tokens=900), now=float(i))
    fresh = {0: Candidate(tokens=100), 1: Candidate(tokens=50, disk_bytes=GB), 2: Candidate(tokens=800),
             3: Candidate(tokens=10)}
    asked: list = []
    d = s.schedule(now=5.0, check=lambda rid: asked.append(rid) or fresh[rid], reserve=lambda rid: rid != 3)
    # 0 fits with its fresh token count; 1 lost its KV: back to preparing (and loaded); 2 fits (100 + 800);
    # 3 fits the tokens but the driver has no room for it: admission stops there.
    assert d.admit == (0, 2) and [lo.request_id for lo in d.loads] == [1]
    assert s.state_of(1) is RequestState.LOADING and s.state_of(3) is RequestState.READY
    assert asked == [0, 1, 2, 3]
    assert s.schedule(now=5.0, check=lambda rid: None).admit == ()  # None: stop at once
    f = FCFSScheduler()
    f.on_arrival(req("x", 0.0), now=0.0)  # READY at arrival, but its KV is on disk by admission time
    d = f.schedule(now=1.0, check=lambda rid: Candidate(tokens=5, disk_bytes=GB))
    assert d.admit == ("x",) and d.blocking == ("x",) and d.loads[0].nbytes == GB


def test_first_request_of_each_decision_fits_the_token_budget_even_while_others_run() -> None:
    s = FCFSScheduler(SchedulerConfig(max_prefill_tokens=1000))
    s.on_arrival(req("a", 0.0, tokens=10), now=0.0)
    assert s.schedule(now=0.0).admit == ("a",)
    s.on_arrival(req("long", 1.0, tokens=5000), now=1.0)
    s.on_arrival(req("b", 2.0, tokens=10), now=2.0)
    assert s.schedule(now=2.0).admit == ("long",)  # its step's only prefill; "a" keeps decoding
    assert s.schedule(now=3.0).admit == ("b",)


def test_admit_false_decides_loads_only_and_max_loading_caps_them() -> None:
    s = BidawScheduler(SchedulerConfig(max_loading=2))
    s.on_arrival(req("r", 0.0), now=0.0)
    for i in range(3):
        s.on_arrival(req(i, 0.0, disk=GB * (i + 1)), now=0.0)
    d = s.schedule(now=1.0, admit=False)
    assert d.admit == () and [lo.request_id for lo in d.loads] == [0, 1]  # two in flight at most
    s.on_load_finished(0, now=2.0)
    assert [lo.request_id for lo in s.schedule(now=2.0, admit=False).loads] == [2]
    assert s.schedule(now=2.0).admit == ("r", 0)


def test_release_staging_at_prefill_holds_the_bytes_until_the_gpu_has_them() -> None:
    s = BidawScheduler(SchedulerConfig(staging_bytes=GB, release_staging="prefill"))
    s.on_arrival(req("a", 0.0, disk=GB), now=0.0)
    s.on_arrival(req("b", 0.0, disk=GB), now=0.0)
    assert [lo.request_id for lo in s.schedule(now=0.0).loads] == ["a"]
    s.on_load_finished("a", now=1.0)
    d = s.schedule(now=1.0)
    assert d.admit == ("a",) and d.loads == ()  # admitted, but its KV still holds the staging memory
    s.on_step_finished([], now=2.0, prefilled=["a"])
    assert [lo.request_id for lo in s.schedule(now=2.0).loads] == ["b"]
    with pytest.raises(UsageError, match="prefilled in state"):
        s.on_step_finished([], now=3.0, prefilled=["b"])


def test_window_sessions_follow_each_policys_serving_order() -> None:
    b = BidawScheduler(SchedulerConfig(max_running=1, window=3))
    b.on_arrival(req("busy", 0.0), now=0.0)
    b.schedule(now=0.0)
    b.on_arrival(req("p1", 1.0, disk=GB, session="s-p1"), now=1.0)
    b.on_arrival(req("r1", 2.0, session="s-r1"), now=2.0)
    b.on_arrival(req("p2", 3.0, disk=GB, session="s-p2"), now=3.0)
    b.on_arrival(req("r2", 4.0, session="s-r2"), now=4.0)
    assert b.window_sessions() == ["s-r1", "s-r2", "s-p1"]  # ready queue first, then preparing by arrival
    assert b.window_sessions(10) == ["s-r1", "s-r2", "s-p1", "s-p2"]
    f = make_scheduler("fcfs", SchedulerConfig(window=2))
    for i in range(3):
        f.on_arrival(req(i, float(i), disk=GB * (i % 2), session=f"u{i}"), now=float(i))
    assert f.window_sessions() == ["u0", "u1"]


def test_batch_limits_slots_and_prefill_tokens() -> None:
    s = BidawScheduler(SchedulerConfig(max_running=3, max_prefill_tokens=1000))
    for i, tokens in enumerate([600, 300, 300, 10]):
        s.on_arrival(req(i, float(i), tokens=tokens), now=float(i))
    assert s.schedule(now=4.0).admit == (0, 1)  # 600 + 300; the next 300 would exceed 1000: stop, no skipping
    assert s.schedule(now=4.0).admit == (2,)  # next step: fresh token budget, but only the third slot is free
    s.on_step_finished([0], now=5.0)
    assert s.schedule(now=5.0).admit == (3,)
    big = BidawScheduler(SchedulerConfig(max_prefill_tokens=10))
    big.on_arrival(req("huge", 0.0, tokens=5000), now=0.0)
    assert big.schedule(now=0.0).admit == ("huge",)  # an empty batch always admits its first candidate


def test_evicted_ready_request_goes_back_to_preparing() -> None:
    s = BidawScheduler(SchedulerConfig(max_running=1))
    s.on_arrival(req("busy", 0.0), now=0.0)
    s.on_arrival(req("r", 0.5), now=0.5)
    s.schedule(now=1.0)
    s.handle(KVEvicted(request_id="r", disk_bytes=GB, now=1.0))
    assert s.state_of("r") is RequestState.PREPARING
    d = s.schedule(now=1.0)
    assert [lo.request_id for lo in d.loads] == ["r"]


def test_illegal_transitions_name_request_event_and_state() -> None:
    s = make_scheduler("bidaw")
    s.on_arrival(req("x", 0.0), now=0.0)
    with pytest.raises(UsageError, match=r"load finished for request 'x' is not allowed in state ready"):
        s.on_load_finished("x", now=0.0)
    with pytest.raises(UsageError, match="arrived twice"):
        s.on_arrival(req("x", 0.0), now=0.0)
    with pytest.raises(UsageError, match=r"step finished for request 'x' is not allowed in state ready"):
        s.on_step_finished(["x"], now=0.0)
    with pytest.raises(UsageError, match="state unknown"):
        s.on_load_finished("ghost", now=0.0)
    with pytest.raises(KeyError, match="known: bidaw, cachedattention, fcfs"):
        make_scheduler("sjf")
    with pytest.raises(UsageError, match="negative"):
        RequestInfo(request_id=1, arrival=0.0, prompt_tokens=1, disk_bytes=-1)


def test_event_objects_drive_the_same_methods() -> None:
    s = BidawScheduler()
    s.handle(Arrival(request=req("a", 0.0, disk=GB), now=0.0))
    d = s.schedule(now=0.0)
    s.handle(LoadFinished(request_id="a", now=1.0))
    assert s.schedule(now=1.0).admit == ("a",)
    s.handle(StepFinished(finished=("a",), now=2.0))
    assert s.state_of("a") is None and d.loads[0].request_id == "a"


# ---------------------------------------------------------------------------------------------------------------
# partly ready: a request whose front the GPU recomputes waits on the disk for its back only


def _partly(first: str, t_first: float, second: str, t_second: float, now: float) -> list[Hashable]:
    """Two preparing requests of 1 GB each; "b" is partly ready (0.8 GB of its front recomputed, so it waits
    for 0.2 GB). One load at a time. Returns the order in which they are admitted."""
    s = BidawScheduler(SchedulerConfig(max_running=8, max_loading=1))
    info = {"a": RequestInfo(request_id="a", arrival=0.0, prompt_tokens=100, disk_bytes=GB),
            "b": RequestInfo(request_id="b", arrival=0.0, prompt_tokens=100, disk_bytes=GB,
                             compute_bytes=800_000_000)}
    for rid, t in ((first, t_first), (second, t_second)):
        s.on_arrival(dataclasses.replace(info[rid], arrival=t), now=t)
    assert s.partly_ready("b") and not s.partly_ready("a")
    admitted: list[Hashable] = []
    for _ in range(4):
        d = s.schedule(now=now)
        admitted += d.admit
        for lo in d.loads:
            if lo.request_id == "b":
                assert lo.compute_bytes == 800_000_000 and lo.nbytes == GB
                assert s.staging_used == GB - 800_000_000  # its front goes to the GPU, not to host memory
            s.on_load_finished(lo.request_id, now=now)
        now += 1.0
    return admitted


def test_bidaw_admits_a_partly_ready_request_ahead_when_disk_hrrn_says_so() -> None:
    # "a" (fully preparing) arrived first; at t=2 its ratio is 1 + 2 s / 1 GB, b's 1 + 1 s / 0.2 GB: b first.
    assert disk_hrrn(2.0, GB) < disk_hrrn(1.0, GB - 800_000_000)
    assert _partly("a", 0.0, "b", 1.0, now=2.0) == ["b", "a"]
    # The same two, "a" having waited long enough that its ratio is the higher: disk-HRRN picks "a", partly
    # ready or not (no unconditional priority; a partly-ready request cannot starve a large load).
    assert disk_hrrn(100.0, GB) > disk_hrrn(1.0, GB - 800_000_000)
    assert _partly("a", 0.0, "b", 99.0, now=100.0) == ["a", "b"]


def test_a_split_rekeys_the_preparing_queue_and_is_one_lifecycle_event() -> None:
    s = BidawScheduler(SchedulerConfig(max_running=8, max_loading=1))
    s.on_arrival(req("a", 0.0, disk=GB), now=0.0)
    s.on_arrival(req("b", 1.0, disk=GB), now=1.0)
    s.handle(Split(request_id="b", compute_bytes=900_000_000, now=1.5))  # the policy now recomputes its front
    assert s.partly_ready("b")
    d = s.schedule(now=2.0)
    assert [lo.request_id for lo in d.loads] == ["b"]
    with pytest.raises(UsageError, match="split for request 'b' is not allowed in state loading"):
        s.on_split("b", compute_bytes=0, now=2.0)
    with pytest.raises(UsageError, match="compute_bytes"):
        s.on_split("a", compute_bytes=2 * GB, now=2.0)
    with pytest.raises(UsageError, match="compute_bytes"):
        RequestInfo(request_id=1, arrival=0.0, prompt_tokens=1, disk_bytes=1, compute_bytes=2)
    s.on_split("a", compute_bytes=0, now=2.0)  # unchanged: a no-op
    assert not s.partly_ready("a")


# ---------------------------------------------------------------------------------------------------------------
# properties

events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(0, 3 * GB), st.integers(1, 3000)),
        st.tuples(st.just("load"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("evict"), st.integers(0, 30), st.integers(1, GB)),
        st.tuples(st.just("split"), st.integers(0, 30), st.integers(0, 4)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", ["fcfs", "cachedattention", "bidaw"])
@settings(max_examples=80, deadline=None)
@given(seq=events, staging=st.integers(GB // 2, 4 * GB))
def test_lifecycle_and_limits_hold_under_random_events(name: str, seq: list[tuple[str, int, int]], staging: int) -> None:
    cfg = SchedulerConfig(max_running=4, max_prefill_tokens=4000, staging_bytes=staging, window=3)
    s = make_scheduler(name, cfg)
    loading: list[Hashable] = []
    admitted: list[Hashable] = []
    arrivals: dict[Hashable, float] = {}
    n = 0
    for i, (kind, a, b) in enumerate(seq):
        now = float(i)
        if kind == "arrive":
            s.on_arrival(RequestInfo(request_id=n, arrival=now, prompt_tokens=b, disk_bytes=a, session=n % 5,
                                     compute_bytes=a // (1 + b % 4) if b % 2 else 0), now=now)  # partly ready
            arrivals[n] = now
            n += 1
        elif kind == "split":
            preparing = [r for r in range(n) if s.state_of(r) is RequestState.PREPARING]
            if preparing:
                rid = preparing[a % len(preparing)]
                s.on_split(rid, compute_bytes=s._disk[rid] * b // 4, now=now)
        elif kind == "load" and loading:
            rid = loading.pop(a % len(loading))
            if s.state_of(rid) in (RequestState.LOADING, RequestState.RUNNING):
                s.on_load_finished(rid, now=now)
        elif kind == "finish" and s.running:
            rid = sorted(s.running)[a % len(s.running)]
            s.on_step_finished([rid], now=now)
        elif kind == "evict":
            ready = [r for r in range(n) if s.state_of(r) is RequestState.READY]
            if ready:
                s.on_kv_evicted(ready[a % len(ready)], disk_bytes=b, now=now)
        waits = {r: s._wait_bytes(r) for r in range(n) if s.state_of(r) is RequestState.PREPARING}
        d = s.schedule(now=now)
        for rid in d.admit:
            assert s.state_of(rid) is RequestState.RUNNING
            assert rid not in admitted  # admitted exactly once
            admitted.append(rid)
            if name == "bidaw" and rid in d.blocking:
                # Bidaw makes a step wait for a load only for an overdue request or one too large to stage
                assert now - arrivals[rid] >= cfg.max_wait_s or waits.get(rid, 0) > staging
        loading += [lo.request_id for lo in d.loads]
        assert len(s.running) <= cfg.max_running
        # Staging: within budget, or one oversized load alone.
        assert s.staging_used <= staging or len([r for r in range(n) if s.state_of(r) is RequestState.LOADING]) <= 1
    # Drain: with loads finishing and steps completing, every request is eventually admitted.
    for step in range(10 * (n + 1)):
        now = float(len(seq) + step)
        for rid in list(loading):
            if s.state_of(rid) in (RequestState.LOADING, RequestState.RUNNING):
                s.on_load_finished(rid, now=now)
        loading.clear()
        s.on_step_finished(sorted(s.running, key=str), now=now)
        d = s.schedule(now=now)
        admitted += list(d.admit)
        loading += [lo.request_id for lo in d.loads]
        if s.waiting() == 0 and not s.running:
            break
    assert s.waiting() == 0
    assert sorted(admitted) == list(range(n))
