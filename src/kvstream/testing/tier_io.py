"""Whole chunks in and out of a :class:`~kvstream.tiers.contract.FileTier`, the way the store moves them.

Write: ``reserve`` → ``create_temp`` → one write of the encoded chunk (:mod:`kvstream.format`) on the tier's
``write_ring`` → ``publish``. Read: ``open_for_read`` → one read on the tier's ``read_ring`` → the header and the
payload checksum are checked, as the store's reader checks them. So a fault or throttle wrapper on the tier's I/O
engine sits in the path exactly as it would under the store.

Invariant: :func:`read_chunk` returns a payload only if it verified against the key's header: any other outcome is
a :class:`Miss` or a :class:`Failed` naming why, never bytes.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass

from kvstream.errors import CorruptChunkError, TierError
from kvstream.format import HEADER_BYTES, ChunkMeta, decode_header, file_size, payload_checksum, verify_payload, \
    write_header
from kvstream.io.buffers import AlignedBuffer
from kvstream.io.engine import IOOp, OpKind, Ring
from kvstream.tiers.contract import FileTier

__all__ = ["Miss", "Failed", "Refused", "encode_chunk", "write_temp", "write_chunk", "read_chunk", "read_open", "IO_TIMEOUT_S"]

IO_TIMEOUT_S = 30.0  # one op that takes longer has hung: the tests report it instead of waiting for ever


@dataclass(frozen=True, slots=True)
class Miss:
    """The tier does not have the key."""


@dataclass(frozen=True, slots=True)
class Failed:
    """The read failed cleanly (an I/O error, a short read, bytes that did not verify): ``why`` says which."""

    why: str


@dataclass(frozen=True, slots=True)
class Refused:
    """``reserve`` refused the chunk: it can never fit, or only evicting pinned chunks would make room."""


def encode_chunk(key: bytes, payload: bytes) -> AlignedBuffer:
    """The chunk file for ``payload`` (header, payload, zero padding) in an aligned buffer of its file size."""
    buf = AlignedBuffer(file_size(len(payload)))
    mv = buf.view()
    write_header(mv, key=key, meta=ChunkMeta(), payload_len=len(payload), payload_sum=payload_checksum(payload),
                 created_ns=time.time_ns())
    mv[HEADER_BYTES:HEADER_BYTES + len(payload)] = payload
    return buf


def _unset(op: IOOp) -> None:
    """An op's callback until :func:`_run` sets the one that wakes its waiter."""


def _run(ring: Ring, op: IOOp) -> int:
    """Submit one op and wait for its completion; its result (bytes, or -errno)."""
    done = threading.Event()
    op.callback = lambda _op: done.set()
    ring.submit([op])
    if not done.wait(IO_TIMEOUT_S):
        raise AssertionError(f"an I/O op on ring {ring!r} did not complete within {IO_TIMEOUT_S} s")
    return op.result


def write_temp(tier: FileTier, key: bytes, payload: bytes) -> tuple[str, int] | Refused:
    """Reserve room and write the whole chunk to a new temporary: (its path, its size), or :class:`Refused`. The
    temporary is not published (a killed writer leaves just this). Raises ``OSError`` if the write fails (the
    temporary is removed and the reservation returned first)."""
    buf = encode_chunk(key, payload)
    n = buf.capacity
    if not tier.reserve(n):
        return Refused()
    try:
        fd, tmp = tier.create_temp(key)
    except BaseException:
        tier.unreserve(n)
        raise
    try:
        res = _run(tier.write_ring, IOOp(kind=OpKind.WRITE, fd=fd, buf=buf, length=n, offset=0, callback=_unset))
    finally:
        os.close(fd)
    if res != n:
        os.unlink(tmp)
        tier.unreserve(n)
        raise OSError(-res if res < 0 else errno.EIO, f"chunk write of {n} B returned {res}")
    return tmp, n


def write_chunk(tier: FileTier, key: bytes, payload: bytes, *, before_publish: threading.Barrier | None = None
                ) -> bool | Refused:
    """Write and publish one chunk: ``publish``'s answer (True: ours is the chunk; False: the key was there first),
    or :class:`Refused`. ``before_publish``: wait there once the bytes are written (racing publishers)."""
    got = write_temp(tier, key, payload)
    if isinstance(got, Refused):
        return got
    tmp, n = got
    if before_publish is not None:
        before_publish.wait(IO_TIMEOUT_S)
    return tier.publish(key, tmp, n)


def read_open(tier: FileTier, key: bytes, fd: int, length: int) -> bytes | Failed:
    """Read a descriptor ``open_for_read`` gave (``length`` bytes asked) and verify it as ``key``'s chunk."""
    if length <= 0 or length % 4096:
        return Failed(f"open_for_read gave a read length of {length} B (not a positive multiple of 4 KiB)")
    buf = AlignedBuffer(length)
    res = _run(tier.read_ring, IOOp(kind=OpKind.READ, fd=fd, buf=buf, length=length, offset=0, callback=_unset))
    if res < 0:
        return Failed(f"read error {os.strerror(-res)}")
    data = bytes(buf.view(0, res))
    try:
        header = decode_header(data, expect_key=key)
        if res != header.file_size:  # short (truncated), or longer than its header says (not our file)
            return Failed(f"read {res} B, the header says the chunk is {header.file_size} B")
        payload = data[HEADER_BYTES:HEADER_BYTES + header.payload_len]
        verify_payload(header, payload)
    except CorruptChunkError as exc:
        return Failed(str(exc))
    return payload


def read_chunk(tier: FileTier, key: bytes) -> bytes | Miss | Failed:
    """Open, read and verify the key's chunk: its payload, a :class:`Miss`, or a clean :class:`Failed`."""
    try:
        got = tier.open_for_read(key)
    except TierError as exc:
        return Failed(str(exc))
    if got is None:
        return Miss()
    fd, length = got
    try:
        return read_open(tier, key, fd, length)
    finally:
        os.close(fd)
