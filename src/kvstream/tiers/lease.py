"""Node identity and liveness on a shared tier: a persistent random id per node, an mtime lease per writer.

Why not the host name and a pid: two containers (PID namespaces) or two hosts given one YAML have the same
name, and a pid means nothing on another machine, so a store judged a live peer dead by ``kill(pid, 0)`` and
deleted its log and temporaries. Instead:

- **Identity** (:func:`node_uid`): 16 hex digits drawn at random once and persisted in a state file (the node's
  local tier, or a path the config names). The configured ``node_id`` stays a human label, written into the
  lease file; nothing is decided by it.
- **Liveness** (:class:`Lease`): each open writer (one store's index on one tier) owns
  ``index/lease-<uid>-<token>`` and touches it every ``heartbeat_s``; a lease whose mtime is more than
  ``expiry_s`` behind a fresh reference is expired. The reference is our own lease's mtime right after we
  touched it, so both stamps come from the same place (the file server, where it stamps; else the clients,
  whose clock skew then has to stay under ``expiry_s - heartbeat_s``). A missing lease is not live.
  A writer also holds an ``flock`` on its lease file. For leases of *this* node's id (the same machine, so one
  kernel arbitrates, even across PID namespaces) a lock we can take means its holder is dead, at once, without
  waiting for the expiry; for other nodes' leases the lock is never consulted (``flock`` is refused across
  clients of GlusterFS and CephFS, and purely local on some Lustre and NFS mounts).

Invariant: a lease file exists from before its writer's first log record or temporary until after its last, so
"no live lease for this token" means nothing of that writer is still being written. What an expired lease
permits is only reclaiming (compacting that writer's logs when it is our own node's, deleting its temporaries,
evicting its node's chunks): a wrong verdict costs cache hits, never bytes.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import secrets
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvstream.tiers.private import mkdir_private

if TYPE_CHECKING:
    from kvstream.config import StoreConfig

__all__ = ["Lease", "node_uid", "node_uid_for", "new_token", "LEASE_EXPIRY_S", "HEARTBEAT_S", "UID_RE", "lease_name"]

LEASE_EXPIRY_S = 60.0  # a writer silent this long is gone (GlusterFS shows ~1 s of stale attributes)
HEARTBEAT_S = 10.0  # how often a writer touches its lease; well under the expiry
UID_RE = re.compile(r"^[0-9a-f]{16}$")
_LEASE_RE = re.compile(r"^lease-([0-9a-f]{16})-([0-9a-f]{8})$")


def new_token() -> str:
    """A writer instance's token: 8 hex digits, distinct per open (temporaries and logs carry it)."""
    return secrets.token_hex(4)


def lease_name(uid: str, token: str) -> str:
    return f"lease-{uid}-{token}"


def node_uid(state_file: Path) -> str:
    """This node's persistent id, read from ``state_file`` or drawn and written there (mode 0600) on first use.

    Two processes starting at once on one node may both draw: ``O_EXCL`` makes one of them win and the other
    reads the winner's id. A damaged file (not 16 hex digits) is an error to fix by hand, not silently
    replaced: replacing it would orphan every chunk this node owns on its shared tiers."""
    mkdir_private(state_file.parent)  # every missing level 0700, whatever the umask
    for _ in range(2):
        try:
            text = state_file.read_text().strip()
        except FileNotFoundError:
            uid = secrets.token_hex(8)
            try:
                fd = os.open(state_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                continue  # another process of this node drew first: read its id
            try:
                os.write(fd, (uid + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            return uid
        if not UID_RE.match(text):
            raise ValueError(f"{state_file}: not a node id (16 hex digits); remove it to draw a new one "
                             "(this node's chunks on shared tiers then belong to a node that never comes back)")
        return text
    raise ValueError(f"{state_file}: could not be read or created")


def node_uid_for(config: "StoreConfig") -> str | None:
    """The persistent id of this node for a store with a ``shared`` tier; None without one (a node's own
    tiers need none: the label stands in). Kept in ``node_state_path`` if set, else in the first node-local
    tier's folder (``node-id``), else in ``~/.local/state/kvstream/node-id-<host name>``. Raises
    ``ConfigError``."""
    from kvstream.errors import ConfigError

    if not any(t.shared for t in config.tiers):
        return None
    local = next((t for t in config.tiers if not t.shared), None)
    if config.node_state_path:
        path = Path(config.node_state_path)
    elif local is not None:
        if not Path(local.path).is_dir() and not config.create_dirs:
            return None  # the tier's own check reports the missing folder
        path = Path(local.path) / "node-id"
    else:  # home folders are often shared by a cluster's nodes: one file per host name
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", os.uname().nodename) or "host"
        path = Path.home() / ".local" / "state" / "kvstream" / f"node-id-{host}"
    try:
        return node_uid(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("node_state_path", f"cannot keep this node's id in {path}: "
                                             f"{getattr(exc, 'strerror', None) or exc}") from None


class Lease:
    """One writer's lease in an index folder, and the reader of everyone's.

    ``start()`` creates the file and a daemon thread that touches it; ``close()`` stops the thread and removes
    the file. Without ``start()`` (a read-only index, ``kvstream verify``) it only judges other leases."""

    def __init__(self, folder: Path, uid: str, token: str, *, label: str = "", expiry_s: float = LEASE_EXPIRY_S,
                 heartbeat_s: float = HEARTBEAT_S) -> None:
        self.folder = folder
        self.uid = uid
        self.token = token
        self.label = label
        self.expiry_s = expiry_s
        self.heartbeat_s = heartbeat_s
        self.path = folder / lease_name(uid, token)
        self.held = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fd = -1  # our lease file, open and flock-ed while held

    def start(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, f"{self.label}\n{os.getpid()}\n".encode())  # for people: who holds it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pass  # no flock here: this node's other processes judge us by the mtime, like other nodes do
        self._fd = fd
        self.held = True
        self._thread = threading.Thread(target=self._run, name=f"kvs-lease-{self.token}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            self.beat()

    def beat(self) -> None:
        """Touch the lease (re-create it if something removed it: a wrong verdict elsewhere must not stick)."""
        if not self.held:
            return
        try:
            os.utime(self.path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ESTALE):
                try:
                    os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600))
                except OSError:
                    pass  # the tier is failing: its reads and writes report that, not the heartbeat

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.held:
            self.held = False
            try:
                self.path.unlink()
            except OSError:
                pass
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    def _lock_says_dead(self, path: str) -> bool | None:
        """For a lease of this node: True if its lock is free (its holder is dead), False if held, None if
        the file system cannot tell (no flock, or the file is gone)."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            return False if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES) else None
        else:
            return True
        finally:
            os.close(fd)  # releases the lock if we took it

    def reference(self) -> float:
        """"Now" as the tier stamps it: our own lease's mtime, freshly touched; the local clock otherwise."""
        if self.held:
            self.beat()
            try:
                return os.stat(self.path).st_mtime
            except OSError:
                pass
        return time.time()

    def live(self) -> dict[str, str]:
        """Live writers on this tier: ``uid-token`` -> uid (our own included while held)."""
        ref = self.reference()
        out: dict[str, str] = {}
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return out
        for e in entries:
            m = _LEASE_RE.match(e.name)
            if not m:
                continue
            if m.group(1) == self.uid and m.group(2) != self.token:
                dead = self._lock_says_dead(e.path)
                if dead is not None:
                    if not dead:
                        out[f"{m.group(1)}-{m.group(2)}"] = m.group(1)
                    continue
            try:
                mtime = e.stat().st_mtime
            except OSError:
                continue  # gone (or stale handle): not live
            if ref - mtime <= self.expiry_s:
                out[f"{m.group(1)}-{m.group(2)}"] = m.group(1)
        if self.held:
            out[f"{self.uid}-{self.token}"] = self.uid
        return out

    def live_uids(self) -> set[str]:
        return set(self.live().values())
