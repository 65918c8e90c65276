"""Read routers (sans-I/O): which tier reads which chunk of a step, decided as reads complete.

A step's read is one list of chunks. A router turns "which tiers hold each chunk" into a :class:`ReadSchedule`,
a small state machine the driver (the real engine or the simulator) runs with three events::

    sched = router.schedule(holders)        # holders[i]: set of tier indices that hold chunk i
    sched.next_claim(t) -> [i, ...]          # tier t has room: chunks it should read next ([] = nothing now)
    sched.on_landed(t, i) -> bool            # tier t delivered chunk i; True = first copy (use it), False = duplicate
    sched.on_failed(t, i)                    # tier t could not deliver i (EIO, bad checksum): retry elsewhere
    sched.on_dropped(t, i)                   # tier t's read of i was dropped unissued (i was delivered meanwhile)
    sched.hedge(t, stuck) -> [i, ...]        # a read is past its deadline elsewhere: may t read it too?
    sched.take_for_compute(i) -> bool        # the GPU recomputes chunk i instead (only if no tier claimed it)
    sched.finished / sched.lost()            # every chunk landed, is recomputed, or is unrecoverable

The driver decides *when* a tier has room (bytes in flight under its budget); the schedule decides *what* it
reads. Chunk indices are the caller's own (positions in the list it passed); the schedule reorders internally.

Meet in the middle, for N tiers
-------------------------------
Chunks are ordered so that those held only by the front tier come first, those held by both in the middle and
those held only by the back tier last; in general each chunk is placed at the mean *home* of the tiers holding
it, where tier ``k`` of ``N`` has its home at fraction ``k/(N-1)`` of the list (tier 0 at the front, tier N-1 at
the back; with 3 tiers the middle one starts in the middle). A tier claims the ``m`` unclaimed chunks it holds
nearest its home, expanding outward (two cursors), so with two tiers tier 0 reads front→back and tier 1
back→front and they meet wherever their speeds put them: the faster tier reads more, with no bandwidth
measured and no ratio tuned.

Once no unclaimed chunk is left for a tier, it may read again a chunk still in flight on another tier (the
meeting region), nearest its own home first — those are the other tier's latest claims, the ones it will finish
last — as many as its own read window holds, so it meets the other tier inside that tier's in-flight window.
Each chunk is read at most twice; the first copy to land is used, the other is counted as a duplicate.
This bounds the tail: a tier never idles while a slower one still holds the step's last chunks.

Failures: a chunk that fails on a tier goes back to the pool for the other tiers that hold it (not to the tier
that failed it); when every holder has failed it, it is *lost* (the caller treats it as a miss).

Fixed split and single tier (the baselines) assign every chunk to one tier up front, by position (the first
``ratio`` share of the ordered list to tier 0, the rest to tier 1, ...), never steal, and move a chunk to another
holder only if its tier fails it or does not hold it.

Compute joins the meeting (``router.schedule(holders, n, front=m)``): the GPU may recompute the step's first
chunks instead of reading them (:mod:`kvstream.compute`). It takes chunks from the front of the list, in order,
through :meth:`ReadSchedule.take_for_compute`, which succeeds only for a chunk no tier has claimed; such a chunk
is never read. ``front`` (the policy's estimate of where compute and the tiers will meet) moves the tiers'
homes behind it: with meet in the middle, tier 0 starts at ``front`` and walks both ways (toward compute and
toward the back tier), the last tier at the back; a single tier reads from the back. The meeting points then
follow the sources' real speeds, as between two tiers. ``front=0`` is the plain schedule, unchanged.

Invariants (tested with hypothesis): every chunk is either delivered exactly once (one ``True`` from
``on_landed``), taken for compute (and then never claimed by a tier), or reported lost; a chunk is claimed by two tiers only after no unclaimed chunk is left for the
second; a tier is only ever given chunks it holds.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

__all__ = [
    "ReadRouter",
    "ReadSchedule",
    "MeetInTheMiddle",
    "FixedSplit",
    "SingleTier",
    "TierReadStats",
    "parse_router",
    "order_for_tiers",
]


@dataclass(slots=True)
class TierReadStats:
    """Per-tier counts of one schedule."""

    claimed: int = 0  # chunks handed to the tier (duplicates included)
    landed: int = 0  # chunks the tier delivered first (the copies that were used)
    duplicates: int = 0  # chunks the tier delivered after another tier had (wasted reads)
    failed: int = 0  # chunks the tier failed


def order_for_tiers(holders: Sequence[Collection[int]], n_tiers: int) -> list[int]:
    """Chunk indices sorted by the mean home position of their holders (stable: ties keep list order).

    With two tiers: chunks held only by tier 0 first, then those held by both, then those only tier 1 holds.
    """
    if n_tiers <= 1:
        return list(range(len(holders)))
    homes = [k / (n_tiers - 1) for k in range(n_tiers)]

    def place(i: int) -> float:
        hs = holders[i]
        return sum(homes[t] for t in hs) / len(hs) if hs else 0.5

    return sorted(range(len(holders)), key=place)


class ReadSchedule(ABC):
    """The per-step state machine; see the module docstring for the protocol.

    ``steal``: whether a tier with nothing unclaimed may re-read chunks still in flight elsewhere (meet in the
    middle only). A driver that cannot use a second copy before the first is done (reads straight into the
    caller's memory) turns it off.
    """

    steal: bool = False
    # The driver's veto on a steal (tier, chunk) -> bool: a copy is worth reading only if it can land before the
    # one in flight (kvstream.read_step sets it from measured bandwidths). None: every steal is allowed.
    steal_filter: Callable[[int, int], bool] | None = None

    def __init__(self, holders: Sequence[Collection[int]], n_tiers: int) -> None:
        if n_tiers < 1:
            raise ValueError(f"a read needs at least one tier, got {n_tiers}")
        self.n_tiers = n_tiers
        self.n = len(holders)
        self._holders: list[frozenset[int]] = []
        for i, hs in enumerate(holders):
            fs = frozenset(hs)
            if any(not 0 <= t < n_tiers for t in fs):
                raise ValueError(f"chunk {i}: holder tier out of range 0..{n_tiers - 1}: {sorted(fs)}")
            self._holders.append(fs)
        self._done = [False] * self.n  # landed (first copy) or lost
        self._copies = [0] * self.n  # reads claimed so far, at most 2
        self._inflight: list[set[int]] = [set() for _ in range(n_tiers)]  # tier -> chunks claimed, not finished
        self._failed_by: list[set[int]] = [set() for _ in range(self.n)]  # chunk -> tiers that failed it
        self._retry: list[int] = []  # chunks failed somewhere, waiting for another holder
        self._lost: list[int] = []
        self._remaining = self.n
        self.stats = [TierReadStats() for _ in range(n_tiers)]
        for i, hs in enumerate(self._holders):
            if not hs:
                self._mark_lost(i)

    # -- events ---------------------------------------------------------------------------------------------
    @abstractmethod
    def next_claim(self, tier: int) -> list[int]:
        """Chunks tier ``tier`` should read next (it holds all of them); ``[]`` if none right now."""

    def take_for_compute(self, i: int) -> bool:
        """The GPU recomputes chunk ``i`` instead of a tier reading it: True if no tier has claimed it (nor is it
        done or waiting for a retry); from then on no tier is given it and it counts as finished here (the read
        step resolves it when the compute ends). False: a tier has it; compute and the tiers have met."""
        if self._done[i] or self._copies[i] or self._failed_by[i]:
            return False
        self._done[i] = True
        self._remaining -= 1
        self._mark_taken(i)
        return True

    def claimed(self, i: int) -> bool:
        """Whether a tier has claimed chunk ``i`` and it is not finished (in flight, or failed and waiting for
        another holder)."""
        return not self._done[i] and bool(self._copies[i])

    def _mark_taken(self, i: int) -> None:
        """Hook: a schedule with its own claim bookkeeping marks chunk ``i`` as gone (taken for compute)."""

    def peek(self, tier: int, n: int) -> list[int]:
        """Up to ``n`` chunks that ``next_claim(tier)`` would hand out next if nothing else happened meanwhile
        (unclaimed ones only: no retries, no steals). Changes nothing; a hint for a driver that prepares reads
        ahead (opens their files), never a promise: another tier may claim them first."""
        return []

    def on_landed(self, tier: int, i: int) -> bool:
        """Tier ``tier`` delivered chunk ``i``. True if this is the copy to use."""
        self._finish_inflight(tier, i)
        if self._done[i]:
            self.stats[tier].duplicates += 1
            return False
        self._done[i] = True
        self._remaining -= 1
        self.stats[tier].landed += 1
        return True

    def on_failed(self, tier: int, i: int) -> None:
        """Tier ``tier`` could not deliver chunk ``i``; another holder may retry it."""
        self._finish_inflight(tier, i)
        self.stats[tier].failed += 1
        self._failed_by[i].add(tier)
        if self._done[i]:
            return
        if any(i in self._inflight[t] for t in range(self.n_tiers)):
            return  # another copy is still on its way
        if self._holders[i] - self._failed_by[i]:
            self._retry.append(i)
        else:
            self._mark_lost(i)

    def on_dropped(self, tier: int, i: int) -> None:
        """Tier ``tier``'s read of chunk ``i`` was dropped before it was issued (the chunk was delivered
        meanwhile): it no longer holds the chunk in flight, and nothing is counted."""
        self._finish_inflight(tier, i)

    def hedge(self, tier: int, stuck: Collection[int]) -> list[int]:
        """Let ``tier`` read again chunks that are taking too long elsewhere (a stalled tier); returns those it
        may take: ones it holds, has not failed, is not already reading, and that have had only one copy."""
        out = []
        for i in stuck:
            if (not self._done[i] and self._copies[i] < 2 and tier in self._holders[i]
                    and tier not in self._failed_by[i] and i not in self._inflight[tier]):
                self._take(tier, i)
                out.append(i)
        return out

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self._remaining == 0

    def lost(self) -> list[int]:
        """Chunks no holder could deliver (in the order they were given up)."""
        return list(self._lost)

    def duplicates(self) -> int:
        return sum(s.duplicates for s in self.stats)

    def inflight(self, tier: int) -> frozenset[int]:
        return frozenset(self._inflight[tier])

    # -- helpers for subclasses -----------------------------------------------------------------------------
    def _take(self, tier: int, i: int) -> None:
        self._copies[i] += 1
        self._inflight[tier].add(i)
        self.stats[tier].claimed += 1

    def _finish_inflight(self, tier: int, i: int) -> None:
        if i not in self._inflight[tier]:
            raise ValueError(f"tier {tier} reported chunk {i}, which it was not reading")
        self._inflight[tier].discard(i)

    def _mark_lost(self, i: int) -> None:
        if not self._done[i]:
            self._done[i] = True
            self._remaining -= 1
            self._lost.append(i)

    def _claim_retries(self, tier: int, limit: int) -> list[int]:
        out: list[int] = []
        keep: list[int] = []
        for i in self._retry:
            if self._done[i]:
                continue
            if len(out) < limit and tier in self._holders[i] and tier not in self._failed_by[i]:
                self._take(tier, i)
                out.append(i)
            else:
                keep.append(i)
        self._retry = keep
        return out


class ReadRouter(ABC):
    """A factory of per-step schedules; holds only its parameters, so one router serves every step."""

    name: str = "abstract"

    @abstractmethod
    def schedule(self, holders: Sequence[Collection[int]], n_tiers: int, *, front: int = 0) -> ReadSchedule:
        """A schedule for one step. ``front``: chunks at the head of the list the GPU is expected to recompute
        (see the module docstring); schedules that assign by position keep their assignment and, when it is
        not 0, take each tier's share from its back."""


# ---------------------------------------------------------------------------------------------------------
class _MitmSchedule(ReadSchedule):
    def __init__(self, holders: Sequence[Collection[int]], n_tiers: int, batch: int, steal: bool,
                 front: int = 0) -> None:
        super().__init__(holders, n_tiers)
        self.batch = batch
        self.steal = steal
        self._order = order_for_tiers(self._holders, n_tiers)  # position -> chunk index
        self._pos = {c: p for p, c in enumerate(self._order)}
        self._claimed = [False] * self.n  # by position
        n = self.n
        front = min(max(front, 0), max(n - 1, 0))
        if front and n_tiers == 1:
            self._home = [n - 1]  # compute takes the front: the one tier reads from the back toward it
        else:
            # Homes spread over [front, n-1]: tier 0 at the expected meeting point with compute (walking both
            # ways, so a wrong estimate only moves the meeting), the last tier at the back.
            self._home = [max(0, front + round(k * (n - 1 - front) / (n_tiers - 1))) if n_tiers > 1 else 0
                          for k in range(n_tiers)]
        # Two cursors per tier: lo walks toward the front, hi toward the back; both start at home.
        self._lo = [h - 1 for h in self._home]
        self._hi = list(self._home)

    def _mark_taken(self, i: int) -> None:
        self._claimed[self._pos[i]] = True

    def _nearest(self, tier: int, lo: int, hi: int) -> tuple[int | None, int, int]:
        """From cursors ``lo`` / ``hi``: the position of the nearest unclaimed chunk this tier holds (None if
        none), and the cursors moved past the positions that are not (claimed, or not held)."""
        order, claimed, holders = self._order, self._claimed, self._holders
        while lo >= 0 and (claimed[lo] or tier not in holders[order[lo]]):
            lo -= 1
        while hi < self.n and (claimed[hi] or tier not in holders[order[hi]]):
            hi += 1
        home = self._home[tier]
        if lo < 0:
            return (hi if hi < self.n else None), lo, hi
        if hi >= self.n:
            return lo, lo, hi
        return (lo if home - lo <= hi - home else hi), lo, hi

    def _next_unclaimed(self, tier: int) -> int | None:
        """Position of the nearest unclaimed chunk this tier holds, advancing its cursors past the rest."""
        p, self._lo[tier], self._hi[tier] = self._nearest(tier, self._lo[tier], self._hi[tier])
        return p

    def peek(self, tier: int, n: int) -> list[int]:
        # The claims' walk on copies of the cursors, marking nothing.
        lo, hi = self._lo[tier], self._hi[tier]
        out: list[int] = []
        while len(out) < n:
            p, lo, hi = self._nearest(tier, lo, hi)
            if p is None:
                break
            if p == lo:
                lo -= 1
            else:
                hi += 1
            if not self._done[self._order[p]]:
                out.append(self._order[p])
        return out

    def next_claim(self, tier: int) -> list[int]:
        if not 0 <= tier < self.n_tiers:
            raise ValueError(f"tier {tier} out of range 0..{self.n_tiers - 1}")
        out = self._claim_retries(tier, self.batch)
        while len(out) < self.batch:
            p = self._next_unclaimed(tier)
            if p is None:
                break
            self._claimed[p] = True
            i = self._order[p]
            if self._done[i]:  # lost before anyone claimed it
                continue
            self._take(tier, i)
            out.append(i)
        if not out and self.steal:
            out = self._steal(tier)
        return out

    def _steal(self, tier: int) -> list[int]:
        # The stealing tier takes the other tiers' in-flight chunks nearest its own home first (their latest
        # claims, which they finish last), as many as the driver's read window lets it keep in flight. Its
        # device would idle otherwise; what a steal costs is the other copy's bandwidth, and the other tiers'
        # windows (sized to drain as fast as this one's) bound that. Measured on the testbed (BENCHMARKS §8):
        # stealing a whole window instead of one batch at a time took meet-in-the-middle from +3.6 % to +0.5 %
        # over the bound (the fast tier no longer reads its share of the tail one chunk at a time).
        home = self._home[tier]
        cands = [
            i
            for t in range(self.n_tiers)
            if t != tier
            for i in self._inflight[t]
            if not self._done[i] and self._copies[i] < 2 and tier in self._holders[i] and tier not in self._failed_by[i]
            and (self.steal_filter is None or self.steal_filter(tier, i))
        ]
        cands.sort(key=lambda i: abs(self._pos[i] - home))
        out = cands[: self.batch]
        for i in out:
            self._take(tier, i)
        return out


@dataclass(frozen=True, slots=True)
class MeetInTheMiddle(ReadRouter):
    """Tiers read from their own ends of the step's list, ``batch`` chunks per claim, and meet in the middle."""

    batch: int = 1  # chunks per claim (the paper's m)
    steal: bool = True  # re-read the meeting region's in-flight chunks once the pool is empty
    name: str = field(default="mitm", init=False)

    def __post_init__(self) -> None:
        if self.batch < 1:
            raise ValueError(f"MeetInTheMiddle batch must be >= 1, got {self.batch}")

    def schedule(self, holders: Sequence[Collection[int]], n_tiers: int, *, front: int = 0) -> ReadSchedule:
        return _MitmSchedule(holders, n_tiers, self.batch, self.steal, front)


# ---------------------------------------------------------------------------------------------------------
class _StaticSchedule(ReadSchedule):
    """Every chunk assigned to one tier up front; claims are served from that tier's queue in order."""

    def __init__(self, holders: Sequence[Collection[int]], n_tiers: int, batch: int, assign: list[int],
                 front: int = 0) -> None:
        super().__init__(holders, n_tiers)
        self.batch = batch
        self._queues: list[list[int]] = [[] for _ in range(n_tiers)]
        for i, t in enumerate(assign):
            if self._done[i]:
                continue
            hs = self._holders[i]
            if t not in hs:  # the assigned tier lacks it: the nearest holder by index reads it
                t = min(hs, key=lambda h: (abs(h - t), h))
            self._queues[t].append(i)
        if not front:
            for q in self._queues:
                q.reverse()  # pop() from the end = take in list order
        # else: compute takes the front, so each tier takes its queue from the back (pop() = the last first)

    def peek(self, tier: int, n: int) -> list[int]:
        out: list[int] = []
        for i in reversed(self._queues[tier]):
            if len(out) == n:
                break
            if not self._done[i]:
                out.append(i)
        return out

    def next_claim(self, tier: int) -> list[int]:
        if not 0 <= tier < self.n_tiers:
            raise ValueError(f"tier {tier} out of range 0..{self.n_tiers - 1}")
        out = self._claim_retries(tier, self.batch)
        q = self._queues[tier]
        while q and len(out) < self.batch:
            i = q.pop()
            if not self._done[i]:
                self._take(tier, i)
                out.append(i)
        return out


def _split_counts(n: int, ratios: Sequence[float]) -> list[int]:
    """Largest-remainder split of ``n`` items by ``ratios`` (sums to ``n`` exactly)."""
    total = sum(ratios)
    raw = [n * r / total for r in ratios]
    counts = [int(x) for x in raw]
    for k in sorted(range(len(raw)), key=lambda k: raw[k] - counts[k], reverse=True)[: n - sum(counts)]:
        counts[k] += 1
    return counts


@dataclass(frozen=True, slots=True)
class FixedSplit(ReadRouter):
    """The first ``ratios[0]`` share of the ordered list from tier 0, the next share from tier 1, and so on.

    ``FixedSplit((0.7,))`` with two tiers means 70 % from tier 0 and 30 % from tier 1.
    """

    ratios: tuple[float, ...] = (0.5,)
    batch: int = 1
    name: str = field(default="fixed", init=False)

    def __post_init__(self) -> None:
        if not self.ratios or not all(0 <= r <= 1 for r in self.ratios) or sum(self.ratios) > 1 + 1e-9:  # NaN fails too
            raise ValueError(f"FixedSplit ratios must each be in [0, 1] and sum to at most 1, got {self.ratios}")

    def shares(self, n_tiers: int) -> list[float]:
        given = list(self.ratios)[:n_tiers]
        if len(given) < n_tiers:
            rest = max(0.0, 1.0 - sum(given))
            given += [rest / (n_tiers - len(given))] * (n_tiers - len(given))
        return given

    def schedule(self, holders: Sequence[Collection[int]], n_tiers: int, *, front: int = 0) -> ReadSchedule:
        order = order_for_tiers([frozenset(h) for h in holders], n_tiers)
        counts = _split_counts(len(order), self.shares(n_tiers)) if order else [0] * n_tiers
        assign = [0] * len(order)
        p = 0
        for t, c in enumerate(counts):
            for i in order[p : p + c]:
                assign[i] = t
            p += c
        return _StaticSchedule(holders, n_tiers, self.batch, assign, front)


@dataclass(frozen=True, slots=True)
class SingleTier(ReadRouter):
    """Every chunk from one tier (``tier`` index); chunks it lacks come from another holder."""

    tier: int = 0
    batch: int = 1
    name: str = field(default="single", init=False)

    def schedule(self, holders: Sequence[Collection[int]], n_tiers: int, *, front: int = 0) -> ReadSchedule:
        if not 0 <= self.tier < n_tiers:
            raise ValueError(f"SingleTier tier {self.tier} out of range 0..{n_tiers - 1}")
        return _StaticSchedule(holders, n_tiers, self.batch, [self.tier] * len(holders), front)


def parse_router(spec: str, tier_names: Sequence[str], *, field_name: str = "router") -> ReadRouter:
    """``mitm`` | ``mitm:M`` | ``fixed:R`` (or ``fixed:R1,R2``) | ``single:NAME``; errors name the field."""
    from kvstream.errors import ConfigError

    kind, _, arg = spec.partition(":")
    try:
        if kind == "mitm":
            return MeetInTheMiddle(batch=int(arg) if arg else 1)
        if kind == "fixed":
            if not arg:
                raise ValueError("fixed needs a ratio, e.g. fixed:0.7")
            return FixedSplit(ratios=tuple(float(x) for x in arg.split(",")))
        if kind == "single":
            name = arg or (tier_names[0] if tier_names else "")
            if name not in tier_names:
                raise ValueError(f"no tier named {name!r} (tiers: {', '.join(tier_names)})")
            return SingleTier(tier=list(tier_names).index(name))
    except ValueError as exc:
        raise ConfigError(field_name, f"{spec!r}: {exc}") from None
    raise ConfigError(field_name, f"unknown router {spec!r}; expected mitm, mitm:M, fixed:R or single:NAME")
