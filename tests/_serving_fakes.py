"""Hand-checkable stand-ins for the serving core's tests: a linear cost model and a dictionary store."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from kvstream.serving.backend import ServingBackend
from kvstream.serving.core import LoadDone, ServingConfig, ServingCore, StartLoad, WriteChunks
from kvstream.sim.driver import SimNode
from kvstream.sim.engine import PRIO_IO, EventLoop
from kvstream.workload.request import CHUNK_TOKENS, Request


class LinearCost:
    """step = 0.1 s + 1 ms per prompt token computed + 10 ms per decoding sequence; no host->GPU cost."""

    kv_bytes_per_token = 1
    kv_capacity_bytes = 10**9

    def step_time_agg(self, prefills, n_dec, sum_ctx):
        if not prefills and not n_dec:
            return 0.0
        return 0.1 + 0.001 * sum(n for n, _ in prefills) + 0.01 * n_dec

    def host_load_s(self, nbytes):
        return 0.0


@dataclass
class FakeStorage(ServingBackend):
    """Chunks on 'disk' (a set) or in 'host' (a set); a load takes ``fixed + per_chunk * disk chunks``."""

    loop: EventLoop
    disk: set = field(default_factory=set)
    host: set = field(default_factory=set)
    fixed: float = 0.0
    per_chunk: float = 0.1
    writes: list = field(default_factory=list)
    released: list = field(default_factory=list)
    flushes: list = field(default_factory=list)
    loads: list = field(default_factory=list)

    def lookup(self, ids: Sequence[Hashable]) -> tuple[int, int]:
        present = in_host = 0
        for c in ids:
            if c in self.host:
                in_host += 1
            elif c not in self.disk:
                break
            present += 1
        return present, in_host

    def start_load(self, action: StartLoad, post):
        load_id, items = action.load_id, action.items
        n_disk = sum(1 for _, ch in items for c in ch if c not in self.host)
        self.loads.append((self.loop.now, load_id, items))
        delay = (self.fixed + self.per_chunk * n_disk) if n_disk else 0.0
        ev = LoadDone(load_id=load_id, available=tuple((rid, len(ch)) for rid, ch in items))
        self.loop.at(self.loop.now + delay, PRIO_IO, post, ev)

    def write(self, w: WriteChunks):
        self.writes.append((self.loop.now, w))

    def flush(self):
        self.flushes.append(self.loop.now)

    def release(self, ids):
        self.released.append(tuple(ids))


def req(rid, t, tokens, out=1, chunks=None, session=None) -> Request:
    n = tokens // CHUNK_TOKENS
    ids = tuple(chunks) if chunks is not None else tuple(f"r{rid}c{i}" for i in range(n))
    return Request(request_id=rid, arrival=t, input_tokens=tokens, output_tokens=out, chunk_ids=ids, session=session)


def run(requests, cfg=ServingConfig(), *, disk=(), host=(), fixed=0.0, per_chunk=0.1, record=None):
    loop = EventLoop()
    st = FakeStorage(loop, disk=set(disk), host=set(host), fixed=fixed, per_chunk=per_chunk)
    core = ServingCore(LinearCost(), st.lookup, cfg, chunk_bytes=1)
    node = SimNode(loop, core, st, requests, record=record)
    node.start()
    loop.run()
    node.dispatch(core.flush_writes())
    recs = {r.request_id: r for r in core.metrics.requests}
    return recs, core, st
