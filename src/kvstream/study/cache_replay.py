"""Cache-only replay of conversation KV accesses against one host-memory tier (no I/O, no timing).

The unit is a conversation's whole KV (Bidaw's trace study caches per user): round ``r`` of a user needs the KV
of rounds ``0 .. r-1`` (a *hit* if it is resident, a *miss* if it was evicted), then stores the KV of rounds
``0 .. r`` (the entry grows). Round 0 needs nothing and is neither. After each access the tier evicts, by
asking the policy for victims, until the resident bytes fit the capacity. This is the protocol of the trace
authors' hit-rate scripts (``hit_rate.py`` in their repository), with two of their choices as options:

- ``context_cap``: a conversation's KV is capped at the model's context (2048 tokens for OPT), as theirs is;
- ``drop_finished``: a conversation's KV is dropped after its last round in the trace, as theirs is (an oracle
  every policy gets equally; turn it off to see the policies also carry conversations that never come back).

Queue-aware eviction sees a look-ahead window of the next ``lookahead`` accesses in trace order (their
``evict_window_count = 30``), standing in for the scheduler's waiting queue. Belady sees the whole future.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np

from kvstream.eviction import (
    AccessMeta,
    EvictionPolicy,
    HitPotentialConfig,
    NextUseOracle,
    QueueAwarePolicy,
    make_eviction_policy,
)
from kvstream.models import ModelShape, kv_bytes_per_token
from kvstream.workload.bidaw import BidawTrace

__all__ = ["AccessStream", "ReplayResult", "build_accesses", "replay", "replay_many", "STUDY_POLICIES"]

# The policies a study compares, in display order.
STUDY_POLICIES: tuple[str, ...] = ("fifo", "lru", "lfu", "inclusive", "queue-aware", "hit-potential", "belady")


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessStream:
    """Conversation-level accesses in arrival order (one per trace row). All arrays have one row per access."""

    user: np.ndarray  # int64 conversation id
    time: np.ndarray  # float64 seconds
    store_bytes: np.ndarray  # int64 KV bytes the conversation holds after this access (rounds 0..r, capped)
    load_bytes: np.ndarray  # int64 KV bytes this access needs (rounds 0..r-1, capped); 0 for round 0
    answer: np.ndarray  # int64 this round's answer tokens (the predictor's input for the next visit)
    round_index: np.ndarray  # int64
    is_last: np.ndarray  # bool, the conversation's last access in the stream
    counted: np.ndarray  # bool, counts toward the hit rate (round > 0 and inside the measurement window)
    bytes_per_token: int  # KV bytes per token used for the sizes

    def __len__(self) -> int:
        return int(self.user.shape[0])


def build_accesses(
    trace: BidawTrace,
    *,
    bytes_per_token: int,
    context_cap: int | None = None,
    measure_from: float | None = None,
    measure_until: float | None = None,
) -> AccessStream:
    """Accesses of ``trace`` with sizes ``min(tokens, context_cap) * bytes_per_token``.

    Only accesses with ``measure_from <= time < measure_until`` count toward hit rates (the rest warm the cache up).
    """
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    hist = trace.history_tokens
    after = hist + trace.query + trace.response
    if context_cap is not None:
        hist = np.minimum(hist, context_cap)
        after = np.minimum(after, context_cap)
    counted = trace.round_index > 0
    if measure_from is not None:
        counted &= trace.time >= measure_from
    if measure_until is not None:
        counted &= trace.time < measure_until
    return AccessStream(
        user=trace.user, time=trace.time, store_bytes=after * bytes_per_token, load_bytes=hist * bytes_per_token,
        answer=trace.response, round_index=trace.round_index, is_last=trace.is_last, counted=counted,
        bytes_per_token=bytes_per_token,
    )  # fmt: skip


def model_bytes_per_token(model: ModelShape, *, tensor: str = "kv", dtype_bytes: int = 2) -> int:
    """Bytes per token of the cached tensor: ``kv`` (K and V) or ``compact`` (see :mod:`kvstream.compact`)."""
    if tensor == "kv":
        return kv_bytes_per_token(model, dtype_bytes)
    if tensor == "compact":
        from kvstream.compact import choose_cached_tensor

        return choose_cached_tensor(model, dtype_bytes=dtype_bytes).bytes_per_token
    raise ValueError(f"tensor must be 'kv' or 'compact', got {tensor!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayResult:
    """Outcome of one policy at one capacity."""

    policy: str
    capacity_bytes: int
    hits: int  # counted accesses whose KV was resident
    misses: int  # counted accesses whose KV had been evicted
    evictions: int  # victims taken (all accesses, warm-up included)
    extra: dict[str, float] = field(default_factory=dict)  # policy-specific figures (e.g. ghost hit rates)
    # The same counts weighted by the KV bytes each counted access needs (its history): the share of *bytes*
    # that must come from disk, as opposed to the share of requests. Invariant: hit_bytes + miss_bytes is the
    # sum of the counted accesses' load_bytes, the same for every policy on one stream.
    hit_bytes: int = 0
    miss_bytes: int = 0

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else float("nan")

    @property
    def miss_rate(self) -> float:
        return self.misses / self.accesses if self.accesses else float("nan")

    @property
    def byte_miss_rate(self) -> float:
        total = self.hit_bytes + self.miss_bytes
        return self.miss_bytes / total if total else float("nan")


def _make_policy(name: str, stream: AccessStream, capacity: int, hp_config: HitPotentialConfig | None) -> EvictionPolicy:
    if name == "belady":
        times: dict[Hashable, list[float]] = {}  # user -> access times
        for i, u in enumerate(stream.user.tolist()):
            times.setdefault(u, []).append(float(i))
        return make_eviction_policy("belady", next_use=NextUseOracle(times))
    if name == "hit-potential":
        return make_eviction_policy("hit-potential", capacity_bytes=capacity, config=hp_config)
    return make_eviction_policy(name)


def replay(
    stream: AccessStream,
    policy: str,
    capacity_bytes: int,
    *,
    lookahead: int = 30,
    drop_finished: bool = True,
    hp_config: HitPotentialConfig | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayResult:
    """Replay ``stream`` against a tier of ``capacity_bytes`` managed by ``policy`` (a ``make_eviction_policy`` name).

    ``progress`` is called with the number of accesses done, every 4096 accesses and at the end.
    Logical time ``now`` is the access index (what :class:`~kvstream.eviction.NextUseOracle` expects).
    """
    if capacity_bytes <= 0:
        raise ValueError(f"capacity must be positive, got {capacity_bytes}")
    pol = _make_policy(policy, stream, capacity_bytes, hp_config)
    queue_aware = pol if isinstance(pol, QueueAwarePolicy) and lookahead > 0 else None
    users = stream.user.tolist()
    store = stream.store_bytes.tolist()
    load = stream.load_bytes.tolist()
    answers = stream.answer.tolist()
    rounds = stream.round_index.tolist()
    last = stream.is_last.tolist()
    counted = stream.counted.tolist()
    n = len(users)
    resident: dict[int, int] = {}  # user -> bytes held
    used = 0
    hits = misses = evictions = 0
    hit_bytes = miss_bytes = 0
    if queue_aware is not None:  # the window after access i holds accesses i+1 .. i+lookahead
        for j in range(1, min(lookahead, n - 1) + 1):
            queue_aware.protect(session=users[j])
    for i in range(n):
        u = users[i]
        held = resident.get(u)
        if counted[i]:
            if held is not None:
                hits += 1
                hit_bytes += load[i]
            else:
                misses += 1
                miss_bytes += load[i]
        size = store[i]
        meta = AccessMeta(session=u, prev_answer_tokens=answers[i], round_index=rounds[i])
        pol.on_insert(u, size, now=float(i), meta=meta)  # a hit re-inserts (the KV grew); see the protocol
        used += size - (held or 0)
        resident[u] = size
        if drop_finished and last[i]:
            pol.on_remove(u)
            used -= resident.pop(u)
        while used > capacity_bytes:
            v = pol.victim(now=float(i))
            if v is None:  # pragma: no cover - guarded by the policy invariant
                raise AssertionError(f"{policy}: no victim with {used} bytes resident")
            pol.on_remove(v)
            used -= resident.pop(cast(int, v))  # the policy holds only the user ids this replay inserts
            evictions += 1
        if queue_aware is not None:  # slide the window: i+1 .. i+lookahead  ->  i+2 .. i+1+lookahead
            if i + 1 < n:
                queue_aware.release(session=users[i + 1])
            if i + 1 + lookahead < n:
                queue_aware.protect(session=users[i + 1 + lookahead])
        if progress is not None and (i & 4095) == 4095:
            progress(i + 1)
    if progress is not None:
        progress(n)
    extra: dict[str, float] = {}
    if policy == "hit-potential":
        rates = pol.ghost_hit_rates()  # type: ignore[attr-defined]
        extra = {f"ghost_hit_bucket_{i}": float(r) for i, r in enumerate(rates)}
    return ReplayResult(policy=policy, capacity_bytes=capacity_bytes, hits=hits, misses=misses, evictions=evictions,
                        extra=extra, hit_bytes=hit_bytes, miss_bytes=miss_bytes)


def replay_many(
    stream: AccessStream,
    policies: Sequence[str],
    capacities: Sequence[int],
    *,
    lookahead: int = 30,
    drop_finished: bool = True,
    progress: Callable[[int], None] | None = None,
) -> list[ReplayResult]:
    """:func:`replay` for every (capacity, policy) pair, capacities outer; ``progress`` gets accesses done in all."""
    out: list[ReplayResult] = []
    done = 0
    for cap in capacities:
        for name in policies:
            base = done

            def step(k: int, base: int = base) -> None:
                if progress is not None:
                    progress(base + k)

            out.append(replay(stream, name, cap, lookahead=lookahead, drop_finished=drop_finished, progress=step))
            done += len(stream)
    return out
