"""The store's write side: buffered puts become deferred, replicated, atomically published copies.

``Store.put`` fills a pooled buffer and inserts a dirty host-memory entry; this module takes it from there.
``flush`` (the step boundary) asks the replication policy which tiers get a copy and hands each copy to that
tier's writer thread, which makes room (eviction), creates the temporary file and submits the write to the
tier's write ring (separate from its read ring); the completion is handed to the publisher thread (fsync, link,
index record), so a slow publish never delays the reaping of reads, and a frozen file system never holds the
caller. An entry stays dirty (never evicted: it may be the only copy) until every copy is written or has failed.
Each published copy's write latency (from its hand-over to the tier's writer thread to its publish, a retry
included) is kept per tier (the last few thousand, for ``Store.stats()``'s percentiles) and passed to the
listener set by :meth:`Writer.observe` (the LMCache plugin's histogram).
A copy that cannot be written (disk full after eviction and one retry, EIO) is skipped and counted, never
retried in a loop; a *second* copy is skipped while its tier's unfinished writes exceed ``write_backlog_bytes``
(the backlog valve: :class:`kvstream.debt_policy.BacklogValve`, the simulator's too).
A skipped second copy (backlog, open breaker, I/O error) is owed, not dropped: :mod:`kvstream.replica_debt`
writes it once the tier can take it.

Locks: the store's ``_lock`` guards the pending list together with host-memory inserts and removes;
``_writes_cv`` the in-flight counts (order: ``_lock`` before ``_writes_cv``, never the other way). A flush
counts itself as handing over (``_handing_over``) in the same critical section that takes the pending list, so
:meth:`Writer.drain` on any thread also waits for copies another thread's flush has taken and not yet counted.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstream.config import write_backlog_limit
from kvstream.debt_policy import BacklogValve, ValveDecision
from kvstream.errors import NO_SPACE, SHORTAGE, WRITE_RETRY, StoreClosedError
from kvstream.health import CircuitBreaker
from kvstream.io.buffers import AlignedBuffer
from kvstream.io.engine import IOOp, OpKind
from kvstream.read_windows import ReadWindows
from kvstream.replica_debt import OwedReplicas
from kvstream.replication import ReplicationPolicy, WriteIntent
from kvstream.stats import WriterCounters
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.memory import HostMemoryTier, MemEntry

__all__ = ["Writer"]

log = logging.getLogger("kvstream.store")
_LATENCIES_KEPT = 4096  # recent write latencies kept per tier (as many as the tiers keep of reads)

WriteListener = Callable[[str, float], None]  # (tier name, seconds from hand-over to publish)


@dataclass(frozen=True, slots=True)
class _WriteTag:
    """What a write op carries from its submission to its completion (``IOOp.tag``)."""

    tier: DirectoryTier
    entry: MemEntry
    tmp: str  # the temporary file the copy is written to, renamed into place at publish
    attempt: int  # 0, or 1 for the one retry after ENOSPC / ESTALE
    submitted: float  # perf_counter() when the copy was first handed to the tier's writer


@dataclass(eq=False, slots=True)
class _PendingWrite:
    entry: MemEntry
    tiers: frozenset[int] | None  # None: ask the replication policy at flush
    put: bool = False  # carries the put's own dirty mark, which becomes the durability hold at hand-over


class Writer:
    """The write side of a store (see the module docstring), given what it writes with, not the store:
    ``tiers`` and ``health`` (one circuit breaker per tier, same order), ``memory`` (the host-memory tier whose
    dirty entries it writes), ``read_windows`` (a tier that recovers forgets the speed measured while it failed),
    ``owed`` (the owed-replica journal: write-ahead records, and the copies it skips), ``replication`` (which
    tiers a put's copies go to), ``lock`` (the store's metadata lock: it guards the pending list together with
    host-memory inserts and removes), ``closed`` (whether the store has closed: no retry after) and
    ``memory_bytes`` (host memory's size: the default backlog limit and the unstored-put limit). It counts in
    its own :class:`~kvstream.stats.WriterCounters` (``counters``)."""

    def __init__(self, *, tiers: Sequence[DirectoryTier], health: Sequence[CircuitBreaker], memory: HostMemoryTier,
                 read_windows: ReadWindows, owed: OwedReplicas, replication: ReplicationPolicy,
                 lock: AbstractContextManager[Any], closed: Callable[[], bool], memory_bytes: int) -> None:
        self._tiers = tiers
        self._health = health
        self._memory = memory
        self._windows = read_windows
        self._owed = owed
        self._replication = replication
        self._lock = lock
        self._closed = closed
        self.counters = WriterCounters()  # this writer's figures (Store.stats() copies them)
        n = len(tiers)
        self._pending: list[_PendingWrite] = []  # guarded by self._lock
        self._writes_inflight = 0
        # Flushes that took pending copies and are still handing them over (outside the store's lock): a drain
        # on another thread waits for them too, or it could report done before those copies were counted.
        self._handing_over = 0
        self._write_backlog = [0] * n  # bytes handed to each tier's writer and not finished
        self._write_busy_since: list[float | None] = [None] * n  # when the tier's backlog last left zero
        self._copying: set[tuple[int, bytes]] = set()  # (tier, key) of copies handed over and not finished
        # The durability hold (module docstring), guarded by _writes_cv: acknowledged puts with no copy on any
        # tier yet, each holding its put's dirty mark; those of them with no copy in flight either are unstored.
        self._held: dict[bytes, MemEntry] = {}
        self._inflight_by_key: dict[bytes, int] = {}  # copies of each key handed over and not finished
        self._unstored: dict[bytes, MemEntry] = {}
        self._unstored_bytes = 0
        # Past this many bytes of unstored puts, put() refuses new chunks (returns False, counted) rather than
        # fill host memory with chunks no tier takes.
        self.unstored_limit = memory_bytes // 2
        # The write backlog valve (kvstream.debt_policy, the simulator's too): each tier's write_backlog_bytes,
        # or half of host memory.
        self.valve = BacklogValve([write_backlog_limit(t.cfg.write_backlog_bytes, memory_bytes) for t in tiers])
        self._writes_cv = threading.Condition(threading.Lock())
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvs-publish")
        # One writer thread per tier starts its writes (room, temporary file): flush() never waits for a slow or
        # frozen file system, and one tier's never holds up another's.
        self._writers = [ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"kvs-write-{t.name}")
                         for t in self._tiers]
        # Recent write latencies per tier (s), appended by the publisher thread, copied under _latency_lock.
        self._latencies: list[deque[float]] = [deque(maxlen=_LATENCIES_KEPT) for _ in self._tiers]
        self._latency_lock = threading.Lock()
        self._listener: WriteListener | None = None

    def observe(self, listener: WriteListener | None) -> None:
        """Call ``listener(tier_name, seconds)`` after each copy is published (on the publisher thread; it must
        be quick and must not raise). None removes it."""
        self._listener = listener

    def write_latencies(self, t: int) -> list[float]:
        """Tier ``t``'s recent write latencies, seconds from hand-over to publish (oldest first)."""
        with self._latency_lock:
            return list(self._latencies[t])

    def close(self, *, wait: bool = True) -> None:
        """After :meth:`drain`: let the writer and publisher threads end (``wait=False``: a drain timed out on a
        stalled tier; do not wait for a writer thread blocked on it, it ends when its write does)."""
        for w in self._writers:
            # Queued copies still run (not cancelled): each is counted in its tier's backlog, which the
            # background closer of a stalled tier waits on, and they land once the tier moves again.
            w.shutdown(wait=wait)
        self._publisher.shutdown(wait=wait)

    def backlog(self, t: int) -> int:
        return self._write_backlog[t]

    def write_busy_s(self, t: int) -> float:
        """Seconds tier ``t`` has had copies handed to its writer and not finished, the current stretch included
        (the tier's counter adds a stretch only when its backlog empties)."""
        with self._writes_cv:
            since = self._write_busy_since[t]
            open_s = time.perf_counter() - since if since is not None else 0.0
            return self._tiers[t].counters.write_busy_s + open_s

    def backlog_limit(self, t: int) -> int | None:
        """Tier ``t``'s write backlog valve limit (bytes; :class:`kvstream.debt_policy.BacklogValve`)."""
        return self.valve.limit(t)

    def order_copy(self, key: bytes, t: int) -> bool:
        """Queue a copy of ``key`` to tier ``t`` for the next flush, if its payload is in host memory (the
        catch-up of owed replicas, :mod:`kvstream.replica_debt`). The entry is dirty (kept) until written."""
        with self._lock:
            e = self._memory.peek(key)
            if e is None or e.removed or (t, key) in self._copying:
                return False
            if any(pw.entry.key == key and (pw.tiers is None or t in pw.tiers) for pw in self._pending):
                return False
            self._memory.mark_dirty(e)
            self.enqueue(e, frozenset((t,)))
        return True

    # -- pending copies (callers hold self._lock) -----------------------------------------------------------
    def enqueue(self, entry: MemEntry, tiers: frozenset[int] | None, *, put: bool = False) -> None:
        """A dirty entry waits for the next flush (``tiers``: the tiers to copy to; None: the policy's).
        ``put``: the entry's dirty mark is a put's (it becomes the durability hold at hand-over)."""
        self._pending.append(_PendingWrite(entry=entry, tiers=tiers, put=put))

    # -- the durability hold ---------------------------------------------------------------------------------
    def _hold(self, entry: MemEntry) -> None:
        """An acknowledged put was handed over and no tier holds it yet: its put's dirty mark stays, so host
        memory keeps it (never evicted) until its first copy is published (:meth:`_release_hold`)."""
        with self._writes_cv:
            self._held[entry.key] = entry
            if not self._inflight_by_key.get(entry.key):
                self._mark_unstored(entry)

    def _mark_unstored(self, entry: MemEntry) -> None:  # caller holds _writes_cv
        if entry.key not in self._unstored:
            self._unstored[entry.key] = entry
            self._unstored_bytes += entry.file_size

    def _mark_not_unstored(self, key: bytes) -> None:  # caller holds _writes_cv
        e = self._unstored.pop(key, None)
        if e is not None:
            self._unstored_bytes -= e.file_size

    def release_hold(self, key: bytes, entry: MemEntry | None = None) -> bool:
        """``key`` has a copy on a tier now (or was removed): its hold ends and the entry may be evicted. With
        ``entry``, only that very entry's hold. Returns True if a hold ended."""
        with self._writes_cv:
            held = self._held.get(key)
            if held is None or (entry is not None and held is not entry):
                return False
            del self._held[key]
            self._mark_not_unstored(key)
            self._writes_cv.notify_all()
        self._memory.mark_clean(held)
        return True

    def held_keys(self) -> list[bytes]:
        """Keys of acknowledged puts that no tier holds yet (in flight or unstored)."""
        with self._writes_cv:
            return list(self._held)

    def unstored(self) -> tuple[int, int]:
        """(chunks, bytes) of acknowledged puts with no copy on any tier and none in flight: host memory is
        their only copy (every tier they target failed or is out of routing); the catch-up writes them."""
        with self._writes_cv:
            return len(self._unstored), self._unstored_bytes

    def cancel(self, key: bytes) -> list[MemEntry]:
        """Drop ``key``'s pending copies; returns their entries (each still holds the put's dirty mark)."""
        cancelled = [pw.entry for pw in self._pending if pw.entry.key == key]
        if cancelled:
            self._pending = [pw for pw in self._pending if pw.entry.key != key]
        return cancelled

    def wait_for_buffer(self, nbytes: int, timeout: float) -> AlignedBuffer | None:
        """Wait (at most ``timeout``) for host memory held by unwritten chunks to free a buffer of ``nbytes``."""
        got: list[AlignedBuffer] = []

        def freed() -> bool:
            b = self._memory.allocate(nbytes)
            if b is not None:
                got.append(b)
            return b is not None

        with self._writes_cv:
            self._writes_cv.wait_for(freed, timeout=timeout)
        return got[0] if got else None

    def flush(self) -> int:
        """Hand every buffered put to the tiers' writer threads (the step boundary). Returns copies handed over."""
        with self._lock:
            pending, self._pending = self._pending, []
            self.counters.flushes += 1
            if not pending:
                return 0
            with self._writes_cv:  # taken with the list: a drain from here on waits for this hand-over
                self._handing_over += 1
        try:
            return self._hand_over(pending)
        finally:
            with self._writes_cv:
                self._handing_over -= 1
                self._writes_cv.notify_all()

    def _hand_over(self, pending: list[_PendingWrite]) -> int:
        now = time.monotonic()
        submitted = 0
        for pw in pending:
            entry = pw.entry
            if entry.removed:
                self._memory.mark_clean(entry)
                continue
            targets = pw.tiers
            if targets is None:
                targets = self._replication.targets(
                    WriteIntent(key=entry.key, nbytes=entry.header.payload_len, position=entry.position),
                    len(self._tiers))
            copies = sum(1 for t in self._tiers if t.contains(entry.key))
            stored = copies > 0  # a tier holds it already: nothing to hold it in memory for
            for t in sorted(targets):  # tier order: the first (fastest) tier takes the copy that is never skipped
                tier = self._tiers[t]
                if tier.contains(entry.key):
                    continue
                if tier.down:  # could not be opened: skipped, not owed (a journal line per put, for ever)
                    tier.counters.write_skipped_unhealthy += 1
                    continue
                if not self._health[t].usable(now):
                    tier.counters.write_skipped_unhealthy += 1
                    self._owed.owe(tier.name, entry.key)
                    continue
                verdict = self.valve.decide(t, copies=copies, backlog=self._write_backlog[t])
                if verdict is not ValveDecision.WRITE:
                    tier.counters.write_skipped_backlog += 1
                    if verdict is ValveDecision.OWE:  # deferred, not dropped (SKIP: the operator wants one copy)
                        self._owed.owe(tier.name, entry.key)
                    continue
                if self._submit_write(tier, entry):
                    submitted += 1
                    copies += 1
            if pw.put and not stored:
                # The put's own dirty mark becomes its durability hold: kept in host memory until a copy lands
                # (its copies in flight may all fail, or none could be handed over: every tier failing).
                self._hold(entry)
                if entry.removed:  # remove() ran meanwhile and found no hold to end: end it here
                    self.release_hold(entry.key, entry)
            else:
                self._memory.mark_clean(entry)  # the put's or order's mark; per-write marks were added above
        return submitted

    def _submit_write(self, tier: DirectoryTier, entry: MemEntry, attempt: int = 0,
                      submitted: float | None = None) -> bool:
        """Hand one copy of ``entry`` to ``tier``'s writer thread. Returns at once: the entry is dirty (kept in
        host memory) and counted in flight from here, and everything that can block on the file system (making
        room by eviction, creating the temporary file) happens on the writer thread, never on the caller's.
        ``submitted``: when the copy was first handed over (a retry keeps its first attempt's time)."""
        fsize = entry.file_size
        if submitted is None:
            submitted = time.perf_counter()
        self._memory.mark_dirty(entry)
        # Write-ahead: the copy is journalled as owed before it is issued and cleared when it lands, so a process
        # killed (or closed past its timeout) with it in flight finds it owed at the next open.
        self._owed.intend(tier.name, entry.key)
        with self._writes_cv:
            self._writes_inflight += 1
            if self._write_busy_since[tier.position] is None:
                self._write_busy_since[tier.position] = time.perf_counter()
            self._write_backlog[tier.position] += fsize
            self._copying.add((tier.position, entry.key))
            self._inflight_by_key[entry.key] = self._inflight_by_key.get(entry.key, 0) + 1
            self._mark_not_unstored(entry.key)
        try:
            self._writers[tier.position].submit(self._start_write, tier, entry, attempt, submitted)
        except RuntimeError:  # closing: the writer threads are gone
            self._start_write(tier, entry, attempt, submitted)
        return True

    def _start_write(self, tier: DirectoryTier, entry: MemEntry, attempt: int, submitted: float) -> None:
        """On the tier's writer thread: reserve room, create the temporary file, submit the write."""
        fsize = entry.file_size
        try:
            if not tier.reserve(fsize):
                tier.counters.write_skipped_full += 1
                self._not_written(tier, entry.key, owed=False)
                self._write_over(tier, entry, fsize)
                return
            try:
                fd, tmp = tier.create_temp(entry.key)
            except OSError as exc:
                tier.unreserve(fsize)
                self._write_failed(tier, entry.key, -(exc.errno or 5))
                self._write_over(tier, entry, fsize)
                return
        except Exception:  # a writer thread must answer for every copy it was given
            log.exception("tier %s: starting a write failed", tier.name)
            self._not_written(tier, entry.key, owed=True)
            self._write_over(tier, entry, fsize)
            return
        op = IOOp(kind=OpKind.WRITE, fd=fd, buf=entry.buf, length=fsize, offset=0,
                  callback=self._on_write_done, tag=_WriteTag(tier, entry, tmp, attempt, submitted))
        try:
            tier.write_ring.submit([op])
        except StoreClosedError:
            os.close(fd)
            self._finish_write(tier, entry, tmp, fsize, ok=False, err=-5, submitted=submitted)

    def _write_over(self, tier: DirectoryTier, entry: MemEntry, fsize: int) -> None:
        """One copy of ``entry`` is done with (published, failed, or never started): its dirty mark and its
        place in the tier's backlog go."""
        self._memory.mark_clean(entry)
        with self._writes_cv:
            self._writes_inflight -= 1
            self._write_backlog[tier.position] -= fsize
            since = self._write_busy_since[tier.position]
            if self._write_backlog[tier.position] == 0 and since is not None:
                tier.counters.write_busy_s += time.perf_counter() - since
                self._write_busy_since[tier.position] = None
            self._copying.discard((tier.position, entry.key))
            left = self._inflight_by_key.get(entry.key, 0) - 1
            if left > 0:
                self._inflight_by_key[entry.key] = left
            else:
                self._inflight_by_key.pop(entry.key, None)
                held = self._held.get(entry.key)
                if held is not None:  # its last copy in flight ended and none landed: memory is its only copy
                    self._mark_unstored(held)
            self._writes_cv.notify_all()

    def _on_write_done(self, op: IOOp) -> None:
        # Ring thread: hand the slow part (fsync, link, index append) to the publisher.
        try:
            self._publisher.submit(self._publish, op)
        except RuntimeError:  # publisher shut down (closing): publish inline
            self._publish(op)

    def _publish(self, op: IOOp) -> None:
        tag = op.tag
        assert isinstance(tag, _WriteTag)
        tier, entry, tmp, attempt, submitted = tag.tier, tag.entry, tag.tmp, tag.attempt, tag.submitted
        fsize = op.length
        ok = op.result == fsize
        err = op.result if op.result < 0 else -5
        try:
            if ok and tier.cfg.fsync:
                os.fsync(op.fd)
        except OSError as exc:
            ok, err = False, -(exc.errno or 5)
        finally:
            try:
                os.close(op.fd)
            except OSError as exc:  # NFS-like clients report write-back errors here; FUSE may say ESTALE
                if ok:
                    ok, err = False, -(exc.errno or 5)
        self._finish_write(tier, entry, tmp, fsize, ok=ok, err=err, attempt=attempt, submitted=submitted)

    def _finish_write(self, tier: DirectoryTier, entry: MemEntry, tmp: str, fsize: int, *, ok: bool, err: int,
                      attempt: int = 0, submitted: float | None = None) -> None:
        try:
            if ok and entry.removed:  # removed while in flight: not a failure, just don't publish
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                tier.unreserve(fsize)
                self._owed.paid(tier.name, entry.key)  # no longer wanted
                return
            if ok:
                try:
                    tier.publish(entry.key, tmp, fsize)
                    tier.counters.write_bytes += fsize
                    tier.counters.write_chunks += 1
                    self._owed.paid(tier.name, entry.key)
                    self.release_hold(entry.key, entry)  # a copy landed: host memory is no longer the only one
                    if self._health[tier.position].on_success(time.monotonic()):  # recovered: forget its
                        # speed measured while failing
                        self._windows.forget(tier.position)
                except OSError as exc:
                    ok, err = False, -(exc.errno or 5)
                else:
                    if submitted is not None:
                        self._note_latency(tier, time.perf_counter() - submitted)
                if ok and entry.removed:  # remove() raced with the publish above; its tier drop may have missed it
                    tier.drop(entry.key)
            if not ok:
                try:
                    os.unlink(tmp)
                except OSError:  # gone, or a stale handle: nothing of ours is left to remove
                    pass
                tier.unreserve(fsize)
                # Disk fuller than our share says (other users): evict this tier's own chunks and retry once,
                # asynchronously (the entry stays dirty until the retry is done); else skip the copy, counted.
                if -err in NO_SPACE and attempt == 0 and not self._closed() and tier.make_room(fsize):
                    tier.counters.write_retried_nospace += 1
                    self._submit_write(tier, entry, attempt=1, submitted=submitted)  # a 2nd failure is counted there
                elif -err in WRITE_RETRY and attempt == 0 and not self._closed():
                    # A shared tier's handle went stale (a peer's delete, a folder re-created) or GlusterFS said
                    # ENODATA (a file's metadata not settled): a new temporary usually works; retried once,
                    # counted; a second failure is counted there (errors.WRITE_RETRY).
                    tier.counters.write_retried_stale += 1
                    self._submit_write(tier, entry, attempt=1, submitted=submitted)
                else:
                    self._write_failed(tier, entry.key, err)
        finally:
            self._write_over(tier, entry, fsize)

    def _note_latency(self, tier: DirectoryTier, seconds: float) -> None:
        with self._latency_lock:
            self._latencies[tier.position].append(seconds)
        listener = self._listener
        if listener is not None:
            try:
                listener(tier.name, seconds)
            except Exception:  # a metrics bug must not fail a published write
                log.exception("tier %s: write listener failed", tier.name)

    def _not_written(self, tier: DirectoryTier, key: bytes, *, owed: bool) -> bool:
        """A copy issued (journalled in flight) ended without landing. ``owed``: it is owed (the catch-up writes
        it later); else it is skipped (a full tier), unless it was an acknowledged put's only hope of a copy:
        then it is owed all the same, never just skipped."""
        if not owed:
            with self._writes_cv:
                owed = key in self._held
        if owed:
            self._owed.owe(tier.name, key)
        else:
            self._owed.paid(tier.name, key)  # skipped: its journal record ends
        return owed

    def _write_failed(self, tier: DirectoryTier, key: bytes, err: int) -> None:
        if -err in NO_SPACE:
            tier.counters.write_skipped_full += 1
            # The file system is fuller than our capacity says (other users): shrink our share a little.
            tier.reserve(0)
            owed = self._not_written(tier, key, owed=False)
        else:
            tier.counters.write_errors += 1
            owed = self._not_written(tier, key, owed=True)  # written later from memory or another holder
            if -err not in SHORTAGE:  # this process (or the system) is short: not the tier's fault
                self._health[tier.position].on_failure(time.monotonic())
        log.warning("tier %s: write failed (%s); copy %s", tier.name, os.strerror(-err) if err < 0 else err,
                    "owed (written later)" if owed else "skipped")

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every copy handed over, or being handed over by a flush on any thread, has been
        published or has failed (True), or ``timeout`` passes (False). Says nothing of unstored puts
        (:meth:`unstored`): :meth:`kvstream.store.Store.drain` adds that."""
        with self._writes_cv:
            return self._writes_cv.wait_for(lambda: self._writes_inflight == 0 and self._handing_over == 0, timeout)

