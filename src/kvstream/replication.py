"""Replication policies (sans-I/O): which tiers get a copy of each chunk, at write time and after reads.

Protocol, driven by the store and by the simulator alike::

    tiers = policy.targets(WriteIntent(key=k, nbytes=n, position=i), n_tiers)   # at flush: where to write
    orders = policy.on_read(ReadObservation(...))                                # after each step's disk read
    # each CopyOrder(key, tier) asks the driver to add a copy of a chunk it has just read (from host memory)

The primary tier (index 0, the node-local one) always gets every chunk: it is the tier a node can count on.
A policy never reads a clock or touches a file; ``now`` is in the observations.

Write amplification = bytes written to all tiers / bytes put; the store and the simulator report it beside
every read-time figure, since writing twice is what replication costs.

- ``full``: every tier (the KVStream paper's choice). With ``read_through`` (the store turns it on when a tier
  after the first is shared with other nodes), a chunk this node reads that its primary tier lacks (another
  node's chunk, or one the primary evicted) gets a copy there from host memory: a prefix another node wrote is
  read from the shared file system once, then from local NVMe (BENCHMARKS §9.1: a 768 MiB prefix's second use
  on another node took 0.32 s with it, 1.12 s again from GlusterFS without).
- ``single``: the primary only (LMCache today).
- ``partial:F``: the primary, plus a second copy of a fraction F of each prefix's chunks, spread evenly along
  the prefix (a low-discrepancy sequence over the chunk position), so any read of a prefix finds about F of
  its chunks on both tiers; the router orders the read list so these dual chunks form the meeting region.
- ``lazy``: the primary only, until a tier's read bandwidth in a step falls below ``slow_ratio`` of the best it
  has shown; then new writes go to every tier and the chunks that step read only from the slow tier get a copy,
  for ``hold_steps`` steps after the last slow one.
- ``selective``: the primary only; a chunk read back from disk (reused) gets its copies on the other tiers.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import xxhash

__all__ = [
    "WriteIntent",
    "ReadObservation",
    "CopyOrder",
    "ReplicationPolicy",
    "FullReplication",
    "SingleCopy",
    "PartialReplication",
    "LazyReplication",
    "partial_fraction",
    "SelectiveReplication",
    "parse_replication",
]

_GOLDEN = (math.sqrt(5) - 1) / 2  # 0.618...: positions i*φ mod 1 spread evenly for every prefix length


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteIntent:
    key: bytes  # the chunk's store key
    nbytes: int  # payload bytes
    position: int | None = None  # chunk index within its prefix, if the caller knows it


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadObservation:
    """What one step's disk read looked like (chunks served from host memory are not in it)."""

    now: float  # seconds, driver's clock
    keys: Sequence[bytes]  # chunks read from disk in this step
    holders: Sequence[Collection[int]]  # holders[i]: tiers that held keys[i] when the read started
    tier_bytes: Sequence[int]  # bytes each tier delivered in this step (duplicates included)
    tier_busy_s: Sequence[float]  # seconds each tier had reads in flight in this step


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyOrder:
    key: bytes  # chunk to copy (the driver has it in host memory: it was just read)
    tier: int  # tier that should get a copy


class ReplicationPolicy(ABC):
    name: str = "abstract"

    @abstractmethod
    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        """Tiers to write this chunk to now; always includes 0."""

    def on_read(self, obs: ReadObservation) -> list[CopyOrder]:
        """Copies to add after a step's read; most policies add none."""
        return []


@dataclass
class FullReplication(ReplicationPolicy):
    name: str = "full"
    read_through: bool = False  # copy a chunk read without a primary copy to the primary (module docstring)

    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        return frozenset(range(n_tiers))

    def on_read(self, obs: ReadObservation) -> list[CopyOrder]:
        if not self.read_through:
            return []
        return [CopyOrder(key=k, tier=0) for k, hs in zip(obs.keys, obs.holders) if hs and 0 not in hs]


@dataclass
class SingleCopy(ReplicationPolicy):
    name: str = "single"

    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        return frozenset((0,))


def _unit(intent: WriteIntent) -> float:
    """A number in [0, 1) per chunk: evenly spread by position when known, else a hash of the key."""
    if intent.position is not None:
        return (intent.position * _GOLDEN) % 1.0
    return xxhash.xxh3_64_intdigest(intent.key) / 2.0**64


@dataclass
class PartialReplication(ReplicationPolicy):
    fraction: float = 0.4
    name: str = "partial"

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction <= 1.0:
            raise ValueError(f"partial replication fraction must be in [0, 1], got {self.fraction}")

    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        if n_tiers == 1 or _unit(intent) >= self.fraction:
            return frozenset((0,))
        return frozenset(range(n_tiers))


def partial_fraction(read_bws: Sequence[float], margin: float = 1.5) -> float:
    """The share of each prefix's chunks to give a second copy (``partial:F``) for tiers that read at
    ``read_bws`` (bytes/s; the primary first): ``margin`` times the share of a step the other tiers read in a
    meet-in-the-middle (their summed bandwidth over all tiers'), at least 0.2 and at most 1.0 (full replication).

    Why: KVStream's advice when the second tier is short of write bandwidth is partial replication (its 40 %
    reads within 5 % of the bound); a slow second tier only ever reads the back ``share`` of a step, so copies of
    the other chunks there cost its write bandwidth (and, through the write backlog, host memory and catch-up
    reads) for no read. The margin keeps dual chunks where the meeting point moves when a tier slows down.
    Why 1.5 and not more: the second copy's writes are what the loads meet. With margin 3 the replay's kvstream
    copied 75-83 % of each prefix to an emulated shared tier that reads about a quarter of a step, its loads read
    40-48 % of their bytes beside those writes, and its local tier read 1.28-1.33 GB/s per busy second against a
    one-tier system's 1.48-1.62; at 1.5 it read 1.51-1.60 and its mean TTFT fell by a quarter (BENCHMARKS §3.0).
    Invariant: 0.2 <= F <= 1.0, non-decreasing in every non-primary tier's bandwidth, 1.0 once they read at
    least twice as fast as the primary (a share of two thirds, at margin 1.5)."""
    if len(read_bws) < 2 or any(not math.isfinite(b) or b < 0 for b in read_bws):
        return 1.0
    total = float(sum(read_bws))
    if total <= 0:
        return 1.0
    share = (total - read_bws[0]) / total
    return min(1.0, max(0.2, margin * share))


@dataclass
class LazyReplication(ReplicationPolicy):
    slow_ratio: float = 0.7  # a step is slow for a tier below this share of its best bandwidth
    hold_steps: int = 8  # keep replicating this many steps after the last slow one
    min_bytes: int = 1 << 20  # steps where a tier read less than this tell nothing about its speed
    name: str = "lazy"
    _best: list[float] = field(default_factory=list, repr=False)
    _replicate_left: int = field(default=0, repr=False)

    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        if n_tiers > 1 and self._replicate_left > 0:
            return frozenset(range(n_tiers))
        return frozenset((0,))

    @property
    def active(self) -> bool:
        return self._replicate_left > 0

    def on_read(self, obs: ReadObservation) -> list[CopyOrder]:
        n = len(obs.tier_bytes)
        if len(self._best) < n:
            self._best += [0.0] * (n - len(self._best))
        slow: set[int] = set()
        for t in range(n):
            if obs.tier_bytes[t] < self.min_bytes or obs.tier_busy_s[t] <= 0:
                continue
            bw = obs.tier_bytes[t] / obs.tier_busy_s[t]
            if self._best[t] and bw < self.slow_ratio * self._best[t]:
                slow.add(t)
            self._best[t] = max(self._best[t], bw)
        if self._replicate_left > 0:
            self._replicate_left -= 1
        if not slow:
            return []
        self._replicate_left = self.hold_steps
        orders = []
        for key, hs in zip(obs.keys, obs.holders):
            if len(hs) == 1 and next(iter(hs)) in slow:
                orders += [CopyOrder(key=key, tier=t) for t in range(n) if t not in hs]
        return orders


@dataclass
class SelectiveReplication(ReplicationPolicy):
    name: str = "selective"

    def targets(self, intent: WriteIntent, n_tiers: int) -> frozenset[int]:
        return frozenset((0,))

    def on_read(self, obs: ReadObservation) -> list[CopyOrder]:
        n = len(obs.tier_bytes)
        return [CopyOrder(key=k, tier=t) for k, hs in zip(obs.keys, obs.holders) for t in range(n) if t not in hs]


def parse_replication(spec: str, *, field_name: str = "replication") -> ReplicationPolicy:
    """``full`` | ``single`` | ``partial:F`` | ``lazy`` | ``selective``; errors name the config field."""
    from kvstream.errors import ConfigError

    kind, _, arg = spec.partition(":")
    try:
        if kind == "full" and not arg:
            return FullReplication()
        if kind == "single" and not arg:
            return SingleCopy()
        if kind == "partial":
            return PartialReplication(fraction=float(arg) if arg else 0.4)
        if kind == "lazy" and not arg:
            return LazyReplication()
        if kind == "selective" and not arg:
            return SelectiveReplication()
    except ValueError as exc:
        raise ConfigError(field_name, f"{spec!r}: {exc}") from None
    raise ConfigError(field_name, f"unknown replication {spec!r}; expected full, single, partial:F, lazy or selective")
