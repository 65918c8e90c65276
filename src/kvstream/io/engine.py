"""The I/O engine interface: rings that run reads and writes on file descriptors.

A :class:`Ring` is one submission queue (a tier has one for reads and one for writes). ``submit`` never waits
for I/O: operations beyond the ring's limits wait in the ring's own backlog and go out as earlier ones finish.
The limits are a count (``depth``) *and* bytes in flight (``max_bytes``): a ring of 48 MiB chunks and a ring of
256 KiB chunks should both keep the device busy without one of them pinning gigabytes of buffers.

Completion contract (both engines, tested to give identical results):
- each submitted op's ``callback(op)`` runs exactly once, on a ring thread, with ``op.result`` set to the bytes
  transferred (``== op.length`` on success; smaller only at end of file) or ``-errno`` on failure;
- a short transfer that is not at end of file is continued by the ring itself (so callers see all-or-EOF);
- callbacks must be quick and must not block on the same ring (hand work to another thread or a queue).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvstream.io.buffers import AlignedBuffer

__all__ = ["OpKind", "IOOp", "Ring", "IOEngine", "make_engine", "available_engines", "DEFAULT_DEPTH", "DEFAULT_MAX_BYTES"]

DEFAULT_DEPTH = 32
DEFAULT_MAX_BYTES = 64 << 20


class OpKind(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(slots=True, eq=False)
class IOOp:
    """One read or write of ``length`` bytes at file ``offset`` into/from ``buf[buf_offset:]``."""

    kind: OpKind
    fd: int
    buf: AlignedBuffer
    length: int  # bytes; a multiple of 4096 for O_DIRECT files
    offset: int  # file offset in bytes
    callback: Callable[["IOOp"], None]
    buf_offset: int = 0
    tag: object = None  # the submitter's own handle, untouched by the ring
    result: int = 0  # set before the callback: bytes transferred, or -errno
    submitted_at: float = 0.0  # time.monotonic() when it entered the ring (backlog included)
    completed_at: float = 0.0
    done_bytes: int = field(default=0, repr=False)  # progress of a continued short transfer

    def __post_init__(self) -> None:
        if self.length <= 0 or self.buf_offset < 0 or self.buf_offset + self.length > self.buf.capacity:
            raise ValueError(
                f"IOOp range [{self.buf_offset}, {self.buf_offset + self.length}) does not fit buffer of {self.buf.capacity} B"
            )


class Ring(ABC):
    """One submission queue. See the module docstring for the completion contract."""

    engine_name: str = "abstract"

    @abstractmethod
    def submit(self, ops: Sequence[IOOp]) -> None:
        """Queue ``ops``; returns at once."""

    @abstractmethod
    def inflight(self) -> int:
        """Operations submitted and not yet completed (backlog included)."""

    @abstractmethod
    def close(self) -> None:
        """Wait for every submitted op to complete, then release the ring's resources. Idempotent."""

    def drain(self, timeout: float | None = None) -> bool:
        """Block until nothing is in flight; True if drained within ``timeout`` seconds (``None``: no limit;
        ``0``: just look). Returns False only if ops were still in flight when the time was up.

        This default needs nothing but :meth:`inflight`, so any subclass gets a working drain: it polls, with a
        pause that starts short (most drains end within a few ops) and doubles up to 50 ms (how late, at most,
        it notices). A ring that signals its completions on a condition variable should override it with a
        wait on that, as the engines in this package do.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.0005
        while self.inflight() > 0:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            time.sleep(pause if deadline is None else min(pause, deadline - now))
            pause = min(2 * pause, 0.05)
        return True


class IOEngine(ABC):
    """A factory of rings of one kind (``uring`` or ``threads``)."""

    name: str = "abstract"

    @abstractmethod
    def ring(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> Ring: ...


def available_engines() -> dict[str, str | None]:
    """Engine name -> ``None`` if usable here, else the reason it is not."""
    from kvstream.io import uring

    return {"uring": uring.unavailable_reason(), "threads": None}


def make_engine(kind: str = "auto") -> IOEngine:
    """``uring``, ``threads`` or ``auto`` (io_uring where the kernel allows it, else threads).

    Asking for ``uring`` where it is unavailable raises :class:`kvstream.errors.ConfigError` with the reason.
    """
    from kvstream.errors import ConfigError
    from kvstream.io import threads, uring

    if kind == "threads":
        return threads.ThreadPoolEngine()
    if kind in ("uring", "auto"):
        reason = uring.unavailable_reason()
        if reason is None:
            return uring.UringEngine()
        if kind == "uring":
            raise ConfigError("io_engine", f"io_uring is not available here: {reason}")
        return threads.ThreadPoolEngine()
    raise ConfigError("io_engine", f"unknown engine {kind!r}; expected uring, threads or auto")


def errno_of(exc: OSError) -> int:
    return exc.errno or 5  # EIO when the OS gave none


def pread_full(fd: int, view: memoryview, offset: int) -> int:
    """Blocking read until ``view`` is full or end of file; returns bytes read. Shared by the thread engine
    and by tools that need one synchronous read (verify, the raw bound reader)."""
    total = 0
    n_want = len(view)
    while total < n_want:
        n = os.preadv(fd, [view[total:]], offset + total)
        if n == 0:
            break
        total += n
    return total


def pwrite_full(fd: int, view: memoryview, offset: int) -> int:
    total = 0
    n_want = len(view)
    while total < n_want:
        n = os.pwritev(fd, [view[total:]], offset + total)
        if n == 0:
            raise OSError(5, "pwritev wrote 0 bytes")
        total += n
    return total


class _LimitedBacklog:
    """Bookkeeping shared by both engines: admit ops while under (depth, max_bytes); at least one always fits."""

    def __init__(self, depth: int, max_bytes: int) -> None:
        if depth < 1:
            raise ValueError(f"ring depth must be >= 1, got {depth}")
        if max_bytes < 1:
            raise ValueError(f"ring max_bytes must be >= 1, got {max_bytes}")
        self.depth = depth
        self.max_bytes = max_bytes
        self.active_ops = 0
        self.active_bytes = 0

    def fits(self, op: IOOp) -> bool:
        if self.active_ops == 0:
            return True
        return self.active_ops < self.depth and self.active_bytes + op.length <= self.max_bytes

    def start(self, op: IOOp) -> None:
        self.active_ops += 1
        self.active_bytes += op.length

    def finish(self, op: IOOp) -> None:
        self.active_ops -= 1
        self.active_bytes -= op.length


_ = threading  # re-exported for engines' type hints
