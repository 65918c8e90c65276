"""Bring the two-node testbed up and down: namespaces, node inits, and one file system at a time.

Used by the pytest fixtures (``tests/conftest.py``), ``bench/dfs/up.py`` and ``bench/dfs/reuse.py``. One testbed
per machine: a lock file (``/run/lock/kvs-dfs.lock``) is held while a command works on it.

Every testbed has an **owner**, written in ``/run/lock/kvs-dfs.owner`` when it is brought up: who started it
(``pytest``, ``bench`` or ``manual`` for ``up.py``), the process (pid and its start time, so a reused pid is not
mistaken for it) and a random session id. Only its owner takes it down. A testbed found at start-up is a
crashed run's leftovers (removed) only if its owner is a process that is gone; one brought up by hand
(``up.py``), or by a process still running, is someone else's: it is left alone (:class:`BedInUse`), and a
pytest session skips its DFS tests naming it instead of tearing it down (issue 21, item 11: a session used to
remove a testbed it had not started).
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from . import ceph, gluster, netns

LOCK_PATH = Path("/run/lock/kvs-dfs.lock")
OWNER_PATH = Path("/run/lock/kvs-dfs.owner")
FILE_SYSTEMS = ("gluster", "ceph")


class BedInUse(RuntimeError):
    """A testbed is up that this process did not start and must not take down."""


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None if there is no such process."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def new_owner(kind: str) -> dict[str, Any]:
    """An owner record for this process: ``kind`` is ``pytest``, ``bench`` or ``manual`` (``up.py``)."""
    pid = os.getpid()
    return {"kind": kind, "pid": pid, "start": _start_time(pid), "session": secrets.token_hex(8),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def read_owner() -> dict[str, Any] | None:
    try:
        data = json.loads(OWNER_PATH.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def owner_alive(owner: dict[str, Any]) -> bool:
    """True if the owner still holds the testbed: a manual one always (until ``up.py down``), else its process
    (the same pid with the same start time) is running."""
    if owner.get("kind") == "manual":
        return True
    pid = owner.get("pid")
    return isinstance(pid, int) and _start_time(pid) is not None and _start_time(pid) == owner.get("start")


def describe(owner: dict[str, Any] | None) -> str:
    if owner is None:
        return "a testbed with no owner record"
    how = "by hand (bench/dfs/up.py)" if owner.get("kind") == "manual" else f"by a {owner.get('kind')} run"
    return f"a testbed started {how}, pid {owner.get('pid')}, at {owner.get('since')}"


def bed_exists() -> bool:
    from . import netns as _n

    return bool(_n.existing() or _n.our_mounts())


def claim(owner: dict[str, Any]) -> None:
    """Take the machine's testbed for ``owner`` (call with the lock held, before bringing it up): a testbed
    already up whose owner is alive (or was started by hand) raises :class:`BedInUse`; a crashed run's is left
    for :func:`network_up` to clean. Writes the owner record."""
    current = read_owner()
    if bed_exists() and current is not None and current.get("session") != owner["session"] and owner_alive(current):
        raise BedInUse(f"{describe(current)} is up; it is not this run's to take down "
                       "(`python bench/dfs/up.py down` removes it)")
    OWNER_PATH.parent.mkdir(parents=True, exist_ok=True)
    tmp = OWNER_PATH.with_suffix(".tmp")
    tmp.write_text(json.dumps(owner))
    os.replace(tmp, OWNER_PATH)


def owns(owner: dict[str, Any]) -> bool:
    current = read_owner()
    return current is not None and current.get("session") == owner["session"]


def release(owner: dict[str, Any]) -> None:
    """Forget the owner record if it is still ``owner``'s (after its testbed came down)."""
    if owns(owner):
        OWNER_PATH.unlink(missing_ok=True)


class Cluster(Protocol):
    name: str
    work: Path
    mounts: dict[str, Path]
    timings: dict[str, float]

    def stop(self) -> None: ...


def lock(timeout_s: float = 600) -> int:
    """Take the machine-wide testbed lock (waiting up to ``timeout_s`` for another run); returns its fd."""
    LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_PATH, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(f"another kvs-dfs testbed holds {LOCK_PATH} for over {timeout_s:.0f} s") from None
            time.sleep(1)


def unlock(fd: int) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def network_up(tmp_root: Path) -> dict[str, float]:
    """Clean a crashed run's leftovers, then make the namespaces and the nodes' inits. Returns timings."""
    t0 = time.monotonic()
    cleaned = netns.clean_leftovers(tmp_root)
    t1 = time.monotonic()
    try:
        netns.create()
        netns.start_node_inits()
    except BaseException:
        netns.destroy()
        raise
    return {"leftovers_cleaned": float(len(cleaned)), "clean_s": t1 - t0, "netns_s": time.monotonic() - t1}


def network_down(owner: dict[str, Any] | None = None) -> float:
    """Delete the namespaces; with ``owner``, only if the testbed is still that owner's (never another run's)."""
    t0 = time.monotonic()
    if owner is not None and not owns(owner):
        raise BedInUse(f"the testbed now belongs to {describe(read_owner())}: not taken down")
    netns.destroy()
    if owner is not None:
        release(owner)
    return time.monotonic() - t0


def fs_up(name: str, tmp_root: Path) -> Cluster:
    """Start ``gluster`` or ``ceph`` with its state in a new ``kvs-dfs-<name>-*`` folder under ``tmp_root``."""
    work = Path(tempfile.mkdtemp(prefix=f"kvs-dfs-{name}-", dir=tmp_root))
    if name == "gluster":
        return gluster.start(work)
    if name == "ceph":
        return ceph.start(work)
    raise ValueError(f"unknown file system {name!r}: one of {FILE_SYSTEMS}")
