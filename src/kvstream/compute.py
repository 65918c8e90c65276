"""Compute joins the meet-in-the-middle: the policy that decides how much of a prefix the GPU recomputes.

KVStream reads a step's chunks from two tiers that meet in the middle; Bidaw hides loads behind ready requests.
Neither uses the GPU. But prefill of a prefix's *first* chunks is cheap (attention cost grows with position),
while a chunk costs the same to load wherever it sits. When the tiers are slow, the GPU computing the front
while the tiers load the back, stopping where they meet, beats both loading everything and recomputing
everything (Cake, arXiv 2410.03065). The mechanism is the read step's compute source
(:class:`kvstream.read_step.ComputePlan`); this module is the *policy* that feeds it. Sans-I/O: it takes
measurements and returns plans; the simulator's store and replay's store drive the same object.

:class:`ComputePolicy`:

- ``observe(tier, nbytes, busy_s)`` after each step: each tier's read bandwidth, an exponential average of
  bytes over busy seconds (what the step's tiers really gave, other loads and tenants included).
- ``plan(cost_s, nbytes, n_tiers)`` when a step starts: ``cost_s[j]`` is the GPU seconds to recompute the
  chain's chunk ``j`` at its position, already scaled by the GPU's load (``gpu_share``: the serving core
  divides by the share of the GPU compute may use, and passes nothing under a full batch: it backs off).
  Returns None (plain tiers: exactly the step without compute) when the best split recomputes nothing; a
  plain race (no claim rule, tiers from half-way) while a tier holding the step is not measured yet; else a plan whose ``front`` is the split that minimizes
  ``max(compute time of chunks [0, m), read time of the rest at the summed bandwidth)``. The step then
  refines it chunk by chunk: the meeting follows the sources' real speeds.

- ``estimate(cost_s, nbytes, tiers)``: the front ``plan`` would choose, changing nothing (no counters): what a
  scheduler is told of a request whose load has not started (Bidaw's *partly ready* requests,
  :class:`kvstream.scheduling.BidawScheduler`, through the serving core).
- ``skip(cost_s, nbytes, tiers)``: True when recomputing a whole item in the step's prefill costs less GPU time
  than reading it takes at the measured bandwidth (a cold or very slow tier).

Every request of a load gets its own split (:func:`split_load`, the one rule both drivers apply): each item's
*chain* (its leading chunks that are read, recomputable in prefix order: :func:`item_chains`) is merged into
one compute order, cheapest next chunk first (:func:`merge_chains`; a chunk's cost grows with its position, so
this order takes, for any number ``m`` of chunks, the ``m`` cheapest the prefix rule allows), the load's disk
chunks are reordered so that this merged chain leads the read step, and ``plan`` places the split in it: one
GPU recomputes the fronts of all the requests (in their prefix order) while the tiers read their backs, and
they meet. A request's split is how many of its chunks lie before the meeting point: zero (read whole), all of
them (recomputed whole), or anything between; an item with no chain (its first chunk in host memory) may still
be left to the step's prefill whole (``skip``). The GPU's share decides what a chunk costs (``gpu_share``: the
serving core scales each request's costs by it and sends none under a full batch, so compute backs off when
the batch has no room for it). After the step, :func:`leading_computed` gives each request's leading
recomputed run (what ``LoadDone.computed`` reports). Replay's store cannot reorder its step, so it hands the
store its keys in :func:`compute_order_hint`'s order and splits with ``reorder=False``.

Where load and recompute cannot overlap (LMCache: a storage backend only says how long a prefix it holds, that
prefix is loaded, and vLLM's prefill then computes every token after it), the only split left is a shorter hit:
:func:`loaded_prefix` picks how many held leading chunks to load, the GPU recomputing the rest after them.

Invariant: a plan never asks for more than the chain, and ``front`` is inside it (0 <= front <= len(cost_s)).

Costs are inputs from outside (a serving core's model, a caller's own :class:`ComputePlan`), so they are never
trusted: a chunk whose cost is not finite, is negative, or exceeds ``max_cost_s`` (default
:data:`MAX_CHUNK_COST_S`) cannot be recomputed, and the chain ends before it (:func:`usable_chain`; prefix
order: nothing after it is usable either). Why: the read step waits for the chunk compute holds, so one
infinite or huge cost held ``Store.read_chunks`` for ever (an ``inf`` timer never fires). Bandwidths that are
not finite and positive are treated as unmeasured samples and ignored. :func:`checked_plan` applies the same
rule to any plan a caller hands the store.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from kvstream.read_step import ComputePlan

H = TypeVar("H", bound=Hashable)

__all__ = ["ComputePolicy", "best_split", "gpu_share", "item_chains", "merge_chains", "split_load", "LoadSplit",
           "leading_computed", "compute_order_hint", "loaded_prefix", "usable_chain", "checked_plan",
           "MAX_CHUNK_COST_S"]

# The longest a compute source may spend on one chunk (GPU seconds, at the share it is given). A chunk that
# would take longer is read, never recomputed: the step waits for the chunk compute holds, and a minute on one
# chunk is a model gone wrong (a near-zero GPU share, a unit error), not a plan.
MAX_CHUNK_COST_S = 60.0


def _cost_ok(c: float, max_cost_s: float) -> bool:
    return math.isfinite(c) and 0.0 <= c <= max_cost_s


def usable_chain(cost_s: Sequence[float], max_cost_s: float = MAX_CHUNK_COST_S) -> tuple[float, ...]:
    """The leading costs a compute source may take: up to (not including) the first that is not finite, is
    negative or exceeds ``max_cost_s``. Chunks are recomputed in prefix order, so nothing after that one is
    usable either."""
    n = 0
    while n < len(cost_s) and _cost_ok(float(cost_s[n]), max_cost_s):
        n += 1
    return tuple(float(c) for c in cost_s[:n])


def checked_plan(plan: ComputePlan | None, n_chunks: int | None = None,
                 max_cost_s: float = MAX_CHUNK_COST_S) -> ComputePlan | None:
    """``plan`` made safe for a read step of ``n_chunks`` chunks (None: any): its chain cut at the first cost
    :func:`usable_chain` refuses and at the step's length, bandwidths that are not finite and positive set to 0
    (unmeasured), ``front`` inside the chain, a margin that is not finite and >= 0 set to the default. None
    when nothing is left to recompute (the tiers alone). The store applies it to every plan it is handed."""
    if plan is None:
        return None
    chain = usable_chain(plan.cost_s, max_cost_s)
    if n_chunks is not None:
        chain = chain[: max(n_chunks, 0)]
    if not chain:
        return None
    bandwidth = tuple(float(b) if math.isfinite(b) and b > 0 else 0.0 for b in plan.bandwidth)
    front = min(max(int(plan.front), 0), len(chain))
    margin = plan.margin if math.isfinite(plan.margin) and plan.margin >= 0 else 0.1  # ComputePlan's default
    if chain == plan.cost_s and bandwidth == plan.bandwidth and front == plan.front and margin == plan.margin:
        return plan
    return ComputePlan(cost_s=chain, bandwidth=bandwidth, front=front, margin=margin)


def _common(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def item_chains(items: Sequence[Sequence[Hashable]], disk: Collection[Hashable],
                limits: Sequence[int] | None = None) -> list[int]:
    """Per item: how many of its leading chunks the compute source may recompute. Chunk ``p`` of item ``k``
    joins while it is read in the load (in ``disk``: not in host memory), ``p < limits[k]`` (the costs the
    core sent), and every other item that holds it has the same leading chunks up to it (so a recomputed chunk
    is a *leading* chunk of every item it serves: the serving core counts a leading run per item). Items that
    share a prefix share those chunks of their chains (recomputed once)."""
    sets = [set(ch) for ch in items]
    out: list[int] = []
    for k, ch in enumerate(items):
        lim = len(ch) if limits is None else min(len(ch), limits[k] if k < len(limits) else 0)
        agree = [(sets[i], _common(ch, items[i])) for i in range(len(items)) if i != k]
        n = 0
        while n < lim and ch[n] in disk:
            c = ch[n]
            if any(c in held and same <= n for held, same in agree):
                break
            n += 1
        out.append(n)
    return out


def merge_chains(items: Sequence[Sequence[H]], chains: Sequence[int],
                 cost_s: Sequence[Sequence[float]]) -> tuple[list[H], list[float]]:
    """The load's one compute order over every item's chain: repeatedly the cheapest next chunk of any item
    (ties: the earlier item), each item's chunks in prefix order, a chunk its items share taken once (at the
    cost of the first item that reaches it). Returns the chunks and each one's GPU seconds. Per-item costs grow
    with position, so the order's first ``m`` chunks are the ``m`` cheapest the prefix rule allows."""
    order: list[H] = []
    costs: list[float] = []
    placed: set[H] = set()
    heap: list[tuple[float, int, int]] = []
    for k, n in enumerate(chains):
        if n > 0:
            heapq.heappush(heap, (cost_s[k][0], k, 0))
    while heap:
        c, k, p = heapq.heappop(heap)
        chunk = items[k][p]
        if chunk not in placed:
            placed.add(chunk)
            order.append(chunk)
            costs.append(c)
        if p + 1 < chains[k]:
            heapq.heappush(heap, (cost_s[k][p + 1], k, p + 1))
    return order, costs


def compute_order_hint(items: Sequence[Sequence[H]], cost_s: Sequence[Sequence[float]],
                       in_memory: Collection[H] = ()) -> list[H]:
    """A load's chunks (deduplicated) in the order :func:`split_load` would give its read step, as far as it is
    known before the read is planned (``in_memory``: the chunks host memory holds now). For a driver that
    cannot reorder the step itself (replay hands ``Store.read_chunks`` its keys in this order): the merged
    chain first, then the rest in item order."""
    everything: list[H] = []
    seen: set[H] = set()
    for ch in items:
        for c in ch:
            if c not in seen:
                seen.add(c)
                everything.append(c)
    disk = seen - set(in_memory)
    chains = item_chains(items, disk, [len(c) for c in cost_s])
    head, _ = merge_chains(items, chains, cost_s)
    first = set(head)
    return head + [c for c in everything if c not in first]


@dataclass(frozen=True, slots=True)
class LoadSplit:
    """How one load is read and recomputed (:func:`split_load`). ``order[j]``: the index in the driver's disk
    list of the read step's chunk ``j`` (the chunks left to the GPU are not in it); the step's first ``chain``
    chunks are the merged chain (``cost_s``: their GPU seconds); ``plan``: the compute source's plan over them
    (None: the tiers alone); ``fronts[k]``: item ``k``'s chunks before the plan's estimated meeting point (the
    split the policy chose for it); ``leave``: item -> its first disk chunk, for items recomputed from there in
    the step's prefill instead of read (the split's other end for an item with no chain)."""

    order: tuple[int, ...]
    chain: int
    cost_s: tuple[float, ...]
    plan: ComputePlan | None
    fronts: tuple[int, ...]
    leave: Mapping[int, int] = field(default_factory=dict)


def split_load(policy: "ComputePolicy", items: Sequence[Sequence[Hashable]], disk: Sequence[Hashable],
               holders: Sequence[Collection[int]], cost_s: Sequence[Sequence[float]], chunk_bytes: int,
               *, reorder: bool = True) -> LoadSplit:
    """Every request of a load gets its own front/back split (module docstring). ``items``: each request's
    available chunks, in prefix order; ``disk``: the load's chunks to read (deduplicated), ``holders[i]`` the
    tiers holding ``disk[i]``; ``cost_s[k]``: item ``k``'s GPU seconds per chunk (empty: it may not recompute).
    An item with no chain (its first chunk in host memory) whose disk chunks no other item needs is left to
    the step's prefill whole when the GPU recomputes it sooner than the tiers read it (``leave``; the split's
    other end, :meth:`ComputePolicy.skip`). ``reorder=False`` (a driver whose read step keeps ``disk``'s order):
    the chain is the longest run at the head of the chunks read that is the merged order's head. Both drivers
    call this, the simulator's store and replay's."""
    idx = {c: i for i, c in enumerate(disk)}
    chains = item_chains(items, idx, [len(c) for c in cost_s])
    leave = _leave(policy, items, chains, idx, holders, cost_s, chunk_bytes)
    dropped = {idx[c] for k, first in leave.items() for c in items[k][first:] if c in idx}
    kept = [i for i in range(len(disk)) if i not in dropped]
    head, costs = merge_chains(items, chains, cost_s)  # a left item has no chain, nor shares a chunk
    m = len(usable_chain(costs, policy.max_cost_s))  # a chunk compute cannot take ends the merged chain
    head, costs = head[:m], costs[:m]
    if reorder:
        first = [idx[c] for c in head]
        taken = set(first)
        order = tuple(first + [i for i in kept if i not in taken])
    else:
        n = 0
        while n < len(head) and n < len(kept) and disk[kept[n]] == head[n]:
            n += 1
        head, costs = head[:n], costs[:n]
        order = tuple(kept)
    tiers = sorted(set().union(*(set(holders[i]) for i in order))) if order else None
    plan = policy.plan(costs, [chunk_bytes] * len(order), tiers) if head else None
    front = set(head[: plan.front]) if plan is not None else set()
    fronts = tuple(sum(1 for c in ch if c in front) for ch in items)
    return LoadSplit(order=order, chain=len(head), cost_s=tuple(costs), plan=plan, fronts=fronts, leave=leave)


def _leave(policy: "ComputePolicy", items: Sequence[Sequence[Hashable]], chains: Sequence[int],
           idx: Mapping[Hashable, int], holders: Sequence[Collection[int]], cost_s: Sequence[Sequence[float]],
           chunk_bytes: int) -> dict[int, int]:
    """Items with no chain to recompute whole rather than read (see :func:`split_load`): item -> first disk
    chunk."""
    uses = Counter(c for ch in items for c in set(ch) if c in idx)
    out: dict[int, int] = {}
    for k, ch in enumerate(items):
        if chains[k] or k >= len(cost_s) or not cost_s[k]:
            continue
        mine = [j for j, c in enumerate(ch) if c in idx]
        if not mine or any(uses[ch[j]] > 1 for j in mine):
            continue
        first = mine[0]
        tiers = sorted(set().union(*(set(holders[idx[ch[j]]]) for j in mine)))
        if policy.skip(cost_s[k][first:], (len(ch) - first) * chunk_bytes, tiers):
            out[k] = first
    return out


def leading_computed(items: Sequence[Sequence[Hashable]], computed: Collection[Hashable],
                     avail: Sequence[int]) -> list[int]:
    """Per item: how many of its leading chunks the GPU recomputed (``computed``: the chunks it recomputed),
    at most ``avail[k]`` (its leading chunks available at all). A recomputed chunk past an item's leading run
    (behind one a tier delivered) is staged for that item as if loaded: the serving core counts a leading run."""
    out = []
    for k, ch in enumerate(items):
        n = 0
        lim = min(len(ch), avail[k])
        while n < lim and ch[n] in computed:
            n += 1
        out.append(n)
    return out


def best_split(cost_s: Sequence[float], rest_bytes: Sequence[int], bandwidth: float) -> int:
    """The number ``m`` of leading chunks to recompute that minimizes ``max(sum(cost_s[:m]), read time of the
    others)``, where the others are ``rest_bytes[m:]`` plus the chunks past the chain (``rest_bytes`` covers
    the whole step: ``len(rest_bytes) >= len(cost_s)``). Ties go to the smaller ``m`` (less GPU time)."""
    if bandwidth <= 0:
        return len(cost_s)
    total = float(sum(rest_bytes))
    best_m, best_t = 0, total / bandwidth
    c = 0.0
    for m in range(1, len(cost_s) + 1):
        c += cost_s[m - 1]
        total -= rest_bytes[m - 1]
        t = max(c, total / bandwidth)
        if t < best_t - 1e-12:
            best_m, best_t = m, t
        if c > best_t:  # compute time only grows from here
            break
    return best_m


def loaded_prefix(load_s: Sequence[float], cost_s: Sequence[float]) -> int:
    """How many of ``n`` held leading chunks to load when loading and recomputing run one after the other (the
    rest, ``[k, n)``, left to the GPU's prefill). ``load_s[j]``: seconds to load chunk ``j`` (0 for a host-memory
    hit; ``inf`` for a tier that delivers nothing); ``cost_s[j]``: GPU seconds to recompute it at its position
    (growing with ``j``: attention reads every token before it).

    Invariant: returns the ``k`` in ``[0, n]`` that minimizes ``sum(load_s[:k]) + sum(cost_s[k:])``, the largest
    such ``k`` on a tie (less GPU work); so ``k == n`` whenever every ``load_s[j] <= cost_s[j]``, and ``k`` never
    grows when a load time does.

    Why the answer is in between only when load times differ per chunk: going from ``k`` to ``k + 1`` changes
    the total by ``load_s[k] - cost_s[k]``. With one load time for every chunk and costs growing with position
    these steps only fall, so the total is concave in ``k`` and its minimum is at an end: all or nothing. With a
    fast front (host memory, a local disk) and a tail only a slow tier holds (a stalled or slow shared file
    system), the steps are negative over the front and positive over the tail: load the front, recompute the
    tail. O(n), one pass."""
    if len(load_s) != len(cost_s):
        raise ValueError(f"loaded_prefix: {len(load_s)} load times but {len(cost_s)} costs")
    # Not trusted (module docstring): a load time or a cost that is not a number >= 0 is infinite: that chunk
    # cannot be loaded (a tier that delivers nothing) or recomputed. k lies in [lo, hi]: past the last chunk
    # that cannot be recomputed and before the first that cannot be loaded; if there is no such k, load what
    # can be loaded (an infinite cost is an estimate, an infinite load time a tier that delivers nothing).
    n = len(load_s)
    load = [float(x) if x >= 0 else math.inf for x in load_s]  # NaN compares False: infinite too
    cost = [float(x) if x >= 0 else math.inf for x in cost_s]
    hi = next((j for j, x in enumerate(load) if math.isinf(x)), n)
    lo = max((j + 1 for j, x in enumerate(cost) if math.isinf(x)), default=0)
    if lo > hi:
        return hi
    best_k, best, total = lo, 0.0, 0.0  # total: the change from k = lo to k (every term finite here)
    for j in range(lo, hi):
        total += load[j] - cost[j]
        if total <= best:
            best_k, best = j + 1, total
    return best_k


def gpu_share(running: int, max_running: int, blocking: bool, busy: float = 0.0) -> float:
    """The share of the GPU a recompute may use. A blocking load holds the whole step (the GPU waits for it):
    all of it. A load behind running work competes with it (other requests' prefill and decodes): the smaller
    of the batch's free share and the GPU's idle share (``busy``: the fraction of recent time it ran steps), 0
    when the batch is full or the GPU never idles (compute backs off entirely)."""
    if blocking:
        return 1.0
    if max_running <= 0:
        return 0.0
    return max(0.0, min(1.0 - running / max_running, 1.0 - busy))


@dataclass
class ComputePolicy:
    """See the module docstring. ``alpha``: weight of a new bandwidth sample; ``margin``: the step's claim
    margin; ``min_chunks``: a chain shorter than this is not worth a plan (a recompute pays the step's
    launch overhead too); ``max_cost_s``: a chunk costing more (or a cost that is not a finite number >= 0)
    ends the chain (:func:`usable_chain`)."""

    n_tiers: int
    alpha: float = 0.3
    margin: float = 0.1
    min_chunks: int = 1
    max_cost_s: float = MAX_CHUNK_COST_S
    bandwidth: list[float | None] = field(default_factory=list)
    plans: int = 0  # plans handed out
    declined: int = 0  # steps where the policy chose the tiers alone
    skipped: int = 0  # items recomputed whole instead of read

    def __post_init__(self) -> None:
        if not self.bandwidth:
            self.bandwidth = [None] * self.n_tiers
        if len(self.bandwidth) != self.n_tiers:
            raise ValueError(f"compute policy: {self.n_tiers} tiers but {len(self.bandwidth)} bandwidths")
        # A bandwidth that is not a finite number >= 0 is not a measurement (0 is one: a tier that delivered
        # nothing).
        self.bandwidth = [b if b is not None and math.isfinite(b) and b >= 0 else None for b in self.bandwidth]

    def observe(self, tier: int, nbytes: int, busy_s: float) -> None:
        """A step's reads on ``tier``: ``nbytes`` checked ok over ``busy_s`` seconds with a read in flight."""
        if not (nbytes > 0 and busy_s > 0 and math.isfinite(nbytes) and math.isfinite(busy_s)):
            return  # nothing measured (NaN compares False)
        bw = nbytes / busy_s
        if not math.isfinite(bw):
            return
        old = self.bandwidth[tier]
        self.bandwidth[tier] = bw if old is None else (1 - self.alpha) * old + self.alpha * bw

    def plan(self, cost_s: Sequence[float], nbytes: Sequence[int], tiers: Sequence[int] | None = None
             ) -> ComputePlan | None:
        """A plan for a step of chunks of ``nbytes`` whose first ``len(cost_s)`` may be recomputed; ``tiers``:
        the tiers that hold the step's chunks (None: all). None = no compute (see the module docstring)."""
        cost_s = usable_chain(cost_s, self.max_cost_s)
        if len(cost_s) < self.min_chunks or not cost_s:
            return None
        use = range(self.n_tiers) if tiers is None else tiers
        bws = [self.bandwidth[t] for t in use]
        if any(b is None for b in bws):
            # Not measured yet: a plain race, as between two tiers (no bandwidth, so no claim rule: compute
            # claims until it meets the tiers), the tiers' schedule starting half-way. The tiers read from the
            # start, so the step measures them; at worst the step waits for one chunk's compute.
            self.plans += 1
            return ComputePlan(cost_s=tuple(cost_s), bandwidth=(0.0,) * self.n_tiers, front=len(cost_s) // 2,
                               margin=self.margin)
        total_bw = sum(b for b in bws if b)
        m = best_split(cost_s, nbytes, total_bw)
        if m == 0:
            self.declined += 1
            return None
        self.plans += 1
        use = list(use)
        bw = tuple(float(self.bandwidth[t] or 0.0) if t in set(use) else 0.0 for t in range(self.n_tiers))
        return ComputePlan(cost_s=tuple(cost_s), bandwidth=bw, front=m, margin=self.margin)

    def estimate(self, cost_s: Sequence[float], nbytes: Sequence[int], tiers: Sequence[int] | None = None) -> int:
        """The front :meth:`plan` would give these chunks now (0: none), without counting a plan: what a
        scheduler is told of a request whose load has not started."""
        cost_s = usable_chain(cost_s, self.max_cost_s)
        if len(cost_s) < self.min_chunks or not cost_s:
            return 0
        use = range(self.n_tiers) if tiers is None else tiers
        bws = [self.bandwidth[t] for t in use]
        if any(b is None for b in bws):
            return len(cost_s) // 2
        return best_split(cost_s, nbytes, sum(b for b in bws if b))

    def skip(self, cost_s: Sequence[float], nbytes: int, tiers: Sequence[int]) -> bool:
        """Whether to recompute a whole item rather than read its ``nbytes`` (see the module docstring)."""
        bws = [self.bandwidth[t] for t in tiers]
        if not cost_s or not bws or any(b is None for b in bws):
            return False
        if len(usable_chain(cost_s, self.max_cost_s)) < len(cost_s):
            return False  # a chunk of it cannot be recomputed: read it
        bw = sum(b for b in bws if b)
        if bw <= 0:
            return True
        if sum(cost_s) < nbytes / bw:
            self.skipped += 1
            return True
        return False
