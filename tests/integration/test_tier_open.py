"""Opening tiers: a missing mount is never written under, a failing tier does not take the others down
(issue 21, items 5 and 7). Runs without root; the same with real mounts, a real full ext4 and real unmounts is
in ``tests/root/test_fault_suite_root.py``.

Before: with ``create_dirs`` (LMCache's default) a store opened while the shared file system was not mounted
created its folder on the root disk under the empty mount point and ran as if it were shared; and a first tier
that could not be opened (out of inodes: empty fan-out folders were never removed) made the whole store refuse to
open, the healthy second tier with it.

Mutation checks (done when this was written): with ``mount_problem`` returning None the require_mount tests
fail (the folder is created on the root disk); with ``Store._open_tiers`` re-raising ``TierUnavailable`` the
down-tier tests fail (ConfigError at open); with ``DirectoryTier._prune_dirs`` doing nothing the fan-out test
fails; with ``_LINK_TRIES`` = 1 (or 2, the one retry there was) the pruned-again-and-again test fails.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

import kvstream
from kvstream.errors import ConfigError, TierUnavailable
from kvstream.format import file_size
from kvstream.tiers.mounts import mount_point_of

SIZE = 8 * 1024


def data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(SIZE)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def two_tiers(local: Path, shared: Path, **kw) -> dict:
    cfg = {"tiers": [{"name": "local", "path": str(local), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(shared), "capacity_bytes": "64MiB", "shared": True}],
           "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads",
           "node_state_path": str(local.parent / "node-id")}
    cfg.update(kw)
    return cfg


def on_root_fs(path: Path) -> None:
    if mount_point_of(path) != Path("/"):
        pytest.skip(f"{path} is not on the root file system here (mounted at {mount_point_of(path)}): the "
                    "unmounted-mount-point case cannot be staged without root")


def shm_mount() -> Path:
    shm = Path("/dev/shm")
    if not os.path.ismount(shm) or not os.access(shm, os.W_OK):
        pytest.skip("/dev/shm is not a writable mount here: no mounted file system to stand in without root")
    return shm


# ── item 5: a tier meant for a mount ───────────────────────────────────────────────────────────────────────


def test_a_shared_tier_under_an_unmounted_mount_point_is_refused_and_nothing_is_created(disk_tmp):
    on_root_fs(disk_tmp)
    mnt = disk_tmp / "mnt" / "pfs"  # "the mount point": an empty folder on the root disk, nothing mounted
    mnt.mkdir(parents=True)
    cfg = two_tiers(disk_tmp / "local", mnt / "kvstream" / "node-a")
    with pytest.raises(TierUnavailable, match=r"tiers\[1\]\.path.*root file system .*nothing was created") as ei:
        kvstream.open_store(cfg)
    assert ei.value.unmounted and isinstance(ei.value, ConfigError)
    assert list(mnt.iterdir()) == []  # never a folder under the unmounted mount point


def test_skip_unmounted_tiers_opens_it_down_loudly_and_serves_from_the_others(disk_tmp, caplog):
    on_root_fs(disk_tmp)
    mnt = disk_tmp / "mnt"
    mnt.mkdir()
    cfg = two_tiers(disk_tmp / "local", mnt / "kvstream", skip_unmounted_tiers=True)
    with kvstream.open_store(cfg) as s:
        for i in range(8):
            assert s.put(key(i), data(i))
        s.flush()
        assert s.drain(10)
        s.evict_memory()
        assert [bytes(b) for b in s.get_many([key(i) for i in range(8)])] == [data(i) for i in range(8)]
        st = s.stats().tiers
        assert "root file system" in st["shared"].down and st["shared"].circuit == "down"
        assert st["local"].down == "" and st["local"].write_chunks == 8
        assert st["shared"].write_chunks == 0 and st["shared"].replicas_owed == 0  # skipped, never owed
        from prometheus_client import CollectorRegistry, generate_latest

        from kvstream.metrics import StoreCollector

        reg = CollectorRegistry()
        reg.register(StoreCollector(s))
        text = generate_latest(reg).decode()
        assert 'kvstream_tier_down{tier="shared"} 1.0' in text and 'kvstream_tier_down{tier="local"} 0.0' in text
    assert list(mnt.iterdir()) == []
    assert any("tier shared is DOWN" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")


def test_a_shared_tier_on_a_mounted_file_system_opens(disk_tmp):
    shm = shm_mount()
    folder = shm / f"kvs-mount-test-{os.getpid()}"
    try:
        with kvstream.open_store(two_tiers(disk_tmp / "local", folder / "kv")) as s:
            assert s.put(key(1), data(1))
            assert s.stats().tiers["shared"].down == ""
        # mount_point: the tier must be on the file system mounted exactly there
        cfg = two_tiers(disk_tmp / "local", folder / "kv")
        cfg["tiers"][1]["mount_point"] = str(shm)
        with kvstream.open_store(cfg) as s:
            assert s.stats().tiers["shared"].down == ""
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_mount_point_must_be_mounted_and_hold_the_tier(disk_tmp):
    on_root_fs(disk_tmp)
    cfg = two_tiers(disk_tmp / "local", disk_tmp / "mnt" / "kv")
    cfg["tiers"][1].update(mount_point=str(disk_tmp / "mnt"), require_mount=False)
    (disk_tmp / "mnt").mkdir()
    with pytest.raises(TierUnavailable, match=r"tiers\[1\]\.path.*mounted at .*/mnt \(mount_point\), but nothing is mounted"):
        kvstream.open_store(cfg)
    assert list((disk_tmp / "mnt").iterdir()) == []
    cfg["tiers"][1]["mount_point"] = str(disk_tmp / "elsewhere")
    with pytest.raises(ConfigError, match=r"tiers\[1\]\.mount_point.*does not hold the tier's path"):
        kvstream.open_store(cfg)


def test_a_node_local_tier_may_stay_on_the_root_disk_and_require_mount_false_allows_a_shared_one(disk_tmp):
    cfg = two_tiers(disk_tmp / "local", disk_tmp / "shared")
    cfg["tiers"][1]["require_mount"] = False
    with kvstream.open_store(cfg) as s:
        assert all(t.down == "" for t in s.stats().tiers.values())


# ── item 7: a tier that cannot be opened does not take the others down ─────────────────────────────────────


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS])
def test_a_first_tier_whose_file_system_fails_at_open_is_down_and_the_second_serves(disk_tmp, monkeypatch, err):
    cfg = two_tiers(disk_tmp / "local", disk_tmp / "shared")
    cfg["tiers"][1]["require_mount"] = False
    with kvstream.open_store(cfg) as s:
        for i in range(6):
            assert s.put(key(i), data(i))
    real_open = os.open
    local = str(disk_tmp / "local")

    def failing_open(path, flags, *a, **kw):  # every create in the first tier fails (full: no block or inode left)
        if str(path).startswith(local) and flags & os.O_CREAT:
            raise OSError(err, os.strerror(err), str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", failing_open)
    with kvstream.open_store(cfg) as s:
        st = s.stats().tiers
        assert os.strerror(err) in st["local"].down and st["local"].circuit == "down"
        assert st["local"].chunks == 0  # nothing listed: never read (its folder may be dying)
        s.evict_memory()
        assert [bytes(b) for b in s.get_many([key(i) for i in range(6)])] == [data(i) for i in range(6)]
        assert s.put(key(99), data(99))
        s.flush()
        assert s.drain(10)
        st = s.stats().tiers
        assert st["shared"].write_chunks == 1 and st["local"].write_chunks == 0
        assert st["local"].write_skipped_unhealthy >= 1  # the put's copy (and read-through copies) skipped
    monkeypatch.setattr(os, "open", real_open)
    with kvstream.open_store(cfg) as s:  # fixed: back in, with everything it held
        assert s.stats().tiers["local"].chunks == 6 and s.stats().tiers["local"].down == ""


def test_a_permission_problem_is_still_a_config_error_and_all_tiers_down_is_an_error(disk_tmp, monkeypatch):
    cfg = two_tiers(disk_tmp / "local", disk_tmp / "shared")
    cfg["tiers"][1]["require_mount"] = False
    real_open = os.open

    def refuse(path, flags, *a, **kw):
        if str(path).startswith(str(disk_tmp / "local")) and flags & os.O_CREAT:
            raise OSError(errno.EACCES, "Permission denied", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", refuse)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path.*Permission denied") as ei:
        kvstream.open_store(cfg)
    assert not isinstance(ei.value, TierUnavailable)

    def full(path, flags, *a, **kw):
        if str(path).startswith(str(disk_tmp)) and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real_open(path, flags, *a, **kw)

    monkeypatch.setattr(os, "open", full)
    with pytest.raises(TierUnavailable, match=r"tiers\[0\]\.path.*No space left on device"):
        kvstream.open_store(cfg)


# ── item 7: empty fan-out folders go with their last file ──────────────────────────────────────────────────


def _fanout_dirs(root: Path) -> int:
    return sum(1 for p in (root / "chunks").rglob("*") if p.is_dir())


def test_emptied_fan_out_folders_are_removed_on_remove_eviction_and_quarantine(disk_tmp):
    n = 64
    cfg = {"tiers": [{"name": "t", "path": str(disk_tmp / "t"), "capacity_bytes": 8 * file_size(SIZE)}],
           "memory_bytes": "4MiB", "create_dirs": True, "io_engine": "threads"}
    with kvstream.open_store(cfg) as s:
        for i in range(n):  # capacity for 8: 56 evictions, each in its own fan-out folder
            assert s.put(bytes([i, i]) + key(i), data(i))
            s.flush()
            assert s.drain(10)
        assert s.stats().tiers["t"].evicted_chunks == n - 8
        assert _fanout_dirs(disk_tmp / "t") == 2 * 8  # ab/ and ab/cd/ of the 8 left
        for i in range(n - 8, n - 1):
            assert s.remove(bytes([i, i]) + key(i))
        assert _fanout_dirs(disk_tmp / "t") == 2
        k = bytes([n - 1, n - 1]) + key(n - 1)
        s.tiers[0].quarantine(k, "test")
        assert _fanout_dirs(disk_tmp / "t") == 0


def test_publishes_racing_the_removal_of_their_fan_out_folder_all_land(disk_tmp):
    """Writers publish keys of one fan-out folder while others remove keys there (each remove may empty and
    remove the folder between a publish's mkdir and its link): every publish lands, none fails."""
    cfg = {"tiers": [{"name": "t", "path": str(disk_tmp / "t"), "capacity_bytes": "256MiB"}],
           "memory_bytes": "32MiB", "create_dirs": True, "io_engine": "threads"}
    keys = [b"\x5a\x5a" + i.to_bytes(4, "big") + bytes(10) for i in range(600)]
    with kvstream.open_store(cfg) as s:
        tier = s.tiers[0]
        errors: list[BaseException] = []

        def churn(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for k in keys[seed::3]:
                    assert s.put(k, data(seed))
                    s.flush()
                    if rng.random() < 0.7:
                        s.drain(5)
                        s.remove(k)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        threads = [threading.Thread(target=churn, args=(t,)) for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert s.drain(10)
        st = s.stats().tiers["t"]
        assert not errors and st.write_errors == 0
        held = [k for k in keys if tier.contains(k)]
        assert all(tier.path_for(k).exists() for k in held)
        assert st.write_chunks == len(keys)


def test_a_publish_whose_fan_out_folder_is_pruned_under_it_again_and_again_still_lands(disk_tmp, monkeypatch):
    """The window the soak above rarely hits, made certain: the folder is removed (another key's eviction
    emptied it) between the publish's ``mkdir`` and its ``link``, three times in a row."""
    cfg = {"tiers": [{"name": "t", "path": str(disk_tmp / "t"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads"}
    real_link = os.link
    pruned = [0]

    def link_after_a_prune(src, dst, *a, **kw):
        if pruned[0] < 3:
            pruned[0] += 1
            for d in (Path(dst).parent, Path(dst).parent.parent):
                try:
                    os.rmdir(d)
                except OSError:
                    pass
        return real_link(src, dst, *a, **kw)

    with kvstream.open_store(cfg) as s:
        monkeypatch.setattr(os, "link", link_after_a_prune)
        assert s.put(key(7), data(7))
        s.flush()
        assert s.drain(10)
        st = s.stats().tiers["t"]
        assert pruned[0] == 3 and st.write_errors == 0 and st.write_chunks == 1
        s.evict_memory()
        assert bytes(s.get_many([key(7)])[0]) == data(7)
