"""Issue 21 item 1: every acknowledgement is a promise kept. A put acknowledged while no tier takes writes
(every breaker open, every copy failing) was written nowhere; once host memory evicted it, it was gone, and the
catch-up dropped its owed copies (0 of 20 readable). Now such a put is *unstored*: kept in host memory (never
evicted), owed to its tiers, written by the catch-up once a tier takes writes again; ``drain`` says False while
any is unstored; ``put`` refuses new chunks (returns False, counted) while they fill half of host memory; close
reports what it could not write."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

import kvstream
from kvstream.io import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.testing.store import engines, payload_for, wait_for

SIZE = 64 * 1024  # bytes of every payload put


def config(root: Path, **kw) -> dict:
    base = {"tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": "256MiB"},
                      {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "256MiB"}],
            "memory_bytes": "32MiB", "create_dirs": True, "io_engine": "threads", "node_id": "n1"}
    base.update(kw)
    return base


def open_breakers(s: kvstream.Store, cooldown_s: float = 3600.0) -> None:
    now = time.monotonic()
    for h in s.health:
        h.cooldown_s = cooldown_s
        for _ in range(h.threshold):
            h.on_failure(now)
        assert h.state == "open"


def cool_down(s: kvstream.Store) -> None:
    for h in s.health:
        h.retry_at = 0.0  # the cool-down is over: half-open, the next copy probes the tier


def test_a_put_no_tier_takes_is_kept_until_a_copy_lands_and_drain_says_so(disk_tmp: Path):
    keys = [bytes([i]) * 16 for i in range(20)]
    with kvstream.open_store(config(disk_tmp)) as s:
        open_breakers(s)
        for k in keys:
            assert s.put(k, payload_for(k, SIZE))
        s.flush()
        assert not s.drain(5), "drain said every put was stored while every tier's breaker was open"
        st = s.stats()
        assert st.unstored_chunks == 20 and st.unstored_bytes == 20 * s.memory.peek(keys[0]).file_size
        assert all(t.replicas_owed == 20 for t in st.tiers.values())
        s.evict_memory()  # unstored puts are not evictable: host memory is their only copy
        got = s.get_many(keys)
        assert sum(g is not None for g in got) == 20
        assert all(bytes(g) == payload_for(k, SIZE) for k, g in zip(keys, got))
        del got
        cool_down(s)  # the tiers take writes again: the catch-up writes the unstored puts
        assert wait_for(lambda: s.stats().unstored_chunks == 0)
        assert wait_for(lambda: not any(t.replicas_owed for t in s.stats().tiers.values()))
        assert s.drain(10)
        s.evict_memory()
        got = s.get_many(keys)
        assert all(g is not None and bytes(g) == payload_for(k, SIZE) for k, g in zip(keys, got))
        assert s.stats().disk_hits >= 20
    with kvstream.open_store(config(disk_tmp)) as again:  # durable: on both tiers after a restart
        assert all(again.tiers[0].contains(k) and again.tiers[1].contains(k) for k in keys)


def test_unstored_puts_fill_at_most_half_of_host_memory_then_put_refuses_at_once(disk_tmp: Path):
    size = 512 * 1024
    with kvstream.open_store(config(disk_tmp, memory_bytes="8MiB")) as s:
        open_breakers(s)
        accepted: list[bytes] = []
        slowest = 0.0
        for i in range(16):
            k = bytes([i + 1]) * 16
            t0 = time.monotonic()
            ok = s.put(k, payload_for(k, size))
            s.flush()
            slowest = max(slowest, time.monotonic() - t0)
            if ok:
                accepted.append(k)
        st = s.stats()
        assert st.puts_dropped_unstored == 16 - len(accepted) > 0
        assert st.unstored_bytes >= s._writer.unstored_limit and st.unstored_chunks == len(accepted)
        assert len(accepted) * (size + 4096) <= s.config.memory_bytes // 2 + size + 4096
        assert slowest < 0.5  # refused at once: no wait for memory that will not come free
        cool_down(s)
        assert wait_for(lambda: s.stats().unstored_chunks == 0)
        assert s.drain(10)
        s.evict_memory()
        got = s.get_many(accepted)
        assert all(g is not None and bytes(g) == payload_for(k, size) for k, g in zip(accepted, got))


def test_a_removed_unstored_put_is_neither_kept_nor_written(disk_tmp: Path):
    with kvstream.open_store(config(disk_tmp)) as s:
        open_breakers(s)
        k = b"r" * 16
        assert s.put(k, payload_for(k, SIZE))
        s.flush()
        assert s.stats().unstored_chunks == 1
        assert s.remove(k)
        assert s.stats().unstored_chunks == 0 and s.drain(5)
        cool_down(s)
        time.sleep(0.6)  # two catch-up rounds
        assert not any(t.contains(k) for t in s.tiers) and s.memory.pool.in_use_bytes == 0


@pytest.mark.slow
@pytest.mark.parametrize("engine", engines())
def test_no_acknowledged_put_is_lost_while_every_write_fails_for_a_while(disk_tmp: Path, engine: str):
    """Writers and readers on several threads while every write to every tier fails with EIO for 0.6 s (the
    breakers open, probe, reopen), then the faults stop: every put acknowledged is read back, byte for byte,
    after the catch-up, from a store reopened on the tiers alone. Without the hold: acknowledged puts lost."""
    cfg = config(disk_tmp, io_engine=engine)
    plan = FaultPlan(seed=4)
    plan.add(Fault(kind="eio", rings="*-w"))
    s = kvstream.open_store(cfg, engine=FaultyEngine(make_engine(engine), plan))
    for h in s.health:
        h.cooldown_s = 0.1
    acked: list[bytes] = []
    wrong: list[int] = [0]
    lock = threading.Lock()
    stop = threading.Event()

    def writer(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(30):
            k = rng.randbytes(16)
            if s.put(k, payload_for(k, SIZE)):
                with lock:
                    acked.append(k)
            if rng.random() < 0.3:
                s.flush()
            if rng.random() < 0.2:
                s.evict_memory()
            time.sleep(0.01)
        s.flush()

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            with lock:
                want = rng.sample(acked, min(8, len(acked)))
            for k, v in zip(want, s.get_many(want)):
                if v is not None and bytes(v) != payload_for(k, SIZE):
                    wrong[0] += 1
            s.evict_memory()

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=reader, args=(100 + i,)) for i in range(2)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.6)
        assert plan.injected("eio") > 0 and any(h.opened for h in s.health)
        plan.clear()  # the tiers take writes again
        for t in threads[:4]:
            t.join(30)
        stop.set()
        for t in threads[4:]:
            t.join(30)
        assert wait_for(lambda: s.stats().unstored_chunks == 0, 30)
        assert s.drain(30)
        assert wrong[0] == 0
    finally:
        stop.set()
        report = s.close(timeout=30)
    assert report.unstored == 0
    assert len(acked) >= 60
    with kvstream.open_store(cfg) as again:  # the tiers alone, host memory empty
        got = again.get_many(acked)
        lost = [k for k, g in zip(acked, got) if g is None]
        assert not lost, f"{len(lost)} of {len(acked)} acknowledged puts lost"
        assert all(bytes(g) == payload_for(k, SIZE) for k, g in zip(acked, got))
