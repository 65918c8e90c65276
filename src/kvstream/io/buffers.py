"""Aligned host buffers for O_DIRECT, pooled and reused.

Each :class:`AlignedBuffer` is its own anonymous ``mmap`` (page aligned, so valid for O_DIRECT on any block
size up to 4 KiB). It is its own buffer exporter on purpose: the pool can tell whether anyone still holds a
``memoryview`` of it from its reference count, and so it never hands out a buffer a caller can still see.

Invariant: a buffer is in at most one place at a time: the pool's free list, an in-flight I/O operation, or an
owner (a memory-tier entry, a pending write); and it is reused only when no memoryview of it is alive.
"""

from __future__ import annotations

import ctypes
import mmap
import sys
import threading
from collections import defaultdict

__all__ = ["ALIGN", "AlignedBuffer", "BufferPool", "round_up"]

ALIGN = 4096  # O_DIRECT alignment used everywhere: file offsets, lengths and buffer addresses


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


class AlignedBuffer:
    """A page-aligned, fixed-capacity byte buffer. ``address`` is stable for its lifetime."""

    __slots__ = ("_mm", "capacity", "address", "_anchor", "__weakref__")

    def __init__(self, capacity: int) -> None:
        if capacity <= 0 or capacity % ALIGN:
            raise ValueError(f"AlignedBuffer capacity must be a positive multiple of {ALIGN}, got {capacity}")
        self._mm = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.capacity = capacity
        # ctypes view used only to learn the address; it is an export of the mmap, counted in the baseline.
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.address = ctypes.addressof(self._anchor)

    def view(self, start: int = 0, stop: int | None = None) -> memoryview:
        """A writable view of ``[start, stop)``. Views keep the buffer out of the free list while alive."""
        return memoryview(self._mm)[start:stop]

    def readonly(self, start: int = 0, stop: int | None = None) -> memoryview:
        return memoryview(self._mm)[start:stop].toreadonly()

    def exported(self) -> bool:
        """True while any memoryview (or other export) of this buffer is alive (CPython reference count)."""
        # Baseline references: self._mm attribute, the ctypes anchor's base reference, getrefcount's argument.
        return sys.getrefcount(self._mm) > 3

    def __len__(self) -> int:
        return self.capacity

    def __repr__(self) -> str:
        return f"AlignedBuffer({self.capacity} B @ {self.address:#x})"


class BufferPool:
    """A bounded pool of aligned buffers in size classes (multiples of 4 KiB, rounded up to a power-of-two
    eighth so similar chunk sizes share a class).

    ``acquire(n)`` returns a buffer of at least ``n`` bytes or ``None`` when the pool would exceed
    ``capacity_bytes`` (a shortage is a return value, not an exception). ``release(buf)`` returns it for reuse;
    a released buffer that is still exported is parked and reused once its views are gone.
    Thread-safe.
    """

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < ALIGN:
            raise ValueError(f"BufferPool capacity must be at least {ALIGN} bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._free: dict[int, list[AlignedBuffer]] = defaultdict(list)
        self._parked: list[AlignedBuffer] = []  # released but still viewed by someone
        self._allocated_bytes = 0  # every buffer the pool created and has not dropped
        self._in_use_bytes = 0
        self.allocations = 0  # buffers created (a flat count in a long run shows reuse works)
        self.reuses = 0

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

    def acquire(self, n: int) -> AlignedBuffer | None:
        cls = self.size_class(n)
        with self._lock:
            self._unpark_locked()
            free = self._free.get(cls)
            if free:
                buf = free.pop()
                self._in_use_bytes += cls
                self.reuses += 1
                return buf
            if self._allocated_bytes + cls > self.capacity_bytes:
                self._shrink_locked(self._allocated_bytes + cls - self.capacity_bytes)
                if self._allocated_bytes + cls > self.capacity_bytes:
                    return None
            self._allocated_bytes += cls
            self._in_use_bytes += cls
            self.allocations += 1
        try:
            return AlignedBuffer(cls)
        except (OSError, ValueError):
            with self._lock:
                self._allocated_bytes -= cls
                self._in_use_bytes -= cls
            return None

    def release(self, buf: AlignedBuffer) -> None:
        with self._lock:
            self._in_use_bytes -= buf.capacity
            if buf.exported():
                self._parked.append(buf)
            else:
                self._free[buf.capacity].append(buf)

    def _unpark_locked(self) -> None:
        if not self._parked:
            return
        still = []
        for buf in self._parked:
            (still if buf.exported() else self._free[buf.capacity]).append(buf)
        self._parked = still

    def _shrink_locked(self, need: int) -> None:
        """Drop free buffers of other size classes until ``need`` bytes are returned to the OS."""
        for cls in sorted(self._free, reverse=True):
            free = self._free[cls]
            while free and need > 0:
                free.pop()
                self._allocated_bytes -= cls
                need -= cls
            if need <= 0:
                return
