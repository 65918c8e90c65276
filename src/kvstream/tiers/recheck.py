"""Checking a chunk file again, from the file itself, before anything is done to it.

Why: a read that does not verify (a checksum mismatch, a short read, a bad header) says that *these bytes*, as
they arrived, are wrong, not that the file is. A bit flipped on the way (a flaky link, a FUSE client, a fault
injected in the I/O path) or a read sized from a stale index looks the same as a damaged file, and quarantining
on the first failure destroyed intact files: 4,269 in 180 s of the load test at 2 % transient read faults.
So a failed verification is answered by a second read with a fresh descriptor and plain ``preadv`` (not the
tier's ring), and the file is quarantined only if that read fails the same checks: a *confirmed* failure.

Sizes are the file's own: the header says how long the payload is; the file's ``fstat`` says how many bytes
exist; neither is believed past the tier's capacity (no chunk of ours is larger), so a planted giant file or a
header claiming terabytes costs one bounded read, never an allocation of that size.

One implementation for the store's reader and ``kvstream verify`` (:func:`check_chunk_file`).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import xxhash

from kvstream.errors import CorruptChunkError
from kvstream.format import HEADER_BYTES, decode_header

__all__ = ["read_size", "reread_into", "check_chunk_file", "ENOENT_LIKE"]

_BLOCK = 4 << 20
_ALIGN = 4096
ENOENT_LIKE = (errno.ENOENT, errno.ESTALE)  # the name (or the file under a handle) is not there


def read_size(st_size: int, limit: int) -> int:
    """Bytes to read for a whole chunk file of ``st_size`` bytes: at least its header, at most ``limit`` (the
    tier's capacity), rounded up to 4 KiB (an O_DIRECT read of an odd length fails with EINVAL; past the end of
    the file it simply returns less). What the header then says decides whether the file is whole."""
    n = min(max(st_size, HEADER_BYTES), max(limit, HEADER_BYTES))
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def reread_into(path: str | Path, views: list[memoryview]) -> tuple[int, int]:
    """Read the file at ``path`` from offset 0 into ``views`` (in order) with a new descriptor and buffered
    ``preadv``: (bytes read, inode read), or (-errno, 0). Never raises ``OSError``.

    Buffered on purpose: it is a second opinion through another path than the ring's O_DIRECT reads (and it
    needs no alignment of the views)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        return -(exc.errno or errno.EIO), 0
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return -errno.EINVAL, 0
        total = 0
        want = sum(len(v) for v in views)
        while total < want:  # preadv may return less than asked before the end of the file
            rest = _skip(views, total)
            n = os.preadv(fd, rest, total)
            if n <= 0:
                break
            total += n
        return total, st.st_ino
    except OSError as exc:
        return -(exc.errno or errno.EIO), 0
    finally:
        os.close(fd)


def _skip(views: list[memoryview], n: int) -> list[memoryview]:
    """``views`` without their first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:])
        n = 0
    return out


def check_chunk_file(path: str | Path, key: bytes, *, limit: int | None = None) -> tuple[int, int, str | None]:
    """(file size, inode, None) if the file at ``path`` is a valid chunk for ``key``, else (size, inode, the
    check that failed). Reads the header, then exactly the payload the header names (in blocks), and never
    more than ``limit`` bytes in all. Raises ``OSError`` if the file cannot be opened or read (an I/O error is
    no verdict on the bytes).

    Opened with ``O_NONBLOCK`` and checked to be a regular file first: a FIFO planted at a chunk path would
    block a plain open forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return 0, st.st_ino, "not a regular file"
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        head = f.read(HEADER_BYTES)
        try:
            header = decode_header(head, where=str(path), expect_key=key)
        except CorruptChunkError as exc:
            return size, st.st_ino, exc.reason
        if limit is not None and header.file_size > max(limit, HEADER_BYTES):
            return size, st.st_ino, f"header says {header.file_size} B, more than the tier holds ({limit} B)"
        if size < header.file_size:
            return size, st.st_ino, f"truncated file ({size} of {header.file_size} B)"
        if size > header.file_size:
            return size, st.st_ino, f"file is {size} B, its header says {header.file_size} B"
        h = xxhash.xxh3_64()
        left = header.payload_len
        while left:
            block = f.read(min(left, _BLOCK))
            if not block:
                return size, st.st_ino, f"truncated payload ({header.payload_len - left} of {header.payload_len} B)"
            h.update(block)
            left -= len(block)
        if h.intdigest() != header.payload_sum:
            return size, st.st_ino, "payload checksum mismatch"
    return size, st.st_ino, None
