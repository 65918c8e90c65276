"""Shared fixtures. Tier folders live on the real disk (not tmpfs), so O_DIRECT is exercised.

Fixtures only: helpers that test files call live in :mod:`kvstream.testing` (test files never import this file
or each other; tests/unit/test_layout.py checks).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvstream.testing.store import disk_tmp_root

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TRACES = SHARED / "data" / "traces"


def _disk_tmp_root() -> Path:
    """A folder on a file system that supports O_DIRECT (tmpfs does not): $KVSTREAM_TEST_DIR, else /var/tmp."""
    return disk_tmp_root(REPO / ".test-tmp")


@pytest.fixture(autouse=True)
def _interpreter_switch_interval():
    """A test that opens a store or runs a replay may lower Python's switch interval process-wide
    (``python_switch_interval_s``, ``--switch-interval-ms``): put it back, so no test runs under another's."""
    import sys

    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


@pytest.fixture
def disk_tmp():
    root = Path(tempfile.mkdtemp(prefix="kvstream-test-", dir=_disk_tmp_root()))
    yield root
    shutil.rmtree(root, ignore_errors=True)


# ── two nodes on real distributed file systems (tests/root/test_dfs_multinode.py, issue 12) ────────────────
# Session-scoped: the namespaces once, and each file system once (`dfs` is parametrised, so pytest runs every
# GlusterFS test, tears GlusterFS down, then starts Ceph: never both at once, and Ceph's bootstrap only once).


def _dfs_modules():
    import sys

    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from dfs import netns, testbed

    return netns, testbed


@pytest.fixture(scope="session")
def dfs_testbed():
    """Namespaces kvs-dfs-{srv,a,b} with a PID/UTS namespace per node; a crashed run's leftovers are removed
    first (under the machine-wide testbed lock, so never a live run's). Yields the timings; tears down after
    the last test, also when tests failed."""
    netns, testbed = _dfs_modules()
    why = netns.missing()
    if why:
        pytest.skip(why)
    fd = testbed.lock(timeout_s=240)  # another session's testbed: wait, but inside pytest-timeout's 300 s
    owner = testbed.new_owner("pytest")  # only this session's testbed is ever taken down by it
    try:
        try:
            testbed.claim(owner)
        except testbed.BedInUse as exc:
            pytest.skip(f"cannot bring the DFS testbed up: {exc}")
        timings = testbed.network_up(_disk_tmp_root())
        try:
            yield timings
        finally:
            timings["netns_teardown_s"] = testbed.network_down(owner)
            _report_dfs_timings("network", timings)
    finally:
        testbed.release(owner)
        testbed.unlock(fd)


@pytest.fixture(scope="session", params=["gluster", "ceph"])
def dfs(request, dfs_testbed):
    """A running file system (GlusterFS, then CephFS) mounted on both nodes: ``.mounts['a'|'b']``."""
    netns, testbed = _dfs_modules()
    cluster = testbed.fs_up(request.param, _disk_tmp_root())
    try:
        yield cluster
    finally:
        try:
            cluster.timings["peak_rss_mib"] = netns.peak_rss_mib()
        finally:
            cluster.stop()
        _report_dfs_timings(cluster.name, cluster.timings)


def _report_dfs_timings(what: str, timings: dict) -> None:
    """Set-up/tear-down times, appended to $KVS_DFS_TIMINGS (a JSON line each) when set: the suite's cost is
    measured on every run, not guessed."""
    import json

    path = os.environ.get("KVS_DFS_TIMINGS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"what": what, **timings}) + "\n")
