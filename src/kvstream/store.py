"""The engine: a host-memory tier over replicated directory tiers, read meet-in-the-middle, written deferred.

Public API (stable): :func:`open_store`, and on :class:`Store`: ``put``, ``flush``, ``contains``, ``lookup``,
``get_many``, ``read_iter``, ``read_chunks``, ``stats``, ``drain``, ``close`` (and ``with``).

Read path (``read_chunks``): memory hits are handed out at once; the rest form one read plan for the whole step.
The router (sans-I/O, :mod:`kvstream.routing`) decides which tier reads which chunk as reads complete; this
module only keeps each tier's read ring filled up to its in-flight byte budget, verifies what lands (header,
key, checksum) and hands each chunk to the caller as soon as it is verified. A chunk that fails verification
or I/O is quarantined (corrupt) or counted (I/O error) and read from another replica if there is one, else
reported as a miss: wrong bytes are never returned. Reads stuck past ``hedge_after_s`` are re-issued on
another replica; a tier that keeps failing is taken out of routing by its circuit breaker and probed back.

Write path: ``put`` copies the payload into a pooled, aligned buffer that becomes a dirty host-memory entry
(hits on it are served at once); ``flush`` — called at the step boundary, once the next forward pass has
started — asks the replication policy which tiers get a copy and submits the writes to those tiers' write
rings, separate from the read rings. A write is published atomically (temporary file, then link); the entry
becomes evictable once every copy is written or has failed. A copy that cannot be written (disk full after
eviction, EIO) is skipped and counted, never retried forever, and never blocks the caller.

Threading: any thread may call the API. Metadata is guarded by ``_lock``; waits on I/O hold no lock. A read's
completion callback, on its ring's thread, claims and submits that tier's next reads itself (so the device
never waits for the caller's thread to come round) and hands the landed read over to the step's queue; the
caller's thread verifies, routes and yields. Write completions are handed to the publisher thread, so a slow
publish never delays the reaping of reads.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstream.config import StoreConfig
from kvstream.errors import CorruptChunkError, StoreClosedError, TierError, UsageError
from kvstream.eviction import AccessMeta
from kvstream.format import (
    HEADER_BYTES,
    ChunkHeader,
    ChunkMeta,
    decode_header,
    file_size,
    payload_checksum,
    verify_payload,
    write_header,
)
from kvstream.health import CircuitBreaker
from kvstream.io.buffers import AlignedBuffer, CallerBuffer
from kvstream.io.engine import IOEngine, IOOp, OpKind, make_engine
from kvstream.replication import CopyOrder, ReadObservation, WriteIntent, parse_replication
from kvstream.read_windows import make_read_windows
from kvstream.routing import ReadSchedule, parse_router
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.memory import HostMemoryTier, MemEntry

__all__ = ["Store", "Chunk", "ReadIntoResult", "open_store"]

# Files a read step may hold open ahead of its reads (see _read_from_disk's open_ahead), all tiers together.
_MAX_OPENED_AHEAD = 256
log = logging.getLogger("kvstream.store")

_ENOENT, _ENOSPC, _EDQUOT = 2, 28, 122
_ENFILE, _EMFILE = 23, 24  # this process (or the system) is out of file descriptors: not the tier's fault
_META_CACHE_ENTRIES = 1 << 18  # get_meta's cache of headers seen (~40 MB at most)


@dataclass(frozen=True, slots=True)
class Chunk:
    """A chunk handed to a caller: its verified payload (read-only) and what its header says."""

    key: bytes
    meta: ChunkMeta
    payload: memoryview
    source: str  # "memory" or the tier name it was read from


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
    reason: str = ""  # why not ok: absent, unreadable, target_too_small, stalled


@dataclass(eq=False, slots=True)
class _ReadTag:
    """One read of one chunk file on one tier: a single op into ``buf`` (a pooled or overflow buffer holding
    the whole file), or, when ``target`` is set, a *direct* read: the header into ``buf`` (4 KiB) and the
    payload straight into the caller's buffer, two ops on one descriptor that complete as one."""

    tier: int
    idx: int  # position in the schedule's list
    key: bytes
    buf: AlignedBuffer
    pooled: bool
    started: float
    fd: int = -1
    size: int = 0  # file size (bytes in flight for this read)
    parts: int = 1  # ops not completed yet
    result: int = 0  # bytes read over all parts, or the first -errno
    latency: float = 0.0
    target: CallerBuffer | None = None
    on_free: Callable[[], None] | None = None  # run once the read is over, if it was abandoned (stalled)
    unread: bool = False  # counted in its step's bytes landed and not yet taken by the caller


class _Step:
    """One read call's completion queue; late completions (duplicates, after the caller is done) clean up
    after themselves instead of landing in a queue nobody reads. Items are read tags whose every part is done.

    ``on_read_over(tag)``, if set, runs on the ring thread when a read's last part completes, before the tag is
    queued: the read loop uses it to refill that tier's ring at once (see ``Store._read_from_disk``)."""

    def __init__(self, store: "Store") -> None:
        self.q: queue.SimpleQueue[_ReadTag] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.done = False
        self.store = store
        self.on_read_over: Callable[[_ReadTag], None] | None = None

    def on_complete(self, op: IOOp) -> None:
        tag: _ReadTag = op.tag
        with self.lock:
            tag.parts -= 1
            if tag.result >= 0:
                tag.result = op.result if op.result < 0 else tag.result + op.result
            tag.latency = max(tag.latency, op.completed_at - op.submitted_at)
            if tag.parts:
                return
            hook = None if self.done else self.on_read_over
        if hook is not None:  # outside self.lock: it submits reads, and finish() must not wait for that
            try:
                hook(tag)
            except Exception:  # a ring thread must survive; the read loop refills again when it takes the tag
                log.exception("read: refill from a completion failed")
        with self.lock:
            if not self.done:
                self.q.put(tag)
                return
        self.store._discard_read(tag)

    def abandon(self, tag: _ReadTag, on_free: Callable[[], None]) -> bool:
        """Hand a read still in flight to ``on_free``-on-completion; False if it has completed meanwhile."""
        with self.lock:
            if tag.parts == 0:
                return False
            tag.on_free = on_free
            return True

    def wait_over(self, tag: _ReadTag) -> None:
        """Block until every part of ``tag`` has completed (its completion is then in the queue)."""
        pause = 0.0002
        while True:
            with self.lock:
                if tag.parts == 0:
                    return
            time.sleep(pause)
            pause = min(2 * pause, 0.01)

    def finish(self) -> None:
        with self.lock:
            self.done = True
        while True:
            try:
                tag = self.q.get_nowait()
            except queue.Empty:
                return
            self.store._discard_read(tag)


@dataclass(eq=False, slots=True)
class _PendingWrite:
    entry: MemEntry
    tiers: frozenset[int] | None  # None: ask the replication policy at flush


def _as_bytes_view(payload: Any) -> tuple[memoryview, ChunkMeta | None]:
    """A flat byte view of any buffer-protocol payload, and the metadata it implies (numpy arrays)."""
    meta = None
    dtype = getattr(payload, "dtype", None)
    shape = getattr(payload, "shape", None)
    if dtype is not None and shape is not None and hasattr(payload, "__array_interface__"):
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
        # ``engine`` lets tests and fault drills wrap the real engine (kvstream.io.faults); normally from config.
        self.engine = engine if engine is not None else make_engine(config.io_engine)
        self.tiers: list[DirectoryTier] = []
        try:
            for i, tcfg in enumerate(config.tiers):
                self.tiers.append(DirectoryTier(tcfg, index=i, engine=self.engine, node_id=config.node_id,
                                                create=config.create_dirs, field_prefix=f"tiers[{i}]"))
        except BaseException:
            for t in self.tiers:
                t.close()
            raise
        names = [t.name for t in self.tiers]
        self.router = parse_router(config.router, names)
        self.replication = parse_replication(config.replication)
        self.memory = HostMemoryTier(config.memory_bytes, config.memory_eviction)
        self.health = [CircuitBreaker() for _ in self.tiers]
        # Smallest window a tier may shrink to: one chunk of the configured size (the read loop always keeps
        # one read in flight regardless).
        self.read_windows = make_read_windows(config.read_windows, [t.cfg.read_inflight_bytes for t in self.tiers],
                                              min_bytes=config.chunk_bytes or 0)
        self._lock = threading.RLock()
        # Reads still in flight when their step ended (the other replica won, or the tier is stalled), per tier:
        # id(tag) -> [started, counted]. A tier whose leftovers stay out past hedge_after_s is failing even if
        # no step ever waited on it (windows and stealing hide a stall from the step itself).
        self._stragglers: list[dict[int, list[Any]]] = [{} for _ in self.tiers]
        self._straggler_lock = threading.Lock()
        self._pending: list[_PendingWrite] = []
        self._writes_inflight = 0
        self._write_backlog = [0] * len(self.tiers)  # bytes submitted to each tier's write ring, not finished
        self._backlog_limit = [t.cfg.write_backlog_bytes if t.cfg.write_backlog_bytes is not None
                               else config.memory_bytes // 2 for t in self.tiers]
        self.put_wait_s = 1.0  # longest a put waits for host memory held by unwritten chunks before dropping
        self._writes_cv = threading.Condition(threading.Lock())
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-publish")
        self._closed = False
        self._c: dict[str, float] = {
            "puts": 0, "put_bytes": 0, "put_file_bytes": 0, "puts_duplicate": 0, "puts_dropped_no_memory": 0,
            "get_chunks": 0, "memory_hits": 0, "disk_hits": 0, "misses": 0, "lost_chunks": 0,
            "read_steps": 0, "read_seconds": 0.0, "verify_seconds": 0.0, "hedged_reads": 0,
            "copies_ordered": 0, "flushes": 0, "stalled_reads": 0,
            "read_into_direct": 0, "read_into_copied": 0, "read_into_abandoned": 0,
        }
        # Headers seen by this process (puts, reads), for get_meta without a disk read: bounded, oldest dropped.
        self._metas: dict[bytes, tuple[ChunkMeta, int]] = {}
        self._meta_intern: dict[ChunkMeta, ChunkMeta] = {}  # one ChunkMeta object per distinct shape

    # -- lifecycle ------------------------------------------------------------------------------------------
    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush buffered puts, wait for every write to finish, release rings and index logs. Idempotent."""
        if self._closed:
            return
        self.flush()
        self.drain()
        self._closed = True
        self._publisher.shutdown(wait=True)
        for t in self.tiers:
            t.close()

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

    def contains(self, key: bytes) -> bool:
        """True if the chunk is in host memory or on a usable tier."""
        self._check_open()
        if key in self.memory:
            return True
        now = time.monotonic()
        if self._holders(key, now):
            return True
        for t in self.tiers:
            t.maybe_refresh()
        return bool(self._holders(key, now))

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the prefix of ``keys`` the store holds (memory or disk)."""
        n = 0
        for k in keys:
            if not self.contains(k):
                break
            n += 1
        return n

    # -- writes ---------------------------------------------------------------------------------------------
    def put(self, key: bytes, payload: Any, *, meta: ChunkMeta | None = None, position: int | None = None,
            tiers: Sequence[str] | None = None) -> bool:
        """Buffer a chunk in host memory; it reaches the tiers at the next :meth:`flush`.

        ``payload`` is any C-contiguous buffer (bytes, numpy array, ...); ``meta`` (dtype, shape, layout) is kept
        in the chunk's header and handed back by :meth:`read_chunks`. ``position`` (chunk index within its
        prefix) helps partial replication place copies; ``tiers`` overrides the replication policy (and adds a
        replica to a named tier that lacks a chunk stored elsewhere). Returns False if the chunk was already
        stored, or had to be dropped because host memory was all dirty (counted in ``puts_dropped_no_memory``;
        the caller recomputes it later, nothing else is lost).
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
            self._c["puts_duplicate"] += 1
            return False
        n = len(view)
        fsize = file_size(n)
        buf = self.memory.allocate(fsize)
        if buf is None:
            # Host memory is all dirty: push what is buffered and wait for the first buffer to come free (not
            # for every write: a slow tier's queue would stall the serving loop), then give up and drop.
            self.flush()
            got: list[AlignedBuffer] = []

            def freed() -> bool:
                b = self.memory.allocate(fsize)
                if b is not None:
                    got.append(b)
                return b is not None

            with self._writes_cv:
                self._writes_cv.wait_for(freed, timeout=self.put_wait_s)
            buf = got[0] if got else None
            if buf is None:
                self._c["puts_dropped_no_memory"] += 1
                log.warning("put dropped: host memory (%d B) is full of unwritten chunks", self.config.memory_bytes)
                return False
        mv = buf.view()
        try:
            mv[HEADER_BYTES : HEADER_BYTES + n] = view
            mv[HEADER_BYTES + n : fsize] = bytes(fsize - HEADER_BYTES - n)  # no stale bytes reach storage
            write_header(mv, key=key, meta=meta, payload_len=n, payload_sum=payload_checksum(view),
                         created_ns=time.time_ns())
        except (ValueError, TypeError) as exc:
            del mv
            self.memory.release(buf)
            raise UsageError(f"put: {exc}") from None
        header = decode_header(mv[:HEADER_BYTES])
        del mv
        entry = MemEntry(key=key, buf=buf, header=header, position=position)
        self._remember_meta(header)
        with self._lock:
            if self.memory.insert(entry, dirty=True) is not entry:  # another thread put it first
                self._c["puts_duplicate"] += 1
                return False
            self._pending.append(_PendingWrite(entry=entry, tiers=target))
            self._c["puts"] += 1
            self._c["put_bytes"] += n
            self._c["put_file_bytes"] += fsize
        return True

    def flush(self) -> int:
        """Hand every buffered put to the write rings (the step boundary). Returns writes submitted."""
        with self._lock:
            pending, self._pending = self._pending, []
            self._c["flushes"] += 1
        now = time.monotonic()
        submitted = 0
        for pw in pending:
            entry = pw.entry
            if entry.removed:
                self.memory.mark_clean(entry)
                continue
            targets = pw.tiers
            if targets is None:
                targets = self.replication.targets(
                    WriteIntent(key=entry.key, nbytes=entry.header.payload_len, position=entry.position),
                    len(self.tiers))
            copies = sum(1 for t in self.tiers if t.contains(entry.key))
            for t in sorted(targets):  # tier order: the first (fastest) tier takes the copy that is never skipped
                tier = self.tiers[t]
                if tier.contains(entry.key):
                    continue
                if not self._usable(t, now):
                    tier.counters.write_skipped_unhealthy += 1
                    continue
                if copies and self._write_backlog[t] >= self._backlog_limit[t]:
                    tier.counters.write_skipped_backlog += 1
                    continue
                if self._submit_write(tier, entry):
                    submitted += 1
                    copies += 1
            self.memory.mark_clean(entry)  # the put's own dirty mark; per-write marks were added above
        return submitted

    def _submit_write(self, tier: DirectoryTier, entry: MemEntry, attempt: int = 0) -> bool:
        fsize = entry.file_size
        if not tier.reserve(fsize):
            tier.counters.write_skipped_full += 1
            return False
        try:
            fd, tmp = tier.create_temp(entry.key)
        except OSError as exc:
            tier.unreserve(fsize)
            self._write_failed(tier, -(exc.errno or 5))
            return False
        self.memory.mark_dirty(entry)
        with self._writes_cv:
            self._writes_inflight += 1
            self._write_backlog[tier.position] += fsize
        op = IOOp(kind=OpKind.WRITE, fd=fd, buf=entry.buf, length=fsize, offset=0,
                  callback=self._on_write_done, tag=(tier, entry, tmp, attempt))
        try:
            tier.write_ring.submit([op])
        except StoreClosedError:
            os.close(fd)
            self._finish_write(tier, entry, tmp, fsize, ok=False, err=-5)
            return False
        return True

    def _on_write_done(self, op: IOOp) -> None:
        # Ring thread: hand the slow part (fsync, link, index append) to the publisher.
        try:
            self._publisher.submit(self._publish, op)
        except RuntimeError:  # publisher shut down (closing): publish inline
            self._publish(op)

    def _publish(self, op: IOOp) -> None:
        tier, entry, tmp, attempt = op.tag
        fsize = op.length
        ok = op.result == fsize
        err = op.result if op.result < 0 else -5
        try:
            if ok and tier.cfg.fsync:
                os.fsync(op.fd)
        except OSError as exc:
            ok, err = False, -(exc.errno or 5)
        finally:
            os.close(op.fd)
        self._finish_write(tier, entry, tmp, fsize, ok=ok, err=err, attempt=attempt)

    def _finish_write(self, tier: DirectoryTier, entry: MemEntry, tmp: str, fsize: int, *, ok: bool, err: int,
                      attempt: int = 0) -> None:
        try:
            if ok and entry.removed:  # removed while in flight: not a failure, just don't publish
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                tier.unreserve(fsize)
                return
            if ok:
                try:
                    tier.publish(entry.key, tmp, fsize)
                    tier.counters.write_bytes += fsize
                    tier.counters.write_chunks += 1
                    self.health[tier.position].on_success()
                except OSError as exc:
                    ok, err = False, -(exc.errno or 5)
                if ok and entry.removed:  # remove() raced with the publish above; its tier drop may have missed it
                    tier.drop(entry.key)
            if not ok:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                tier.unreserve(fsize)
                # Disk fuller than our share says (other users): evict this tier's own chunks and retry once,
                # asynchronously (the entry stays dirty until the retry is done); else skip the copy, counted.
                if -err in (_ENOSPC, _EDQUOT) and attempt == 0 and not self._closed and tier.make_room(fsize):
                    tier.counters.write_retried_nospace += 1
                    self._submit_write(tier, entry, attempt=1)  # a second failure is counted there
                else:
                    self._write_failed(tier, err)
        finally:
            self.memory.mark_clean(entry)
            with self._writes_cv:
                self._writes_inflight -= 1
                self._write_backlog[tier.position] -= fsize
                self._writes_cv.notify_all()

    def _write_failed(self, tier: DirectoryTier, err: int) -> None:
        if -err in (_ENOSPC, _EDQUOT):
            tier.counters.write_skipped_full += 1
            # The file system is fuller than our capacity says (other users): shrink our share a little.
            tier.reserve(0)
        else:
            tier.counters.write_errors += 1
            if -err not in (_EMFILE, _ENFILE):
                self.health[tier.position].on_failure(time.monotonic())
        log.warning("tier %s: write failed (%s); copy skipped", tier.name, os.strerror(-err) if err < 0 else err)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted write has been published or has failed."""
        with self._writes_cv:
            return self._writes_cv.wait_for(lambda: self._writes_inflight == 0, timeout)

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

    def read_chunks(self, keys: Sequence[bytes], *, metas: Sequence[AccessMeta | None] | None = None
                    ) -> Iterator[tuple[int, Chunk | None]]:
        """Like :meth:`read_iter`, with each chunk's header metadata and source. Every index is yielded once."""
        self._check_open()
        t_start = time.perf_counter()
        hits, disk_idx, holders, misses = self._plan_read(keys, metas)
        for i, e in hits:
            yield i, Chunk(key=keys[i], meta=e.header.meta, payload=e.payload(), source="memory")
        if disk_idx:
            yield from self._read_from_disk(keys, disk_idx, holders, misses, metas)
        for i in misses:
            self._c["misses"] += 1
            yield i, None
        self._c["read_seconds"] += time.perf_counter() - t_start

    def _plan_read(self, keys: Sequence[bytes], metas: Sequence[AccessMeta | None] | None
                   ) -> tuple[list[tuple[int, MemEntry]], list[int], list[list[int]], list[int]]:
        """Split a step's keys into memory hits, chunks to read (with the usable tiers holding each) and misses."""
        now = time.monotonic()
        hits: list[tuple[int, MemEntry]] = []
        disk_idx: list[int] = []
        holders: list[list[int]] = []
        misses: list[int] = []
        for i, key in enumerate(keys):
            e = self.memory.get(key, meta=metas[i] if metas else None)
            if e is not None:
                self._c["memory_hits"] += 1
                hits.append((i, e))
                continue
            hs = self._holders(key, now)
            if not hs:
                for t in self.tiers:
                    t.maybe_refresh()
                hs = self._holders(key, now)
            if hs:
                disk_idx.append(i)
                holders.append(hs)
            else:
                misses.append(i)
        self._c["get_chunks"] += len(keys)
        return hits, disk_idx, holders, misses

    def get_meta(self, keys: Sequence[bytes]) -> list[tuple[ChunkMeta, int] | None]:
        """Each chunk's ``(meta, payload_len)`` as its header says, or None where the store does not hold it
        (or its header cannot be read intact). What a caller needs to size the targets of :meth:`read_into`.

        Answered from host memory, from headers seen by this process (puts and reads), or else by reading the
        4 KiB headers from a tier that holds them (once per chunk after a restart)."""
        self._check_open()
        out: list[tuple[ChunkMeta, int] | None] = [None] * len(keys)
        now = time.monotonic()
        unknown: list[tuple[int, list[int]]] = []
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
                unknown.append((i, hs))
        if unknown:
            self._read_headers(keys, unknown, out)
        return out

    def _remember_meta(self, header: ChunkHeader) -> None:
        metas = self._metas
        if len(metas) >= _META_CACHE_ENTRIES:
            try:
                metas.pop(next(iter(metas)))  # oldest first: a bounded cache, not a record
            except (KeyError, RuntimeError, StopIteration):  # another thread trimmed it at the same moment
                pass
        meta = self._meta_intern.setdefault(header.meta, header.meta) if len(self._meta_intern) < 4096 else header.meta
        metas[header.key] = (meta, header.payload_len)

    def _read_headers(self, keys: Sequence[bytes], unknown: list[tuple[int, list[int]]],
                      out: list[tuple[ChunkMeta, int] | None]) -> None:
        """Read the headers of ``unknown`` chunks: one 4 KiB read each, all at once, on the first usable holder;
        a header that fails (or, with hedging on, takes longer than ``hedge_after_s``) is tried on the next."""
        pending = [(i, list(hs)) for i, hs in unknown]
        wait = self.config.hedge_after_s
        while pending:
            done: queue.SimpleQueue[IOOp] = queue.SimpleQueue()
            lock = threading.Lock()
            over = [False]

            def on_done(op: IOOp, done: queue.SimpleQueue[IOOp] = done, lock: threading.Lock = lock,
                        over: list[bool] = over) -> None:
                with lock:
                    if not over[0]:
                        done.put(op)
                        return
                os.close(op.fd)  # a late header read nobody waits for any more
                self.memory.release(op.buf, op.tag[2])

            submitted: dict[int, tuple[int, int, list[int]]] = {}  # id(op) -> (index, tier, holders left)
            for i, hs in pending:
                while hs:
                    t = hs.pop(0)
                    try:
                        opened = self.tiers[t].open_for_read(keys[i])
                    except TierError:
                        continue
                    if opened is None:
                        continue
                    buf, pooled = self.memory.allocate_or_overflow(HEADER_BYTES)
                    op = IOOp(kind=OpKind.READ, fd=opened[0], buf=buf, length=HEADER_BYTES, offset=0,
                              callback=on_done, tag=(i, t, pooled))
                    submitted[id(op)] = (i, t, hs)
                    self.tiers[t].read_ring.submit([op])
                    break
            pending = []
            deadline = None if wait is None else time.monotonic() + wait
            answered: set[int] = set()
            while len(answered) < len(submitted):
                try:
                    op = done.get(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.0))
                except queue.Empty:
                    break
                answered.add(id(op))
                os.close(op.fd)
                i, t, pooled = op.tag
                try:
                    self._header_landed(keys[i], t, op, out, i)
                finally:
                    self.memory.release(op.buf, pooled)
                hs = submitted[id(op)][2]
                if out[i] is None and hs:
                    pending.append((i, hs))
            with lock:
                over[0] = True
            while True:  # completions that raced with the deadline: ours to clean up
                try:
                    op = done.get_nowait()
                except queue.Empty:
                    break
                os.close(op.fd)
                self.memory.release(op.buf, op.tag[2])
                answered.add(id(op))
            stalled = set()
            for key_id, (i, t, hs) in submitted.items():
                if key_id not in answered:  # past hedge_after_s: the next holder, and one failure of the tier
                    stalled.add(t)
                    if hs:
                        pending.append((i, hs))
            for t in stalled:
                self.health[t].on_failure(time.monotonic())

    def _header_landed(self, key: bytes, t: int, op: IOOp, out: list[tuple[ChunkMeta, int] | None], i: int) -> None:
        """A header read is back: remember it, or count the failure as a failed read in a step would."""
        tier = self.tiers[t]
        where = f"{tier.name}:{tier.relpath(key)}"
        if op.result < 0:
            self._read_failed(t, key, op.result, where)
            return
        view = op.buf.view(0, op.result)
        try:
            header = decode_header(view, where=where, expect_key=key)
        except CorruptChunkError as exc:
            tier.quarantine(key, exc.reason)
            return
        finally:
            view.release()
        self._remember_meta(header)
        out[i] = (header.meta, header.payload_len)

    def read_into(self, keys: Sequence[bytes], targets: Sequence[Any], *,
                  on_target_free: Callable[[int], None] | None = None) -> Iterator[tuple[int, ReadIntoResult]]:
        """Read a step straight into the caller's buffers: ``targets[i]`` (writable, C-contiguous) receives chunk
        ``i``'s payload. Yields ``(i, ReadIntoResult)`` once for every index, as each lands (memory hits
        first, misses last).

        A target whose address is 4 KiB-aligned and that holds the payload rounded up to 4 KiB (see
        :meth:`get_meta`) is read with O_DIRECT into place (no copy, no host-memory copy kept) when the
        fastest tier reads it; any other read goes through a pooled buffer and is copied in. The payload is
        verified in the target before it is reported.

        Invariant: a read into a target cannot be taken back, so a target is reported only once no read into
        it is still in flight, and the generator ends only when none is: a second copy (a steal, or a hedged
        read of a stalled tier) never goes into a target another read is writing; if it wins, it is used
        only after that read is over (copied in if that read failed). The one exception: when everything else is done
        and a read into a target is stuck past ``hedge_after_s``, and ``on_target_free`` is given, that target
        is reported ``busy`` (not ok) and ``on_target_free(i)`` is called, on some store thread, once the
        stuck read is over; without the callback the call waits for it.
        """
        self._check_open()
        if len(targets) != len(keys):
            raise UsageError(f"read_into: {len(keys)} keys but {len(targets)} targets")
        t_start = time.perf_counter()
        bufs = [CallerBuffer(t) for t in targets]
        try:
            hits, disk_idx, holders, absent = self._plan_read(keys, None)
            for i, e in hits:
                n = e.header.payload_len
                if n > bufs[i].capacity:
                    yield i, ReadIntoResult(ok=False, reason="target_too_small")
                    continue
                bufs[i].view(0, n)[:] = e.payload()
                yield i, ReadIntoResult(ok=True, source="memory", nbytes=n, meta=e.header.meta)
            lost: list[int] = []
            if disk_idx:
                yield from self._read_from_disk(keys, disk_idx, holders, lost, None,
                                                targets=[bufs[i] for i in disk_idx], on_target_free=on_target_free)
            for reason, idx in (("unreadable", lost), ("absent", absent)):
                for i in idx:
                    self._c["misses"] += 1
                    yield i, ReadIntoResult(ok=False, reason=reason)
        finally:
            for b in bufs:
                b.release()
            self._c["read_seconds"] += time.perf_counter() - t_start

    def _read_from_disk(self, keys: Sequence[bytes], disk_idx: list[int], holders: list[list[int]],
                        misses: list[int], metas: Sequence[AccessMeta | None] | None,
                        targets: list[CallerBuffer] | None = None,
                        on_target_free: Callable[[int], None] | None = None) -> Iterator[tuple[int, Any]]:
        """The step's disk reads. Without ``targets`` yields ``(i, Chunk)``; with them (read_into) yields
        ``(i, ReadIntoResult)`` for every chunk not in ``misses``. Indices in ``misses`` are left to the caller.

        Threading: a tier's ring is refilled from its own completions, on the ring thread (``refill``), and the
        caller's thread verifies, routes and yields. Why: the device shares itself between readers and writers
        by what is queued when it dispatches, and a refill that waits for the caller's thread (which hashes
        payloads, copies, and runs whatever the caller does between two chunks) leaves the tier under-queued;
        measured under a concurrent write stream on the same disk, the read got ~25 % less bandwidth than a
        reader refilling from its completions (BENCHMARKS §8.0). For the same reason the caller's thread opens
        the files each tier will claim next (``open_ahead``, from the schedule's ``peek``), so a refill only
        claims, takes a buffer and submits. ``mu`` guards every piece of routing state
        below (the schedule, bytes and reads in flight, busy clocks, reads into targets); ``closed`` ends the
        refills when the caller is done, so no read is submitted after the leftovers are registered."""
        n_t = len(self.tiers)
        sched: ReadSchedule = self.router.schedule(holders, n_t)
        # read_into: only the fastest tier reads into the targets in place; the others read into pooled buffers
        # and their chunks are copied. A read into a target cannot be taken back, so a target written by a slow
        # tier would hold the step until that read ends even after the fast tier had stolen the chunk; this way
        # a steal by the fast tier lands in place and the slow tier's late copy is simply dropped.
        direct_tier = self._fastest_tier() if targets is not None else -1
        step = _Step(self)
        mu = threading.RLock()
        closed = False
        inflight_bytes = [0] * n_t
        inflight_ops: list[dict[int, _ReadTag]] = [{} for _ in range(n_t)]
        busy_since: list[float | None] = [None] * n_t
        busy = [0.0] * n_t
        tier_bytes = [0] * n_t
        budget = self.read_windows.windows()
        hedge_after = self.config.hedge_after_s
        direct_inflight: dict[int, _ReadTag] = {}  # j -> the read writing into targets[j]
        deferred: dict[int, tuple[_ReadTag, ChunkHeader]] = {}  # j -> a won second copy waiting for that read
        opened: dict[tuple[int, int], tuple[int, int]] = {}  # (t, j) -> (fd, size) opened ahead for tier t
        # Read-ahead bound: a refill from a completion stops while more than one window's worth (all tiers) has
        # landed and not been taken by the caller. A caller slower than the tiers then paces the reads as it
        # takes chunks (its own fill below), so memory held for it stays bounded whatever the step's size.
        unread = 0
        unread_cap = sum(budget)
        self._c["read_steps"] += 1
        if hedge_after:
            self._count_stragglers(hedge_after)

        def fill(t: int) -> None:
            # Keep tier t's ring fed up to its byte budget; at least one read in flight if it has work. Under mu.
            while not closed and (inflight_bytes[t] < budget[t] or not inflight_ops[t]):
                claim = sched.next_claim(t)
                if not claim:
                    return
                submit(t, claim)

        def submit(t: int, claim: list[int]) -> None:  # under mu
            tier = self.tiers[t]
            ops = []
            for j in claim:
                i = disk_idx[j]
                try:
                    got = opened.pop((t, j), None) or tier.open_for_read(keys[i])
                except TierError as exc:  # the tier cannot even open files: another replica, a breaker failure
                    if exc.errno not in (_EMFILE, _ENFILE):  # out of descriptors is this process's shortage
                        self.health[t].on_failure(time.monotonic())
                    log.warning("%s", exc)
                    sched.on_failed(t, j)
                    continue
                if got is None:  # vanished since planning (evicted by another node)
                    sched.on_failed(t, j)
                    continue
                fd, size = got
                target = targets[j] if targets is not None else None
                if (t == direct_tier and target is not None and target.direct_ok and j not in direct_inflight  # type: ignore[union-attr]
                        and HEADER_BYTES < size <= HEADER_BYTES + target.capacity):  # type: ignore[union-attr]
                    buf, pooled = self.memory.allocate_or_overflow(HEADER_BYTES)
                    tag = _ReadTag(tier=t, idx=j, key=keys[i], buf=buf, pooled=pooled, started=time.monotonic(),
                                   fd=fd, size=size, parts=2, target=target)
                    ops.append(IOOp(kind=OpKind.READ, fd=fd, buf=buf, length=HEADER_BYTES, offset=0,
                                    callback=step.on_complete, tag=tag))
                    ops.append(IOOp(kind=OpKind.READ, fd=fd, buf=target, length=size - HEADER_BYTES,  # type: ignore[arg-type]
                                    offset=HEADER_BYTES, callback=step.on_complete, tag=tag))
                    direct_inflight[j] = tag
                else:
                    buf, pooled = self.memory.allocate_or_overflow(size)
                    tag = _ReadTag(tier=t, idx=j, key=keys[i], buf=buf, pooled=pooled, started=time.monotonic(),
                                   fd=fd, size=size)
                    ops.append(IOOp(kind=OpKind.READ, fd=fd, buf=buf, length=size, offset=0,
                                    callback=step.on_complete, tag=tag))
                inflight_bytes[t] += size
                inflight_ops[t][j] = tag
            if ops:
                if busy_since[t] is None:
                    busy_since[t] = time.monotonic()
                tier.read_ring.submit(ops)

        def refill(tag: _ReadTag) -> None:
            # On the ring thread, as the read's last part completes: the read is over, its tier can take more.
            nonlocal unread
            t = tag.tier
            with mu:
                if closed or inflight_ops[t].get(tag.idx) is not tag:
                    return
                inflight_bytes[t] -= tag.size
                del inflight_ops[t][tag.idx]
                if not inflight_ops[t] and busy_since[t] is not None:
                    busy[t] += time.monotonic() - busy_since[t]
                    busy_since[t] = None
                if tag.on_free is not None:  # an abandoned read's tier is stalled: do not feed it from here
                    return
                tag.unread = True
                unread += tag.size
                if unread <= unread_cap:
                    fill(t)

        step.on_read_over = refill

        def open_ahead(t: int) -> None:
            # On the caller's thread: open the files tier t will read next (about one window of them), so the
            # refill on the ring thread only submits. An open there releases the GIL mid-refill, and getting it
            # back behind this thread's work delayed the next read enough to cost the tier device share under a
            # write stream (write-load-diag/refill_mechanics.py: 0.56 vs 0.72 GB/s, raw reader 0.74).
            with mu:
                if closed or len(opened) >= _MAX_OPENED_AHEAD:
                    return
                want = [j for j in sched.peek(t, max(len(inflight_ops[t]), 1)) if (t, j) not in opened]
            for j in want:
                got = self.tiers[t].open_ahead(keys[disk_idx[j]])
                if got is None:
                    continue
                with mu:
                    if not closed:
                        opened[(t, j)] = got
                        continue
                os.close(got[0])

        def deliver_copy(tag: _ReadTag, header: ChunkHeader) -> ReadIntoResult:
            """A pooled copy that won: into the target (read_into), kept in host memory if pooled."""
            j, n = tag.idx, header.payload_len
            target = targets[j]  # type: ignore[index]
            if n > target.capacity:
                self._release_tag(tag)
                return ReadIntoResult(ok=False, reason="target_too_small")
            target.view(0, n)[:] = tag.buf.view(HEADER_BYTES, HEADER_BYTES + n)
            self._c["read_into_copied"] += 1
            if tag.pooled:
                self.memory.insert(MemEntry(key=tag.key, buf=tag.buf, header=header), dirty=False)
            else:
                self._release_tag(tag)
            return ReadIntoResult(ok=True, source=self.tiers[tag.tier].name, nbytes=n, meta=header.meta)

        try:
            with mu:
                for t in range(n_t):
                    fill(t)
            while True:
                with mu:
                    if sched.finished and not deferred:
                        break
                try:
                    tag = step.q.get(timeout=hedge_after if hedge_after else 0.5)
                except queue.Empty:
                    with mu:
                        self._hedge(sched, inflight_ops, hedge_after, submit)
                        stuck = bool(deferred and on_target_free is not None and hedge_after and sched.finished)
                    if stuck:
                        yield from self._abandon_stuck(step, mu, deferred, direct_inflight, hedge_after, disk_idx,
                                                       on_target_free)  # type: ignore[arg-type]
                    with mu:
                        if not any(inflight_ops):  # nothing in flight and not finished: claims were all refused
                            for t in range(n_t):
                                fill(t)
                            if not any(inflight_ops):
                                break
                    continue
                t, j = tag.tier, tag.idx
                os.close(tag.fd)
                if tag.on_free is not None:  # abandoned (reported busy) and over now: free the target
                    self._discard_read(tag, fd_closed=True)
                    continue
                with mu:
                    if tag.unread:
                        unread -= tag.size
                    if tag.target is not None:
                        direct_inflight.pop(j, None)
                    fill(t)  # a no-op while refill() keeps up; feeds the ring when read-ahead was capped
                open_ahead(t)
                chunk = self._verify_read(tag)
                if chunk is None:
                    with mu:
                        sched.on_failed(t, j)
                        for u in range(n_t):  # a retry may now be claimable by another tier
                            fill(u)
                    self._release_tag(tag)
                    if j in deferred:  # the first read into the target failed; the won copy is good
                        yield disk_idx[j], deliver_copy(*deferred.pop(j))
                    continue
                header = chunk[0]
                tier_bytes[t] += tag.size
                with mu:
                    landed_first = sched.on_landed(t, j)
                    target_busy = j in direct_inflight
                if targets is not None:
                    if tag.target is not None and (landed_first or j in deferred):
                        if j in deferred:  # both copies good: keep the one already in place
                            self._release_tag(deferred.pop(j)[0])
                        else:
                            self._c["disk_hits"] += 1
                        self._release_tag(tag)
                        self._c["read_into_direct"] += 1
                        self.tiers[t].on_hit(tag.key)
                        yield disk_idx[j], ReadIntoResult(ok=True, source=self.tiers[t].name,
                                                          nbytes=header.payload_len, meta=header.meta)
                    elif landed_first:
                        self._c["disk_hits"] += 1
                        self.tiers[t].on_hit(tag.key)
                        if target_busy:  # the target is still being written: wait for that read
                            deferred[j] = (tag, header)
                        else:
                            yield disk_idx[j], deliver_copy(tag, header)
                    else:
                        self.tiers[t].counters.duplicate_chunks += 1
                        self._release_tag(tag)
                elif landed_first:
                    self._c["disk_hits"] += 1
                    entry = None
                    if tag.pooled:
                        meta = metas[disk_idx[j]] if metas else None
                        entry = self.memory.insert(MemEntry(key=tag.key, buf=tag.buf, header=header), dirty=False,
                                                   meta=meta)
                        payload = entry.payload()
                    else:
                        payload = tag.buf.readonly(HEADER_BYTES, HEADER_BYTES + header.payload_len)
                    self.tiers[t].on_hit(tag.key)
                    yield disk_idx[j], Chunk(key=tag.key, meta=header.meta, payload=payload,
                                             source=self.tiers[t].name)
                else:
                    self.tiers[t].counters.duplicate_chunks += 1
                    self._release_tag(tag)
        finally:
            with mu:  # no refill from here on: the caller is done (or stopped early)
                closed = True
                unused = list(opened.values())
                opened.clear()
            for fd, _ in unused:  # opened ahead for reads another tier made, or that the step never needed
                os.close(fd)
            for tag, _ in deferred.values():  # the caller stopped early: nobody will use these
                self._release_tag(tag)
            # A caller that stops early (or an error) gets its targets back only once nothing writes into them.
            with mu:
                waiting = [tag for tag in direct_inflight.values() if tag.on_free is None]
            for tag in waiting:
                step.wait_over(tag)
            # Register leftovers before finish(): any that completed meanwhile are drained by finish() through
            # _discard_read, which unregisters them.
            with mu, self._straggler_lock:
                for t, ops in enumerate(inflight_ops):
                    for tag in ops.values():
                        self._stragglers[t][id(tag)] = [tag.started, False]
            step.finish()
            end = time.monotonic()
            with mu:
                for t in range(n_t):
                    if busy_since[t] is not None:
                        busy[t] += end - busy_since[t]
                    self.tiers[t].counters.read_busy_s += busy[t]
        for j in sched.lost():
            self._c["lost_chunks"] += 1
            misses.append(disk_idx[j])
        self._after_read([keys[i] for i in disk_idx], holders, tier_bytes, busy)

    def _fastest_tier(self) -> int:
        """The tier with the highest read bandwidth estimate (tier 0, the node-local one, until measured)."""
        est = [self.read_windows.bandwidth_estimate(t) for t in range(len(self.tiers))]
        if any(e is None for e in est):
            return 0
        return max(range(len(est)), key=lambda t: est[t])  # type: ignore[arg-type, return-value]

    def _abandon_stuck(self, step: _Step, mu: "threading.RLock", deferred: dict[int, tuple[_ReadTag, ChunkHeader]],
                       direct_inflight: dict[int, _ReadTag], hedge_after: float, disk_idx: list[int],
                       on_target_free: Callable[[int], None]) -> Iterator[tuple[int, ReadIntoResult]]:
        """Everything else is done and reads into some targets are stuck: report those targets busy and let
        the stuck reads free them when they end (see :meth:`read_into`). ``mu`` guards ``direct_inflight``."""
        now = time.monotonic()
        for j in list(deferred):
            with mu:
                tag = direct_inflight.get(j)
            if tag is None or now - tag.started <= hedge_after:
                continue
            i = disk_idx[j]
            if step.abandon(tag, lambda i=i: on_target_free(i)):
                self._release_tag(deferred.pop(j)[0])
                self._c["read_into_abandoned"] += 1
                yield i, ReadIntoResult(ok=False, busy=True, reason="stalled")

    def _hedge(self, sched: ReadSchedule, inflight_ops: list[dict[int, _ReadTag]], hedge_after: float | None,
               submit: Any) -> None:
        if not hedge_after:
            return
        now = time.monotonic()
        for t, ops in enumerate(inflight_ops):
            stuck = [j for j, tag in ops.items() if now - tag.started > hedge_after]
            if not stuck:
                continue
            self.health[t].on_failure(now)
            for u in range(len(inflight_ops)):
                if u != t and self._usable(u, now):
                    again = sched.hedge(u, stuck)
                    if again:
                        self._c["hedged_reads"] += len(again)
                        submit(u, again)

    def _verify_read(self, tag: _ReadTag) -> tuple[ChunkHeader] | None:
        """Check a landed read (header, key, length, checksum: in the caller's target for a direct read); on
        failure quarantine or count it and return None."""
        tier = self.tiers[tag.tier]
        where = f"{tier.name}:{tier.relpath(tag.key)}"
        if tag.result < 0:
            self._read_failed(tag.tier, tag.key, tag.result, where)
            return None
        t0 = time.perf_counter()
        try:
            view = tag.buf.view(0, min(tag.result, HEADER_BYTES) if tag.target is not None else tag.result)
            try:
                header = decode_header(view[:HEADER_BYTES], where=where, expect_key=tag.key)
                if tag.result < header.file_size:
                    raise CorruptChunkError(where, f"truncated file ({tag.result} of {header.file_size} B)")
                if self.config.verify_reads:
                    if tag.target is not None:
                        payload = tag.target.view(0, header.payload_len)
                    else:
                        payload = view[HEADER_BYTES : HEADER_BYTES + header.payload_len]
                    try:
                        verify_payload(header, payload, where=where)
                    finally:
                        payload.release()
            finally:
                view.release()
        except CorruptChunkError as exc:
            tier.quarantine(tag.key, exc.reason)
            return None
        finally:
            self._c["verify_seconds"] += time.perf_counter() - t0
        c = tier.counters
        c.read_bytes += tag.result
        c.read_chunks += 1
        c.note_latency(tag.latency)
        self.health[tag.tier].on_success()
        if header.key not in self._metas:
            self._remember_meta(header)
        return (header,)

    def _read_failed(self, t: int, key: bytes, result: int, where: str) -> None:
        """A read (of a whole chunk or of its header) returned ``-errno``: a missing file is dropped from the
        index; any other error counts against the tier and its breaker."""
        tier = self.tiers[t]
        if -result == _ENOENT:
            tier.counters.missing_files += 1
            tier.drop(key, unlink=False)
        else:
            tier.counters.read_errors += 1
            self.health[t].on_failure(time.monotonic())
            log.warning("tier %s: read of %s failed: %s", tier.name, where, os.strerror(-result))

    def _release_tag(self, tag: _ReadTag) -> None:
        self.memory.release(tag.buf, tag.pooled)

    def _discard_read(self, tag: _ReadTag, *, fd_closed: bool = False) -> None:
        """A read that completed after its step was over (a duplicate, a stalled read, or the caller stopped
        early), or an abandoned read into a caller's target: clean up and, for the latter, free the target."""
        if not fd_closed:
            try:
                os.close(tag.fd)
            except OSError:
                pass
        with self._straggler_lock:
            self._stragglers[tag.tier].pop(id(tag), None)
        if tag.result > 0:
            self.tiers[tag.tier].counters.duplicate_chunks += 1
        elif tag.result < 0 and -tag.result != _ENOENT:
            # Nobody waited for this read (the other replica won), but the tier still failed it: the breaker
            # must hear of it, or a tier that only ever loses races would never be taken out.
            self.tiers[tag.tier].counters.read_errors += 1
            self.health[tag.tier].on_failure(time.monotonic())
        self._release_tag(tag)
        if tag.on_free is not None:
            try:
                tag.on_free()
            except Exception:  # the caller's callback must not break a ring thread
                log.exception("read_into: on_target_free raised")

    def _count_stragglers(self, hedge_after: float) -> None:
        """Leftover reads older than ``hedge_after`` are one failure of their tier per step, however many there are
        (a stall is one event; counting each stuck read would open the breaker on a single bad moment)."""
        now = time.monotonic()
        with self._straggler_lock:
            late = []
            for t, reads in enumerate(self._stragglers):
                for rec in reads.values():
                    if not rec[1] and now - rec[0] > hedge_after:
                        rec[1] = True
                        late.append(t)
        self._c["stalled_reads"] += len(late)
        for t in set(late):
            self.health[t].on_failure(now)

    def _after_read(self, keys: list[bytes], holders: list[list[int]], tier_bytes: list[int],
                    busy: list[float]) -> None:
        for t in range(len(self.tiers)):
            self.read_windows.observe(t, tier_bytes[t], busy[t])
        orders: list[CopyOrder] = self.replication.on_read(ReadObservation(
            now=time.monotonic(), keys=keys, holders=holders, tier_bytes=tier_bytes, tier_busy_s=busy))
        if not orders:
            return
        by_key: dict[bytes, set[int]] = {}
        for o in orders:
            by_key.setdefault(o.key, set()).add(o.tier)
        with self._lock:
            for key, ts in by_key.items():
                e = self.memory.get(key)
                if e is None:
                    continue  # not kept in memory (overflow read): the copy waits for the next reuse
                self.memory.mark_dirty(e)
                self._pending.append(_PendingWrite(entry=e, tiers=frozenset(ts)))
                self._c["copies_ordered"] += len(ts)

    # -- administration -------------------------------------------------------------------------------------
    def remove(self, key: bytes) -> bool:
        """Delete a chunk from memory and every tier. Returns True if it was anywhere.

        A put not yet flushed is cancelled, and a write already in flight is unpublished when it lands
        (``MemEntry.removed``), so a removed key never reappears after :meth:`drain`."""
        self._check_open()
        with self._lock:
            entry = self.memory.peek(key)
            found = entry is not None
            if entry is not None:
                entry.removed = True  # before the tier drops below: see _finish_write's re-check
            cancelled = [pw for pw in self._pending if pw.entry.key == key]
            if cancelled:
                self._pending = [pw for pw in self._pending if pw.entry.key != key]
            self.memory.discard(key)
            self._metas.pop(key, None)
            for pw in cancelled:
                self.memory.mark_clean(pw.entry)  # the put's own dirty mark, never taken by flush()
        for t in self.tiers:
            if t.contains(key):
                found = True
                t.drop(key)
        return found

    def evict_memory(self) -> int:
        """Drop every clean chunk from host memory (buffers stay in the pool for reuse); returns chunks dropped.
        Benchmarks use it so a repeat reads from disk again; chunks not yet written stay."""
        dropped = 0
        with self._lock:
            while self.memory._evict_one():
                dropped += 1
        return dropped

    def stats(self) -> dict[str, Any]:
        """Counters for operators and benchmarks; ``write_amplification`` = bytes written / bytes put."""
        tiers = {}
        written = 0
        for t in self.tiers:
            c = t.counters
            written += c.write_bytes
            lat = sorted(c.latencies)
            tiers[t.name] = {
                "path": str(t.root), "direct_io": t.direct, "chunks": len(t.index), "used_bytes": t.used_bytes,
                "capacity_bytes": t.cfg.capacity_bytes, "read_bytes": c.read_bytes, "read_chunks": c.read_chunks,
                "read_busy_s": c.read_busy_s,
                "read_window_bytes": self.read_windows.window(t.position),
                "read_gbps_estimate": (bw / 1e9 if (bw := self.read_windows.bandwidth_estimate(t.position)) else None),
                "read_gbps": c.read_bytes / c.read_busy_s / 1e9 if c.read_busy_s else 0.0,
                "duplicate_chunks": c.duplicate_chunks, "read_errors": c.read_errors,
                "corrupt_chunks": c.corrupt_chunks, "missing_files": c.missing_files,
                "write_bytes": c.write_bytes, "write_chunks": c.write_chunks, "write_errors": c.write_errors,
                "write_skipped_full": c.write_skipped_full,
                "write_skipped_unhealthy": c.write_skipped_unhealthy,
                "write_skipped_backlog": c.write_skipped_backlog, "write_backlog_bytes": self._write_backlog[t.position], "already_present": c.already_present,
                "write_retried_nospace": c.write_retried_nospace,
                "evicted_chunks": c.evicted_chunks, "evicted_bytes": c.evicted_bytes,
                "read_latency_p50_s": lat[len(lat) // 2] if lat else None,
                "read_latency_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
                "circuit": self.health[t.position].state, "circuit_opened": self.health[t.position].opened,
                "index_load_s": t.index.load_seconds, "removed_temporaries": t.removed_temporaries,
            }
        c = dict(self._c)
        return {
            "io_engine": self.engine.name, "router": self.config.router, "replication": self.config.replication,
            **c,
            "write_amplification": written / c["put_file_bytes"] if c["put_file_bytes"] else 0.0,
            "memory": {"capacity_bytes": self.memory.capacity_bytes, "used_bytes": self.memory.used_bytes(),
                       "chunks": len(self.memory), "hits": self.memory.hits, "evictions": self.memory.evictions,
                       "overflow_buffers": self.memory.overflow_buffers,
                       "buffer_allocations": self.memory.pool.allocations, "buffer_reuses": self.memory.pool.reuses},
            "tiers": tiers,
        }


def open_store(config: "StoreConfig | dict[str, Any] | str | os.PathLike[str]", *,
               engine: IOEngine | None = None) -> Store:
    """Open (or create) a store. ``config``: a :class:`StoreConfig`, a dict of the same fields, or a YAML path.

    Raises :class:`kvstream.errors.ConfigError` naming the field for any bad value, missing or unwritable folder.
    """
    return Store(StoreConfig.from_any(config), engine=engine)
