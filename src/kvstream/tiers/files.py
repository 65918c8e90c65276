"""A directory tier: one file per chunk under a folder (node-local NVMe or a shared file system alike).

Layout under the tier's folder::

    KVSTREAM_TIER            marker (format version); a folder without it is initialised on first open
    chunks/ab/cd/<hex>.kvc   one chunk (see kvstream.format), fan-out by the key's first two bytes
    tmp/                     files being written: <hex>.<uid>-<token>.<rand>.tmp, same file system as chunks/
                             (uid: the node's persistent id, token: its writer's lease; see tiers/lease.py)
    index/                   the persistent index (kvstream.tiers.index)
    quarantine/              chunks that failed verification, kept for inspection, never read again

Publishing is atomic and first-wins: the chunk is written to ``tmp/``, then ``link()``-ed to its final name,
which fails with EEXIST if any process or node published the key first (same key, same bytes: that copy is as
good as ours), and the temporary is unlinked. So a reader sees either no file or a whole one, never a torn one.
Where ``link`` is not supported (some FUSE file systems) ``rename`` is used, which replaces an identical file.

Capacity is enforced on this node's own chunks: on a ``shared`` tier it is a per-node quota, and the eviction
policy (LRU by default) only ever picks chunks this node published, plus those of nodes whose lease has expired
(nobody else will evict them). Other nodes' chunks are read, never counted or evicted. A read that finds no file
(ENOENT) or a stale handle (ESTALE: a peer deleted it) is a miss, not a tier failure. Many writers on one tier:
docs/shared-tier.md.
Files are created mode 0600 and folders 0700: a shared file system is readable by other jobs.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstream.config import TierConfig
from kvstream.errors import CONFIG_ERRNOS, GONE, WRITE_RETRY, ConfigError, TierError, TierUnavailable
from kvstream.eviction import EvictionPolicy, eviction_options, make_eviction_policy
from kvstream.io.buffers import ALIGN, AlignedBuffer
from kvstream.io.engine import IOEngine, Ring
from kvstream.tiers.contract import TierCapabilities
from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex
from kvstream.tiers.mounts import mount_problem
from kvstream.tiers.pins import Pins
from kvstream.tiers.private import mkdir_private
from kvstream.tiers.rebuild import valid_unlisted
from kvstream.tiers.recheck import read_size

__all__ = ["DirectoryTier", "TierCounters", "MARKER"]

log = logging.getLogger("kvstream.tier")

MARKER = "KVSTREAM_TIER"
_MARKER_TEXT = "kvstream tier, chunk format 1\n"
_TMP_MAX_AGE_S = 3600.0  # temporaries of older versions (no lease in their name) older than this are leftovers
TMP_RE = re.compile(r"^[0-9a-f]+\.([0-9a-f]{16})-([0-9a-f]{8})\.[0-9a-f]+\.tmp$")  # key.uid-token.rand.tmp
_GONE = GONE  # the name (or the file under a handle) is not there: a miss, not a fault (errors.py, errno rules)
_LINK_TRIES = 4


@dataclass
class TierCounters:
    """Cumulative per-tier figures (read by ``Store.stats()`` and the Prometheus exporter)."""

    read_bytes: int = 0
    read_chunks: int = 0
    read_busy_s: float = 0.0  # wall time with at least one read of this tier in flight
    duplicate_chunks: int = 0
    read_errors: int = 0
    corrupt_chunks: int = 0  # quarantined: failed verification twice (the read, then a re-read of the file)
    read_retried: int = 0  # reads that failed verification and were read again before any verdict
    read_transient: int = 0  # ... whose re-read verified: a fault on the way, the file intact and kept
    missing_files: int = 0
    write_bytes: int = 0
    write_busy_s: float = 0.0  # wall time with at least one copy handed to the tier's writer and not finished
    write_chunks: int = 0
    write_errors: int = 0
    write_skipped_full: int = 0  # copies not written because the disk was full even after eviction
    write_skipped_unhealthy: int = 0  # copies not written because the tier's circuit breaker was open
    write_skipped_backlog: int = 0  # second copies not written because the tier's write backlog was full
    write_retried_nospace: int = 0  # writes retried after ENOSPC/EDQUOT, once room was made by eviction
    already_present: int = 0  # publishes that found the key published first
    write_retried_stale: int = 0  # writes retried once after ESTALE (a peer's delete or a re-created folder)
    write_refused_pinned: int = 0  # copies refused: only evicting pinned chunks would have made room
    publish_conflicts: int = 0  # links that won although another writer's file held the name (GlusterFS)
    orphans_listed: int = 0  # published files a killed writer never logged, listed from its temporary at open
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
    """One tier folder: layout, index, capacity, atomic publish, and its read and write rings. Implements
    :class:`kvstream.tiers.contract.FileTier` (conformance: ``tests/contract/test_directory_tier.py``)."""

    def __init__(self, cfg: TierConfig, *, index: int, engine: IOEngine, node_id: str, create: bool,
                 field_prefix: str, node_uid: str | None = None, pins: Pins | None = None, down: str = "") -> None:
        """Open (or create) the tier folder. Raises :class:`ConfigError` naming ``<field_prefix>.path`` if the
        configuration is wrong, and its subclass :class:`TierUnavailable` if the tier's file system is failing
        or absent (full, read-only, dead, not mounted): the store may then open without it. ``down`` (the
        reason): build the tier as down instead, touching nothing on disk (see ``Store``)."""
        self.cfg = cfg
        self.name = cfg.name
        self.position = index  # index in the store's tier list (0 = primary)
        self.root = Path(cfg.path)
        self._field = field_prefix
        self.node_id = node_id
        self.down = down  # why the tier could not be opened ("" while up): never read, written or probed
        self.counters = TierCounters()
        self.relisted_chunks = 0
        self.removed_temporaries = 0
        if down:
            self.direct = False
            self.index = TierIndex(self.root / "index", node_id=node_id, node_uid=node_uid, writable=False, load=False)
        else:
            self._open_files(create, node_uid)
        self._open_flags_read = os.O_RDONLY | (os.O_DIRECT if self.direct else 0)
        self._open_flags_write = os.O_WRONLY | os.O_CREAT | os.O_EXCL | (os.O_DIRECT if self.direct else 0)
        try:
            self.policy: EvictionPolicy = make_eviction_policy(cfg.eviction, **eviction_options(cfg.eviction, cfg.capacity_bytes))
        except KeyError as exc:
            self.index.close()
            raise ConfigError(f"{field_prefix}.eviction", str(exc).strip('"')) from None
        self._lock = threading.Lock()
        self._dropping: set[bytes] = set()  # keys whose delete record is being logged (see drop)
        # Invariant: the policy holds exactly the keys of _own and _adopted that are not in _held; _held is the
        # keys of _own and _adopted that are pinned (kept out of the policy, so never a victim); _used is the
        # sum of _own's sizes (pinned ones included: they still take room).
        self._own: dict[bytes, int] = {}  # this node's chunks: counted against capacity (its quota here)
        self._adopted: set[bytes] = set()  # chunks of nodes with no live lease: evictable, not counted
        self.pins = pins if pins is not None else Pins()
        self._held: set[bytes] = set()
        self._used = 0
        self._live_uids: set[str] | None = None  # nodes with a live lease at the last look (shared tiers)
        if not down:
            self._resync()
        self._reserved = 0
        self._made_dirs: set[str] = set()
        self._link_ok = True
        self.read_ring: Ring = engine.ring(f"{cfg.name}-r", depth=cfg.read_depth, max_bytes=cfg.read_inflight_bytes)
        self.write_ring: Ring = engine.ring(f"{cfg.name}-w", depth=cfg.write_depth, max_bytes=cfg.write_inflight_bytes)
        self._last_refresh = time.monotonic()

    def _open_files(self, create: bool, node_uid: str | None) -> None:
        """Everything opening does on disk: the folder (checked, or created), its layout and marker, the O_DIRECT
        probe, the index (and a rebuild from the files if it is damaged), leftover temporaries. Any ``OSError``
        becomes a ConfigError (a configuration to fix) or a TierUnavailable (a failing file system)."""
        try:
            self._check_folder(create)
            for sub in ("chunks", "tmp", "index", "quarantine"):
                (self.root / sub).mkdir(mode=0o700, exist_ok=True)
            marker = self.root / MARKER
            if not marker.exists():
                _write_private(marker, _MARKER_TEXT.encode())
            else:
                self._check_marker(marker)
            self.direct = self._probe_direct()
            self.index = TierIndex(self.root / "index", node_id=self.node_id, node_uid=node_uid)
        except OSError as exc:
            raise self._open_error(exc, f"{self.root}") from None
        try:
            self.relisted_chunks = self._rebuild() if self.index.damaged else 0
            self.removed_temporaries = self._clean_tmp()  # after the index: it judges writers by their leases
        except OSError as exc:
            self.index.close()
            raise self._open_error(exc, f"{self.root}") from None

    def _open_error(self, exc: OSError, what: str) -> ConfigError:
        """A ConfigError naming the tier's path for an ``OSError`` met while opening: a TierUnavailable unless
        the errno says the configuration is wrong (permissions, not a folder: ``errors.CONFIG_ERRNOS``)."""
        f = f"{self._field}.path"
        msg = f"{what}: {exc.strerror or exc}"
        if exc.errno in CONFIG_ERRNOS:
            return ConfigError(f, msg)
        return TierUnavailable(f, msg + " (the tier's file system is failing: full, read-only, dead or gone?)",
                               err=exc.errno)

    # -- opening --------------------------------------------------------------------------------------------
    def _check_folder(self, create: bool) -> None:
        """The folder exists (or is created) on the file system it must be on, and is writable. Raises
        ConfigError / TierUnavailable (``unmounted``) naming ``<field>.path``; ``OSError`` from the probe."""
        f = f"{self._field}.path"
        require = self.cfg.shared if self.cfg.require_mount is None else self.cfg.require_mount
        why = mount_problem(self.root, require_mount=require, mount_point=self.cfg.mount_point)
        if why is not None:  # checked before anything is created: never a folder under an unmounted mount point
            raise TierUnavailable(f, why, unmounted=True)
        if not self.root.exists():
            if not create:
                raise ConfigError(f, f"folder {self.root} does not exist (create it, or set create_dirs: true)")
            try:
                # exist_ok: two nodes (or processes) opening a new shared tier at once both get here
                mkdir_private(self.root)
            except OSError as exc:
                raise self._open_error(exc, f"cannot create {self.root}") from None
        if not self.root.is_dir():
            raise ConfigError(f, f"{self.root} is not a folder")
        probe = self.root / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            os.close(fd)
            probe.unlink()
        except OSError as exc:
            raise self._open_error(exc, f"folder {self.root} is not writable") from None

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

    def _rebuild(self) -> int:
        """The index met damage at load (a damaged snapshot, damaged log records): puts may be lost and valid
        chunk files unlisted. Rebuild what this node may: set its own damaged snapshot aside (its next
        compaction, run now, writes a new one) and list again every whole chunk file no index lists
        (:mod:`kvstream.tiers.rebuild`). On a shared tier only damage in this node's own index files is
        rebuilt here (each node rewrites only its own); damage in a peer's is a warning for its owner's next
        open or ``kvstream verify --repair``. Returns the chunks listed again."""
        idx = self.index
        if self.cfg.shared and not idx.own_damage():
            log.warning("tier %s: damaged index files of other nodes (%s; %d damaged log records): their owners "
                        "rebuild them at their next open, or run `kvstream verify --repair %s`", self.name,
                        ", ".join(sorted(idx.damaged_snapshots)) or "no snapshot", idx.damaged_records, self.root)
            return 0
        moved = False
        for name in sorted(idx.damaged_snapshots):
            moved = idx.set_aside_snapshot(name, self.root / "quarantine") or moved
        young = 0.0
        if self.cfg.shared and idx.lease.live_uids() - {idx.uid}:
            young = idx.lease.expiry_s  # a live peer's publish may not be logged yet: leave young files alone
        n = 0
        for key, size in valid_unlisted(self.root, idx, limit=self.cfg.capacity_bytes, young_s=young):
            idx.record(OP_PUT, key, size)
            n += 1
        if moved:
            idx.compact_now()
        log.warning("tier %s: the index was damaged (%d damaged log records, snapshot(s) %s); rebuilt from the "
                    "chunk files: %d chunk(s) listed again", self.name, idx.damaged_records,
                    ", ".join(sorted(idx.damaged_snapshots)) or "fine", n)
        return n

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
        """Remove temporaries whose writer is gone: the lease their name carries (``uid-token``) is not live
        and the file is older than the lease expiry (a new lease may take a moment to show on another client).
        Never a live writer's, whatever node or PID namespace it runs in; temporaries of older versions (no
        lease in the name) once they are an hour old."""
        removed = 0
        tmp = self.root / "tmp"
        lease = self.index.lease
        live = lease.live()
        now = lease.reference()  # the tier's clock, as mtimes are stamped: no trust in ours
        for entry in os.scandir(tmp):
            m = TMP_RE.match(entry.name)
            try:
                age = now - entry.stat().st_mtime
            except OSError:
                continue
            if m:
                # this node's writers are judged by their lease's lock at once (see tiers/lease.py); others'
                # only once the temporary is older than the expiry too
                stale = f"{m.group(1)}-{m.group(2)}" not in live and (m.group(1) == lease.uid or age > lease.expiry_s)
            else:
                stale = age > _TMP_MAX_AGE_S
            if stale:
                if m:
                    self._list_orphan(entry.name.split(".", 1)[0], entry.path)
                try:
                    os.unlink(entry.path)
                    removed += 1
                except OSError:
                    pass
        return removed

    def _list_orphan(self, key_hex: str, tmp_path: str) -> None:
        """A dead writer's temporary that is also the chunk file under the key's name (the same inode: its link
        won, and the writer was killed before the put was logged, see :meth:`publish`): list the chunk as this
        node's, so that it counts against this node's quota and can be evicted, instead of sitting on disk
        outside every quota until ``kvstream verify --repair``."""
        try:
            key = bytes.fromhex(key_hex)
            tmp_st = os.stat(tmp_path)
            st = os.stat(self.path_for(key))
        except (OSError, ValueError):
            return
        if (st.st_ino, st.st_dev) != (tmp_st.st_ino, tmp_st.st_dev) or key in self.index:
            return
        self.index.record(OP_PUT, key, st.st_size)
        self.counters.orphans_listed += 1

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

    @property
    def capacity_bytes(self) -> int:
        """This node's quota on the tier (``TierConfig.capacity_bytes``)."""
        return self.cfg.capacity_bytes

    @property
    def capabilities(self) -> TierCapabilities:
        """Real files (O_DIRECT where the probe at open found it works), durable (chunks and the index are files),
        shared if configured so, pins honoured (:meth:`hold`)."""
        return TierCapabilities(modelled=False, direct_io=self.direct, shared=self.cfg.shared, durable=True,
                                pins=True)

    def maybe_refresh(self, min_interval_s: float = 1.0) -> None:
        """On a shared tier, pick up other nodes' puts and deletes (at most once per interval), and which nodes
        are alive (their chunks become evictable here when their lease expires)."""
        if not self.cfg.shared or self.down:
            return
        now = time.monotonic()
        if now - self._last_refresh < min_interval_s:
            return
        self._last_refresh = now
        reloads = self.index.reloads
        recs = self.index.refresh()
        live = self.index.lease.live_uids()
        if self.index.reloads != reloads or live != self._live_uids:
            self._live_uids = live
            self._resync()
            return
        for key in dict.fromkeys(r.key for r in recs):
            self._sync(key)

    def _resync(self) -> None:
        """Rebuild the policy's membership and ``_used`` from the index (at open, after a reload, when the
        set of live nodes changed)."""
        if self.cfg.shared and self._live_uids is None:
            self._live_uids = self.index.lease.live_uids()
        with self._lock:
            keys = set(self._own) | self._adopted
        for key, _size in self.index.items():
            keys.add(key)
        for key in keys:
            self._sync(key)

    def _sync(self, key: bytes) -> None:
        """Bring one key's place (own: counted and evictable; adopted: evictable; neither) in line with the
        index. On a tier that is not shared every listed chunk is this node's."""
        size = self.index.get(key)
        if size is None:
            mine = adopt = False
        elif not self.cfg.shared:
            mine, adopt = True, False
        else:
            owners = self.index.owners(key)
            mine = self.index.uid in owners
            adopt = not mine and not (owners & (self._live_uids or set()))
        with self._lock:
            if key in self._dropping:
                return  # a drop of ours is logging its delete: it does the bookkeeping
            in_policy = (key in self._own or key in self._adopted) and key not in self._held
            if key in self._own:
                self._used -= self._own.pop(key)
            self._adopted.discard(key)
            if mine:
                self._own[key] = size  # type: ignore[assignment]
                self._used += size  # type: ignore[operator]
            elif adopt:
                self._adopted.add(key)
            member = mine or adopt
            held = member and self.pins.pinned(key)
            if held:
                self._held.add(key)
            else:
                self._held.discard(key)
            if member and not held and not in_policy:
                self.policy.on_insert(key, size)  # type: ignore[arg-type]
            elif (not member or held) and in_policy:
                self.policy.on_remove(key)

    # -- pins -----------------------------------------------------------------------------------------------
    def hold(self, key: bytes) -> bool:
        """The key is pinned (its count in :attr:`pins` is above zero): take it out of the eviction policy.
        True if this tier now holds the chunk safe from eviction; False if it does not hold it, or if an
        eviction, remove or quarantine of it is already under way (taken before the pin: it goes)."""
        with self._lock:
            if key in self._dropping or not self.pins.pinned(key):
                return False
            if key in self._own or key in self._adopted:
                if key not in self._held:
                    self._held.add(key)
                    self.policy.on_remove(key)
                return True
            return key in self.index  # listed, but another live node's: never evicted here anyway

    def release(self, key: bytes) -> None:
        """The key's last pin went: it may be evicted again (it re-enters the policy as just used)."""
        with self._lock:
            if key in self._held and not self.pins.pinned(key):
                self._held.discard(key)
                size = self._own.get(key, self.index.get(key) or 0)
                self.policy.on_insert(key, size)

    def pinned_count(self) -> int:
        """Chunks of this tier kept out of eviction by a pin (a gauge)."""
        return len(self._held)

    # -- reads ----------------------------------------------------------------------------------------------
    def open_for_read(self, key: bytes) -> tuple[int, int] | None:
        """(fd, file size) for a read of the whole chunk file, or None if the tier does not have it.

        Opened with ``O_NONBLOCK`` and checked to be a regular file: a FIFO or device planted at a chunk path
        would otherwise block the open (or the read) forever; it is quarantined and the chunk is a miss here.
        This call may still block on slow metadata (a network file system, a throttled device): the reader runs
        it on the tier's open threads, off the step's lock, so the hedge deadline covers it.

        ENOENT and ESTALE are a miss (see :meth:`on_missing`): on a shared tier they are what a peer's eviction
        looks like from here. Raises :class:`TierError` if the tier cannot open it (I/O error, the tier folder
        vanished): the file may be intact, so the key is kept; the caller reads another replica and counts a
        tier failure."""
        if key not in self.index:
            return None
        try:
            got = self._open_regular(key)
        except OSError as exc:
            if exc.errno in _GONE:
                if not self.present():  # the whole tier is gone (unmounted): a tier failure, not a lost file
                    self.counters.read_errors += 1
                    raise TierError(self.name, "open", exc.errno, f"tier folder {self.root} has vanished") from None
                self.on_missing(key)
                return None
            # EIO reading a directory block, EACCES: the tier fails, the file may be fine
            if self._not_a_file(key):  # a FIFO or device at the path (O_DIRECT refuses those): not the tier's fault
                return None
            self.counters.read_errors += 1
            raise TierError(self.name, "open", exc.errno, f"{self.relpath(key)}: {exc.strerror}") from None
        if got is None:
            self.quarantine(key, "not a regular file")
            return None
        return got

    def open_ahead(self, key: bytes) -> tuple[int, int] | None:
        """Like :meth:`open_for_read` for a read that may never be issued (opened early, off the I/O path):
        None on any failure, counting nothing; the read proper then opens the file itself and reports."""
        if key not in self.index:
            return None
        try:
            return self._open_regular(key)
        except OSError:
            return None

    def _open_regular(self, key: bytes) -> tuple[int, int] | None:
        """(descriptor, bytes to read) for the chunk file (``O_NONBLOCK``: a FIFO cannot block the open), or None
        if what sits at the path is not a regular file. Raises ``OSError`` if it cannot be opened.

        The size is the open file's own (``fstat``), not the index's: the index is a hint that can be stale
        (another node removed the key and put it again, larger) or wrong (a damaged record), and a read sized
        from it cut an intact file short and quarantined it. Never trusted blindly either: at least a header,
        at most the tier's capacity (no chunk of ours is larger); the header read then decides."""
        fd = os.open(self.path_for(key), self._open_flags_read | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        return fd, read_size(st.st_size, self.cfg.capacity_bytes)

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

    def on_missing(self, key: bytes) -> None:
        """A read of a listed chunk found no file (ENOENT) or a stale handle (ESTALE): a miss, never a tier
        failure. The listing is dropped only if a second look finds the name gone too (on a shared tier in this
        process only, see below):
        GlusterFS answers ENOENT now and then for a file that exists, and a delete logged for it would hide
        the chunk from every node (an orphan). The delete names the gens listed now, so a put published
        since (a new gen) is not touched; and a node that later writes the key and finds the file there lists
        it again (see :meth:`publish`)."""
        self.counters.missing_files += 1
        try:
            os.stat(self.path_for(key))
            return  # there after all: this read is a miss, the chunk stays listed
        except OSError as exc:
            if exc.errno not in _GONE:
                return  # cannot tell: keep it
        # On a shared tier even a second ENOENT can be GlusterFS's (the 5-minute two-node soak lost chunks whose
        # files were there, their listings dropped this way): forget the key in this process only. A file that
        # is really gone costs this node one miss per restart; a delete logged for one that is not would hide
        # it from every node for good. Only this node writes a local tier: there a missing file is gone.
        self.drop(key, unlink=False, log_delete=not self.cfg.shared)

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
                got = self._take_victim()
                if got is None:
                    break
                victims.append(got)
            fits = self._used + self._reserved + nbytes <= self.cfg.capacity_bytes
            if fits:
                self._reserved += nbytes
            elif self._held:
                # Nothing evictable is left: if the pinned chunks hold the room, the put is refused (LMCache's
                # contract: pinned chunks are never evicted; the caller may put it again later), and counted.
                pinned = sum(self._own.get(k, 0) for k in self._held)
                if self._used + self._reserved + nbytes - pinned <= self.cfg.capacity_bytes:
                    self.counters.write_refused_pinned += 1
        self._evict(victims)
        return fits

    def _take_victim(self) -> tuple[bytes, int] | None:
        """The policy's next victim, taken out of the policy and the quota and marked dropping; None if there
        is none. Only this node's chunks and those of nodes with no live lease are in the policy, so nothing a
        live peer owns is ever picked. Called with ``_lock`` held."""
        while True:
            key = self.policy.victim()
            if key is None:
                return None
            assert isinstance(key, bytes)  # the policy only ever holds this tier's chunk keys
            self.policy.on_remove(key)
            if not self.pins.pinned(key):
                break
            self._held.add(key)  # pinned since it was last placed (its hold() has not run yet): never a victim
        size = self._own.pop(key, None)
        if size is not None:
            self._used -= size
        else:
            self._adopted.discard(key)
            size = self.index.get(key) or 0
        self._dropping.add(key)
        return key, size

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
        """Evict this node's chunks (eviction policy order) until ``nbytes`` are freed, whatever the capacity
        says: the file system ran out of space first (ENOSPC/EDQUOT: other users). Returns bytes freed."""
        victims: list[tuple[bytes, int]] = []
        freed = 0
        with self._lock:
            while freed < nbytes:
                got = self._take_victim()
                if got is None:
                    break
                freed += got[1]
                victims.append(got)
        self._evict(victims)
        return freed

    def unreserve(self, nbytes: int) -> None:
        with self._lock:
            self._reserved -= nbytes

    def create_temp(self, key: bytes) -> tuple[int, str]:
        """Open a new temporary for ``key``; returns (fd, path). The name carries this writer's lease
        (``uid-token``), so no other writer takes it for a dead one's while the lease is live. ESTALE (the
        ``tmp/`` folder's handle went stale on this client) is retried once."""
        lease = self.index.lease
        for attempt in (0, 1):
            path = str(self.root / "tmp" / f"{key.hex()}.{lease.uid}-{lease.token}.{secrets.token_hex(4)}.tmp")
            try:
                return os.open(path, self._open_flags_write, 0o600), path
            except OSError as exc:
                if exc.errno not in WRITE_RETRY or attempt:
                    raise
                self.counters.write_retried_stale += 1
        raise AssertionError("unreachable")

    def publish(self, key: bytes, tmp_path: str, file_size: int) -> bool:
        """Make a fully written temporary visible under the key's name. Returns False if another writer had
        already published the key (its copy is kept, ours dropped). Called with the space reserved.

        On a shared tier only the winner logs the put (and owns the chunk: its quota, its eviction); a loser
        learns of the chunk from the winner's log on its next refresh, unless nothing lists the key at all
        (a file whose put was never logged, or whose listing was dropped on a spurious ENOENT): then the loser
        lists it, so no valid file stays invisible. No name is trusted alone: a reader checks the header's key
        and checksum. GlusterFS lets two links of one name both succeed now and then (two directory entries);
        a winner checks that the name is its file and resolves a double win at once (:meth:`_settle`).

        The temporary is unlinked only after the put is logged: a writer killed between the link and the log
        leaves its temporary, a second link to the published file, by which its node (or, once its lease has
        expired, any node) lists the orphan at its next open (:meth:`_clean_tmp`)."""
        final = self.path_for(key)
        try:
            won = self._link(tmp_path, final)  # raises: the caller unreserves (Writer._finish_write)
            if won and self._link_ok:
                won = self._settle(tmp_path, final)
            if not won:
                self.counters.already_present += 1
            if won:
                # Always a new put (a new gen), even if this node already lists the key: that listing may be one
                # a peer has deleted (it adopted and evicted our chunk, or removed it) whose delete we have not
                # read yet; reading it later would unlist the file just published (found by the two-node soak:
                # 134 acknowledged chunks whose files were there, listed by nobody).
                self.index.record(OP_PUT, key, file_size)
            elif key not in self.index:
                self.index.record(OP_PUT, key, file_size)  # an unlisted file: listed (and owned) by us from now
        finally:
            try:
                os.unlink(tmp_path)
            except OSError:
                pass
        self._sync(key)
        with self._lock:  # only now: until the chunk counts as used, its reservation holds its place
            self._reserved -= file_size
        return won

    def _settle(self, tmp_path: str, final: Path) -> bool:
        """After a successful ``link``: True if the name now resolves to our file (the temporary's inode).

        GlusterFS (a distribute volume) lets two clients' links of one name both succeed (4 of 8 runs of the
        two-node race test; ``verify``: two directory entries under one name): each writer then believes it
        won and logs a put, and the name resolves to one of the two files. The writer that finds the name
        resolving to another file resolves it at once, the same way every time: it removes the entry the name
        resolves to (the other writer's: the same key, a valid chunk just like ours) until the name resolves
        to ours, or is free, when ours is linked again. One entry is left, ours, and we log our put; the other
        writer's put lists the same key, so it stays listed whichever node evicts it. Bounded: after
        ``_LINK_TRIES`` rounds the name is left as it is (``kvstream verify --repair`` resolves leftovers)."""
        try:
            mine = os.stat(tmp_path)
        except OSError:
            return True  # cannot tell (our temporary is gone): as before, the link decides
        for _ in range(_LINK_TRIES):
            try:
                st = os.stat(final)
            except OSError as exc:
                if exc.errno not in _GONE:
                    return True
                try:  # the name is free (a remove raced, or we removed the other entry): ours goes there
                    os.link(tmp_path, final)
                except FileExistsError:
                    pass
                except OSError:
                    return False
                continue
            if (st.st_ino, st.st_dev) == (mine.st_ino, mine.st_dev):
                return True
            self.counters.publish_conflicts += 1
            log.warning("tier %s: %s: another writer's file under the name our link just won (two links won); "
                        "removing it so that one remains", self.name, final.name)
            try:
                os.unlink(final)
            except OSError as exc:
                if exc.errno not in _GONE:
                    return False
        return False

    def _link(self, tmp_path: str, final: Path) -> bool:
        """``link()`` the temporary to its final name (``rename`` where there are no hard links); True if ours
        is the file now there, False if the name was taken. The temporary is left for the caller to unlink.

        A fan-out folder made a moment ago by another node can read as missing or stale on this client
        (ENOENT/ESTALE from ``link``), and one emptied by an eviction is removed (:meth:`_prune_dirs`), possibly
        between our ``mkdir`` and our ``link``: the folders are made again and the link retried (up to
        ``_LINK_TRIES`` times: each retry needs another eviction emptying that very folder in that window)."""
        d = os.path.dirname(final)
        for attempt in range(_LINK_TRIES):
            try:
                if attempt or d not in self._made_dirs:
                    mkdir_private(d)
                    self._made_dirs.add(d)
                if self._link_ok:
                    try:
                        os.link(tmp_path, final)
                        return True
                    except FileExistsError:
                        return False
                    except OSError as exc:
                        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
                            raise
                        self._link_ok = False  # no hard links here: rename (replaces identical bytes)
                os.rename(tmp_path, final)
                return True
            except OSError as exc:
                if exc.errno not in _GONE or attempt == _LINK_TRIES - 1:
                    raise
                self._made_dirs.discard(d)
        raise AssertionError("unreachable")

    # -- removal --------------------------------------------------------------------------------------------
    def _delete_file(self, key: bytes) -> None:
        try:
            os.unlink(self.path_for(key))
        except OSError as exc:
            if exc.errno not in _GONE:  # already gone (a peer deleted it, a stale handle): what we wanted
                raise
        self._prune_dirs(key)

    def _prune_dirs(self, key: bytes) -> None:
        """Remove the key's fan-out folders (``chunks/ab/cd``, then ``chunks/ab``) if its file was their last.

        Why: folders were never removed, so a tier that had held many keys kept up to 65,536 empty folders: an
        ext4 out of inodes refused every create, and the store would not open. ``rmdir`` only removes an empty
        folder, so this never takes a file; a publish into the folder at that moment finds it gone (ENOENT from
        ``link``) and makes it again (:meth:`_link` retries)."""
        d2 = self.path_for(key).parent
        self._made_dirs.discard(str(d2))
        for d in (d2, d2.parent):
            try:
                os.rmdir(d)
            except OSError:
                return  # not empty (ENOTEMPTY, EEXIST), gone already, or a failing tier: leave it

    def drop(self, key: bytes, *, unlink: bool = True, log_delete: bool = True) -> None:
        """Remove a key from this tier (its file too, unless it is already gone). ``log_delete=False``: forget
        it in this process only (the index logs still list it; see :meth:`on_missing`)."""
        with self._lock:
            # The delete record is logged after the unlink (crash order), outside the lock: until it is, the key
            # is still in the index, so a second drop of it (two removes, a remove racing a quarantine) must not
            # count it again.
            busy = key in self._dropping  # another thread is dropping it: that thread unlinks and logs
            known = key in self.index and not busy
            if known:
                self._dropping.add(key)
                if (key in self._own or key in self._adopted) and key not in self._held:
                    self.policy.on_remove(key)
                self._held.discard(key)
                if key in self._own:
                    self._used -= self._own.pop(key)
                self._adopted.discard(key)
        if not known:
            if unlink and not busy:
                self._delete_file(key)  # a file the index does not list (as before: drop means "gone")
            return
        try:
            if unlink:
                self._delete_file(key)
            if log_delete:
                self.index.record(OP_DEL, key)
            else:
                self.index.forget(key)
        finally:
            with self._lock:
                self._dropping.discard(key)

    def quarantine(self, key: bytes, reason: str, *, ino: int | None = None) -> None:
        """Move a chunk that failed verification out of the way (kept for inspection) and forget it. ``ino``:
        the inode that was found bad; if the name holds another file by now (the key removed and put again
        since), that file is left alone."""
        src = self.path_for(key)
        if ino is not None:
            try:
                if os.lstat(src).st_ino != ino:
                    return
            except OSError:
                return  # gone already: the read that failed was a miss
        dst = self.root / "quarantine" / f"{key.hex()}.{int(time.time())}.kvc"
        try:
            os.rename(src, dst)
            _write_private(self.root / "quarantine" / (dst.name + ".why"), (reason + "\n").encode())
            self._prune_dirs(key)
        except OSError:
            self._delete_file(key)
        self.counters.corrupt_chunks += 1
        self.drop(key, unlink=False)
        log.warning("tier %s: quarantined chunk %s: %s", self.name, key.hex(), reason)

    def close(self) -> None:
        self.write_ring.close()
        self.read_ring.close()
        self.index.close()

