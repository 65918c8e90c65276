"""Pins: chunks a caller needs kept, counted per key, as LMCache counts them.

LMCache 0.5.6's contract (``StoragePluginInterface.pin``/``unpin``; its ``LocalDiskBackend`` and
``DiskCacheMetadata``): a lookup with ``pin=True`` (vLLM's) or ``pin(key)`` adds one to the key's pin count,
``unpin(key)`` takes one away; a chunk whose count is above zero is never chosen for eviction, and a put that
could only make room by evicting pinned chunks is refused (LMCache logs "Insufficient evictable disk cache
space" and stores nothing; a later put may try again). A forced ``remove`` removes a pinned chunk anyway, and
its pins with it. So: pin twice, unpin once: still pinned.

One :class:`Pins` per store, shared by its directory tiers: each tier keeps a pinned chunk out of its eviction
policy while the count is above zero (:meth:`kvstream.tiers.files.DirectoryTier.hold`), so no victim is ever a
pinned chunk, whatever the policy. Pins are this process's: they are not written anywhere (a restart forgets
them, as LMCache's do) and other nodes of a shared tier never evict this node's chunks anyway.
"""

from __future__ import annotations

import threading

__all__ = ["Pins"]


class Pins:
    """Pin counts by key. Thread-safe. Invariant: every count held is above zero."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[bytes, int] = {}

    def add(self, key: bytes) -> int:
        """One more pin on ``key``; returns its count now."""
        with self._lock:
            n = self._counts.get(key, 0) + 1
            self._counts[key] = n
            return n

    def remove(self, key: bytes) -> int | None:
        """One pin fewer on ``key``: its count now (0: unpinned), or None if it was not pinned."""
        with self._lock:
            n = self._counts.get(key)
            if n is None:
                return None
            if n == 1:
                del self._counts[key]
                return 0
            self._counts[key] = n - 1
            return n - 1

    def clear(self, key: bytes) -> bool:
        """Drop every pin on ``key`` (a forced remove); True if it had any."""
        with self._lock:
            return self._counts.pop(key, None) is not None

    def pinned(self, key: bytes) -> bool:
        return key in self._counts  # a dict lookup: atomic under the GIL, no lock needed

    def count(self, key: bytes) -> int:
        return self._counts.get(key, 0)

    def __len__(self) -> int:
        return len(self._counts)
