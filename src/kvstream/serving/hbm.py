"""GPU HBM as a prefix cache (vLLM's automatic prefix caching, at 256-token chunk granularity).

Accounting, in tokens of KV:

    used = sum(reservation of each running request) + CHUNK_TOKENS * (resident chunks)

A running request reserves, when admitted, everything it will add: ``input + output - hit_chunks * 256``
tokens (its new prompt KV and its answer). Its hit chunks are resident already and it pins them. When it
finishes, its reservation is returned and its full prompt chunks become resident (unpinned, evictable), so a
later request with the same prefix hits them in HBM. Generated tokens are not cached (a chunk is only ever
cached once it was part of a prompt, as in the traces).

Invariants:
- ``used <= capacity`` after every successful :meth:`admit`; a failed admit changes nothing.
- a pinned chunk (refcount > 0) is never evicted; unpinned resident chunks leave in LRU order, a prompt's later
  chunks before its earlier ones (so a prefix is never cut in the middle while its tail stays).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvstream.workload.request import CHUNK_TOKENS

__all__ = ["HbmCache"]


class HbmCache:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"HBM KV capacity must be positive, got {capacity_tokens} tokens")
        self.capacity = int(capacity_tokens)
        self._ref: dict[Hashable, int] = {}  # resident chunk -> number of running requests pinning it
        self._lru: OrderedDict[Hashable, None] = OrderedDict()  # unpinned resident chunks; first = next victim
        self._reserved: dict[int, int] = {}  # request id -> tokens reserved
        self._pins: dict[int, tuple[Hashable, ...]] = {}  # request id -> chunks it pins
        self._reserved_total = 0
        self.evictions = 0

    @property
    def used(self) -> int:
        return self._reserved_total + CHUNK_TOKENS * len(self._ref)

    @property
    def free(self) -> int:
        return self.capacity - self.used

    def __contains__(self, chunk: object) -> bool:
        return chunk in self._ref

    def match(self, chunk_ids: Sequence[Hashable]) -> int:
        """Leading chunks of ``chunk_ids`` resident in HBM."""
        ref = self._ref
        n = 0
        for c in chunk_ids:
            if c not in ref:
                break
            n += 1
        return n

    def can_ever_fit(self, tokens: int) -> bool:
        return tokens <= self.capacity

    def admit(self, rid: int, chunk_ids: Sequence[Hashable], hit: int, tokens: int) -> bool:
        """Pin ``chunk_ids[:hit]`` and reserve ``tokens - hit * 256`` tokens, evicting unpinned chunks as needed.

        Returns False (and changes nothing) if even evicting every unpinned chunk would not make room.
        """
        if rid in self._reserved:
            raise ValueError(f"request {rid} is already admitted to HBM")
        need = max(tokens - hit * CHUNK_TOKENS, 0)
        pinned = chunk_ids[:hit]
        # Chunks we are about to pin cannot be evicted to make room for ourselves.
        evictable = len(self._lru) - sum(1 for c in pinned if c in self._lru)
        if need > self.free + evictable * CHUNK_TOKENS:
            return False
        for c in reversed(pinned):
            r = self._ref[c]
            if r == 0:
                del self._lru[c]
            self._ref[c] = r + 1
        while self.free < need:
            victim, _ = self._lru.popitem(last=False)
            del self._ref[victim]
            self.evictions += 1
        self._reserved[rid] = need
        self._reserved_total += need
        self._pins[rid] = tuple(pinned)
        return True

    def publish(self, rid: int, chunk_ids: Sequence[Hashable]) -> None:
        """Request ``rid``'s prefill is done: its prompt chunks become resident (pinned by it), so later requests
        hit them while it still decodes. Their tokens come out of its reservation; a chunk the reservation no
        longer covers (a request clamped to the whole capacity) takes free space or an unpinned chunk's place,
        and publishing stops when there is neither (``used <= capacity`` always holds)."""
        ref = self._ref
        pins = list(self._pins[rid])
        pinned = set(pins)
        for c in chunk_ids:
            if c in pinned:
                continue
            r = ref.get(c)
            if r is None:
                if self._reserved[rid] >= CHUNK_TOKENS:
                    self._reserved[rid] -= CHUNK_TOKENS
                    self._reserved_total -= CHUNK_TOKENS
                elif self.free < CHUNK_TOKENS and not self._evict_one():
                    break
                ref[c] = 1
            else:
                if r == 0:
                    del self._lru[c]
                ref[c] = r + 1
            pins.append(c)
            pinned.add(c)
        self._pins[rid] = tuple(pins)

    def finish(self, rid: int, chunk_ids: Sequence[Hashable]) -> None:
        """Request ``rid`` is done: return its reservation, unpin its hits, keep its prompt chunks cached."""
        need = self._reserved.pop(rid)
        self._reserved_total -= need
        for c in self._pins.pop(rid):
            r = self._ref[c] - 1
            self._ref[c] = r
            if r == 0:
                self._lru[c] = None
        # Newly computed chunks become resident while there is room; tail first so the LRU evicts tails first.
        ref, lru = self._ref, self._lru
        for c in chunk_ids:
            if c not in ref:
                if self.free < CHUNK_TOKENS and not self._evict_one():
                    break
                ref[c] = 0
        for c in reversed(chunk_ids):
            if ref.get(c) == 0:
                lru[c] = None
                lru.move_to_end(c)

    def _evict_one(self) -> bool:
        if not self._lru:
            return False
        victim, _ = self._lru.popitem(last=False)
        del self._ref[victim]
        self.evictions += 1
        return True

    def running(self) -> int:
        return len(self._reserved)
