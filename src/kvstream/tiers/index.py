"""The persistent index of a directory tier: which chunk files exist, how big they are, and which node owns them.

Why a log and a snapshot, not a scan: a tier of a million chunks on a parallel file system cannot be reopened
with a ``stat`` per chunk (minutes on Lustre). Instead each open writer appends fixed-size records to its own
log, ``index/log-<uid>-<token>.log`` (one writer per file: appends from several nodes to one file are not
atomic on shared file systems; ``uid`` is the node's persistent id, ``token`` this open's, see
:mod:`kvstream.tiers.lease`), and each node compacts its own closed logs into its own snapshot,
``index/<uid>.snapshot.idx``. Reopening reads the snapshots and the logs they do not cover: a few hundred MB at
most, parsed with numpy. Design and reasons for many writers: docs/shared-tier.md.

Record (96 bytes, little-endian): magic ``KVI2`` | op u8 (1 put, 2 delete) | key_len u8 | 2 pad | file_size u64
| gen u64 | key 64s | 4 pad | xxh32 of the preceding 88 bytes. ``gen`` is drawn at random for each put; a
delete names the gen it deletes. So records need no clock: a key is listed while some put's gen has no delete,
whatever order the logs of different nodes are read in (a delete read before its put is held back, bounded,
and cancels the put when it comes). A node's own put/delete order is its log order. Logs of older versions
(magic ``KVIX``, a wall-clock time where the gen is) are still read: their deletes delete every gen of the key,
applied in time order before the new logs.
A torn last record (crash mid-append) fails its checksum and is ignored.

Space for the log is reserved ahead (``posix_fallocate``, ``_RESERVE_BYTES`` at a time, zero-filled) and records
are written at the log's own offset, so that a full file system does not cost the record that says a chunk was
evicted to make room: an eviction frees space, but a concurrent chunk write can take it before the delete
record is appended. Readers stop at the first record whose magic is wrong, so the zeroed reserve (and a crash
that leaves it) reads as the end of the log; ``close()`` cuts the reserve off.

Compaction (at open): only of this node's own logs that are closed (renamed ``.closed`` by ``close()``, or whose
writer's lease is gone: a crashed process of this node), merged into this node's snapshot, published by
rename, which lists the logs it covers. No node deletes another node's logs (``flock`` does not work across
clients of GlusterFS or CephFS, so two nodes must never write one file). A peer whose logs were compacted sees
the snapshot change (its name, inode, size or mtime) on its next :meth:`TierIndex.refresh` and reloads
everything; deletes of other nodes' gens that the merge cannot cancel are kept in the snapshot as tombstones.
Reads of a log are keyed by its stem, so a ``.log`` renamed ``.closed`` is not read again from byte 0.

Covered logs are **not** deleted by the compaction that covers them: a peer's GlusterFS client may list neither
the new snapshot nor the deleted log for about a second, and a peer that reloads then misses every chunk they
held (the two-node restart test: 3 of 6 runs). They are deleted by a later compaction, once the snapshot that
covers them is ``COVERED_LOG_GRACE_S`` old by the tier's clock (our lease's fresh mtime against the snapshot's).
No record is ever counted twice: a reader skips every log named in the covered list of the snapshot *it read*
(at load and at every refresh), and a snapshot's covered list names every log whose records it holds for as
long as that log may still be listed: logs carried over from the previous snapshot stay named until a
compaction finds them gone (listing and ``stat``) with the previous snapshot past the grace, and logs deleted
by this compaction stay named in the snapshot it writes. A reader that sees the old snapshot (or none) reads
the kept logs instead: the same records, once. (Replaying a covered log over a snapshot would bring back puts
that a later, compacted log deleted, and an older-style delete would remove newer listings of its key.)

Compaction temporaries (``snapshot.<uid>-<token>.<rand>.tmp``, left by a process killed mid-compaction) are
removed at open by this node only, and only its own: those whose writer's lease is gone (for this node's
leases, its lock is free), or, for names without a token (older versions), older than the lease expiry.

Truth is the files: the index is a hint. A listed file that is gone reads as a miss (and the entry is dropped);
a file published but not yet logged (crash between rename and append) is invisible until its key is written
again, when the first-publish-wins link finds it. ``kvstream verify`` reports both.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import re
import secrets
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from kvstream.tiers.lease import LEASE_EXPIRY_S, Lease, new_token
from kvstream.tiers.private import mkdir_private

log = logging.getLogger("kvstream.index")

__all__ = ["TierIndex", "IndexRecord", "OP_PUT", "OP_DEL", "log_owner", "SNAPSHOT_SUFFIX", "COVERED_LOG_GRACE_S"]

OP_PUT = 1
OP_DEL = 2
_REC = struct.Struct("<4sBBxxQQ64s4x")
_REC_BYTES = _REC.size + 4  # + xxh32
_RESERVE_BYTES = 512 * _REC_BYTES  # 48 KiB: a few hundred records of a full disk's evictions
_MAGIC = b"KVIX"  # records of older versions: a wall-clock time where the gen is
_MAGIC2 = b"KVI2"
_SNAP_MAGIC = b"KVIXSNP1"  # the one shared snapshot of older versions (read, never written)
_SNAP_HEAD = struct.Struct("<8sQQI")  # magic, entries, time_ns, covered-names bytes
_SNAP_DTYPE = np.dtype([("size", "<u8"), ("klen", "u1"), ("key", "S64")])
_SNAP2_MAGIC = b"KVIXSNP2"
_SNAP2_HEAD = struct.Struct("<8sQQI")  # magic, entries, tombstones, covered-names bytes
_SNAP2_DTYPE = np.dtype([("size", "<u8"), ("gen", "<u8"), ("klen", "u1"), ("key", "S64")])
_TOMB_DTYPE = np.dtype([("gen", "<u8"), ("klen", "u1"), ("key", "S64")])
SNAPSHOT_SUFFIX = ".snapshot.idx"  # <uid>.snapshot.idx: one per node, written by that node only
_LEGACY_SNAPSHOT = "snapshot.idx"
_LOG_RE = re.compile(r"^log-([0-9a-f]{16})-([0-9a-f]{8})\.(log|closed)$")
_MAX_EARLY_DELETES = 1 << 16  # deletes read before their put (another node's log read first): held back
_MAX_TOMBSTONES = 1 << 20  # deletes of other nodes' gens kept by a snapshot (84 B each)
COVERED_LOG_GRACE_S = 10.0  # a covered log is deleted once its snapshot is this old (peers have seen it)
_SNAP_TMP_RE = re.compile(r"^snapshot\.([0-9a-f]{16})(?:-([0-9a-f]{8}))?\.[0-9a-f]+\.tmp$")  # uid[-token].rand
_LOG_DTYPE = np.dtype([("magic", "S4"), ("op", "u1"), ("klen", "u1"), ("pad", "V2"), ("size", "<u8"),
                       ("time", "<u8"), ("key", "V64"), ("pad2", "V4"), ("sum", "<u4")])
assert _LOG_DTYPE.itemsize == _REC_BYTES


@dataclass(frozen=True, slots=True)
class IndexRecord:
    op: int  # OP_PUT | OP_DEL
    key: bytes
    file_size: int  # bytes of the chunk file (puts)
    time_ns: int  # older records only (0 in new ones): their order across logs
    gen: int = 0  # new records: the put's random id, which its delete names; 0: an older record


def _encode(rec: IndexRecord) -> bytes:
    if rec.gen:
        body = _REC.pack(_MAGIC2, rec.op, len(rec.key), rec.file_size, rec.gen, rec.key)
    else:
        body = _REC.pack(_MAGIC, rec.op, len(rec.key), rec.file_size, rec.time_ns, rec.key)
    return body + xxhash.xxh32_intdigest(body).to_bytes(4, "little")


def log_owner(name: str) -> tuple[str, str] | None:
    """(uid, token) of a log written by this version, None for an older log (or not a log name)."""
    m = _LOG_RE.match(name)
    return (m.group(1), m.group(2)) if m else None


def _read_fresh(path: Path, start: int = 0) -> bytes:
    """A log or snapshot from ``start`` to its end, not from this client's page cache. A log's writer
    overwrites the zeros it reserved ahead (``posix_fallocate``), so the file's size does not change when a
    record lands and a FUSE client (ceph-fuse, GlusterFS) keeps serving the zeros it cached at an earlier read.
    Every index read goes through here, compaction's above all: it deletes the logs it merged, so a record it
    missed is gone for good (the two-node GlusterFS soak lost 107 acknowledged chunks in 45 s, all put by
    processes later killed, until compaction read their logs this way; 0 after)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            pass  # no page cache to drop, or no fadvise: the read below is what the file system gives
        chunks: list[bytes] = []
        off = start
        while True:
            b = os.pread(fd, 1 << 20, off)
            if not b:
                return b"".join(chunks)
            chunks.append(b)
            off += len(b)
    finally:
        os.close(fd)


def _stem(name: str) -> str:
    """A log's name without ``.log``/``.closed``: the same log before and after ``close()`` renames it."""
    return name.rsplit(".", 1)[0]


@dataclass(slots=True)
class LogScan:
    """What one read of a log holds: its valid ``records`` in order; ``end``, the offset just past the last of
    them (where the next read of a growing log starts); ``damaged``, bytes skipped *between* valid records (a bit
    flip, a zeroed hole, foreign bytes: damage, never a torn tail); ``holes``, where each damaged stretch began
    and how long it was; ``tail_junk``, bytes after ``end`` that are not zeros (a torn last record)."""

    records: list[IndexRecord]
    end: int = 0
    damaged: int = 0
    holes: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    tail_junk: int = 0

    @property
    def damaged_records(self) -> int:
        return -(-self.damaged // _REC_BYTES)


def _decode_at(raw: memoryview, off: int) -> IndexRecord | None:
    """The record at byte ``off`` if it is a valid one (magic, checksum, fields), else None."""
    body = raw[off : off + _REC.size]
    if len(body) < _REC.size or bytes(body[:4]) not in (_MAGIC, _MAGIC2):
        return None
    if xxhash.xxh32_intdigest(body) != int.from_bytes(raw[off + _REC.size : off + _REC_BYTES], "little"):
        return None
    magic, op, klen, size, t, key = _REC.unpack_from(raw, off)
    if op not in (OP_PUT, OP_DEL) or not 0 < klen <= 64:  # checksummed but not ours: foreign
        return None
    if magic == _MAGIC2:
        if t == 0:  # a new record always has a gen: checksummed but not ours
            return None
        return IndexRecord(op, key[:klen], size, 0, t)
    return IndexRecord(op, key[:klen], size, t)


def _next_magic(data: bytes, start: int) -> int:
    hits = [i for i in (data.find(_MAGIC2, start), data.find(_MAGIC, start)) if i >= 0]
    return min(hits) if hits else -1


def _scan_log(data: bytes, *, resync_zeros: bool = True, whole: bool = False) -> LogScan:
    """Every valid record of a log, resyncing past damage: a record that fails its checksum (or is foreign)
    mid-log no longer hides every record after it (a bit flip hid 139 of 200 chunks, silently). After a bad
    record the scan moves to the next place a record's magic appears (aligned or not: bytes inserted or lost
    shift the rest) and takes the first valid record from there.

    Zeros are the end of what a writer has written (its reserve, or a crash) unless valid records follow them;
    ``resync_zeros=False`` (a log whose writer is alive, read while it grows) stops at zeros instead: a network
    file system's client may serve zeros it cached for a stretch another client has written since, with fresh
    records after it, and skipping that stretch would lose its records for good (it is read again next time).
    ``whole=True``: a closed log, whose writer cut its reserve off at ``close()``; anything after its last valid
    record (zeros included) is damage too, not a tail still being written.
    Never raises; sizes come only from the data itself."""
    raw = memoryview(data)
    n = len(data)
    out = LogScan([])
    off = 0
    gap: int | None = None  # where the current damaged stretch began
    while off + _REC_BYTES <= n:
        rec = _decode_at(raw, off)
        if rec is not None:
            if gap is not None:
                out.damaged += off - gap
                out.holes.append((gap, off - gap))
                gap = None
            out.records.append(rec)
            off += _REC_BYTES
            out.end = off
            continue
        if gap is None:
            if not resync_zeros and not raw[off : off + _REC_BYTES].tobytes().strip(b"\0"):
                break
            gap = off
        nxt = _next_magic(data, off + 1)
        if nxt < 0:
            break
        off = nxt
    rest = data[out.end :]
    if whole and rest:
        out.damaged += len(rest)
        out.holes.append((out.end, len(rest)))
    else:
        out.tail_junk = len(rest) if rest.strip(b"\0") else 0
    return out


def _decode_log(data: bytes) -> Iterator[IndexRecord]:
    """Valid records of a log, skipping damaged ones (:func:`_scan_log`); never raises."""
    yield from _scan_log(data).records


@dataclass(slots=True)
class _Snapshot:
    """A parsed snapshot: listings (key, gen, size), tombstones (key, gen) and the log names it covers."""

    entries: list[tuple[bytes, int, int]]
    tombs: list[tuple[bytes, int]]
    covered: set[str]


def _parse_snapshot(data: bytes, where: str) -> _Snapshot:
    """Either snapshot format; raises ``ValueError`` naming ``where`` on anything damaged. Sizes read from
    the file are checked against its length before any array is built on them."""
    if len(data) < _SNAP_HEAD.size + 8:
        raise ValueError(f"{where}: truncated snapshot")
    magic, count, second, names_len = _SNAP_HEAD.unpack_from(data)
    body_end = len(data) - 8
    if magic not in (_SNAP_MAGIC, _SNAP2_MAGIC) or \
            xxhash.xxh3_64_intdigest(data[:body_end]) != int.from_bytes(data[body_end:], "little"):
        raise ValueError(f"{where}: bad snapshot checksum")
    v2 = magic == _SNAP2_MAGIC
    dtype = _SNAP2_DTYPE if v2 else _SNAP_DTYPE
    tomb_count = second if v2 else 0
    off = _SNAP_HEAD.size
    room = body_end - off - names_len
    if names_len > body_end - off or count > room // dtype.itemsize or \
            tomb_count > (room - count * dtype.itemsize) // _TOMB_DTYPE.itemsize:
        raise ValueError(f"{where}: sizes in the header go past the end of the file")
    covered = set(data[off : off + names_len].decode(errors="replace").split("\n")) - {""}
    off += names_len
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=off)
    if count and (int(arr["klen"].min()) == 0 or int(arr["klen"].max()) > 64):
        raise ValueError(f"{where}: key length out of range")
    keys = [k.ljust(n, b"\0") for k, n in zip(arr["key"].tolist(), arr["klen"].tolist())]  # numpy strips NULs
    gens = arr["gen"].tolist() if v2 else [0] * count
    entries = list(zip(keys, gens, arr["size"].tolist()))
    tombs: list[tuple[bytes, int]] = []
    if tomb_count:
        t = np.frombuffer(data, dtype=_TOMB_DTYPE, count=tomb_count, offset=off + count * dtype.itemsize)
        if int(t["klen"].min()) == 0 or int(t["klen"].max()) > 64:
            raise ValueError(f"{where}: key length out of range")
        tombs = [(k.ljust(n, b"\0"), g) for k, n, g in zip(t["key"].tolist(), t["klen"].tolist(), t["gen"].tolist())]
    return _Snapshot(entries, tombs, covered)


class TierIndex:
    """The live set of one tier: key -> file size in bytes, each listing with its gen and owning node.
    Thread-safe.

    Invariants: ``_live`` and ``_gens`` have the same keys and no ``_gens[k]`` is empty (gen -> owner uid;
    gen 0 and owner ``""`` for entries of older versions). A key is one node's (its quota, its eviction) iff
    one of its gens was put by that node. Only this node's records go to our log, and only our own logs are
    ever compacted or deleted by us."""

    def __init__(self, folder: Path, *, node_id: str, writable: bool = True, node_uid: str | None = None,
                 lease_expiry_s: float = LEASE_EXPIRY_S, covered_grace_s: float = COVERED_LOG_GRACE_S,
                 load: bool = True) -> None:
        """``writable``: hold a lease, compact, and append to a log of our own; else only read. ``load=False``
        (with ``writable=False``): an empty index that never touched the folder (a tier that is down)."""
        self.folder = folder
        self.node_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in node_id)[:40] or "node"
        # Used alone (tests, tools) without a persisted id, the label stands in for it, hashed to the id's form.
        self.uid = node_uid or xxhash.xxh64_hexdigest(self.node_id.encode())
        self._lock = threading.Lock()
        self._live: dict[bytes, int] = {}
        self._gens: dict[bytes, dict[int, str]] = {}
        self._early: dict[tuple[bytes, int], None] = {}  # deletes read before their put (bounded, oldest out)
        self._tails: dict[str, int] = {}  # logs read: stem -> bytes consumed (a rename to .closed keeps it)
        self._snap_seen: dict[str, tuple[int, int, int]] | None = {}  # snapshot -> (inode, size, mtime_ns) loaded
        self._covered: set[str] = set()  # logs the snapshots we loaded cover: their records are in, never read
        self.covered_grace_s = covered_grace_s
        token = new_token()
        self._own_name = f"log-{self.uid}-{token}.log"
        self.lease = Lease(folder, self.uid, token, label=self.node_id, expiry_s=lease_expiry_s)
        self._own_fd: int | None = None
        self.writable = writable
        self.load_seconds = 0.0
        self.compacted_logs = 0
        self.deleted_covered_logs = 0  # covered logs this open's compaction deleted (see the module docstring)
        self.removed_temporaries = 0  # compaction temporaries of dead writers this open removed
        self.reloads = 0  # full reloads after a snapshot changed or a log vanished (see refresh)
        self.load_retries = 0  # loads listed again because a file vanished under them (see _load)
        self.append_errors = 0  # records that could not be appended to our log (see _append)
        self._holes: dict[tuple[str, int], int] = {}  # (log stem, offset) -> bytes of damage found there
        self.damaged_snapshots: set[str] = set()  # snapshots that failed their checks at the last load
        self._own_size = 0  # bytes of whole records in our log; the reserve beyond it is zeros
        self._reserved = 0  # bytes allocated to our log (>= _own_size when reservation works)
        t0 = time.perf_counter()
        if writable:
            mkdir_private(folder)
            self.lease.start()  # before our log exists: a log without a live lease is a dead writer's
            try:
                self._compact()
                with self._lock:
                    self._load()
                self._own_fd = os.open(folder / self._own_name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except BaseException:
                self.lease.close()
                raise
            self._reserve()
        elif load:
            with self._lock:
                self._load()
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

    def owners(self, key: bytes) -> set[str]:
        """Node ids whose puts list ``key`` (``""``: an entry of an older version, nobody's)."""
        with self._lock:
            return set(self._gens.get(key, {}).values())

    def owned(self, key: bytes) -> bool:
        """True if this node put one of the key's listings (the key counts against this node's quota)."""
        with self._lock:
            return self.uid in self._gens.get(key, {}).values()

    # -- updates --------------------------------------------------------------------------------------------
    def record(self, op: int, key: bytes, file_size: int = 0) -> None:
        """Apply and append: a put after the file is published (a new gen, this node's), or a delete after the
        file is unlinked (one record per gen listed for the key, whoever put it: the name is gone for all)."""
        with self._lock:
            if op == OP_PUT:
                recs = [IndexRecord(OP_PUT, key, file_size, 0, secrets.randbits(64) or 1)]
            else:  # a gen-0 listing (older version) is deleted by an older-style record: all its gens
                recs = [IndexRecord(OP_DEL, key, 0, 0 if g else time.time_ns(), g) for g in self._gens.get(key, {})]
            for rec in recs:
                self._apply(rec, self.uid)
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
            self._gens.pop(key, None)

    def _apply(self, rec: IndexRecord, owner: str) -> None:
        """Apply one record of ``owner``'s log. Called with ``_lock`` held (or on a state not yet shared)."""
        key = rec.key
        if rec.op == OP_PUT:
            if rec.gen and (key, rec.gen) in self._early:  # its delete was read first (another log)
                del self._early[(key, rec.gen)]
                return
            self._gens.setdefault(key, {})[rec.gen] = owner
            self._live[key] = rec.file_size
        elif rec.op == OP_DEL:
            gens = self._gens.get(key)
            if rec.gen and (gens is None or rec.gen not in gens):
                self._early[(key, rec.gen)] = None
                if len(self._early) > _MAX_EARLY_DELETES:
                    del self._early[next(iter(self._early))]
                return
            if gens is not None and rec.gen:
                del gens[rec.gen]
            if not rec.gen or not gens:  # an older-style delete removes every listing of the key
                self._gens.pop(key, None)
                self._live.pop(key, None)

    def refresh(self) -> list[IndexRecord]:
        """Read what other writers appended since the last look; returns the new records (for eviction
        bookkeeping). Cheap when nothing changed: one directory listing, a stat per snapshot and one read per
        log. If a snapshot changed or a log vanished before we read all of it (a peer compacted), the whole
        index is reloaded instead (``reloads`` counts it) and nothing is returned: callers then resync."""
        logs, snaps = self._listing()
        if self._stamps(snaps) != self._snap_seen:
            self._reload()
            return []
        legacy: list[IndexRecord] = []
        new: list[tuple[str, list[IndexRecord]]] = []
        live: dict[str, str] | None = None
        for name in logs:
            if name == self._own_name or name in self._covered:  # a covered log's records came with its snapshot
                continue
            if live is None:
                live = self.lease.live()
            stem = _stem(name)
            start = self._tails.get(stem, 0)
            try:
                data = _read_fresh(self.folder / name, start)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ESTALE):  # compacted (or renamed) under us: reload
                    self._reload()
                    return []
                continue  # an unreadable log is a failing tier: its reads report that; try again next time
            scan = _scan_log(data, resync_zeros=self._finished(name, live), whole=name.endswith(".closed"))
            self._note_damage(name, scan, start)
            recs = scan.records
            self._tails[stem] = start + scan.end
            owner = log_owner(name)
            if owner is None:
                legacy += recs
            else:
                new.append((owner[0], recs))
        legacy.sort(key=lambda r: r.time_ns)
        with self._lock:
            for rec in legacy:
                self._apply(rec, "")
            for uid, recs in new:
                for rec in recs:
                    self._apply(rec, uid)
        return legacy + [r for _, recs in new for r in recs]

    def _finished(self, name: str, live: dict[str, str]) -> bool:
        """True if no live writer appends to log ``name`` (closed, or its writer's lease is gone): zeros in it
        are then damage, not a stretch not visible yet (see :func:`_scan_log`)."""
        owner = log_owner(name)
        return name.endswith(".closed") or owner is None or f"{owner[0]}-{owner[1]}" not in live

    def _note_damage(self, name: str, scan: LogScan, start: int) -> None:
        """Count and warn (once per stretch) about damage found mid-log."""
        stem = _stem(name)
        for off, length in scan.holes:
            hole = (stem, start + off)
            if hole in self._holes:
                continue
            self._holes[hole] = length
            log.warning("index %s: %s: %d B of damaged records at byte %d (skipped; the records after them are "
                        "read); `kvstream verify` reports it, `--repair` relists chunks a lost record hid",
                        self.folder, name, length, start + off)

    @property
    def damaged_records(self) -> int:
        """Index records found damaged mid-log so far (each stretch counted once), a counter."""
        return sum(-(-n // _REC_BYTES) for n in self._holes.values())

    @property
    def damaged(self) -> bool:
        """The last load met a damaged snapshot or a damaged log record: puts may be lost, chunk files may be
        unlisted (orphans) until the index is rebuilt from the files."""
        return bool(self.damaged_snapshots or self._holes)

    def own_damage(self) -> bool:
        """Damage was found in this node's own snapshot or logs (which only this node may rewrite)."""
        return f"{self.uid}{SNAPSHOT_SUFFIX}" in self.damaged_snapshots or any(
            (o := log_owner(stem + ".log")) is not None and o[0] == self.uid for stem, _off in self._holes)

    def set_aside_snapshot(self, name: str, dest: Path) -> bool:
        """Move this node's damaged snapshot ``name`` out of the index folder into ``dest`` (kept for
        inspection), once a second read after a pause confirms the damage (a network file system's client can
        serve a stale copy that fails its checksum for a moment). True if moved. Its entries are then listed
        again from the logs it covered (still there, read since it is gone) and the chunk files (the caller
        relists orphans); this node's next compaction writes a new snapshot."""
        if not name.startswith(self.uid):
            return False  # another node's: never ours to move (`kvstream verify --repair` does)
        path = self.folder / name
        time.sleep(0.2)
        try:
            _parse_snapshot(_read_fresh(path), name)
            return False  # reads fine now: it was a stale copy
        except FileNotFoundError:
            return False
        except (OSError, ValueError):
            pass
        mkdir_private(dest)
        try:
            os.rename(path, dest / f"{name}.{int(time.time())}.damaged")
        except OSError as exc:
            log.warning("index %s: cannot move the damaged snapshot %s aside: %s", self.folder, name, exc.strerror)
            return False
        self.damaged_snapshots.discard(name)
        log.warning("index %s: damaged snapshot %s moved to %s; rebuilt from the logs and the chunk files",
                    self.folder, name, dest)
        return True

    def compact_now(self) -> None:
        """Compact (as at open) and reload: after a damaged snapshot was set aside, a new one is written."""
        self._compact()
        self._reload()

    def _reload(self) -> None:
        with self._lock:
            self._load()
        self.reloads += 1

    def close(self) -> None:
        """Stop appending, mark the log closed so this node's next open may compact it, then give up the lease
        (in that order: a log without a live lease is a finished one)."""
        with self._lock:
            fd, self._own_fd = self._own_fd, None
        if fd is None:
            self.lease.close()
            return
        try:
            os.ftruncate(fd, self._own_size)  # the unused reserve goes
        except OSError:
            pass
        try:
            os.close(fd)
        except OSError:
            pass
        own = self.folder / self._own_name
        try:
            if self._own_size == 0 or own.stat().st_size == 0:
                own.unlink()
            else:
                own.rename(own.with_suffix(".closed"))
        except OSError:
            pass  # a failing tier: the log stays .log, and its lease expiry marks it closed
        self.lease.close()

    # -- loading and compaction -----------------------------------------------------------------------------
    def _listing(self) -> tuple[list[str], list[str]]:
        """(log names, snapshot names) in the index folder, sorted."""
        try:
            names = sorted(os.listdir(self.folder))
        except OSError:
            return [], []
        logs = [n for n in names if n.startswith("log-") and n.endswith((".log", ".closed"))]
        snaps = [n for n in names if n == _LEGACY_SNAPSHOT or n.endswith(SNAPSHOT_SUFFIX)]
        return logs, snaps

    def _log_names(self) -> list[str]:
        return self._listing()[0]

    def _stamps(self, snaps: list[str]) -> dict[str, tuple[int, int, int]]:
        out: dict[str, tuple[int, int, int]] = {}
        for name in snaps:
            try:
                st = os.stat(self.folder / name)
            except OSError:
                continue
            out[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return out

    def _read_snapshot(self, path: Path | None = None) -> tuple[dict[bytes, int], set[str]]:
        """(key -> size, covered log names) of one snapshot (default: the older versions' ``snapshot.idx``);
        empty if there is none. Raises ``ValueError`` if it is damaged."""
        path = path or self.folder / _LEGACY_SNAPSHOT
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return {}, set()
        snap = _parse_snapshot(data, str(path))
        return {k: size for k, _g, size in snap.entries}, snap.covered

    def _load(self) -> None:
        """Rebuild the live set from every snapshot and every log no snapshot covers. Puts go first, then
        deletes: a delete names its put's gen, so the order in which nodes' logs are read does not matter.
        Called with ``_lock`` held (or before the index is shared).

        A peer that closes (``.log`` renamed ``.closed``) or compacts (snapshot published, logs deleted) between
        our listing and our reads would make a log or snapshot vanish under us, and its records with it: a peer's
        chunks unlisted here until the next reload (the two-node suite saw 0 of a restarting node's 16 chunks).
        So a load that meets a vanished file lists and loads again, after a pause that doubles (GlusterFS's client
        can list a deleted log, and miss the snapshot that replaced it, for up to about a second): at most ~1.6 s,
        and only when a peer closes or compacts; then it keeps what it read."""
        for pause in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
            if pause:
                self.load_retries += 1
                time.sleep(pause)
            if self._load_once():
                return

    def _load_once(self) -> bool:
        """One listing and load; False if a file listed was gone when read (see :meth:`_load`)."""
        whole_view = True
        logs, snaps = self._listing()
        self._snap_seen = self._stamps(snaps)  # before reading: a change while we read shows next time
        self._live, self._gens, self._early, self._tails = {}, {}, {}, {}
        covered: set[str] = set()
        self._covered = covered  # filled below, as each snapshot is read: refresh() must skip the same logs
        dels: list[tuple[IndexRecord, str]] = []
        live: dict[str, str] | None = None
        self.damaged_snapshots = set()
        for name in snaps:
            try:
                snap = _parse_snapshot(_read_fresh(self.folder / name), name)
            except OSError as exc:
                whole_view = whole_view and exc.errno not in (errno.ENOENT, errno.ESTALE)
                continue
            except ValueError as exc:
                # Its entries are lost to this load; the logs it covered are read instead (its covered list is
                # unknown). Its owner replaces it at open (rebuilt from its logs and the chunk files:
                # DirectoryTier._rebuild), `kvstream verify --repair` moves it aside.
                self.damaged_snapshots.add(name)
                log.warning("index %s: %s", self.folder, exc)
                continue
            owner = "" if name == _LEGACY_SNAPSHOT else name[: -len(SNAPSHOT_SUFFIX)]
            covered |= snap.covered
            for key, gen, size in snap.entries:
                self._apply(IndexRecord(OP_PUT, key, size, 0, gen), owner)
            dels += [(IndexRecord(OP_DEL, key, 0, 0, gen), owner) for key, gen in snap.tombs if gen]
        legacy: list[IndexRecord] = []
        for name in logs:
            if name in covered:
                continue
            try:
                data = _read_fresh(self.folder / name)
            except OSError as exc:
                whole_view = whole_view and exc.errno not in (errno.ENOENT, errno.ESTALE)
                continue
            if live is None:
                live = self.lease.live()
            scan = _scan_log(data, resync_zeros=self._finished(name, live), whole=name.endswith(".closed"))
            self._note_damage(name, scan, 0)
            got = scan.records
            self._tails[_stem(name)] = scan.end
            writer = log_owner(name)
            if writer is None:
                legacy += got
                continue
            for rec in got:
                if rec.op == OP_PUT or not rec.gen:
                    self._apply(rec, writer[0])
                else:
                    dels.append((rec, writer[0]))
        legacy.sort(key=lambda r: r.time_ns)
        for rec in legacy:
            self._apply(rec, "")
        for rec, owner in dels:
            self._apply(rec, owner)
        return whole_view

    def _compact(self) -> None:
        """Remove this node's dead compaction temporaries, then merge its closed logs into its own snapshot (and
        delete the logs an earlier snapshot covers, once past the grace). Best effort (an optimisation): any
        failure leaves the logs, which are then simply read at open."""
        try:
            fd = os.open(self.folder / f"{self.uid}.compact.lock", os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    return  # another process of this node is compacting; its snapshot will do
                # No flock here (ENOLCK, EOPNOTSUPP): only this node's own processes could race on this file.
            self._clean_compaction_tmp()
            self._compact_locked()
        except OSError as exc:  # a full or failing tier must still open: compaction is only an optimisation
            log.warning("index %s: compaction skipped: %s", self.folder, exc.strerror or exc)
        finally:
            os.close(fd)

    def _clean_compaction_tmp(self) -> None:
        """Remove this node's compaction temporaries whose writer is gone (a process killed mid-compaction):
        by the lease rules (:mod:`kvstream.tiers.lease`), a temporary whose ``uid-token`` has no live lease (this
        node's leases: judged by their lock at once; without flock, by the expiry), or one without a token
        (older versions) older than the expiry. Never another node's, never a live writer's."""
        try:
            names = [n for n in os.listdir(self.folder) if n.startswith("snapshot.") and n.endswith(".tmp")]
        except OSError:
            return
        mine = [(n, m.group(2)) for n in names if (m := _SNAP_TMP_RE.match(n)) is not None and m.group(1) == self.uid]
        if not mine:
            return
        live = self.lease.live()
        now = self.lease.reference()
        for name, token in mine:
            if token is not None:
                stale = f"{self.uid}-{token}" not in live
            else:
                try:
                    stale = now - os.stat(self.folder / name).st_mtime > self.lease.expiry_s
                except OSError:
                    continue
            if stale:
                try:
                    os.unlink(self.folder / name)
                    self.removed_temporaries += 1
                except OSError:
                    pass

    def _compact_locked(self) -> None:
        snap_path = self.folder / f"{self.uid}{SNAPSHOT_SUFFIX}"
        # The new snapshot replaces the old one, so it must hold everything the old one did: compact only on
        # top of a snapshot read whole, or of one that is really not there. A snapshot that cannot be read now
        # (GlusterFS: a spurious ENOENT, or a stale copy that fails its checksum, right after another process of
        # this node replaced it) means "not now", never "empty": replacing it with the new logs alone lost every
        # chunk it listed (the two-node soak: 118 acknowledged chunks in 5 minutes, files on disk, listed by
        # nobody). Its logs stay and are read at open meanwhile; `kvstream verify` reports a damaged one.
        snap_mtime: float | None = None
        try:
            snap = _parse_snapshot(_read_fresh(snap_path), str(snap_path))
            snap_mtime = os.stat(snap_path).st_mtime
        except FileNotFoundError:
            if snap_path.name in os.listdir(self.folder):
                return  # listed but not found: a stale lookup; compact next time
            snap = _Snapshot([], [], set())
        except (OSError, ValueError) as exc:
            log.warning("index %s: snapshot %s unreadable (%s); compaction skipped", self.folder, snap_path.name, exc)
            return
        logs = self._listing()[0]
        mine = [(n, o) for n in logs if (o := log_owner(n)) is not None and o[0] == self.uid]
        listed = {n for n, _o in mine}
        # Logs the snapshot covers: kept (and named) until peers have had time to see the snapshot; then deleted,
        # and still named in the snapshot written now. A covered name whose log is gone (listing and stat agree)
        # is dropped only past the grace too: it was deleted by an earlier compaction, before that snapshot.
        past_grace = snap_mtime is not None and self.lease.reference() - snap_mtime >= self.covered_grace_s
        carried: set[str] = set()
        for name in sorted(snap.covered):
            present = name in listed or (self.folder / name).exists()
            if present and past_grace:
                try:
                    (self.folder / name).unlink()
                    self.deleted_covered_logs += 1
                except OSError:
                    pass  # gone already, or still there: either way named again below, tried again next time
            if present or not past_grace:
                carried.add(name)
        live: dict[str, str] | None = None
        closed: list[str] = []
        for name, (_uid, token) in mine:
            if name in snap.covered or name == self._own_name:
                continue
            if not name.endswith(".closed"):
                live = self.lease.live() if live is None else live
                if f"{self.uid}-{token}" in live:
                    continue  # another process of this node is writing it
            closed.append(name)
        if not closed:
            return  # the snapshot stays as it is: it still names every log it covers
        entries = {(k, g): size for k, g, size in snap.entries}
        tombs = dict.fromkeys(snap.tombs)
        for name in closed:
            scan = _scan_log(_read_fresh(self.folder / name), whole=name.endswith(".closed"))
            self._note_damage(name, scan, 0)
            for rec in scan.records:
                if rec.op == OP_PUT:
                    entries[(rec.key, rec.gen)] = rec.file_size
                elif not rec.gen:  # an older-style delete: every listing of ours; nothing to keep for others
                    for kg in [kg for kg in entries if kg[0] == rec.key]:
                        del entries[kg]
                elif (rec.key, rec.gen) in entries:
                    del entries[(rec.key, rec.gen)]
                else:  # another node's listing: kept so that whoever loads its put also loads this delete
                    tombs[(rec.key, rec.gen)] = None
        while len(tombs) > _MAX_TOMBSTONES:
            del tombs[next(iter(tombs))]
        # The logs merged now are kept (see the module docstring): a later compaction deletes them.
        self._write_snapshot(entries, set(closed) | carried, tombs=list(tombs), path=snap_path)
        self.compacted_logs = len(closed)

    def _write_snapshot(self, live: dict[bytes, int] | dict[tuple[bytes, int], int], covered: set[str], *,
                        tombs: list[tuple[bytes, int]] | None = None, path: Path | None = None) -> None:
        """Publish a snapshot (by rename) at ``path`` (default the older versions' name). ``live`` maps
        (key, gen) -> size, or key -> size for listings without a gen."""
        rows = [((k, 0) if isinstance(k, bytes) else k, size) for k, size in live.items()]
        arr = np.zeros(len(rows), dtype=_SNAP2_DTYPE)
        if rows:
            arr["key"] = [k for (k, _g), _s in rows]
            arr["klen"] = [len(k) for (k, _g), _s in rows]
            arr["gen"] = [g for (_k, g), _s in rows]
            arr["size"] = [s for _kg, s in rows]
        tombs = tombs or []
        t = np.zeros(len(tombs), dtype=_TOMB_DTYPE)
        if tombs:
            t["key"] = [k for k, _g in tombs]
            t["klen"] = [len(k) for k, _g in tombs]
            t["gen"] = [g for _k, g in tombs]
        names = "\n".join(sorted(covered)).encode()
        body = _SNAP2_HEAD.pack(_SNAP2_MAGIC, len(rows), len(tombs), len(names)) + names + arr.tobytes() + t.tobytes()
        path = path or self.folder / _LEGACY_SNAPSHOT
        tmp = self.folder / f"snapshot.{self.uid}-{self.lease.token}.{secrets.token_hex(4)}.tmp"
        try:
            self._write_file(tmp, body)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        os.replace(tmp, path)
    @staticmethod
    def _write_file(tmp: Path, body: bytes) -> None:
        with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(body)
            f.write(xxhash.xxh3_64_intdigest(body).to_bytes(8, "little"))
            f.flush()
            os.fsync(f.fileno())
