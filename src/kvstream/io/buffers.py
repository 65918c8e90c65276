"""Aligned host buffers for O_DIRECT, pooled and reused.

Each :class:`AlignedBuffer` is its own anonymous ``mmap`` (page aligned, so valid for O_DIRECT on any block
size up to 4 KiB). It is its own buffer exporter on purpose: the pool can tell whether anyone still holds a
``memoryview`` of it from its reference count, and so it never hands out a buffer a caller can still see.

Invariant: a buffer is in at most one place at a time: the pool's free list, an in-flight I/O operation, or an
owner (a memory-tier entry, a pending write); and it is reused only when no memoryview of it is alive.

Huge pages: a buffer of at least one huge page (2 MiB) starts on a 2 MiB boundary and is
``madvise(MADV_HUGEPAGE)``-d before it is first touched, so the kernel can back it with transparent huge pages.
Why: an O_DIRECT request holds at most ``max_segments`` physically contiguous runs; with 4 KiB pages a 4 MiB
buffer is as fragmented as free memory happens to be, and the block layer cuts each op into small requests
(docs/bench/io.md: fio 1.1-2.0 GB/s with 4 KiB pages, 3.1-3.8 GB/s with huge pages on the project VM). Only the
2 MiB blocks wholly inside ``capacity`` can be huge (the mapping is trimmed to ``capacity``), so resident memory
never exceeds what the pool accounts for. It is a hint: where THP is absent or ``never`` nothing changes.
``KVSTREAM_HUGEPAGES=0`` in the environment (read at import; :data:`HUGEPAGES`) or ``hugepages=False`` on a
buffer or pool turns it off, to compare.

Slabs: a pool's buffers of a size class in ``[SLAB_MIN, HUGE_PAGE)`` (e.g. a 1 MiB chunk plus its 4 KiB header)
cannot hold a huge page on their own, so with huge pages on the pool carves them from a *slab*: one 2 MiB-aligned,
madvised mapping of a multiple of 2 MiB holding several slots of that class (:class:`_Slab`). Each slot is an
:class:`AlignedBuffer` whose exporter is its own ctypes array over the slot (``from_buffer``, which also keeps the
slab's mapping alive), so export-awareness stays per buffer. A slab counts fully against the pool's capacity from
the moment it is mapped, and is dropped (its memory returned once the last reference goes) only when every slot
is in the free list and unexported.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
from collections import defaultdict

__all__ = ["ALIGN", "HUGE_PAGE", "HUGEPAGES", "SLAB_MIN", "AlignedBuffer", "BufferPool", "CallerBuffer", "round_up"]

ALIGN = 4096  # O_DIRECT alignment used everywhere: file offsets, lengths and buffer addresses


def _huge_page_size() -> int:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size") as f:
            n = int(f.read())
        if n >= ALIGN and n & (n - 1) == 0:
            return n
    except (OSError, ValueError):
        pass
    return 2 << 20  # x86-64 / aarch64 with 4 KiB base pages


HUGE_PAGE = _huge_page_size()
# Default for buffers created without an explicit ``hugepages=``; tests and benchmarks may rebind it.
HUGEPAGES = os.environ.get("KVSTREAM_HUGEPAGES", "1").strip().lower() not in ("0", "false", "no", "off")
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
SLAB_MIN = 64 << 10  # smallest size class a pool carves from huge-page slabs
_SLAB_MAX_PAGES = 8  # a slab is 1..8 huge pages


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def _anon(size: int) -> mmap.mmap:
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _addr(mm: mmap.mmap) -> int:
    # The temporary ctypes object (and its export of ``mm``) is gone when this returns.
    return ctypes.addressof(ctypes.c_char.from_buffer(mm))


def _map_huge(capacity: int) -> tuple[mmap.mmap, int, bool]:
    """An anonymous mapping holding ``capacity`` bytes from a ``HUGE_PAGE``-aligned offset, and the hint applied.

    Linux (6.7+) places anonymous mappings whose length is a multiple of the huge page size on a huge page
    boundary, so mapping ``capacity`` rounded up usually suffices; otherwise over-map by one huge page and start
    at the first boundary inside. The tail beyond ``capacity`` is then trimmed (``mremap`` in place, via
    ``mmap.resize``): the mapping ends where the buffer ends, so no huge page reaches past ``capacity``.
    """
    span = round_up(capacity, HUGE_PAGE)
    mm = _anon(span)
    off = -_addr(mm) % HUGE_PAGE
    if off:
        mm.close()
        mm = _anon(span + HUGE_PAGE)
        off = -_addr(mm) % HUGE_PAGE
    if len(mm) > off + capacity:
        try:
            mm.resize(off + capacity)
        except (OSError, ValueError, TypeError, SystemError):
            pass  # keeps an untouched (virtual only) tail; views are still cut to capacity
    advised = False
    if _MADV_HUGEPAGE is not None:
        try:
            mm.madvise(_MADV_HUGEPAGE, off, capacity)
            advised = True
        except (OSError, ValueError, AttributeError):
            pass  # a hint: EINVAL without THP support
    return mm, off, advised


class AlignedBuffer:
    """A page-aligned, fixed-capacity byte buffer. ``address`` is stable for its lifetime.

    ``hugepages`` (default :data:`HUGEPAGES`): for a capacity of at least ``HUGE_PAGE``, start on a huge page
    boundary and ask for transparent huge pages. ``self.hugepages`` says whether the hint was given.
    """

    __slots__ = ("_mm", "_off", "_whole", "capacity", "address", "hugepages", "_anchor", "_exp", "_slab",
                 "__weakref__")
    _mm: mmap.mmap  # the mapping (a slot's: its slab's, shared)
    _off: int  # where the buffer starts in it
    _whole: bool  # the buffer is the whole mapping
    capacity: int
    address: int
    hugepages: bool
    _anchor: ctypes.c_char | None  # an own buffer's export of its mapping (None for a slot)
    _exp: ctypes.Array[ctypes.c_ubyte] | None  # a slot's exporter: a ctypes array over just the slot
    _slab: _Slab | None  # the slab a slot belongs to

    def __init__(self, capacity: int, hugepages: bool | None = None) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"AlignedBuffer capacity must be a positive multiple of {ALIGN}, got {capacity}")
        if hugepages is None:
            hugepages = HUGEPAGES
        if hugepages and capacity >= HUGE_PAGE:
            self._mm, self._off, self.hugepages = _map_huge(capacity)
        else:
            self._mm, self._off, self.hugepages = _anon(capacity), 0, False
        self._whole = self._off == 0 and len(self._mm) == capacity  # the fast path in view()
        self.capacity = capacity
        # ctypes view used only to learn the address; it is an export of the mmap, counted in the baseline.
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor) + self._off
        self._exp = None
        self._slab = None

    @classmethod
    def _slot(cls, slab: _Slab, off: int) -> AlignedBuffer:
        """A buffer of ``slab.slot_bytes`` at byte ``off`` of the slab's mapping (a slot; not its own mmap).

        Its exporter is a ctypes array over just this slot: every memoryview of the buffer holds a reference to
        that array (not to the shared mmap), so :meth:`exported` sees this slot's views only. The array also
        holds an export of the slab's mmap, so the mapping outlives every slot and every view of one.
        """
        self = cls.__new__(cls)
        self._mm, self._off, self._whole = slab.mm, off, False
        self.capacity = slab.slot_bytes
        self.hugepages = slab.hugepages
        self._anchor = None
        exp = (ctypes.c_ubyte * slab.slot_bytes).from_buffer(slab.mm, off)
        self._exp = exp
        self._slab = slab
        self.address = ctypes.addressof(exp)
        return self

    def _mv(self) -> memoryview:
        if self._exp is not None:
            return memoryview(self._exp).cast("B")  # the array's format is "<B"; callers expect plain bytes
        if self._whole:
            return memoryview(self._mm)
        return memoryview(self._mm)[self._off:self._off + self.capacity]

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A writable view of ``[start, stop)``. Views keep the buffer out of the free list while alive."""
        return self._mv()[start:stop]

    def readonly(self, start: int = 0, stop: int | None = None) -> memoryview:
        return self._mv()[start:stop].toreadonly()

    def exported(self) -> bool:
        """True while any memoryview (or other export) of this buffer is alive (CPython reference count)."""
        if self._exp is not None:
            # A slot: baseline references are self._exp and getrefcount's argument; each view's managed buffer
            # holds one more.
            return sys.getrefcount(self._exp) > 2
        # Baseline references: self._mm attribute, the ctypes anchor's base reference, getrefcount's argument.
        return sys.getrefcount(self._mm) > 3

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        slab = ", slab" if self._slab is not None else ""
        return f"AlignedBuffer({self.capacity} B @ {self.address:#x}{', huge pages' if self.hugepages else ''}{slab})"


class CallerBuffer:
    """A caller's writable buffer presented to the rings like an :class:`AlignedBuffer` (``address``,
    ``capacity``, ``view``), so a read can land in memory the store does not own (``Store.read_into``).

    It holds an export of the caller's buffer for its lifetime (the memory cannot be resized or freed through
    Python while a read may still write into it); :meth:`release` drops it. ``direct_ok`` says whether the
    buffer is aligned for O_DIRECT (4 KiB address); the store reads an unaligned one through a bounce buffer.
    """

    __slots__ = ("_mv", "_anchor", "address", "capacity")
    _mv: memoryview  # the caller's buffer, flat bytes
    _anchor: ctypes.c_char | None  # an export that pins the caller's memory (None once released, or empty)
    address: int
    capacity: int

    def __init__(self, target: object) -> None:
        mv = memoryview(target)  # type: ignore[arg-type]
        if mv.readonly:
            raise ValueError("read target must be writable")
        if not mv.c_contiguous:
            raise ValueError("read target must be C-contiguous")
        mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        self._mv = mv
        self.capacity = len(mv)
        if self.capacity:
            self._anchor = ctypes.c_char.from_buffer(mv)
            self.address = ctypes.addressof(self._anchor)
        else:
            self._anchor, self.address = None, 0

    @property
    def direct_ok(self) -> bool:
        return self.capacity > 0 and self.address % ALIGN == 0

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        return self._mv[start:stop]

    def readonly(self, start: int = 0, stop: int | None = None) -> memoryview:
        return self._mv[start:stop].toreadonly()

    def release(self) -> None:
        self._anchor = None
        self._mv.release()

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return f"CallerBuffer({self.capacity} B @ {self.address:#x})"


def _slab_bytes(slot_bytes: int, limit: int | None = None) -> int:
    """The slab size (a multiple of ``HUGE_PAGE``, at most ``_SLAB_MAX_PAGES`` of them and at most ``limit``)
    that wastes the smallest fraction on a tail too short for a slot; the smallest such. 0 if none fits a slot."""
    best, best_waste = 0, 1.0
    for pages in range(1, _SLAB_MAX_PAGES + 1):
        size = pages * HUGE_PAGE
        if limit is not None and size > limit:
            break
        if size < slot_bytes:
            continue
        waste = (size % slot_bytes) / size
        if waste < best_waste:
            best, best_waste = size, waste
    return best


class _Slab:
    """One huge-page-aligned mapping of ``size`` bytes cut into ``nslots`` slots of ``slot_bytes``."""

    __slots__ = ("mm", "base", "size", "slot_bytes", "nslots", "hugepages", "nfree")

    def __init__(self, size: int, slot_bytes: int) -> None:
        self.mm, self.base, self.hugepages = _map_huge(size)
        self.size = size
        self.slot_bytes = slot_bytes
        self.nslots = size // slot_bytes
        self.nfree = 0  # slots of this slab in the pool's free or fresh lists (not in use, not parked)

    def slots(self) -> list[AlignedBuffer]:
        return [AlignedBuffer._slot(self, self.base + i * self.slot_bytes) for i in range(self.nslots)]

    def __repr__(self) -> str:
        return f"_Slab({self.size} B, {self.nslots} x {self.slot_bytes} B, {self.nfree} free)"


class BufferPool:
    """A bounded pool of aligned buffers in size classes (multiples of 4 KiB, rounded up to a power-of-two
    eighth so similar chunk sizes share a class).

    ``acquire(n)`` returns a buffer of at least ``n`` bytes or ``None`` when the pool would exceed
    ``capacity_bytes`` (a shortage is a return value, not an exception). ``release(buf)`` returns it for reuse;
    a released buffer that is still exported is parked and reused once its views are gone.
    ``hugepages`` is passed to every :class:`AlignedBuffer` it creates (``None``: :data:`HUGEPAGES`, read at
    each allocation). With huge pages on, classes in ``[SLAB_MIN, HUGE_PAGE)`` come from huge-page slabs (see
    the module docstring); ``allocated_bytes`` counts whole slabs, and never exceeds ``capacity_bytes``.
    Thread-safe.
    """

    def __init__(self, capacity_bytes: int, hugepages: bool | None = None) -> None:
        if capacity_bytes < ALIGN:
            raise ValueError(f"BufferPool capacity must be at least {ALIGN} bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.hugepages = hugepages
        self._lock = threading.Lock()
        self._free: dict[int, list[AlignedBuffer]] = defaultdict(list)
        self._parked: list[AlignedBuffer] = []  # released but still viewed by someone
        self._fresh: dict[int, list[AlignedBuffer]] = defaultdict(list)  # slab slots never handed out yet
        self._slabs: list[_Slab] = []  # every slab mapped and not dropped
        self._allocated_bytes = 0  # every buffer (or whole slab) the pool created and has not dropped
        self._in_use_bytes = 0
        self._closed = False  # after clear(): nothing handed out, nothing taken back
        self.allocations = 0  # buffers created (a flat count in a long run shows reuse works)
        self.reuses = 0
        self.slab_allocations = 0

    @staticmethod
    def size_class(n: int) -> int:
        n = round_up(max(n, 1))
        if n <= 64 * ALIGN:
            return n
        # Above 256 KiB: round up to 1/8 of the next power of two, so at most 12.5 % is wasted.
        step = 1 << max((n - 1).bit_length() - 3, 12)
        return (n + step - 1) // step * step

    @property
    def in_use_bytes(self) -> int:
        return self._in_use_bytes

    @property
    def allocated_bytes(self) -> int:
        return self._allocated_bytes

    @property
    def slab_count(self) -> int:
        return len(self._slabs)

    def _use_slabs(self, cls: int) -> bool:
        hp = HUGEPAGES if self.hugepages is None else self.hugepages
        return bool(hp) and _MADV_HUGEPAGE is not None and SLAB_MIN <= cls < HUGE_PAGE

    def acquire(self, n: int) -> AlignedBuffer | None:
        cls = self.size_class(n)
        with self._lock:
            if self._closed:
                return None
            self._unpark_locked()
            free = self._free.get(cls)
            while free:
                buf = free.pop()
                if buf._slab is not None:
                    buf._slab.nfree -= 1
                if buf.exported():
                    # Viewed again after it was released (a holder of a stale reference made a view): never hand
                    # out a buffer someone can still see; park it until that view is gone.
                    self._parked.append(buf)
                    continue
                self._in_use_bytes += cls
                self.reuses += 1
                return buf
            fresh = self._fresh.get(cls)
            if fresh:
                buf = fresh.pop()
                assert buf._slab is not None  # fresh buffers are slab slots
                buf._slab.nfree -= 1
                self._in_use_bytes += cls
                self.allocations += 1
                return buf
            if self._use_slabs(cls):
                got = self._acquire_slab_locked(cls)
                if got is not None:
                    return got
                # no slab fits: fall through to a plain buffer if the room allows it
            if self._allocated_bytes + cls > self.capacity_bytes:
                self._shrink_locked(self._allocated_bytes + cls - self.capacity_bytes)
                if self._allocated_bytes + cls > self.capacity_bytes:
                    return None
            self._allocated_bytes += cls
            self._in_use_bytes += cls
            self.allocations += 1
        try:
            return AlignedBuffer(cls, self.hugepages)
        except (OSError, ValueError):
            with self._lock:
                self._allocated_bytes -= cls
                self._in_use_bytes -= cls
            return None

    def _acquire_slab_locked(self, cls: int) -> AlignedBuffer | None:
        """Map a new slab of class ``cls`` within the capacity (dropping free buffers if needed), hand out one
        slot and put the rest in the free list. None if not even a one-huge-page slab fits."""
        want = _slab_bytes(cls)
        if self._allocated_bytes + want > self.capacity_bytes:
            self._shrink_locked(self._allocated_bytes + want - self.capacity_bytes)
        size = _slab_bytes(cls, self.capacity_bytes - self._allocated_bytes)
        if not size:
            return None
        try:
            slab = _Slab(size, cls)
            slots = slab.slots()
        except (OSError, ValueError, BufferError):
            return None
        self._slabs.append(slab)
        self._allocated_bytes += size
        self.slab_allocations += 1
        self.allocations += 1  # counts buffers as they are first handed out
        self._fresh[cls].extend(reversed(slots[1:]))  # popped in address order
        slab.nfree = len(slots) - 1
        self._in_use_bytes += cls
        return slots[0]

    def prefault(self, n: int) -> int:
        """Fill the pool's free room with buffers of ``n`` bytes' size class, every page touched, and put them
        in the free list; returns the bytes that took. Call it before the pool is in use: it briefly holds all
        free room. What an engine that pins its host buffers at start gets: later reads and puts reuse resident
        memory instead of having the kernel fault and zero fresh pages on the I/O path."""
        got: list[AlignedBuffer] = []
        while (buf := self.acquire(n)) is not None:
            ctypes.memset(buf.address, 0, buf.capacity)
            got.append(buf)
        for buf in got:
            self.release(buf)
        return sum(b.capacity for b in got)

    def clear(self) -> None:
        """Forget every buffer the pool holds (free, never handed out, parked) and every slab, and close the pool:
        their memory goes back to the OS as soon as nothing else refers to them. A buffer still in use or viewed
        lives on through its holder's reference; when it is released later it is dropped, not taken back, and
        :meth:`acquire` hands out nothing more. For an owner that is closing. (A slab's slot that is still viewed
        keeps its whole slab mapped until that view goes.)"""
        with self._lock:
            self._closed = True
            self._free.clear()
            self._fresh.clear()
            self._parked.clear()
            self._slabs.clear()
            self._allocated_bytes = 0
            self._in_use_bytes = 0

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            if self._closed:
                return  # dropped: its memory goes once its last holder does
            self._in_use_bytes -= buf.capacity
            if buf.exported():
                self._parked.append(buf)
            else:
                self._push_free_locked(buf)

    def _push_free_locked(self, buf: AlignedBuffer) -> None:
        self._free[buf.capacity].append(buf)
        if buf._slab is not None:
            buf._slab.nfree += 1

    def _unpark_locked(self) -> None:
        if not self._parked:
            return
        still = []
        for buf in self._parked:
            if buf.exported():
                still.append(buf)
            else:
                self._push_free_locked(buf)
        self._parked = still

    def _shrink_locked(self, need: int) -> None:
        """Drop free buffers of other size classes, then wholly free slabs, until ``need`` bytes are returned to
        the OS. A slot is never dropped alone: its memory goes back only with its whole slab."""
        for cls in sorted(self._free, reverse=True):
            free = self._free[cls]
            if not any(b._slab is None for b in free):
                continue
            keep: list[AlignedBuffer] = []
            while free and need > 0:
                b = free.pop()
                if b._slab is not None:
                    keep.append(b)
                    continue
                self._allocated_bytes -= cls
                need -= cls
            free.extend(reversed(keep))
            if need <= 0:
                return
        for slab in list(self._slabs):
            if need <= 0:
                return
            if slab.nfree != slab.nslots:
                continue
            free, fresh = self._free[slab.slot_bytes], self._fresh[slab.slot_bytes]
            if any(b.exported() for b in free + fresh if b._slab is slab):  # a released buffer viewed again
                continue
            free[:] = [b for b in free if b._slab is not slab]
            fresh[:] = [b for b in fresh if b._slab is not slab]
            self._slabs.remove(slab)
            slab.nfree = 0
            self._allocated_bytes -= slab.size
            need -= slab.size
            # The mapping is unmapped when the last reference (the slots just dropped) goes.
