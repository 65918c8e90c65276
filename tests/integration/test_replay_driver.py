"""Both drivers make identical decisions from identical event sequences.

The simulator's driver (an event heap) and replay's real-time driver (a clock, threads posting completions)
are run on the same workload against stores with the same timing: load = fixed + per chunk read. The
real-time driver runs on a virtual clock that jumps to the next due time, so the comparison is exact."""

from __future__ import annotations

import heapq

from kvstream.serving.core import LoadDone, ServingConfig, ServingCore, WriteChunks
from kvstream.serving.backend import ServingBackend
from kvstream.serving.realtime import Clock, RealtimeDriver
from kvstream.testing.serving import LinearCost, prefix_lookup, req, run


class FakeRTBackend(ServingBackend):
    def __init__(self, clock, disk, fixed, per_chunk):
        self.clock, self.disk, self.fixed, self.per_chunk = clock, set(disk), fixed, per_chunk
        self.host: set = set()
        self._heap: list = []
        self._seq = 0

    def lookup(self, ids):
        return prefix_lookup(ids, self.host, self.disk)

    def start_load(self, action, post):
        n_disk = sum(1 for _, ch in action.items for c in ch if c not in self.host)
        delay = (self.fixed + self.per_chunk * n_disk) if n_disk else 0.0
        ev = LoadDone(load_id=action.load_id, available=tuple((rid, len(ch)) for rid, ch in action.items))
        self._seq += 1
        heapq.heappush(self._heap, (self.clock.now() + delay, self._seq, ev, post))
        self.fire_due(self.clock.now())

    def fire_due(self, now):
        while self._heap and self._heap[0][0] <= now:
            _, _, ev, post = heapq.heappop(self._heap)
            post(ev)

    def next_completion(self):
        return self._heap[0][0] if self._heap else None

    def write(self, action):
        pass

    def flush(self):
        pass

    def release(self, chunk_ids):
        pass


class VirtualClock(Clock):
    def __init__(self):
        self.t = 0.0
        self.backend = None

    def now(self):
        return self.t

    def wait(self, timeout):
        target = self.t + timeout
        nxt = self.backend.next_completion() if self.backend else None
        if nxt is not None and nxt <= target:
            self.t = nxt
            self.backend.fire_due(self.t)
        else:
            self.t = target

    def wake(self):
        pass


def _workload():
    reqs = [req(i, 0.04 * (i // 2), 256 * (1 + i % 6), out=1 + i % 4) for i in range(40)]
    disk = [c for r in reqs[::3] for c in r.chunk_ids[:3]]
    return reqs, disk


def _compare(cfg):
    reqs, disk = _workload()
    sim_log: list = []
    run(reqs, cfg, disk=disk, fixed=0.02, per_chunk=0.05, record=sim_log)
    clock = VirtualClock()
    be = FakeRTBackend(clock, disk, 0.02, 0.05)
    clock.backend = be
    core = ServingCore(LinearCost(), be.lookup, cfg, chunk_bytes=1)
    rt_log: list = []
    RealtimeDriver(core, be, reqs, clock=clock, sample_every_s=1e9, record=rt_log).run()
    assert len(rt_log) == len(sim_log)
    for (t1, e1, a1), (t2, e2, a2) in zip(sim_log, rt_log):
        assert e1 == e2 and a1 == a2 and abs(t1 - t2) < 1e-9
    assert core.finished == len(reqs)


def test_identical_decisions_fcfs_step_loads():
    _compare(ServingConfig())


def test_identical_decisions_lmcache_like():
    _compare(ServingConfig(load_mode="request", defer_writes=False))


def test_identical_decisions_bidaw():
    _compare(ServingConfig(admit="ready", prefetch="hrrn"))


class WindowBackend(FakeRTBackend):
    """A backend whose host-memory policy is queue-aware: it records every window it is given."""

    wants_window = True

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.windows: list = []

    def set_window(self, sessions):
        self.windows.append(list(sessions))


def test_replay_passes_the_policys_lookahead_window_to_queue_aware_eviction():
    reqs = [req(i, 0.01 * i, 512, out=2, session=f"user{i % 7}") for i in range(30)]
    disk = [c for r in reqs for c in r.chunk_ids]
    cfg = ServingConfig(prefetch="lookahead:4")
    clock = VirtualClock()
    be = WindowBackend(clock, disk, 0.02, 0.05)
    clock.backend = be
    core = ServingCore(LinearCost(), be.lookup, cfg, chunk_bytes=1)
    windows_seen: list = []
    real = core.window_sessions
    core.window_sessions = lambda *a: windows_seen.append(real(*a)) or windows_seen[-1]  # type: ignore[method-assign]
    log: list = []
    RealtimeDriver(core, be, reqs, clock=clock, sample_every_s=1e9, record=log).run()
    assert core.finished == len(reqs)
    assert len(be.windows) == len(log)  # after every event, as the simulator's driver does
    assert be.windows == windows_seen and any(len(w) == 4 for w in be.windows)  # the CachedAttention window (W=4)
    # No window for a policy without one, nor for a backend whose eviction is not queue-aware.
    be2 = WindowBackend(VirtualClock(), disk, 0.02, 0.05)
    assert not RealtimeDriver(ServingCore(LinearCost(), be2.lookup, ServingConfig(), chunk_bytes=1), be2, [])._window
    be3 = FakeRTBackend(VirtualClock(), disk, 0.02, 0.05)
    assert not RealtimeDriver(ServingCore(LinearCost(), be3.lookup, cfg, chunk_bytes=1), be3, [])._window


def test_one_dispatch_carries_out_every_action_in_order_for_both_drivers():
    # The one dispatch (kvstream.serving.backend) both drivers call: storage actions go to the backend in the
    # order given, a step to the driver's clock, and a load's completion only through post, later.
    from kvstream.serving.backend import dispatch
    from kvstream.serving.core import Flush, ReleaseChunks, StartLoad, StartStep

    calls: list = []

    class Recorder(ServingBackend):
        def lookup(self, ids):
            return 0, 0

        def start_load(self, action, post):
            calls.append(("load", action.load_id, post))

        def write(self, action):
            calls.append(("write", action.chunk_ids))

        def flush(self):
            calls.append(("flush",))

        def release(self, chunk_ids):
            calls.append(("release", tuple(chunk_ids)))

    def post(ev):
        calls.append(("posted", ev))

    acts = [WriteChunks(request_id=1, chunk_ids=("a",), first_position=0), StartStep(step_id=3, duration=0.5,
            prefills=1, decodes=0), Flush(), StartLoad(load_id=7, items=((1, ("b",)),), background=True),
            ReleaseChunks(chunk_ids=("c", "d"))]
    dispatch(acts, Recorder(), post=post, start_step=lambda a: calls.append(("step", a.step_id, a.duration)))
    assert calls == [("write", ("a",)), ("step", 3, 0.5), ("flush",), ("load", 7, post), ("release", ("c", "d"))]


def test_the_simulators_store_is_a_serving_backend_with_the_stores_window_rule():
    from kvstream.eviction import make_eviction_policy
    from kvstream.replication import parse_replication
    from kvstream.routing import parse_router
    from kvstream.serving.backend import window_wanted
    from kvstream.sim.devices import Device
    from kvstream.sim.engine import EventLoop
    from kvstream.sim.storage import SimStorage, SimTier

    def sim(policy):
        loop = EventLoop()
        tier = SimTier(name="t", device=Device(loop, "t", read_bw=1e9, write_bw=1e9))
        return SimStorage(loop, tiers=[tier], router=parse_router("single", ["t"]),
                          replication=parse_replication("single"), host_eviction=make_eviction_policy(policy),
                          host_capacity_chunks=8, chunk_bytes=1 << 20)

    qa, lru = sim("queue-aware"), sim("lru")
    assert isinstance(qa, ServingBackend) and qa.wants_window and not lru.wants_window
    look = ServingConfig(prefetch="lookahead:4")
    assert window_wanted(ServingCore(LinearCost(), qa.lookup, look, chunk_bytes=1), qa)
    assert not window_wanted(ServingCore(LinearCost(), qa.lookup, ServingConfig(), chunk_bytes=1), qa)
    assert not window_wanted(ServingCore(LinearCost(), lru.lookup, look, chunk_bytes=1), lru)
    assert lru.sample() == {"t.read": 0, "t.write": 0}


def test_store_backend_tags_sessions_on_reads_and_protects_the_window(tmp_path):
    from kvstream.serving.core import StartLoad
    from kvstream.serving.storebackend import StoreBackend
    from kvstream.store import open_store

    store = open_store({"tiers": [{"name": "local", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 26}],
                        "memory_bytes": 1 << 24, "memory_eviction": "queue-aware", "router": "single:local",
                        "replication": "single", "create_dirs": True})
    be = StoreBackend(store, model="m", chunk_bytes=4096, workers=1)
    try:
        assert be.wants_window
        for c in ("a0", "a1", "b0"):
            be.write(WriteChunks(request_id=0, chunk_ids=(c,), first_position=0))
        be.flush()
        be.sync()  # puts run on the backend's put thread, in order
        store.drain(timeout=30)
        got: list = []
        be._load(StartLoad(load_id=1, items=((0, ("a0", "a1")), (1, ("b0",))), background=True,
                           metas=(("user-a", 10), ("user-b", None))), got.append)
        assert got[0].available == ((0, 2), (1, 1))
        pol = store.memory.policy
        be.set_window(["user-a"])
        assert pol.is_protected(be.key("a0")) and pol.is_protected(be.key("a1"))
        assert not pol.is_protected(be.key("b0"))
        be.set_window([])
        assert not pol.is_protected(be.key("a0"))
    finally:
        be.close()
        store.close()


# -- one time line -------------------------------------------------------------------------------------------
def _run_virtual(reqs, cfg, speed):
    _, disk = _workload()
    clock = VirtualClock()
    be = FakeRTBackend(clock, disk, 0.02, 0.05)
    clock.backend = be
    core = ServingCore(LinearCost(), be.lookup, cfg, chunk_bytes=1)
    log: list = []
    drv = RealtimeDriver(core, be, reqs, clock=clock, speed=speed, sample_every_s=1e9, record=log)
    drv.run()
    return core, log


def test_speed_compresses_arrivals_everywhere():
    """``--speed 8``: TTFT, queueing time and the scheduler's waiting time all use the compressed arrival, so a
    run at speed 8 is the run of the re-timed requests at speed 1, and no time is negative."""
    import dataclasses

    reqs, _ = _workload()
    for cfg in (ServingConfig(), ServingConfig(admit="ready", prefetch="hrrn")):
        fast, log8 = _run_virtual(reqs, cfg, 8.0)
        scaled = [dataclasses.replace(r, arrival=r.arrival / 8) for r in reqs]
        same, log1 = _run_virtual(scaled, cfg, 1.0)
        assert [(round(t, 9), a) for t, _, a in log8] == [(round(t, 9), a) for t, _, a in log1]
        recs = fast.metrics.requests
        assert len(recs) == len(reqs) and all(r.ttft >= 0 and r.queue_s >= 0 for r in recs)
        assert [r.arrival for r in recs] == [r.arrival for r in scaled]
        times = [t for t, _, _ in log8]
        assert times == sorted(times)


class _StallingClock(Clock):
    """A wall clock whose first reading on the load thread is returned 0.2 s late (a poster descheduled between
    reading the clock and queueing its completion, as on a 2-core machine under load)."""

    def __init__(self):
        import threading
        import time

        self._time, self._threading = time, threading
        self._t0 = time.monotonic()
        self._cv = threading.Condition()
        self.stalled = False

    def now(self):
        t = self._time.monotonic() - self._t0
        if self._threading.current_thread().name.startswith("poster") and not self.stalled:
            self.stalled = True
            self._time.sleep(0.2)
        return t

    def wait(self, timeout):
        with self._cv:
            self._cv.wait(min(timeout, 0.005))

    def wake(self):
        with self._cv:
            self._cv.notify_all()


class _ThreadBackend(ServingBackend):
    """Every chunk on disk; each load posts from its own thread after 50 ms."""

    def lookup(self, ids):
        return len(ids), 0

    def start_load(self, action, post):
        import threading
        import time

        def work():
            time.sleep(0.05)
            post(LoadDone(load_id=action.load_id, available=tuple((rid, len(ch)) for rid, ch in action.items)))

        threading.Thread(target=work, name=f"poster-{action.load_id}").start()

    def write(self, action):
        pass

    def flush(self):
        pass

    def release(self, chunk_ids):
        pass


def test_a_late_posted_completion_never_runs_before_a_later_arrival():
    """A completion whose poster read the clock, then stalled while a later arrival was delivered, must not be
    delivered "before" that arrival (Bidaw's next load would start before its request arrived: negative
    queueing time, seen as a negative mean in a replay on a busy machine)."""
    reqs = [req(0, 0.0, 1024, out=2), req(1, 0.1, 1024, out=2)]
    clock = _StallingClock()
    core = ServingCore(LinearCost(), _ThreadBackend().lookup, ServingConfig(admit="ready", prefetch="hrrn"),
                       chunk_bytes=1)
    log: list = []
    RealtimeDriver(core, _ThreadBackend(), reqs, clock=clock, sample_every_s=1e9, record=log).run()
    assert clock.stalled and core.finished == 2
    times = [t for t, _, _ in log]
    assert times == sorted(times)
    assert all(r.queue_s >= 0 and r.ttft >= 0 for r in core.metrics.requests)


def test_store_backend_stages_the_stores_views_not_copies(tmp_path):
    """A load holds the store's own payload views until the core releases them: nothing is copied, and the KV
    stays valid and unchanged while the store evicts the entries and reuses host memory for other chunks."""
    import pytest

    from kvstream.serving.core import StartLoad
    from kvstream.serving.storebackend import StoreBackend, disk_load_gbps
    from kvstream.store import open_store

    store = open_store({"tiers": [{"name": "local", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 26}],
                        "memory_bytes": 1 << 20, "router": "single:local", "replication": "single",
                        "create_dirs": True})
    be = StoreBackend(store, model="m", chunk_bytes=4096, workers=1)
    try:
        want = {c: bytes([n + 1]) * 4096 for n, c in enumerate(("a0", "a1"))}
        for c, data in want.items():
            store.put(be.key(c), data)
        store.flush()
        store.drain(timeout=30)
        store.evict_memory()
        got: list = []
        be._load(StartLoad(load_id=1, items=((0, ("a0", "a1")),), background=True, metas=(("u", None, 0, 0),)),
                 got.append)
        assert got[0].available == ((0, 2),)
        views = {c: be._views[be.key(c)] for c in want}
        assert all(bytes(views[c]) == want[c] for c in want)
        assert be.loads[-1].disk_bytes == 2 * 4096 and be.loads[-1].memory_bytes == 0
        assert disk_load_gbps(be.loads)[2] == 2 * 4096
        store.evict_memory()  # the entries leave the cache; the buffers stay with the views
        for i in range(300):  # host memory (1 MiB) is filled several times over
            store.put(be.key(f"x{i}"), bytes([200]) * 4096)
            if i % 50 == 49:
                store.flush()
                store.drain(timeout=30)
        assert all(bytes(views[c]) == want[c] for c in want)
        be.release(("a0", "a1"))
        assert be.staged_bytes == 0
        with pytest.raises(ValueError):
            bytes(views["a0"])  # released: the store may reuse that buffer now
    finally:
        be.close()
        store.close()


def test_disk_load_gbps_counts_overlapping_loads_once():
    from kvstream.serving.storebackend import LoadRecord, disk_load_gbps

    loads = [LoadRecord(start=0.0, end=1.0, disk_bytes=10**9, memory_bytes=0, background=True),
             LoadRecord(start=0.5, end=1.5, disk_bytes=10**9, memory_bytes=5, background=False),
             LoadRecord(start=2.0, end=2.5, disk_bytes=5 * 10**8, memory_bytes=0, background=False),
             LoadRecord(start=3.0, end=9.0, disk_bytes=0, memory_bytes=10**9, background=False)]  # memory only
    gbps, busy, total = disk_load_gbps(loads)
    assert busy == 2.0 and total == 2.5 * 10**9 and gbps == 1.25
    assert disk_load_gbps([]) == (0.0, 0.0, 0)


def test_store_backend_tells_eviction_each_chunks_session_turn_and_position():
    """Bidaw's hit-potential eviction groups a session's chunks into visits (turn) and shrinks a prefix from its
    tail (position): a load passes both, per chunk, with the session and the previous answer length."""
    from kvstream.commands.replay import _system
    from kvstream.serving.core import StartLoad
    from kvstream.serving.storebackend import StoreBackend

    class Store:
        memory: set = set()

        def read_chunks(self, keys, *, metas=None, compute=None):
            self.metas = list(metas)
            return iter([(i, None) for i in range(len(keys))])

    st = Store()
    be = StoreBackend(st, model="m", chunk_bytes=4096, workers=1)
    try:
        got: list = []
        be._load(StartLoad(load_id=0, items=((7, ("c5", "c6")), (8, ("d0",))), background=False,
                           metas=(("s1", 40, 3, 5), ("s2", None, 0, 0))), got.append)
        assert got[0].available == ((7, 0), (8, 0))
        assert [(m.session, m.prev_answer_tokens, m.round_index, m.position) for m in st.metas] == \
            [("s1", 40, 3, 5), ("s1", 40, 3, 6), ("s2", None, 0, 0)]
    finally:
        be.close()
    # both Bidaw systems run its eviction, the others LRU
    assert [_system(n)["memory_eviction"] for n in ("kvstream", "kvstream-only", "bidaw-only", "lmcache-like")] \
        == ["hit-potential", "lru", "hit-potential", "lru"]
