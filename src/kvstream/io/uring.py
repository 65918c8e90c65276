"""The io_uring engine, in pure Python over the raw system calls (ctypes, no compiled extension).

Why no binding: the packaged ``liburing`` Python wheel dies with SIGILL on these CPUs (measured by the team), and a
compiled extension of our own would be one more build step on every machine. The part of
io_uring a storage engine needs is small: set up a ring, map it, write 64-byte submission entries, read
16-byte completion entries, and call ``io_uring_enter``. ctypes does all of it, and it releases the GIL for
the duration of each foreign call, so a thread blocked in ``io_uring_enter`` costs nothing to the others.

Structure: :class:`_RawRing` is one io_uring instance (the mappings, SQE/CQE access, the syscalls), with no
threads or locks; :class:`UringRing` puts the ring contract of :mod:`kvstream.io.engine` on top of it.
"""

# ─────────────────────────────────────────────────────────────────────────────────────────────────────────────
# Why it is built this way
#
# * One io_uring instance per Ring, and one thread per ring (the "reaper") that is the ring's *only* caller
#   of io_uring_enter. Any thread may call submit(): it writes SQEs into the shared SQ ring under the ring
#   lock and, only when the reaper is asleep in io_uring_enter, rings a doorbell (an eventfd on which the
#   reaper keeps a multishot IORING_OP_POLL_ADD, so the write becomes a CQE that wakes it). The reaper then
#   submits and waits in one call: io_uring_enter(to_submit, min_complete=1, GETEVENTS).
#   Why not enter from the submitting thread: submission is not cheap. For an O_DIRECT read the kernel
#   pins the buffer's pages and builds the bios *inside* io_uring_enter, in the calling thread: measured
#   here (4 KiB-page buffers), 7 µs per 256 KiB op, 73 µs per 4 MiB op, 870 µs per 48 MiB op (a step of 40
#   such chunks would be 35 ms of the serving loop's time). With one issuer per ring, submit() costs the caller a few µs
#   whatever the op size, and a tier's read ring and write ring, and each tier, pay that cost on their own
#   threads, in parallel. It also gives each ring one io-wq pool (io-wq workers belong to the thread that
#   issued the request) rather than one per submitting thread, and a ring whose requests never belong to
#   a short-lived thread (an exiting thread's *unbound* io-wq work is cancelled; regular files and block
#   devices are bound work, so this matters only for other fds). Cost: one eventfd write per submit batch
#   that finds the reaper asleep, and one eventfd read when it wakes.
# * The reaper finishes each completion's bookkeeping (short-transfer continuation, limits, backlog
#   admission, SQEs for the newly admitted ops) under the lock, gets the new SQEs to the device with a
#   non-waiting io_uring_enter, and only then runs the callbacks, outside the lock: callbacks may submit to
#   the same ring, and the device is never idle while Python runs callbacks. An op stops counting against
#   (depth, max_bytes) when its I/O has finished, i.e. before its callback runs.
# * Sizes: the SQ has >= depth + 2 entries (depth ops, the doorbell poll, one spare) and the CQ twice that
#   (IORING_SETUP_CQSIZE). A CQE exists only for a request in flight, and at most depth + 1 requests are in
#   flight, so the CQ cannot overflow by construction; the overflow counter is still checked and a non-zero
#   value is logged (with IORING_FEAT_NODROP the kernel keeps such CQEs and hands them over later anyway).
# * An op longer than _MAX_SQE_BYTES (1 GiB; the kernel caps one read/write at 0x7ffff000 bytes and the SQE
#   length field is 32 bits) is split: each SQE covers at most 1 GiB, and the rest goes out as the
#   continuation of a short transfer does, so ops of any length work (tested with a smaller cap).
# * Short transfers: 0 < res < remaining -> resubmit the remainder; res == 0 -> end of file for a read (the
#   result is the bytes so far) and -EIO for a write (as pwrite_full); res < 0 -> -errno to the callback;
#   -EINTR is retried (as Python retries EINTR for the thread engine). Identical to the thread engine.
#
# Memory ordering (the SQ and CQ rings are shared with the kernel)
#   SQ: we write the SQE, then store the SQ tail. Without SQPOLL the kernel reads the SQ only inside
#   io_uring_enter, which only the reaper calls, after taking the ring lock that the submitting thread
#   released after its stores. The lock orders the other thread's stores before the reaper's syscall and the
#   kernel then runs in the reaper's own context, so program order applies on any architecture.
#   CQ: the kernel writes a CQE and then publishes the CQ tail with smp_store_release, from any CPU (IRQ
#   completion, io-wq worker). We need an acquire load of the tail before reading the CQEs, and a release
#   store of the CQ head after reading them (or the kernel may reuse a slot we have not read yet).
#   x86-64: plain loads and stores are enough. x86 is TSO: loads are not reordered with other loads, stores
#   not with other stores, and loads not with later stores; and no compiler can reorder our accesses, each
#   is a separate opaque C call made by the interpreter (memoryview item access: one aligned 4-byte mov).
#   aarch64: loads may be reordered, so plain accesses are not enough. We call libatomic's out-of-line
#   __atomic_load_4(ACQUIRE) / __atomic_store_4(RELEASE) through ctypes (LDAR / STLR) for the ring indices;
#   where libatomic.so.1 is missing, unavailable_reason() says so and `auto` falls back to threads.
#   (The aarch64 path is exercised on x86-64 by the tests; it has not run on aarch64 hardware yet.)
#
# What it costs (CPU per op: user + system of the whole process, reaper and io-wq threads included; depth
# 16; 2 shared vCPUs (AMD EPYC, KVM), kernel 6.18, Python 3.11; median of 3 runs of
# `flock /tmp/kvs-bench.lock .venv/bin/python bench/engine_vs_fio.py --cpu-per-op`, docs/bench/io.md):
#     op size   source        uring µs/op   threads µs/op
#     4 KiB     O_DIRECT          9.4           20.8
#     256 KiB   O_DIRECT         11.0           13.6
#     4 MiB     O_DIRECT         31.3           35.9
#     4 KiB     page cache        8.2            8.5     (no device: the engine's own overhead, ~120k ops/s)
#   The Python side (SQE pack, CQE unpack, bookkeeping, callback) is ~8 µs per op; the rest is the kernel
#   pinning pages and building bios, which grows with op size. Reading 3 GiB in 4 MiB ops takes 0.02-0.03 s of
#   CPU with uring and 0.05-0.06 s with threads. Bandwidth equals fio's on the same files when both sides have
#   equally contiguous buffers (docs/bench/io.md).
#
# What is open (not done: no measurement here says it would help)
# * Registered buffers (IORING_REGISTER_BUFFERS + READ_FIXED): saves pinning the pages on every op. All told
#   a 4 MiB op costs 31 µs of CPU, about 3 % of a core at the disk's ~1000 ops/s: not worth coupling the
#   ring to the BufferPool (which would have to register its slabs) until a measurement says otherwise.
# * Registered files (IORING_REGISTER_FILES): saves an fget/fput per op; same reasoning.
# * SQPOLL: a kernel thread polling the SQ would spend one of the two cores here spinning.
# * SINGLE_ISSUER + DEFER_TASKRUN (6.1+; ring created disabled, enabled by the reaper): measured, no gain
#   (4 KiB O_DIRECT: 11.8-12.8 µs/op against 9.7-9.9 with COOP_TASKRUN; page cache: equal). Not used.
# * Not fork-safe: a child inherits the mappings but not the reaper; create rings after fork.
# ─────────────────────────────────────────────────────────────────────────────────────────────────────────────

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import logging
import mmap
import os
import platform
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from kvstream.errors import StoreClosedError, UsageError
from kvstream.io.engine import DEFAULT_DEPTH, DEFAULT_MAX_BYTES, IOEngine, IOOp, OpKind, Ring, _LimitedBacklog

__all__ = ["UringEngine", "UringRing", "unavailable_reason"]

log = logging.getLogger(__name__)

# ── kernel ABI (include/uapi/linux/io_uring.h) ──────────────────────────────────────────────────────────────
# The io_uring syscall numbers are the same in the generic table (aarch64) and on x86-64.
_NR_SETUP, _NR_ENTER = 425, 426
_SUPPORTED_ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}

_SETUP_CQSIZE = 1 << 3
_SETUP_SUBMIT_ALL = 1 << 7  # keep submitting a batch when one SQE fails to prepare (5.18)
_SETUP_COOP_TASKRUN = 1 << 8  # no IPI to a running issuer for task work (5.19)
_FEAT_SINGLE_MMAP = 1 << 0
_ENTER_GETEVENTS = 1 << 0
_OFF_SQ_RING, _OFF_CQ_RING, _OFF_SQES = 0, 0x8000000, 0x10000000
_OP_NOP, _OP_POLL_ADD, _OP_READ, _OP_WRITE = 0, 6, 22, 23
_POLL_ADD_MULTI = 1 << 0  # in sqe.len for POLL_ADD (5.13)
_CQE_F_MORE = 1 << 1  # a multishot request stays armed
_POLLIN = 0x1
_MAX_ENTRIES = 32768  # IORING_MAX_ENTRIES

# struct io_uring_sqe (64 bytes): opcode, flags, ioprio, fd, off, addr, len, rw_flags/poll32_events,
# user_data, buf_index, personality, splice_fd_in, addr3, pad.
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")
_CQE = struct.Struct("<QiI")  # struct io_uring_cqe: user_data, res, flags
assert _SQE.size == 64 and _CQE.size == 16

_MAX_SQE_BYTES = 1 << 30  # one SQE moves at most this many bytes; longer ops continue (see header)
_RESERVED_SQES = 2  # doorbell poll + one spare, beyond the ring's depth

# user_data values that are not ops: ops are numbered from 1 up, far below these.
_UD_DOORBELL = 1 << 63
_UD_PROBE = (1 << 63) + 1


class _SQRingOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "flags", "dropped", "array", "resv1")] + [
        ("user_addr", ctypes.c_uint64)
    ]


class _CQRingOffsets(ctypes.Structure):
    _fields_ = [(n, ctypes.c_uint32) for n in ("head", "tail", "ring_mask", "ring_entries", "overflow", "cqes", "flags", "resv1")] + [
        ("user_addr", ctypes.c_uint64)
    ]


class _Params(ctypes.Structure):
    _fields_ = [
        ("sq_entries", ctypes.c_uint32),
        ("cq_entries", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("sq_thread_cpu", ctypes.c_uint32),
        ("sq_thread_idle", ctypes.c_uint32),
        ("features", ctypes.c_uint32),
        ("wq_fd", ctypes.c_uint32),
        ("resv", ctypes.c_uint32 * 3),
        ("sq_off", _SQRingOffsets),
        ("cq_off", _CQRingOffsets),
    ]


assert ctypes.sizeof(_Params) == 120

# ── system calls ──────────────────────────────────────────────────────────────────────────────────────────
# A private CDLL instance, so setting argtypes here never changes another module's view of libc.syscall.
# Fixed argtypes (all longs) are safe for the variadic syscall(2) on x86-64 and aarch64 Linux, whose
# variadic and fixed integer calling conventions are the same. ctypes releases the GIL around the call.
_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
_syscall.argtypes = [ctypes.c_long] * 7


def _sys(nr: int, a: int = 0, b: int = 0, c: int = 0, d: int = 0, e: int = 0, f: int = 0) -> int:
    ret: int = _syscall(nr, a, b, c, d, e, f)
    if ret < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return ret


def _arch() -> str | None:
    return _SUPPORTED_ARCHES.get(platform.machine().lower())


@functools.cache
def _libatomic() -> ctypes.CDLL | None:
    """libatomic's out-of-line atomics, for ordered ring-index accesses on weakly ordered CPUs."""
    try:
        lib = ctypes.CDLL("libatomic.so.1")
        lib.__atomic_load_4.restype = ctypes.c_uint32
        lib.__atomic_load_4.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.__atomic_store_4.restype = None
        lib.__atomic_store_4.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int]
    except (OSError, AttributeError):
        return None
    return lib


_ATOMIC_ACQUIRE, _ATOMIC_RELEASE = 2, 3


def _pow2_at_least(n: int) -> int:
    return 1 << max(n - 1, 1).bit_length()


# ── one io_uring instance ─────────────────────────────────────────────────────────────────────────────────


class _RawRing:
    """One io_uring instance: its fd, its three mappings and the SQE/CQE accessors.

    Not thread-safe: the owner serialises push()/reap() (UringRing does, under its lock); enter() may run
    concurrently with them (the kernel side is safe, and only the reaper calls it).

    Invariants: ``_sq_tail`` is the SQ tail we have published; the SQ array is the identity map (slot i holds
    index i), written once here; ``_cq_head`` is the CQ head we have published.
    """

    def __init__(self, sq_entries: int, cq_entries: int, *, ordered: bool | None = None) -> None:
        if not 1 <= sq_entries <= _MAX_ENTRIES:
            raise ValueError(f"io_uring SQ size must be in [1, {_MAX_ENTRIES}], got {sq_entries}")
        self.fd = -1
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []
        self._anchors: list[ctypes.c_char] = []
        p = _Params()
        for flags in (
            _SETUP_CQSIZE | _SETUP_SUBMIT_ALL | _SETUP_COOP_TASKRUN,
            _SETUP_CQSIZE,  # kernels before 5.18/5.19
        ):
            ctypes.memset(ctypes.byref(p), 0, ctypes.sizeof(p))
            p.flags = flags
            p.cq_entries = cq_entries
            try:
                self.fd = _sys(_NR_SETUP, sq_entries, ctypes.addressof(p))
                break
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        else:
            raise OSError(errno.EINVAL, "io_uring_setup rejected every flag set we know (kernel too old?)")
        self.setup_flags = p.flags
        self.features = p.features
        self.sq_entries = p.sq_entries
        self.cq_entries = p.cq_entries
        try:
            self._map(p, ordered)
        except BaseException:
            self.close()
            raise

    def _map(self, p: _Params, ordered: bool | None) -> None:
        rw = mmap.PROT_READ | mmap.PROT_WRITE
        shared = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        sq_size = p.sq_off.array + p.sq_entries * 4
        cq_size = p.cq_off.cqes + p.cq_entries * _CQE.size
        if p.features & _FEAT_SINGLE_MMAP:
            sq_size = cq_size = max(sq_size, cq_size)
        sq_mm = mmap.mmap(self.fd, sq_size, flags=shared, prot=rw, offset=_OFF_SQ_RING)
        self._maps.append(sq_mm)
        if p.features & _FEAT_SINGLE_MMAP:
            cq_mm = sq_mm
        else:
            cq_mm = mmap.mmap(self.fd, cq_size, flags=shared, prot=rw, offset=_OFF_CQ_RING)
            self._maps.append(cq_mm)
        self._sqes = mmap.mmap(self.fd, p.sq_entries * _SQE.size, flags=shared, prot=rw, offset=_OFF_SQES)
        self._maps.append(self._sqes)
        self._cq = cq_mm
        sq32 = memoryview(sq_mm).cast("I")
        cq32 = memoryview(cq_mm).cast("I")
        self._views += [sq32, cq32]
        self._sq32, self._cq32 = sq32, cq32

        self._sq_mask = sq32[p.sq_off.ring_mask // 4]
        self._cq_mask = cq32[p.cq_off.ring_mask // 4]
        self._sq_khead = p.sq_off.head // 4
        self._sq_ktail = p.sq_off.tail // 4
        self._cq_khead = p.cq_off.head // 4
        self._cq_ktail = p.cq_off.tail // 4
        self._cq_koverflow = p.cq_off.overflow // 4
        self._cqes_off = p.cq_off.cqes
        array = p.sq_off.array // 4
        for i in range(p.sq_entries):
            sq32[array + i] = i
        self._sq_tail: int = sq32[self._sq_ktail]
        self._cq_head: int = cq32[self._cq_khead]
        self.overflow_seen = 0

        if ordered is None:
            ordered = _arch() != "x86_64"
        self.ordered = ordered
        # The ring's shared indices, read with acquire and written with release semantics.
        self._load_sq_head: Callable[[], int]
        self._store_sq_tail: Callable[[int], None]
        self._load_cq_tail: Callable[[], int]
        self._store_cq_head: Callable[[int], None]
        if ordered:
            lib = _libatomic()
            if lib is None:
                raise OSError(errno.ENOTSUP, "libatomic.so.1 is needed for ordered ring accesses on this CPU")
            # getattr: a literal lib.__atomic_load_4 inside a class body would be name-mangled
            load, store = getattr(lib, "__atomic_load_4"), getattr(lib, "__atomic_store_4")
            self._anchors += [ctypes.c_char.from_buffer(sq_mm), ctypes.c_char.from_buffer(cq_mm)]
            sq_base, cq_base = (ctypes.addressof(a) for a in self._anchors)
            self._load_sq_head = lambda: load(sq_base + self._sq_khead * 4, _ATOMIC_ACQUIRE)
            self._store_sq_tail = lambda v: store(sq_base + self._sq_ktail * 4, v, _ATOMIC_RELEASE)
            self._load_cq_tail = lambda: load(cq_base + self._cq_ktail * 4, _ATOMIC_ACQUIRE)
            self._store_cq_head = lambda v: store(cq_base + self._cq_khead * 4, v, _ATOMIC_RELEASE)
        else:  # x86-64 TSO: plain aligned 4-byte accesses (see the header comment)
            self._load_sq_head = lambda: sq32[self._sq_khead]
            self._store_sq_tail = lambda v: sq32.__setitem__(self._sq_ktail, v)
            self._load_cq_tail = lambda: cq32[self._cq_ktail]
            self._store_cq_head = lambda v: cq32.__setitem__(self._cq_khead, v)

    # SQ side
    def unsubmitted(self) -> int:
        """SQEs published but not yet consumed by the kernel."""
        return (self._sq_tail - self._load_sq_head()) & 0xFFFFFFFF

    def push(self, opcode: int, fd: int, addr: int, length: int, offset: int, user_data: int, op_flags: int = 0) -> None:
        """Write one SQE and publish it (store the tail after the entry). Caller serialises."""
        tail = self._sq_tail
        if (tail - self._load_sq_head()) & 0xFFFFFFFF >= self.sq_entries:
            raise RuntimeError("io_uring SQ is full: more requests in flight than the ring was sized for")
        _SQE.pack_into(self._sqes, (tail & self._sq_mask) * 64, opcode, 0, 0, fd, offset, addr, length, op_flags, user_data, 0, 0, 0, 0, 0)
        tail = (tail + 1) & 0xFFFFFFFF
        self._sq_tail = tail
        self._store_sq_tail(tail)

    def enter(self, to_submit: int, min_complete: int, flags: int) -> int:
        """io_uring_enter; the GIL is released while it blocks. Raises OSError (EINTR included)."""
        return _sys(_NR_ENTER, self.fd, to_submit, min_complete, flags, 0, 0)

    # CQ side
    def reap(self) -> list[tuple[int, int, int]]:
        """Every available CQE as ``(user_data, res, flags)``, and the slots handed back to the kernel."""
        head = self._cq_head
        n = (self._load_cq_tail() - head) & 0xFFFFFFFF
        if not n:
            return []
        mask, base, cq, unpack = self._cq_mask, self._cqes_off, self._cq, _CQE.unpack_from
        out = [unpack(cq, base + ((head + k) & mask) * 16) for k in range(n)]
        self._cq_head = head = (head + n) & 0xFFFFFFFF
        self._store_cq_head(head)
        overflow = self._cq32[self._cq_koverflow]
        if overflow != self.overflow_seen:  # cannot happen with our sizing; say so loudly if it does
            log.error("io_uring CQ overflowed (%d CQEs); ring sizing invariant broken", overflow)
            self.overflow_seen = overflow
        return out

    def close(self) -> None:
        """Unmap and close; idempotent. The kernel cancels whatever is still in flight."""
        for v in self._views:
            v.release()
        self._views.clear()
        self._anchors.clear()  # ctypes anchors hold exports of the mmaps until they are freed
        self._load_sq_head = self._store_sq_tail = self._load_cq_tail = self._store_cq_head = None  # type: ignore[assignment]
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # an export still alive (only on a failed set-up): unmapped when it goes
                pass
        self._maps.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ── availability ───────────────────────────────────────────────────────────────────────────────────────────


@functools.cache
def unavailable_reason() -> str | None:
    """``None`` if io_uring works here (a ring is set up and a NOP and a READ complete), else why not. Cached."""
    arch = _arch()
    if arch is None:
        return f"io_uring engine supports x86_64 and aarch64 only, this CPU is {platform.machine()!r}"
    if arch == "aarch64" and _libatomic() is None:
        return "on aarch64 the ring indices need acquire/release accesses and libatomic.so.1 is not loadable"
    try:
        with open("/proc/sys/kernel/io_uring_disabled") as f:
            disabled = int(f.read().strip() or 0)
    except (OSError, ValueError):
        disabled = 0
    if disabled == 2:
        return "io_uring is disabled by the kernel.io_uring_disabled sysctl (= 2)"
    try:
        ring = _RawRing(4, 8)
    except OSError as exc:
        return _setup_error_reason(exc, disabled)
    try:
        return _self_test(ring)
    except OSError as exc:
        return f"io_uring self-test failed: {exc}"
    finally:
        ring.close()


def _setup_error_reason(exc: OSError, disabled: int) -> str:
    if exc.errno == errno.ENOSYS:
        seccomp = _seccomp_mode()
        if seccomp:
            return f"io_uring_setup returned ENOSYS under a seccomp filter (Seccomp: {seccomp}); the sandbox blocks it"
        return "the kernel has no io_uring (io_uring_setup: ENOSYS)"
    if exc.errno == errno.EPERM:
        if disabled == 1:
            return "io_uring is restricted by kernel.io_uring_disabled = 1 and this process is not in io_uring_group"
        seccomp = _seccomp_mode()
        extra = f" (seccomp filter active, Seccomp: {seccomp})" if seccomp else ""
        return f"io_uring_setup is not permitted here (EPERM){extra}"
    if exc.errno == errno.ENOMEM:
        return "io_uring_setup failed with ENOMEM (RLIMIT_MEMLOCK too low on kernels before 5.12?)"
    return f"io_uring_setup failed: {exc}"


def _seccomp_mode() -> str | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Seccomp:"):
                    mode = line.split()[1]
                    return None if mode == "0" else mode
    except OSError:
        pass
    return None


def _self_test(ring: _RawRing) -> str | None:
    """A NOP and an IORING_OP_READ from a pipe must complete with the expected results."""
    ring.push(_OP_NOP, -1, 0, 0, 0, _UD_PROBE)
    _enter_retrying(ring, 1, 1)
    cqes = ring.reap()
    if [(ud, res) for ud, res, _ in cqes] != [(_UD_PROBE, 0)]:
        return f"io_uring NOP did not complete as expected: {cqes}"
    r, w = os.pipe()
    try:
        os.write(w, b"kvstream")
        buf = ctypes.create_string_buffer(8)
        ring.push(_OP_READ, r, ctypes.addressof(buf), 8, 0, _UD_PROBE)  # offset 0 on a pipe: "no offset"
        _enter_retrying(ring, 1, 1)
        cqes = ring.reap()
    finally:
        os.close(r)
        os.close(w)
    if [(ud, res) for ud, res, _ in cqes] != [(_UD_PROBE, 8)] or buf.raw != b"kvstream":
        return f"io_uring READ (opcode 22, kernel >= 5.6) did not work: {cqes}"
    return None


def _enter_retrying(ring: _RawRing, to_submit: int, min_complete: int) -> None:
    while True:
        try:
            ring.enter(to_submit, min_complete, _ENTER_GETEVENTS if min_complete else 0)
            return
        except InterruptedError:
            to_submit = ring.unsubmitted()


# ── the ring ───────────────────────────────────────────────────────────────────────────────────────────────

_TRANSIENT = (errno.EINTR, errno.EAGAIN, errno.EBUSY)  # io_uring_enter errors that mean "try again"


class UringRing(Ring):
    """A :class:`~kvstream.io.engine.Ring` on its own io_uring instance; see the module header.

    Invariants (under ``_lock``):
    - ``_pending`` = len(backlog) + len(_ops) + completions whose callback has not returned yet;
    - every op in ``_ops`` has exactly one SQE published or one request in the kernel, and counts in
      ``_limits``; an op leaves ``_ops`` exactly once, when its final CQE is reaped;
    - ``_rung`` is True from the moment a thread decides to write the doorbell until its CQE is reaped;
    - ``_waiting`` is True while the reaper is in (or about to enter) a blocking io_uring_enter.
    """

    engine_name = "uring"

    def __init__(
        self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES, _ordered: bool | None = None
    ) -> None:
        self.label = label
        self._limits = _LimitedBacklog(depth, max_bytes)
        sq = _pow2_at_least(depth + _RESERVED_SQES)
        if sq > _MAX_ENTRIES:
            raise ValueError(f"ring depth must be <= {_MAX_ENTRIES - _RESERVED_SQES} for io_uring, got {depth}")
        self._raw = _RawRing(sq, 2 * sq, ordered=_ordered)
        self._lock = threading.Lock()
        self._drained = threading.Condition(self._lock)
        self._backlog: deque[IOOp] = deque()  # waiting for room under the limits
        self._ops: dict[int, IOOp] = {}  # user_data -> op whose request is in the kernel (or its SQE is queued)
        self._ids = itertools.count(1)  # this ring's own user_data numbers
        self._pending = 0
        self._closed = False
        self._broken: BaseException | None = None
        self._waiting = False
        self._rung = False
        self._multishot = True  # doorbell poll mode; falls back to one-shot on kernels before 5.13
        try:
            self._efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        except BaseException:
            self._raw.close()
            raise
        self._arm_doorbell_locked()
        self._reaper = threading.Thread(target=self._run, name=f"kvs-uring-{label}", daemon=True)
        self._reaper.start()

    # public API
    def submit(self, ops: Sequence[IOOp]) -> None:
        for op in ops:
            if op.kind is not OpKind.READ and op.kind is not OpKind.WRITE:
                raise UsageError(f"ring '{self.label}': unknown op kind {op.kind!r}")
            if op.offset < 0:  # io_uring reads offset -1 as "the file position": never let one through
                raise UsageError(f"ring '{self.label}': file offset must be >= 0, got {op.offset}")
        now = time.monotonic()
        with self._lock:
            if self._broken is not None:
                raise StoreClosedError(f"ring '{self.label}' is broken ({self._broken}) and takes no more ops")
            if self._closed:
                raise StoreClosedError(f"ring '{self.label}' is closed")
            for op in ops:
                op.submitted_at = now
                op.done_bytes = 0
                op.result = 0
                self._backlog.append(op)
                self._pending += 1
            if self._admit_locked():
                self._wake_locked()

    def inflight(self) -> int:
        return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        with self._lock:
            return self._drained.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        """Refuse new ops, wait for every submitted op's callback, then unmap and close. Idempotent.

        Called from one of this ring's own callbacks, it returns at once and the reaper finishes the close
        when the last op is done (waiting there would wait for itself)."""
        with self._lock:
            self._closed = True
            self._wake_locked()
        if threading.current_thread() is not self._reaper:
            self._reaper.join()

    # bookkeeping (all *_locked under self._lock)
    def _wake_locked(self) -> None:
        """Ring the doorbell if the reaper may be asleep in io_uring_enter and nobody has rung yet.

        Under the lock (a ~1 µs write): the reaper closes the eventfd under the same lock, so a late write can
        never reach a closed, or reused, descriptor number."""
        if self._waiting and not self._rung and self._efd >= 0:
            self._rung = True
            os.eventfd_write(self._efd, 1)

    def _admit_locked(self) -> int:
        n = 0
        limits = self._limits
        while self._backlog and limits.fits(self._backlog[0]):
            op = self._backlog.popleft()
            limits.start(op)
            uid = next(self._ids)
            self._ops[uid] = op
            self._push_op_locked(uid, op)
            n += 1
        return n

    def _push_op_locked(self, uid: int, op: IOOp) -> None:
        done = op.done_bytes
        self._raw.push(
            _OP_READ if op.kind is OpKind.READ else _OP_WRITE,
            op.fd,
            op.buf.address + op.buf_offset + done,
            min(op.length - done, _MAX_SQE_BYTES),
            op.offset + done,
            uid,
        )

    def _arm_doorbell_locked(self) -> None:
        self._raw.push(_OP_POLL_ADD, self._efd, 0, _POLL_ADD_MULTI if self._multishot else 0, 0, _UD_DOORBELL, _POLLIN)

    def _complete_locked(self, uid: int, res: int, flags: int, now: float, done: list[IOOp]) -> bool:
        """Handle one CQE; append a finished op to ``done``. Returns True if it was the doorbell."""
        if uid == _UD_DOORBELL:
            self._rung = False
            if not flags & _CQE_F_MORE:  # a one-shot poll, or a multishot one the kernel ended: re-arm
                if res == -errno.EINVAL and self._multishot:
                    self._multishot = False
                if not self._closed or self._pending:
                    self._arm_doorbell_locked()
            return True
        op = self._ops.get(uid)
        if op is None:  # cannot happen: every SQE we publish is in _ops; never let it pass silently
            log.error("ring '%s': CQE for unknown user_data %#x (res %d)", self.label, uid, res)
            return False
        if res > 0:
            op.done_bytes += res
            if op.done_bytes < op.length:  # short transfer (or a split op): the ring continues it
                self._push_op_locked(uid, op)
                return False
            op.result = op.length
        elif res == 0:
            op.result = op.done_bytes if op.kind is OpKind.READ else -errno.EIO  # EOF / a write that wrote nothing
        elif res == -errno.EINTR:
            self._push_op_locked(uid, op)
            return False
        else:
            op.result = res
        del self._ops[uid]
        self._limits.finish(op)
        op.completed_at = now
        done.append(op)
        return False

    # the reaper
    def _run(self) -> None:
        raw = self._raw
        try:
            while True:
                with self._lock:
                    if self._closed and self._pending == 0:
                        return
                    to_submit = raw.unsubmitted()
                    self._waiting = True
                try:
                    raw.enter(to_submit, 1, _ENTER_GETEVENTS)
                    backoff = False
                except OSError as exc:
                    if exc.errno not in _TRANSIENT:
                        raise
                    backoff = exc.errno != errno.EINTR  # EAGAIN/EBUSY: the kernel is short of something
                done: list[IOOp] = []
                with self._lock:
                    self._waiting = False
                    now = time.monotonic()
                    cqes = raw.reap()
                    doorbell = False
                    for uid, res, flags in cqes:
                        doorbell |= self._complete_locked(uid, res, flags, now, done)
                    if done:
                        self._admit_locked()
                    to_submit = raw.unsubmitted()
                if doorbell:
                    self._drain_doorbell()
                if backoff and not cqes:
                    time.sleep(0.0005)
                failure: BaseException | None = None
                if done and to_submit:  # get the next requests to the device before running callbacks
                    try:
                        self._submit_now(to_submit)
                    except BaseException as exc:  # raised after the callbacks: reaped ops are still delivered
                        failure = exc
                for op in done:
                    self._callback(op)
                if done:
                    with self._lock:
                        self._pending -= len(done)
                        if self._pending == 0:
                            self._drained.notify_all()
                if failure is not None:
                    raise failure
        except BaseException as exc:  # a broken ring (a bug, or the kernel refusing the ring itself)
            log.exception("io_uring ring '%s' failed; failing its pending ops", self.label)
            self._fail_all(exc)
        finally:
            with self._lock:
                self._closed = True
                self._raw.close()
                os.close(self._efd)
                self._efd = -1

    def _submit_now(self, to_submit: int) -> None:
        try:
            self._raw.enter(to_submit, 0, 0)
        except OSError as exc:
            if exc.errno not in _TRANSIENT:
                raise
            # Not submitted now: the next (waiting) io_uring_enter submits them.

    def _drain_doorbell(self) -> None:
        try:
            os.eventfd_read(self._efd)
        except BlockingIOError:
            pass

    def _callback(self, op: IOOp) -> None:
        try:
            op.callback(op)
        except Exception:  # a raising callback must not stop the ring or skip the others
            log.exception("ring '%s': callback for %s op at offset %d raised", self.label, op.kind.value, op.offset)

    def _fail_all(self, exc: BaseException) -> None:
        """Complete every pending op with -errno, once. Only on a broken ring, an abnormal state: requests
        already in the kernel are cancelled when the ring fd closes, which may happen after these callbacks."""
        err = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
        with self._lock:
            self._broken = exc
            admitted = list(self._ops.values())
            for op in admitted:
                self._limits.finish(op)
            ops = admitted + list(self._backlog)
            self._ops.clear()
            self._backlog.clear()
            now = time.monotonic()
            for op in ops:
                op.result = -err
                op.completed_at = now
        for op in ops:
            self._callback(op)
        with self._lock:
            self._pending = 0
            self._drained.notify_all()


class UringEngine(IOEngine):
    """Rings on io_uring. Check :func:`unavailable_reason` first (``make_engine('auto')`` does)."""

    name = "uring"

    def ring(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> Ring:
        return UringRing(label, depth=depth, max_bytes=max_bytes)

