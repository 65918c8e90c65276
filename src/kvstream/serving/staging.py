"""Staged KV's pins: the one ledger of the host-memory pins a serving backend holds for the core's loads.

A load pins, for each of its items, the chunks of the item's staged span (:func:`kvstream.serving.core.staged_span`):
one pin per (item, chunk), so a chunk two waiting requests share is pinned twice. The core takes them off one at a
time (:class:`~kvstream.serving.core.ReleaseChunks`) once the GPU has the KV. Both backends keep these counts here:
the simulator's modelled store (:class:`kvstream.sim.storage.SimStorage`, whose host memory then holds the chunk
pinned, out of its eviction policy) and replay's real one (:class:`kvstream.serving.storebackend.StoreBackend`,
which then keeps the store's payload view, the real pin of the buffer). What the ledger tells them is the two
moments that matter to host memory: a chunk's first pin and its last release.

Invariant: every count held is above zero; releasing a chunk that holds no pin raises (a core releasing what no
load pinned is a bug, never silently absorbed). Not thread-safe: a backend with threads holds its own lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["StagedPins"]

K = TypeVar("K", bound=Hashable)


class StagedPins(Generic[K]):
    """Pin counts of staged chunks (see the module docstring)."""

    __slots__ = ("_counts",)

    def __init__(self) -> None:
        self._counts: dict[K, int] = {}

    def hold(self, key: K) -> bool:
        """One more pin on ``key``; True if it is the first (the backend now pins the chunk in host memory)."""
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        return n == 0

    def release(self, key: K) -> bool:
        """One pin fewer on ``key``; True if it was the last (the backend lets the chunk go). Raises if ``key``
        holds no pin."""
        n = self._counts.get(key)
        if n is None:
            raise AssertionError(f"release of staged chunk {key!r} that holds no pin")
        if n == 1:
            del self._counts[key]
            return True
        self._counts[key] = n - 1
        return False

    def count(self, key: K) -> int:
        return self._counts.get(key, 0)

    def __contains__(self, key: object) -> bool:
        return key in self._counts

    def __len__(self) -> int:
        return len(self._counts)

    def __iter__(self) -> Iterator[K]:
        return iter(self._counts)

    def clear(self) -> list[K]:
        """Drop every pin (the backend closes); the chunks that held any."""
        keys = list(self._counts)
        self._counts.clear()
        return keys
