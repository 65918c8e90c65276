"""Owed copies to a tier whose file system dies under it (root, XFS shutdown): the journal of owed replicas
lives on that very tier, so it moves to a fallback journal on the other tier; after the file system is
repaired and the store reopened, the copies are owed still and the catch-up writes them (issue 13: "owed debts
to a dead first tier are memory-only")."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvstream
from kvstream.replica_debt import OwedReplicas
from kvstream.testing.store import check_all, make_keys, put_and_flush, two_tier_config

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "faults"))
import kernel  # noqa: E402

pytestmark = pytest.mark.root


def test_copies_owed_to_a_dead_first_tier_survive_a_restart_and_are_written_after(disk_tmp):
    if (why := kernel.missing_xfs()) is not None:
        pytest.skip(why)
    size = 128 << 10
    keys = make_keys(12, seed=5)
    with kernel.loop_fs("owedlocal", 320 << 20, fstype="xfs") as fs:
        cfg = two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared")
        s = kvstream.open_store(cfg)
        put_and_flush(s, keys[:8], size)
        assert s.drain(10)
        fs.shutdown()  # the first tier, and the journal on it, fail with EIO from now on
        put_and_flush(s, keys[8:], size)
        assert s.drain(10)
        assert s.owed.counts()["local"] == 4
        fallback = s.owed.path
        assert fallback is not None and fallback.is_relative_to(disk_tmp / "shared")  # moved off the dead tier
        s.close(timeout=5)
        subprocess.run(["umount", str(fs.mountpoint)], check=True)  # repair: XFS replays its log at mount
        fs.mounted = False
        fs.mount()
        with kvstream.open_store(cfg) as again:
            assert isinstance(again.owed, OwedReplicas)
            assert again.owed.counts()["local"] == 4
            deadline = time.monotonic() + 15
            # (The first chunks' local copies may be gone: XFS shutdown drops what its log had not committed,
            # as a crash does. They are on the shared tier; only the owed ones are checked on local.)
            while not all(again.tiers[0].contains(k) for k in keys[8:]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert all(again.tiers[0].contains(k) for k in keys[8:]), "the owed copies were not written"
            assert again.owed.counts()["local"] == 0 and not fallback.exists()
            check_all(again, keys, size)
