"""A directory tier: one file per chunk under a folder (node-local NVMe or a shared file system alike).

Layout under the tier's folder::

    KVSTREAM_TIER            marker (format version); a folder without it is initialised on first open
    chunks/ab/cd/<hex>.kvc   one chunk (see kvstream.format), fan-out by the key's first two bytes
    tmp/                     files being written: <hex>.<node>.<pid>.<rand>.tmp, same file system as chunks/
    index/                   the persistent index (kvstream.tiers.index)
    quarantine/              chunks that failed verification, kept for inspection, never read again

Publishing is atomic and first-wins: the chunk is written to ``tmp/``, then ``link()``-ed to its final name,
which fails with EEXIST if any process or node published the key first (same key, same bytes: that copy is as
good as ours), and the temporary is unlinked. So a reader sees either no file or a whole one, never a torn one.
Where ``link`` is not supported (some FUSE file systems) ``rename`` is used, which replaces an identical file.

Capacity is enforced on this node's view of the tier: before a write is published space is reserved, and the
tier's eviction policy (LRU by default) picks files to delete until the reservation fits.
Files are created mode 0600 and folders 0700: a shared file system is readable by other jobs.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.config import TierConfig
from kvstream.errors import ConfigError, TierError
from kvstream.eviction import EvictionPolicy, eviction_options, make_eviction_policy
from kvstream.io.buffers import ALIGN, AlignedBuffer
from kvstream.io.engine import IOEngine, Ring
from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex, pid_alive

__all__ = ["DirectoryTier", "TierCounters", "MARKER"]

log = logging.getLogger("kvstream.tier")

MARKER = "KVSTREAM_TIER"
_MARKER_TEXT = "kvstream tier, chunk format 1\n"
_TMP_MAX_AGE_S = 3600.0  # temporaries of other nodes older than this are crash leftovers


@dataclass
class TierCounters:
    """Cumulative per-tier figures (read by ``Store.stats()`` and the Prometheus exporter)."""

    read_bytes: int = 0
    read_chunks: int = 0
    read_busy_s: float = 0.0  # wall time with at least one read of this tier in flight
    duplicate_chunks: int = 0
    read_errors: int = 0
    corrupt_chunks: int = 0
    missing_files: int = 0
    write_bytes: int = 0
    write_chunks: int = 0
    write_errors: int = 0
    write_skipped_full: int = 0  # copies not written because the disk was full even after eviction
    write_skipped_unhealthy: int = 0  # copies not written because the tier's circuit breaker was open
    write_skipped_backlog: int = 0  # second copies not written because the tier's write backlog was full
    write_retried_nospace: int = 0  # writes retried after ENOSPC/EDQUOT, once room was made by eviction
    already_present: int = 0  # publishes that found the key published first
    evicted_chunks: int = 0
    evicted_bytes: int = 0
    latencies: list[float] = field(default_factory=list, repr=False)  # recent per-chunk read latencies (s)

    def note_latency(self, seconds: float) -> None:
        lat = self.latencies
        lat.append(seconds)
        if len(lat) > 4096:
            del lat[:2048]


def _write_private(path: Path, data: bytes) -> None:
    """Create (or replace) a small file readable by its owner only, whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


class DirectoryTier:
    """One tier folder: layout, index, capacity, atomic publish, and its read and write rings."""

    def __init__(self, cfg: TierConfig, *, index: int, engine: IOEngine, node_id: str, create: bool,
                 field_prefix: str) -> None:
        self.cfg = cfg
        self.name = cfg.name
        self.position = index  # index in the store's tier list (0 = primary)
        self.root = Path(cfg.path)
        self._field = field_prefix
        self._check_folder(create)
        for sub in ("chunks", "tmp", "index", "quarantine"):
            (self.root / sub).mkdir(mode=0o700, exist_ok=True)
        marker = self.root / MARKER
        if not marker.exists():
            _write_private(marker, _MARKER_TEXT.encode())
        else:
            self._check_marker(marker)
        self.node_id = node_id
        self.direct = self._probe_direct()
        self._open_flags_read = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        self._open_flags_write = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        self.removed_temporaries = self._clean_tmp()
        self.index = TierIndex(self.root / "index", node_id=node_id)
        try:
            self.policy: EvictionPolicy = make_eviction_policy(cfg.eviction, **eviction_options(cfg.eviction, cfg.capacity_bytes))
        except KeyError as exc:
            raise ConfigError(f"{field_prefix}.eviction", str(exc).strip('"')) from None
        for key, size in self.index.items():
            self.policy.on_insert(key, size)
        self._lock = threading.Lock()
        self._dropping: set[bytes] = set()  # keys whose delete record is being logged (see drop)
        self._used = sum(size for _, size in self.index.items())
        self._reserved = 0
        self._made_dirs: set[str] = set()
        self._link_ok = True
        self.counters = TierCounters()
        self.read_ring: Ring = engine.ring(f"{cfg.name}-r", depth=cfg.read_depth, max_bytes=cfg.read_inflight_bytes)
        self.write_ring: Ring = engine.ring(f"{cfg.name}-w", depth=cfg.write_depth, max_bytes=cfg.write_inflight_bytes)
        self._last_refresh = time.monotonic()

    # -- opening --------------------------------------------------------------------------------------------
    def _check_folder(self, create: bool) -> None:
        f = f"{self._field}.path"
        if not self.root.exists():
            if not create:
                raise ConfigError(f, f"folder {self.root} does not exist (create it, or set create_dirs: true)")
            try:
                # exist_ok: two nodes (or processes) opening a new shared tier at once both get here
                self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as exc:
                raise ConfigError(f, f"cannot create {self.root}: {exc.strerror}") from None
        if not self.root.is_dir():
            raise ConfigError(f, f"{self.root} is not a folder")
        probe = self.root / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f, f"folder {self.root} is not writable: {exc.strerror}") from None

    def _check_marker(self, marker: Path) -> None:
        """Warn (once, at open) if the folder was made by another chunk format: its chunks will fail
        verification and be quarantined one by one, never returned."""
        try:
            text = marker.read_text(errors="replace")
        except OSError as exc:
            log.warning("tier %s: cannot read %s: %s", self.name, marker, exc.strerror)
            return
        if text != _MARKER_TEXT:
            log.warning("tier %s: %s says %r, this build writes %r; chunks that do not verify will be ignored",
                        self.name, marker, text.strip()[:80], _MARKER_TEXT.strip())

    def _probe_direct(self) -> bool:
        mode = self.cfg.direct_io
        if mode == "off":
            return False
        probe = self.root / "tmp" / f".direct-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
        except OSError as exc:
            if mode == "on":
                raise ConfigError(f"{self._field}.direct_io",
                                  f"O_DIRECT refused by the file system at {self.root}: {exc.strerror}") from None
            log.warning("tier %s: O_DIRECT not supported at %s (%s); using buffered I/O", self.name, self.root,
                        exc.strerror)
            return False
        try:
            buf = AlignedBuffer(ALIGN)
            os.pwritev(fd, [buf.view()], 0)
            return True
        except OSError as exc:
            if mode == "on":
                raise ConfigError(f"{self._field}.direct_io", f"O_DIRECT write failed at {self.root}: {exc.strerror}") from None
            return False
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _clean_tmp(self) -> int:
        """Remove temporaries left by crashed writers: this node's dead pids, anyone's older than an hour."""
        removed = 0
        tmp = self.root / "tmp"
        now = time.time()
        for entry in os.scandir(tmp):
            parts = entry.name.split(".")
            stale = False
            if len(parts) >= 5 and parts[-1] == "tmp" and parts[1] == self.node_id and parts[2].isdigit():
                pid = int(parts[2])
                stale = pid != os.getpid() and not pid_alive(pid)
            if not stale:
                try:
                    stale = now - entry.stat().st_mtime > _TMP_MAX_AGE_S
                except FileNotFoundError:
                    continue
            if stale:
                try:
                    os.unlink(entry.path)
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

    # -- naming ---------------------------------------------------------------------------------------------
    @staticmethod
    def relpath(key: bytes) -> str:
        """Where a key lives, relative to the tier folder. Hex only: no key can name a path outside it."""
        h = key.hex()
        return f"chunks/{h[:2]}/{h[2:4]}/{h}.kvc"

    def path_for(self, key: bytes) -> Path:
        return self.root / self.relpath(key)

    # -- queries --------------------------------------------------------------------------------------------
    def contains(self, key: bytes) -> bool:
        return key in self.index

    def file_size(self, key: bytes) -> int | None:
        return self.index.get(key)

    @property
    def used_bytes(self) -> int:
        return self._used

    def maybe_refresh(self, min_interval_s: float = 1.0) -> None:
        """On a shared tier, pick up other nodes' puts and deletes (at most once per interval)."""
        if not self.cfg.shared:
            return
        now = time.monotonic()
        if now - self._last_refresh < min_interval_s:
            return
        self._last_refresh = now
        for rec in self.index.refresh():
            with self._lock:
                if rec.op == OP_PUT:
                    self.policy.on_insert(rec.key, rec.file_size)
                else:
                    self.policy.on_remove(rec.key)
                self._used = self.index.total_bytes()

    # -- reads ----------------------------------------------------------------------------------------------
    def open_for_read(self, key: bytes) -> tuple[int, int] | None:
        """(fd, file size) for a read of the whole chunk file, or None if the tier does not have it.

        Opened with ``O_NONBLOCK`` and checked to be a regular file: a FIFO or device planted at a chunk path
        would otherwise block the open (or the read) forever; it is quarantined and the chunk is a miss here.
        This call may still block on slow metadata (a network file system, a throttled device): the reader runs
        it on the tier's open threads, off the step's lock, so the hedge deadline covers it.

        Raises :class:`TierError` if the tier cannot open it (I/O error, the tier folder vanished): the file
        may be intact, so the key is kept; the caller reads another replica and counts a tier failure."""
        size = self.index.get(key)
        if size is None:
            return None
        try:
            fd = self._open_regular(key)
        except FileNotFoundError:
            if not self.present():  # the whole tier is gone (unmounted): a tier failure, not a lost file
                self.counters.read_errors += 1
                raise TierError(self.name, "open", errno.ENOENT, f"tier folder {self.root} has vanished") from None
            self.counters.missing_files += 1
            self.drop(key, unlink=False)
            return None
        except OSError as exc:  # EIO reading a directory block, EACCES, ESTALE: the tier fails, the file may be fine
            if self._not_a_file(key):  # a FIFO or device at the path (O_DIRECT refuses those): not the tier's fault
                return None
            self.counters.read_errors += 1
            raise TierError(self.name, "open", exc.errno, f"{self.relpath(key)}: {exc.strerror}") from None
        if fd is None:
            self.quarantine(key, "not a regular file")
            return None
        return fd, size

    def open_ahead(self, key: bytes) -> tuple[int, int] | None:
        """Like :meth:`open_for_read` for a read that may never be issued (opened early, off the I/O path):
        None on any failure, counting nothing; the read proper then opens the file itself and reports."""
        size = self.index.get(key)
        if size is None:
            return None
        try:
            fd = self._open_regular(key)
        except OSError:
            return None
        return None if fd is None else (fd, size)

    def _open_regular(self, key: bytes) -> int | None:
        """A descriptor for reading the chunk file (``O_NONBLOCK``: a FIFO cannot block the open), or None if
        what sits at the path is not a regular file. Raises ``OSError`` if it cannot be opened."""
        fd = os.open(self.path_for(key), self._open_flags_read | os.O_NONBLOCK)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                return fd
        except OSError:
            os.close(fd)
            raise
        os.close(fd)
        return None

    def _not_a_file(self, key: bytes) -> bool:
        """True (and the entry quarantined) if something other than a regular file sits at the chunk's path."""
        try:
            mode = os.lstat(self.path_for(key)).st_mode
        except OSError:
            return False
        if stat.S_ISREG(mode):
            return False
        self.quarantine(key, "not a regular file")
        return True

    def present(self) -> bool:
        """True while the tier folder is still this tier (its marker is there: not unmounted or replaced)."""
        return os.path.exists(self.root / MARKER)

    def on_hit(self, key: bytes) -> None:
        with self._lock:
            self.policy.on_access(key)

    # -- writes ---------------------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` by evicting; False if the chunk can never fit."""
        if nbytes > self.cfg.capacity_bytes:
            return False
        victims: list[tuple[bytes, int]] = []
        with self._lock:
            while self._used + self._reserved + nbytes > self.cfg.capacity_bytes:
                key = self.policy.victim()
                if key is None:
                    break
                self.policy.on_remove(key)
                size = self.index.get(key) or 0
                self._used -= size
                self._dropping.add(key)
                victims.append((key, size))
            fits = self._used + self._reserved + nbytes <= self.cfg.capacity_bytes
            if fits:
                self._reserved += nbytes
        self._evict(victims)
        return fits

    def _evict(self, victims: list[tuple[bytes, int]]) -> None:
        """Unlink and log evicted chunks (already taken out of the policy and ``_used``, and in ``_dropping``
        so a concurrent drop does not count them again)."""
        for key, size in victims:
            try:
                self._delete_file(key)
                self.index.record(OP_DEL, key)
            finally:
                with self._lock:
                    self._dropping.discard(key)
            self.counters.evicted_chunks += 1
            self.counters.evicted_bytes += size

    def make_room(self, nbytes: int) -> int:
        """Evict this tier's chunks (eviction policy order) until ``nbytes`` are freed, whatever the capacity
        says: the file system ran out of space first (ENOSPC/EDQUOT: other users). Returns bytes freed."""
        victims: list[tuple[bytes, int]] = []
        freed = 0
        with self._lock:
            while freed < nbytes:
                key = self.policy.victim()
                if key is None:
                    break
                self.policy.on_remove(key)
                size = self.index.get(key) or 0
                self._used -= size
                freed += size
                self._dropping.add(key)
                victims.append((key, size))
        self._evict(victims)
        return freed

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def create_temp(self, key: bytes) -> tuple[int, str]:
        """Open a new temporary for ``key``; returns (fd, path)."""
        name = f"{key.hex()}.{self.node_id}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        path = str(self.root / "tmp" / name)
        fd = os.open(path, self._open_flags_write, 0o600)
        return fd, path

    def publish(self, key: bytes, tmp_path: str, file_size: int) -> bool:
        """Make a fully written temporary visible under the key's name. Returns False if another writer had
        already published the key (its copy is kept, ours dropped). Called with the space reserved."""
        final = self.path_for(key)
        d = os.path.dirname(final)
        if d not in self._made_dirs:
            os.makedirs(os.path.dirname(d), mode=0o700, exist_ok=True)  # makedirs gives `mode` to the leaf only
            os.makedirs(d, mode=0o700, exist_ok=True)
            self._made_dirs.add(d)
        won = True
        try:
            if self._link_ok:
                try:
                    os.link(tmp_path, final)
                except FileExistsError:
                    won = False
                except OSError as exc:
                    if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                        raise
                    self._link_ok = False  # this file system has no hard links: rename (replaces identical bytes)
            if not self._link_ok:
                os.rename(tmp_path, final)
        finally:
            try:
                os.unlink(tmp_path)
            except FileNotFoundError:
                pass
        with self._lock:
            self._reserved -= file_size
            known = key in self.index
            if not known:
                self._used += file_size
                self.policy.on_insert(key, file_size)
        if not won:
            self.counters.already_present += 1
        if not known:
            self.index.record(OP_PUT, key, file_size)
        return won

    # -- removal --------------------------------------------------------------------------------------------
    def _delete_file(self, key: bytes) -> None:
        try:
            os.unlink(self.path_for(key))
        except FileNotFoundError:
            pass

    def drop(self, key: bytes, *, unlink: bool = True) -> None:
        """Remove a key from this tier (its file too, unless it is already gone)."""
        with self._lock:
            # The delete record is logged after the unlink (crash order), outside the lock: until it is, the key
            # is still in the index, so a second drop of it (two removes, a remove racing a quarantine) must not
            # count it again.
            busy = key in self._dropping  # another thread is dropping it: that thread unlinks and logs
            known = key in self.index and not busy
            if known:
                self._dropping.add(key)
                self.policy.on_remove(key)
                self._used -= self.index.get(key) or 0
        if not known:
            if unlink and not busy:
                self._delete_file(key)  # a file the index does not list (as before: drop means "gone")
            return
        try:
            if unlink:
                self._delete_file(key)
            self.index.record(OP_DEL, key)
        finally:
            with self._lock:
                self._dropping.discard(key)

    def quarantine(self, key: bytes, reason: str) -> None:
        """Move a chunk that failed verification out of the way (kept for inspection) and forget it."""
        src = self.path_for(key)
        dst = self.root / "quarantine" / f"{key.hex()}.{int(time.time())}.kvc"
        try:
            os.rename(src, dst)
            _write_private(self.root / "quarantine" / (dst.name + ".why"), (reason + "\n").encode())
        except OSError:
            self._delete_file(key)
        self.counters.corrupt_chunks += 1
        self.drop(key, unlink=False)
        log.warning("tier %s: quarantined chunk %s: %s", self.name, key.hex(), reason)

    def close(self) -> None:
        self.write_ring.close()
        self.read_ring.close()
        self.index.close()

