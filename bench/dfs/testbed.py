"""Bring the two-node testbed up and down: namespaces, node inits, and one file system at a time.

Used by the pytest fixtures (``tests/conftest.py``) and by ``bench/dfs/up.py``. One testbed per machine: a
lock file (``/run/lock/kvs-dfs.lock``) is held while one exists, so the leftover cleaner run at start can
never mistake a live run's namespaces for a crashed run's.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import time
from pathlib import Path
from typing import Protocol

from . import ceph, gluster, netns

LOCK_PATH = Path("/run/lock/kvs-dfs.lock")
FILE_SYSTEMS = ("gluster", "ceph")


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


def network_down() -> float:
    t0 = time.monotonic()
    netns.destroy()
    return time.monotonic() - t0


def fs_up(name: str, tmp_root: Path) -> Cluster:
    """Start ``gluster`` or ``ceph`` with its state in a new ``kvs-dfs-<name>-*`` folder under ``tmp_root``."""
    work = Path(tempfile.mkdtemp(prefix=f"kvs-dfs-{name}-", dir=tmp_root))
    if name == "gluster":
        return gluster.start(work)
    if name == "ceph":
        return ceph.start(work)
    raise ValueError(f"unknown file system {name!r}: one of {FILE_SYSTEMS}")
