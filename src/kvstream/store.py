"""The engine: a host-memory tier over replicated directory tiers, read meet-in-the-middle, written deferred.

Public API (stable): :func:`open_store`, and on :class:`Store`: ``put``, ``flush``, ``contains``, ``lookup``, ``pin``, ``unpin``,
``locate_prefix`` and ``read_bandwidth`` (where a held prefix is, what each tier reads at), ``get_many``,
``read_iter``, ``read_chunks``, ``stats`` (a :class:`kvstream.stats.StoreStats`), ``observe_writes``,
``drain``, ``close`` (and ``with``).

Read path (``read_chunks``, ``read_into``, ``get_meta``): memory hits are pinned when the step is planned (a
view made with the lookup, under the memory lock) and handed out at once; the rest form one read step for the
whole call, a sans-I/O machine (:mod:`kvstream.read_step`) that :mod:`kvstream.reader` drives with the tiers'
open threads and read rings. The router decides which tier reads which chunk as reads complete; what lands is
verified (header, key, checksum) and handed out as soon as it is. A chunk that fails verification or I/O is
quarantined (corrupt) or counted (I/O error) and read from another replica if there is one, else reported as a
miss: wrong bytes are never returned. Reads (and opens) stuck past ``hedge_after_s`` are re-issued on another
replica; a tier that keeps failing is taken out of routing by its circuit breaker and probed back.

Write path: ``put`` copies the payload into a pooled, aligned buffer that becomes a dirty host-memory entry
(hits on it are served at once); ``flush`` — called at the step boundary, once the next forward pass has
started — hands the copies to :mod:`kvstream.writer` (replication policy, per-tier writer threads, separate
write rings, atomic publish). A copy that cannot be written is skipped and counted, never blocks the caller.

Threading: any thread may call the API. Metadata is guarded by ``_lock``; waits on I/O hold no lock. Reads:
see :mod:`kvstream.reader`. Write completions are handed to the publisher thread, so a slow publish never
delays the reaping of reads.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstream.compute import checked_plan
from kvstream.config import StoreConfig
from kvstream.errors import ConfigError, StoreClosedError, TierUnavailable, UsageError
from kvstream.eviction import AccessMeta
from kvstream.format import (
    HEADER_BYTES,
    ChunkHeader,
    ChunkMeta,
    decode_header,
    file_size,
    payload_checksum,
    write_header,
)
from kvstream.health import CircuitBreaker
from kvstream.io.buffers import CallerBuffer
from kvstream.io.engine import IOEngine, make_engine
from kvstream.io.switch_interval import lower_switch_interval
from kvstream.replica_debt import CatchUp, OwedReplicas, ReplicaReport, check_replicas
from kvstream.replication import CopyOrder, FullReplication, ReadObservation, parse_replication
from kvstream.read_windows import make_read_windows
from kvstream.removals import Removals
from kvstream.routing import parse_router
from kvstream.stats import MemoryStats, StoreCounters, StoreStats, TierStats, percentiles
from kvstream.read_step import ComputePlan, ReadStep
from kvstream.reader import Reader
from kvstream.writer import Writer
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.lease import node_uid_for
from kvstream.tiers.memory import HostMemoryTier, MemEntry
from kvstream.tiers.pins import Pins

__all__ = ["Store", "Chunk", "ChunkPlace", "CloseReport", "ComputeRequest", "RECOMPUTED", "ReadIntoResult",
           "open_store"]


@dataclass(frozen=True, slots=True)
class ComputeRequest:
    """What a caller with a GPU asks of one read step (:meth:`Store.read_chunks`'s ``compute``)."""

    leave: frozenset[bytes] = frozenset()  # disk chunks not to read: the GPU computes them (yielded as None)
    plan: ComputePlan | None = None  # the step's front, recomputed by the GPU while the tiers read the back
    on_step: Callable[[ReadStep], None] | None = None  # after the step: its per-tier bytes and busy time


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What :meth:`Store.close` could not finish. True when everything was written and closed: every copy the
    replication policy wanted is on its tier, none is owed."""

    drained: bool  # every write handed over finished before the timeout
    stuck_tiers: tuple[str, ...] = ()  # tiers with I/O still in flight: closed in the background when it ends
    errors: tuple[str, ...] = ()  # tiers that failed to close (logged)
    owed: tuple[tuple[str, int], ...] = ()  # (tier, copies) still owed or in flight: journalled for the next open
    unstored: int = 0  # acknowledged puts with no copy on any tier: lost with host memory (logged as an error)

    def __bool__(self) -> bool:
        return self.drained and not self.stuck_tiers and not self.errors and not self.owed and not self.unstored


@dataclass(frozen=True, slots=True)
class ChunkPlace:
    """Where a held chunk is (:meth:`Store.locate_prefix`): in host memory (``memory``), or else on the usable
    tiers ``tiers`` (positions, in tier order), whose copies are ``file_bytes`` long (header and payload: what a
    read moves; 0 if the index no longer knows)."""

    memory: bool
    tiers: tuple[int, ...] = ()
    file_bytes: int = 0


log = logging.getLogger("kvstream.store")

_META_CACHE_ENTRIES = 1 << 18  # get_meta's cache of headers seen (~40 MB at most)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk handed to a caller: its verified payload (read-only) and what its header says."""

    key: bytes
    meta: ChunkMeta
    payload: memoryview
    source: str  # "memory" or the tier name it was read from


# What read_chunks(compute=...) yields for a chunk the GPU recomputed: no payload (test with ``is``).
RECOMPUTED = Chunk(key=b"", meta=ChunkMeta(dtype="uint8", shape=(0,), fmt="raw"), payload=memoryview(b""),
                   source="gpu")


@dataclass(frozen=True, slots=True)
class ReadIntoResult:
    """What :meth:`Store.read_into` says of one target.

    ``ok``: the target holds the chunk's verified payload in ``[0, nbytes)``. ``busy``: not ok, and a read into
    the target is still in flight on a stalled tier; the caller must leave the target alone until the store
    calls its ``on_target_free(index)`` (only ever reported when that callback was given)."""

    ok: bool
    source: str = ""  # "memory" or the tier name; "" when not ok
    nbytes: int = 0
    meta: ChunkMeta | None = None
    busy: bool = False
    reason: str = ""  # why not ok: absent, unreadable, target_too_small, stalled, closed


def _as_bytes_view(payload: Any) -> tuple[memoryview, ChunkMeta | None]:
    """A flat byte view of any buffer-protocol payload, and the metadata it implies (numpy arrays)."""
    meta = None
    dtype = getattr(payload, "dtype", None)
    shape = getattr(payload, "shape", None)
    if dtype is not None and shape is not None and hasattr(payload, "__array_interface__"):
        if getattr(dtype, "hasobject", False):  # its bytes are pointers into this process: not KV
            raise UsageError(f"put payload holds Python objects (dtype {dtype}); pass numeric data")
        meta = ChunkMeta(dtype=str(dtype), shape=tuple(int(d) for d in shape), fmt="raw")
    try:
        view = memoryview(payload)
    except TypeError:
        raise UsageError(f"put payload must support the buffer protocol, got {type(payload).__name__}") from None
    if not view.c_contiguous:
        raise UsageError("put payload must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view, meta


class Store:
    """See the module docstring. Build one with :func:`open_store`."""

    def __init__(self, config: StoreConfig, *, engine: IOEngine | None = None) -> None:
        self.config = config
        if config.python_switch_interval_s is not None:
            lower_switch_interval(config.python_switch_interval_s, by="python_switch_interval_s")
        # ``engine`` lets tests and fault drills wrap the real engine (kvstream.io.faults); normally from config.
        self.engine = engine if engine is not None else make_engine(config.io_engine)
        self.tiers: list[DirectoryTier] = []
        self.pins = Pins()  # chunks kept out of every tier's eviction (LMCache's pin/unpin): kvstream.tiers.pins
        try:
            node_uid = node_uid_for(config)  # persistent, random: identity on shared tiers (docs/shared-tier.md)
            self._open_tiers(config, node_uid)
        except OSError as exc:  # a dead or unreadable file system under a tier: say which, not a traceback
            for t in self.tiers:
                t.close()
            raise ConfigError(f"tiers[{len(self.tiers)}].path", f"{config.tiers[len(self.tiers)].path}: "
                                                                 f"{exc.strerror or exc} (is its file system alive?)") from None
        except BaseException:
            for t in self.tiers:
                t.close()
            raise
        names = [t.name for t in self.tiers]
        self.router = parse_router(config.router, names)
        self.replication = parse_replication(config.replication)
        if isinstance(self.replication, FullReplication) and not self.tiers[0].cfg.shared \
                and any(t.cfg.shared for t in self.tiers[1:]):
            # Other nodes' chunks reach this node only through the shared tier: keep what it reads locally.
            self.replication.read_through = True
        self.memory = HostMemoryTier(config.memory_bytes, config.memory_eviction,
                                     overflow_bytes=config.memory_bytes if config.read_overflow_bytes is None
                                     else config.read_overflow_bytes)
        self.health = [CircuitBreaker() for _ in self.tiers]
        for t in self.tiers:
            if t.down:
                self.health[t.position].mark_down()
        # Smallest window a tier may shrink to: one chunk of the configured size (the read loop always keeps
        # one read in flight regardless).
        self.read_windows = make_read_windows(config.read_windows, [t.cfg.read_inflight_bytes for t in self.tiers],
                                              min_bytes=config.chunk_bytes or 0)
        self._lock = threading.RLock()
        self.put_wait_s = 1.0  # longest a put waits for host memory held by unwritten chunks before dropping
        self._closed = False
        self.removals = Removals()  # guarded by _lock: a read that raced a remove must not cache its chunk
        self._counters = StoreCounters()  # the store's own; the reader, writer and catch-up keep theirs
        # Headers seen by this process (puts, reads), for get_meta without a disk read: bounded, oldest dropped.
        self._metas: dict[bytes, tuple[ChunkMeta, int]] = {}
        self._meta_intern: dict[ChunkMeta, ChunkMeta] = {}  # one ChunkMeta object per distinct shape
        self._reader = Reader(tiers=self.tiers, health=self.health, memory=self.memory,
                              read_windows=self.read_windows, router=self.router, removals=self.removals,
                              lock=self._lock, remember_meta=self._remember_meta,
                              hedge_after_s=config.hedge_after_s, verify_reads=config.verify_reads)
        # Copies the writer had to skip are owed (journal in the first tier's folder) and paid in the background.
        # When the first tier fails, its debts move to a journal on the second (named by the node's unique id).
        fallback_name = f"{node_uid or config.node_id}.log"
        fallback = self.tiers[1].root / "owed" / fallback_name if len(self.tiers) > 1 and not self.tiers[1].down \
            else None
        self.owed = OwedReplicas(None if self.tiers[0].down else self.tiers[0].root / "owed", config.node_id, names,
                                 fallback=fallback)
        self._writer = Writer(tiers=self.tiers, health=self.health, memory=self.memory,
                              read_windows=self.read_windows, owed=self.owed, replication=self.replication,
                              lock=self._lock, closed=lambda: self._closed, memory_bytes=config.memory_bytes)
        self._catch_up = CatchUp(tiers=self.tiers, health=self.health, memory=self.memory, owed=self.owed,
                                 writer=self._writer, serving_steps=lambda: self._reader.active_steps,
                                 read_back=self._read_back, closed=lambda: self._closed,
                                 chunk_bytes=config.chunk_bytes or 0)

    def _open_tiers(self, config: StoreConfig, node_uid: str | None) -> None:
        """Open each tier. A tier whose file system is failing (full, out of inodes, read-only, dead:
        ``TierUnavailable``) is opened *down* (never read, written or probed; logged as an error, ``down`` in
        stats, ``kvstream_tier_down``) so that it does not take the healthy tiers down with it; so is one that
        fails its mount check, with ``skip_unmounted_tiers`` (else that is a ConfigError naming it). If no tier
        opens, the first tier's error is raised."""
        failures: list[TierUnavailable] = []
        for i, tcfg in enumerate(config.tiers):
            kw: dict[str, Any] = dict(index=i, engine=self.engine, node_id=config.node_id, create=config.create_dirs,
                                      field_prefix=f"tiers[{i}]", node_uid=node_uid, pins=self.pins)
            try:
                self.tiers.append(DirectoryTier(tcfg, **kw))
                continue
            except TierUnavailable as exc:
                if exc.unmounted and not config.skip_unmounted_tiers:
                    raise
                failures.append(exc)
                reason = str(exc)
            log.error("tier %s is DOWN: %s. The store runs without it (no reads, no writes, no copies owed to it) "
                      "until it is reopened once the cause is fixed", tcfg.name, reason)
            self.tiers.append(DirectoryTier(tcfg, down=reason, **kw))
        if failures and all(t.down for t in self.tiers):
            raise failures[0]

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float | None = None) -> "CloseReport":
        """Flush buffered puts, wait (at most ``timeout`` s; default ``config.close_timeout_s``) for every write to
        finish, pay owed copies, release rings and index logs. Idempotent; never raises for a failing tier.

        Owed copies (second copies skipped at a write backlog, an open breaker or an I/O error; unstored puts)
        are paid within the same timeout, by the catch-up's rounds run on this thread, for as long as they make
        progress; what stays owed (a tier out of routing, the time up) is journalled for the next open and named
        in the report (``owed``), as are copies still in flight on a stalled tier (journalled before they were
        issued). Acknowledged puts that no tier took (``unstored``) are lost with host memory, and reported.

        A tier whose writes or reads are still in flight when the time is up (a stalled device) is not waited
        for: its rings still own the buffers the kernel writes from, so a daemon thread closes them once they
        drain, and the report names the tier (its unfinished copies are not on it). A tier that fails to close
        (EIO from a dead file system) is logged and named in the report; the other tiers still close.

        Reads on other threads: a read call (``get_many``, ``read_iter``, ``read_chunks``, ``read_into``,
        ``get_meta``) in progress when close starts returns promptly: what it delivered stays valid (views pin
        their buffers), and every chunk that had not landed is a miss (``None``; ``read_into`` reports
        ``ok=False, reason="closed"``); no read is issued after that. The one wait left is the documented one
        of ``read_into``: a read already writing into a caller's target is waited for by that call. A call
        started after close raises :class:`~kvstream.errors.StoreClosedError`."""
        if self._closed:
            return CloseReport(drained=True)
        if timeout is None:
            timeout = self.config.close_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        stopped = self._catch_up.stop(timeout=min(5.0, timeout) if timeout is not None else 5.0)
        self.flush()
        drained = self._writer.drain(timeout)
        if drained and stopped:
            # Pay what can be paid within the timeout (owed second copies, unstored puts); the rest stays in the
            # journal for the next open and is reported.
            self._catch_up.pay(deadline)
            drained = self._writer.drain(left())
        unstored = self._writer.unstored()[0]
        if unstored:
            log.error("close: %d acknowledged put(s) have no copy on any tier (every tier they target failing); "
                      "they are lost with host memory now", unstored)
        self._closed = True
        self._writer.close(wait=drained)
        # Reads running on other threads end now (what has not landed is a miss); the reads they already
        # submitted land on the rings, and a tier is stuck only if they have not landed by the deadline.
        self._reader.close()
        for t in self.tiers:
            t.read_ring.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stuck: list[str] = []
        errors: list[str] = []
        for t in self.tiers:
            if self._writer.backlog(t.position) or t.write_ring.inflight() or t.read_ring.inflight():
                stuck.append(t.name)
                threading.Thread(target=self._close_tier_when_idle, args=(t,), name=f"kvs-close-{t.name}",
                                 daemon=True).start()
                continue
            if (err := self._close_tier(t)) is not None:
                errors.append(err)
        # Copies still owed, and copies in flight on a stuck tier (journalled before they were issued: if they
        # never land, the next open finds them owed).
        owed = self.owed.counts()
        for name, n in self.owed.inflight_counts().items():
            owed[name] += n
        self.owed.close()
        self.memory.close()
        if stuck:
            log.warning("close: tier(s) %s still had I/O in flight after %.1f s (a stalled device?); their "
                        "unfinished copies are not written there, and their rings close once it completes",
                        ", ".join(stuck), timeout if timeout is not None else 0.0)
        if any(owed.values()):
            log.warning("close: copies still owed (journalled; written after the next open): %s",
                        ", ".join(f"{name} {n}" for name, n in owed.items() if n))
        return CloseReport(drained=drained and not stuck, stuck_tiers=tuple(stuck), errors=tuple(errors),
                           owed=tuple((name, n) for name, n in owed.items() if n), unstored=unstored)

    @staticmethod
    def _close_tier(t: DirectoryTier) -> str | None:
        try:
            t.close()
        except OSError as exc:
            msg = f"tier {t.name}: close failed: {exc.strerror or exc}"
            log.warning("%s; its index log may lack the last records (`kvstream verify --repair` rebuilds it)", msg)
            return msg
        return None

    def _close_tier_when_idle(self, t: DirectoryTier) -> None:
        # A writer thread blocked in create() on a frozen file system holds a copy that is still counted in
        # the backlog; closing the index (ftruncate) under it would block this thread instead, which is fine.
        while self._writer.backlog(t.position):
            time.sleep(0.05)
        t.write_ring.drain()
        t.read_ring.drain()
        self._close_tier(t)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosedError("store is closed")

    @property
    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    # -- queries --------------------------------------------------------------------------------------------
    def _usable(self, t: int, now: float | None = None) -> bool:
        return self.health[t].usable(time.monotonic() if now is None else now)

    def _holders(self, key: bytes, now: float) -> list[int]:
        return [t.position for t in self.tiers if t.contains(key) and self._usable(t.position, now)]

    def _holders_refreshed(self, key: bytes, now: float) -> list[int]:
        """:meth:`_holders`, looking again after a refresh of the tiers' indexes when none holds the key (another
        node may have published it since)."""
        hs = self._holders(key, now)
        if not hs:
            for t in self.tiers:
                t.maybe_refresh()
            hs = self._holders(key, now)
        return hs

    def contains(self, key: bytes) -> bool:
        """True if the chunk is in host memory or on a usable tier."""
        self._check_open()
        if key in self.memory:
            return True
        return bool(self._holders_refreshed(key, time.monotonic()))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of ``keys`` the store holds (memory or disk)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    def locate_prefix(self, keys: Sequence[bytes]) -> list[ChunkPlace]:
        """The leading held prefix of ``keys`` (as :meth:`lookup` counts it: ``len`` of the answer is
        ``lookup(keys)``) and where each of its chunks is: host memory, or the usable tiers that hold it.
        Answered from host memory and the tiers' indexes: no I/O (a folder a miss sends us to re-scan aside, as
        in :meth:`contains`). A snapshot: a chunk may be evicted or read into memory right after."""
        self._check_open()
        out: list[ChunkPlace] = []
        now = time.monotonic()
        for key in keys:
            if key in self.memory:
                out.append(ChunkPlace(memory=True))
                continue
            hs = self._holders_refreshed(key, now)
            if not hs:
                break
            sizes = [self.tiers[t].file_size(key) or 0 for t in hs]
            out.append(ChunkPlace(memory=False, tiers=tuple(hs), file_bytes=max(sizes)))
        return out

    def read_bandwidth(self, tier: int) -> float | None:
        """Tier ``tier``'s (a position) read bandwidth estimate in bytes per busy second: the read-window
        policy's running mean of what its reads delivered (0.0: a tier busy for a step without landing
        anything). None while it is not measured, or where the policy keeps none (``read_windows: fixed``)."""
        return self.read_windows.bandwidth_estimate(tier)

    # -- writes ---------------------------------------------------------------------------------------------
    def put(self, key: bytes, payload: Any, *, meta: ChunkMeta | None = None, position: int | None = None,
            tiers: Sequence[str] | None = None, access: AccessMeta | None = None) -> bool:
        """Buffer a chunk in host memory; it reaches the tiers at the next :meth:`flush`.

        ``payload`` is any C-contiguous buffer (bytes, numpy array, ...); ``meta`` (dtype, shape, layout) is kept
        in the chunk's header and handed back by :meth:`read_chunks`. ``position`` (chunk index within its
        prefix) helps partial replication place copies; ``tiers`` overrides the replication policy (and adds a
        replica to a named tier that lacks a chunk stored elsewhere); ``access`` (session, previous answer
        length...) goes to the host-memory eviction policy when the chunk becomes evictable (Bidaw's hit
        potential needs it). Returns False if the chunk was already
        stored, or had to be dropped because host memory was all dirty (counted in ``puts_dropped_no_memory``;
        the caller recomputes it later, nothing else is lost), or was refused because unstored puts (no tier
        took them: :meth:`drain`) fill half of host memory (``puts_dropped_unstored``).

        True is a promise: the chunk stays in host memory until a tier holds a copy (it is never evicted
        before), and :meth:`drain` says whether every acknowledged put has one.
        """
        self._check_open()
        if not isinstance(key, (bytes, bytearray)) or not 0 < len(key) <= 64:
            raise UsageError("chunk key must be 1..64 bytes")
        key = bytes(key)
        view, implied = _as_bytes_view(payload)
        meta = meta or implied or ChunkMeta(dtype="uint8", shape=(len(view),), fmt="raw")
        target = None
        if tiers is not None:
            names = self.tier_names
            unknown = [n for n in tiers if n not in names]
            if unknown:
                raise UsageError(f"put: unknown tier(s) {unknown}; tiers are {names}")
            target = frozenset(names.index(n) for n in tiers)
        # Already stored: in memory, on any tier, or (with ``tiers``) on every tier named (so a put naming a tier
        # that lacks the chunk adds that replica).
        held = [t.contains(key) for t in self.tiers]
        if key in self.memory or (all(held[t] for t in target) if target is not None else any(held)):
            self._counters.puts_duplicate += 1
            return False
        if self._writer.unstored()[1] >= self._writer.unstored_limit:
            # Half of host memory already holds puts no tier took (every tier failing): refuse this one now,
            # honestly, rather than acknowledge it and lose it, or wait for memory that will not come free.
            self._counters.puts_dropped_unstored += 1
            if self._counters.puts_dropped_unstored in (1, 100) or self._counters.puts_dropped_unstored % 10000 == 0:
                log.warning("put refused: %d B of host memory hold chunks no tier could take (every tier "
                            "failing?); they are written once a tier recovers", self._writer.unstored()[1])
            return False
        n = len(view)
        fsize = file_size(n)
        buf = self.memory.allocate(fsize)
        if buf is None:
            # Host memory is all dirty: push what is buffered and wait for the first buffer to come free (not
            # for every write: a slow tier's queue would stall the serving loop), then give up and drop.
            self.flush()
            buf = self._writer.wait_for_buffer(fsize, self.put_wait_s)
            if buf is None:
                self._counters.puts_dropped_no_memory += 1
                dropped = self._counters.puts_dropped_no_memory
                if dropped in (1, 10, 100) or dropped % 1000 == 0:  # a count, not one line per put (stats() has all)
                    log.warning("put dropped (%d so far): host memory (%d B) is full of unwritten chunks; the tiers "
                                "write slower than puts arrive (more memory_bytes, or faster tiers)", dropped,
                                self.config.memory_bytes)
                return False
        mv = buf.view()
        try:
            # numpy copies with the GIL released (a memoryview slice assignment holds it for the whole copy:
            # ~11 ms for 48 MiB here, long enough to make the reader's threads oversleep by as much).
            np.copyto(np.frombuffer(mv, dtype=np.uint8, count=n, offset=HEADER_BYTES),
                      np.frombuffer(view, dtype=np.uint8))
            mv[HEADER_BYTES + n : fsize] = bytes(fsize - HEADER_BYTES - n)  # no stale bytes reach storage
            write_header(mv, key=key, meta=meta, payload_len=n, payload_sum=payload_checksum(view),
                         created_ns=time.time_ns())
        except (ValueError, TypeError) as exc:
            del mv
            self.memory.release(buf)
            raise UsageError(f"put: {exc}") from None
        header = decode_header(mv[:HEADER_BYTES])
        del mv
        entry = MemEntry(key=key, buf=buf, header=header, position=position, access=access)
        self._remember_meta(header)
        with self._lock:
            if self.memory.insert(entry, dirty=True) is not entry:  # another thread put it first
                self._counters.puts_duplicate += 1
                return False
            self._writer.enqueue(entry, target, put=True)
            self._counters.puts += 1
            self._counters.put_bytes += n
            self._counters.put_file_bytes += fsize
        return True

    def flush(self) -> int:
        """Hand every buffered put to the tiers' writers (the step boundary). Returns copies handed over."""
        return self._writer.flush()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait (at most ``timeout`` s; None: no limit) until every copy handed over, by a flush on any thread,
        has been published or has failed. True if so *and* every acknowledged put has a copy on some tier.

        False, once the writes in flight have ended, while puts are *unstored*: every tier they target failed
        their copies or was out of routing (breakers open). Such a chunk is never lost silently: it stays in host
        memory, never evicted, owed to its tiers, and the catch-up writes it once a tier takes writes again
        (``stats().unstored_chunks``); :meth:`put` refuses new chunks while they fill half of host memory, and
        :meth:`close` reports those it could not write. ``drain`` does not wait for tiers to recover."""
        if not self._writer.drain(timeout):
            return False
        return self._writer.unstored()[0] == 0

    # -- reads ----------------------------------------------------------------------------------------------
    def get_many(self, keys: Sequence[bytes]) -> list[memoryview | None]:
        """Read a whole step; ``None`` where a chunk is nowhere (or could not be read intact)."""
        out: list[memoryview | None] = [None] * len(keys)
        for i, chunk in self.read_chunks(keys):
            if chunk is not None:
                out[i] = chunk.payload
        return out

    def read_iter(self, keys: Sequence[bytes]) -> Iterator[tuple[int, memoryview | None]]:
        """Yield ``(index, payload)`` as each chunk lands (memory hits first); misses last, as ``None``."""
        for i, chunk in self.read_chunks(keys):
            yield i, (chunk.payload if chunk is not None else None)

    def read_chunks(self, keys: Sequence[bytes], *, metas: Sequence[AccessMeta | None] | None = None,
                    compute: Callable[[list[bytes], list[list[int]]], ComputeRequest | None] | None = None,
                    background: bool = False) -> Iterator[tuple[int, Chunk | None]]:
        """Like :meth:`read_iter`, with each chunk's header metadata and source. Every index is yielded once.

        A payload is a read-only view that pins its buffer: it stays valid and unchanged for as long as the
        caller holds it, whatever other threads put, evict or read meanwhile.

        ``compute`` (a serving engine with a GPU, :mod:`kvstream.compute`): called once with the chunks the step
        must read from disk and their holders, it returns a :class:`ComputeRequest`: chunks to leave to the GPU
        (not read; yielded as ``None``) and the front of the step the GPU recomputes while the tiers read the back.
        A chunk the GPU recomputed is yielded as :data:`RECOMPUTED` (no payload).

        ``background``: the read is the store's own work (the catch-up of owed replicas), not a serving read:
        it is not counted among the steps background work yields to (:attr:`Reader.active_steps`)."""
        self._check_open()
        t_start = time.perf_counter()
        hits, disk_idx, holders, misses = self._plan_read(keys, metas)
        try:
            for i, e, view in hits:
                yield i, Chunk(key=keys[i], meta=e.header.meta, payload=view, source="memory")
        finally:
            hits.clear()  # drops the pins the caller did not take (it stopped early); its own views live on
        req = compute([keys[i] for i in disk_idx], holders) if compute is not None and disk_idx else None
        left: list[int] = []
        if req is not None and req.leave:
            keep = [p for p, i in enumerate(disk_idx) if keys[i] not in req.leave]
            left = [i for i in disk_idx if keys[i] in req.leave]
            disk_idx, holders = [disk_idx[p] for p in keep], [holders[p] for p in keep]
        disk_keys = [keys[i] for i in disk_idx]
        # A caller's plan is not trusted: a cost that is infinite, NaN or huge would hold the step for ever.
        plan = checked_plan(req.plan, len(disk_idx)) if req is not None else None

        def on_end(step: ReadStep) -> None:
            self._after_read(disk_keys, holders, step)
            if req is not None and req.on_step is not None:
                req.on_step(step)

        if disk_idx:
            for out in self._reader.run(disk_keys, holders, "chunks",
                                        metas=[metas[i] for i in disk_idx] if metas else None, on_end=on_end,
                                        compute=plan, background=background):
                i = disk_idx[out.j]
                if out.kind == "delivered":
                    assert out.header is not None and out.payload is not None
                    yield i, Chunk(key=keys[i], meta=out.header.meta, payload=out.payload, source=out.source)
                elif out.kind == "computed":
                    yield i, RECOMPUTED
                elif out.kind == "closed":  # the store closed under the call: a miss, not a lost chunk
                    misses.append(i)
                else:
                    self._counters.lost_chunks += 1
                    misses.append(i)
        for i in left:  # left to the GPU by the caller: not a miss of the store's
            yield i, None
        for i in misses:
            self._counters.misses += 1
            yield i, None
        self._counters.read_seconds += time.perf_counter() - t_start

    def _plan_read(self, keys: Sequence[bytes], metas: Sequence[AccessMeta | None] | None
                   ) -> tuple[list[tuple[int, MemEntry, memoryview]], list[int], list[list[int]], list[int]]:
        """Split a step's keys into memory hits (each pinned: a view made with the lookup, under the memory
        lock), chunks to read (with the usable tiers holding each) and misses."""
        now = time.monotonic()
        hits: list[tuple[int, MemEntry, memoryview]] = []
        disk_idx: list[int] = []
        holders: list[list[int]] = []
        misses: list[int] = []
        for i, key in enumerate(keys):
            got = self.memory.pin(key, meta=metas[i] if metas else None)
            if got is not None:
                self._counters.memory_hits += 1
                hits.append((i, got[0], got[1]))
                continue
            hs = self._holders_refreshed(key, now)
            if hs:
                disk_idx.append(i)
                holders.append(hs)
            else:
                misses.append(i)
        self._counters.get_chunks += len(keys)
        return hits, disk_idx, holders, misses

    def get_meta(self, keys: Sequence[bytes]) -> list[tuple[ChunkMeta, int] | None]:
        """Each chunk's ``(meta, payload_len)`` as its header says, or None where the store does not hold it
        (or its header cannot be read intact). What a caller needs to size the targets of :meth:`read_into`.

        Answered from host memory, from headers seen by this process (puts and reads), or else by reading the
        4 KiB headers through a read step like any other (hedged, failing over to the next holder)."""
        self._check_open()
        out: list[tuple[ChunkMeta, int] | None] = [None] * len(keys)
        now = time.monotonic()
        unknown: list[int] = []
        holders: list[list[int]] = []
        for i, key in enumerate(keys):
            e = self.memory.peek(key)
            if e is not None:
                out[i] = (e.header.meta, e.header.payload_len)
                continue
            hs = self._holders(key, now)
            if not hs:
                continue
            known = self._metas.get(key)
            if known is not None:
                out[i] = known
            else:
                unknown.append(i)
                holders.append(hs)
        if unknown:
            for got in self._reader.run([keys[i] for i in unknown], holders, "headers"):
                if got.kind == "delivered" and got.header is not None:
                    out[unknown[got.j]] = (got.header.meta, got.header.payload_len)
        return out

    def _read_back(self, key: bytes) -> None:
        """The catch-up's read-back: read ``key`` into host memory as the store's own work (not a serving step)."""
        for _i, _chunk in self.read_chunks([key], background=True):
            pass

    def _remember_meta(self, header: ChunkHeader) -> None:
        metas = self._metas
        if header.key in metas:
            return
        if len(metas) >= _META_CACHE_ENTRIES:
            try:
                metas.pop(next(iter(metas)))  # oldest first: a bounded cache, not a record
            except (KeyError, RuntimeError, StopIteration):  # another thread trimmed it at the same moment
                pass
        meta = self._meta_intern.setdefault(header.meta, header.meta) if len(self._meta_intern) < 4096 else header.meta
        metas[header.key] = (meta, header.payload_len)

    def read_into(self, keys: Sequence[bytes], targets: Sequence[Any], *,
                  on_target_free: Callable[[int], None] | None = None,
                  metas: Sequence[AccessMeta | None] | None = None) -> Iterator[tuple[int, ReadIntoResult]]:
        """Read a step straight into the caller's buffers: ``targets[i]`` (writable, C-contiguous) receives chunk
        ``i``'s payload. Yields ``(i, ReadIntoResult)`` once for every index, as each lands (memory hits
        first, misses last).

        A target whose address is 4 KiB-aligned and that holds the payload rounded up to 4 KiB (see
        :meth:`get_meta`) is read with O_DIRECT into place (no copy, no host-memory copy kept) when the
        fastest tier reads it; any other read goes through a pooled buffer and is copied in. The payload is
        verified in the target before it is reported. ``metas`` (session, previous answer length...) feed the
        host-memory eviction policy, as in :meth:`read_chunks`.

        Invariant: a read into a target cannot be taken back, so a target is reported only once no read into
        it is still in flight, and the generator ends only when none is: a second copy (a steal, or a hedged
        read of a stalled tier) never goes into a target another read is writing; if it wins, it is used
        only after that read is over (copied in if that read failed). The one exception: when everything else is
        done and a read into a target is stuck past ``hedge_after_s``, and ``on_target_free`` is given, that
        target is reported ``busy`` (not ok) and ``on_target_free(i)`` is called, on some store thread, once the
        stuck read is over; without the callback the call waits for it. The store keeps its own reference to a
        busy target until then, so the memory stays valid even if the caller drops its reference.
        """
        self._check_open()
        if len(targets) != len(keys):
            raise UsageError(f"read_into: {len(keys)} keys but {len(targets)} targets")
        if metas is not None and len(metas) != len(keys):
            raise UsageError(f"read_into: {len(keys)} keys but {len(metas)} metas")
        t_start = time.perf_counter()
        bufs = [CallerBuffer(t) for t in targets]
        busy: set[int] = set()
        hits: list[tuple[int, MemEntry, memoryview]] = []
        try:
            hits, disk_idx, holders, absent = self._plan_read(keys, metas)
            for i, e, view in hits:
                n = e.header.payload_len
                if n > bufs[i].capacity:
                    view.release()
                    yield i, ReadIntoResult(ok=False, reason="target_too_small")
                    continue
                bufs[i].view(0, n)[:] = view
                view.release()
                yield i, ReadIntoResult(ok=True, source="memory", nbytes=n, meta=e.header.meta)
            hits = []
            lost: list[int] = []
            if disk_idx:
                free = None if on_target_free is None else (lambda j: on_target_free(disk_idx[j]))
                for out in self._reader.run([keys[i] for i in disk_idx], holders, "into",
                                            targets=[bufs[i] for i in disk_idx], on_target_free=free,
                                            metas=[metas[i] for i in disk_idx] if metas else None,
                                            on_end=lambda step: self._after_read([keys[i] for i in disk_idx],
                                                                                 holders, step)):
                    i = disk_idx[out.j]
                    if out.kind == "delivered":
                        assert out.header is not None
                        yield i, ReadIntoResult(ok=True, source=out.source, nbytes=out.header.payload_len,
                                                meta=out.header.meta)
                    elif out.kind == "too_small":
                        yield i, ReadIntoResult(ok=False, reason="target_too_small")
                    elif out.kind == "busy":
                        busy.add(i)
                        yield i, ReadIntoResult(ok=False, busy=True, reason="stalled")
                    elif out.kind == "closed":  # the store closed under the call
                        self._counters.misses += 1
                        yield i, ReadIntoResult(ok=False, reason="closed")
                    else:
                        self._counters.lost_chunks += 1
                        lost.append(i)
            for reason, idx in (("unreadable", lost), ("absent", absent)):
                for i in idx:
                    self._counters.misses += 1
                    yield i, ReadIntoResult(ok=False, reason=reason)
        finally:
            for _, _, view in hits:
                view.release()
            for i, b in enumerate(bufs):
                if i not in busy:  # a busy target is released by its stuck read when it ends
                    b.release()
            self._counters.read_seconds += time.perf_counter() - t_start

    def _after_read(self, keys: list[bytes], holders: list[list[int]], step: ReadStep) -> None:
        """A step is over: its tiers' bytes and busy time feed the read windows and the replication policy."""
        tier_bytes, busy = step.tier_bytes, step.busy_s
        for t in range(len(self.tiers)):
            self.read_windows.observe(t, tier_bytes[t], busy[t])
        self._counters.read_steps += 1
        orders: list[CopyOrder] = self.replication.on_read(ReadObservation(
            now=time.monotonic(), keys=keys, holders=holders, tier_bytes=tier_bytes, tier_busy_s=busy))
        if not orders:
            return
        by_key: dict[bytes, set[int]] = {}
        ordered = False
        for o in orders:
            by_key.setdefault(o.key, set()).add(o.tier)
        with self._lock:
            for key, ts in by_key.items():
                e = self.memory.get(key)
                if e is None:
                    # Not kept in host memory (an overflow buffer, or read straight into the caller's buffer, as
                    # the LMCache plugin does). A copy to the primary is owed: the catch-up reads it back from its
                    # holder off the serving path. Other copies wait for the next reuse.
                    if 0 in ts:
                        self.owed.owe(self.tiers[0].name, key)
                    continue
                self.memory.mark_dirty(e)
                self._writer.enqueue(e, frozenset(ts))
                self._counters.copies_ordered += len(ts)
                ordered = True
        if ordered:
            self.flush()  # a node that only reads (a peer's prefixes) may never put: hand the copies over now

    # -- pins -----------------------------------------------------------------------------------------------
    def pin(self, key: bytes) -> bool:
        """Keep ``key`` out of every tier's eviction until as many :meth:`unpin` calls (LMCache's contract:
        :mod:`kvstream.tiers.pins`). False, and nothing pinned, if the store does not hold the chunk. While
        pinned chunks fill a tier, a copy that could only be written by evicting them is refused (counted in
        ``write_refused_pinned``; the chunk stays in host memory, and a later put may try again)."""
        self._check_open()
        if not self.contains(key):
            return False
        self.pins.add(key)
        if any([t.hold(key) for t in self.tiers]):  # every tier: each keeps its copy
            return True
        entry = self.memory.peek(key)
        if entry is not None and entry.dirty:
            return True  # its copies are being written: each tier holds it as it lands (pinned by then)
        # No tier holds it safe: not on any (host memory only), or its eviction was decided before the pin.
        if self.pins.remove(key) == 0:
            for t in self.tiers:
                t.release(key)
        return False

    def unpin(self, key: bytes) -> bool:
        """Take one pin off ``key``; False if it had none. At zero the chunk may be evicted again."""
        self._check_open()
        n = self.pins.remove(key)
        if n is None:
            return False
        if n == 0:
            for t in self.tiers:
                t.release(key)
        return True

    # -- administration -------------------------------------------------------------------------------------
    def remove(self, key: bytes) -> bool:
        """Delete a chunk from memory and every tier. Returns True if it was anywhere.

        A put not yet flushed is cancelled, and a write already in flight is unpublished when it lands
        (``MemEntry.removed``), so a removed key never reappears after :meth:`drain`."""
        self._check_open()
        self.pins.clear(key)  # a remove is forced (LMCache's remove(force=True)): its pins go with it
        with self._lock:
            self.removals.record(key)
            entry = self.memory.peek(key)
            found = entry is not None
            if entry is not None:
                entry.removed = True  # before the tier drops below: see _finish_write's re-check
            cancelled = self._writer.cancel(key)
            self.memory.discard(key)
            self._metas.pop(key, None)
            for e in cancelled:
                self.memory.mark_clean(e)  # the put's own dirty mark, never taken by flush()
            for t in self.tiers:
                self.owed.paid(t.name, key)  # nothing is owed for a removed chunk (catch-up must not copy it)
            self._writer.release_hold(key)  # an unstored put that is removed is not kept for its copies
        for t in self.tiers:
            if t.contains(key):
                found = True
                t.drop(key)
        return found

    def evict_memory(self) -> int:
        """Drop every clean chunk from host memory (buffers stay in the pool for reuse); returns chunks dropped.
        Benchmarks use it so a repeat reads from disk again; chunks not yet written stay."""
        with self._lock:
            return self.memory.evict_clean()

    def prefault_memory(self, chunk_bytes: int) -> int:
        """Map and touch all of host memory (``memory_bytes`` and ``read_overflow_bytes``) now, in buffers for
        chunks of ``chunk_bytes`` payload bytes, as an engine that pins its host buffers at start does (LMCache
        allocates its CPU buffer up front); call it before the store is in use. The first large loads then reuse
        resident memory instead of the kernel faulting and zeroing fresh pages on the read path (on the project
        VM a 2.5 GB load that touched 1.4 GB of fresh memory read the local disk at 0.8-1.0 GB/s against ~2 GB/s:
        BENCHMARKS §3.2). Costs that much resident memory from now on; returns the bytes made resident."""
        from kvstream.format import file_size

        self._check_open()
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        return self.memory.prefault(file_size(chunk_bytes))

    def write_busy_seconds(self) -> dict[str, float]:
        """Per tier, seconds it has had copies handed to its writer and not finished, the stretch still open
        included (``TierStats.write_busy_s`` without building the whole snapshot)."""
        return {t.name: self._writer.write_busy_s(t.position) for t in self.tiers}

    def stats(self) -> StoreStats:
        """A snapshot of the counters for operators and benchmarks (:mod:`kvstream.stats`; ``.as_dict()`` for
        JSON); ``write_amplification`` = bytes written / bytes put."""
        tiers: dict[str, TierStats] = {}
        written = 0
        owed = self.owed.counts()
        for t in self.tiers:
            c = t.counters
            written += c.write_bytes
            r50, r99 = percentiles(list(c.latencies))
            w50, w99 = percentiles(self._writer.write_latencies(t.position))
            bw = self.read_windows.bandwidth_estimate(t.position)
            write_busy = self._writer.write_busy_s(t.position)
            breaker = self.health[t.position]
            tiers[t.name] = TierStats(
                path=str(t.root), direct_io=t.direct, chunks=len(t.index), used_bytes=t.used_bytes,
                capacity_bytes=t.cfg.capacity_bytes, read_bytes=c.read_bytes, read_chunks=c.read_chunks,
                read_busy_s=c.read_busy_s, read_window_bytes=self.read_windows.window(t.position),
                read_gbps_estimate=bw / 1e9 if bw else None,
                read_gbps=c.read_bytes / c.read_busy_s / 1e9 if c.read_busy_s else 0.0,
                duplicate_chunks=c.duplicate_chunks, read_errors=c.read_errors, corrupt_chunks=c.corrupt_chunks,
                missing_files=c.missing_files, write_bytes=c.write_bytes, write_busy_s=write_busy,
                write_gbps=c.write_bytes / write_busy / 1e9 if write_busy else 0.0,
                write_chunks=c.write_chunks,
                write_errors=c.write_errors, write_skipped_full=c.write_skipped_full,
                write_skipped_unhealthy=c.write_skipped_unhealthy, write_skipped_backlog=c.write_skipped_backlog,
                write_backlog_bytes=self._writer.backlog(t.position), already_present=c.already_present,
                write_retried_nospace=c.write_retried_nospace, write_retried_stale=c.write_retried_stale,
                evicted_chunks=c.evicted_chunks, evicted_bytes=c.evicted_bytes,
                read_latency_p50_s=r50, read_latency_p99_s=r99, write_latency_p50_s=w50, write_latency_p99_s=w99,
                circuit=breaker.state, circuit_opened=breaker.opened, index_load_s=t.index.load_seconds,
                removed_temporaries=t.removed_temporaries, replicas_owed=owed.get(t.name, 0),
                read_retried=c.read_retried, read_transient=c.read_transient,
                write_refused_pinned=c.write_refused_pinned, pinned_chunks=t.pinned_count(),
                index_damaged_records=t.index.damaged_records, down=t.down,
                publish_conflicts=c.publish_conflicts, orphans_listed=c.orphans_listed,
            )
        counts = self._counters.snapshot()  # a copy: other threads keep counting
        rc = self._reader.counters.snapshot()
        wc = self._writer.counters.snapshot()
        cc = self._catch_up.counters.snapshot()
        unstored = self._writer.unstored()
        mem = self.memory
        return StoreStats(
            io_engine=self.engine.name, router=self.config.router, replication=self.config.replication,
            puts=counts.puts, put_bytes=counts.put_bytes, put_file_bytes=counts.put_file_bytes,
            puts_duplicate=counts.puts_duplicate, puts_dropped_no_memory=counts.puts_dropped_no_memory,
            get_chunks=counts.get_chunks, memory_hits=counts.memory_hits, disk_hits=rc.disk_hits,
            misses=counts.misses, lost_chunks=counts.lost_chunks, read_steps=counts.read_steps,
            read_seconds=float(counts.read_seconds), verify_seconds=float(rc.verify_seconds),
            hedged_reads=rc.hedged_reads, copies_ordered=counts.copies_ordered, flushes=wc.flushes,
            stalled_reads=rc.stalled_reads, read_into_direct=rc.read_into_direct,
            read_into_copied=rc.read_into_copied, read_into_abandoned=rc.read_into_abandoned,
            puts_dropped_unstored=counts.puts_dropped_unstored, unstored_chunks=unstored[0],
            unstored_bytes=unstored[1],
            write_amplification=written / counts.put_file_bytes if counts.put_file_bytes else 0.0,
            catch_up_copies=cc.copies_started, catch_up_reads=cc.reads,
            catch_up_reads_deferred=self._catch_up.reads_deferred,
            catch_up_reads_waited=self._catch_up.policy.reads_waited,
            catch_up_reads_wasted=self._catch_up.policy.read_backs_wasted,
            catch_up_gave_up=self._catch_up.policy.gave_up,
            owed_journal_compactions=self.owed.compactions,
            memory=MemoryStats(capacity_bytes=mem.capacity_bytes, used_bytes=mem.used_bytes(), chunks=len(mem),
                               hits=mem.hits, evictions=mem.evictions, overflow_buffers=mem.overflow_buffers,
                               overflow_kept_bytes=mem.overflow_pool.allocated_bytes if mem.overflow_pool else 0,
                               overflow_reuses=mem.overflow_pool.reuses if mem.overflow_pool else 0,
                               buffer_allocations=mem.pool.allocations, buffer_reuses=mem.pool.reuses),
            tiers=tiers,
        )

    def check_replicas(self, *, repair: bool = False, timeout_s: float = 300.0) -> ReplicaReport:
        """What ``kvstream verify --config`` reports: the copies owed and, with full replication, the deficits a
        scan of the indexes finds; ``repair`` has the catch-up pay them (:func:`kvstream.replica_debt.check_replicas`)."""
        return check_replicas(tiers=self.tiers, owed=self.owed, catch_up=self._catch_up, drain=self.drain,
                              full=isinstance(self.replication, FullReplication),  # the parsed policy
                              repair=repair, timeout_s=timeout_s)

    def observe_writes(self, listener: Callable[[str, float], None] | None) -> None:
        """Call ``listener(tier_name, seconds)`` after each copy is published, with its write latency (hand-over
        to the tier's writer thread to publish); on the publisher thread, so it must be quick. None removes it.
        The same latencies' percentiles are in :meth:`stats` (``write_latency_p50_s``, ``..._p99_s``)."""
        self._writer.observe(listener)

def open_store(config: "StoreConfig | dict[str, Any] | str | os.PathLike[str]", *,
               engine: IOEngine | None = None) -> Store:
    """Open (or create) a store. ``config``: a :class:`StoreConfig`, a dict of the same fields, or a YAML path.

    Raises :class:`kvstream.errors.ConfigError` naming the field for any bad value, missing or unwritable folder.
    """
    return Store(StoreConfig.from_any(config), engine=engine)
