"""Which keys were removed while a read was in flight, so a read that began before a remove cannot cache its
chunk after it (the chunk would reappear in host memory, and the catch-up of owed replicas would copy it back
to a tier the remove had just emptied).

A read linearises before a concurrent remove: its caller may still get the bytes. It only must not *cache*
them. Each remove takes the next sequence number; a read notes the number current when it starts and asks,
when its chunk lands, whether that key was removed since. The record is bounded: the oldest removals are
forgotten, and a read that started before the oldest remembered one is answered "maybe removed" (it then skips
the cache; the cost is one cache insert, never a wrong answer).

Not thread-safe by itself: the store calls it under its ``_lock`` (the lock that orders host-memory inserts
and removes).
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["Removals"]


class Removals:
    """Sequence-numbered record of recent removes. Invariant: ``removed_since(key, s)`` is True whenever ``key``
    was removed after :meth:`now` returned ``s`` (it may also be True when it was not, once records were
    forgotten)."""

    def __init__(self, remember: int = 4096) -> None:
        self._remember = remember
        self._seq = 0
        self._floor = 0  # sequence number of the newest forgotten record
        self._last: OrderedDict[bytes, int] = OrderedDict()  # key -> sequence number of its last remove

    def now(self) -> int:
        """The current sequence number; a read notes it when it starts."""
        return self._seq

    def record(self, key: bytes) -> None:
        self._seq += 1
        self._last[key] = self._seq
        self._last.move_to_end(key)
        while len(self._last) > self._remember:
            _, self._floor = self._last.popitem(last=False)

    def removed_since(self, key: bytes, seq: int) -> bool:
        return seq < self._floor or self._last.get(key, 0) > seq
