"""Hand-checkable stand-ins for tests of the serving core (:mod:`kvstream.serving.core`) and its drivers: a linear
cost model, a dictionary store that implements the serving backend interface, and :func:`run`, which serves a list
of requests on the simulator's event loop with both.

Every number is round so a test can work its expected times out by hand: a step costs 0.1 s + 1 ms per prompt
token + 10 ms per decoding sequence, and a load ``fixed + per_chunk`` seconds per chunk read from 'disk'.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstream.serving.backend import ServingBackend
from kvstream.serving.core import LoadDone, ServingConfig, ServingCore, StartLoad, WriteChunks
from kvstream.sim.driver import SimNode
from kvstream.sim.engine import PRIO_IO, EventLoop
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = ["LinearCost", "FakeStorage", "prefix_lookup", "req", "run"]


def prefix_lookup(ids: Sequence[Hashable], host: set[Hashable], disk: set[Hashable]) -> tuple[int, int]:
    """A serving backend's ``lookup`` over two sets: (chunks of the leading run that are in ``host`` or ``disk``,
    how many of those are in ``host``); the run stops at the first chunk in neither."""
    present = in_host = 0
    for c in ids:
        if c in host:
            in_host += 1
        elif c not in disk:
            break
        present += 1
    return present, in_host


class LinearCost:
    """step = 0.1 s + 1 ms per prompt token computed + 10 ms per decoding sequence; no host->GPU cost."""

    kv_bytes_per_token = 1
    kv_capacity_bytes = 10**9

    def step_time_agg(self, prefills: Sequence[tuple[int, int]], n_dec: int, sum_ctx: int) -> float:
        if not prefills and not n_dec:
            return 0.0
        return 0.1 + 0.001 * sum(n for n, _ in prefills) + 0.01 * n_dec

    def host_load_s(self, nbytes: int) -> float:
        return 0.0


@dataclass
class FakeStorage(ServingBackend):
    """Chunks on 'disk' (a set) or in 'host' (a set); a load takes ``fixed + per_chunk * disk chunks``. Every
    write, release, flush and load is recorded (with the loop's time) for the test to check."""

    loop: EventLoop
    disk: set[Hashable] = field(default_factory=set)
    host: set[Hashable] = field(default_factory=set)
    fixed: float = 0.0
    per_chunk: float = 0.1
    writes: list[tuple[float, WriteChunks]] = field(default_factory=list)
    released: list[tuple[Hashable, ...]] = field(default_factory=list)
    flushes: list[float] = field(default_factory=list)
    loads: list[tuple[float, Any, Any]] = field(default_factory=list)

    def lookup(self, ids: Sequence[Hashable]) -> tuple[int, int]:
        return prefix_lookup(ids, self.host, self.disk)

    def start_load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        load_id, items = action.load_id, action.items
        n_disk = sum(1 for _, ch in items for c in ch if c not in self.host)
        self.loads.append((self.loop.now, load_id, items))
        delay = (self.fixed + self.per_chunk * n_disk) if n_disk else 0.0
        ev = LoadDone(load_id=load_id, available=tuple((rid, len(ch)) for rid, ch in items))
        self.loop.at(self.loop.now + delay, PRIO_IO, post, ev)

    def write(self, w: WriteChunks) -> None:
        self.writes.append((self.loop.now, w))

    def flush(self) -> None:
        self.flushes.append(self.loop.now)

    def release(self, ids: Sequence[Hashable]) -> None:
        self.released.append(tuple(ids))


def req(rid: Any, t: float, tokens: int, out: int = 1, chunks: Iterable[Hashable] | None = None,
        session: Hashable | None = None) -> Request:
    """A request ``rid`` arriving at ``t`` with a ``tokens``-token prompt (chunk ids ``r{rid}c{i}`` unless
    ``chunks`` names them) and ``out`` tokens to decode."""
    n = tokens // CHUNK_TOKENS
    ids = tuple(chunks) if chunks is not None else tuple(f"r{rid}c{i}" for i in range(n))
    return Request(request_id=rid, arrival=t, input_tokens=tokens, output_tokens=out, chunk_ids=ids, session=session)


def run(requests: Sequence[Request], cfg: ServingConfig | None = None, *, disk: Iterable[Hashable] = (),
        host: Iterable[Hashable] = (), fixed: float = 0.0, per_chunk: float = 0.1,
        record: Any = None) -> tuple[dict[Any, Any], ServingCore, FakeStorage]:
    """Serve ``requests`` with :class:`LinearCost` and a :class:`FakeStorage` holding ``disk`` and ``host``
    chunks (``cfg``: default ServingConfig()); returns (request records by id, the core, the storage)."""
    loop = EventLoop()
    st = FakeStorage(loop, disk=set(disk), host=set(host), fixed=fixed, per_chunk=per_chunk)
    cost: Any = LinearCost()  # duck-typed: the two methods and two figures ServingCore reads of a CostModel
    core = ServingCore(cost, st.lookup, cfg if cfg is not None else ServingConfig(), chunk_bytes=1)
    node = SimNode(loop, core, st, requests, record=record)  # type: ignore[arg-type]  # any serving backend does
    node.start()
    loop.run()
    node.dispatch(core.flush_writes())
    recs = {r.request_id: r for r in core.metrics.requests}
    return recs, core, st
