"""The persistent index of a directory tier: which chunk files exist and how big they are.

Why a log and a snapshot, not a scan: a tier of a million chunks on a parallel file system cannot be reopened
with a ``stat`` per chunk (minutes on Lustre). Instead each open store appends fixed-size records to its own
log, ``index/log-<node>-<pid>-<rand>.log`` (one writer per file: appends from several nodes to one file are not
atomic on shared file systems), and a compacted snapshot ``index/snapshot.idx`` holds the live set. Reopening
reads the snapshot and the logs sequentially: a few hundred MB at most, parsed with numpy.

Record (96 bytes, little-endian): magic ``KVIX`` | op u8 (1 put, 2 delete) | key_len u8 | 2 pad | file_size u64
| time_ns u64 | key 64s | 4 pad | xxh32 of the preceding 88 bytes. A torn last record (crash mid-append) fails
its checksum and is ignored.

Space for the log is reserved ahead (``posix_fallocate``, ``_RESERVE_BYTES`` at a time, zero-filled) and records
are written at the log's own offset, so that a full file system does not cost the record that says a chunk was
evicted to make room: an eviction frees space, but a concurrent chunk write can take it before the delete
record is appended. Readers stop at the first record whose magic is wrong, so the zeroed reserve (and a crash
that leaves it) reads as the end of the log; ``close()`` cuts the reserve off.

Compaction (at open, under a non-blocking ``flock`` on ``index/compact.lock``; skipped if another process holds
it): merge the snapshot and every *closed* log (renamed ``.closed`` by ``close()``, or left by a process of this
node that no longer exists) into a new snapshot, published by rename, which lists the logs it covers; covered
logs are deleted afterwards, and skipped if a crash left them behind.

Truth is the files: the index is a hint. A listed file that is gone reads as a miss (and the entry is dropped);
a file published but not yet logged (crash between rename and append) is invisible until its key is written
again, when the first-publish-wins link finds it and logs it. ``kvstream verify`` reports both.
Invariant: records are applied in ``time_ns`` order after the snapshot, so a put and a later delete of one key
from two processes end deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

log = logging.getLogger("kvstream.index")

__all__ = ["TierIndex", "IndexRecord", "OP_PUT", "OP_DEL", "pid_alive"]

OP_PUT = 1
OP_DEL = 2
_REC = struct.Struct("<4sBBxxQQ64s4x")
_REC_BYTES = _REC.size + 4  # + xxh32
_RESERVE_BYTES = 512 * _REC_BYTES  # 48 KiB: a few hundred records of a full disk's evictions
_MAGIC = b"KVIX"
_SNAP_MAGIC = b"KVIXSNP1"
_SNAP_HEAD = struct.Struct("<8sQQI")  # magic, entries, time_ns, covered-names bytes
_SNAP_DTYPE = np.dtype([("size", "<u8"), ("klen", "u1"), ("key", "S64")])
_LOG_DTYPE = np.dtype([("magic", "S4"), ("op", "u1"), ("klen", "u1"), ("pad", "V2"), ("size", "<u8"),
                       ("time", "<u8"), ("key", "V64"), ("pad2", "V4"), ("sum", "<u4")])
assert _LOG_DTYPE.itemsize == _REC_BYTES


@dataclass(frozen=True, slots=True)
class IndexRecord:
    op: int
    key: bytes
    file_size: int
    time_ns: int


def _encode(rec: IndexRecord) -> bytes:
    body = _REC.pack(_MAGIC, rec.op, len(rec.key), rec.file_size, rec.time_ns, rec.key)
    return body + xxhash.xxh32_intdigest(body).to_bytes(4, "little")


def _decode_log(data: bytes) -> Iterator[IndexRecord]:
    """Valid records of a log; stops at the first torn or foreign record (only the tail can be torn)."""
    n = len(data) // _REC_BYTES
    if n == 0:
        return
    arr = np.frombuffer(data, dtype=_LOG_DTYPE, count=n)
    raw = memoryview(data)
    for j in range(n):
        off = j * _REC_BYTES
        body = raw[off : off + _REC.size]
        if arr["magic"][j] != _MAGIC or xxhash.xxh32_intdigest(body) != int(arr["sum"][j]):
            return
        klen = int(arr["klen"][j])
        if arr["op"][j] not in (OP_PUT, OP_DEL) or not 0 < klen <= 64:  # checksummed but not ours: foreign
            return
        key = bytes(raw[off + 24 : off + 24 + klen])
        yield IndexRecord(int(arr["op"][j]), key, int(arr["size"][j]), int(arr["time"][j]))


def pid_alive(pid: int) -> bool:
    """True if a process of this node with that pid exists (used to spot crashed writers)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class TierIndex:
    """The live set of one tier: key -> file size in bytes. Thread-safe."""

    def __init__(self, folder: Path, *, node_id: str, writable: bool = True) -> None:
        self.folder = folder
        self.node_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_id)[:40] or "node"
        self._lock = threading.Lock()
        self._live: dict[bytes, int] = {}
        self._tails: dict[str, int] = {}  # other writers' logs: name -> bytes consumed
        self._own_name = f"log-{self.node_id}-{os.getpid()}-{secrets.token_hex(4)}.log"
        self._own_fd: int | None = None
        self.writable = writable
        self.load_seconds = 0.0
        self.compacted_logs = 0
        self.append_errors = 0  # records that could not be appended to our log (see _append)
        self._own_size = 0  # bytes of whole records in our log; the reserve beyond it is zeros
        self._reserved = 0  # bytes allocated to our log (>= _own_size when reservation works)
        t0 = time.perf_counter()
        folder.mkdir(parents=True, exist_ok=True) if writable else None
        if writable:
            self._compact()
        self._load()
        if writable:
            self._own_fd = os.open(folder / self._own_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            self._reserve()
        self.load_seconds = time.perf_counter() - t0

    # -- queries --------------------------------------------------------------------------------------------
    def get(self, key: bytes) -> int | None:
        return self._live.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __len__(self) -> int:
        return len(self._live)

    def items(self) -> list[tuple[bytes, int]]:
        with self._lock:
            return list(self._live.items())

    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._live.values())

    # -- updates --------------------------------------------------------------------------------------------
    def record(self, op: int, key: bytes, file_size: int = 0) -> None:
        """Apply and append one record (a put after the file is published, a delete after it is unlinked)."""
        rec = IndexRecord(op, key, file_size, time.time_ns())
        with self._lock:
            self._apply(rec)
            if self._own_fd is not None:
                self._append(_encode(rec))

    def _reserve(self) -> None:
        """Allocate the next ``_RESERVE_BYTES`` of our log ahead of the records (see the module docstring).

        Best effort: a file system without fallocate (glibc then writes zeros) or a full one leaves the log
        growing record by record, which is what it did before. Called with ``_lock`` held (or from __init__)."""
        try:
            os.posix_fallocate(self._own_fd, self._own_size, _RESERVE_BYTES)  # type: ignore[arg-type]
        except OSError:
            return
        self._reserved = max(self._reserved, self._own_size + _RESERVE_BYTES)

    def _append(self, data: bytes) -> None:
        """Write one record after the last; on failure (ENOSPC, EIO) zero what was torn and go on.

        Never raises: a record that did not reach the log only makes the index a worse hint after a restart
        (a put not logged: the file is invisible until rewritten; a delete not logged: the entry reads as a
        missing file and is dropped), the states the module docstring allows. A torn record mid-log would hide
        every later one, hence the zeroing (or the cut, past the reserve). Called with ``_lock`` held."""
        try:
            n = os.pwrite(self._own_fd, data, self._own_size)  # type: ignore[arg-type]
            if n == len(data):
                self._own_size += n
                if self._reserved - self._own_size < _RESERVE_BYTES // 4:
                    self._reserve()
                return
            err: OSError = OSError(28, "short append")
        except OSError as exc:
            err = exc
        self.append_errors += 1
        try:
            if self._own_size + len(data) <= self._reserved:
                os.pwrite(self._own_fd, bytes(len(data)), self._own_size)  # type: ignore[arg-type]
            else:
                os.ftruncate(self._own_fd, self._own_size)  # type: ignore[arg-type]
        except OSError:
            pass
        if self.append_errors in (1, 10, 100) or self.append_errors % 1000 == 0:
            log.warning("index %s: %d record(s) not logged (%s); the index is rebuilt from the files by "
                        "`kvstream verify --repair`", self.folder, self.append_errors, err.strerror or err)

    def forget(self, key: bytes) -> None:
        """Drop an entry from memory only (its file was found missing: another node deleted it)."""
        with self._lock:
            self._live.pop(key, None)

    def _apply(self, rec: IndexRecord) -> None:
        if rec.op == OP_PUT:
            self._live[rec.key] = rec.file_size
        elif rec.op == OP_DEL:
            self._live.pop(rec.key, None)

    def refresh(self) -> list[IndexRecord]:
        """Read what other writers appended since the last look; returns the new records (for eviction
        bookkeeping). Cheap when nothing changed: one directory listing and one read per log."""
        new: list[IndexRecord] = []
        for name in self._log_names():
            if name == self._own_name:
                continue
            start = self._tails.get(name, 0)
            try:
                with open(self.folder / name, "rb") as f:
                    f.seek(start)
                    data = f.read()
            except FileNotFoundError:
                continue
            whole = len(data) // _REC_BYTES * _REC_BYTES
            recs = list(_decode_log(data[:whole]))
            self._tails[name] = start + len(recs) * _REC_BYTES
            new += recs
        new.sort(key=lambda r: r.time_ns)
        with self._lock:
            for rec in new:
                self._apply(rec)
        return new

    def close(self) -> None:
        """Stop appending and mark the log closed so the next open may compact it."""
        with self._lock:
            fd, self._own_fd = self._own_fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, self._own_size)  # the unused reserve goes
        except OSError:
            pass
        os.close(fd)
        own = self.folder / self._own_name
        try:
            if self._own_size == 0 or own.stat().st_size == 0:
                own.unlink()
            else:
                own.rename(own.with_suffix(".closed"))
        except FileNotFoundError:
            pass

    # -- loading and compaction -----------------------------------------------------------------------------
    def _log_names(self) -> list[str]:
        try:
            return sorted(n for n in os.listdir(self.folder) if n.startswith("log-") and n.endswith((".log", ".closed")))
        except FileNotFoundError:
            return []

    def _read_snapshot(self) -> tuple[dict[bytes, int], set[str]]:
        path = self.folder / "snapshot.idx"
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}, set()
        if len(data) < _SNAP_HEAD.size + 8:
            raise ValueError(f"{path}: truncated snapshot")
        magic, count, _t, names_len = _SNAP_HEAD.unpack_from(data)
        body_end = len(data) - 8
        if magic != _SNAP_MAGIC or xxhash.xxh3_64_intdigest(data[:body_end]) != int.from_bytes(data[body_end:], "little"):
            raise ValueError(f"{path}: bad snapshot checksum")
        off = _SNAP_HEAD.size
        if names_len > body_end - off or count > (body_end - off - names_len) // _SNAP_DTYPE.itemsize:
            raise ValueError(f"{path}: sizes in the header go past the end of the file")
        covered = set(data[off : off + names_len].decode().split("\n")) - {""}
        off += names_len
        arr = np.frombuffer(data, dtype=_SNAP_DTYPE, count=count, offset=off)
        if count and (int(arr["klen"].min()) == 0 or int(arr["klen"].max()) > 64):
            raise ValueError(f"{path}: key length out of range")
        sizes = arr["size"].tolist()
        klens = arr["klen"].tolist()
        keys = arr["key"].tolist()  # numpy strips trailing NULs: re-pad to the stored length
        live = {k.ljust(n, b"\0"): s for k, n, s in zip(keys, klens, sizes)}
        return live, covered

    def _load(self) -> None:
        try:
            live, covered = self._read_snapshot()
        except ValueError:
            live, covered = {}, set()  # a damaged snapshot only costs the entries it held (a cache, re-written later)
        self._live = live
        recs: list[IndexRecord] = []
        for name in self._log_names():
            if name in covered:
                continue
            try:
                data = (self.folder / name).read_bytes()
            except FileNotFoundError:
                continue
            whole = len(data) // _REC_BYTES * _REC_BYTES
            got = list(_decode_log(data[:whole]))
            self._tails[name] = len(got) * _REC_BYTES
            recs += got
        recs.sort(key=lambda r: r.time_ns)
        for rec in recs:
            self._apply(rec)

    def _closed_log(self, name: str) -> bool:
        if name.endswith(".closed"):
            return True
        # log-<node>-<pid>-<rand>.log of this node whose process is gone: a crashed writer.
        parts = name[4:-4].rsplit("-", 2)
        if len(parts) == 3 and parts[0] == self.node_id and parts[1].isdigit():
            return not pid_alive(int(parts[1]))
        return False

    def _compact(self) -> None:
        lock_path = self.folder / "compact.lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # someone else is compacting; their snapshot will do
            try:
                live, covered = self._read_snapshot()
            except ValueError:
                live, covered = {}, set()
            names = self._log_names()
            for name in names:  # logs a crash left behind after they were merged
                if name in covered:
                    (self.folder / name).unlink(missing_ok=True)
            closed = [n for n in names if n not in covered and self._closed_log(n)]
            if not closed:
                return
            recs: list[IndexRecord] = []
            for name in closed:
                data = (self.folder / name).read_bytes()
                recs += _decode_log(data[: len(data) // _REC_BYTES * _REC_BYTES])
            recs.sort(key=lambda r: r.time_ns)
            for rec in recs:
                if rec.op == OP_PUT:
                    live[rec.key] = rec.file_size
                else:
                    live.pop(rec.key, None)
            try:
                self._write_snapshot(live, set(closed))
            except OSError as exc:  # a full or failing tier must still open: compaction is only an optimisation
                log.warning("index %s: compaction skipped: %s", self.folder, exc.strerror or exc)
                return
            for name in closed:
                (self.folder / name).unlink(missing_ok=True)
            self.compacted_logs = len(closed)
        finally:
            os.close(fd)

    def _write_snapshot(self, live: dict[bytes, int], covered: set[str]) -> None:
        arr = np.zeros(len(live), dtype=_SNAP_DTYPE)
        if live:
            keys = list(live)
            arr["key"] = keys
            arr["klen"] = [len(k) for k in keys]
            arr["size"] = list(live.values())
        names = "\n".join(sorted(covered)).encode()
        body = _SNAP_HEAD.pack(_SNAP_MAGIC, len(live), time.time_ns(), len(names)) + names + arr.tobytes()
        tmp = self.folder / f"snapshot.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        try:
            self._write_file(tmp, body)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, self.folder / "snapshot.idx")

    @staticmethod
    def _write_file(tmp: Path, body: bytes) -> None:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(body)
            f.write(xxhash.xxh3_64_intdigest(body).to_bytes(8, "little"))
            f.flush()
            os.fsync(f.fileno())
