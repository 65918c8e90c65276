"""The host-memory tier: a bounded pool of aligned buffers holding chunk file images (header + payload).

An entry is *dirty* while copies of it are still to be written to disk tiers (it can't be evicted: it may be
the only copy) and *clean* afterwards; only clean entries are known to the eviction policy. The same buffer
serves the memory hit, the O_DIRECT write and the read that filled it: nothing is copied between them.

Invariants:
- bytes held (pool.allocated_bytes) never exceed ``capacity_bytes``; reads that need more than that get
  unpooled buffers which are never cached (counted in ``overflow_buffers``). Those come from a second pool,
  :attr:`HostMemoryTier.overflow_pool` (at most ``overflow_bytes``, kept mapped between uses), when it has room,
  else are mapped afresh. Why a pool: a load larger than host memory's free room (chunks pinned by callers,
  unwritten chunks) mapped a fresh buffer per chunk and the kernel zeroed and faulted every page of it on the
  read path; on the project VM such loads ran the local disk at 0.8-1.0 GB/s against ~2 GB/s
  (BENCHMARKS §3.2). The overflow pool follows the same rule as the main one: a buffer goes back to it when
  its reader is done with it and is handed out again only once no view of it is alive.
- a cached entry's buffer returns to the pool only when the entry is evicted (a read's buffer when the read is
  released; an overflow buffer when its reader is done), and any buffer is reused only once no memoryview a
  caller got from it is alive (see kvstream.io.buffers) — so a caller never sees its bytes change.
- a view handed to a reader is made *under this tier's lock*, while the entry is still cached (:meth:`pin`,
  :meth:`insert_pinned`): the view is the pin. An entry found earlier and viewed later could have been evicted
  and its buffer reused in between (another thread's put, or the step's own reads taking buffers), and the
  view would show another chunk's bytes. Eviction may still drop a pinned entry from the cache; its buffer is
  parked, not reused, until the last view is gone.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kvstream.eviction import AccessMeta, EvictionPolicy, eviction_options, make_eviction_policy
from kvstream.format import HEADER_BYTES, ChunkHeader
from kvstream.io.buffers import ALIGN, AlignedBuffer, BufferPool

__all__ = ["HostMemoryTier", "MemEntry"]


@dataclass(eq=False)
class MemEntry:
    key: bytes
    buf: AlignedBuffer  # the chunk's file image: header at 0, payload at HEADER_BYTES
    header: ChunkHeader
    dirty: int = 0  # disk writes of this entry not finished yet
    position: int | None = None  # chunk index within its prefix, if known (for replication placement)
    removed: bool = False  # Store.remove() ran while writes were in flight: they must not stay published
    access: AccessMeta | None = None  # what the writer knew of the access (session...), for the eviction policy

    def payload(self) -> memoryview:
        """Read-only view of the payload (callers must not be able to change a cached chunk)."""
        return self.buf.readonly(HEADER_BYTES, HEADER_BYTES + self.header.payload_len)

    @property
    def file_size(self) -> int:
        return self.header.file_size


class HostMemoryTier:
    def __init__(self, capacity_bytes: int, eviction: str = "lru", *, overflow_bytes: int = 0) -> None:
        self.capacity_bytes = capacity_bytes
        self.pool = BufferPool(capacity_bytes)
        # Spare buffers for reads host memory has no room for (module docstring); None: map each afresh.
        self.overflow_pool = BufferPool(overflow_bytes) if overflow_bytes >= ALIGN else None
        self._overflow_owned: weakref.WeakSet[AlignedBuffer] = weakref.WeakSet()  # handed out by overflow_pool
        self._eviction = eviction
        self.policy: EvictionPolicy = make_eviction_policy(eviction, **eviction_options(eviction, capacity_bytes))
        self._entries: dict[bytes, MemEntry] = {}
        self._lock = threading.RLock()
        self.hits = 0
        self.evictions = 0
        self.overflow_buffers = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: bytes, *, meta: AccessMeta | None = None) -> MemEntry | None:
        with self._lock:
            e = self._entries.get(key)
            if e is not None:
                self.hits += 1
                if e.dirty == 0:
                    self.policy.on_access(key, meta=meta)
            return e

    def pin(self, key: bytes, *, meta: AccessMeta | None = None) -> tuple[MemEntry, memoryview] | None:
        """A hit: the entry and a read-only view of its payload, made atomically (the view pins the buffer)."""
        with self._lock:
            e = self.get(key, meta=meta)
            if e is None:
                return None
            return e, e.payload()

    def insert_pinned(self, entry: MemEntry, *, meta: AccessMeta | None = None) -> tuple[MemEntry, memoryview]:
        """:meth:`insert` (clean), and a view of the cached entry's payload made under the same lock."""
        with self._lock:
            e = self.insert(entry, dirty=False, meta=meta)
            return e, e.payload()

    @property
    def queue_aware(self) -> bool:
        """True if the eviction policy protects a look-ahead window of sessions (:meth:`set_window`)."""
        return hasattr(self.policy, "set_window")

    def set_window(self, sessions: Iterable[Hashable]) -> None:
        """Hand a queue-aware policy the sessions the waiting queue's look-ahead window will need."""
        with self._lock:
            set_window = getattr(self.policy, "set_window", None)
            if set_window is not None:
                set_window(sessions)

    def evict_clean(self) -> int:
        """Drop every clean entry (their buffers go back to the pool, or are parked while viewed)."""
        n = 0
        with self._lock:
            while self._evict_one():
                n += 1
        return n

    def allocate(self, nbytes: int) -> AlignedBuffer | None:
        """A pooled buffer of at least ``nbytes``, evicting clean entries if needed; None if all memory is dirty."""
        with self._lock:
            while True:
                buf = self.pool.acquire(nbytes)
                if buf is not None:
                    return buf
                if not self._evict_one():
                    return None

    def allocate_or_overflow(self, nbytes: int) -> tuple[AlignedBuffer, bool]:
        """A buffer for a read: pooled if possible, else an unpooled one (a spare from the overflow pool if it has
        one or room for one, else mapped afresh). Returns (buffer, pooled). Whoever ends up with an unpooled
        buffer hands it to :meth:`release` with ``pooled=False`` when it is done (a view may still be alive: the
        buffer is reused only after the view is gone)."""
        buf = self.allocate(nbytes)
        if buf is not None:
            return buf, True
        # Outside this tier's lock: mapping a new spare must not hold up hits and puts (the pool has its own).
        spare = self.overflow_pool.acquire(nbytes) if self.overflow_pool is not None else None
        with self._lock:
            self.overflow_buffers += 1
            if spare is not None:
                self._overflow_owned.add(spare)
                return spare, False
        return AlignedBuffer(BufferPool.size_class(nbytes)), False

    def prefault(self, nbytes: int) -> int:
        """Map and touch the whole tier (and the overflow pool) in buffers of ``nbytes``' size class, so the
        first loads do not pay for fresh pages (:meth:`BufferPool.prefault`). Returns the bytes made resident."""
        done = self.pool.prefault(nbytes)
        if self.overflow_pool is not None:
            done += self.overflow_pool.prefault(nbytes)
        return done

    def close(self) -> None:
        """Forget every entry and pooled buffer (the store is closing): host memory goes back to the OS now, not
        whenever the garbage collector next finds the store (a replay opening one store per system held each
        closed one's prefaulted 4 GiB until then). A buffer a caller still views, or an unfinished write still
        uses, lives on through that reference."""
        with self._lock:
            self._entries.clear()
            self.policy = make_eviction_policy(self._eviction,
                                               **eviction_options(self._eviction, self.capacity_bytes))
            self.pool.clear()
            if self.overflow_pool is not None:
                self.overflow_pool.clear()

    def release(self, buf: AlignedBuffer, pooled: bool = True) -> None:
        """Give back a buffer from :meth:`allocate` / :meth:`allocate_or_overflow`. An unpooled one goes back to
        the overflow pool if it came from there (parked while a view of it lives), else it is simply dropped."""
        if pooled:
            self.pool.release(buf)
            return
        with self._lock:
            spare = buf in self._overflow_owned
            if spare:
                self._overflow_owned.discard(buf)
        if spare:
            assert self.overflow_pool is not None
            self.overflow_pool.release(buf)

    def insert(self, entry: MemEntry, *, dirty: bool, meta: AccessMeta | None = None) -> MemEntry:
        """Cache ``entry`` (its buffer must be pooled). If the key is already cached the new buffer is released
        and the existing entry returned."""
        with self._lock:
            old = self._entries.get(entry.key)
            if old is not None:
                self.pool.release(entry.buf)
                return old
            if meta is not None and entry.access is None:
                entry.access = meta  # what the policy was told, kept with the entry (as a put's is)
            self._entries[entry.key] = entry
            if dirty:
                entry.dirty += 1
            else:
                self.policy.on_insert(entry.key, entry.buf.capacity, meta=meta)
            return entry

    def mark_dirty(self, entry: MemEntry) -> None:
        with self._lock:
            if entry.dirty == 0 and self._entries.get(entry.key) is entry:
                self.policy.on_remove(entry.key)
            entry.dirty += 1

    def mark_clean(self, entry: MemEntry) -> None:
        """One pending write of ``entry`` finished; at zero it becomes evictable."""
        with self._lock:
            entry.dirty -= 1
            if entry.dirty == 0:
                if self._entries.get(entry.key) is entry:
                    self.policy.on_insert(entry.key, entry.buf.capacity, meta=entry.access)
                else:  # dropped from the cache while being written
                    self.pool.release(entry.buf)

    def peek(self, key: bytes) -> MemEntry | None:
        """The cached entry without counting a hit or touching the eviction order."""
        with self._lock:
            return self._entries.get(key)

    def discard(self, key: bytes) -> None:
        with self._lock:
            e = self._entries.pop(key, None)
            if e is None:
                return
            if e.dirty == 0:
                self.policy.on_remove(key)
                self.pool.release(e.buf)

    def _evict_one(self) -> bool:
        key = self.policy.victim()
        if key is None:
            return False
        self.policy.on_remove(key)
        assert isinstance(key, bytes)  # the policy only knows keys this tier gave it
        e = self._entries.pop(key)
        self.pool.release(e.buf)
        self.evictions += 1
        return True

    def used_bytes(self) -> int:
        return self.pool.allocated_bytes

    def dirty_count(self) -> int:
        with self._lock:
            return sum(1 for e in self._entries.values() if e.dirty)
