"""Eviction policies (sans-I/O): which resident entry to drop next.

A policy only keeps bookkeeping; it never frees memory or deletes files. A tier (host memory or a directory)
reports what happened and asks for a victim:

    policy.on_insert(key, size, now=t, meta=m)   # an entry became resident (and evictable)
    policy.on_access(key, now=t, meta=m)         # a hit on a resident entry
    policy.on_remove(key)                        # the entry left (evicted, deleted, or pinned by the tier)
    policy.victim(now=t) -> key | None           # lowest-value resident entry, without removing it

Invariants every policy keeps:
- ``victim()`` returns only keys that were inserted and not removed since; ``None`` only when none is resident.
- ``victim()`` has no side effect: the tier calls ``on_remove`` once it has really evicted the entry.
- ``on_insert`` of a key that is already resident replaces it: the size is updated and it counts as one access
  (LRU moves it to the back, FIFO keeps its place, LFU adds one use). A replay whose entries grow on every
  use (a conversation's KV) calls ``on_insert`` alone on a hit.
- ``on_access`` / ``on_remove`` of a key that is not resident are ignored (a tier may race a removal).
- Pinned entries (pending writes, reads in flight) are simply not inserted until the tier unpins them, so
  policies have no notion of pins.
- ``now`` is passed in (seconds, any monotonic origin); a policy never reads a clock.
- Every operation costs O(1) or O(log n) in the number of resident entries (``victim`` of the hit-potential
  policy: O(number of answer-length bins + log n)); nothing scans the resident set.

``meta`` is an optional :class:`AccessMeta` with what smarter policies use (session, previous answer length).

Policies (``make_eviction_policy`` names):

=================  ===================================================================================
``lru``            least recently used
``fifo``           first in, first out (a hit does not move an entry)
``lfu``            least frequently used since insertion, ties by least recent
``queue-aware``    CachedAttention's scheduler-aware eviction: LRU that passes over entries the look-ahead
                   window of the waiting queue will need (:meth:`QueueAwarePolicy.set_window`)
``inclusive``      FlashGen-style inclusive hierarchy, see :class:`InclusivePolicy` for exactly what it is
``belady``         offline optimum (farthest next use); needs ``next_use=`` (the future), see
                   :class:`BeladyPolicy`
``hit-potential``  Bidaw: evict the lowest predicted hit potential; needs ``capacity_bytes=``, see
                   :class:`HitPotentialPolicy`
=================  ===================================================================================
"""

from __future__ import annotations

import heapq
import math
from abc import ABC, abstractmethod
from bisect import bisect_right
from collections import OrderedDict, defaultdict, deque
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sortedcontainers import SortedDict  # type: ignore[import-untyped]  # no stubs published

__all__ = [
    "AccessMeta",
    "EvictionPolicy",
    "eviction_options",
    "LRUPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "QueueAwarePolicy",
    "InclusivePolicy",
    "BeladyPolicy",
    "NextUseOracle",
    "HitPotentialPolicy",
    "ReuseDistanceTracker",
    "make_eviction_policy",
    "eviction_policy_names",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessMeta:
    """What the serving side knows about an access; every field optional."""

    session: Hashable | None = None  # conversation / user id the entry belongs to
    # Length of the answer the conversation most recently received, i.e. the answer this entry's KV now ends with
    # (Bidaw's predictor: the longer the answer, the later the user comes back).
    prev_answer_tokens: int | None = None
    position: int | None = None  # chunk index within its prefix
    round_index: int | None = None  # the conversation's request (turn) this access belongs to; groups chunk events


class EvictionPolicy(ABC):
    """Base class; see the module docstring for the protocol and its invariants."""

    name: str = "abstract"

    @abstractmethod
    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None: ...

    @abstractmethod
    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None: ...

    @abstractmethod
    def on_remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def victim(self, *, now: float = 0.0) -> Hashable | None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    def __contains__(self, key: object) -> bool:  # pragma: no cover - overridden where cheap
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used: O(1) per event (an ordered dict, oldest first)."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # key -> size; first = least recent

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        self._order[key] = size
        self._order.move_to_end(key)

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class FIFOPolicy(EvictionPolicy):
    """First in, first out: the oldest insertion goes first; hits and re-inserts keep an entry's place. O(1)."""

    name = "fifo"

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, int] = OrderedDict()  # key -> size; first = oldest insertion

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        self._order[key] = size  # an existing key keeps its position (dict assignment does not move it)

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        pass

    def on_remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        return next(iter(self._order), None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order


class LFUPolicy(EvictionPolicy):
    """Least frequently used, counting uses since the entry was inserted (a removed entry forgets its count);
    ties go to the least recently used. Buckets of equal count in a sorted dict: O(log #counts) per event."""

    name = "lfu"

    def __init__(self) -> None:
        self._count: dict[Hashable, int] = {}  # key -> uses since insertion (>= 1)
        # count -> keys with that count, least recent first. Invariant: no empty bucket is kept.
        self._buckets: SortedDict = SortedDict()

    def _bump(self, key: Hashable) -> None:
        c = self._count[key]
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            del self._buckets[c]
        self._count[key] = c + 1
        self._buckets.setdefault(c + 1, OrderedDict())[key] = None

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        if key in self._count:
            self._bump(key)
            return
        self._count[key] = 1
        self._buckets.setdefault(1, OrderedDict())[key] = None

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        if key in self._count:
            self._bump(key)

    def on_remove(self, key: Hashable) -> None:
        c = self._count.pop(key, None)
        if c is None:
            return
        bucket = self._buckets[c]
        del bucket[key]
        if not bucket:
            del self._buckets[c]

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        if not self._buckets:
            return None
        key: Hashable = next(iter(self._buckets.peekitem(0)[1]))
        return key

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, key: object) -> bool:
        return key in self._count


class _ProtectedLRU(EvictionPolicy):
    """LRU over entries that are not protected; protected entries are set aside, keeping their recency, and are
    chosen (least recent first) only when nothing else is resident. O(log n) per event: two sorted dicts keyed
    by a recency sequence number, so an entry that loses its protection goes back to its recency slot.

    Protection is reference counted, by key and by session (an entry's session comes from ``meta`` at insert
    or access). Invariant: an entry is in ``_free`` iff it is resident and neither its key nor its session has a
    positive count; otherwise it is in ``_held``.
    """

    def __init__(self) -> None:
        self._seq = 0
        self._stamp: dict[Hashable, int] = {}  # resident key -> recency sequence number
        self._free: SortedDict = SortedDict()  # seq -> key, unprotected, least recent first
        self._held: SortedDict = SortedDict()  # seq -> key, protected
        self._session_of: dict[Hashable, Hashable] = {}  # resident key -> session (when known)
        self._session_keys: defaultdict[Hashable, set[Hashable]] = defaultdict(set)  # session -> resident keys
        self._key_refs: dict[Hashable, int] = {}  # key -> protection count (> 0)
        self._session_refs: dict[Hashable, int] = {}  # session -> protection count (> 0)

    # -- protection ---------------------------------------------------------------------------------------------
    def _protected(self, key: Hashable) -> bool:
        if key in self._key_refs:
            return True
        s = self._session_of.get(key)
        return s is not None and s in self._session_refs

    def _refile(self, key: Hashable) -> None:
        seq = self._stamp.get(key)
        if seq is None:
            return
        if self._protected(key):
            if self._free.pop(seq, None) is not None:
                self._held[seq] = key
        elif self._held.pop(seq, None) is not None:
            self._free[seq] = key

    def _change(self, refs: dict[Hashable, int], item: Hashable, delta: int) -> bool:
        """Adjust a count; True when the item crossed zero (protection switched on or off)."""
        before = refs.get(item, 0)
        after = before + delta
        if after < 0:
            raise ValueError(f"{self.name}: released {item!r} more often than it was protected")
        if after:
            refs[item] = after
        else:
            refs.pop(item, None)
        return (before == 0) != (after == 0)

    def _protect_key(self, key: Hashable, delta: int) -> None:
        if self._change(self._key_refs, key, delta):
            self._refile(key)

    def _protect_session(self, session: Hashable, delta: int) -> None:
        if self._change(self._session_refs, session, delta):
            for key in self._session_keys.get(session, ()):
                self._refile(key)

    # -- protocol -----------------------------------------------------------------------------------------------
    def _touch(self, key: Hashable, meta: AccessMeta | None) -> None:
        old = self._stamp.get(key)
        if old is not None:
            if self._free.pop(old, None) is None:
                self._held.pop(old, None)
        session = meta.session if meta is not None else None
        if session is not None and self._session_of.get(key) != session:
            prev = self._session_of.get(key)
            if prev is not None:
                self._session_keys[prev].discard(key)
            self._session_of[key] = session
            self._session_keys[session].add(key)
        self._seq += 1
        self._stamp[key] = self._seq
        (self._held if self._protected(key) else self._free)[self._seq] = key

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        self._touch(key, meta)

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        if key in self._stamp:
            self._touch(key, meta)

    def on_remove(self, key: Hashable) -> None:
        seq = self._stamp.pop(key, None)
        if seq is None:
            return
        if self._free.pop(seq, None) is None:
            self._held.pop(seq, None)
        session = self._session_of.pop(key, None)
        if session is not None:
            keys = self._session_keys[session]
            keys.discard(key)
            if not keys:
                del self._session_keys[session]

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        key: Hashable
        if self._free:
            key = self._free.peekitem(0)[1]
            return key
        if self._held:
            key = self._held.peekitem(0)[1]
            return key
        return None

    def __len__(self) -> int:
        return len(self._stamp)

    def __contains__(self, key: object) -> bool:
        return key in self._stamp

    def is_protected(self, key: Hashable) -> bool:
        return key in self._stamp and self._protected(key)


class QueueAwarePolicy(_ProtectedLRU):
    """CachedAttention's scheduler-aware eviction: LRU, except that entries the look-ahead window over the waiting
    queue will need are never chosen while anything else is resident.

    The scheduler (or a replay) tells the policy what the window holds, by session or by key:

    - :meth:`set_window` ``(sessions)`` replaces the protected set of sessions with the given ones (a multiset:
      a session queued twice is protected until both leave); the cost is the size of the change.
    - :meth:`protect` / :meth:`release` add or drop one reference to a key or a session, for drivers that track
      the window incrementally (a request enters the window: protect its session; it is scheduled: release).
    """

    name = "queue-aware"

    def __init__(self) -> None:
        super().__init__()
        self._window: dict[Hashable, int] = {}  # session -> count, as last given to set_window

    def protect(self, *, key: Hashable | None = None, session: Hashable | None = None) -> None:
        if key is not None:
            self._protect_key(key, +1)
        if session is not None:
            self._protect_session(session, +1)

    def release(self, *, key: Hashable | None = None, session: Hashable | None = None) -> None:
        if key is not None:
            self._protect_key(key, -1)
        if session is not None:
            self._protect_session(session, -1)

    def set_window(self, sessions: Iterable[Hashable]) -> None:
        new: dict[Hashable, int] = {}
        for s in sessions:
            new[s] = new.get(s, 0) + 1
        old = self._window
        for s, c in old.items():
            d = new.get(s, 0) - c
            if d:
                self._protect_session(s, d)
        for s, c in new.items():
            if s not in old:
                self._protect_session(s, c)
        self._window = new


class InclusivePolicy(_ProtectedLRU):
    """A FlashGen-style inclusive multi-level baseline, for the host-memory level.

    What is implemented, exactly: the hierarchy GPU ⊂ host memory ⊂ disk is *inclusive* — every entry in host
    memory also has a copy on disk (written through when it is created, so evicting it from memory never writes),
    and every entry the GPU level currently holds also stays in host memory. The host level picks victims by LRU
    and passes over entries the GPU level holds (:meth:`hold_upper` / :meth:`release_upper`, reference counted),
    since evicting them would break inclusion; if only such entries are left it takes the least recent of them.

    What it is not: FlashGen's own code is not available here; nothing of its GPU-level management, request
    batching or prefetching is modelled. In a cache-only replay there is no GPU level, so this policy chooses
    exactly what LRU chooses; its cost in a real engine is capacity (GPU-resident entries occupy host memory too),
    which the tier, not the policy, accounts for.
    """

    name = "inclusive"

    def hold_upper(self, key: Hashable) -> None:
        self._protect_key(key, +1)

    def release_upper(self, key: Hashable) -> None:
        self._protect_key(key, -1)


# ---------------------------------------------------------------------------------------------------------------
# Belady (offline optimum)


class NextUseOracle:
    """The future of an access sequence: ``next_use(key, now)`` is the first access time of ``key`` after ``now``,
    ``math.inf`` if there is none. Built from the whole sequence, so only offline replays can have one."""

    def __init__(self, times: Mapping[Hashable, Sequence[float]]) -> None:
        self._times = {k: np.asarray(v, dtype=np.float64) for k, v in times.items()}
        for k, t in self._times.items():
            if t.size > 1 and np.any(np.diff(t) < 0):
                raise ValueError(f"access times of {k!r} are not sorted")

    @classmethod
    def from_sequence(cls, keys: Iterable[Hashable]) -> NextUseOracle:
        """Access ``i`` of the sequence happens at time ``i`` (drive the policy with ``now=i``)."""
        times: defaultdict[Hashable, list[float]] = defaultdict(list)
        for i, k in enumerate(keys):
            times[k].append(float(i))
        return cls(times)

    def __call__(self, key: Hashable, now: float) -> float:
        t = self._times.get(key)
        if t is None:
            return math.inf
        i = int(np.searchsorted(t, now, side="right"))
        return float(t[i]) if i < t.size else math.inf


class BeladyPolicy(EvictionPolicy):
    """Belady's MIN: evict the entry whose next use is farthest in the future (never used again: first).

    Offline: it needs ``next_use(key, now) -> time`` (e.g. a :class:`NextUseOracle`), evaluated when the entry
    is inserted or accessed at ``now``. With equal sizes and one insertion per miss, no policy misses less on the
    same sequence; with unequal sizes (a conversation's KV grows) it is the usual bound, not a proven optimum.
    A max-heap with lazy deletion: O(log n) per event.
    """

    name = "belady"

    def __init__(self, next_use: Callable[[Hashable, float], float]) -> None:
        self._next_use = next_use
        self._entry: dict[Hashable, tuple[float, int]] = {}  # key -> (next use, seq) as last computed
        self._heap: list[tuple[float, int, Hashable]] = []  # (-next use, -seq, key); stale rows skipped lazily
        self._seq = 0

    def _push(self, key: Hashable, now: float) -> None:
        nu = float(self._next_use(key, now))
        self._seq += 1
        self._entry[key] = (nu, self._seq)
        heapq.heappush(self._heap, (-nu, -self._seq, key))
        if len(self._heap) > 2 * len(self._entry) + 64:  # drop stale rows so the heap stays O(n)
            self._heap = [(-nu2, -s2, k) for k, (nu2, s2) in self._entry.items()]
            heapq.heapify(self._heap)

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        self._push(key, now)

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        if key in self._entry:
            self._push(key, now)

    def on_remove(self, key: Hashable) -> None:
        self._entry.pop(key, None)

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        heap = self._heap
        while heap:
            neg_nu, neg_seq, key = heap[0]
            cur = self._entry.get(key)
            if cur is not None and cur[1] == -neg_seq:
                return key
            heapq.heappop(heap)  # stale: removed or re-stamped since
        return None

    def __len__(self) -> int:
        return len(self._entry)

    def __contains__(self, key: object) -> bool:
        return key in self._entry


# ---------------------------------------------------------------------------------------------------------------
# Weighted reuse distance


class ReuseDistanceTracker:
    """Online *weighted reuse distance* of groups (conversations): between two visits of a group, the bytes of the
    distinct other groups visited in between, each counted once with the size of its latest visit.

    This is the measure of Bidaw's trace study (the LRU stack distance in bytes): a visit whose distance is below
    the cache size hits under LRU. A Fenwick tree over visit positions holds each group's latest weight at its
    latest position, so a visit or a query costs O(log V) (V = visits since the last compaction); compaction
    renumbers the live groups when positions run out, dropping groups :meth:`forget` was called for.

    Invariant: ``sum(weights in the tree) == total()`` and each known group has exactly one position.
    """

    def __init__(self, capacity: int = 1 << 15) -> None:
        self._cap = max(16, capacity)
        self._tree = [0] * (self._cap + 1)  # Fenwick tree, 1-based
        self._where: dict[Hashable, list[int]] = {}  # group -> [position, weight]
        self._next = 1  # next free position
        self._total = 0

    def _add(self, pos: int, delta: int) -> None:
        tree, n = self._tree, self._cap
        while pos <= n:
            tree[pos] += delta
            pos += pos & -pos

    def _prefix(self, pos: int) -> int:
        tree = self._tree
        s = 0
        while pos > 0:
            s += tree[pos]
            pos -= pos & -pos
        return s

    def _compact(self) -> None:
        live = sorted(self._where.items(), key=lambda kv: kv[1][0])
        self._cap = max(self._cap, 4 * len(live) + 16)
        n = self._cap
        tree = [0] * (n + 1)
        for i, (_g, rec) in enumerate(live, start=1):
            rec[0] = i
            tree[i] = rec[1]
        for i in range(1, n + 1):  # linear-time build: each node, once complete, adds itself to its parent
            parent = i + (i & -i)
            if parent <= n:
                tree[parent] += tree[i]
        self._tree = tree
        self._next = len(live) + 1

    def visit(self, group: Hashable, nbytes: int = 0) -> int | None:
        """Record a new visit of ``group`` weighing ``nbytes``; return its weighted reuse distance (bytes of other
        groups since its previous visit), or ``None`` on its first visit."""
        rec = self._where.get(group)
        dist: int | None = None
        if rec is not None:
            pos, w = rec
            dist = self._total - self._prefix(pos)
            self._add(pos, -w)
            self._total -= w
        if self._next > self._cap:
            if rec is not None:
                del self._where[group]
            self._compact()
            rec = None
        pos = self._next
        self._next += 1
        if rec is None:
            rec = [pos, 0]
            self._where[group] = rec
        rec[0], rec[1] = pos, 0
        if nbytes:
            self.add_bytes(group, nbytes)
        return dist

    def add_bytes(self, group: Hashable, nbytes: int) -> None:
        """Add to the weight of the group's current visit (a visit's bytes may arrive in several events)."""
        rec = self._where.get(group)
        if rec is None:
            raise KeyError(f"group {group!r} has no visit")
        rec[1] += nbytes
        self._total += nbytes
        self._add(rec[0], nbytes)

    def elapsed(self, group: Hashable) -> int | None:
        """Bytes of distinct other groups visited since the group's latest visit (its distance if it came now)."""
        rec = self._where.get(group)
        if rec is None:
            return None
        return self._total - self._prefix(rec[0])

    def forget(self, group: Hashable) -> None:
        """Drop a group; later visits of it are first visits. Its bytes stop counting in others' distances."""
        rec = self._where.pop(group, None)
        if rec is not None:
            self._add(rec[0], -rec[1])
            self._total -= rec[1]

    def total(self) -> int:
        return self._total

    def __contains__(self, group: object) -> bool:
        return group in self._where

    def __len__(self) -> int:
        return len(self._where)


# ---------------------------------------------------------------------------------------------------------------
# Bidaw hit potential


@dataclass(frozen=True, slots=True, kw_only=True)
class HitPotentialConfig:
    """Knobs of :class:`HitPotentialPolicy`; the distance buckets follow Bidaw's trace study (40 GB steps from a
    200 GB memory up to 480 GB and beyond)."""

    # Upper edges (tokens, exclusive) of the previous-answer-length bins; answers at or beyond the last edge share
    # the last bin. An entry whose answer length is unknown uses the pooled histogram of all bins.
    answer_edges: tuple[int, ...] = (4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256, 320)
    small_buckets: int = 8  # the small range [0, C) split this many ways (resolution of the extreme threshold)
    promising_buckets: int = 10  # promising range: this many equal buckets from C ...
    promising_span: float = 2.0  # ... up to (1 + span) x C; beyond is the extreme range (hit rate 0)
    # Extra bucket edges inside the extreme range (multiples of C): their hit rate is 0 like the rest of the range;
    # they only give the elapsed-distance threshold (below) a resolution when returns come from far away.
    extreme_edges: tuple[float, ...] = (4.0, 6.0, 8.0, 12.0, 16.0)
    # A conversation that has been away longer than all but this share of its answer bin's observed returns has
    # reached the extreme range: its potential drops to 0 (see the class docstring).
    extreme_tail: float = 0.01
    half_life: int = 20000  # samples (visits) after which a histogram count weighs half, so the model follows load
    min_samples: int = 32  # a bin with fewer (decayed) samples uses the pooled histogram
    refresh_every: int = 64  # samples between recomputations of the potential table
    ghost_horizon: float = 4.0  # the ghost cache sees this many capacities of accessed bytes into its "future"
    # A conversation away beyond the last edge counts as *departed*: one "never came back" observation for its
    # answer bin (it lowers the bin's potential, not its threshold). Departed conversations with nothing resident
    # are forgotten, so the policy's memory follows the live set. Each visit checks this many conversations, round
    # robin (O(1) per visit; every conversation is checked within #conversations / sweep_per_visit visits).
    sweep_per_visit: int = 2

    def __post_init__(self) -> None:
        if not self.answer_edges or list(self.answer_edges) != sorted(set(self.answer_edges)):
            raise ValueError("HitPotentialConfig.answer_edges must be a non-empty increasing tuple")
        if self.small_buckets < 1 or self.promising_buckets < 1 or self.promising_span <= 0:
            raise ValueError("HitPotentialConfig: bucket counts and promising_span must be positive")
        if not 0 <= self.extreme_tail < 1:
            raise ValueError("HitPotentialConfig.extreme_tail must be in [0, 1)")
        if list(self.extreme_edges) != sorted(set(self.extreme_edges)) or (
            self.extreme_edges and self.extreme_edges[0] <= 1 + self.promising_span
        ):
            raise ValueError("HitPotentialConfig.extreme_edges must increase and start beyond 1 + promising_span")


class _Group:
    """A conversation as the hit-potential policy sees it."""

    __slots__ = ("keys", "heap", "bin", "visit", "known", "since", "departed")

    def __init__(self, unknown_bin: int) -> None:
        self.keys: dict[Hashable, int] = {}  # resident key -> tail order (position * 2^32 + seq)
        self.heap: list[tuple[int, Hashable]] = []  # (-tail order, key), lazy: a row is live iff keys[key] matches
        self.bin: int = unknown_bin  # answer-length bin of its latest visit (the last index: unknown)
        self.visit: Hashable = None  # identity of its latest visit (round index, or a counter)
        self.known: bool = False  # its latest visit had an answer length (so its next distance is a sample)
        self.since: int = 0  # the policy's byte volume when its latest visit began
        self.departed: bool = False  # counted as "never came back" since its latest visit


class _GhostBelady:
    """Belady over the recent past, at the granularity of conversation visits (Bidaw's ghost cache).

    Visits enter a lag queue; a visit is *processed* once ``horizon`` bytes of later visits have arrived, so by
    then its group's next visit (if it came within the horizon) is known, and Belady's choice is exact except
    among groups whose next use lies beyond the horizon (all treated as "never", evicted first). The ghost holds
    sizes only. Each processed re-visit adds a hit or a miss to the distance bucket of its weighted reuse
    distance. Cost per processed visit: O(log n).
    """

    def __init__(self, capacity: int, horizon: int, n_buckets: int, half_life: int) -> None:
        self.capacity = capacity
        self.horizon = horizon
        self.hits = np.zeros(n_buckets)
        self.total = np.zeros(n_buckets)
        self._half_life = half_life
        self._since_decay = 0
        self._pending: deque[list[Any]] = deque()  # [seq, group, bytes, bucket or -1, processed]
        self._pending_bytes = 0
        self._upcoming: defaultdict[Hashable, deque[int]] = defaultdict(deque)  # group -> pending visit seqs
        self._seq = 0
        self._resident: dict[Hashable, tuple[float, int, int]] = {}  # group -> (next use, stamp, size)
        self._heap: list[tuple[float, int, Any]] = []  # (-next use, -stamp, group), lazy
        self._stamp = 0
        self._used = 0
        self.processed = 0

    def add_visit(self, group: Hashable, nbytes: int, bucket: int) -> list[Any]:
        """Queue a visit; returns its record so later bytes of the same visit can be added to ``rec[2]``."""
        self._seq += 1
        rec = [self._seq, group, nbytes, bucket, False]
        self._pending.append(rec)
        self._pending_bytes += nbytes
        self._upcoming[group].append(self._seq)
        self.drain()
        return rec

    def add_bytes(self, rec: list[Any], nbytes: int) -> None:
        """More bytes of a visit; ignored once the visit was processed (only when one visit exceeds the horizon)."""
        if not rec[4]:
            rec[2] += nbytes
            self._pending_bytes += nbytes

    def drain(self) -> None:
        while self._pending and self._pending_bytes - self._pending[0][2] >= self.horizon:
            self._process(self._pending.popleft())

    def flush(self) -> None:
        """Process every pending visit now (end of a trace; tests)."""
        while self._pending:
            self._process(self._pending.popleft())

    def hit_rates(self) -> np.ndarray:
        """Hits / visits per bucket (NaN where no visit was processed)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.total > 0, self.hits / np.maximum(self.total, 1e-300), np.nan)

    def _process(self, rec: list[Any]) -> None:
        seq, group, nbytes, bucket, _done = rec
        rec[4] = True
        self._pending_bytes -= nbytes
        up = self._upcoming[group]
        up.popleft()  # this visit
        nxt = float(up[0]) if up else math.inf
        if not up:
            del self._upcoming[group]
        old = self._resident.get(group)
        if bucket >= 0:
            self.total[bucket] += 1
            if old is not None:
                self.hits[bucket] += 1
            self._since_decay += 1
            if self._since_decay >= self._half_life:
                self.hits *= 0.5
                self.total *= 0.5
                self._since_decay = 0
        if old is not None:
            self._used -= old[2]
        self._stamp += 1
        self._resident[group] = (nxt, self._stamp, nbytes)
        self._used += nbytes
        heapq.heappush(self._heap, (-nxt, -self._stamp, group))
        while self._used > self.capacity and self._heap:
            neg_nu, neg_stamp, g = heapq.heappop(self._heap)
            cur = self._resident.get(g)
            if cur is None or cur[1] != -neg_stamp:
                continue
            del self._resident[g]
            self._used -= cur[2]
        if len(self._heap) > 2 * len(self._resident) + 64:
            self._heap = [(-nu, -st, g) for g, (nu, st, _s) in self._resident.items()]
            heapq.heapify(self._heap)
        self.processed += 1


class HitPotentialPolicy(EvictionPolicy):
    """Bidaw's eviction: evict the entry whose conversation has the lowest *hit potential*.

    Model (per conversation, a "group": ``meta.session``, or the key itself when no session is given):

    1. **Predictor.** The weighted reuse distance ``D`` of a conversation's next visit grows with the length of
       the answer it just received (users read longer answers longer). Online, every re-visit adds its measured
       ``D`` (:class:`ReuseDistanceTracker`) to a histogram kept per bin of the previous answer length, over
       distance buckets: the *small* range ``[0, C)`` (``C`` = capacity), ``promising`` buckets from ``C`` to
       ``(1 + promising_span) C``, and the *extreme* range beyond. Counts decay (``half_life``).
    2. **Hit rate per range.** small: 1.0; extreme: 0.0; promising bucket ``i``: the hit rate that a ghost cache
       running Belady over the recent past (:class:`_GhostBelady`, same capacity) achieved on visits whose
       distance fell in that bucket, made non-increasing in distance; before the ghost has data for a bucket, a
       linear ramp from 1 to 0 stands in.
    3. **Potential** of a conversation in answer bin ``a``:
       ``p_small * 1.0 + p_extreme * 0.0 + sum_i p_promising(i) * hit_promising(i)``, the probabilities being the
       bin's histogram shares (Bidaw's formula). Conversations that never come back are part of the extreme
       share: one is counted as *departed* once it has been away beyond the last distance edge (16 C).
    4. **Elapsed distance** (this implementation's addition, needed once conversations can end): a conversation
       that has been away longer than all but ``extreme_tail`` of its bin's observed returns is in the extreme
       range by now, and its potential is 0. Without this rule a conversation that never comes back would keep
       the potential of its bin until it is counted as departed.

    Eviction: conversations are kept per answer bin in the order of their latest visit. Within a bin the
    potential is the bin's value, dropping to 0 beyond the bin's threshold, so it is non-increasing in the time
    away and the bin's oldest conversation is its lowest: ``victim`` compares one conversation per bin (ties go to
    the longer-away one, i.e. LRU) and returns that conversation's last chunk (highest ``meta.position``;
    without positions, the latest inserted), so a prefix shrinks from its tail and its head stays usable.
    Cost: O(bins) per ``victim``, O(log n) per event; the exact elapsed distance (a Fenwick-tree query) is only
    computed when a cheap upper bound (all bytes accessed since the visit) passes the threshold.

    A *visit* is one request of a conversation: chunk events with the same ``(session, meta.round_index)`` form
    one visit; without ``round_index``, consecutive events of the same session do. The visit's weight is the
    bytes its events touched (``on_insert`` sizes, and stored sizes on ``on_access``). ``meta.prev_answer_tokens``
    of the visit is the answer the conversation just received (the predictor's input for its *next* visit).
    """

    name = "hit-potential"

    def __init__(self, capacity_bytes: int, config: HitPotentialConfig | None = None) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"hit-potential: capacity_bytes must be positive, got {capacity_bytes}")
        cfg = config or HitPotentialConfig()
        self.capacity = int(capacity_bytes)
        self.config = cfg
        c = float(self.capacity)
        small = [c * (i + 1) / cfg.small_buckets for i in range(cfg.small_buckets)]
        prom = [c + c * cfg.promising_span * (i + 1) / cfg.promising_buckets for i in range(cfg.promising_buckets)]
        far = [c * x for x in cfg.extreme_edges]
        self._edges = small + prom + far  # upper edges of the buckets; the last bucket is open
        self._extreme_start = prom[-1]  # distances from here on have hit rate 0
        self._lower = np.asarray([0.0, *self._edges])  # lower edge of each bucket
        self._n_small = cfg.small_buckets
        self._n_buckets = len(self._edges) + 1
        self._n_bins = len(cfg.answer_edges) + 1
        self._unknown = self._n_bins  # index of the "answer length unknown" bin
        # answer bin x distance bucket, decayed counts (lists: one += per visit is cheaper than on a numpy array)
        self._hist: list[list[float]] = [[0.0] * self._n_buckets for _ in range(self._n_bins)]
        self._departed: list[float] = [0.0] * self._n_bins  # decayed "never came back" counts per answer bin
        self._since_decay = 0
        self._tracker = ReuseDistanceTracker()
        self._ghost = _GhostBelady(self.capacity, int(cfg.ghost_horizon * c), cfg.promising_buckets, cfg.half_life)
        self._groups: dict[Hashable, _Group] = {}
        self._key_group: dict[Hashable, Hashable] = {}  # resident key -> group
        self._sizes: dict[Hashable, int] = {}  # resident key -> size
        # Groups with resident keys, per answer bin (last = unknown), oldest latest-visit first.
        self._bins: list[OrderedDict[Hashable, None]] = [OrderedDict() for _ in range(self._n_bins + 1)]
        self._pot: list[float] = [1.0] * (self._n_bins + 1)  # bin -> potential
        self._thr: list[float] = [math.inf] * (self._n_bins + 1)  # bin -> elapsed distance where it becomes 0
        self._dirty = 0  # samples since the table was computed
        self._table_ready = False
        self._volume = 0  # bytes of all visits so far (an upper bound on any elapsed distance)
        self._last_group: Hashable = object()  # group of the previous event, to split visits without round ids
        self._visit_counter = 0
        self._ghost_rec: dict[Hashable, list[Any]] = {}  # group -> its current visit's ghost record
        self._visits = 0
        self._sweep_queue: deque[Hashable] = deque()  # every known group once, checked round robin
        self._seq = 0

    # -- model ------------------------------------------------------------------------------------------------
    def _bucket(self, dist: float) -> int:
        return bisect_right(self._edges, dist)

    def _answer_bin(self, answer: int | None) -> int:
        if answer is None:
            return self._unknown
        return min(bisect_right(self.config.answer_edges, answer), self._n_bins - 1)

    def bucket_hit_rates(self) -> np.ndarray:
        """Hit rate assumed for each distance bucket: 1 (small), ghost Belady (promising, non-increasing), 0 (extreme)."""
        cfg = self.config
        rates = np.empty(self._n_buckets)
        rates[: self._n_small] = 1.0
        prior = 1.0 - (np.arange(cfg.promising_buckets) + 1) / (cfg.promising_buckets + 1)
        g_tot, g_hit = self._ghost.total, self._ghost.hits
        ghost = np.where(g_tot >= 4, g_hit / np.maximum(g_tot, 1e-12), prior)
        rates[self._n_small : self._n_small + cfg.promising_buckets] = np.minimum.accumulate(np.clip(ghost, 0, 1))
        rates[self._n_small + cfg.promising_buckets :] = 0.0
        return rates

    def _compute_table(self) -> None:
        # Rows: answer bins, then "unknown" (pooled); a bin with too few samples uses the pooled row too.
        hist = np.array(self._hist)
        departed = np.array(self._departed)
        pooled, pooled_departed = hist.sum(axis=0), departed.sum()
        few = hist.sum(axis=1) < self.config.min_samples
        hist[few] = pooled
        departed[few] = pooled_departed
        dist = np.vstack((hist, pooled))
        departed = np.append(departed, pooled_departed)
        # tail[b, j] = count of returns with D >= lower edge of bucket j; tail[b, 0] = all returns.
        tail = np.cumsum(dist[:, ::-1], axis=1)[:, ::-1]
        mass = tail[:, 0]
        has = mass > 1e-12
        # Departures are "distance infinite" samples: they dilute the potential but not the return thresholds.
        pot = np.where(has, (dist @ self.bucket_hit_rates()) / np.where(has, mass + departed, 1.0), 1.0)
        # The threshold is the first lower edge where the share of returns from that far falls to extreme_tail or
        # below (infinite when more than that share of returns lies in the open last bucket).
        below = tail <= self.config.extreme_tail * mass[:, None]
        first = below.argmax(axis=1)
        thr = np.where(has & below[np.arange(below.shape[0]), first], self._lower[first], math.inf)
        self._pot = pot.tolist()
        self._thr = thr.tolist()
        self._dirty = 0
        self._table_ready = True

    def _refresh(self) -> None:
        if not self._table_ready or self._dirty >= self.config.refresh_every:
            self._compute_table()

    def potential(self, group: Hashable) -> float | None:
        """The conversation's current hit potential (None if the policy does not know it)."""
        g = self._groups.get(group)
        if g is None:
            return None
        self._refresh()
        e = self._tracker.elapsed(group) or 0
        return 0.0 if e >= self._thr[g.bin] else self._pot[g.bin]

    def _sample(self, answer_bin: int, dist: float) -> None:
        self._hist[answer_bin][self._bucket(dist)] += 1.0
        self._dirty += 1
        self._since_decay += 1
        if self._since_decay >= self.config.half_life:
            self._hist = [[c * 0.5 for c in row] for row in self._hist]
            self._departed = [c * 0.5 for c in self._departed]
            self._since_decay = 0

    # -- visits -----------------------------------------------------------------------------------------------
    def _enter(self, key: Hashable, group: Hashable, size: int, meta: AccessMeta | None) -> None:
        g = self._groups.get(group)
        if g is None:
            g = self._groups[group] = _Group(self._unknown)
            self._sweep_queue.append(group)
        rnd = meta.round_index if meta is not None else None
        if rnd is not None:
            visit_id: Hashable = ("r", rnd)
            new_visit = g.visit != visit_id
        else:
            new_visit = group != self._last_group or g.visit is None
            if new_visit:
                self._visit_counter += 1
                visit_id = ("c", self._visit_counter)
            else:
                visit_id = g.visit
        self._last_group = group
        bins = self._bins
        if new_visit:
            self._new_visit(group, g, visit_id, meta.prev_answer_tokens if meta is not None else None)
        elif g.keys:
            bins[g.bin].move_to_end(group)
        if size:
            self._volume += size
            self._tracker.add_bytes(group, size)
            self._ghost.add_bytes(self._ghost_rec[group], size)
            self._ghost.drain()
        if key not in g.keys:
            if not g.keys:
                bins[g.bin][group] = None
            self._seq += 1
            pos = meta.position if meta is not None and meta.position is not None else 0
            order = (pos << 32) + (self._seq & 0xFFFFFFFF)
            g.keys[key] = order
            heapq.heappush(g.heap, (-order, key))
            self._key_group[key] = group

    def _new_visit(self, group: Hashable, g: _Group, visit_id: Hashable, answer: int | None) -> None:
        dist = self._tracker.visit(group, 0)
        if dist is not None and g.known and not g.departed:  # (a forgotten group's return was counted as departed)
            self._sample(g.bin, dist)
        g.departed = False
        bucket = -1
        if dist is not None:
            b = self._bucket(dist) - self._n_small
            bucket = b if 0 <= b < self.config.promising_buckets else -1
        self._ghost_rec[group] = self._ghost.add_visit(group, 0, bucket)
        g.visit = visit_id
        g.known = answer is not None
        g.since = self._volume
        new_bin = self._answer_bin(answer)
        if g.keys:
            self._bins[g.bin].pop(group, None)
            self._bins[new_bin][group] = None
        g.bin = new_bin
        self._visits += 1
        self._sweep(self.config.sweep_per_visit)

    def _sweep(self, n: int) -> None:
        """Check ``n`` conversations (round robin): count those away beyond the last edge as departed, and forget
        the departed ones that have nothing resident."""
        last = self._edges[-1]
        queue = self._sweep_queue
        for _ in range(min(n, len(queue))):
            group = queue.popleft()
            g = self._groups.get(group)
            if g is None:
                continue
            if not g.departed:
                e = self._tracker.elapsed(group)
                if e is not None and e >= last:
                    if g.known:
                        self._departed[g.bin] += 1.0
                        self._dirty += 1
                    g.departed = True
            if g.departed and not g.keys:
                del self._groups[group]
                self._tracker.forget(group)
                self._ghost_rec.pop(group, None)
                continue
            queue.append(group)

    def on_insert(self, key: Hashable, size: int, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        group = meta.session if meta is not None and meta.session is not None else key
        old_group = self._key_group.get(key)
        if old_group is not None and old_group != group:
            self.on_remove(key)
        self._sizes[key] = size
        self._enter(key, group, size, meta)

    def on_access(self, key: Hashable, *, now: float = 0.0, meta: AccessMeta | None = None) -> None:
        size = self._sizes.get(key)
        if size is None:
            return
        self._enter(key, self._key_group[key], size, meta)

    def on_remove(self, key: Hashable) -> None:
        group = self._key_group.pop(key, None)
        if group is None:
            return
        self._sizes.pop(key, None)
        g = self._groups[group]
        g.keys.pop(key, None)
        if not g.keys:
            g.heap.clear()
            self._bins[g.bin].pop(group, None)
        elif len(g.heap) > 2 * len(g.keys) + 8:
            g.heap = [(-o, k) for k, o in g.keys.items()]
            heapq.heapify(g.heap)

    def victim(self, *, now: float = 0.0) -> Hashable | None:
        if not self._key_group:
            return None
        self._refresh()
        pot, thr, volume, elapsed = self._pot, self._thr, self._volume, self._tracker.elapsed
        groups_by_key = self._groups
        best_group: Hashable = None
        best_pot, best_away = math.inf, -1
        for b, members in enumerate(self._bins):
            if not members:
                continue
            head = next(iter(members))
            away = volume - groups_by_key[head].since  # >= the exact elapsed distance, and ordered like it
            p = pot[b]
            if away >= thr[b] and (elapsed(head) or 0) >= thr[b]:
                p = 0.0
            if p < best_pot or (p == best_pot and away > best_away):
                best_pot, best_away, best_group = p, away, head
        g = groups_by_key[best_group]
        heap = g.heap
        while heap:
            neg_order, key = heap[0]
            if g.keys.get(key) == -neg_order:
                return key
            heapq.heappop(heap)
        raise AssertionError("hit-potential: a binned group has no live key")  # pragma: no cover

    def __len__(self) -> int:
        return len(self._key_group)

    def __contains__(self, key: object) -> bool:
        return key in self._key_group

    # -- introspection for studies and tests --------------------------------------------------------------------
    def distance_edges(self) -> list[float]:
        """Upper edges of the distance buckets (bytes); the last bucket (extreme) is open."""
        return list(self._edges)

    def histogram(self) -> np.ndarray:
        """Decayed counts, answer bin x distance bucket (a copy)."""
        return np.asarray(self._hist)

    def bin_potentials(self) -> list[float]:
        """Potential of each answer bin (last: unknown answer length), as currently computed."""
        self._refresh()
        return list(self._pot)

    def ghost_hit_rates(self) -> np.ndarray:
        return self.bucket_hit_rates()[self._n_small : self._n_small + self.config.promising_buckets].copy()


# ---------------------------------------------------------------------------------------------------------------
# Registry


_SIMPLE: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "queue-aware": QueueAwarePolicy,
    "inclusive": InclusivePolicy,
}


def eviction_policy_names() -> list[str]:
    return sorted([*_SIMPLE, "belady", "hit-potential"])


def eviction_options(name: str, capacity_bytes: int) -> dict[str, Any]:
    """The options a store tier of ``capacity_bytes`` passes to :func:`make_eviction_policy` for ``name``."""
    return {"capacity_bytes": capacity_bytes} if name == "hit-potential" else {}


def make_eviction_policy(name: str, **options: Any) -> EvictionPolicy:
    """Build a policy by its config name. Raises ``KeyError`` naming the known ones.

    ``lru``, ``fifo``, ``lfu``, ``queue-aware``, ``inclusive`` take no options. ``belady`` needs
    ``next_use=`` (a callable ``(key, now) -> next access time``, e.g. :class:`NextUseOracle`); ``hit-potential``
    needs ``capacity_bytes=`` and takes an optional ``config=`` :class:`HitPotentialConfig`. A missing required
    option raises ``TypeError`` naming it.
    """
    if name in _SIMPLE:
        if options:
            raise TypeError(f"eviction policy {name!r} takes no options, got {sorted(options)}")
        return _SIMPLE[name]()
    if name == "belady":
        if "next_use" not in options:
            raise TypeError("eviction policy 'belady' needs next_use=(key, now) -> time (the future accesses)")
        return BeladyPolicy(**options)
    if name == "hit-potential":
        if "capacity_bytes" not in options:
            raise TypeError("eviction policy 'hit-potential' needs capacity_bytes= (the tier's capacity)")
        return HitPotentialPolicy(**options)
    raise KeyError(f"unknown eviction policy {name!r}; known: {', '.join(eviction_policy_names())}")
