"""Fault drills in-process (runs everywhere): each failure mode the store must survive, with the outcome users need.

Faults come from :mod:`kvstream.io.faults` (a seeded wrapper around the real I/O engine), from damaging files
on disk, and from real ``kill -9`` of writer processes. Every test checks the two numbers that must be zero:
wrong bytes returned, and bytes lost that some replica still held.
"""

from __future__ import annotations

import errno
import logging
import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import numpy as np
import pytest

import kvstream
from kvstream.commands.verify import verify_tier
from kvstream.errors import UsageError
from kvstream.format import HEADER_BYTES
from kvstream.io.buffers import AlignedBuffer
from kvstream.io.engine import IOOp, OpKind, make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine, parse_faults
from kvstream.tiers.files import DirectoryTier
from kvstream.testing.store import make_keys, payload_for

SIZE = 32 * 1024  # bytes of a payload put with no size given

relpath = DirectoryTier.relpath


def config(root: Path, **kw) -> dict:
    base = {
        "tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": "64MiB"},
                  {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "64MiB"}],
        "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads",
    }
    base.update(kw)
    return base


def populate(cfg: dict, keys: list[bytes], size: int = 32 * 1024) -> None:
    with kvstream.open_store(cfg) as s:
        for k in keys:
            assert s.put(k, payload_for(k, size))


def faulty(cfg: dict, *faults: Fault, seed: int = 1):
    plan = FaultPlan(faults, seed=seed)
    engine = FaultyEngine(make_engine("threads"), plan)
    return kvstream.open_store(cfg, engine=engine), plan, engine


def wrong_bytes(keys: list[bytes], out: list, size: int = 32 * 1024) -> int:
    """Bytes returned that differ from what was put (a returned chunk of the wrong length counts whole)."""
    bad = 0
    for k, o in zip(keys, out):
        if o is None:
            continue
        want = payload_for(k, size)
        got = bytes(o)
        if len(got) != len(want):
            bad += max(len(got), len(want))
        else:
            bad += int(np.count_nonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8)))
    return bad


def hit_on_every_replica(plan: FaultPlan, keys: list[bytes], kinds: set[str], n_tiers: int = 2) -> set[bytes]:
    """Keys whose every replica got an injected fault of ``kinds`` (then a miss is the right answer)."""
    tiers_hit: dict[str, set[str]] = {}
    for ev in plan.events:
        if ev.kind in kinds and ev.path:
            tiers_hit.setdefault(Path(ev.path).stem.split(".")[0], set()).add(ev.ring)
    return {k for k in keys if len(tiers_hit.get(k.hex(), ())) >= n_tiers}


# ── the wrapper itself ─────────────────────────────────────────────────────────────────────────────────────


def _one_op(ring, kind: OpKind, fd: int, buf: AlignedBuffer, length: int) -> IOOp:
    done: list[IOOp] = []
    op = IOOp(kind=kind, fd=fd, buf=buf, length=length, offset=0, callback=done.append)
    ring.submit([op])
    assert ring.drain(10)
    assert done == [op]
    return op


@pytest.fixture
def data_file(disk_tmp):
    path = disk_tmp / "f"
    data = np.random.default_rng(3).bytes(64 * 1024)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDWR)
    yield fd, data
    os.close(fd)


@pytest.mark.parametrize("kind,op_kind,expect", [
    ("eio", OpKind.READ, -errno.EIO), ("eio", OpKind.WRITE, -errno.EIO),
    ("enospc", OpKind.WRITE, -errno.ENOSPC), ("edquot", OpKind.WRITE, -errno.EDQUOT),
])
def test_error_faults_set_the_result(data_file, kind, op_kind, expect):
    fd, _ = data_file
    plan = FaultPlan([Fault(kind=kind, rings="t-*")])
    ring = FaultyEngine(make_engine("threads"), plan).ring("t-r")
    op = _one_op(ring, op_kind, fd, AlignedBuffer(64 * 1024), 64 * 1024)
    assert op.result == expect
    assert plan.injected(kind) == 1 and plan.events[-1].path.endswith("/f")
    ring.close()


def test_write_only_faults_leave_reads_alone_and_patterns_select_rings(data_file):
    fd, data = data_file
    plan = FaultPlan([Fault(kind="enospc"), Fault(kind="eio", rings="other-*")])
    ring = FaultyEngine(make_engine("threads"), plan).ring("t-r")
    buf = AlignedBuffer(64 * 1024)
    op = _one_op(ring, OpKind.READ, fd, buf, 64 * 1024)
    assert op.result == 64 * 1024 and bytes(buf.view()) == data and plan.injected() == 0
    assert plan.ops_seen["t-r"] == 1
    ring.close()


def test_flip_changes_exactly_one_bit_and_short_cuts_the_length(data_file):
    fd, data = data_file
    plan = FaultPlan([Fault(kind="flip", window=(100, 200))], seed=5)
    ring = FaultyEngine(make_engine("threads"), plan).ring("t-r")
    buf = AlignedBuffer(64 * 1024)
    op = _one_op(ring, OpKind.READ, fd, buf, 64 * 1024)
    diff = np.frombuffer(bytes(buf.view()), np.uint8) ^ np.frombuffer(data, np.uint8)
    where = np.flatnonzero(diff)
    assert op.result == 64 * 1024 and len(where) == 1 and 100 <= where[0] < 200
    assert bin(int(diff[where[0]])).count("1") == 1 and plan.events[-1].offset == where[0]
    plan.set([Fault(kind="short")])
    op = _one_op(ring, OpKind.READ, fd, buf, 64 * 1024)
    assert 0 <= op.result < 64 * 1024 and plan.injected("short") == 1
    ring.close()


def test_delay_holds_the_completion_and_close_waits_for_it(data_file):
    fd, _ = data_file
    engine = FaultyEngine(make_engine("threads"), FaultPlan([Fault(kind="delay", delay_s=0.3)]))
    ring = engine.ring("t-r")
    done: list[float] = []
    t0 = time.monotonic()
    ring.submit([IOOp(kind=OpKind.READ, fd=fd, buf=AlignedBuffer(4096), length=4096, offset=0,
                      callback=lambda op: done.append(time.monotonic()))])
    assert ring.inflight() == 1 and not ring.drain(0.1)
    ring.close()  # must wait for the held completion
    assert done and done[0] - t0 >= 0.3 and ring.inflight() == 0


def test_release_stalls_delivers_held_completions_at_once(data_file):
    fd, _ = data_file
    engine = FaultyEngine(make_engine("threads"), FaultPlan([Fault(kind="delay", delay_s=60)]))
    ring = engine.ring("t-r")
    ring.submit([IOOp(kind=OpKind.READ, fd=fd, buf=AlignedBuffer(4096), length=4096, offset=0, callback=lambda op: None)])
    time.sleep(0.05)
    engine.release_stalls()
    assert ring.drain(5)
    ring.close()


def test_same_seed_same_faults_and_limits_are_kept(data_file):
    fd, _ = data_file

    def run(seed: int) -> list[int]:
        plan = FaultPlan([Fault(kind="eio", p=0.5), Fault(kind="short", p=0.5, limit=3)], seed=seed)
        ring = FaultyEngine(make_engine("threads"), plan).ring("t-r")
        res = [_one_op(ring, OpKind.READ, fd, AlignedBuffer(8192), 8192).result for _ in range(40)]
        ring.close()
        assert plan.injected("short") <= 3
        return res

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_fault_specs_parse_and_bad_ones_name_the_item():
    fs = parse_faults("eio:local-r:0.3, delay:shared-r:0.1:2")
    assert fs[0] == Fault(kind="eio", rings="local-r", p=0.3)
    assert fs[1].kind == "delay" and fs[1].delay_s == 2.0
    for bad, match in [("eio", "KIND:RINGS"), ("melt:local-r", "melt"), ("eio:x:2", "in \\[0, 1\\]"),
                       ("delay:x:0.5", "delay_s"), ("eio:x:lots", "numbers")]:
        with pytest.raises(UsageError, match=match):
            parse_faults(bad)


# ── reads: EIO, checksum mismatch, short reads ─────────────────────────────────────────────────────────────


def test_eio_on_one_tier_reads_the_other_and_opens_the_breaker(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(24)
    populate(cfg, keys)
    s, plan, _ = faulty(cfg, Fault(kind="eio", rings="local-r"))
    with s:
        out = s.get_many(keys)
        assert s.tiers[0].read_ring.drain(5)  # local reads the shared tier beat are counted when they end
        st = s.stats()
    assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0
    local = st.tiers["local"]
    assert plan.injected("eio") == local.read_errors >= 1
    assert local.circuit_opened >= 1 and local.chunks == 24  # an I/O error drops nothing
    assert st.tiers["shared"].read_chunks == 24 and st.lost_chunks == 0


def test_eio_on_both_tiers_is_a_miss_only_where_every_replica_failed(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(40)
    populate(cfg, keys)
    s, plan, _ = faulty(cfg, Fault(kind="eio", rings="*-r", p=0.4), seed=3)
    with s:
        for h in s.health:
            h.threshold = 10**6  # keep both tiers in routing: this test is about replicas, not the breaker
        out = s.get_many(keys)
    assert wrong_bytes(keys, out) == 0
    missed = {k for k, o in zip(keys, out) if o is None}
    assert missed and missed <= hit_on_every_replica(plan, keys, {"eio"})
    with kvstream.open_store(cfg) as s:  # faults over: the files were intact, so nothing is lost
        out = s.get_many(keys)
    assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0


@pytest.mark.parametrize("kind", ["flip", "short"])
def test_a_damaged_read_is_read_again_and_the_intact_file_kept(disk_tmp, kind):
    # single:local: every chunk is read from local first, so every injected fault is seen by a verification
    # (with meet in the middle, a fault on a stolen read that lands after the other copy is dropped unread).
    # A bit flipped on the way or a short read is not a damaged file (issue 21, item 9): the file is read again
    # and served from there; nothing is quarantined.
    cfg = config(disk_tmp, router="single:local")
    keys = make_keys(16)
    populate(cfg, keys)
    window = (HEADER_BYTES, HEADER_BYTES + 32 * 1024) if kind == "flip" else None  # in the checked payload
    s, plan, _ = faulty(cfg, Fault(kind=kind, rings="local-r", p=0.5, window=window), seed=2)
    with s:
        out = s.get_many(keys)
        st = s.stats()
    assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0
    n = plan.injected(kind)
    local = st.tiers["local"]
    assert n >= 1 and local.read_retried == local.read_transient == n and local.corrupt_chunks == 0
    assert st.tiers["shared"].read_chunks == 0  # every chunk from its re-read on local
    assert not list((disk_tmp / "local" / "quarantine").glob("*.kvc"))
    assert local.chunks == 16


def test_damaged_reads_on_every_replica_are_re_read_never_returned_as_data(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(8)
    populate(cfg, keys)
    s, plan, _ = faulty(cfg, Fault(kind="flip", rings="*-r", window=(HEADER_BYTES, HEADER_BYTES + 32 * 1024)))
    with s:
        out = s.get_many(keys)
        st = s.stats()
    assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0  # the re-reads verified
    assert plan.injected("flip") >= 8
    assert sum(t.corrupt_chunks for t in st.tiers.values()) == 0


def test_files_damaged_on_every_replica_are_misses_never_data(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(8)
    populate(cfg, keys)
    for tier in ("local", "shared"):
        for k in keys:
            p = disk_tmp / tier / relpath(k)
            raw = bytearray(p.read_bytes())
            raw[HEADER_BYTES + 7] ^= 0x01
            p.write_bytes(bytes(raw))
    with kvstream.open_store(cfg) as s:
        out = s.get_many(keys)
        st = s.stats()
    assert out == [None] * 8 and st.lost_chunks == 8
    assert st.tiers["local"].corrupt_chunks == 8 and st.tiers["shared"].corrupt_chunks == 8


def test_open_failing_with_an_io_error_reads_the_other_replica_and_keeps_the_key(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(6)
    populate(cfg, keys)
    with kvstream.open_store(cfg) as s:
        s.tiers[0]._open_flags_read |= os.O_DIRECTORY  # every open() on local now fails (ENOTDIR), as EIO would
        out = s.get_many(keys)
        st = s.stats().tiers["local"]
        assert wrong_bytes(keys, out) == 0 and all(o is not None for o in out)
        assert st.read_errors >= 1 and st.chunks == 6 and st.missing_files == 0


def test_a_vanished_tier_folder_is_a_tier_failure_not_lost_chunks(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(6)
    populate(cfg, keys)
    with kvstream.open_store(cfg) as s:
        os.rename(disk_tmp / "local", disk_tmp / "local.away")  # as if unmounted under us
        try:
            out = s.get_many(keys)
            st = s.stats().tiers["local"]
            assert wrong_bytes(keys, out) == 0 and all(o is not None for o in out)
            assert st.read_errors >= 1 and st.circuit_opened == 1 and st.chunks == 6
        finally:
            os.rename(disk_tmp / "local.away", disk_tmp / "local")
    with kvstream.open_store({**cfg, "router": "single:local"}) as s:  # back: every chunk is still there
        assert all(o is not None for o in s.get_many(keys))
        assert s.stats().tiers["local"].read_chunks == 6


# ── stalls, hedging, the circuit breaker ───────────────────────────────────────────────────────────────────


def test_a_stalled_tier_is_hedged_taken_out_and_probed_back_in(disk_tmp):
    cfg = config(disk_tmp, hedge_after_s=0.05)
    keys = make_keys(16)
    populate(cfg, keys)
    s, plan, engine = faulty(cfg, Fault(kind="delay", rings="local-r", delay_s=20.0))
    try:
        s.health[0].cooldown_s = 0.3
        s.health[0].stall_floor_s = 0.1  # (default 1 s) a stall is a failure once out this long, nothing delivered
        steps = []
        # Each stalled step is one stall of the tier: hedged within the step, or its reads still stuck past
        # hedge_after_s when the next step starts. Once they are out past the floor with nothing delivered by the
        # tier meanwhile, each is a failure; three open its breaker.
        for _ in range(12):
            s.evict_memory()
            t0 = time.monotonic()
            out = s.get_many(keys)
            steps.append(time.monotonic() - t0)
            assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0  # the step completes
            if s.health[0].state == "open":
                break
            time.sleep(0.06)  # the forward pass between two steps
        st = s.stats()
        # The stuck reads were re-read on the shared tier (hedged after hedge_after_s, or taken over by its
        # meet-in-the-middle steal as soon as it ran out of its own chunks, whichever came first).
        assert max(steps) < 2.0 and st.tiers["shared"].read_chunks >= len(steps) * len(keys)
        assert st.tiers["local"].circuit == "open" and st.tiers["local"].read_chunks == 0
        s.evict_memory()
        t0 = time.monotonic()
        out = s.get_many(keys)  # breaker open: the shared tier serves alone, no hedging delay at all
        assert all(o is not None for o in out) and s.stats().hedged_reads == st.hedged_reads
        forgot: list[int] = []  # the probe and the recovery drop local's speed estimate, taken while it stalled
        forget = s.read_windows.forget
        s.read_windows.forget = lambda t: (forgot.append(t), forget(t))  # type: ignore[method-assign]
        plan.clear()
        engine.release_stalls()
        time.sleep(0.35)  # cool-down over: half-open, the next read probes local
        s.evict_memory()
        out = s.get_many(keys)
        st = s.stats()
        assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0
        assert st.tiers["local"].circuit == "closed"  # the probe succeeded
        assert forgot and set(forgot) == {0}
        # Back in routing: the step after the probe reads from local again. (The probe step itself ran with the
        # speed estimate it was planned with, which still carried the stall, so the shared tier may steal and
        # land local's one or two chunks first; probing and closing the breaker drop that estimate.)
        s.evict_memory()
        out = s.get_many(keys)
        assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0
        assert s.stats().tiers["local"].read_chunks > 0
    finally:
        engine.release_stalls()
        s.close()


def test_breaker_reopens_with_a_longer_cooldown_when_the_probe_fails(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(8)
    populate(cfg, keys)
    s, plan, _ = faulty(cfg, Fault(kind="eio", rings="local-r"))
    with s:
        br = s.health[0]
        br.cooldown_s = 0.1
        s.get_many(keys)
        assert s.tiers[0].read_ring.drain(5)  # reads the shared tier won count when they fail, after the step
        assert br.state == "open" and br.opened == 1
        time.sleep(0.12)
        # The probe fails again. Opens run off the step's path, so when the shared tier delivers every chunk
        # before local's first open is done, local's read is dropped unread and the next step probes.
        for _ in range(5):
            s.evict_memory()
            out = s.get_many(keys)
            assert s.tiers[0].read_ring.drain(5)
            if br.state != "half-open":
                break
        assert br.state == "open" and br.opened == 2 and br._current_cooldown == pytest.approx(0.2)
        assert all(o is not None for o in out)


# ── writes: ENOSPC / EDQUOT, EIO, stalled writes ──────────────────────────────────────────────────────────


@pytest.mark.parametrize("kind", ["enospc", "edquot"])
def test_no_space_on_write_evicts_and_retries_once(disk_tmp, kind):
    cfg = config(disk_tmp)
    old = make_keys(10, seed=1)
    populate(cfg, old)
    new = make_keys(4, seed=2)
    s, plan, _ = faulty(cfg, Fault(kind=kind, rings="local-w", limit=4))  # the first try of each write fails
    with s:
        for k in new:
            s.put(k, payload_for(k, SIZE))
        s.flush()
        assert s.drain(10)
        st = s.stats().tiers["local"]
        # Each of the 4 faults hit a first try (then retried once room was made) or, when a retry raced ahead of
        # the last first tries under load, a retry (then the copy is skipped and counted).
        retried, skipped = st.write_retried_nospace, st.write_skipped_full
        assert plan.injected(kind) == 4 and retried >= 2 and retried + skipped == 4
        assert st.evicted_chunks >= retried and st.write_chunks == 4 - skipped
        assert sum(s.tiers[0].contains(k) for k in new) == 4 - skipped
    assert not list((disk_tmp / "local" / "tmp").iterdir())


def test_no_space_that_persists_skips_the_copy_records_it_and_never_blocks(disk_tmp):
    cfg = config(disk_tmp)
    old = make_keys(6, seed=1)
    populate(cfg, old)
    new = make_keys(6, seed=2)
    s, plan, _ = faulty(cfg, Fault(kind="enospc", rings="local-w"))
    with s:
        t0 = time.monotonic()
        for k in new:
            s.put(k, payload_for(k, SIZE))
        s.flush()
        serving = time.monotonic() - t0
        assert s.drain(10)
        st = s.stats().tiers
        assert serving < 1.0
        assert st["local"].write_skipped_full == 6 and st["local"].write_retried_nospace >= 1
        assert st["shared"].write_chunks == 6
        s.evict_memory()
        out = s.get_many(new + old)
        assert all(o is not None for o in out) and wrong_bytes(new + old, out) == 0
    assert not list((disk_tmp / "local" / "tmp").iterdir())


def test_write_eio_skips_the_copy_counts_it_and_cleans_the_temporary(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(8)
    s, plan, _ = faulty(cfg, Fault(kind="eio", rings="local-w"))
    with s:
        for k in keys:
            s.put(k, payload_for(k, SIZE))
        s.flush()
        s.drain(10)
        st = s.stats().tiers
        assert st["local"].write_errors == plan.injected("eio") >= 1
        assert st["local"].circuit_opened >= 1
        assert st["local"].write_errors + st["local"].write_skipped_unhealthy == 8
        assert st["shared"].write_chunks == 8
    assert not list((disk_tmp / "local" / "tmp").iterdir()) and not list((disk_tmp / "local" / "chunks").rglob("*.kvc"))
    with kvstream.open_store(cfg) as s:
        out = s.get_many(keys)
        assert all(o is not None for o in out) and wrong_bytes(keys, out) == 0


def test_a_stalled_write_tier_never_blocks_puts_flushes_or_reads(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(8)
    s, plan, engine = faulty(cfg, Fault(kind="delay", rings="*-w", delay_s=30.0))
    t0 = time.monotonic()
    for k in keys:
        s.put(k, payload_for(k, SIZE))
    s.flush()
    out = s.get_many(keys)  # served from host memory while the writes hang
    assert time.monotonic() - t0 < 1.0 and wrong_bytes(keys, out) == 0 and all(o is not None for o in out)
    assert not s.drain(0.2)
    engine.release_stalls()
    s.close()
    with kvstream.open_store(cfg) as s2:
        assert s2.lookup(keys) == 8


# ── crash (kill -9) during writes, restart ─────────────────────────────────────────────────────────────────


def _writer_forever(cfg: dict, ack_path: str, seed: int) -> None:
    """Write chunks forever; after each flush+drain, append the keys now stored to ``ack_path``."""
    rng = random.Random(seed)
    s = kvstream.open_store(cfg)
    with open(ack_path, "a") as ack:
        while True:
            batch = [rng.randbytes(16) for _ in range(4)]
            for k in batch:
                s.put(k, payload_for(k, 200_000))
            s.flush()
            s.drain()
            ack.write("".join(k.hex() + "\n" for k in batch))
            ack.flush()


def test_kill_9_during_writes_leaves_no_partial_chunk_and_loses_nothing_acknowledged(disk_tmp):
    cfg = config(disk_tmp)
    ack = disk_tmp / "acked"
    ctx = mp.get_context("spawn")
    rng = random.Random(7)
    for round_ in range(3):
        p = ctx.Process(target=_writer_forever, args=(cfg, str(ack), round_))
        p.start()
        deadline = time.monotonic() + 30
        while (not ack.exists() or ack.stat().st_size < 33 * 4 * (round_ + 1)) and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))  # somewhere in the middle of a write, a publish or an index append
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        assert p.exitcode == -signal.SIGKILL
    acked = [bytes.fromhex(line) for line in ack.read_text().split()]
    assert len(acked) >= 12
    left = {t: len(os.listdir(disk_tmp / t / "tmp")) for t in ("local", "shared")}  # the last kill's orphans
    with kvstream.open_store(cfg) as s:
        st = s.stats().tiers
        assert {t: st[t].removed_temporaries for t in left} == left
        out = s.get_many(acked)
        assert all(o is not None for o in out) and wrong_bytes(acked, out, 200_000) == 0
    for tier in ("local", "shared"):
        assert not list((disk_tmp / tier / "tmp").iterdir())  # orphaned temporaries cleaned at open
        rep = verify_tier(disk_tmp / tier)
        assert not rep.errors, rep.errors  # every visible chunk is whole; the index matches the files
        assert rep.valid_chunks == rep.chunk_files >= len(acked)
        # a kill between a publish and its index record leaves its temporary (a second link of the file): the
        # next open lists the chunk from it, so no orphan sits outside every quota (issue 21, item 11)
        assert not [f for f in rep.warnings if f.kind == "orphan"], [f.file for f in rep.warnings]


# ── two processes (two nodes) on one shared tier ──────────────────────────────────────────────────────────


def _node(cfg: dict, keys: list[bytes], seconds: float, seed: int, out_q) -> None:
    rng = random.Random(seed)
    torn = served = 0
    with kvstream.open_store(cfg) as s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            batch = rng.sample(keys, 6)
            for k in batch:
                s.put(k, payload_for(k, 96 * 1024))
            s.flush()
            s.evict_memory()
            want = rng.sample(keys, 12)
            for k, o in zip(want, s.get_many(want)):
                if o is not None:
                    served += 1
                    torn += bytes(o) != payload_for(k, 96 * 1024)
        s.drain()
        corrupt = sum(t.corrupt_chunks for t in s.stats().tiers.values())
    out_q.put((torn, served, corrupt))


def test_two_nodes_writing_and_reading_the_same_keys_never_see_a_torn_chunk(disk_tmp):
    keys = make_keys(48, seed=9)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for node in ("a", "b"):
        cfg = config(disk_tmp, node_id=f"node-{node}", router="single:shared", tiers=[
            {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "1GiB", "shared": True,
             "require_mount": False}])
        procs.append(ctx.Process(target=_node, args=(cfg, keys, 2.5, ord(node), q)))
    for p in procs:
        p.start()
    results = [q.get(timeout=90) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert sum(r[0] for r in results) == 0  # no torn (or otherwise wrong) payload ever returned
    assert sum(r[2] for r in results) == 0  # and none was even seen: publishing is atomic
    assert sum(r[1] for r in results) > 20  # reads really raced the other node's writes
    assert not verify_tier(disk_tmp / "shared").errors


# ── foreign, truncated, zero-length, wrong-version files in a tier folder ──────────────────────────────────


def _damage(path: Path, how: str, other: Path) -> None:
    raw = bytearray(path.read_bytes())
    if how == "zero-length":
        path.write_bytes(b"")
    elif how == "truncated":
        path.write_bytes(raw[: HEADER_BYTES + 100])
    elif how == "wrong-version":
        from kvstream.format import _FIXED, _SUM
        import xxhash

        raw[8:10] = (2).to_bytes(2, "little")  # version 2, header checksum made valid again
        _SUM.pack_into(raw, _FIXED.size, xxhash.xxh3_64_intdigest(bytes(raw[: _FIXED.size])))
        path.write_bytes(raw)
    elif how == "foreign":
        path.write_bytes(other.read_bytes())  # another key's (valid) chunk under this name
    elif how == "not-a-chunk":
        path.write_bytes(b"#!/bin/sh\necho hello\n" * 300)


@pytest.mark.parametrize("how", ["zero-length", "truncated", "wrong-version", "foreign", "not-a-chunk"])
def test_bad_files_in_a_tier_are_ignored_with_a_warning(disk_tmp, how, caplog):
    cfg = config(disk_tmp, replication="single")
    keys = make_keys(4)
    populate(cfg, keys)
    victim = disk_tmp / "local" / relpath(keys[0])
    _damage(victim, how, disk_tmp / "local" / relpath(keys[1]))
    (disk_tmp / "local" / "chunks" / "README.txt").write_text("someone else's file")
    (disk_tmp / "local" / "index" / "log-junk.log").write_bytes(os.urandom(500))
    caplog.set_level(logging.WARNING, logger="kvstream")
    with kvstream.open_store(cfg) as s:
        out = s.get_many(keys)
        st = s.stats()
    assert out[0] is None and wrong_bytes(keys, out) == 0 and all(o is not None for o in out[1:])
    assert st.tiers["local"].corrupt_chunks == 1
    assert any("quarantined" in r.getMessage() and keys[0].hex() in r.getMessage() for r in caplog.records)
    rep = verify_tier(disk_tmp / "local")
    assert {f.file for f in rep.errors} == {"chunks/README.txt"}  # the bad chunk is already quarantined
    assert any(f.kind == "log" and f.file == "index/log-junk.log" for f in rep.warnings)


def test_a_folder_of_another_format_version_opens_with_a_warning(disk_tmp, caplog):
    cfg = config(disk_tmp)
    populate(cfg, make_keys(2))
    (disk_tmp / "local" / "KVSTREAM_TIER").write_text("kvstream tier, chunk format 9\n")
    caplog.set_level(logging.WARNING, logger="kvstream")
    with kvstream.open_store(cfg) as s:
        assert s.lookup(make_keys(2)) == 2
    assert any("chunk format 9" in r.getMessage() for r in caplog.records)


# ── the index log on a full or failing disk ────────────────────────────────────────────────────────────────


def test_an_index_append_that_fails_never_raises_and_keeps_serving(disk_tmp, caplog):
    cfg = config(disk_tmp)
    keys = make_keys(6)
    caplog.set_level(logging.WARNING, logger="kvstream")
    with kvstream.open_store(cfg) as s:
        idx = s.tiers[0].index
        real_fd = idx._own_fd
        idx._own_fd = os.open("/dev/full", os.O_WRONLY)  # every append now fails with ENOSPC
        try:
            for k in keys:
                s.put(k, payload_for(k, SIZE))
            s.flush()
            assert s.drain(10)
            assert idx.append_errors == 6 and all(s.tiers[0].contains(k) for k in keys)
            out = s.get_many(keys)
            assert wrong_bytes(keys, out) == 0 and all(o is not None for o in out)
        finally:
            os.close(idx._own_fd)
            idx._own_fd = real_fd
    assert any("not logged" in r.getMessage() for r in caplog.records)
    with kvstream.open_store(cfg) as s:  # the puts were never logged on local: invisible there, served by shared
        assert not any(s.tiers[0].contains(k) for k in keys) and s.lookup(keys) == 6
    assert any(f.kind == "orphan" for f in verify_tier(disk_tmp / "local").warnings)


def test_a_compaction_that_cannot_write_its_snapshot_does_not_stop_the_store_opening(disk_tmp, monkeypatch):
    from kvstream.tiers.index import TierIndex

    cfg = config(disk_tmp)
    keys = make_keys(4)
    populate(cfg, keys)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(TierIndex, "_write_file", staticmethod(no_space))
    with kvstream.open_store(cfg) as s:
        assert s.lookup(keys) == 4 and s.tiers[0].index.compacted_logs == 0
    assert not list((disk_tmp / "local" / "index").glob("snapshot*"))
    monkeypatch.undo()
    with kvstream.open_store(cfg) as s:  # space again: the logs left behind are compacted now
        assert s.tiers[0].index.compacted_logs >= 1 and s.lookup(keys) == 4


# ── out of file descriptors (EMFILE): a shortage of this process, not a failing tier ───────────────────────


def _read_with_few_fds(cfg: dict, keys: list[bytes], q) -> None:
    import logging
    import resource

    class _CountEmfile(logging.Handler):
        n = 0

        def emit(self, record: logging.LogRecord) -> None:
            if "Too many open files" in record.getMessage():
                _CountEmfile.n += 1

    logging.getLogger("kvstream").addHandler(_CountEmfile())
    with kvstream.open_store(cfg) as s:
        s.evict_memory()
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 12, hard))
        try:
            out = s.get_many(keys)  # one step asks for far more files than may be open
            bad = wrong_bytes(keys, out, 8192)
            served = sum(o is not None for o in out)
            states = [h.state for h in s.health]
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        out = s.get_many(keys)  # descriptors back: everything is there
        q.put((bad, served, states, sum(o is not None for o in out), wrong_bytes(keys, out, 8192), _CountEmfile.n))


def test_running_out_of_file_descriptors_is_a_miss_not_a_crash_or_a_broken_tier(disk_tmp):
    cfg = config(disk_tmp)
    keys = make_keys(64)
    populate(cfg, keys, size=8192)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_read_with_few_fds, args=(cfg, keys, q))
    p.start()
    bad, served, states, served_after, bad_after, emfile = q.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    # Opens did fail (EMFILE) and cost misses or a read from the other replica, never an exception or wrong
    # bytes. (All 64 may still be served: a CI run had every failed open answered by the other tier's copy.)
    assert emfile > 0, "the descriptor limit never bit: the test tested nothing"
    assert bad == 0 and 0 < served <= 64
    assert states == ["closed", "closed"]  # and no tier was blamed for it
    assert served_after == 64 and bad_after == 0
