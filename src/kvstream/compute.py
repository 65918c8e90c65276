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

- ``skip(cost_s, nbytes, tiers)`` for a load's *other* items (the read step's compute source serves one
  chain, the first item): True when recomputing the whole item in the step's prefill costs less GPU time than
  reading it takes at the measured bandwidth (the split's other end, m = n: a cold or very slow tier), so
  the load leaves it out and the core recomputes it.

Invariant: a plan never asks for more than the chain, and ``front`` is inside it (0 <= front <= len(cost_s)).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field

from kvstream.read_step import ComputePlan

__all__ = ["ComputePolicy", "best_split", "gpu_share", "chain_length", "computed_per_item", "items_to_skip"]


def chain_length(items: Sequence[Sequence[Hashable]], disk: Sequence[Hashable]) -> int:
    """The compute chain of a load: how many leading chunks of ``items[0]`` the read step's compute source may
    recompute. ``disk``: the load's chunks to read, in step order (deduplicated; host-memory hits left out).
    Chunk ``j`` joins while it is the step's chunk ``j`` (so chunks 0..j of the first item are all read, none
    from host memory) and every other item that needs it has the same leading chunks up to it: a recomputed
    chunk is then a *leading* chunk of every item it serves, which is what a driver reports per item
    (:func:`computed_per_item`) and what the serving core's pin count per item relies on. Both drivers (the
    simulator's store and replay's) use this one rule."""
    if not items:
        return 0
    first = items[0]
    others = [(set(ch), _common(first, ch)) for ch in items[1:]]
    n = 0
    while n < min(len(first), len(disk)) and disk[n] == first[n]:
        c = first[n]
        if any(c in held and agree <= n for held, agree in others):
            break
        n += 1
    return n


def _common(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def items_to_skip(policy: "ComputePolicy", items: Sequence[Sequence[Hashable]],
                  on_disk: Mapping[Hashable, Collection[int]], cost_s: Sequence[Sequence[float]],
                  chunk_bytes: int) -> dict[int, int]:
    """The split's other end for a load's items past the first (the compute chain serves one item): an item
    whose disk chunks (``on_disk``: chunk -> tiers holding it) no other item needs, and which the GPU recomputes
    faster than the tiers read it (:meth:`ComputePolicy.skip`), is left out of the read. Returns item index ->
    its first disk chunk: it is available up to there, the core recomputes the rest in the step's prefill."""
    uses = Counter(c for ch in items for c in set(ch) if c in on_disk)
    out: dict[int, int] = {}
    for k in range(1, min(len(items), len(cost_s))):
        ch = items[k]
        mine = [j for j, c in enumerate(ch) if c in on_disk]
        if not mine or any(uses[ch[j]] > 1 for j in mine):
            continue
        first = mine[0]
        tiers = sorted(set().union(*(on_disk[ch[j]] for j in mine)))
        if policy.skip(cost_s[k][first:], (len(ch) - first) * chunk_bytes, tiers):
            out[k] = first
    return out


def computed_per_item(items: Sequence[Sequence[Hashable]], computed: int, avail: Sequence[int]) -> list[int]:
    """Per item: how many of its leading chunks were recomputed, given that the first ``computed`` chunks of
    ``items[0]`` were (its leading run; ``avail[k]``: item ``k``'s leading chunks available at all)."""
    if not items or computed <= 0:
        return [0] * len(items)
    return [min(_common(items[0][:computed], ch), avail[k]) for k, ch in enumerate(items)]


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


def gpu_share(running: int, max_running: int, blocking: bool) -> float:
    """The share of the GPU a recompute may use. A blocking load holds the whole step (the GPU waits for it):
    all of it. A load behind running work competes with it: the free share of the batch, 0 when the batch is
    full (compute backs off entirely)."""
    if blocking:
        return 1.0
    if max_running <= 0:
        return 0.0
    return max(0.0, 1.0 - running / max_running)


@dataclass
class ComputePolicy:
    """See the module docstring. ``alpha``: weight of a new bandwidth sample; ``margin``: the step's claim
    margin; ``min_chunks``: a chain shorter than this is not worth a plan (a recompute pays the step's
    launch overhead too)."""

    n_tiers: int
    alpha: float = 0.3
    margin: float = 0.1
    min_chunks: int = 1
    bandwidth: list[float | None] = field(default_factory=list)
    plans: int = 0  # plans handed out
    declined: int = 0  # steps where the policy chose the tiers alone
    skipped: int = 0  # items recomputed whole instead of read

    def __post_init__(self) -> None:
        if not self.bandwidth:
            self.bandwidth = [None] * self.n_tiers
        if len(self.bandwidth) != self.n_tiers:
            raise ValueError(f"compute policy: {self.n_tiers} tiers but {len(self.bandwidth)} bandwidths")

    def observe(self, tier: int, nbytes: int, busy_s: float) -> None:
        """A step's reads on ``tier``: ``nbytes`` checked ok over ``busy_s`` seconds with a read in flight."""
        if nbytes <= 0 or busy_s <= 0:
            return
        bw = nbytes / busy_s
        old = self.bandwidth[tier]
        self.bandwidth[tier] = bw if old is None else (1 - self.alpha) * old + self.alpha * bw

    def plan(self, cost_s: Sequence[float], nbytes: Sequence[int], tiers: Sequence[int] | None = None
             ) -> ComputePlan | None:
        """A plan for a step of chunks of ``nbytes`` whose first ``len(cost_s)`` may be recomputed; ``tiers``:
        the tiers that hold the step's chunks (None: all). None = no compute (see the module docstring)."""
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

    def skip(self, cost_s: Sequence[float], nbytes: int, tiers: Sequence[int]) -> bool:
        """Whether to recompute a whole item rather than read its ``nbytes`` (see the module docstring)."""
        bws = [self.bandwidth[t] for t in tiers]
        if not cost_s or not bws or any(b is None for b in bws):
            return False
        bw = sum(b for b in bws if b)
        if bw <= 0:
            return True
        if sum(cost_s) < nbytes / bw:
            self.skipped += 1
            return True
        return False
