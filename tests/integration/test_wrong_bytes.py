"""Zero wrong bytes: a chunk handed to a caller is the chunk it asked for, for as long as the caller holds it.

Deterministic cases first (a step planned with memory hits whose host memory is emptied and refilled before
the later hits are handed out: the pin taken at planning must hold), then a soak: reader threads over every
read API and writer threads that put, flush, remove and evict at once, with host memory small enough that
eviction never stops, on both I/O engines; every payload is checked when it is handed out, and every view still
held is checked again at the end (a view that changed after it was handed out is a wrong byte too).

Mutation check (done by hand when this was written, and worth redoing after any change to the read path): with
the pin removed (``HostMemoryTier.pin`` returning a view made after the lock, or ``BufferPool.acquire``'s
exported check and the planning pin both removed), ``test_plan_then_evict_*`` fail on every run.
"""

from __future__ import annotations

import gc
import random
import threading
import time
import weakref

import numpy as np
import pytest

import kvstream
from kvstream.format import ChunkMeta
from kvstream.io.buffers import AlignedBuffer, round_up
from kvstream.testing.store import engines, wait_pool_empty

CHUNK = 64 * 1024 - 100  # payload bytes: with the header, one 68 KiB size class (slab slots)


def cfg_for(root, engine="threads", memory="2MiB", two=True, **kw):
    tiers = [{"name": "local", "path": str(root / "local"), "capacity_bytes": "256MiB"}]
    if two:
        tiers.append({"name": "shared", "path": str(root / "shared"), "capacity_bytes": "256MiB"})
    d = {"tiers": tiers, "memory_bytes": memory, "create_dirs": True, "io_engine": engine}
    d.update(kw)
    return d


def payload(key: bytes, n: int = CHUNK) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(n)


def keys_for(n: int, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def put_all(s, keys):
    for k in keys:
        s.put(k, payload(k), meta=ChunkMeta(dtype="uint8", shape=(CHUNK,), fmt="raw"))
    s.flush()
    s.drain()


def churn(s, n: int, seed: int) -> None:
    """Empty host memory and fill it again with other chunks (reusing every free buffer)."""
    s.evict_memory()
    put_all(s, keys_for(n, seed))
    s.evict_memory()
    put_all(s, keys_for(n, seed + 1))


@pytest.mark.slow
@pytest.mark.parametrize("api", ["read_chunks", "read_iter", "get_many_like"])
def test_plan_then_evict_keeps_every_memory_hit_intact(disk_tmp, api):
    with kvstream.open_store(cfg_for(disk_tmp, memory="4MiB")) as s:
        keys = keys_for(24, seed=1)
        put_all(s, keys)  # all in host memory (and on disk)
        gen = s.read_chunks(keys) if api != "read_iter" else s.read_iter(keys)
        first = next(gen)
        churn(s, 60, seed=100)  # another thread's puts and evictions, between two yields of one step
        got = [first] + list(gen)
        assert sorted(i for i, _ in got) == list(range(len(keys)))
        for i, c in got:
            view = c.payload if api != "read_iter" else c
            assert view is not None
            assert bytes(view) == payload(keys[i]), f"chunk {i}: another chunk's bytes"
        churn(s, 60, seed=200)  # views held across more churn stay unchanged
        for i, c in got:
            view = c.payload if api != "read_iter" else c
            assert bytes(view) == payload(keys[i]), f"chunk {i}: changed after it was handed out"


@pytest.mark.slow
def test_plan_then_evict_read_into_copies_the_right_chunk(disk_tmp):
    with kvstream.open_store(cfg_for(disk_tmp, memory="4MiB")) as s:
        keys = keys_for(24, seed=2)
        put_all(s, keys)
        targets = [bytearray(CHUNK) for _ in keys]
        gen = s.read_into(keys, targets)
        first = next(gen)
        churn(s, 60, seed=300)
        results = dict([first] + list(gen))
        assert all(r.ok for r in results.values())
        for i, k in enumerate(keys):
            assert bytes(targets[i]) == payload(k), f"target {i}: another chunk's bytes"


def test_a_viewed_buffer_released_to_the_pool_is_never_handed_out(disk_tmp):
    """The pool re-checks exports in acquire, not only in release: a view made from a stale reference after
    the buffer went back to the free list keeps that buffer out of use."""
    from kvstream.io.buffers import BufferPool

    pool = BufferPool(1 << 20, hugepages=False)
    b = pool.acquire(8192)
    pool.release(b)  # not viewed: goes to the free list
    stale = b.view()  # a holder of an old reference looks at it again
    stale[:4] = b"mine"
    again = pool.acquire(8192)
    assert again is not b
    assert bytes(stale[:4]) == b"mine"
    del stale
    assert pool.acquire(8192) is b  # parked, then reusable once the view is gone


@pytest.mark.parametrize("engine", engines())
def test_overflow_buffers_are_reused_only_after_their_views_are_gone(disk_tmp, engine):
    """Reads that land while host memory is full of viewed chunks get overflow buffers; those are kept for reuse
    (``read_overflow_bytes``) but never handed out again while the caller still holds a view of one."""
    keys = keys_for(60, seed=3)
    with kvstream.open_store(cfg_for(disk_tmp, engine, memory="1MiB", two=False)) as s:
        put_all(s, keys)
        s.evict_memory()
        spares = s.memory.overflow_pool
        assert spares is not None
        held = [(keys[i], c.payload) for i, c in s.read_chunks(keys[:30]) if c is not None]
        first = s.memory.overflow_buffers
        assert len(held) == 30 and first > 0  # 1 MiB holds ~15 chunks: the rest overflowed
        more = [(keys[30 + i], c.payload) for i, c in s.read_chunks(keys[30:]) if c is not None]
        assert len(more) == 30 and s.memory.overflow_buffers > first
        assert spares.reuses == 0  # every spare is still viewed
        for k, v in held + more:
            assert bytes(v) == payload(k), "a held view changed"
        for _, v in held:
            v.release()
        del held
        gc.collect()
        again = [(keys[30 + i], c.payload) for i, c in s.read_chunks(keys[30:]) if c is not None]
        assert spares.reuses > 0  # the first read's spares came back once their views were gone
        for k, v in more + again:
            assert bytes(v) == payload(k), "a held view changed"


def test_close_gives_host_memory_back_and_leaves_held_views_intact(disk_tmp):
    """Closing forgets every pooled buffer at once (not when the garbage collector finds the store); a view a
    caller still holds keeps its own buffer, unchanged."""
    keys = keys_for(40, seed=5)
    s = kvstream.open_store(cfg_for(disk_tmp, memory="1MiB", two=False))
    put_all(s, keys)
    s.evict_memory()
    assert s.prefault_memory(CHUNK) > 0
    held = [(keys[i], c.payload) for i, c in s.read_chunks(keys[:25]) if c is not None]
    assert len(held) == 25 and s.memory.overflow_buffers > 0
    spares = s.memory.overflow_pool
    assert spares is not None
    free = [weakref.ref(b) for pool in (s.memory.pool, spares) for bufs in list(pool._free.values())
            + list(pool._fresh.values()) for b in bufs]
    assert free, "nothing free to give back"
    s.close()
    gc.collect()
    # The pools no longer refer to them (a slab's mapping goes once none of its slots is viewed either).
    assert all(r() is None for r in free), "the store still holds a free buffer after close"
    assert s.evict_memory() == 0 and len(s.memory) == 0  # the closed tier stays consistent
    for k, v in held:
        assert bytes(v) == payload(k)


def test_no_overflow_buffers_are_kept_with_read_overflow_bytes_0(disk_tmp):
    keys = keys_for(30, seed=4)
    with kvstream.open_store(cfg_for(disk_tmp, memory="1MiB", two=False, read_overflow_bytes=0)) as s:
        put_all(s, keys)
        s.evict_memory()
        held = [(keys[i], c.payload) for i, c in s.read_chunks(keys) if c is not None]
        assert s.memory.overflow_pool is None and s.memory.overflow_buffers > 0
        assert all(bytes(v) == payload(k) for k, v in held)


@pytest.mark.slow
@pytest.mark.parametrize("engine", engines())
def test_soak_readers_and_writers_never_see_wrong_bytes(disk_tmp, engine):
    """4 reader threads (get_many, read_iter, read_chunks, read_into) and 2 writer threads (put/flush/remove,
    evict_memory) on one store whose host memory holds ~30 chunks, for a few seconds."""
    n_keys = 160
    keys = keys_for(n_keys, seed=7)
    base = {k: payload(k) for k in keys}
    wrong: list[str] = []
    held: list[tuple[bytes, memoryview]] = []
    held_lock = threading.Lock()
    stop = threading.Event()
    errors: list[BaseException] = []
    counts = {"chunks": 0}
    with kvstream.open_store(cfg_for(disk_tmp, engine, memory="2MiB", hedge_after_s=0.5)) as s:
        put_all(s, keys[: n_keys // 2])

        def check_view(k: bytes, v) -> None:
            if v is None:
                return
            counts["chunks"] += 1
            if bytes(v) != base[k]:
                wrong.append(f"{k.hex()[:8]}: wrong payload")

        def reader(mode: int, seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    step = rng.sample(keys, 12)
                    if mode == 0:
                        for k, v in zip(step, s.get_many(step)):
                            check_view(k, v)
                            if v is not None and rng.random() < 0.05:
                                with held_lock:
                                    held.append((k, v))
                    elif mode == 1:
                        for i, v in s.read_iter(step):
                            check_view(step[i], v)
                    elif mode == 2:
                        for i, c in s.read_chunks(step):
                            if c is not None:
                                check_view(step[i], c.payload)
                                if rng.random() < 0.05:
                                    with held_lock:
                                        held.append((step[i], c.payload))
                    else:
                        bufs = [AlignedBuffer(round_up(CHUNK)) for _ in step]
                        targets = [b.view() for b in bufs]
                        for i, r in s.read_into(step, targets):
                            if r.ok:
                                check_view(step[i], targets[i][: r.nbytes])
            except BaseException as exc:  # noqa: BLE001 — reported by the test
                errors.append(exc)

        def writer(seed: int) -> None:
            rng = random.Random(seed)
            try:
                while not stop.is_set():
                    k = rng.choice(keys)
                    r = rng.random()
                    if r < 0.55:
                        s.put(k, base[k], meta=ChunkMeta(dtype="uint8", shape=(CHUNK,), fmt="raw"))
                    elif r < 0.75:
                        s.flush()
                    elif r < 0.9:
                        s.remove(k)
                    else:
                        s.evict_memory()
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=reader, args=(m, m)) for m in range(4)]
        threads += [threading.Thread(target=writer, args=(10 + w,)) for w in range(2)]
        for t in threads:
            t.start()
        time.sleep(4.0)
        stop.set()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "a thread hung"
        assert not errors, errors[:3]
        # every view still held is unchanged
        for k, v in held:
            if bytes(v) != base[k]:
                wrong.append(f"{k.hex()[:8]}: held view changed")
    assert counts["chunks"] > 500, counts
    assert not wrong, wrong[:5]


def _stored_then_local_delayed(root, keys, delay_s):
    """``keys`` stored on both tiers, then a store (hedging at 0.05 s) whose local reads each take ``delay_s``."""
    from kvstream.io.engine import make_engine
    from kvstream.io.faults import Fault, FaultPlan, FaultyEngine

    cfg = cfg_for(root, hedge_after_s=0.05)
    with kvstream.open_store(cfg) as s:
        put_all(s, keys)
    engine = FaultyEngine(make_engine("threads"), FaultPlan([Fault(kind="delay", rings="local-r",
                                                                   delay_s=delay_s)], seed=1))
    return kvstream.open_store(cfg, engine=engine), engine


def test_busy_target_stays_alive_until_its_read_ends(disk_tmp):
    """A target reported busy belongs to the store until ``on_target_free``: a caller that drops its reference
    does not free the memory a stalled read is still writing into."""
    keys = keys_for(4, seed=9)
    s, engine = _stored_then_local_delayed(disk_tmp, keys, 30)
    try:
        metas = s.get_meta(keys)
        sizes = [round_up(m[1]) for m in metas]
        arrays = [np.zeros(n + 4096, dtype=np.uint8) for n in sizes]
        # aligned windows into numpy arrays, so the local tier reads in place
        targets = [a[-a.ctypes.data % 4096:][:n] for a, n in zip(arrays, sizes)]
        refs = [weakref.ref(a) for a in arrays]
        freed: list[int] = []
        results = dict(s.read_into(keys, targets, on_target_free=freed.append))
        busy = [i for i, r in results.items() if r.busy]
        assert all(r.ok or r.busy for r in results.values())
        assert busy, "the stalled local tier held no target (test set-up)"
        del targets, arrays
        gc.collect()
        for i in busy:
            assert refs[i]() is not None, f"busy target {i} was freed while its read is in flight"
        engine.release_stalls()
        deadline = time.monotonic() + 5
        while len(freed) < len(busy) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(freed) == sorted(busy)
        gc.collect()
        assert all(refs[i]() is None for i in busy), "the store kept a busy target after freeing it"
    finally:
        engine.release_stalls()
        s.close()


def _slow_opens(tier, seconds_for):
    """Emulated slow metadata on ``tier``: each open waits ``seconds_for(key)``; nothing is opened ahead."""
    real = tier.open_for_read

    def slow(key):
        time.sleep(seconds_for(key))
        return real(key)

    tier.open_for_read = slow
    tier.open_ahead = lambda key: None


def test_a_target_reported_ok_is_never_written_again(disk_tmp):
    """Found by adversarial testing: chunk A was copied in from the shared tier and reported ok while the local
    tier's open of A was still running; when that open returned, a read in place went into A's target, which
    the caller already owned again. A read opened after its chunk was delivered is now dropped unissued."""
    cfg = cfg_for(disk_tmp, hedge_after_s=0.05)
    a, b = keys_for(2, seed=11)
    with kvstream.open_store(cfg) as s:
        put_all(s, [a])
        s.put(b, payload(b), meta=ChunkMeta(dtype="uint8", shape=(CHUNK,), fmt="raw"), tiers=["shared"])
        s.flush()
        s.drain()
    with kvstream.open_store(cfg) as s:
        _slow_opens(s.tiers[0], lambda k: 0.3)
        _slow_opens(s.tiers[1], lambda k: 1.0 if k == b else 0.0)
        bufs = [AlignedBuffer(round_up(CHUNK)) for _ in range(2)]
        targets = [x.view() for x in bufs]
        for i, r in s.read_into([a, b], targets):
            assert r.ok
            if i == 0:
                assert bytes(targets[0][:CHUNK]) == payload(a)
                targets[0][:] = b"\xee" * len(targets[0])  # the caller owns it again and reuses it
        time.sleep(0.1)
        assert bytes(targets[0]) == b"\xee" * len(targets[0]), "a target was written after it was reported"


def test_stopping_early_releases_every_buffer(disk_tmp):
    """Found by adversarial testing: a caller that stopped at a yield left the rest of that action list undone
    (a waiting copy's Release), leaking a pooled buffer per call."""
    keys = keys_for(8, seed=12)
    s, engine = _stored_then_local_delayed(disk_tmp, keys, 0.4)
    with s:
        for _ in range(3):
            s.evict_memory()
            bufs = [AlignedBuffer(round_up(CHUNK)) for _ in keys]
            gen = s.read_into(keys, [x.view() for x in bufs])
            next(gen)
            gen.close()
        engine.release_stalls()
        s.drain()
        wait_pool_empty(s)


def test_a_finished_steps_opens_do_not_hold_the_next_step(disk_tmp):
    """Found by adversarial testing: 64 abandoned opens of a slow tier made the next step wait for all of them
    (5 s for one chunk). Opens of reads no longer needed are skipped."""
    cfg = cfg_for(disk_tmp)
    keys = keys_for(64, seed=13)
    with kvstream.open_store(cfg) as s:
        put_all(s, keys)
        solo = keys_for(1, seed=14)[0]
        s.put(solo, payload(solo), meta=ChunkMeta(dtype="uint8", shape=(CHUNK,), fmt="raw"), tiers=["local"])
        s.flush()
        s.drain()
    with kvstream.open_store(cfg) as s:
        _slow_opens(s.tiers[0], lambda k: 0.3)
        assert all(v is not None for v in s.get_many(keys))  # the shared tier reads them all
        t0 = time.monotonic()
        (v,) = s.get_many([solo])
        took = time.monotonic() - t0
        assert v is not None and bytes(v) == payload(solo)
        assert took < 1.5, f"one chunk took {took:.2f} s behind a finished step's opens"


def test_concurrent_removes_of_one_key_count_it_once(disk_tmp):
    """Found by adversarial testing: two removes of one key both subtracted its size (used_bytes < 0)."""
    with kvstream.open_store(cfg_for(disk_tmp)) as s:
        keys = keys_for(60, seed=15)
        put_all(s, keys)
        s.evict_memory()
        barrier = threading.Barrier(2)

        def remover():
            barrier.wait()
            for k in keys:
                s.remove(k)

        ts = [threading.Thread(target=remover) for _ in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(30)
        for name, t in s.stats().tiers.items():
            assert (t.used_bytes, t.chunks) == (0, 0), name


@pytest.mark.parametrize("api", ["read_chunks", "read_into"])
def test_a_read_that_raced_a_remove_hands_its_bytes_over_but_never_caches_them(disk_tmp, api):
    """Found by CI: a read that began before a remove cached its chunk after it, so the key reappeared in host
    memory, and the catch-up of owed replicas then copied it back to a tier the remove had emptied (the shared
    tier held 1 chunk after every key was removed). The bytes still reach the caller (the read linearises
    before the remove); host memory and the tiers stay empty of the key. Fails with the check in
    ``Reader._keep`` removed."""
    with kvstream.open_store(cfg_for(disk_tmp, memory="8MiB")) as s:
        keys = keys_for(12, seed=21)
        put_all(s, keys)
        s.evict_memory()
        if api == "read_chunks":
            gen = s.read_chunks(keys)
            got = [next(gen)]  # the step is planned and every read submitted; the rest land in host memory
        else:
            targets = [bytearray(CHUNK) for _ in keys]  # not aligned: read into pooled buffers, then copied
            gen = s.read_into(keys, targets)
            got = [next(gen)]
        removed = [k for j, k in enumerate(keys) if j != got[0][0]]
        for k in removed:
            assert s.remove(k)
        got += list(gen)
        assert sorted(j for j, _ in got) == list(range(len(keys)))
        for j, c in got:
            data = bytes(c.payload) if api == "read_chunks" else bytes(targets[j])
            assert data == payload(keys[j])
        for k in removed:
            assert s.memory.peek(k) is None, "a removed key reappeared in host memory"
        s.flush()
        s.drain()
        for k in removed:
            assert not any(t.contains(k) for t in s.tiers)
            assert not any(s.owed.owes(t.name, k) for t in s.tiers)
        s.evict_memory()
        assert all(c is None for _, c in s.read_chunks(removed))


def test_the_removal_record_answers_maybe_removed_once_it_forgot():
    """The record is bounded; a read older than its oldest remembered remove must skip the cache."""
    from kvstream.removals import Removals

    r = Removals(remember=2)
    start = r.now()
    r.record(b"a")
    assert r.removed_since(b"a", start) and not r.removed_since(b"b", start)
    assert not r.removed_since(b"a", r.now())
    mid = r.now()
    r.record(b"b")
    r.record(b"c")  # forgets a's record
    assert r.removed_since(b"zzz", start)  # older than what it remembers: maybe
    assert not r.removed_since(b"zzz", mid) and r.removed_since(b"c", mid)
