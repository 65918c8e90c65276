"""Owed replicas: a copy the replication policy asked for and the writer had to skip is deferred, not dropped.

A second copy is skipped at flush when its tier's write backlog is past ``write_backlog_bytes`` (a slow shared
tier must not fill host memory), when the tier's circuit breaker is open, or when its write fails with an I/O
error. Each such (chunk, tier) becomes a *debt*: :class:`OwedReplicas` keeps the set, persistently, and
:class:`CatchUp` pays it back in the background once the tier's backlog has drained below half its limit and
the tier is usable again — from host memory if the chunk is still there, else by reading it back from a tier
that holds it. A debt ends when the copy is published on the tier, or when the chunk is nowhere any more
(evicted by policy from every tier: nothing is left to copy, and nothing was lost that policy did not drop).

Persistence: a journal of text lines in the first tier's folder, ``owed/<node_id>.log`` (``+TIER KEYHEX`` owes,
``-TIER KEYHEX`` pays), rewritten compacted at open. Appends are small and unsynced: a crash may forget the
debts of its last moments (those chunks keep their first copy; ``kvstream verify --config`` finds what the
policy says is missing). Nothing read from the journal is trusted: a line that is not a known tier and a hex
key of 1..64 bytes is skipped.

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
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from kvstream.replication import FullReplication

if TYPE_CHECKING:
    from kvstream.store import Store

__all__ = ["OwedReplicas", "CatchUp", "CatchUpPolicy", "DebtAction", "full_replication_deficits", "ReplicaReport",
           "check_replicas"]

log = logging.getLogger("kvstream.store")
_K = TypeVar("_K", bound=Hashable)  # a debt's key: bytes in the store, the simulator's chunk ids


class OwedReplicas:
    """The set of (tier name, key) copies owed, with its journal. Thread-safe."""

    def __init__(self, folder: Path | None, node_id: str, tier_names: Iterable[str], *,
                 fallback: Path | None = None) -> None:
        """``folder``/``node_id``.log is the journal; ``fallback`` (a file on another tier) takes over when it
        cannot be written (module docstring)."""
        self._lock = threading.Lock()
        self._tiers = list(tier_names)
        self._owed: dict[str, dict[bytes, None]] = {t: {} for t in self._tiers}  # insertion-ordered sets
        self._fd: int | None = None
        self.journal_errors = 0
        self._candidates = [p for p in (folder / f"{node_id}.log" if folder is not None else None, fallback)
                            if p is not None]
        self.path: Path | None = None  # the journal in use (None: debts in memory only)
        if self._candidates:
            self._load_and_compact()

    # -- the set ---------------------------------------------------------------------------------------------
    def owe(self, tier: str, key: bytes) -> None:
        with self._lock:
            if key not in self._owed[tier]:
                self._owed[tier][key] = None
                self._append(f"+{tier} {key.hex()}\n")

    def paid(self, tier: str, key: bytes) -> None:
        with self._lock:
            if self._owed[tier].pop(key, 0) is None:
                self._append(f"-{tier} {key.hex()}\n")

    def owes(self, tier: str, key: bytes) -> bool:
        return key in self._owed[tier]

    def oldest(self, tier: str, n: int) -> list[bytes]:
        """Up to ``n`` debts of ``tier``, oldest first (they stay owed until :meth:`paid`)."""
        with self._lock:
            out: list[bytes] = []
            for k in self._owed[tier]:
                if len(out) >= n:
                    break
                out.append(k)
            return out

    def newest(self, tier: str, n: int) -> list[bytes]:
        """Up to ``n`` debts of ``tier``, newest first: the ones most likely still in host memory."""
        with self._lock:
            out: list[bytes] = []
            for k in reversed(self._owed[tier]):
                if len(out) >= n:
                    break
                out.append(k)
            return out

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {t: len(d) for t, d in self._owed.items()}

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    # -- the journal -----------------------------------------------------------------------------------------
    def _append(self, line: str) -> None:
        if self._fd is None:
            return
        try:
            os.write(self._fd, line.encode())
        except OSError as exc:  # a full or failing tier under the journal: the debt is still owed in memory
            self.journal_errors += 1
            if self.journal_errors in (1, 100):
                log.warning("owed replicas %s: journal append failed (%s)", self.path, exc.strerror or exc)
            self._move_on()

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
            body = "".join(f"+{t} {k.hex()}\n" for t, d in self._owed.items() for k in d).encode()
            tmp = path.with_suffix(".tmp")
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
                f.write(body)
            os.replace(tmp, path)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        except OSError as exc:
            log.warning("owed replicas %s: journal unusable (%s)", path, exc.strerror or exc)
            return False
        self.path = path
        return True

    def _load_and_compact(self) -> None:
        readable = []
        for path in self._candidates:  # every journal a past run left (the fallback holds the newest debts)
            try:
                with open(path, "rb") as f:
                    data = f.read(64 << 20)  # a journal past 64 MiB is damaged or foreign: read what fits
            except FileNotFoundError:
                continue
            except OSError as exc:
                log.warning("owed replicas %s: journal unreadable (%s)", path, exc.strerror or exc)
                continue
            readable.append(path)
            for raw in data.split(b"\n"):
                parsed = self._parse(raw)
                if parsed is None:
                    continue
                sign, tier, key = parsed
                if sign == "+":
                    self._owed[tier][key] = None
                else:
                    self._owed[tier].pop(key, None)
        for path in self._candidates:
            if self._rewrite(path):
                for old in readable:
                    if old != path:
                        try:
                            os.unlink(old)
                        except OSError:
                            pass  # read again at the next open: a debt owed twice is paid once
                return
        log.warning("owed replicas: no journal can be written; debts are kept in memory only")

    def _parse(self, raw: bytes) -> tuple[str, str, bytes] | None:
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


def full_replication_deficits(store: "Store") -> dict[str, list[bytes]]:
    """With ``replication: full``, the chunks this node's primary tier holds that another tier it writes to
    lacks (a shared tier's other chunks are other nodes', never a deficit of this one's)."""
    primary = store.tiers[0]
    keys = [k for k, _ in primary.index.items()]
    return {t.name: [k for k in keys if not t.contains(k)] for t in store.tiers[1:]}


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


def check_replicas(store: "Store", *, repair: bool = False, timeout_s: float = 300.0) -> ReplicaReport:
    """What ``kvstream verify --config`` reports: the copies owed and the deficits a scan finds. With ``repair``
    every deficit becomes a debt and the store's own catch-up pays them (the one mechanism that writes owed
    copies), waiting up to ``timeout_s``; the report is then of what is left."""
    full = isinstance(store.replication, FullReplication)  # the parsed policy, not the config's spelling
    deficits = full_replication_deficits(store) if full else {}
    if repair:
        for tier, keys in deficits.items():
            for k in keys:
                store.owed.owe(tier, k)
        deadline = time.monotonic() + timeout_s
        while any(store.owed.counts().values()) and time.monotonic() < deadline:
            store._catch_up.poke()
            time.sleep(0.05)
        store.drain(max(0.0, deadline - time.monotonic()))
        deficits = full_replication_deficits(store) if full else {}
    return ReplicaReport(owed=store.owed.counts(), deficits={t: len(k) for t, k in deficits.items()},
                         repaired=repair)


class DebtAction(Enum):
    """What a catch-up round does with one debt."""

    PAID = "paid"  # the tier holds the chunk already: the debt ends
    DROP = "drop"  # the chunk is nowhere else (evicted by policy everywhere): nothing to copy, the debt ends
    COPY = "copy"  # in host memory: order the copy
    READ_BACK = "read-back"  # read it from a holder tier into host memory, then order the copy
    DEFER = "defer"  # a read-back while a serving read step is in flight: the next round


class CatchUpPolicy:
    """The catch-up's rules, sans-I/O: the store's :class:`CatchUp` thread and the simulator's model
    (``kvstream.sim.storage``) drive one each, so the simulator pays debts as the store does.

    A round looks every ``interval_s``; per tier that is usable and whose write backlog is below half its limit
    (:meth:`tier_ready`) it takes up to ``batch`` debts in the order :meth:`select` gives and asks :meth:`decide`
    for each. Debts whose chunk is still in host memory go first, newest first: a copy from memory costs the
    owed tier's write and nothing else, while a debt left until its chunk is evicted costs a read-back from the
    tier that serves the loads (in ``kvstream replay``'s default, before this rule, 76-86 read-backs of 48 MiB
    from the local tier per minute, during loads). A read-back (the chunk left host memory) waits while a serving
    read step is in flight: it would take the holder tier's bandwidth from a load on the critical path. Under
    reads that never pause it goes on anyway once ``max_deferred_rounds`` rounds in a row deferred one (30 s), so
    debts cannot starve. State: the count of rounds in a row that deferred (:meth:`end_round`)."""

    interval_s = 0.25
    batch = 16  # chunks per tier per round: catch-up must not crowd the serving path's reads and writes
    max_deferred_rounds = 120

    def __init__(self) -> None:
        self.deferred_rounds = 0
        self.reads_deferred = 0
        self._deferred_now = False

    @staticmethod
    def tier_ready(usable: bool, backlog: int, limit: int | None) -> bool:
        """Whether a round pays this tier's debts now."""
        return usable and (limit is None or backlog < limit // 2)

    def select(self, oldest: list[_K], newest: list[_K], in_memory: Callable[[_K], bool]) -> list[_K]:
        """The debts one tier's round looks at, in order: of the ``newest`` and ``oldest`` debts (each up to
        ``batch``, as the caller found them), those whose chunk ``in_memory`` says host memory holds, newest
        first, then the rest oldest first; at most ``batch``."""
        seen: set[_K] = set()
        resident: list[_K] = []
        for k in newest:
            if k not in seen and in_memory(k):
                seen.add(k)
                resident.append(k)
        rest = [k for k in oldest if k not in seen]
        return (resident + rest)[: self.batch]

    def decide(self, *, on_tier: bool, in_memory: bool, has_holder: bool, serving: bool) -> DebtAction:
        """One debt: ``on_tier`` (the owed tier holds it now), ``in_memory`` (host memory holds it),
        ``has_holder`` (another tier holds it), ``serving`` (a serving read step is in flight)."""
        if on_tier:
            return DebtAction.PAID
        if in_memory:
            return DebtAction.COPY
        if not has_holder:
            return DebtAction.DROP
        if serving and self.deferred_rounds < self.max_deferred_rounds:
            self.reads_deferred += 1
            self._deferred_now = True
            return DebtAction.DEFER
        return DebtAction.READ_BACK

    def end_round(self) -> None:
        self.deferred_rounds = self.deferred_rounds + 1 if self._deferred_now else 0
        self._deferred_now = False


class CatchUp:
    """Pays owed replicas back in the background (see the module docstring), by :class:`CatchUpPolicy`'s rules.
    One daemon thread per store."""

    def __init__(self, store: "Store", owed: OwedReplicas) -> None:
        self.store = store
        self.owed = owed
        self.copies_started = 0
        self.reads = 0
        self.policy = CatchUpPolicy()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvs-catch-up", daemon=True)
        self._thread.start()

    def poke(self) -> None:
        """Something may have changed (a backlog drained, a breaker closed): look now, not at the next tick."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.policy.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.round()
            except Exception:  # noqa: BLE001 — the thread must outlive one bad round; the debts stay owed
                log.exception("owed replicas: catch-up round failed")

    @property
    def reads_deferred(self) -> int:
        """Read-backs put off because a serving read step was in flight."""
        return self.policy.reads_deferred

    def round(self) -> int:
        """One pass over every tier's debts; returns the copies handed to the writer."""
        store = self.store
        writer = store._writer
        policy = self.policy
        started = 0
        try:
            for t in store.tiers:
                if not self.owed.counts()[t.name]:
                    continue
                if not policy.tier_ready(store._usable(t.position), writer.backlog(t.position),
                                         writer.backlog_limit(t.position)):
                    continue
                picked = policy.select(self.owed.oldest(t.name, policy.batch), self.owed.newest(t.name, policy.batch),
                                       self._in_memory)
                for key in picked:
                    if store._closed or self._stop.is_set():
                        return started
                    act = policy.decide(on_tier=t.contains(key), in_memory=self._in_memory(key),
                                        has_holder=any(o is not t and o.contains(key) for o in store.tiers),
                                        serving=store._reader.active_steps > 0)
                    if act in (DebtAction.PAID, DebtAction.DROP):
                        self.owed.paid(t.name, key)
                        continue
                    if act is DebtAction.DEFER:
                        continue
                    if act is DebtAction.READ_BACK:
                        self.reads += 1
                        for _i, _chunk in store.read_chunks([key], background=True):  # lands in host memory
                            pass
                    if store._writer.order_copy(key, t.position):
                        started += 1
        finally:
            policy.end_round()
        if started:
            store.flush()
            self.copies_started += started
        return started

    def _in_memory(self, key: bytes) -> bool:
        return self.store.memory.peek(key) is not None
