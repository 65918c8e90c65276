"""Raw O_DIRECT I/O used as the *bound* in benchmarks: read (or write) files as fast as an engine can.

No chunk format, no verification, no index: ``read_files`` keeps ``depth`` reads in flight on one ring, each
completion's callback issuing the next read into the same buffer, and reports bytes, seconds and GB/s. A
benchmark compares the store's own reads against this figure measured in the same run on the same files
(TESTBED.md, "Rules"), and ``read_tiers_concurrently`` gives the aggregate-bandwidth bound of several tiers
read at once (one thread and one ring per tier).

``write_files`` is the matching raw writer (test data for probes and benchmarks, write bandwidth, and a
background write load that can run until told to stop).

Sizes: ops are multiples of 4096 bytes at 4096-aligned offsets (O_DIRECT). Files written by kvstream have
aligned sizes; a file whose size is not a multiple of 4096 fails its last O_DIRECT read with -EINVAL.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

from kvstream.io.buffers import ALIGN, AlignedBuffer, round_up
from kvstream.io.engine import IOEngine, IOOp, OpKind

__all__ = [
    "RawResult",
    "MultiTierResult",
    "read_files",
    "write_files",
    "read_tiers_concurrently",
    "drop_page_cache",
    "filesystem_type",
    "advise_hugepages",
    "direct_io_problem",
    "MAX_WHOLE_FILE_OP",
]

MAX_WHOLE_FILE_OP = 64 << 20  # with no op_bytes given, each file is one op, cut into ops of at most this
FileSpec: TypeAlias = "str | os.PathLike[str] | tuple[int, int]"  # a path, or an (fd, size) pair the caller owns


@dataclass(frozen=True, slots=True, kw_only=True)
class RawResult:
    """What one raw pass moved and how long it took. ``started``/``finished`` are ``time.perf_counter()``."""

    bytes: int  # bytes transferred (sum of op results)
    ops: int  # ops completed
    seconds: float  # wall time from the first submit to the last completion
    cpu_seconds: float  # process CPU (user + system, all threads, io-wq workers included) over the same span
    started: float
    finished: float
    latencies: tuple[float, ...] = ()  # per-op seconds from issue to completion, when asked for

    @property
    def gbps(self) -> float:
        """Bandwidth in GB/s (10^9 bytes per second)."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def cpu_seconds_per_gb(self) -> float:
        return self.cpu_seconds / (self.bytes / 1e9) if self.bytes else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class MultiTierResult:
    """Several tiers read at once: each tier's own result, and the aggregate.

    With a time window (``read_tiers_concurrently(seconds=...)``) every tier reads for the same span, so each
    tier's GB/s is its bandwidth *while the others read too*, and :attr:`sum_gbps` is the aggregate-bandwidth
    bound of DESIGN.md (Σ tier bandwidths measured concurrently). Without one, each tier reads its files once
    and the faster tiers finish early: :attr:`gbps` is then the wall-clock rate of that fixed job, which is
    *not* the bound when the tiers differ in speed.
    """

    tiers: dict[str, RawResult]  # tier name -> its result (its own start/finish)
    bytes: int
    seconds: float  # first start to last finish over all tiers
    window: float | None  # the common time window in seconds, if one was used

    @property
    def gbps(self) -> float:
        """All bytes over the common wall time."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def sum_gbps(self) -> float:
        """Σ of the tiers' own GB/s (the aggregate-bandwidth bound when a window was used)."""
        return sum(r.gbps for r in self.tiers.values())


# ── files and work lists ───────────────────────────────────────────────────────────────────────────────────


class _Files:
    """Opens path specs (O_DIRECT) and closes what it opened; (fd, size) pairs are used as given."""

    def __init__(self, files: Iterable[FileSpec], flags: int, *, direct: bool, size: int | None = None) -> None:
        self.entries: list[tuple[int, int, str]] = []  # (fd, size, name)
        self._owned: list[int] = []
        try:
            for spec in files:
                if isinstance(spec, tuple):
                    fd, n = spec
                    self.entries.append((fd, n, f"fd {fd}"))
                    continue
                fd = os.open(spec, flags | (os.O_DIRECT if direct else 0), 0o644)
                self._owned.append(fd)
                self.entries.append((fd, os.fstat(fd).st_size if size is None else size, os.fspath(spec)))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for fd in self._owned:
            os.close(fd)
        self._owned.clear()


def _work(entries: Sequence[tuple[int, int, str]], op_bytes: int) -> list[tuple[int, int, int, str]]:
    """(fd, offset, length, name) for every op: files in order, each cut into ``op_bytes`` pieces."""
    out = []
    for fd, size, name in entries:
        for off in range(0, size, op_bytes):
            out.append((fd, off, round_up(min(op_bytes, size - off), ALIGN), name))
    return out


def _op_bytes_for(entries: Sequence[tuple[int, int, str]], op_bytes: int | None) -> int:
    if op_bytes is None:
        op_bytes = max((size for _, size, _ in entries), default=ALIGN)
        op_bytes = min(round_up(max(op_bytes, 1)), MAX_WHOLE_FILE_OP)
    if op_bytes <= 0 or op_bytes % ALIGN:
        raise ValueError(f"op_bytes must be a positive multiple of {ALIGN}, got {op_bytes}")
    return op_bytes


_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_HUGE = 2 << 20  # x86-64 / aarch64 (4 KiB base pages) PMD size


def advise_hugepages(buf: AlignedBuffer) -> bool:
    """Ask for transparent huge pages behind ``buf`` (``madvise(MADV_HUGEPAGE)``), before it is touched.

    Why: an O_DIRECT request holds at most ``max_segments`` physically contiguous runs (254 on the virtio
    disk here). With 4 KiB pages a 4 MiB buffer is as fragmented as free memory happens to be, and the block
    layer splits each op into requests of ~0.5-1.5 MiB; backed by 2 MiB pages it goes out as 4 MiB requests.
    Measured on this VM's disk (fio and both engines alike): ~1.1-2.0 GB/s with 4 KiB pages, 3.1-4.6 GB/s
    with huge pages. Small ops gain too when their buffers are slices of one huge-page slab: each is then one
    segment, and the scheduler merges adjacent requests up to max_sectors_kb. Returns False where THP is
    unavailable (nothing changed); a buffer under 2 MiB cannot hold a huge page and is left alone.
    """
    if buf.capacity < _HUGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    return bool(_libc.madvise(buf.address, buf.capacity, mmap.MADV_HUGEPAGE) == 0)


def _new_buffer(size: int, hugepages: bool) -> AlignedBuffer:
    buf = AlignedBuffer(size, hugepages=hugepages)
    if hugepages:
        advise_hugepages(buf)
    # Touch every page now, so first-use page faults are not timed as I/O.
    ctypes.memset(buf.address, 0, buf.capacity)
    return buf


# ── the pump ───────────────────────────────────────────────────────────────────────────────────────────────


class _Pump:
    """Keeps up to ``depth`` ops in flight on one ring; each completion issues the next op with its buffer.

    Invariant: ``_outstanding`` = ops issued and not completed; the pump is done when the work is exhausted
    (or stopped, or failed) and ``_outstanding`` is 0.
    """

    def __init__(
        self, ring_engine: IOEngine, label: str, kind: OpKind, work: Iterator[tuple[int, int, int, str]],
        slots: Sequence[tuple[AlignedBuffer, int]], depth: int, max_op: int, want_latency: bool, stop: threading.Event | None,
    ) -> None:
        self._ring = ring_engine.ring(label, depth=depth, max_bytes=depth * max_op)
        self._kind = kind
        self._work = work
        self._slots = slots  # (buffer, offset in it) per op in flight
        self._stop = stop
        self._lock = threading.Lock()
        self._outstanding = 0
        self._done = threading.Event()
        self.bytes = 0
        self.ops = 0
        self.error: tuple[int, str, int] | None = None  # (-errno, file name, offset) of the first failure
        self.latencies: list[float] | None = [] if want_latency else None
        self.finished = 0.0

    def _next_locked(self) -> tuple[int, int, int, str] | None:
        if self.error is not None or (self._stop is not None and self._stop.is_set()):
            return None
        return next(self._work, None)

    def run(self) -> float:
        """Issue, wait for everything, close the ring; returns the perf_counter() at the first submit."""
        first: list[IOOp] = []
        with self._lock:
            for buf, at in self._slots:
                item = self._next_locked()
                if item is None:
                    break
                first.append(self._make(item, buf, at))
            self._outstanding = len(first)
        started = time.perf_counter()
        try:
            if first:
                self._ring.submit(first)
                self._done.wait()
            else:
                self.finished = started
        finally:
            self._ring.close()
        return started

    def _make(self, item: tuple[int, int, int, str], buf: AlignedBuffer, at: int) -> IOOp:
        fd, off, length, name = item
        op = IOOp(kind=self._kind, fd=fd, buf=buf, buf_offset=at, length=length, offset=off, callback=self._on_done)
        op.tag = name
        return op

    def _on_done(self, op: IOOp) -> None:
        last = False
        with self._lock:
            if op.result < 0:
                if self.error is None:
                    self.error = (op.result, str(op.tag), op.offset)
            else:
                self.bytes += op.result
                self.ops += 1
                if self.latencies is not None:
                    self.latencies.append(op.completed_at - op.submitted_at)
            item = self._next_locked()
            if item is None:
                self._outstanding -= 1
                last = self._outstanding == 0
        if item is not None:
            self._ring.submit([self._make(item, op.buf, op.buf_offset)])
        elif last:
            self.finished = time.perf_counter()
            self._done.set()


def _pump(
    engine: IOEngine, label: str, kind: OpKind, entries: Sequence[tuple[int, int, str]], *, depth: int, op_bytes: int,
    slots: Sequence[tuple[AlignedBuffer, int]], latencies: bool, stop: threading.Event | None = None, repeat: bool = False,
) -> RawResult:
    work_list = _work(entries, op_bytes)
    work: Iterator[tuple[int, int, int, str]] = _cycle(work_list) if repeat else iter(work_list)
    pump = _Pump(engine, label, kind, work, slots, depth, op_bytes, latencies, stop)
    cpu0 = time.process_time()
    started = pump.run()
    cpu = time.process_time() - cpu0
    if pump.error is not None:
        res, name, off = pump.error
        raise OSError(-res, f"raw {kind.value} of {name} at offset {off} failed: {os.strerror(-res)}")
    return RawResult(
        bytes=pump.bytes, ops=pump.ops, seconds=pump.finished - started, cpu_seconds=cpu, started=started,
        finished=pump.finished, latencies=tuple(pump.latencies or ()),
    )


def _cycle(items: list[tuple[int, int, int, str]]) -> Iterator[tuple[int, int, int, str]]:
    while items:
        yield from items


# ── public helpers ─────────────────────────────────────────────────────────────────────────────────────────


def read_files(
    files: Iterable[FileSpec],
    *,
    engine: IOEngine,
    depth: int = 16,
    op_bytes: int | None = None,
    direct: bool = True,
    latencies: bool = False,
    hugepages: bool = True,
    until: threading.Event | None = None,
    label: str = "rawread",
) -> RawResult:
    """Read every byte of ``files`` with ``depth`` ops in flight; no verification.

    ``files``: paths (opened here with O_DIRECT unless ``direct=False``) or ``(fd, size)`` pairs (the caller's
    fds, used as they are). ``op_bytes``: bytes per op (default: whole files, at most 64 MiB per op).
    ``hugepages``: back the buffers with transparent huge pages (see :func:`advise_hugepages`).
    ``until``: read the files round and round until the event is set (a time window), then finish the ops
    in flight; the result counts every byte read.
    Raises OSError naming the file and offset of the first failed op.
    """
    opened = _Files(files, os.O_RDONLY, direct=direct)
    try:
        size = _op_bytes_for(opened.entries, op_bytes)
        # One slab cut into depth slots, as fio does: with huge pages behind it each slot is physically
        # contiguous, so adjacent requests can merge (see advise_hugepages).
        slab = _new_buffer(depth * size, hugepages)
        slots = [(slab, i * size) for i in range(depth)]
        return _pump(
            engine, label, OpKind.READ, opened.entries, depth=depth, op_bytes=size, slots=slots, latencies=latencies,
            stop=until, repeat=until is not None,
        )
    finally:
        opened.close()


def write_files(
    paths: Sequence[str | os.PathLike[str]],
    file_bytes: int,
    *,
    engine: IOEngine,
    depth: int = 8,
    op_bytes: int | None = None,
    direct: bool = True,
    sync: bool = True,
    until: threading.Event | None = None,
    hugepages: bool = True,
    label: str = "rawwrite",
) -> RawResult:
    """Create (or overwrite) each path with ``file_bytes`` of random-looking data, ``depth`` writes in flight.

    ``sync``: fdatasync every file before the clock stops, so the figure is what reached the device.
    ``until``: keep overwriting the files round-robin until the event is set (a background write load);
    the result then counts every byte written. One source buffer serves every write (its content is
    irrelevant to the device), so memory stays ``op_bytes`` however deep the queue.
    """
    if file_bytes <= 0 or file_bytes % ALIGN:
        raise ValueError(f"file_bytes must be a positive multiple of {ALIGN}, got {file_bytes}")
    flags = os.O_WRONLY | os.O_CREAT | (0 if until is not None else os.O_TRUNC)
    opened = _Files(paths, flags, direct=direct, size=file_bytes)
    try:
        size = min(_op_bytes_for(opened.entries, op_bytes), file_bytes)
        src = _new_buffer(size, hugepages)
        src.view()[:] = os.urandom(size)
        result = _pump(
            engine, label, OpKind.WRITE, opened.entries, depth=depth, op_bytes=size, slots=[(src, 0)] * depth,
            latencies=False, stop=until, repeat=until is not None,
        )
        if not sync:
            return result
        for fd, _, _ in opened.entries:
            os.fdatasync(fd)
        finished = time.perf_counter()
        return RawResult(
            bytes=result.bytes, ops=result.ops, seconds=finished - result.started, cpu_seconds=result.cpu_seconds,
            started=result.started, finished=finished,
        )
    finally:
        opened.close()


def read_tiers_concurrently(
    tiers: Mapping[str, Iterable[FileSpec]],
    *,
    engine: IOEngine,
    depth: int = 16,
    op_bytes: int | None = None,
    direct: bool = True,
    latencies: bool = False,
    hugepages: bool = True,
    seconds: float | None = None,
) -> MultiTierResult:
    """Read every tier's files at the same time, one thread (and one ring) per tier, started together.

    ``seconds``: read for this common window (each tier going round its files), then stop every tier at
    once; this is how to measure the aggregate-bandwidth bound (see :class:`MultiTierResult`). Without it,
    each tier reads its files once. Raises the first tier's error.
    """
    names = list(tiers)
    stop = threading.Event() if seconds is not None else None

    def start_clock() -> None:  # runs once, when every tier is ready
        if stop is not None:
            timer = threading.Timer(seconds, stop.set)  # type: ignore[arg-type]
            timer.daemon = True
            timer.start()

    barrier = threading.Barrier(len(names), action=start_clock)
    results: dict[str, RawResult] = {}
    errors: dict[str, BaseException] = {}

    def one(name: str) -> None:
        try:
            files = list(tiers[name])
            barrier.wait()
            results[name] = read_files(
                files, engine=engine, depth=depth, op_bytes=op_bytes, direct=direct, latencies=latencies,
                hugepages=hugepages, until=stop, label=f"raw-{name}",
            )
        except threading.BrokenBarrierError:
            pass
        except BaseException as exc:  # reported below, in the caller's thread
            errors[name] = exc
            barrier.abort()

    threads = [threading.Thread(target=one, args=(n,), name=f"rawread-{n}") for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        name, exc = next(iter(errors.items()))
        raise OSError(getattr(exc, "errno", None) or 5, f"tier '{name}': {exc}") from exc
    total = sum(r.bytes for r in results.values())
    span = max(r.finished for r in results.values()) - min(r.started for r in results.values()) if results else 0.0
    return MultiTierResult(tiers=results, bytes=total, seconds=span, window=seconds)


def drop_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Ask the kernel to drop cached pages of each file (``posix_fadvise(DONTNEED)``); returns files done.

    Dirty pages cannot be dropped, so each file is flushed first. O_DIRECT reads bypass the page cache
    anyway (that is why the raw reader uses them); this is for buffered reads and for tools like fio
    without ``direct=1``. Missing files are skipped.
    """
    n = 0
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


# File systems where an O_DIRECT open succeeds (tmpfs since Linux 6.6) but reads come from RAM.
_RAM_FILESYSTEMS = frozenset({"tmpfs", "ramfs", "devtmpfs", "hugetlbfs"})


def filesystem_type(path: str | os.PathLike[str]) -> str:
    """The type of the file system holding ``path`` (``ext4``, ``tmpfs``, ``fuse.glusterfs``...), from
    /proc/self/mounts (the longest mount point that contains the path); ``unknown`` if it cannot tell."""
    real = os.path.realpath(path)
    best, kind = "", "unknown"
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
                inside = real == mnt or real.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    except OSError:
        pass
    return kind


def direct_io_problem(directory: str | os.PathLike[str]) -> str | None:
    """``None`` if O_DIRECT files in ``directory`` reach a device; otherwise why not (a phrase to put after
    the directory's name).

    Opening with O_DIRECT is not proof: tmpfs accepts it since Linux 6.6 and still serves RAM.
    """
    kind = filesystem_type(directory)
    if kind in _RAM_FILESYSTEMS:
        return f"on {kind}, where O_DIRECT reads RAM, not a device"
    probe = os.path.join(directory, f".kvstream-odirect-{os.getpid()}-{threading.get_ident()}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"its file system ({kind}) refuses O_DIRECT: {exc.strerror}"
    os.close(fd)
    os.unlink(probe)
    return None
