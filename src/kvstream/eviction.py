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
- Pinned entries (pending writes, reads in flight) are simply not inserted until the tier unpins them, so
  policies have no notion of pins.
- ``now`` is passed in (seconds, any monotonic origin); a policy never reads a clock.

``meta`` is an optional :class:`AccessMeta` with what smarter policies use (session, previous answer length).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["AccessMeta", "EvictionPolicy", "LRUPolicy", "make_eviction_policy"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AccessMeta:
    """What the serving side knows about an access; every field optional."""

    session: Hashable | None = None  # conversation / user id the entry belongs to
    prev_answer_tokens: int | None = None  # length of that conversation's previous answer (Bidaw's predictor)
    position: int | None = None  # chunk index within its prefix


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


_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy}


def make_eviction_policy(name: str) -> EvictionPolicy:
    """Build a policy by its config name (``lru``, ...). Raises ``KeyError`` naming the known ones."""
    try:
        return _POLICIES[name]()
    except KeyError:
        raise KeyError(f"unknown eviction policy {name!r}; known: {', '.join(sorted(_POLICIES))}") from None
