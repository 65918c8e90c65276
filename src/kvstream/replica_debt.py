"""Owed replicas: a copy the replication policy asked for and the writer had to skip is deferred, not dropped.

A second copy is skipped at flush when its tier's write backlog is past ``write_backlog_bytes`` (a slow shared
tier must not fill host memory), when the tier's circuit breaker is open, or when its write fails with an I/O
error. Each such (chunk, tier) becomes a *debt*: :class:`OwedReplicas` keeps the set, persistently, and
:class:`CatchUp` pays it back in the background once the tier's backlog has drained below half its limit and
the tier is usable again — from host memory if the chunk is still there, else by reading it back from a tier
that holds it. A debt ends when the copy is published on the tier, or when the chunk is nowhere any more
(evicted by policy from every tier: nothing is left to copy, and nothing was lost that policy did not drop).
The rules themselves (the backlog valve that skips a copy, the catch-up's order, deferring and back-off) are
sans-I/O objects in :mod:`kvstream.debt_policy`, which the simulator drives too; this module carries them out.

Persistence: a journal of text lines in the first tier's folder, ``owed/<node_id>.log`` (``+TIER KEYHEX`` owes,
``-TIER KEYHEX`` pays). Write-ahead: every copy the writer issues is journalled (``+``) *before* it is issued
(:meth:`OwedReplicas.intend`) and cleared (``-``) when it lands, so a copy in flight when the process is killed,
or when ``close(timeout)`` gives up on a stalled tier, is owed at the next open (87 of 87 such copies were
forgotten before). Appends are small and unsynced: a crash of the machine (not of the process) may forget the
records of its last moments (those chunks keep their first copy; ``kvstream verify --config`` finds what the
policy says is missing).

At open the whole journal is read, streamed in blocks (memory bounded by the live set, whatever the file's
size; it used to be read only to 64 MiB, and a probe lost 49 of 50 live debts past that), and rewritten as the
live set. Nothing read from it is trusted: a line that is not a known tier and a hex key of 1..64 bytes is
skipped, a line longer than any record is junk, and an unterminated last line (a crash mid-append) is dropped
with a warning. While open, the catch-up thread rewrites it (a temporary, fsynced, renamed over it; appends
made meanwhile are carried over) once it holds more than four records per live debt and at least 4096: with
write-ahead records a busy store appends two per copy, and it grew ~100 KB/min in a soak before.

When the first tier is the one failing, its journal fails with it, and the debts owed *to* it are exactly the
ones to keep. The journal then moves to a fallback on another tier (``owed/<node uid>.log`` there: a shared
tier's folder is every node's, so it is named by the node's unique id): the whole set is written there and
appends go on there. At open every journal found is read and the set is compacted into the first one that can
be written; the others are removed once it is.

Why full replication is checked by a scan too: a store that crashed before its journal reached the disk, or an
operator's ``verify --repair``, can find debts from the indexes alone (every chunk on the primary tier, not on
a tier that full replication also writes). :func:`full_replication_deficits` is that scan.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvstream.debt_policy import CatchUpPolicy, DebtAction
from kvstream.health import CircuitBreaker
from kvstream.stats import CatchUpCounters
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.memory import HostMemoryTier

__all__ = ["OwedReplicas", "CatchUp", "CatchUpPolicy", "DebtAction", "full_replication_deficits", "ReplicaReport",
           "check_replicas"]

log = logging.getLogger("kvstream.store")


_BLOCK = 1 << 20  # the journal is read in blocks of this size (bounded memory, whatever its length)
_MAX_LINE = 512  # longer than any valid record ("+" tier name, space, 128 hex digits): junk, skipped
_COMPACT_MIN_LINES = 4096  # the journal is rewritten once it has this many lines and ...
_COMPACT_RATIO = 4  # ... more than this many per live debt


class OwedReplicas:
    """The set of (tier name, key) copies owed, with its journal. Thread-safe.

    A debt is *owed* (the catch-up pays it) or *in flight* (a copy of it handed to a writer: :meth:`intend`).
    Both are journalled: a copy is recorded before it is issued and cleared when it lands (:meth:`paid`), so a
    process killed, or closed past its timeout, while copies are in flight finds them owed at its next open."""

    def __init__(self, folder: Path | None, node_id: str, tier_names: Iterable[str], *,
                 fallback: Path | None = None) -> None:
        """``folder``/``node_id``.log is the journal; ``fallback`` (a file on another tier) takes over when it
        cannot be written (module docstring)."""
        self._lock = threading.Lock()
        self._tiers = list(tier_names)
        self._owed: dict[str, dict[bytes, None]] = {t: {} for t in self._tiers}  # insertion-ordered sets
        self._inflight: dict[str, dict[bytes, None]] = {t: {} for t in self._tiers}  # copies issued, not landed
        self._fd: int | None = None
        self.journal_errors = 0
        self.compactions = 0  # journal rewrites while open (the one at open not counted)
        self.torn_records = 0  # unterminated last records dropped at open (a crash mid-append)
        self._lines = 0  # records in the journal file now (what a compaction weighs against the live set)
        self._compacting: list[str] | None = None  # records appended while a compaction writes its snapshot
        self._candidates = [p for p in (folder / f"{node_id}.log" if folder is not None else None, fallback)
                            if p is not None]
        self.path: Path | None = None  # the journal in use (None: debts in memory only)
        if self._candidates:
            self._load_and_compact()

    # -- the set ---------------------------------------------------------------------------------------------
    def owe(self, tier: str, key: bytes) -> None:
        """The copy of ``key`` to ``tier`` is owed (skipped, or its write failed): the catch-up pays it."""
        with self._lock:
            if self._inflight[tier].pop(key, 0) is None:  # journalled when it was issued
                self._owed[tier][key] = None
            elif key not in self._owed[tier]:
                self._owed[tier][key] = None
                self._append(f"+{tier} {key.hex()}\n")

    def intend(self, tier: str, key: bytes) -> None:
        """A copy of ``key`` to ``tier`` is about to be issued: journal it first (write-ahead), so that if the
        process dies, or closes past its timeout, before it lands, the copy is owed at the next open. It ends
        with :meth:`paid` (landed, or no longer wanted) or :meth:`owe` (failed: the catch-up pays it)."""
        with self._lock:
            if key in self._inflight[tier]:
                return
            self._inflight[tier][key] = None
            if self._owed[tier].pop(key, 0) is not None:  # not journalled yet
                self._append(f"+{tier} {key.hex()}\n")

    def paid(self, tier: str, key: bytes) -> None:
        """The copy landed, or is no longer wanted (the chunk was removed, or is nowhere to copy from)."""
        with self._lock:
            was = self._owed[tier].pop(key, 0) is None
            was = self._inflight[tier].pop(key, 0) is None or was
            if was:
                self._append(f"-{tier} {key.hex()}\n")

    def owes(self, tier: str, key: bytes) -> bool:
        """True if the copy is owed or in flight (journalled, not landed)."""
        return key in self._owed[tier] or key in self._inflight[tier]

    def oldest(self, tier: str, n: int, skip: Container[bytes] = ()) -> list[bytes]:
        """Up to ``n`` debts of ``tier`` (owed, not in flight), oldest first, passing over those in ``skip``
        (they stay owed until :meth:`paid`)."""
        with self._lock:
            out: list[bytes] = []
            for k in self._owed[tier]:
                if len(out) >= n:
                    break
                if k not in skip:
                    out.append(k)
            return out

    def newest(self, tier: str, n: int, skip: Container[bytes] = ()) -> list[bytes]:
        """Up to ``n`` debts of ``tier`` (owed, not in flight), newest first: the ones most likely still in host
        memory; passing over those in ``skip``."""
        with self._lock:
            out: list[bytes] = []
            for k in reversed(self._owed[tier]):
                if len(out) >= n:
                    break
                if k not in skip:
                    out.append(k)
            return out

    def counts(self) -> dict[str, int]:
        """Per tier, copies owed (not counting those in flight: :meth:`inflight_counts`)."""
        with self._lock:
            return {t: len(d) for t, d in self._owed.items()}

    def inflight_counts(self) -> dict[str, int]:
        """Per tier, copies issued and not landed (journalled: owed at the next open if they never land)."""
        with self._lock:
            return {t: len(d) for t, d in self._inflight.items()}

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- the journal -----------------------------------------------------------------------------------------
    def _append(self, line: str) -> None:  # caller holds the lock
        if self._compacting is not None:
            self._compacting.append(line)
        if self._fd is None:
            return
        try:
            os.write(self._fd, line.encode())
            self._lines += 1
        except OSError as exc:  # a full or failing tier under the journal: the debt is still owed in memory
            self.journal_errors += 1
            if self.journal_errors in (1, 100):
                log.warning("owed replicas %s: journal append failed (%s)", self.path, exc.strerror or exc)
            self._move_on()

    def _live_lines(self) -> list[str]:  # caller holds the lock
        return [f"+{t} {k.hex()}\n" for src in (self._owed, self._inflight) for t, d in src.items() for k in d]

    def needs_compaction(self) -> bool:
        """True once the journal holds many more records than there are live debts (module docstring)."""
        with self._lock:
            live = sum(len(d) for d in self._owed.values()) + sum(len(d) for d in self._inflight.values())
            return (self._fd is not None and self._compacting is None and self._lines >= _COMPACT_MIN_LINES
                    and self._lines > _COMPACT_RATIO * live)

    def compact(self) -> bool:
        """Rewrite the journal as the live set (atomically: a temporary, fsynced, renamed over it). Appends go on
        meanwhile: the snapshot is written without the lock, and what was appended since is added under it
        before the rename. Returns True if rewritten. Called off the serving path (the catch-up thread)."""
        with self._lock:
            path = self.path
            if path is None or self._fd is None or self._compacting is not None:
                return False
            body = "".join(self._live_lines()).encode()
            self._compacting = []
        tmp = path.with_name(path.name + ".compact")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(body)
                f.flush()
                os.fsync(f.fileno())  # the rename must never leave an empty journal where debts were
        except OSError as exc:
            with self._lock:
                self._compacting = None
            log.warning("owed replicas %s: compaction failed (%s); the journal is kept as it is", path,
                        exc.strerror or exc)
            _unlink_quietly(tmp)
            return False
        with self._lock:
            extra, self._compacting = self._compacting, None
            if self.path != path or self._fd is None:  # the journal moved, or closed, meanwhile
                _unlink_quietly(tmp)
                return False
            try:
                if extra:
                    with open(tmp, "ab") as f:
                        f.write("".join(extra).encode())
                os.replace(tmp, path)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND)
            except OSError as exc:
                log.warning("owed replicas %s: compaction failed (%s); the journal is kept as it is", path,
                            exc.strerror or exc)
                _unlink_quietly(tmp)
                return False
            old, self._fd = self._fd, fd
            self._lines = body.count(b"\n") + len(extra)
            self.compactions += 1
        try:
            os.close(old)
        except OSError:
            pass
        return True

    def _move_on(self) -> None:
        """The journal in use failed: rewrite the whole set into the next candidate (caller holds the lock)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
        later = self._candidates[self._candidates.index(self.path) + 1:] if self.path in self._candidates else []
        for path in later:
            if self._rewrite(path):
                log.warning("owed replicas: journal moved to %s", path)
                return
        log.warning("owed replicas: no journal can be written; debts are kept in memory only")
        self.path = None

    def _rewrite(self, path: Path) -> bool:
        """Write the current set to ``path`` (atomically) and append there from now on."""
        try:
            path.parent.mkdir(mode=0o700, exist_ok=True)  # as the tier's own folders
            lines = self._live_lines()
            tmp = path.with_suffix(".tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write("".join(lines).encode())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            log.warning("owed replicas %s: journal unusable (%s)", path, exc.strerror or exc)
            return False
        self.path = path
        self._lines = len(lines)
        return True

    def _load_and_compact(self) -> None:
        readable = []
        for path in self._candidates:  # every journal a past run left (the fallback holds the newest debts)
            try:
                self._read_journal(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("owed replicas %s: journal unreadable (%s)", path, exc.strerror or exc)
                continue
            readable.append(path)
        for path in self._candidates:
            if self._rewrite(path):
                for old in readable:
                    if old != path:
                        _unlink_quietly(old)  # else read again at the next open: a debt owed twice is paid once
                return
        log.warning("owed replicas: no journal can be written; debts are kept in memory only")

    def _read_journal(self, path: Path) -> None:
        """Apply every record of ``path``, streamed in blocks (memory bounded by the live set, never by the
        file): nothing read is trusted (:meth:`_parse`), a line past ``_MAX_LINE`` is junk, and an unterminated
        last line is a torn append (a crash mid-write): dropped, with a warning."""
        carry = b""
        skipping = False  # inside a line already past _MAX_LINE: drop up to its newline
        with open(path, "rb") as f:
            while block := f.read(_BLOCK):
                lines = (carry + block).split(b"\n")
                carry = lines.pop()
                for raw in lines:
                    if skipping:  # the end of a line already past _MAX_LINE
                        skipping = False
                        continue
                    self._apply(raw)
                if len(carry) > _MAX_LINE:  # no valid record is this long: junk up to the next newline
                    carry = b""
                    skipping = True
        if carry:
            self.torn_records += 1
            log.warning("owed replicas %s: dropped a torn last record (%d B; a crash mid-append?)", path,
                        len(carry))

    def _apply(self, raw: bytes) -> None:
        parsed = self._parse(raw)
        if parsed is None:
            return
        sign, tier, key = parsed
        if sign == "+":
            self._owed[tier][key] = None
        else:
            self._owed[tier].pop(key, None)

    def _parse(self, raw: bytes) -> tuple[str, str, bytes] | None:
        if len(raw) > _MAX_LINE:
            return None
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            return None
        if len(text) < 4 or text[0] not in "+-" or " " not in text:
            return None
        tier, _, hexkey = text[1:].partition(" ")
        if tier not in self._owed or not 2 <= len(hexkey) <= 128 or len(hexkey) % 2:
            return None
        try:
            return text[0], tier, bytes.fromhex(hexkey)
        except ValueError:
            return None


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def full_replication_deficits(tiers: Sequence[DirectoryTier]) -> dict[str, list[bytes]]:
    """With ``replication: full``, the chunks this node's primary tier (``tiers[0]``) holds that another tier it
    writes to lacks (a shared tier's other chunks are other nodes', never a deficit of this one's)."""
    primary = tiers[0]
    keys = [k for k, _ in primary.index.items()]
    return {t.name: [k for k in keys if not t.contains(k)] for t in tiers[1:]}


@dataclass
class ReplicaReport:
    """Per tier: copies owed (journal) and, with ``replication: full``, chunks of the primary the tier lacks."""

    owed: dict[str, int]
    deficits: dict[str, int]
    repaired: bool = False  # check_replicas(repair=True) ran the catch-up to the end (or to its timeout)

    @property
    def missing(self) -> int:
        return sum(self.owed.values()) + sum(self.deficits.values())

    def to_dict(self) -> dict[str, object]:
        return {"owed": self.owed, "deficits": self.deficits, "repaired": self.repaired, "missing": self.missing}


def check_replicas(*, tiers: Sequence[DirectoryTier], owed: OwedReplicas, catch_up: "CatchUp",
                   drain: Callable[[float | None], bool], full: bool, repair: bool = False,
                   timeout_s: float = 300.0) -> ReplicaReport:
    """What ``kvstream verify --config`` reports (:meth:`kvstream.store.Store.check_replicas`): the copies owed
    and, with ``full`` replication, the deficits a scan finds. With ``repair`` every deficit becomes a debt and
    the store's own catch-up pays them (the one mechanism that writes owed copies), waiting up to ``timeout_s``
    (``drain`` waits for the writes); the report is then of what is left."""
    deficits = full_replication_deficits(tiers) if full else {}
    if repair:
        for tier, keys in deficits.items():
            for k in keys:
                owed.owe(tier, k)
        deadline = time.monotonic() + timeout_s
        while any(owed.counts().values()) and time.monotonic() < deadline:
            catch_up.poke()
            time.sleep(0.05)
        drain(max(0.0, deadline - time.monotonic()))
        deficits = full_replication_deficits(tiers) if full else {}
    return ReplicaReport(owed=owed.counts(), deficits={t: len(k) for t, k in deficits.items()}, repaired=repair)


class CopyQueue(Protocol):
    """What the catch-up needs of the store's writer (:class:`kvstream.writer.Writer`): each tier's write backlog
    and its valve's limit, a copy ordered from host memory, and the hand-over and wait of those copies."""

    def backlog(self, t: int) -> int: ...

    def backlog_limit(self, t: int) -> int | None: ...

    def order_copy(self, key: bytes, t: int) -> bool: ...

    def flush(self) -> int: ...

    def drain(self, timeout: float | None = None) -> bool: ...


class CatchUp:
    """Pays owed replicas back in the background (see the module docstring), by :class:`CatchUpPolicy`'s rules.
    One daemon thread per store; it also compacts the journal when it has grown (:meth:`OwedReplicas.compact`).
    At close, :meth:`pay` runs the same rounds on the closing thread, within the close's timeout.

    It is given what it pays with, not the store: ``tiers`` and ``health`` (one circuit breaker per tier),
    ``memory`` (where a copy is made from, and whether a read-back has room), ``owed`` (the debts), ``writer``
    (:class:`CopyQueue`), ``serving_steps`` (serving read steps in flight now: a read-back waits for them),
    ``read_back`` (read one chunk into host memory, as the store's own background work), ``closed`` (the store
    has closed) and ``chunk_bytes`` (the configured chunk size, 0 if unknown). It counts in its own
    :class:`~kvstream.stats.CatchUpCounters` (``counters``)."""

    def __init__(self, *, tiers: Sequence[DirectoryTier], health: Sequence[CircuitBreaker], memory: HostMemoryTier,
                 owed: OwedReplicas, writer: CopyQueue, serving_steps: Callable[[], int],
                 read_back: Callable[[bytes], None], closed: Callable[[], bool], chunk_bytes: int) -> None:
        self._tiers = tiers
        self._health = health
        self._memory = memory
        self.owed = owed
        self._writer = writer
        self._serving_steps = serving_steps
        self._read_back = read_back
        self._closed = closed
        self._chunk_bytes = chunk_bytes
        self.counters = CatchUpCounters()  # its figures (Store.stats() copies them; the policy keeps its own)
        self.policy = CatchUpPolicy()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvs-catch-up", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Something may have changed (a backlog drained, a breaker closed): look now, not at the next tick."""
        self._wake.set()

    def stop(self, timeout: float = 5.0) -> bool:
        """End the thread (a round in progress finishes first). True if it ended within ``timeout``."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.policy.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.round()
                if self.owed.needs_compaction():
                    self.owed.compact()
            except Exception:  # noqa: BLE001 — the thread must outlive one bad round; the debts stay owed
                log.exception("owed replicas: catch-up round failed")

    @property
    def copies_started(self) -> int:
        """Owed replicas handed to the writer."""
        return self.counters.copies_started

    @property
    def reads(self) -> int:
        """Owed replicas read back from another tier first."""
        return self.counters.reads

    @property
    def reads_deferred(self) -> int:
        """Read-backs put off because a serving read step was in flight."""
        return self.policy.reads_deferred

    def pay(self, deadline: float | None) -> None:
        """At close (the thread stopped): run rounds on this thread until nothing is owed, the ``deadline``
        (``time.monotonic()``; None: none) passes, or a round can do nothing (tiers out of routing, no room to
        read back): what is left stays journalled for the next open. Serving reads are not waited for."""
        while sum(self.owed.counts().values()) and (deadline is None or time.monotonic() < deadline):
            before = sum(self.owed.counts().values())
            self.round(final=True)
            self._writer.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if sum(self.owed.counts().values()) >= before:
                # nothing paid: copies handed over were refused or failed again (a tier whose chunks are all
                # pinned refuses each time), and another round would only repeat them until the deadline
                return

    def round(self, *, final: bool = False) -> int:
        """One pass over every tier's debts; returns the copies handed to the writer. ``final``: at close (no
        stop check, no back-off, no deferring to serving reads)."""
        writer = self._writer
        policy = self.policy
        started = 0
        now = time.monotonic()
        for debt in policy.tracked():  # debts that ended, or whose chunk is back in host memory
            if not self.owed.owes(*debt) or self._in_memory(debt[1]):
                policy.forget(debt)
        room = self._memory_room()
        try:
            for t in self._tiers:
                if not self.owed.counts()[t.name]:
                    continue
                if not policy.tier_ready(self._health[t.position].usable(time.monotonic()), writer.backlog(t.position),
                                         writer.backlog_limit(t.position)):
                    continue
                skip = set() if final else {k for tn, k in policy.given_up_now(now) if tn == t.name}
                picked = policy.select(self.owed.oldest(t.name, policy.batch, skip),
                                       self.owed.newest(t.name, policy.batch, skip), self._in_memory)
                for key in picked:
                    if self._closed() or (self._stop.is_set() and not final):
                        return started
                    debt = (t.name, key)
                    act = policy.decide(on_tier=t.contains(key), in_memory=self._in_memory(key),
                                        has_holder=any(o is not t and o.contains(key) for o in self._tiers),
                                        serving=self._serving_steps() > 0 and not final, room=room,
                                        now=None if final else now, debt=debt)
                    if act in (DebtAction.PAID, DebtAction.DROP):
                        self.owed.paid(t.name, key)
                        continue
                    if act in (DebtAction.DEFER, DebtAction.WAIT):
                        continue
                    if act is DebtAction.READ_BACK:
                        self.counters.reads += 1
                        self._read_back(key)  # lands in host memory (if it has room)
                        kept = self._in_memory(key)
                        policy.read_back_done(debt, time.monotonic(), kept)
                        room = room and kept  # not kept: host memory has no room for the rest of the round
                        if not kept:
                            continue
                    if writer.order_copy(key, t.position):
                        started += 1
        finally:
            policy.end_round()
        if started:
            writer.flush()
            self.counters.copies_started += started
        return started

    def _in_memory(self, key: bytes) -> bool:
        return self._memory.peek(key) is not None

    def _memory_room(self) -> bool:
        """Whether host memory could keep a chunk read back now: it has unallocated room, or a chunk it may
        evict (a clean one). A hint: a read-back that finds otherwise counts as not kept."""
        mem = self._memory
        if mem.capacity_bytes - mem.pool.in_use_bytes >= (self._chunk_bytes or 1):
            return True  # free buffers, or room to map more
        return mem.dirty_count() < len(mem)
