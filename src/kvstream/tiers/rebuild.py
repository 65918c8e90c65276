"""Rebuilding a tier's index from its chunk files, after index damage.

Why: the index is a hint, the files are the truth. A damaged log record or snapshot loses the puts it held, and
a chunk file no index lists is invisible to every store (an *orphan*), although it is on disk, whole and valid.
Each chunk file is self-describing (its 4 KiB header names its key and payload length and is checksummed,
:mod:`kvstream.format`), so the listing can be rebuilt from the files alone: every file under ``chunks/`` whose
header is valid for the key its name says and whose size is what the header says, and that no index lists, is
listed again (a put record in the caller's log, owned by the caller).

Used by a store at open when its index met damage (``DirectoryTier._rebuild``) and by ``kvstream verify
--repair``. On a shared tier a file younger than the lease expiry may be a live peer's publish whose put is
not logged yet: it is left alone while any lease is live (its writer lists it; if it died, a later rebuild
does). The payload checksum is not read here (a read checks it; ``kvstream verify`` reads every byte).
"""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Container, Iterator
from pathlib import Path

from kvstream.errors import CorruptChunkError
from kvstream.format import HEADER_BYTES, decode_header

__all__ = ["chunk_files", "valid_unlisted", "CHUNK_NAME"]

CHUNK_NAME = re.compile(r"^([0-9a-f]{2,128})\.kvc$")


def chunk_files(root: Path) -> Iterator[tuple[bytes, Path]]:
    """(key, path) of every chunk-named regular file at its place under ``root/chunks`` (``ab/cd/<hex>.kvc``)."""
    chunks = root / "chunks"
    try:
        level1 = sorted(os.scandir(chunks), key=lambda e: e.name)
    except OSError:
        return
    for d1 in level1:
        if not d1.is_dir(follow_symlinks=False):
            continue
        try:
            level2 = sorted(os.scandir(d1.path), key=lambda e: e.name)
        except OSError:
            continue
        for d2 in level2:
            if not d2.is_dir(follow_symlinks=False):
                continue
            try:
                names = sorted(os.listdir(d2.path))
            except OSError:
                continue
            for name in names:
                m = CHUNK_NAME.match(name)
                if m is None or len(m.group(1)) % 2 or not m.group(1).startswith(d1.name + d2.name):
                    continue
                yield bytes.fromhex(m.group(1)), Path(d2.path) / name


def _whole(path: Path, key: bytes, limit: int) -> int | None:
    """The file's size if it is a whole chunk file of ``key`` by its header (never reading more than the
    header), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        header = decode_header(os.pread(fd, HEADER_BYTES, 0), where=str(path), expect_key=key)
    except (OSError, CorruptChunkError):
        return None
    finally:
        os.close(fd)
    if header.file_size != st.st_size or st.st_size > limit:
        return None
    return st.st_size


def valid_unlisted(root: Path, listed: Container[bytes], *, limit: int,
                   young_s: float = 0.0, now: float | None = None) -> Iterator[tuple[bytes, int]]:
    """(key, file size) of every whole chunk file under ``root`` whose key is not in ``listed``, skipping files
    whose mtime is less than ``young_s`` seconds before ``now`` (a live peer's publish not logged yet)."""
    now = time.time() if now is None else now
    for key, path in chunk_files(root):
        if key in listed:
            continue
        if young_s:
            try:
                if now - path.stat().st_mtime < young_s:
                    continue
            except OSError:
                continue
        size = _whole(path, key, limit)
        if size is not None:
            yield key, size
