"""Both drivers make identical decisions from identical event sequences.

The simulator's driver (an event heap) and replay's real-time driver (a clock, threads posting completions)
are run on the same workload against stores with the same timing: load = fixed + per chunk read. The
real-time driver runs on a virtual clock that jumps to the next due time, so the comparison is exact."""

from __future__ import annotations

import heapq

from _serving_fakes import LinearCost, req, run

from kvstream.serving.core import LoadDone, ServingConfig, ServingCore, WriteChunks
from kvstream.serving.realtime import Clock, RealtimeBackend, RealtimeDriver


class FakeRTBackend(RealtimeBackend):
    def __init__(self, clock, disk, fixed, per_chunk):
        self.clock, self.disk, self.fixed, self.per_chunk = clock, set(disk), fixed, per_chunk
        self.host: set = set()
        self._heap: list = []
        self._seq = 0

    def lookup(self, ids):
        present = in_host = 0
        for c in ids:
            if c in self.host:
                in_host += 1
            elif c not in self.disk:
                break
            present += 1
        return present, in_host

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
