"""The rules of owed replicas, sans-I/O: when the writer skips a second copy (:class:`BacklogValve`) and how the
debts that leaves are paid back (:class:`CatchUpPolicy`).

Both are plain, deterministic objects: they take what the driver saw (a tier's write backlog in bytes, how many
copies a chunk has, whether host memory holds it, the time) and return a decision; they never touch a file, a
lock or a clock of their own. Two drivers use the very same objects: the store (:class:`kvstream.writer.Writer`
asks the valve at every flush, :class:`kvstream.replica_debt.CatchUp` runs the catch-up rounds on its thread)
and the simulator (:class:`kvstream.sim.storage.SimStorage`, in simulated time), so the simulator skips and pays
copies exactly as the store does. The debts themselves (the set and its journal) are
:class:`kvstream.replica_debt.OwedReplicas`'s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from enum import Enum
from typing import TypeVar

__all__ = ["BacklogValve", "CatchUpPolicy", "Debt", "DebtAction", "ValveDecision"]

_K = TypeVar("_K", bound=Hashable)  # a debt's key: bytes in the store, the simulator's chunk ids


class ValveDecision(Enum):
    """What the backlog valve says of one copy at flush."""

    WRITE = "write"  # hand the copy to the tier's writer
    OWE = "owe"  # skip it, owed: the catch-up writes it once the tier's backlog has drained
    SKIP = "skip"  # skip it for good: a limit of 0 (the operator wants one copy, the first)


class BacklogValve:
    """The write backlog valve: a slow tier must not fill host memory with copies waiting for it.

    At flush the copies of a chunk are asked for in tier order (the first, fastest tier takes the copy that is
    never skipped). A copy is skipped when the chunk already has one (``copies``: on a tier, or handed over
    earlier in this flush) and the tier's ``backlog`` (bytes of copies handed to it and not finished, this
    flush's included) is at or past its limit. A skipped copy is owed (:attr:`ValveDecision.OWE`), unless the
    limit is 0: then only first copies are written (:attr:`ValveDecision.SKIP`). A tier whose limit is None has
    no valve (the simulator's old unbounded queues). The catch-up pays a tier's debts only while its backlog is
    below half the limit (:meth:`CatchUpPolicy.tier_ready`), so the valve does not flap open and shut.

    ``limits``: bytes per tier, in tier order (the store's defaults: :func:`kvstream.config.write_backlog_limit`). Stateless beyond
    them: the drivers count what it skipped (``write_skipped_backlog``)."""

    def __init__(self, limits: Sequence[int | None]) -> None:
        for t, lim in enumerate(limits):
            if lim is not None and lim < 0:
                raise ValueError(f"backlog limit of tier {t} must be >= 0 bytes or None, got {lim}")
        self.limits: list[int | None] = list(limits)

    @property
    def active(self) -> bool:
        """Whether any tier has a limit (else every copy is written)."""
        return any(lim is not None for lim in self.limits)

    def limit(self, t: int) -> int | None:
        return self.limits[t]

    def decide(self, t: int, *, copies: int, backlog: int) -> ValveDecision:
        """One copy to tier ``t`` of a chunk that has ``copies`` copies already, the tier's ``backlog`` bytes
        queued or in flight."""
        lim = self.limits[t]
        if copies and lim is not None and backlog >= lim:
            return ValveDecision.OWE if lim > 0 else ValveDecision.SKIP
        return ValveDecision.WRITE


class DebtAction(Enum):
    """What a catch-up round does with one debt."""

    PAID = "paid"  # the tier holds the chunk already: the debt ends
    DROP = "drop"  # the chunk is nowhere else (evicted by policy everywhere): nothing to copy, the debt ends
    COPY = "copy"  # in host memory: order the copy
    READ_BACK = "read-back"  # read it from a holder tier into host memory, then order the copy
    DEFER = "defer"  # a read-back while a serving read step is in flight: the next round
    WAIT = "wait"  # a read-back host memory has no room to keep (or during the back-off after one): later


Debt = tuple[str, bytes]  # (tier name, key)


class CatchUpPolicy:
    """The catch-up's rules, sans-I/O: the store's :class:`~kvstream.replica_debt.CatchUp` thread and the
    simulator's model (``kvstream.sim.storage``) drive one each, so the simulator pays debts as the store does.

    A round looks every ``interval_s``; per tier that is usable and whose write backlog is below half its limit
    (:meth:`tier_ready`) it takes up to ``batch`` debts in the order :meth:`select` gives and asks :meth:`decide`
    for each. Debts whose chunk is still in host memory go first, newest first: a copy from memory costs the
    owed tier's write and nothing else, while a debt left until its chunk is evicted costs a read-back from the
    tier that serves the loads (in ``kvstream replay``'s default, before this rule, 76-86 read-backs of 48 MiB
    from the local tier per minute, during loads). A read-back (the chunk left host memory) waits while a serving
    read step is in flight: it would take the holder tier's bandwidth from a load on the critical path. Under
    reads that never pause it goes on anyway once ``max_deferred_rounds`` rounds in a row deferred one (30 s), so
    debts cannot starve.

    A read-back is only worth its read if host memory keeps what it reads (the copy is written from there): with
    no room (every buffer holds an unwritten chunk or a caller's view) the read lands in a spare buffer that is
    not kept, and the debt is read again next round, for ever (1,782 read-backs and no copy in 30 s). So a
    read-back waits (``WAIT``) while the driver says there is no room, and after a read-back that was not kept
    (:meth:`read_back_done`) the policy backs off: no read-back for ``interval_s``, doubling up to
    ``max_backoff_s``, until one is kept. A debt read back ``max_read_backs`` times without being kept is given
    up for ``give_up_s`` (counted in ``gave_up``; it stays owed and journalled, and is copied at once if its chunk
    comes into host memory some other way): the catch-up passes over it (:meth:`given_up_now`), then it gets one
    more read-back. So a debt is read back at most ``max_read_backs`` times, then once per ``give_up_s``, for as
    long as host memory keeps none of what is read.

    State: the count of rounds in a row that deferred (:meth:`end_round`), the back-off, the read-backs of each
    debt that were not kept, and the debts given up."""

    interval_s = 0.25
    batch = 16  # chunks per tier per round: catch-up must not crowd the serving path's reads and writes
    max_deferred_rounds = 120
    max_read_backs = 3  # read-backs of one debt not kept in host memory before it is given up
    max_backoff_s = 8.0
    give_up_s = 60.0  # how long a debt given up is passed over

    def __init__(self) -> None:
        self.deferred_rounds = 0
        self.reads_deferred = 0
        self.reads_waited = 0  # read-backs put off: no room in host memory, or backing off
        self.read_backs_wasted = 0  # read-backs whose chunk host memory did not keep (no copy could follow)
        self.gave_up = 0  # times a debt was given up (read back max_read_backs times without being kept)
        self._given_up: dict[Debt, float] = {}  # debt -> until when it is passed over
        self._tries: dict[Debt, int] = {}
        self._backoff_s = 0.0
        self._wait_until = -math.inf
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

    def decide(self, *, on_tier: bool, in_memory: bool, has_holder: bool, serving: bool, room: bool = True,
               now: float | None = None, debt: Debt | None = None) -> DebtAction:
        """One debt: ``on_tier`` (the owed tier holds it now), ``in_memory`` (host memory holds it),
        ``has_holder`` (another tier holds it), ``serving`` (a serving read step is in flight), ``room`` (host
        memory could keep a chunk read back now), ``now`` (for the back-off; None: no back-off, as at close),
        ``debt`` (which one, for the per-debt bound)."""
        if on_tier:
            return DebtAction.PAID
        if in_memory:
            return DebtAction.COPY
        if not has_holder:
            return DebtAction.DROP
        if debt is not None and now is not None and debt in self._given_up:
            if now < self._given_up[debt]:
                return DebtAction.WAIT
            del self._given_up[debt]  # one more read-back; not kept, it is given up again
            self._tries[debt] = self.max_read_backs - 1
        if not room or (now is not None and now < self._wait_until):
            if not room and now is not None and now >= self._wait_until:
                self._back_off(now)
            self.reads_waited += 1
            return DebtAction.WAIT
        if serving and self.deferred_rounds < self.max_deferred_rounds:
            self.reads_deferred += 1
            self._deferred_now = True
            return DebtAction.DEFER
        return DebtAction.READ_BACK

    def read_back_done(self, debt: Debt, now: float, kept: bool) -> None:
        """A ``READ_BACK`` of ``debt`` ended: ``kept`` if host memory holds the chunk now (its copy can be
        ordered). Not kept: counted, the back-off grows, and the debt is given up after ``max_read_backs``."""
        if kept:
            self._tries.pop(debt, None)
            self._backoff_s = 0.0
            self._wait_until = -math.inf
            return
        self.read_backs_wasted += 1
        n = self._tries.get(debt, 0) + 1
        if n >= self.max_read_backs:
            self._tries.pop(debt, None)
            self._given_up[debt] = now + self.give_up_s
            self.gave_up += 1
        else:
            self._tries[debt] = n
        self._back_off(now)

    def forget(self, debt: Debt) -> None:
        """``debt`` ended, or its chunk is in host memory again: its read-back count and give-up go."""
        self._tries.pop(debt, None)
        self._given_up.pop(debt, None)

    def tracked(self) -> list[Debt]:
        """Debts the policy keeps state for (the driver forgets those that ended: :meth:`forget`)."""
        return list(self._tries) + list(self._given_up)

    def given_up_now(self, now: float) -> set[Debt]:
        """The debts passed over at ``now`` (given up, their ``give_up_s`` not over)."""
        return {d for d, until in self._given_up.items() if now < until}

    def _back_off(self, now: float) -> None:
        self._backoff_s = min(self.max_backoff_s, self._backoff_s * 2 if self._backoff_s else self.interval_s)
        self._wait_until = now + self._backoff_s

    def end_round(self) -> None:
        self.deferred_rounds = self.deferred_rounds + 1 if self._deferred_now else 0
        self._deferred_now = False
