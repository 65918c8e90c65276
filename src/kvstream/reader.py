"""The store's reader: drives one :class:`kvstream.read_step.ReadStep` per call with real files, rings and threads.

Every decision (claims, windows, read-ahead, hedging, delivery, duplicates, losses, busy targets) is the read
step's; this module only carries out its actions and feeds it events:

- ``Open``: handed to the tier's open threads (``open()`` can block on a network file system, a throttled
  device's cold metadata or a FIFO: never on the caller's thread nor under the step's lock, and the hedge
  deadline counts from the moment the read was claimed, so a slow open is just a slow read).
- ``Submit``: a buffer is taken (or the caller's target, for a read in place) and the read goes to the tier's
  read ring; the ring's completion feeds ``landed`` on the ring thread, which may claim and submit that tier's
  next reads at once, so the device never waits for the caller's thread (measured under a write stream on the
  same disk: a refill that waits for the consumer costs the read ~25 % of its device share, docs/bench/read.md).
- The caller's thread verifies each landed read (header, key, length, checksum), feeds ``checked`` and hands
  out what the step delivers; it ``tick``s the step when a hedge deadline passes.
- ``Release``: the read's descriptor and buffer are freed (and, for a read into a target reported busy, the
  target goes back to its caller through ``on_target_free``).

Ownership: a read's pooled buffer belongs to the read from ``Submit`` until it is released or delivered; a
delivered buffer becomes a host-memory entry, and the view handed to the caller pins it (never reused while
viewed). A caller's target belongs to the store from the call until it is reported (or, when reported busy,
until ``on_target_free``): the export that keeps it alive is dropped only then.

Locking: ``_Call.mu`` guards the read step and the read table; no syscall, allocation or verification runs
under it except ring submission bookkeeping.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstream.errors import GONE, SHORTAGE, CorruptChunkError, StoreClosedError, TierError
from kvstream.eviction import AccessMeta
from kvstream.health import CircuitBreaker
from kvstream.format import HEADER_BYTES, ChunkHeader, decode_header, verify_payload
from kvstream.io.buffers import AlignedBuffer, CallerBuffer
from kvstream.io.engine import IOOp, OpKind
from kvstream.stats import ReaderCounters
from kvstream.read_step import (Busy, ChunkState, Compute, ComputePlan, Deliver, Lost, Open, ReadState, ReadStep,
                                Release, Stalled, Submit)
from kvstream.read_windows import ReadWindows
from kvstream.removals import Removals
from kvstream.routing import ReadRouter
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.memory import HostMemoryTier, MemEntry
from kvstream.tiers.recheck import check_chunk_file, reread_into

__all__ = ["Reader", "ReadOutcome"]

log = logging.getLogger("kvstream.store")
_GONE = GONE  # no file, or a handle to one a peer deleted: a miss on a shared tier, not a fault (errno rules)
_OPEN_THREADS = 4  # per tier: opens of one tier wait behind each other, never behind another tier's
_MAX_OPENED_AHEAD = 256  # files a step may hold open ahead of its claims, all tiers together


def _close_quietly(fd: int) -> None:
    """Close a read descriptor. Its errors are not the read's: FUSE clients (GlusterFS) answer ``close()`` with
    ENOENT once a peer deleted the file, and the read has landed (or been given up) by then."""
    try:
        os.close(fd)
    except OSError:
        pass


@dataclass(eq=False, slots=True)
class _Tag:
    """The driver's side of one read: what it holds (descriptor, buffer, target) and its I/O result."""

    rid: int
    tier: int
    j: int  # chunk index within the step
    key: bytes
    started: float
    fd: int = -1
    buf: AlignedBuffer | None = None
    pooled: bool = False
    nbytes: int = 0
    parts: int = 0  # ops not completed yet
    result: int = 0  # bytes read over all parts, or the first -errno
    latency: float = 0.0
    target: CallerBuffer | None = None  # set for a read in place
    header: ChunkHeader | None = None  # set once checked ok
    late: bool = False  # registered as a straggler (the step gave up on it)


@dataclass(frozen=True, slots=True)
class ReadOutcome:
    """One chunk's result from :meth:`Reader.run`. ``kind``: delivered, lost, busy, too_small, computed (the
    GPU recomputed it: no payload; only with a compute plan), closed (the store closed before it landed: a
    miss)."""

    j: int
    kind: str
    source: str = ""
    header: ChunkHeader | None = None
    payload: memoryview | None = None  # chunks mode: the pinned payload


@dataclass(frozen=True, slots=True)
class _Computed:
    """Put on a call's queue when the modelled GPU has recomputed chunk ``j`` (a :class:`Compute`'s timer)."""

    j: int


class _Call:
    """One running read step and everything its driver threads share (guarded by ``mu``)."""

    def __init__(self, step: ReadStep, keys: list[bytes], mode: str, targets: list[CallerBuffer] | None,
                 on_target_free: Callable[[int], None] | None, metas: Sequence[AccessMeta | None] | None) -> None:
        self.step = step
        self.keys = keys
        self.mode = mode  # "chunks", "into" or "headers"
        self.targets = targets
        self.on_target_free = on_target_free
        self.mu = threading.Lock()
        self.cv = threading.Condition(self.mu)
        self.q: queue.SimpleQueue[_Tag | _Computed | None] = queue.SimpleQueue()  # landed reads; GPU done; None: wake
        self.tags: dict[int, _Tag] = {}
        self.metas = metas
        # Files opened ahead of their claims, (tier, chunk) -> (fd, size): see Reader._open_ahead.
        self.opened: dict[tuple[int, int], tuple[int, int]] = {}
        self.opening_ahead = [False] * step.n_tiers  # an open-ahead task is queued or running for the tier
        self.removal_seq = 0  # Store.removals.now() when the step began: see Reader._keep


class Reader:
    """Runs read steps over a store's directory tiers: their files, read rings and open threads, the host memory
    that pooled reads land in and delivered ones are cached in, the tiers' circuit breakers and read windows.

    It is given exactly those (not the store): ``tiers`` and ``health`` (one breaker per tier, same order),
    ``memory``, ``read_windows``, ``router`` (the sans-I/O read router whose schedule each step follows),
    ``removals`` and ``lock`` (the store's metadata lock: a delivered chunk is cached under it, ordered with
    ``Store.remove``, which records then discards under the same lock), ``remember_meta`` (headers seen, for
    ``Store.get_meta``), and two settings, ``hedge_after_s`` and ``verify_reads``. It counts in its own
    :class:`~kvstream.stats.ReaderCounters` (``counters``)."""

    def __init__(self, *, tiers: Sequence[DirectoryTier], health: Sequence[CircuitBreaker], memory: HostMemoryTier,
                 read_windows: ReadWindows, router: ReadRouter, removals: Removals, lock: AbstractContextManager[Any],
                 remember_meta: Callable[[ChunkHeader], None], hedge_after_s: float | None,
                 verify_reads: bool) -> None:
        self._tiers = tiers
        self._health = health
        self._memory = memory
        self._windows = read_windows
        self._router = router
        self._removals = removals
        self._lock = lock
        self._remember_meta = remember_meta
        self._hedge_after_s = hedge_after_s
        self._verify_reads = verify_reads
        self.counters = ReaderCounters()  # this reader's figures (Store.stats() copies them)
        self._openers = [ThreadPoolExecutor(max_workers=_OPEN_THREADS, thread_name_prefix=f"kvs-open-{t.name}")
                         for t in tiers]
        # Reads still in flight when their step ended (the other replica won, or the tier is stalled), per tier:
        # id(tag) -> [started, counted]. A tier whose leftovers stay out past hedge_after_s is failing even if
        # no step ever waited on it (windows and stealing hide a stall from the step itself).
        self._stragglers: list[dict[int, list[Any]]] = [{} for _ in self._tiers]
        self._straggler_lock = threading.Lock()
        self._active = 0  # steps begun and not ended, background ones (the catch-up's read-backs) excluded
        self._active_lock = threading.Lock()
        self._calls: set[_Call] = set()  # every step running now (guarded by _active_lock): close() wakes them
        self._closing = False  # set once by close(): running steps end, their unresolved chunks are misses
        self._submitting = 0  # threads inside a ring submission (guarded by _active_lock)
        self._quiet = threading.Condition(self._active_lock)  # notified when the last submission ends

    @property
    def active_steps(self) -> int:
        """Serving read steps in flight now (background work waits while this is above zero)."""
        return self._active

    def close(self) -> None:
        """The store is closing: every step running on another thread ends at once (its chunks not resolved
        yet are reported ``closed``: misses), and no step starts any more. Returns once no thread is inside a
        ring submission: no read is submitted after that (a refill, an open done, a hedge: each fails quietly,
        neither counted nor blamed on the tier), so the reads already submitted are all there is; they land on
        the rings (the store waits for those, within its timeout, before it closes them), and a read into a
        caller's target is still waited for by its own call, as ever."""
        with self._active_lock:
            self._closing = True
            calls = list(self._calls)
            # From here no read is submitted (a Submit completes as failed, quietly); wait for those being
            # submitted right now, so that a drain of the read rings after this covers every read there is.
            self._quiet.wait_for(lambda: self._submitting == 0, timeout=5.0)
        for call in calls:
            call.q.put(None)  # wake its consumer: it sees _closing and ends the step
        for ex in self._openers:  # a stuck open must not hold close(): its thread ends when the open does.
            # Queued opens are cancelled: their steps have ended (or end now), so nothing waits for them.
            ex.shutdown(wait=False, cancel_futures=True)

    @property
    def running_calls(self) -> int:
        """Steps begun and not ended (background ones included)."""
        with self._active_lock:
            return len(self._calls)

    # -- one step -------------------------------------------------------------------------------------------
    def run(self, keys: Sequence[bytes], holders: list[list[int]], mode: str, *,
            targets: list[CallerBuffer] | None = None, on_target_free: Callable[[int], None] | None = None,
            metas: Sequence[AccessMeta | None] | None = None,
            on_end: Callable[[ReadStep], None] | None = None,
            compute: ComputePlan | None = None, background: bool = False) -> Iterator[ReadOutcome]:
        """Read ``keys`` (each held by the tiers in ``holders``). Yields one :class:`ReadOutcome` per chunk,
        delivered ones as they land and lost ones last. ``mode``: ``chunks`` (payloads pinned in host memory),
        ``into`` (into ``targets``), ``headers`` (4 KiB headers only). ``on_end(step)`` runs once the step is over
        (not when the caller stops early), with the step's per-tier bytes and busy time. ``compute``: the GPU
        recomputes the step's front meanwhile (:mod:`kvstream.compute`); each :class:`Compute` waits its
        modelled seconds on a timer (replay's modelled GPU) and yields a ``computed`` outcome. ``background``:
        the step is the store's own work (not counted in :attr:`active_steps`)."""
        n_t = len(self._tiers)
        sizes = []
        for key, hs in zip(keys, holders):
            size = self._tiers[hs[0]].file_size(key) if hs else None
            sizes.append(HEADER_BYTES if mode == "headers" else (size or HEADER_BYTES))
        for t in range(n_t):
            if self._health[t].state == "half-open":
                # A probe: what was measured of the tier while it failed (a stall drives its speed estimate
                # toward zero) would shrink its window to one chunk and let the other tier's steals take even
                # that, so the probe would prove nothing. Unmeasured, it gets its full window and its share.
                self._windows.forget(t)
        windows = self._windows.windows()
        in_place = None
        in_place_tier = -1
        if mode == "into" and targets is not None:
            in_place = [t.capacity if t.direct_ok else 0 for t in targets]
            # A read into a target cannot be taken back, so only the fastest tier reads in place; the others
            # read into pooled buffers and are copied, and a steal by the fast tier lands in place while the
            # slow tier's late copy is simply dropped.
            in_place_tier = self._fastest_tier()
        hedge = self._hedge_after_s
        step = ReadStep(self._router.schedule(holders, n_t, front=compute.front if compute else 0), sizes, windows,
                        hedge_after_s=hedge, in_place=in_place, in_place_tier=in_place_tier,
                        report_busy=on_target_free is not None, header_bytes=HEADER_BYTES,
                        bandwidth=[self._windows.bandwidth_estimate(t) for t in range(n_t)], compute=compute)
        call = _Call(step, list(keys), mode, targets, on_target_free, metas)
        with self._lock:
            call.removal_seq = self._removals.now()
        if hedge:
            self._count_stragglers(hedge)
        with self._active_lock:
            closing = self._closing
            if not closing:
                self._calls.add(call)
                self._active += not background
        if closing:  # the store closed after this call checked it was open: nothing is read
            for j in range(len(keys)):
                yield ReadOutcome(j, "closed")
            return
        try:
            with call.mu:
                acts = step.start(time.monotonic())
            yield from self._carry_out(call, acts)
            while True:
                with call.mu:
                    if step.done or self._closing:
                        break
                    deadline = step.next_deadline()
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    with call.mu:
                        acts = step.tick(now, self._usable_tiers(now))
                    yield from self._carry_out(call, acts)
                    continue  # the tick may have resolved the step (busy targets): look again before waiting
                wait = 0.5 if deadline is None else min(max(deadline - time.monotonic(), 0.0005), 0.5)
                try:
                    tag = call.q.get(timeout=wait)
                except queue.Empty:
                    continue
                if tag is None:
                    continue
                if isinstance(tag, _Computed):
                    with call.mu:
                        acts = step.computed(tag.j, time.monotonic())
                        got = step.chunks[tag.j] is ChunkState.COMPUTED
                    yield from self._carry_out(call, acts)
                    if got:
                        yield ReadOutcome(tag.j, "computed", source="gpu")
                    continue
                with call.mu:
                    if step.reads[tag.rid].state is not ReadState.LANDED:
                        continue  # released meanwhile (cannot happen before close; defensive)
                ok = self._check(call, tag)
                with call.mu:
                    acts = step.checked(tag.rid, time.monotonic(), ok)
                yield from self._carry_out(call, acts)
        finally:
            with self._active_lock:
                self._calls.discard(call)
                self._active -= not background
            self._end(call)
        if self._closing:  # ended by close(): nothing more is asked of the store (no copies ordered)
            for j, state in enumerate(step.chunks):
                if state is ChunkState.LOST or state is ChunkState.PENDING:
                    yield ReadOutcome(j, "closed" if state is ChunkState.PENDING else "lost")
            return
        if on_end is not None:
            on_end(step)
        for j, state in enumerate(step.chunks):
            if state is ChunkState.LOST:
                yield ReadOutcome(j, "lost")

    def _end(self, call: _Call) -> None:
        """The consumer is done or stopped early: abandon what is in flight, free what landed, and give the
        caller its targets back only once nothing writes into them (unless reported busy)."""
        step = call.step
        now = time.monotonic()
        with call.mu:
            acts = step.close(now)
            wait_for = [call.tags[rid] for rid in step.in_place_pending() if rid in call.tags]
            unused = list(call.opened.values())
            call.opened.clear()
        for fd, _ in unused:  # opened ahead for reads another tier made, or that the step never needed
            _close_quietly(fd)
        for a in acts:
            self._act(call, a)  # Release only: landed reads nobody checked (late) and copies that waited
        with call.cv:
            call.cv.wait_for(lambda: all(t.parts == 0 and t.fd < 0 for t in wait_for))
            leftovers = [t for rid, t in call.tags.items()
                         if step.reads[rid].state is ReadState.ABANDONED and not t.late]
            with self._straggler_lock:
                for tag in leftovers:
                    tag.late = True
                    self._stragglers[tag.tier][id(tag)] = [tag.started, False]
        for t in range(len(self._tiers)):
            self._tiers[t].counters.read_busy_s += step.busy_s[t]

    # -- actions --------------------------------------------------------------------------------------------
    def _carry_out(self, call: _Call, acts: list[Any]) -> Iterator[ReadOutcome]:
        """Carry out actions on the consumer's thread; yields what the step delivers. Every action is carried
        out before the first yield: a caller that stops at a yield must not leave a Release undone (its buffer
        would never go back to the pool)."""
        outcomes: list[ReadOutcome] = []
        for a in acts:
            if isinstance(a, Deliver):
                out = self._deliver(call, call.tags[a.read])
                if out is not None:
                    outcomes.append(out)
            elif isinstance(a, Busy):
                self.counters.read_into_abandoned += 1
                outcomes.append(ReadOutcome(a.chunk, "busy"))
            elif isinstance(a, Lost):
                pass  # reported at the end, with those lost on other threads (step.chunks)
            elif isinstance(a, Compute):
                # The modelled GPU: the chunk is recomputed after its seconds (a daemon timer, so a step that
                # ends first leaves nothing behind but a marker on a queue nobody reads).
                timer = threading.Timer(a.seconds, call.q.put, args=(_Computed(a.chunk),))
                timer.daemon = True
                timer.start()
            else:
                self._act(call, a)
        yield from outcomes

    def _act(self, call: _Call, a: Any) -> None:
        """Actions any thread may carry out (the consumer's, an open thread, a ring thread)."""
        if isinstance(a, Open):
            tag = _Tag(rid=a.read, tier=a.tier, j=a.chunk, key=call.keys[a.chunk], started=time.monotonic())
            with call.mu:
                call.tags[a.read] = tag
                ahead = call.opened.pop((a.tier, a.chunk), None)
            if self._closing:  # no new reads once the store closes: the open fails (one opened ahead is closed)
                if ahead is not None:
                    _close_quietly(ahead[0])
                self._open_done(call, tag, None, None)
                return
            if a.hedged:
                self.counters.hedged_reads += 1
            if ahead is not None:  # opened ahead: submit from this thread at once (no hop, no syscall)
                self._open_done(call, tag, ahead, None)
                return
            try:
                self._openers[a.tier].submit(self._open, call, tag)
            except RuntimeError:  # the store is closing: the open fails
                self._open_done(call, tag, None, None)
        elif isinstance(a, Submit):
            self._submit(call, call.tags[a.read], a)
            self._want_open_ahead(call, call.tags[a.read].tier)
        elif isinstance(a, Release):
            landed = call.tags.get(a.read)
            if landed is not None and call.step.reads[a.read].state is ReadState.DUPLICATE:
                self._tiers[landed.tier].counters.duplicate_chunks += 1  # read, checked, not needed
            self._release(call, landed, late=a.late)
        elif isinstance(a, Stalled):
            self.counters.stalled_reads += 1
            now = time.monotonic()
            with call.mu:  # since when the tier's oldest read of this step is out
                since = min((tag.started for rid, tag in call.tags.items() if tag.tier == a.tier
                             and call.step.reads[rid].state in (ReadState.OPENING, ReadState.IN_FLIGHT)),
                            default=now)
            self._health[a.tier].on_stall(now, since)

    def _act_elsewhere(self, call: _Call, acts: list[Any]) -> None:
        """Carry out actions on an open or ring thread. A chunk lost there is already resolved in the step (the
        consumer reports it at the end); the consumer is woken so it sees the step may be done."""
        for a in acts:
            if isinstance(a, Lost):
                call.q.put(None)
            else:
                self._act(call, a)

    def _want_open_ahead(self, call: _Call, t: int) -> None:
        """Queue one open-ahead task for tier ``t`` unless one is pending."""
        with call.mu:
            if call.opening_ahead[t] or call.step.closed or len(call.opened) >= _MAX_OPENED_AHEAD:
                return
            call.opening_ahead[t] = True
        try:
            self._openers[t].submit(self._open_ahead, call, t)
        except RuntimeError:
            with call.mu:
                call.opening_ahead[t] = False

    def _open_ahead(self, call: _Call, t: int) -> None:
        """On tier ``t``'s open thread: open the files the tier will claim next (``peek``: a hint, claiming
        nothing; about as many as it has reads in flight), so that when a read lands the refill on the ring
        thread only claims and submits. Why: the device shares itself between readers and writers by what is
        queued when it dispatches, and a refill that waits for an open loses the tier its place
        (write-load-diag/refill_mechanics.py: 0.56 vs 0.72 GB/s, raw reader 0.74). Best effort: a file that
        will not open here is opened again, and reported, by its read."""
        tier = self._tiers[t]
        try:
            with call.mu:
                if call.step.closed:
                    return
                want = [j for j in call.step.sched.peek(t, max(call.step.active(t), 1)) if (t, j) not in call.opened]
            for j in want:
                got = tier.open_ahead(call.keys[j])
                if got is None:
                    continue
                with call.mu:
                    if not call.step.closed and (t, j) not in call.opened:
                        call.opened[(t, j)] = got
                        continue
                _close_quietly(got[0])
        finally:
            with call.mu:
                call.opening_ahead[t] = False

    def _open(self, call: _Call, tag: _Tag) -> None:
        """On the tier's open thread. A read whose chunk was resolved (or whose step ended) while it waited
        behind the tier's other opens is not opened at all: a slow tier's queue of opens would otherwise hold
        every later step's opens behind a finished step's."""
        tier = self._tiers[tag.tier]
        with call.mu:
            skip = not call.step.needed(tag.rid)
            acts = call.step.not_needed(tag.rid, time.monotonic()) if skip else []
        if skip:
            self._act_elsewhere(call, acts)
            return
        err: TierError | None = None
        got = None
        try:
            got = tier.open_for_read(tag.key)
        except TierError as exc:
            err = exc
        except Exception as exc:  # noqa: BLE001 — an open thread must answer the step whatever happens
            log.exception("read: open failed unexpectedly")
            err = TierError(tier.name, "open", None, str(exc))
        self._open_done(call, tag, got, err)

    def _open_done(self, call: _Call, tag: _Tag, got: tuple[int, int] | None, err: TierError | None) -> None:
        now = time.monotonic()
        if err is not None:
            if err.errno not in SHORTAGE:  # out of descriptors (or memory) is this process's shortage
                self._health[tag.tier].on_failure(now)
            log.warning("%s", err)
        with call.mu:
            if got is None:
                acts = call.step.open_failed(tag.rid, now)
            else:
                fd, size = got
                tag.fd = fd
                nbytes = HEADER_BYTES if call.mode == "headers" else size
                acts = call.step.opened(tag.rid, now, nbytes)
                for a in acts:
                    if isinstance(a, Submit):
                        tag.nbytes = a.nbytes
                        tag.parts = 2 if a.in_place else 1
        self._act_elsewhere(call, acts)

    def _submit(self, call: _Call, tag: _Tag, a: Submit) -> None:
        memory = self._memory
        ring = self._tiers[tag.tier].read_ring
        if a.in_place:
            target = call.targets[tag.j]  # type: ignore[index]
            tag.target = target
            tag.buf, tag.pooled = memory.allocate_or_overflow(HEADER_BYTES)
            ops = [IOOp(kind=OpKind.READ, fd=tag.fd, buf=tag.buf, length=HEADER_BYTES, offset=0,
                        callback=lambda op: self._on_complete(call, op), tag=tag),
                   IOOp(kind=OpKind.READ, fd=tag.fd, buf=target, length=a.nbytes - HEADER_BYTES,  # type: ignore[arg-type]
                        offset=HEADER_BYTES, callback=lambda op: self._on_complete(call, op), tag=tag)]
        else:
            tag.buf, tag.pooled = memory.allocate_or_overflow(a.nbytes)
            ops = [IOOp(kind=OpKind.READ, fd=tag.fd, buf=tag.buf, length=a.nbytes, offset=0,
                        callback=lambda op: self._on_complete(call, op), tag=tag)]
        try:
            with self._active_lock:  # the check and the count together: close() then waits for this submit
                if self._closing:
                    raise StoreClosedError("store is closing")
                self._submitting += 1
            try:
                ring.submit(ops)
            finally:
                with self._active_lock:
                    self._submitting -= 1
                    if not self._submitting and self._closing:
                        self._quiet.notify_all()
        except (StoreClosedError, OSError) as exc:
            err = -(getattr(exc, "errno", None) or 5)
            for op in ops:
                op.result, op.completed_at, op.submitted_at = err, time.monotonic(), time.monotonic()
                self._on_complete(call, op)

    def _on_complete(self, call: _Call, op: IOOp) -> None:
        """On the ring thread: one op of a read is done; when its last is, the step hears that it landed."""
        tag = op.tag
        assert isinstance(tag, _Tag)
        with call.mu:
            tag.parts -= 1
            if tag.result >= 0:
                tag.result = op.result if op.result < 0 else tag.result + op.result
            tag.latency = max(tag.latency, op.completed_at - op.submitted_at)
            if tag.parts:
                return
            try:
                acts = call.step.landed(tag.rid, time.monotonic())
            except Exception:  # a ring thread must survive; never expected
                log.exception("read: landed event failed")
                return
            if call.step.reads[tag.rid].state is ReadState.LANDED:
                call.q.put(tag)
            call.cv.notify_all()
        try:
            self._act_elsewhere(call, acts)
        except Exception:  # a ring thread must survive; the consumer refills again when it checks the read
            log.exception("read: refill from a completion failed")

    def _release(self, call: _Call, tag: _Tag | None, *, late: bool) -> None:
        """Free a read's descriptor and buffer; a straggler's end is counted against its tier; a busy target
        goes back to its caller."""
        if tag is None:
            return
        fd = tag.fd
        tag.fd = -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        if tag.buf is not None:
            self._memory.release(tag.buf, tag.pooled)
            tag.buf = None
        if late:
            with self._straggler_lock:
                self._stragglers[tag.tier].pop(id(tag), None)
            if tag.result > 0:
                self._tiers[tag.tier].counters.duplicate_chunks += 1
                # A probe read that lost its race to the other replica still shows the tier answers again.
                health = self._health[tag.tier]
                if tag.result >= tag.nbytes and health.state == "half-open" and health.on_success(time.monotonic()):
                    self._windows.forget(tag.tier)
            elif tag.result < 0 and -tag.result not in _GONE and not self._closing:
                # Nobody waited for this read (the other replica won), but the tier still failed it: the breaker
                # must hear of it, or a tier that only ever loses races would never be taken out.
                self._tiers[tag.tier].counters.read_errors += 1
                self._health[tag.tier].on_failure(time.monotonic())
        if tag.target is not None and call.step.reads[tag.rid].busy:  # set under mu before this Release existed
            tag.target.release()
            if call.on_target_free is not None:
                try:
                    call.on_target_free(tag.j)
                except Exception:  # the caller's callback must not break a store thread
                    log.exception("read_into: on_target_free raised")
        with call.cv:
            call.cv.notify_all()

    # -- the consumer's work --------------------------------------------------------------------------------
    def _check(self, call: _Call, tag: _Tag) -> bool:
        """Verify a landed read (header, key, length, checksum; in the caller's target for a read in place); on
        failure re-read the file once into the same buffers and verify again, and quarantine only if that
        fails too (:mod:`kvstream.tiers.recheck`: a bit flipped on the way or a short read is not a damaged
        file). Closes the descriptor either way."""
        tier = self._tiers[tag.tier]
        if tag.fd >= 0:
            _close_quietly(tag.fd)
            tag.fd = -1
        where = f"{tier.name}:{tier.relpath(tag.key)}"
        if tag.result < 0:
            if not self._closing:  # a ring closed under the read is the store's doing, not the tier's
                self._read_failed(tag.tier, tag.key, tag.result, where)
            return False
        t0 = time.perf_counter()
        try:
            got = self._verify(call, tag, where)
            header = self._recheck(call, tag, where, got) if isinstance(got, CorruptChunkError) else got
            if header is None:
                return False
        finally:
            self.counters.verify_seconds += time.perf_counter() - t0
        c = tier.counters
        c.read_bytes += tag.result
        c.read_chunks += 1
        c.note_latency(tag.latency)
        if self._health[tag.tier].on_success(time.monotonic()):  # recovered: its speed estimate carries the fault
            self._windows.forget(tag.tier)
        self._remember_meta(header)
        tag.header = header
        return True

    def _verify(self, call: _Call, tag: _Tag, where: str) -> ChunkHeader | CorruptChunkError:
        """The header of the ``tag.result`` bytes that landed if they are the chunk asked for, whole (and its
        payload's checksum matches, with ``verify_reads``), else the check that failed."""
        assert tag.buf is not None
        view = tag.buf.view(0, min(tag.result, HEADER_BYTES) if tag.target is not None else tag.result)
        try:
            header = decode_header(view[:HEADER_BYTES], where=where, expect_key=tag.key)
            if call.mode != "headers":
                if tag.result < header.file_size:
                    raise CorruptChunkError(where, f"truncated file ({tag.result} of {header.file_size} B)")
                if self._verify_reads:
                    if tag.target is not None:
                        payload = tag.target.view(0, header.payload_len)
                    else:
                        payload = view[HEADER_BYTES: HEADER_BYTES + header.payload_len]
                    try:
                        verify_payload(header, payload, where=where)
                    finally:
                        payload.release()
            return header
        except CorruptChunkError as exc:
            return exc
        finally:
            view.release()

    def _recheck(self, call: _Call, tag: _Tag, where: str, first: CorruptChunkError) -> ChunkHeader | None:
        """A landed read failed verification: read the file again (a fresh descriptor, plain ``preadv``) into
        the read's own buffers (it owns them until released: no other read writes there) and verify again.
        The header on success; None if the chunk cannot be delivered from this tier now. The file is
        quarantined only on a second failed verification of the same file; an I/O error or a vanished name on
        the re-read is no verdict (counted as a read error, or a miss)."""
        tier = self._tiers[tag.tier]
        c = tier.counters
        c.read_retried += 1
        assert tag.buf is not None
        if tag.target is not None:
            views = [tag.buf.view(0, HEADER_BYTES), tag.target.view(0, tag.nbytes - HEADER_BYTES)]
        else:
            views = [tag.buf.view(0, tag.nbytes)]
        try:
            n, ino = reread_into(tier.path_for(tag.key), views)
        finally:
            for v in views:
                v.release()
        if n < 0:
            if -n in _GONE:
                tier.on_missing(tag.key)
            else:
                c.read_errors += 1
                self._health[tag.tier].on_failure(time.monotonic())
                log.warning("tier %s: %s failed verification (%s) and its re-read failed: %s; the file is kept",
                            tier.name, where, first.reason, os.strerror(-n))
            return None
        tag.result = n
        got = self._verify(call, tag, where)
        if not isinstance(got, CorruptChunkError):
            c.read_transient += 1
            log.warning("tier %s: %s failed verification (%s), then read back intact: a fault on the way, the file "
                        "is kept", tier.name, where, first.reason)
            return got
        if n >= tag.nbytes and call.mode != "headers":
            # The buffers were full: the file may be larger than the read was sized (it changed since the open).
            # Only a check of the whole file by its own header may condemn it.
            try:
                _size, ino, why = check_chunk_file(tier.path_for(tag.key), tag.key, limit=tier.cfg.capacity_bytes)
            except OSError as exc:
                why = None
                if exc.errno in _GONE:
                    tier.on_missing(tag.key)
            if why is None:
                return None  # whole and valid now (put again while we read): a miss here, nothing to quarantine
            got = CorruptChunkError(where, why)
        tier.quarantine(tag.key, got.reason, ino=ino)
        return None

    def _read_failed(self, t: int, key: bytes, result: int, where: str) -> None:
        """A read (of a whole chunk or of its header) returned ``-errno``: a missing file (ENOENT, or ESTALE: a
        peer deleted it under our descriptor) is a miss (see ``DirectoryTier.on_missing``); any other error
        counts against the tier and its breaker."""
        tier = self._tiers[t]
        if -result in _GONE:
            tier.on_missing(key)
        else:
            tier.counters.read_errors += 1
            self._health[t].on_failure(time.monotonic())
            log.warning("tier %s: read of %s failed: %s", tier.name, where, os.strerror(-result))

    def _deliver(self, call: _Call, tag: _Tag) -> ReadOutcome | None:
        """Hand a delivered read to the caller: pinned in host memory (chunks), copied into its target (into),
        or its header (headers). Ownership of the buffer moves to host memory or is released here."""
        header = tag.header
        assert header is not None
        tier = self._tiers[tag.tier]
        self.counters.disk_hits += call.mode != "headers"
        if call.mode != "headers":
            tier.on_hit(tag.key)
        if call.mode == "headers":
            self._release(call, tag, late=False)
            return ReadOutcome(tag.j, "delivered", tier.name, header)
        if call.mode == "into":
            if tag.target is not None:  # read in place: the payload is in the target, verified there
                self._release(call, tag, late=False)
                self.counters.read_into_direct += 1
                return ReadOutcome(tag.j, "delivered", tier.name, header)
            target = call.targets[tag.j]  # type: ignore[index]
            n = header.payload_len
            if n > target.capacity:
                self._release(call, tag, late=False)
                return ReadOutcome(tag.j, "too_small", tier.name, header)
            assert tag.buf is not None
            target.view(0, n)[:] = tag.buf.view(HEADER_BYTES, HEADER_BYTES + n)
            self.counters.read_into_copied += 1
            self._keep(call, tag, header)
            return ReadOutcome(tag.j, "delivered", tier.name, header)
        payload = self._keep(call, tag, header, want_view=True)
        return ReadOutcome(tag.j, "delivered", tier.name, header, payload)

    def _keep(self, call: _Call, tag: _Tag, header: ChunkHeader, *, want_view: bool = False) -> memoryview | None:
        """A delivered read's buffer: cached in host memory if pooled (the view, made under the memory lock,
        pins it), else handed over as a view (an overflow buffer goes back to its pool, reused once the view is gone).

        A key removed since the step began is not cached: the caller still gets the bytes (the read
        linearises before the remove), but the entry leaves host memory at once, its buffer pinned only by the
        view (:mod:`kvstream.removals`)."""
        buf, pooled = tag.buf, tag.pooled
        tag.buf = None
        assert buf is not None
        if pooled:
            meta = call.metas[tag.j] if call.metas else None
            entry = MemEntry(key=tag.key, buf=buf, header=header)
            with self._lock:  # orders the check with Store.remove (which records, then discards, under it)
                cached, view = self._memory.insert_pinned(entry, meta=meta)
                if cached is entry and self._removals.removed_since(tag.key, call.removal_seq):
                    self._memory.discard(tag.key)
            if not want_view:
                view.release()
                return None
            return view
        # An overflow buffer: the caller's view (if any) is its only holder; it goes back to the overflow pool
        # now, parked there until that view is gone (never handed out while a view of it lives).
        out = buf.readonly(HEADER_BYTES, HEADER_BYTES + header.payload_len) if want_view else None
        self._memory.release(buf, False)
        return out

    # -- helpers --------------------------------------------------------------------------------------------
    def _usable_tiers(self, now: float) -> list[int]:
        return [t for t in range(len(self._tiers)) if self._health[t].usable(now)]

    def _fastest_tier(self) -> int:
        """The tier with the highest read bandwidth estimate (tier 0, the node-local one, until measured)."""
        rw = self._windows
        est = [rw.bandwidth_estimate(t) for t in range(len(self._tiers))]
        if any(e is None for e in est):
            return 0
        return max(range(len(est)), key=lambda t: est[t])  # type: ignore[arg-type, return-value]

    def _count_stragglers(self, hedge_after: float) -> None:
        """Leftover reads older than ``hedge_after`` are one stall of their tier per step, however many there are
        (a stall is one event; counting each stuck read would open the breaker on a single bad moment), dated by
        the oldest still out; the breaker decides whether it is a failure
        (:meth:`kvstream.health.CircuitBreaker.on_stall`: out past its floor with nothing delivered since).
        ``stalled_reads`` counts each late read once."""
        now = time.monotonic()
        with self._straggler_lock:
            late: dict[int, float] = {}  # tier -> since when its oldest read still out past the deadline is out
            n_late = 0
            for t, reads in enumerate(self._stragglers):
                for rec in reads.values():
                    if now - rec[0] > hedge_after:
                        late[t] = min(late.get(t, rec[0]), rec[0])
                        if not rec[1]:
                            rec[1] = True
                            n_late += 1
        self.counters.stalled_reads += n_late
        for t, since in late.items():  # a failure only if the tier is hung, not slow (health.on_stall)
            self._health[t].on_stall(now, since)
