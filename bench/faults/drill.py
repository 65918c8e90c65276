"""Fault drills: run each fault N times against real tier folders and count what users care about.

    flock /tmp/kvs-bench.lock .venv/bin/python bench/faults/drill.py --rounds 20            # in-process faults
    flock /tmp/kvs-bench.lock .venv/bin/python bench/faults/drill.py --rounds 5 --real      # + kernel faults (root)
    ... --only read-eio-one stall-hedge --json out.json --markdown

For every scenario and round: a fresh pair of tier folders (``local`` and ``shared``, full replication, on the
real disk) is filled with ``--keys`` chunks of ``--size`` bytes whose contents are a function of the key; the
fault is injected while the store serves reads and writes; then the faults stop and a fresh, fault-free store
reads every key once more. Per scenario the table reports:

- **injected**: faults actually injected (counted by :class:`kvstream.io.faults.FaultPlan`, or by the drill for
  files it damaged, processes it killed, kernel faults it caused);
- **outcome**: what the engine did (replica reads, quarantines, hedges, breaker openings, retries, misses);
- **bytes lost**: bytes of chunks the store did not return although a replica was intact and untouched by any
  injected fault (during the faults), plus bytes of chunks a fault-free read afterwards can no longer return
  although not every replica was destroyed by an injected fault. A chunk whose every copy was damaged is an
  *expected* miss, reported in the outcome, not counted as lost. Must be 0.
- **wrong bytes**: bytes returned, during or after the faults, that differ from what was put. Must be 0.

In-process faults use :mod:`kvstream.io.faults` (seeded; ``--seed``); kernel faults use ``kernel.py`` (loop
devices, mounts, blkio throttling) and run only with ``--real`` as root; what the machine cannot do is
reported with the reason.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import kvstream  # noqa: E402
from kvstream.commands.verify import verify_tier  # noqa: E402
from kvstream.format import _FIXED, _SUM, HEADER_BYTES  # noqa: E402
from kvstream.io.engine import make_engine  # noqa: E402
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine  # noqa: E402
from kvstream.tiers.files import DirectoryTier  # noqa: E402

relpath = DirectoryTier.relpath


# ── bookkeeping ────────────────────────────────────────────────────────────────────────────────────────────


@dataclass
class Tally:
    """One scenario's totals over its rounds."""

    name: str
    fault: str  # what is injected, in words
    mechanism: str  # "in-process hook", "on-disk damage", "kill -9", "kernel: ..."
    rounds: int = 0
    injected: int = 0
    bytes_lost: int = 0
    wrong_bytes: int = 0
    counters: dict[str, float] = field(default_factory=dict)  # summed over rounds
    maxima: dict[str, float] = field(default_factory=dict)
    outcome: str = ""  # filled from counters at the end
    skipped: str = ""  # why it did not run here
    seconds: float = 0.0

    def add(self, **kw: float) -> None:
        for k, v in kw.items():
            self.counters[k] = self.counters.get(k, 0) + v

    def peak(self, **kw: float) -> None:
        for k, v in kw.items():
            self.maxima[k] = max(self.maxima.get(k, 0.0), v)


def payload_for(key: bytes, size: int) -> bytes:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def wrong(keys: list[bytes], out: list, size: int) -> int:
    bad = 0
    for k, o in zip(keys, out):
        if o is None:
            continue
        got, want = bytes(o), payload_for(k, size)
        if len(got) != len(want):
            bad += max(len(got), len(want))
        else:
            bad += int(np.count_nonzero(np.frombuffer(got, np.uint8) != np.frombuffer(want, np.uint8)))
    return bad


class Round:
    """A fresh pair of tier folders, filled with ``n`` chunks, and the helpers every scenario needs."""

    def __init__(self, base: Path, n: int, size: int, seed: int, *, local: Path | None = None, **cfg_kw: object):
        self.dir = Path(tempfile.mkdtemp(prefix="round-", dir=base))
        self.size = size
        self.rng = random.Random(seed)
        self.seed = seed
        self.keys = [self.rng.randbytes(16) for _ in range(n)]
        self.local = local or self.dir / "local"
        self.cfg = {"tiers": [{"name": "local", "path": str(self.local), "capacity_bytes": "4GiB"},
                              {"name": "shared", "path": str(self.dir / "shared"), "capacity_bytes": "4GiB"}],
                    "memory_bytes": "256MiB", "create_dirs": True, "io_engine": "threads", **cfg_kw}

    def populate(self, keys: list[bytes] | None = None) -> None:
        with kvstream.open_store(self.cfg) as s:
            for k in keys if keys is not None else self.keys:
                s.put(k, payload_for(k, self.size))

    def faulty(self, *faults: Fault) -> tuple[kvstream.Store, FaultPlan, FaultyEngine]:
        plan = FaultPlan(faults, seed=self.seed)
        engine = FaultyEngine(make_engine("threads"), plan)
        return kvstream.open_store(self.cfg, engine=engine), plan, engine

    def final_read(self, expected_missing: set[bytes] = frozenset()) -> tuple[int, int, int]:
        """Fault-free read of every key: (bytes lost, wrong bytes, chunks missing as expected)."""
        with kvstream.open_store(self.cfg) as s:
            out = s.get_many(self.keys)
        lost = sum(self.size for k, o in zip(self.keys, out) if o is None and k not in expected_missing)
        expected = sum(1 for k, o in zip(self.keys, out) if o is None and k in expected_missing)
        return lost, wrong(self.keys, out, self.size), expected

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def every_replica_hit(plan: FaultPlan, kinds: set[str]) -> set[bytes]:
    hit: dict[str, set[str]] = {}
    for ev in plan.events:
        if ev.kind in kinds and ev.path:
            hit.setdefault(Path(ev.path).name.split(".")[0], set()).add(ev.ring.split("-")[0])
    return {bytes.fromhex(h) for h, tiers in hit.items() if len(tiers) >= 2}


def tier_sum(st: dict, name: str) -> float:
    return sum(t[name] for t in st["tiers"].values())


# ── in-process scenarios ───────────────────────────────────────────────────────────────────────────────────


def read_faults(kind: str, rings: str, p: float) -> Callable[[Round, Tally], None]:
    """EIO / bit flips / short reads on read rings; the chunks were written without faults."""

    def run(r: Round, t: Tally) -> None:
        r.populate()
        window = (HEADER_BYTES, HEADER_BYTES + r.size) if kind == "flip" else None
        s, plan, _ = r.faulty(Fault(kind=kind, rings=rings, p=p, window=window))
        with s:
            if rings == "*-r":
                for h in s.health:
                    h.threshold = 10**9  # about replicas here; the breaker has its own scenario
            out = s.get_many(r.keys)
            st = s.stats().as_dict()
        t.wrong_bytes += wrong(r.keys, out, r.size)
        destroyed = every_replica_hit(plan, {"flip", "short"}) if kind != "eio" else set()
        hit_all = every_replica_hit(plan, {kind})
        misses = [k for k, o in zip(r.keys, out) if o is None]
        t.add(reads=len(r.keys), served=len(r.keys) - len(misses), misses=len(misses),
              misses_unexplained=sum(1 for k in misses if k not in hit_all),
              read_errors=tier_sum(st, "read_errors"), quarantined=tier_sum(st, "corrupt_chunks"),
              other_replica=st["tiers"]["shared"]["read_chunks"])
        t.injected += plan.injected()
        lost, bad, expected = r.final_read(destroyed)
        t.bytes_lost += lost + sum(r.size for k in misses if k not in hit_all)  # a miss no fault explains: lost
        t.wrong_bytes += bad
        t.add(expected_misses_after=expected)

    return run


def at_rest_damage(r: Round, t: Tally) -> None:
    """Damage chunk files on disk (one replica of 30 % of the keys, both of 5 %), then read everything."""
    r.populate()
    hows = ["payload-bit", "header-bit", "truncate", "zero-length", "wrong-version", "foreign", "not-a-chunk"]
    destroyed: set[bytes] = set()
    n_files = 0
    for i, k in enumerate(r.keys):
        x = r.rng.random()
        tiers = ["local", "shared"] if x < 0.05 else [r.rng.choice(["local", "shared"])] if x < 0.35 else []
        for tier in tiers:
            _damage(r.dir / tier / relpath(k), r.rng.choice(hows), r.dir / tier / relpath(r.keys[(i + 1) % len(r.keys)]),
                    r.rng)
            n_files += 1
        if len(tiers) == 2:
            destroyed.add(k)
    with kvstream.open_store(r.cfg) as s:
        for h in s.health:
            h.threshold = 10**9
        out = s.get_many(r.keys)
        st = s.stats().as_dict()
    t.injected += n_files
    t.wrong_bytes += wrong(r.keys, out, r.size)
    misses = {k for k, o in zip(r.keys, out) if o is None}
    t.add(damaged_files=n_files, quarantined=tier_sum(st, "corrupt_chunks"), misses=len(misses),
          expected_misses=len(destroyed))
    t.bytes_lost += r.size * len(misses - destroyed)
    lost, bad, _ = r.final_read(destroyed)
    t.bytes_lost += lost
    t.wrong_bytes += bad


def _damage(path: Path, how: str, other: Path, rng: random.Random) -> None:
    import xxhash

    raw = bytearray(path.read_bytes())
    if how == "payload-bit":
        pos = HEADER_BYTES + rng.randrange(len(raw) - HEADER_BYTES)
        raw[pos] ^= 1 << rng.randrange(8)
        # a flip in the payload's padding is harmless and undetectable: keep it inside the payload
        pos = HEADER_BYTES + rng.randrange(min(len(raw) - HEADER_BYTES, 4096))
        raw[pos] ^= 1 << rng.randrange(8)
    elif how == "header-bit":
        raw[rng.randrange(_FIXED.size)] ^= 1 << rng.randrange(8)
    elif how == "truncate":
        del raw[rng.randrange(len(raw)):]
    elif how == "zero-length":
        raw.clear()
    elif how == "wrong-version":
        raw[8:10] = (7).to_bytes(2, "little")
        _SUM.pack_into(raw, _FIXED.size, xxhash.xxh3_64_intdigest(bytes(raw[: _FIXED.size])))
    elif how == "foreign":
        raw[:] = other.read_bytes()
    else:
        raw[:] = os.urandom(len(raw))
    path.write_bytes(bytes(raw))


def stall_hedge(r: Round, t: Tally) -> None:
    """1 s stalls on 30 % of the local tier's reads; hedge after 20 ms; several steps."""
    r.cfg["hedge_after_s"] = 0.02
    r.populate()
    s, plan, engine = r.faulty(Fault(kind="delay", rings="local-r", p=0.3, delay_s=1.0))
    steps = []
    try:
        for _ in range(4):
            s.evict_memory()
            t0 = time.monotonic()
            out = s.get_many(r.keys)
            steps.append(time.monotonic() - t0)
            t.wrong_bytes += wrong(r.keys, out, r.size)
            t.bytes_lost += r.size * sum(o is None for o in out)  # every replica was intact: a miss is a loss
            t.add(misses=sum(o is None for o in out))
        st = s.stats().as_dict()
    finally:
        engine.release_stalls()
        s.close()
    t.injected += plan.injected()
    t.add(steps=len(steps), hedged=st["hedged_reads"], breaker_opened=st["tiers"]["local"]["circuit_opened"])
    t.peak(max_step_s=max(steps), stall_s=1.0)
    t.counters.setdefault("step_s", 0)
    t.counters["step_s"] += statistics.median(steps)
    lost, bad, _ = r.final_read()
    t.bytes_lost += lost
    t.wrong_bytes += bad


def breaker(r: Round, t: Tally) -> None:
    """EIO on every local read for a while, then none: the breaker opens, then probes the tier back in."""
    r.populate()
    s, plan, _ = r.faulty(Fault(kind="eio", rings="local-r"))
    with s:
        s.health[0].cooldown_s = 0.05
        out = s.get_many(r.keys)
        t.wrong_bytes += wrong(r.keys, out, r.size)
        opened = s.health[0].state == "open"
        plan.clear()
        time.sleep(0.06)
        s.evict_memory()
        out = s.get_many(r.keys)
        t.wrong_bytes += wrong(r.keys, out, r.size)
        back = s.health[0].state == "closed" and s.stats().as_dict()["tiers"]["local"]["read_chunks"] > 0
        t.add(misses=sum(o is None for o in out), opened=opened, probed_back=back)
        t.bytes_lost += r.size * sum(o is None for o in out)
    t.injected += plan.injected()
    lost, bad, _ = r.final_read()
    t.bytes_lost += lost
    t.wrong_bytes += bad


def write_faults(kind: str, p: float) -> Callable[[Round, Tally], None]:
    """ENOSPC / EDQUOT / EIO on the local tier's writes while new chunks are put; old chunks fill it."""

    def run(r: Round, t: Tally) -> None:
        old, new = r.keys[: len(r.keys) // 2], r.keys[len(r.keys) // 2:]
        r.populate(old)
        s, plan, _ = r.faulty(Fault(kind=kind, rings="local-w", p=p))
        worst = 0.0
        with s:
            for i in range(0, len(new), 4):
                t0 = time.monotonic()
                for k in new[i:i + 4]:
                    s.put(k, payload_for(k, r.size))
                s.flush()
                worst = max(worst, time.monotonic() - t0)
            s.drain(60)
            st = s.stats().as_dict()["tiers"]
            s.evict_memory()
            out = s.get_many(r.keys)
        t.wrong_bytes += wrong(r.keys, out, r.size)
        loc = st["local"]
        t.injected += plan.injected()
        t.bytes_lost += r.size * sum(o is None for o in out)  # the shared copy of every chunk was written
        t.add(writes=len(new), retried=loc["write_retried_nospace"], evicted=loc["evicted_chunks"],
              skipped_full=loc["write_skipped_full"], write_errors=loc["write_errors"],
              skipped_unhealthy=loc["write_skipped_unhealthy"], misses=sum(o is None for o in out))
        t.peak(max_put_flush_s=worst)
        tmp_left = len(os.listdir(r.local / "tmp"))
        t.add(tmp_left=tmp_left)
        lost, bad, _ = r.final_read()
        t.bytes_lost += lost
        t.wrong_bytes += bad

    return run


def _writer(cfg: dict, ack: str, seed: int, size: int) -> None:
    rng = random.Random(seed)
    s = kvstream.open_store(cfg)
    with open(ack, "a") as f:
        while True:
            batch = [rng.randbytes(16) for _ in range(4)]
            for k in batch:
                s.put(k, payload_for(k, size))
            s.flush()
            s.drain()
            f.write("".join(k.hex() + "\n" for k in batch))
            f.flush()


def kill9(r: Round, t: Tally) -> None:
    """``kill -9`` a writer process at a random moment, 3 times; then reopen and check everything."""
    ack = r.dir / "acked"
    ctx = mp.get_context("spawn")
    orphans = 0
    for i in range(3):
        p = ctx.Process(target=_writer, args=(r.cfg, str(ack), r.seed * 10 + i, r.size))
        p.start()
        target = (i + 1) * 4 * 33
        deadline = time.monotonic() + 30
        while (not ack.exists() or ack.stat().st_size < target) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(r.rng.uniform(0, 0.2))
        os.kill(p.pid, signal.SIGKILL)
        p.join(10)
        t.injected += 1
        orphans += sum(len(os.listdir(r.dir / tier / "tmp")) for tier in ("local", "shared"))
    r.keys = [bytes.fromhex(x) for x in ack.read_text().split()]
    partial = 0
    for tier in ("local", "shared"):
        rep = verify_tier(r.dir / tier)
        partial += len(rep.errors)
    lost, bad, _ = r.final_read()
    left = sum(len(os.listdir(r.dir / tier / "tmp")) for tier in ("local", "shared"))
    t.add(acknowledged=len(r.keys), orphans_seen=orphans, partial_visible=partial, tmp_left_after_reopen=left)
    t.bytes_lost += lost
    t.wrong_bytes += bad


def _node(cfg: dict, keys: list[bytes], size: int, seconds: float, seed: int, q) -> None:
    rng = random.Random(seed)
    torn = served = 0
    with kvstream.open_store(cfg) as s:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for k in rng.sample(keys, 6):
                s.put(k, payload_for(k, size))
            s.flush()
            s.evict_memory()
            want = rng.sample(keys, 12)
            for k, o in zip(want, s.get_many(want)):
                if o is not None:
                    served += 1
                    torn += wrong([k], [o], size)
        s.drain()
        corrupt = sum(t["corrupt_chunks"] for t in s.stats().as_dict()["tiers"].values())
    q.put((torn, served, corrupt))


def two_nodes(r: Round, t: Tally) -> None:
    """Two processes (node ids a, b) write and read the same keys on one shared tier for 2 s."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = []
    for node in "ab":
        cfg = {**r.cfg, "node_id": f"node-{node}", "router": "single:shared",
               "tiers": [{"name": "shared", "path": str(r.dir / "shared"), "capacity_bytes": "4GiB", "shared": True,
                          "require_mount": False}]}
        procs.append(ctx.Process(target=_node, args=(cfg, r.keys, r.size, 2.0, r.seed * 2 + ord(node), q)))
    for p in procs:
        p.start()
    res = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    t.wrong_bytes += sum(x[0] for x in res)
    t.injected += sum(x[1] for x in res)  # racing reads
    t.add(racing_reads=sum(x[1] for x in res), torn=sum(x[0] for x in res), corrupt_seen=sum(x[2] for x in res),
          verify_errors=len(verify_tier(r.dir / "shared").errors))


def foreign_files(r: Round, t: Tally) -> None:
    """Plant junk in the tier folders: stray names, log garbage, zero-length and foreign chunk files."""
    r.populate()
    destroyed: set[bytes] = set()
    for tier in ("local", "shared"):
        root = r.dir / tier
        (root / "chunks" / "notes.txt").write_text("not ours")
        (root / "chunks" / "ab").mkdir(exist_ok=True)
        (root / "chunks" / "ab" / "zz.kvc").write_bytes(b"")
        (root / "index" / "log-garbage.log").write_bytes(os.urandom(960))
        (root / "index" / "log-x-1-y.closed").write_bytes(os.urandom(200))
        (root / "tmp" / "junk.tmp").write_bytes(b"x")
        (root / "stray").write_text("x")
        t.injected += 6
    for k in r.rng.sample(r.keys, 3):
        _damage(r.dir / "local" / relpath(k), r.rng.choice(["zero-length", "truncate", "wrong-version", "foreign"]),
                r.dir / "local" / relpath(r.keys[0] if k != r.keys[0] else r.keys[1]), r.rng)
        t.injected += 1
    with kvstream.open_store(r.cfg) as s:
        out = s.get_many(r.keys)
        st = s.stats().as_dict()
    t.wrong_bytes += wrong(r.keys, out, r.size)
    t.add(misses=sum(o is None for o in out), quarantined=tier_sum(st, "corrupt_chunks"))
    lost, bad, _ = r.final_read(destroyed)
    t.bytes_lost += lost
    t.wrong_bytes += bad


# ── kernel scenarios (--real, root) ────────────────────────────────────────────────────────────────────────


def kernel_scenario(kind: str) -> Callable[[Round, Tally], None]:
    import kernel

    def put_all(s: kvstream.Store, keys: list[bytes], size: int, t: Tally) -> None:
        worst = 0.0
        for i in range(0, len(keys), 4):
            t0 = time.monotonic()
            for k in keys[i:i + 4]:
                s.put(k, payload_for(k, size))
            s.flush()
            worst = max(worst, time.monotonic() - t0)
        s.drain(60)
        t.peak(max_put_flush_s=worst)

    def run(r: Round, t: Tally) -> None:
        size = r.size
        with kernel.loop_fs(f"drill-{kind}", (40 << 20) if kind == "enospc" else (64 << 20)) as fs:
            r.local = fs.mountpoint / "tier"
            r.cfg["tiers"][0]["path"] = str(r.local)
            if kind == "stall":
                r.cfg["hedge_after_s"] = 0.03
            if kind == "enospc":  # ~1.6x what the file system holds
                r.keys += [r.rng.randbytes(16) for _ in range(max(0, (64 << 20) // (size + 4096) - len(r.keys)))]
            first, later = (r.keys[: len(r.keys) // 2], r.keys[len(r.keys) // 2:]) if kind in ("ro", "gone") \
                else (r.keys, [])
            with kvstream.open_store(r.cfg) as s:
                s.health[0].cooldown_s = 0.1
                put_all(s, first, size, t)
                s.evict_memory()
                if kind == "eio":
                    cut = min(kernel.first_block(r.local / relpath(k)) for k in first if s.tiers[0].contains(k))
                    fs.shrink(cut // 4096 * 4096)
                elif kind == "ro":
                    fs.freeze_readonly(r.local)
                elif kind == "gone":
                    fs.detach()
                try:
                    t0 = time.monotonic()
                    if kind == "stall":
                        with kernel.throttle_reads(fs.maj_min(), 1 << 20, "drill"):
                            out = s.get_many(first)
                    else:
                        out = s.get_many(first)  # reads first: they meet the fault before any write opens the breaker
                    t.peak(max_step_s=time.monotonic() - t0)
                    t.wrong_bytes += wrong(first, out, size)
                    t.bytes_lost += size * sum(o is None for o in out)
                    put_all(s, later, size, t)  # writes into the read-only or vanished tier
                    full = s.stats().as_dict()
                    st = full["tiers"]["local"]
                    t.add(misses=sum(o is None for o in out), read_errors=st["read_errors"],
                          write_errors=st["write_errors"], retried=st["write_retried_nospace"],
                          skipped_unhealthy=st["write_skipped_unhealthy"],
                          evicted=st["evicted_chunks"], quarantined=st["corrupt_chunks"],
                          breaker_opened=st["circuit_opened"], hedged=full["hedged_reads"])
                    t.injected += {"enospc": st["write_retried_nospace"] + st["write_skipped_full"],
                                   "stall": full["hedged_reads"]}.get(kind, st["read_errors"] + st["write_errors"])
                finally:
                    if kind == "eio":
                        fs.restore_size()
                    elif kind == "ro":
                        fs.thaw(r.local)
            if kind == "gone":
                fs.mount()
            lost, bad, _ = r.final_read()
            t.bytes_lost += lost
            t.wrong_bytes += bad
            t.add(verify_errors=len(verify_tier(r.local).errors))

    return run



def timed_puts(s: kvstream.Store, keys: list[bytes], size: int) -> float:
    """Put and flush each key; returns the slowest put+flush (the serving path must never wait on a bad tier)."""
    worst = 0.0
    for k in keys:
        t1 = time.monotonic()
        s.put(k, payload_for(k, size))
        s.flush()
        worst = max(worst, time.monotonic() - t1)
    return worst


def owed_replicas(r: Round, t: Tally) -> None:
    """A burst past the shared tier's write backlog: its copies are skipped, owed, and written by the catch-up;
    after a restart nothing is owed and every chunk has both copies (issue 13: full replication is full)."""
    r.cfg["memory_bytes"] = "8MiB"
    r.cfg["tiers"][1]["write_backlog_bytes"] = 2 * (r.size + 4096)
    with kvstream.open_store(r.cfg) as s:
        for k in r.keys:
            s.put(k, payload_for(k, r.size))
        s.flush()
        s.drain(30)
        st = s.stats().tiers["shared"]
        t.injected += st.write_skipped_backlog
        t.add(skipped_backlog=st.write_skipped_backlog)
        deadline = time.monotonic() + 30
        while s.owed.counts()["shared"] and time.monotonic() < deadline:
            time.sleep(0.05)
        s.drain(30)
        t.add(owed_left=s.owed.counts()["shared"], catch_up_reads=s.stats().catch_up_reads)
    with kvstream.open_store(r.cfg) as s:
        t.add(both_copies=sum(all(tier.contains(k) for tier in s.tiers) for k in r.keys), chunks=len(r.keys))
    lost, bad, _ = r.final_read()
    t.bytes_lost += lost
    t.wrong_bytes += bad


def xfs_down(r: Round, t: Tally) -> None:
    """The first tier's XFS is shut down (every operation EIO, as when its disk dies) mid-run: reads come from
    the other replica, new copies to it are owed (their journal moves off the dead tier), and after a repair
    (umount, mount: XFS replays its log) and a restart the catch-up writes them."""
    import kernel

    size = r.size
    with kernel.loop_fs("drill-xfs", 320 << 20, fstype="xfs") as fs:  # XFS wants at least 300 MB
        r.local = fs.mountpoint / "tier"
        r.cfg["tiers"][0]["path"] = str(r.local)
        first, later = r.keys[: len(r.keys) // 2], r.keys[len(r.keys) // 2:]
        s = kvstream.open_store(r.cfg)
        s.health[0].cooldown_s = 0.1
        for k in first:
            s.put(k, payload_for(k, size))
        s.flush()
        s.drain(30)
        s.evict_memory()
        fs.shutdown()
        t0 = time.monotonic()
        out = s.get_many(first)
        t.peak(max_step_s=time.monotonic() - t0)
        t.wrong_bytes += wrong(first, out, size)
        t.bytes_lost += size * sum(o is None for o in out)
        worst = timed_puts(s, later, size)
        s.drain(30)
        t.peak(max_put_flush_s=worst)
        st = s.stats().tiers["local"]
        owed = s.owed.counts()["local"]
        t.injected += st.read_errors + st.write_errors
        t.add(read_errors=st.read_errors, write_errors=st.write_errors, owed=owed,
              journal_moved=int(s.owed.path is not None and not s.owed.path.is_relative_to(r.local)))
        report = s.close(timeout=5)
        t.add(close_stuck=len(report.stuck_tiers))
        fs.detach()
        fs.mount()
        with kvstream.open_store(r.cfg) as again:
            deadline = time.monotonic() + 30
            while again.owed.counts()["local"] and time.monotonic() < deadline:
                time.sleep(0.05)
            again.drain(30)
            t.add(owed_written=sum(again.tiers[0].contains(k) for k in later), owed_left=again.owed.counts()["local"])
        lost, bad, _ = r.final_read()
        t.bytes_lost += lost
        t.wrong_bytes += bad
        t.add(verify_errors=len(verify_tier(r.local).errors))


def frozen(r: Round, t: Tally) -> None:
    """The first tier's file system is frozen (``fsfreeze``: creates and writes block) mid-run: puts and flushes
    never wait on it, reads are served, ``close`` returns after its timeout naming the tier, and the copies land
    once it thaws."""
    import kernel

    size = r.size
    with kernel.loop_fs("drill-freeze", 64 << 20) as fs:
        r.local = fs.mountpoint / "tier"
        r.cfg["tiers"][0]["path"] = str(r.local)
        first, later = r.keys[: len(r.keys) // 2], r.keys[len(r.keys) // 2:]
        s = kvstream.open_store(r.cfg)
        for k in first:
            s.put(k, payload_for(k, size))
        s.flush()
        s.drain(30)
        fs.freeze()
        try:
            worst = timed_puts(s, later, size)
            t.peak(max_put_flush_s=worst)
            s.evict_memory()
            t0 = time.monotonic()
            out = s.get_many(r.keys)
            t.peak(max_step_s=time.monotonic() - t0)
            t.wrong_bytes += wrong(r.keys, out, size)
            t.bytes_lost += size * sum(o is None for o in out)
            t1 = time.monotonic()
            report = s.close(timeout=0.5)
            t.peak(close_s=time.monotonic() - t1)
            t.injected += 1
            t.add(close_named=int(report.stuck_tiers == ("local",)))
        finally:
            fs.unfreeze()
        deadline = time.monotonic() + 30
        while s.tiers[0].index._own_fd is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the background closer finishes once the frozen writes land
        with kvstream.open_store(r.cfg) as again:
            t.add(landed_after_thaw=sum(again.tiers[0].contains(k) for k in later), thawed_chunks=len(later))
        lost, bad, _ = r.final_read()
        t.bytes_lost += lost
        t.wrong_bytes += bad
        t.add(verify_errors=len(verify_tier(r.local).errors))

SCENARIOS: list[tuple[str, str, str, Callable[[Round, Tally], None] | None]] = [
    ("read-eio-one", "EIO on 30 % of one tier's reads", "in-process hook", read_faults("eio", "local-r", 0.3)),
    ("read-eio-both", "EIO on 30 % of both tiers' reads", "in-process hook", read_faults("eio", "*-r", 0.3)),
    ("read-bitflip", "one bit flipped in 20 % of reads (payload), both tiers", "in-process hook",
     read_faults("flip", "*-r", 0.2)),
    ("read-short", "20 % of reads cut short, both tiers", "in-process hook", read_faults("short", "*-r", 0.2)),
    ("at-rest-damage", "chunk files damaged on disk (7 kinds), one or both replicas", "on-disk damage", at_rest_damage),
    ("stall-hedge", "1 s stall on 30 % of one tier's reads", "in-process hook", stall_hedge),
    ("breaker", "EIO on every read of one tier, then recovery", "in-process hook", breaker),
    ("write-enospc", "ENOSPC on 50 % of one tier's writes", "in-process hook", write_faults("enospc", 0.5)),
    ("write-edquot", "EDQUOT on 50 % of one tier's writes", "in-process hook", write_faults("edquot", 0.5)),
    ("write-eio", "EIO on 30 % of one tier's writes", "in-process hook", write_faults("eio", 0.3)),
    ("kill-9", "writer process killed (SIGKILL) mid-write, 3x a round", "kill -9", kill9),
    ("two-nodes", "two processes writing+reading the same keys on one shared tier", "2 processes", two_nodes),
    ("foreign-files", "junk, zero-length, truncated, wrong-version, foreign files in the folders", "on-disk damage",
     foreign_files),
    ("owed-replicas", "a burst past the shared tier's write backlog (second copies skipped)", "configuration",
     owed_replicas),
]
REAL: list[tuple[str, str, str, str]] = [
    ("real-enospc", "file system smaller than the tier's capacity", "kernel: 40 MiB loop ext4", "enospc"),
    ("real-eio", "device EIO under every chunk of one tier", "kernel: loop device cut short", "eio"),
    ("real-readonly", "tier folder turned read-only mid-run", "kernel: read-only bind mount", "ro"),
    ("real-vanished", "tier unmounted mid-run, then mounted again", "kernel: umount -l", "gone"),
    ("real-stall", "device throttled to 1 MiB/s", "kernel: blkio cgroup throttle", "stall"),
]


def outcome(t: Tally) -> str:
    c, m, n = t.counters, t.maxima, max(t.rounds, 1)
    g = lambda k: int(c.get(k, 0))  # noqa: E731
    if t.name.startswith("read-"):
        return (f"{g('served')}/{g('reads')} served ({g('other_replica')} from the other replica), "
                f"{g('misses')} misses ({g('misses_unexplained')} not explained by a fault on every replica), "
                f"{g('read_errors')} I/O errors counted, {g('quarantined')} quarantined")
    if t.name == "at-rest-damage":
        return (f"{g('damaged_files')} damaged files: {g('quarantined')} read and quarantined (the rest unread: "
                f"their other replica served first); {g('misses')} misses = {g('expected_misses')} chunks damaged "
                f"on both replicas")
    if t.name == "stall-hedge":
        return (f"{g('steps')} steps: median {c.get('step_s', 0) / n * 1000:.0f} ms, max {m.get('max_step_s', 0):.2f} s "
                f"(stall 1 s); {g('hedged')} hedged reads; breaker opened {g('breaker_opened')}x; {g('misses')} misses")
    if t.name == "breaker":
        return f"opened {g('opened')}/{n}, probed back in {g('probed_back')}/{n}; {g('misses')} misses"
    if t.name.startswith("write-"):
        return (f"{g('writes')} writes: {g('retried')} retried after eviction ({g('evicted')} evicted), "
                f"{g('skipped_full')} skipped (full), {g('write_errors')} EIO + {g('skipped_unhealthy')} skipped "
                f"(breaker); slowest put+flush {m.get('max_put_flush_s', 0) * 1000:.0f} ms; "
                f"{g('tmp_left')} temporaries left; {g('misses')} misses")
    if t.name == "kill-9":
        return (f"{g('acknowledged')} acknowledged chunks all read back; {g('orphans_seen')} orphaned temporaries "
                f"seen, {g('tmp_left_after_reopen')} left after reopen; {g('partial_visible')} partial or "
                f"inconsistent files visible")
    if t.name == "two-nodes":
        return (f"{g('racing_reads')} reads raced the other node's writes: {g('torn')} torn, "
                f"{g('corrupt_seen')} corrupt seen; verify errors {g('verify_errors')}")
    if t.name == "foreign-files":
        return (f"every store opened and served; {g('quarantined')} damaged local copies quarantined (the shared "
                f"copy served), junk ignored; {g('misses')} misses")
    if t.name == "owed-replicas":
        return (f"{g('skipped_backlog')} second copies skipped at the backlog limit and owed; {g('owed_left')} still "
                f"owed after the catch-up ({g('catch_up_reads')} read back from the other tier); after a restart "
                f"{g('both_copies')}/{g('chunks')} chunks have both copies")
    if t.name == "real-xfs-down":
        return (f"{g('read_errors')} read + {g('write_errors')} write EIOs; reads served by the other replica; "
                f"{g('owed')} copies owed, journal moved off the dead tier {g('journal_moved')}/{n}; close stuck on "
                f"{g('close_stuck')} tiers; after repair and restart {g('owed_written')} owed copies written, "
                f"{g('owed_left')} left; slowest read step {m.get('max_step_s', 0) * 1000:.0f} ms, slowest put+flush "
                f"{m.get('max_put_flush_s', 0) * 1000:.0f} ms; verify errors {g('verify_errors')}")
    if t.name == "real-fsfreeze":
        return (f"slowest put+flush on the frozen tier {m.get('max_put_flush_s', 0) * 1000:.0f} ms, slowest read "
                f"step {m.get('max_step_s', 0) * 1000:.0f} ms; close(timeout=0.5) returned in "
                f"{m.get('close_s', 0):.2f} s naming the frozen tier {g('close_named')}/{n}; after the thaw "
                f"{g('landed_after_thaw')}/{g('thawed_chunks')} frozen copies landed; verify errors {g('verify_errors')}")
    if t.name.startswith("real-"):
        return (f"{g('misses')} misses; faulty tier: {g('read_errors')} read errors, {g('write_errors')} write "
                f"errors, {g('skipped_unhealthy')} copies skipped (breaker open), {g('retried')} writes retried after eviction ({g('evicted')} evicted), {g('quarantined')} "
                f"quarantined, breaker opened {g('breaker_opened')}x, {g('hedged')} hedged reads; slowest read step "
                f"{m.get('max_step_s', 0) * 1000:.0f} ms, slowest put+flush {m.get('max_put_flush_s', 0) * 1000:.0f} ms; "
                f"verify errors {g('verify_errors')}")
    return json.dumps(c)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--keys", type=int, default=32)
    ap.add_argument("--size", type=int, default=64 * 1024, help="payload bytes per chunk (default 64 KiB)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", nargs="+", metavar="NAME")
    ap.add_argument("--real", action="store_true", help="also run the kernel scenarios (root)")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--markdown", action="store_true", help="print the RELIABILITY.md table")
    ap.add_argument("--dir", default="/var/tmp", help="where round folders go (a real disk: O_DIRECT)")
    args = ap.parse_args(argv)

    import logging

    logging.getLogger("kvstream").setLevel(logging.ERROR)  # the drill injects thousands of faults on purpose
    base = Path(tempfile.mkdtemp(prefix="kvs-drill-", dir=args.dir))
    plan: list[tuple[str, str, str, Callable[[Round, Tally], None] | None, str]] = [
        (n, f, m, fn, "") for n, f, m, fn in SCENARIOS]
    if args.real:
        import kernel

        why = kernel.missing_loop()
        for n, f, m, kind in REAL:
            reason = why or (kernel.missing_blkio() if kind == "stall" else None)
            plan.append((n, f, m, None if reason else kernel_scenario(kind), reason or ""))
        dm = kernel.missing_dm("error")
        for n, f in [("real-dm-error", "dm-error table under a mounted tier"), ("real-dm-flakey", "dm-flakey"),
                     ("real-dm-delay", "dm-delay stall")]:
            plan.append((n, f, "kernel: device-mapper", None, dm or "not wired into the drill (see the root suite)"))
        plan.append(("real-edquot", "writer over its ext4 quota", "kernel: ext4 quota", None,
                     kernel.missing_quota() or "run by the root suite only"))
        no_xfs = why or next((f"{tool} is not installed (apt xfsprogs)" for tool in ("mkfs.xfs", "xfs_io")
                              if not shutil.which(tool)), None)
        plan.append(("real-xfs-down", "the first tier's XFS shut down mid-run (its disk dies), repaired, reopened",
                     "kernel: `xfs_io -x -c shutdown`", None if no_xfs else xfs_down, no_xfs or ""))
        no_freeze = why or (None if shutil.which("fsfreeze") else "fsfreeze is not installed (util-linux)")
        plan.append(("real-fsfreeze", "the first tier's file system frozen mid-run, then thawed", "kernel: `fsfreeze`",
                     None if no_freeze else frozen, no_freeze or ""))
    if args.only:
        plan = [p for p in plan if p[0] in args.only]
    tallies: list[Tally] = []
    try:
        for name, fault, mech, fn, skip in plan:
            t = Tally(name=name, fault=fault, mechanism=mech, skipped=skip)
            tallies.append(t)
            if fn is None:
                print(f"{name:16} not run: {skip}", flush=True)
                continue
            t0 = time.monotonic()
            rounds = args.rounds if not name.startswith(("real-", "kill-9", "two-nodes")) else max(1, args.rounds // 4)
            for i in range(rounds):
                r = Round(base, args.keys, args.size, seed=args.seed * 1000 + i)
                try:
                    fn(r, t)
                finally:
                    r.cleanup()
                t.rounds += 1
            t.seconds = time.monotonic() - t0
            t.outcome = outcome(t)
            print(f"{name:16} rounds={t.rounds:3} injected={t.injected:6} lost={t.bytes_lost} wrong={t.wrong_bytes} "
                  f"({t.seconds:.1f} s)\n{'':17}{t.outcome}", flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps([t.__dict__ for t in tallies], indent=2))
    if args.markdown:
        print()
        print("| fault | mechanism | rounds | injected | outcome | bytes lost | wrong bytes |")
        print("|---|---|---:|---:|---|---:|---:|")
        for t in tallies:
            if t.skipped and not t.rounds:
                print(f"| {t.name}: {t.fault} | {t.mechanism} | 0 | 0 | not run here: {t.skipped} | – | – |")
            else:
                print(f"| {t.name}: {t.fault} | {t.mechanism} | {t.rounds} | {t.injected} | {t.outcome} | "
                      f"{t.bytes_lost} | {t.wrong_bytes} |")
    bad = [t.name for t in tallies if t.bytes_lost or t.wrong_bytes]
    if bad:
        print(f"FAILED: bytes lost or wrong in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
