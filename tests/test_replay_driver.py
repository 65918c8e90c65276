"""Both drivers make identical decisions from identical event sequences.

The simulator's driver (an event heap) and replay's real-time driver (a clock, threads posting completions)
are run on the same workload against stores with the same timing: load = fixed + per chunk read. The
real-time driver runs on a virtual clock that jumps to the next due time, so the comparison is exact."""

from __future__ import annotations

import heapq

from _serving_fakes import LinearCost, req, run

from kvstream.serving.core import LoadDone, ServingConfig, ServingCore
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
