"""Store.get_meta and Store.read_into: payloads read straight into the caller's buffers, verified in place.

What must hold: every index is answered once; ``ok`` means the target holds exactly the bytes that were put;
a corrupt or missing replica is never reported ok (another replica is used, else a miss); a target is handed
back only when no read into it is in flight (or reported ``busy`` and freed through the callback later).
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

import kvstream
from kvstream.format import HEADER_BYTES, ChunkMeta
from kvstream.io.buffers import AlignedBuffer, round_up
from kvstream.io.engine import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.testing.store import engines, payload_for, wait_pool_empty


def config(root: Path, engine: str = "threads", two: bool = True, **kw) -> dict:
    tiers = [{"name": "local", "path": str(root / "local"), "capacity_bytes": "64MiB"}]
    if two:
        tiers.append({"name": "shared", "path": str(root / "shared"), "capacity_bytes": "64MiB"})
    base = {"tiers": tiers, "memory_bytes": "16MiB", "create_dirs": True, "io_engine": engine}
    base.update(kw)
    return base


def make_data(n: int, seed: int = 0) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(n)]
    # sizes that are and are not multiples of 4 KiB, so the padded tail lands in the target's slack
    return {k: payload_for(k, 48 * 1024 + 4096 * (i % 3) + 17 * (i % 2)) for i, k in enumerate(keys)}


def populate(cfg: dict, data: dict[bytes, bytes]) -> None:
    with kvstream.open_store(cfg) as s:
        for k, v in data.items():
            assert s.put(k, v, meta=ChunkMeta(dtype="uint8", shape=(len(v),), fmt="raw"))


def stored(cfg: dict, n: int) -> tuple[dict[bytes, bytes], list[bytes]]:
    """``n`` chunks put through a store of ``cfg`` (then closed: flushed and drained)."""
    data = make_data(n)
    populate(cfg, data)
    return data, list(data)


def aligned_targets(sizes: list[int]) -> tuple[list[AlignedBuffer], list[memoryview]]:
    bufs = [AlignedBuffer(round_up(n)) for n in sizes]
    return bufs, [b.view() for b in bufs]


def check(results: dict[int, object], keys: list[bytes], data: dict[bytes, bytes], targets: list) -> int:
    """Wrong bytes among the targets reported ok."""
    bad = 0
    for i, res in results.items():
        if res.ok:
            want = data[keys[i]]
            assert res.nbytes == len(want)
            got = bytes(targets[i][: res.nbytes])
            bad += sum(a != b for a, b in zip(got, want)) if got != want else 0
    return bad


@pytest.mark.parametrize("engine", engines())
def test_read_into_aligned_targets_reads_in_place(disk_tmp, engine):
    cfg = config(disk_tmp, engine)
    data, keys = stored(cfg, 12)
    with kvstream.open_store(cfg) as s:
        metas = s.get_meta(keys)  # fresh process: headers read from disk
        assert [m[1] for m in metas] == [len(data[k]) for k in keys]
        assert all(m[0] == ChunkMeta(dtype="uint8", shape=(len(data[k]),), fmt="raw") for m, k in zip(metas, keys))
        _, targets = aligned_targets([m[1] for m in metas])
        before = s.stats()
        results = dict(s.read_into(keys, targets))
        st = s.stats()
        assert sorted(results) == list(range(len(keys)))
        assert all(r.ok and r.source in ("local", "shared") for r in results.values())
        assert check(results, keys, data, targets) == 0
        # The fastest tier (local, until measured) reads in place; the shared tier's chunks are copied in.
        direct, copied = st.read_into_direct, st.read_into_copied
        assert direct + copied == len(keys) and direct >= 1
        assert direct == sum(r.source == "local" for r in results.values())
        # nothing kept twice: only the copied chunks' pooled buffers stay in host memory
        assert st.memory.chunks - before.memory.chunks == copied


@pytest.mark.parametrize("engine", engines())
def test_read_into_one_tier_reads_everything_in_place(disk_tmp, engine):
    cfg = config(disk_tmp, engine, two=False)
    data, keys = stored(cfg, 12)
    with kvstream.open_store(cfg) as s:
        metas = s.get_meta(keys)
        _, targets = aligned_targets([m[1] for m in metas])
        results = dict(s.read_into(keys, targets))
        assert all(r.ok and r.source == "local" for r in results.values())
        assert check(results, keys, data, targets) == 0
        st = s.stats()
        assert st.read_into_direct == len(keys) and st.read_into_copied == 0
        assert st.memory.chunks == 0


def test_unaligned_or_small_targets_go_through_a_pooled_buffer(disk_tmp):
    cfg = config(disk_tmp, two=False)
    data, keys = stored(cfg, 6)
    with kvstream.open_store(cfg) as s:
        # offset by one byte: not 4 KiB aligned; exact payload length: too small for the padded O_DIRECT tail
        raw = [bytearray(len(data[k]) + 1) for k in keys]
        targets = [memoryview(r)[1:] for r in raw]
        targets[2] = memoryview(bytearray(len(data[keys[2]]) - 1))  # one byte short: refused, not truncated
        results = dict(s.read_into(keys, targets))
        assert [results[i].ok for i in range(6)] == [True, True, False, True, True, True]
        assert results[2].reason == "target_too_small"
        assert check(results, keys, data, targets) == 0
        st = s.stats()
        assert st.read_into_direct == 0 and st.read_into_copied == 5


def test_memory_hits_absent_keys_and_order(disk_tmp):
    cfg = config(disk_tmp, two=False)
    data = make_data(5)
    keys = list(data)
    with kvstream.open_store(cfg) as s:
        for k in keys[:2]:
            s.put(k, data[k])  # still in host memory (not even flushed)
        s.flush()
        s.drain()
        s.evict_memory()
        s.put(keys[2], data[keys[2]])
        asked = keys[:3] + [b"never-stored-key"]
        metas = s.get_meta(asked)
        assert metas[3] is None and all(m is not None for m in metas[:3])
        _, targets = aligned_targets([len(data[k]) for k in keys[:3]] + [4096])
        got = list(s.read_into(asked, targets))
        assert [i for i, _ in got][0] == 2 and got[0][1].source == "memory"  # memory hits first
        assert [i for i, _ in got][-1] == 3 and got[-1][1].reason == "absent"  # misses last
        res = dict(got)
        assert check(res, asked[:3], data, targets) == 0 and all(res[i].ok for i in range(3))


@pytest.mark.parametrize("damage", ["flip", "truncate", "unlink"])
def test_a_damaged_replica_is_never_reported_and_the_other_is_used(disk_tmp, damage):
    cfg = config(disk_tmp, router="single:local")
    data, keys = stored(cfg, 4)
    with kvstream.open_store(cfg) as s:
        path = s.tiers[0].path_for(keys[1])
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(HEADER_BYTES + 100)
            b = f.read(1)
            f.seek(HEADER_BYTES + 100)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "truncate":
        import os
        os.truncate(path, HEADER_BYTES + 4096)
    else:
        path.unlink()
    with kvstream.open_store(cfg) as s:
        metas = s.get_meta(keys)  # headers are intact (or the file is gone: then the shared replica's header)
        assert all(m is not None for m in metas)
        _, targets = aligned_targets([m[1] for m in metas])
        results = dict(s.read_into(keys, targets))
        assert all(r.ok for r in results.values())
        assert results[1].source == "shared"  # the local copy failed: read again from the other replica
        assert check(results, keys, data, targets) == 0


def test_one_damaged_copy_and_no_other_is_a_miss(disk_tmp):
    cfg = config(disk_tmp, two=False)
    data, keys = stored(cfg, 3)
    with kvstream.open_store(cfg) as s:
        path = s.tiers[0].path_for(keys[0])
        metas = s.get_meta(keys)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 5)
        b = f.read(1)
        f.seek(HEADER_BYTES + 5)
        f.write(bytes([b[0] ^ 0x80]))
    with kvstream.open_store(cfg) as s:
        _, targets = aligned_targets([m[1] for m in metas])
        results = dict(s.read_into(keys, targets))
        assert not results[0].ok and results[0].reason == "unreadable"
        assert results[1].ok and results[2].ok
        assert s.stats().tiers["local"].corrupt_chunks == 1
        assert s.get_meta(keys)[0] is None  # quarantined: no longer held


def _stalled_store(cfg: dict, delay_s: float):
    plan = FaultPlan([Fault(kind="delay", rings="local-r", delay_s=delay_s)], seed=1)
    engine = FaultyEngine(make_engine("threads"), plan)
    return kvstream.open_store(cfg, engine=engine), plan, engine


def test_a_stalled_read_into_a_target_is_waited_for_without_a_callback(disk_tmp):
    cfg = config(disk_tmp, router="single:local", hedge_after_s=0.05)
    data, keys = stored(cfg, 3)
    s, plan, engine = _stalled_store(cfg, 0.5)
    try:
        metas = s.get_meta(keys)  # header reads are stalled too: they simply take the delay
        _, targets = aligned_targets([m[1] for m in metas])
        t0 = time.monotonic()
        results, when = {}, []
        for i, r in s.read_into(keys, targets):
            results[i] = r
            when.append(time.monotonic() - t0)
        # The hedged copies from the shared tier won, but no target was handed back while the stalled read into
        # it was still going.
        assert min(when) >= 0.45
        assert all(r.ok for r in results.values()) and check(results, keys, data, targets) == 0
        assert s.stats().hedged_reads >= 1
    finally:
        engine.release_stalls()
        s.close()


def test_a_stalled_read_into_a_target_is_reported_busy_and_freed_later_with_a_callback(disk_tmp):
    cfg = config(disk_tmp, router="single:local", hedge_after_s=0.05)
    data, keys = stored(cfg, 3)
    with kvstream.open_store(cfg) as s:
        metas = s.get_meta(keys)
    s, plan, engine = _stalled_store(cfg, 1.0)
    freed: list[tuple[int, float]] = []
    done = threading.Event()

    def on_free(i: int) -> None:
        freed.append((i, time.monotonic()))
        if len(freed) == len(keys):
            done.set()

    try:
        _, targets = aligned_targets([m[1] for m in metas])
        t0 = time.monotonic()
        results = dict(s.read_into(keys, targets, on_target_free=on_free))
        returned = time.monotonic() - t0
        assert returned < 0.8  # did not wait for the stall
        assert sorted(results) == [0, 1, 2]
        assert all(r.busy and not r.ok and r.reason == "stalled" for r in results.values())
        assert freed == []  # still being written: not freed yet
        assert done.wait(5.0)
        assert sorted(i for i, _ in freed) == [0, 1, 2] and min(t for _, t in freed) - t0 >= 0.9
        assert s.stats().read_into_abandoned == 3
    finally:
        engine.release_stalls()
        s.close()


def test_stopping_early_waits_for_reads_into_the_targets(disk_tmp):
    cfg = config(disk_tmp, two=False)
    data, keys = stored(cfg, 8)
    with kvstream.open_store(cfg) as s:
        metas = s.get_meta(keys)
        _, targets = aligned_targets([m[1] for m in metas])
        gen = s.read_into(keys, targets)
        next(gen)
        gen.close()
        # Whatever was in flight into the targets has completed: the ring holds no read any more (one tier, no
        # hedging: every read in flight was a direct read into a target). The ring counts an op until its
        # completion callback has returned, a few microseconds after the read itself is over: allow 20 ms.
        deadline = time.monotonic() + 0.02
        while s.tiers[0].read_ring.inflight() and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert s.tiers[0].read_ring.inflight() == 0
        results = dict(s.read_into(keys, targets))
        assert all(r.ok for r in results.values()) and check(results, keys, data, targets) == 0


def test_read_into_rejects_mismatched_targets(disk_tmp):
    with kvstream.open_store(config(disk_tmp, two=False)) as s:
        with pytest.raises(kvstream.errors.UsageError):
            list(s.read_into([b"a", b"b"], [bytearray(4096)]))
        with pytest.raises(ValueError):
            list(s.read_into([b"a"], [b"read-only bytes"]))


def test_get_meta_reads_headers_from_the_other_replica_when_a_tier_stalls(disk_tmp):
    cfg = config(disk_tmp, hedge_after_s=0.05)
    data, keys = stored(cfg, 4)
    s, plan, engine = _stalled_store(cfg, 2.0)  # every local read held back 2 s
    s.health[0].stall_floor_s = 0.05  # (default 1 s) a stall is a failure once out this long
    try:
        t0 = time.monotonic()
        metas = s.get_meta(keys)
        assert time.monotonic() - t0 < 1.0  # did not wait for the stalled tier
        assert [m[1] for m in metas] == [len(data[k]) for k in keys]
        # The shared tier read every header before the deadline (header reads are a read step like any other,
        # meeting in the middle); the local tier's stuck reads are stragglers, one failure of the tier at the
        # next step once they are past the deadline.
        time.sleep(0.1)
        list(s.read_chunks(keys[:1]))
        assert s.health[0].failures >= 1
        engine.release_stalls()
        s.drain()
        time.sleep(0.05)
        # the late local reads cleaned up after themselves: their pooled buffers are back (released stalls end
        # on the ring's threads: allow them a moment)
        wait_pool_empty(s)
    finally:
        engine.release_stalls()
        s.close()


def test_read_into_hands_its_access_metadata_to_host_memory_eviction(disk_tmp):
    """``metas=`` reaches the host-memory policy as with read_chunks (hit-potential eviction needs the session
    and answer length of chunks read back from disk); a length mismatch is a UsageError."""
    from kvstream.eviction import AccessMeta

    cfg = config(disk_tmp, memory_eviction="hit-potential")
    data, keys = stored(cfg, 3)
    metas = [AccessMeta(session=f"s{i}", prev_answer_tokens=10 * i) for i in range(3)]
    with kvstream.open_store(cfg) as s:
        targets = [bytearray(len(data[k]) + 1) for k in keys]  # unaligned: read through pooled buffers, kept
        got = dict(s.read_into(keys, targets, metas=metas))
        assert all(r.ok and r.source != "memory" for r in got.values())
        kept = {k: s.memory.peek(k) for k in keys}
        assert all(e is not None and e.access == m for (k, e), m in zip(kept.items(), metas))
        with pytest.raises(kvstream.UsageError, match="3 keys but 2 metas"):
            list(s.read_into(keys, targets, metas=metas[:2]))
