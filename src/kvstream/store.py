"""The engine: a host-memory tier over replicated directory tiers, read meet-in-the-middle, written deferred.

Public API (stable): :func:`open_store`, and on :class:`Store`: ``put``, ``flush``, ``contains``, ``lookup``,
``get_many``, ``read_iter``, ``read_chunks``, ``stats``, ``drain``, ``close`` (and ``with``).

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
started — asks the replication policy which tiers get a copy and submits the writes to those tiers' write
rings, separate from the read rings. A write is published atomically (temporary file, then link); the entry
becomes evictable once every copy is written or has failed. A copy that cannot be written (disk full after
eviction, EIO) is skipped and counted, never retried forever, and never blocks the caller.

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstream.config import StoreConfig
from kvstream.errors import StoreClosedError, UsageError
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
from kvstream.io.buffers import AlignedBuffer, CallerBuffer
from kvstream.io.engine import IOEngine, IOOp, OpKind, make_engine
from kvstream.replication import CopyOrder, ReadObservation, WriteIntent, parse_replication
from kvstream.read_windows import make_read_windows
from kvstream.routing import parse_router
from kvstream.read_step import ReadStep
from kvstream.reader import Reader
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.memory import HostMemoryTier, MemEntry

__all__ = ["Store", "Chunk", "ReadIntoResult", "open_store"]

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
        self._pending: list[_PendingWrite] = []
        self._writes_inflight = 0
        self._write_backlog = [0] * len(self.tiers)  # bytes submitted to each tier's write ring, not finished
        self._backlog_limit = [t.cfg.write_backlog_bytes if t.cfg.write_backlog_bytes is not None
                               else config.memory_bytes // 2 for t in self.tiers]
        self.put_wait_s = 1.0  # longest a put waits for host memory held by unwritten chunks before dropping
        self._writes_cv = threading.Condition(threading.Lock())
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-publish")
        # One writer thread per tier starts its writes (room, temporary file): flush() never waits for a slow or
        # frozen file system, and one tier's never holds up another's.
        self._writers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvs-write-{t.name}")
                         for t in self.tiers]
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
        self._reader = Reader(self)

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
        for w in self._writers:
            w.shutdown(wait=True)
        self._publisher.shutdown(wait=True)
        self._reader.close()
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
        """Hand one copy of ``entry`` to ``tier``'s writer thread. Returns at once: the entry is dirty (kept in
        host memory) and counted in flight from here, and everything that can block on the file system (making
        room by eviction, creating the temporary file) happens on the writer thread, never on the caller's."""
        fsize = entry.file_size
        self.memory.mark_dirty(entry)
        with self._writes_cv:
            self._writes_inflight += 1
            self._write_backlog[tier.position] += fsize
        try:
            self._writers[tier.position].submit(self._start_write, tier, entry, attempt)
        except RuntimeError:  # closing: the writer threads are gone
            self._start_write(tier, entry, attempt)
        return True

    def _start_write(self, tier: DirectoryTier, entry: MemEntry, attempt: int) -> None:
        """On the tier's writer thread: reserve room, create the temporary file, submit the write."""
        fsize = entry.file_size
        try:
            if not tier.reserve(fsize):
                tier.counters.write_skipped_full += 1
                self._write_not_started(tier, entry, fsize)
                return
            try:
                fd, tmp = tier.create_temp(entry.key)
            except OSError as exc:
                tier.unreserve(fsize)
                self._write_failed(tier, -(exc.errno or 5))
                self._write_not_started(tier, entry, fsize)
                return
        except Exception:  # a writer thread must answer for every copy it was given
            log.exception("tier %s: starting a write failed", tier.name)
            self._write_not_started(tier, entry, fsize)
            return
        op = IOOp(kind=OpKind.WRITE, fd=fd, buf=entry.buf, length=fsize, offset=0,
                  callback=self._on_write_done, tag=(tier, entry, tmp, attempt))
        try:
            tier.write_ring.submit([op])
        except StoreClosedError:
            os.close(fd)
            self._finish_write(tier, entry, tmp, fsize, ok=False, err=-5)

    def _write_not_started(self, tier: DirectoryTier, entry: MemEntry, fsize: int) -> None:
        self.memory.mark_clean(entry)
        with self._writes_cv:
            self._writes_inflight -= 1
            self._write_backlog[tier.position] -= fsize
            self._writes_cv.notify_all()

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
        """Like :meth:`read_iter`, with each chunk's header metadata and source. Every index is yielded once.

        A payload is a read-only view that pins its buffer: it stays valid and unchanged for as long as the
        caller holds it, whatever other threads put, evict or read meanwhile."""
        self._check_open()
        t_start = time.perf_counter()
        hits, disk_idx, holders, misses = self._plan_read(keys, metas)
        try:
            for i, e, view in hits:
                yield i, Chunk(key=keys[i], meta=e.header.meta, payload=view, source="memory")
        finally:
            hits.clear()  # drops the pins the caller did not take (it stopped early); its own views live on
        if disk_idx:
            for out in self._reader.run([keys[i] for i in disk_idx], holders, "chunks",
                                        metas=[metas[i] for i in disk_idx] if metas else None,
                                        on_end=lambda step: self._after_read([keys[i] for i in disk_idx], holders,
                                                                             step)):
                i = disk_idx[out.j]
                if out.kind == "delivered":
                    assert out.header is not None and out.payload is not None
                    yield i, Chunk(key=keys[i], meta=out.header.meta, payload=out.payload, source=out.source)
                else:
                    self._c["lost_chunks"] += 1
                    misses.append(i)
        for i in misses:
            self._c["misses"] += 1
            yield i, None
        self._c["read_seconds"] += time.perf_counter() - t_start

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
                self._c["memory_hits"] += 1
                hits.append((i, got[0], got[1]))
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
        only after that read is over (copied in if that read failed). The one exception: when everything else is
        done and a read into a target is stuck past ``hedge_after_s``, and ``on_target_free`` is given, that
        target is reported ``busy`` (not ok) and ``on_target_free(i)`` is called, on some store thread, once the
        stuck read is over; without the callback the call waits for it. The store keeps its own reference to a
        busy target until then, so the memory stays valid even if the caller drops its reference.
        """
        self._check_open()
        if len(targets) != len(keys):
            raise UsageError(f"read_into: {len(keys)} keys but {len(targets)} targets")
        t_start = time.perf_counter()
        bufs = [CallerBuffer(t) for t in targets]
        busy: set[int] = set()
        hits: list[tuple[int, MemEntry, memoryview]] = []
        try:
            hits, disk_idx, holders, absent = self._plan_read(keys, None)
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
                    else:
                        self._c["lost_chunks"] += 1
                        lost.append(i)
            for reason, idx in (("unreadable", lost), ("absent", absent)):
                for i in idx:
                    self._c["misses"] += 1
                    yield i, ReadIntoResult(ok=False, reason=reason)
        finally:
            for _, _, view in hits:
                view.release()
            for i, b in enumerate(bufs):
                if i not in busy:  # a busy target is released by its stuck read when it ends
                    b.release()
            self._c["read_seconds"] += time.perf_counter() - t_start

    def _read_failed(self, t: int, key: bytes, result: int, where: str) -> None:
        """A read (of a whole chunk or of its header) returned ``-errno``: a missing file (or one a peer
        replaced: ESTALE) is dropped from the index; any other error counts against the tier and its breaker."""
        tier = self.tiers[t]
        if -result == _ENOENT:
            tier.counters.missing_files += 1
            tier.drop(key, unlink=False)
        else:
            tier.counters.read_errors += 1
            self.health[t].on_failure(time.monotonic())
            log.warning("tier %s: read of %s failed: %s", tier.name, where, os.strerror(-result))

    def _after_read(self, keys: list[bytes], holders: list[list[int]], step: ReadStep) -> None:
        """A step is over: its tiers' bytes and busy time feed the read windows and the replication policy."""
        tier_bytes, busy = step.tier_bytes, step.busy_s
        for t in range(len(self.tiers)):
            self.read_windows.observe(t, tier_bytes[t], busy[t])
        self._c["read_steps"] += 1
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
            dropped = self.memory.evict_clean()
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
