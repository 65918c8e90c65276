"""Prefetch staging leaves the puts their room: the staging budget (``staging_budget_chunks``, sized by the replay
backend from its store's host memory and write backlog valve) never lets staged KV and the second copies waiting
for a slow tier fill host memory, so a put does not wait for a buffer (nor is dropped).

The real store, two tiers, the second one's writes held to 4 MB/s, full replication: the valve lets up to half of
host memory wait for that tier. KV is staged the way replay stages it (a background load through
:class:`~kvstream.serving.storebackend.StoreBackend`, whose payload views pin the buffers until the GPU has
them), then a serving loop's steps put and flush new chunks (10 ms apart: the first copies reach the local disk
in between, as they do beside a forward pass). ``put_wait_s = 0``: a put that finds host memory full is dropped
at once (counted), so the test sees every put that would have waited.
"""

from __future__ import annotations

import time

import pytest

from kvstream.io import make_engine
from kvstream.io.throttle import ThrottledEngine
from kvstream.serving.core import StartLoad, staging_budget_chunks
from kvstream.serving.storebackend import StoreBackend
from kvstream.store import open_store

CHUNK = 256 * 1024
MEMORY = 8 << 20


def _puts_dropped(disk_tmp, staged_chunks: int | None) -> tuple[int, int]:
    """(staging budget the backend computes, puts dropped) with ``staged_chunks`` chunks staged (None: the
    budget)."""
    engine = ThrottledEngine(make_engine("threads"), {"shared-w": 4e6})
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": 1 << 28},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": 1 << 28}],
           "memory_bytes": MEMORY, "router": "mitm", "replication": "full", "create_dirs": True}
    store = open_store(cfg, engine=engine)
    be = StoreBackend(store, model="m", chunk_bytes=CHUNK, workers=1)
    try:
        budget = be.staging_budget_chunks()
        n = budget if staged_chunks is None else staged_chunks
        staged = tuple(f"staged{i}" for i in range(n))
        for c in staged:
            store.put(be.key(c), be.payload)
        store.flush()
        assert store.drain(timeout=60)
        store.evict_memory()
        done: list = []
        be._load(StartLoad(load_id=1, items=((0, staged),), background=True), done.append)
        assert done[0].available == ((0, n),) and be.staged_bytes == n * CHUNK
        store.put_wait_s = 0.0
        for i in range(40):  # 40 steps of 10 ms, each putting a chunk and flushing it as the next step starts
            store.put(be.key(f"new{i}"), be.payload)
            store.flush()
            time.sleep(0.01)  # the forward pass: the local tier writes its first copy meanwhile
        dropped = store.stats().puts_dropped_no_memory
        be.release(staged)
        assert store.drain(timeout=60)
        return budget, dropped
    finally:
        be.close()
        store.close()


def test_staging_within_the_budget_leaves_the_puts_room(disk_tmp):
    budget, dropped = _puts_dropped(disk_tmp, None)
    # 8 MiB of 256 KiB chunks (320 KiB buffers: 25), a valve of 4 MiB (16 copies): (25 - 16) // 2
    assert budget == 4
    assert dropped == 0


def test_staging_half_of_host_memory_beside_the_valve_drops_puts(disk_tmp):
    # The earlier budget, half of host memory, plus the valve's half: no room is left for the puts.
    _, dropped = _puts_dropped(disk_tmp, MEMORY // CHUNK // 2)
    assert dropped > 0


@pytest.mark.parametrize("host, backlog, want", [(36, 22, 7), (36, 0, 18), (25, 16, 4), (3, 2, 1), (1, 5, 1)])
def test_staging_budget_is_half_of_what_the_valve_leaves(host: int, backlog: int, want: int) -> None:
    got = staging_budget_chunks(host, backlog)
    assert got == want
    if host - backlog >= 2:
        assert 2 * got + backlog <= host  # the other half stays for the first copies on their way to disk


def test_staged_pins_count_per_item_and_report_the_first_and_the_last():
    from kvstream.serving.staging import StagedPins

    pins: StagedPins[str] = StagedPins()
    assert pins.hold("a") and not pins.hold("a") and pins.hold("b")
    assert pins.count("a") == 2 and len(pins) == 2
    assert not pins.release("a") and pins.release("a") and "a" not in pins
    with pytest.raises(AssertionError):
        pins.release("a")  # the core released what no load pinned: a bug, never absorbed
    assert pins.clear() == ["b"] and len(pins) == 0


def test_both_backends_keep_a_shared_chunk_staged_until_its_last_item_releases_it(disk_tmp):
    # Two waiting requests share a prefix chunk: one load stages it for both (two pins). The simulator's host
    # memory keeps it pinned, and replay's backend keeps the store's view, until both have released it.
    from kvstream.eviction import make_eviction_policy
    from kvstream.replication import parse_replication
    from kvstream.routing import parse_router
    from kvstream.sim.devices import Device
    from kvstream.sim.engine import EventLoop
    from kvstream.sim.storage import SimStorage, SimTier

    action = StartLoad(load_id=1, items=((0, ("p", "a")), (1, ("p", "b"))), background=True)
    loop = EventLoop()
    tier = SimTier(name="t", device=Device(loop, "t", read_bw=1e9, write_bw=1e9))
    sim = SimStorage(loop, tiers=[tier], router=parse_router("single", ["t"]), replication=parse_replication("single"),
                     host_eviction=make_eviction_policy("lru"), host_capacity_chunks=8, chunk_bytes=CHUNK)
    sim.prewarm(["p", "a", "b"])
    done: list = []
    sim.start_load(action, done.append)
    loop.run(until=1e6)
    assert done[0].available == ((0, 2), (1, 2))
    assert sim._host["p"] == 1 and sim._staged.count("p") == 2  # one host pin, two staged pins
    sim.release(("p", "a"))
    assert sim._host["p"] == 1 and sim._host["a"] == 0  # "a" is evictable again, "p" is not
    sim.release(("p", "b"))
    assert all(p == 0 for p in sim._host.values()) and len(sim._staged) == 0

    store = open_store({"tiers": [{"name": "t", "path": str(disk_tmp / "t"), "capacity_bytes": 1 << 26}],
                        "memory_bytes": MEMORY, "router": "single:t", "replication": "single", "create_dirs": True})
    be = StoreBackend(store, model="m", chunk_bytes=CHUNK, workers=1)
    try:
        for c in ("p", "a", "b"):
            store.put(be.key(c), be.payload)
        store.flush()
        assert store.drain(timeout=60)
        store.evict_memory()
        got: list = []
        be._load(action, got.append)
        assert got[0].available == ((0, 2), (1, 2)) and be.staged_bytes == 3 * CHUNK
        be.release(("p", "a"))
        assert be.staged_bytes == 2 * CHUNK  # "p" is still staged for request 1
        be.release(("p", "b"))
        assert be.staged_bytes == 0
    finally:
        be.close()
        store.close()


def test_dropped_puts_are_counted_and_logged_as_a_count_not_a_line_each(disk_tmp, caplog):
    # The replay's demo printed one "put dropped" line per dropped put, dozens a run. The store logs the 1st,
    # 10th and 100th (then every 1000th) with the count so far; stats() keeps the exact number.
    engine = ThrottledEngine(make_engine("threads"), {"local-w": 4e6})
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": 1 << 28}],
           "memory_bytes": 2 << 20, "create_dirs": True}
    store = open_store(cfg, engine=engine)
    store.put_wait_s = 0.0
    try:
        with caplog.at_level("WARNING", logger="kvstream"):
            for i in range(150):
                store.put(f"k{i}".encode(), bytes(CHUNK))
        dropped = store.stats().puts_dropped_no_memory
        lines = [r.getMessage() for r in caplog.records if "put dropped" in r.getMessage()]
        assert dropped >= 100
        assert len(lines) == 3 and lines[0].startswith("put dropped (1 so far)") and "(100 so far)" in lines[2]
    finally:
        store.close(timeout=60)
