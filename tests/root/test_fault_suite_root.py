"""The fault suite on real kernel mechanisms (root): a full file system, a read-only remount, an unmounted
tier, device EIO, a throttled (stalled) device, and device-mapper faults where the kernel has them.

Each test says exactly why it cannot run (not root, no loop driver, no device-mapper, no blkio throttling,
no quota support) and runs whenever it can. Every loop device, dm device, mount and cgroup it makes is named
``kvs-fault-*`` and removed on the way out, also when the test fails (``bench/faults/kernel.py``).
The in-process equivalents of these faults, which run everywhere, are in ``test_faults.py``.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvstream
from kvstream.commands.verify import verify_tier
from kvstream.errors import ConfigError
from kvstream.testing.store import check_all, make_keys, put_and_flush, two_tier_config
from kvstream.tiers.files import DirectoryTier

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench" / "faults"))
import kernel  # noqa: E402

pytestmark = pytest.mark.root


def need(reason: str | None) -> None:
    if reason is not None:
        pytest.skip(reason)


# ── ENOSPC ─────────────────────────────────────────────────────────────────────────────────────────────────


def test_a_full_file_system_evicts_retries_and_never_blocks_the_serving_path(disk_tmp):
    need(kernel.missing_loop())
    size = 1 << 20
    keys = make_keys(56)
    with kernel.loop_fs("enospc", 40 << 20) as fs:  # ~38 MiB usable; the tier is told it has 1 GiB
        cfg = two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared")
        # This test is about ENOSPC on the local tier: a busy disk under the shared tier must not make the
        # backlog rule skip second copies (that rule has its own tests; issue 13 defers such copies).
        cfg["tiers"][1]["write_backlog_bytes"] = "1GiB"
        with kvstream.open_store(cfg) as s:
            worst = put_and_flush(s, keys, size)
            assert s.drain(60)
            st = s.stats().tiers
            local = st["local"]
            assert local.write_retried_nospace >= 1 and local.evicted_chunks >= 1
            assert local.chunks + local.evicted_chunks + local.write_skipped_full >= len(keys)
            assert st["shared"].write_chunks == len(keys)
            assert worst < 1.0, f"a put+flush took {worst:.2f} s"
            check_all(s, keys, size)
        assert not list((fs.mountpoint / "tier" / "tmp").iterdir())
        assert not verify_tier(fs.mountpoint / "tier").errors


def test_the_index_log_takes_its_records_on_a_full_file_system():
    """The delete record of an eviction must land although a concurrent write took the space it freed: the log
    writes into space it reserved ahead (without it, the records below fail with ENOSPC and a restart lists
    files that are gone)."""
    from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex

    need(kernel.missing_loop())
    with kernel.loop_fs("idxfull", 16 << 20) as fs:
        folder = fs.mountpoint / "index"
        idx = TierIndex(folder, node_id="n1")
        with open(fs.mountpoint / "filler", "wb") as f:  # fill the file system to the last block
            try:
                while True:
                    f.write(b"\xff" * (1 << 16))
                    f.flush()
            except OSError:
                pass
        keys = make_keys(200)
        for k in keys:
            idx.record(OP_PUT, k, 4096)
        for k in keys[:150]:
            idx.record(OP_DEL, k)
        assert idx.append_errors == 0
        idx.close()
        again = TierIndex(folder, node_id="n1", writable=False)
        assert sorted(k for k, _ in again.items()) == sorted(keys[150:])


# ── read-only tier ─────────────────────────────────────────────────────────────────────────────────────────


def test_a_tier_turned_read_only_skips_copies_keeps_serving_and_recovers(disk_tmp):
    need(kernel.missing_loop())
    size = 256 << 10
    keys = make_keys(24)
    with kernel.loop_fs("ro", 64 << 20) as fs:
        cfg = two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared")
        with kvstream.open_store(cfg) as s:
            s.health[0].cooldown_s = 0.2
            put_and_flush(s, keys[:8], size)
            assert s.drain(10)
            fs.freeze_readonly(fs.mountpoint / "tier")
            worst = put_and_flush(s, keys[8:16], size)
            assert s.drain(10) and worst < 1.0
            st = s.stats().tiers
            assert st["local"].write_errors >= 1 and st["local"].circuit_opened >= 1
            assert st["local"].write_errors + st["local"].write_skipped_unhealthy == 8
            assert st["shared"].write_chunks == 16
            check_all(s, keys[:16], size)
            # A second store opened now: the read-only tier is down (named, not a refusal of the whole store:
            # issue 21, item 7); the other tier serves.
            with kvstream.open_store(cfg) as again:
                down = again.stats().tiers["local"].down
                assert "not writable: Read-only file system" in down and again.health[0].state == "down"
                check_all(again, keys[:16], size)
            fs.thaw(fs.mountpoint / "tier")
            time.sleep(0.25)  # breaker cool-down: the next write probes the tier
            before = s.stats().tiers["local"].write_chunks
            put_and_flush(s, keys[16:], size)
            assert s.drain(10)
            assert s.stats().tiers["local"].write_chunks > before
        assert not verify_tier(fs.mountpoint / "tier").errors


# ── vanished tier ──────────────────────────────────────────────────────────────────────────────────────────


def test_an_unmounted_tier_is_a_tier_failure_and_nothing_on_it_is_lost(disk_tmp):
    need(kernel.missing_loop())
    size = 256 << 10
    keys = make_keys(12)
    with kernel.loop_fs("gone", 64 << 20) as fs:
        tier = fs.mountpoint / "tier"
        cfg = two_tier_config(tier, disk_tmp / "shared")
        with kvstream.open_store(cfg) as s:
            put_and_flush(s, keys[:8], size)
            assert s.drain(10)
            fs.detach()  # umount -l: the folder is an empty mount point from now on
            check_all(s, keys[:8], size)
            worst = put_and_flush(s, keys[8:], size)
            assert s.drain(10) and worst < 1.0
            local = s.stats().tiers["local"]
            assert local.read_errors >= 1 and local.circuit_opened >= 1
            assert local.chunks == 8 and local.missing_files == 0  # not forgotten: the files are fine
        fs.mount()
        with kvstream.open_store({**cfg, "router": "single:local"}) as s:
            check_all(s, keys[:8], size)
            assert s.stats().tiers["local"].read_chunks == 8
        assert not verify_tier(tier).errors


# ── a tier out of inodes; a shared tier whose mount is gone (issue 21, items 7 and 5) ──────────────────────


def _inodes_used(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_files - st.f_ffree


def test_a_tier_on_an_ext4_with_few_inodes_prunes_its_folders_and_once_full_is_down_not_fatal(disk_tmp):
    """An ext4 with 64 inodes under the first tier (capacity 8 chunks, each key in its own fan-out folder).
    Before the fix every key left two empty folders behind: the file system ran out of inodes after ~20 keys,
    copies failed, and the next open refused the whole store. Now emptied folders go with their last file, and
    a first tier that really is out of inodes opens down while the second serves."""
    need(kernel.missing_loop())
    size = 16 << 10
    keys = [bytes([i, 255 - i]) + bytes(14) for i in range(120)]
    from kvstream.format import file_size

    with kernel.loop_fs("inodes", 16 << 20, inodes=64) as fs:
        cfg = two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared")
        cfg["tiers"][0]["capacity_bytes"] = 8 * file_size(size)
        with kvstream.open_store(cfg) as s:
            peak = 0
            for i in range(0, len(keys), 4):
                put_and_flush(s, keys[i:i + 4], size)
                assert s.drain(20)
                peak = max(peak, _inodes_used(fs.mountpoint))
            local = s.stats().tiers["local"]
            assert local.write_errors == 0 and local.write_skipped_full == 0 and local.evicted_chunks == 112
            assert peak <= 56, f"{peak} inodes used: emptied fan-out folders are not removed"  # 46 seen; 64 without
        with kvstream.open_store(cfg) as s:  # reopens with every tier up
            assert s.stats().tiers["local"].down == ""
        # now fill every inode left with someone else's files
        junk = fs.mountpoint / "junk"
        junk.mkdir()
        n = 0
        with pytest.raises(OSError) as ei:
            while True:
                (junk / str(n)).touch()
                n += 1
        assert ei.value.errno == errno.ENOSPC
        with kvstream.open_store(cfg) as s:
            st = s.stats().tiers
            assert "No space left on device" in st["local"].down and s.health[0].state == "down"
            check_all(s, keys, size)  # every chunk from the shared tier
            put_and_flush(s, [b"\xee" * 16], size)
            assert s.drain(10) and s.stats().tiers["shared"].write_chunks == 1
        shutil.rmtree(junk)


def test_a_shared_tier_whose_file_system_is_unmounted_is_never_written_under(disk_tmp):
    """A real mount and a real unmount: the store opened while the shared file system is not mounted refuses
    (or, with skip_unmounted_tiers, runs without that tier), and creates nothing under the empty mount point;
    once the file system is mounted again its chunks are all there."""
    need(kernel.missing_loop())
    size = 64 << 10
    keys = make_keys(8)
    with kernel.loop_fs("unmounted", 64 << 20) as fs:
        cfg = two_tier_config(disk_tmp / "local", fs.mountpoint / "kvstream")
        cfg["tiers"][1]["shared"] = True  # require_mount by default
        cfg["node_state_path"] = str(disk_tmp / "node-id")
        with kvstream.open_store(cfg) as s:
            put_and_flush(s, keys, size)
            assert s.drain(10) and s.stats().tiers["shared"].write_chunks == 8
        fs.detach()
        assert list(fs.mountpoint.iterdir()) == []
        with pytest.raises(ConfigError, match=r"tiers\[1\]\.path.*root file system"):
            kvstream.open_store(cfg)
        with kvstream.open_store({**cfg, "skip_unmounted_tiers": True}) as s:
            assert "root file system" in s.stats().tiers["shared"].down
            check_all(s, keys, size)  # from local
            put_and_flush(s, make_keys(4, seed=5), size)
            assert s.drain(10)
        assert list(fs.mountpoint.iterdir()) == []  # nothing under the mount point, ever
        fs.mount()
        with kvstream.open_store({**cfg, "router": "single:shared"}) as s:
            assert s.stats().tiers["shared"].chunks == 8
            check_all(s, keys, size)


# ── a dead file system (XFS shutdown) and a frozen one (fsfreeze) ───────────────────────────────────────────


def test_a_file_system_that_dies_under_a_tier_serves_from_the_other_owes_its_copies_and_closes(disk_tmp):
    """XFS shutdown: every operation on the tier's file system fails with EIO from then on, as when its disk
    dies. Reads come from the other replica, new copies to the dead tier are skipped and owed (not silently
    dropped), puts never wait on it, and close() reports the dead tier instead of raising."""
    need(kernel.missing_xfs())
    size = 256 << 10
    keys = make_keys(12)
    with kernel.loop_fs("xfsdown", 320 << 20, fstype="xfs") as fs:
        cfg = two_tier_config(disk_tmp / "local", fs.mountpoint / "tier")  # the shared tier dies; the journal is local
        s = kvstream.open_store(cfg)
        put_and_flush(s, keys[:8], size)
        assert s.drain(10)
        fs.shutdown()
        check_all(s, keys[:8], size)
        worst = put_and_flush(s, keys[8:], size)
        assert s.drain(10) and worst < 1.0
        st = s.stats().tiers["shared"]
        assert st.write_errors + st.write_skipped_unhealthy == 4 and st.replicas_owed == 4
        report = s.close(timeout=5)
        assert report.drained and not report.stuck_tiers  # nothing hangs on a dead file system
        with kvstream.open_store(cfg) as again:  # a dead tier is opened down, named; the other one serves
            assert "Input/output error" in again.stats().tiers["shared"].down
            check_all(again, keys, size)  # every chunk is served from local
        with kvstream.open_store({**cfg, "tiers": cfg["tiers"][:1]}) as alone:
            check_all(alone, keys, size)


def test_a_frozen_file_system_never_holds_a_put_and_close_returns_naming_it(disk_tmp):
    """fsfreeze: creates and writes on the tier block until it is thawed. Puts and flushes return at once,
    reads are served, and close(timeout) returns after about the timeout naming the frozen tier; its copies
    land once it thaws (the background closer then closes the tier)."""
    need(kernel.missing_loop())
    need(None if shutil.which("fsfreeze") else "fsfreeze is not installed (util-linux)")
    size = 256 << 10
    keys = make_keys(8)
    with kernel.loop_fs("freeze", 64 << 20) as fs:
        cfg = two_tier_config(disk_tmp / "local", fs.mountpoint / "tier")
        s = kvstream.open_store(cfg)
        put_and_flush(s, keys[:4], size)
        assert s.drain(10)
        fs.freeze()
        try:
            worst = put_and_flush(s, keys[4:], size)
            assert worst < 1.0, f"a put+flush took {worst:.2f} s on a frozen tier"
            check_all(s, keys, size)
            t0 = time.monotonic()
            report = s.close(timeout=0.5)
            assert time.monotonic() - t0 < 3.0
            assert not report and report.stuck_tiers == ("shared",)
        finally:
            fs.unfreeze()
        deadline = time.monotonic() + 10
        while s.tiers[1].index._own_fd is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # the background closer finishes once the writes land
        assert s.tiers[1].index._own_fd is None
        with kvstream.open_store(cfg) as again:
            assert all(again.tiers[1].contains(k) for k in keys)  # the frozen copies landed after the thaw
        assert not verify_tier(fs.mountpoint / "tier").errors


# ── EIO from the device ────────────────────────────────────────────────────────────────────────────────────


def test_eio_from_the_device_reads_the_other_replica_and_quarantines_nothing(disk_tmp):
    need(kernel.missing_loop())
    size = 256 << 10
    keys = make_keys(12)
    with kernel.loop_fs("eio", 64 << 20) as fs:
        tier = fs.mountpoint / "tier"
        with kvstream.open_store(two_tier_config(tier, disk_tmp / "shared")) as s:
            s.health[0].cooldown_s = 0.2
            put_and_flush(s, keys, size)
            assert s.drain(10)
            cut = min(kernel.first_block(tier / DirectoryTier.relpath(k)) for k in keys) // 4096 * 4096
            fs.shrink(cut)  # every chunk's data is now past the end of the device
            try:
                check_all(s, keys, size)
                local = s.stats().tiers["local"]
                assert local.read_errors >= 1 and local.circuit_opened >= 1
                assert local.corrupt_chunks == 0 and local.chunks == 12  # EIO is not corruption
            finally:
                fs.restore_size()
            time.sleep(0.25)
            before = s.stats().tiers["local"].read_chunks
            # Probed back in with its full window (the probe forgets the speed measured while it failed), and the
            # step after the probe reads from it for certain (closing the breaker forgot that estimate too).
            check_all(s, keys, size)
            check_all(s, keys, size)
            assert s.stats().tiers["local"].read_chunks > before
        assert not list((tier / "quarantine").iterdir())
        assert not verify_tier(tier).errors


# ── a stalled device ───────────────────────────────────────────────────────────────────────────────────────


def test_a_throttled_device_is_hedged_and_taken_out_of_routing(disk_tmp):
    need(kernel.missing_loop())
    need(kernel.missing_blkio())
    size = 256 << 10
    keys = make_keys(16)
    with kernel.loop_fs("stall", 64 << 20) as fs:
        with kvstream.open_store(two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared", hedge_after_s=0.03)) as s:
            put_and_flush(s, keys, size)
            assert s.drain(10)
            bound = len(keys) * (size + 4096) / (1 << 20)  # seconds if every read waited for the 1 MiB/s tier
            with kernel.throttle_reads(fs.maj_min(), 1 << 20):
                steps = []
                for _ in range(40):
                    t0 = time.monotonic()
                    check_all(s, keys, size)
                    steps.append(time.monotonic() - t0)
                    if s.health[0].state == "open":
                        break
                    # the forward pass between steps: reads the slow tier still holds are older than
                    # hedge_after_s when the next step starts, a stall of the tier; once they are out past the
                    # breaker's floor (1 s) and the tier has delivered nothing to a step since, a failure
                    time.sleep(0.05)
                st = s.stats()
            assert max(steps) < bound / 3, (steps, bound)
            # its reads were taken over (hedged, or stolen by the other tier) and the tier is out of routing
            assert st.tiers["shared"].read_chunks >= len(steps) * len(keys) - 3
            assert st.tiers["local"].circuit == "open"


# ── device-mapper faults (where the kernel has device-mapper) ──────────────────────────────────────────────


@pytest.mark.parametrize("target", ["error", "flakey"])
def test_dm_eio_under_a_mounted_tier(disk_tmp, target):
    need(kernel.missing_loop())
    need(kernel.missing_dm(target))
    size = 256 << 10
    keys = make_keys(12)
    with kernel.loop_fs(f"dm-{target}", 64 << 20, dm=True) as fs:
        tier = fs.mountpoint / "tier"
        with kvstream.open_store(two_tier_config(tier, disk_tmp / "shared")) as s:
            put_and_flush(s, keys, size)
            assert s.drain(10)
            fs.dm_table(fs.table("error") if target == "error" else fs.table("flakey", 0, 60))
            try:
                check_all(s, keys, size)
                local = s.stats().tiers["local"]
                assert local.read_errors >= 1 and local.corrupt_chunks == 0 and local.chunks == 12
            finally:
                fs.dm_table(fs.table("linear"))


def test_dm_delay_stall_is_hedged(disk_tmp):
    need(kernel.missing_loop())
    need(kernel.missing_dm("delay"))
    size = 256 << 10
    keys = make_keys(16)
    with kernel.loop_fs("dm-delay", 64 << 20, dm=True) as fs:
        with kvstream.open_store(two_tier_config(fs.mountpoint / "tier", disk_tmp / "shared", hedge_after_s=0.03)) as s:
            put_and_flush(s, keys, size)
            assert s.drain(10)
            fs.dm_table(fs.table("delay", 2000))
            try:
                t0 = time.monotonic()
                check_all(s, keys, size)
                assert time.monotonic() - t0 < 1.5 and s.stats().hedged_reads >= 1
            finally:
                fs.dm_table(fs.table("linear"))


# ── EDQUOT (a non-root writer over its quota) ──────────────────────────────────────────────────────────────

_QUOTA_CHILD = r"""
import json, sys, numpy as np, kvstream
tier, n = sys.argv[1], int(sys.argv[2])
cfg = {"tiers": [{"name": "q", "path": tier, "capacity_bytes": "1GiB"}], "replication": "single",
       "memory_bytes": "32MiB", "io_engine": "threads"}
with kvstream.open_store(cfg) as s:
    for i in range(n):
        s.put(i.to_bytes(16, "little"), np.full(1 << 20, i % 251, np.uint8))
        s.flush()
    s.drain(30)
    print(json.dumps(s.stats().tiers["q"].as_dict()))
"""


def _set_block_quota(device: str, uid: int, kib: int) -> None:
    import ctypes

    class _DQ(ctypes.Structure):  # struct if_dqblk
        _fields_ = [(n, ctypes.c_uint64) for n in ("bh", "bs", "cs", "ih", "is_", "ci", "bt", "it")] + [
            ("valid", ctypes.c_uint32)]

    libc = ctypes.CDLL(None, use_errno=True)
    q = _DQ(bh=kib, bs=kib, valid=1)  # QIF_BLIMITS
    if libc.quotactl((0x800008 << 8) | 0, device.encode(), uid, ctypes.byref(q)) != 0:  # Q_SETQUOTA, USRQUOTA
        raise OSError(ctypes.get_errno(), "quotactl(Q_SETQUOTA)")


def test_edquot_for_a_writer_over_its_quota(disk_tmp):
    need(kernel.missing_quota())
    uid = 65534
    with kernel.loop_fs("quota", 96 << 20, quota=True) as fs:
        tier = fs.mountpoint / "tier"
        tier.mkdir(mode=0o700)
        os.chown(tier, uid, uid)
        _set_block_quota(str(fs.device), uid, 24 << 10)  # 24 MiB for a writer of 40 MiB
        r = subprocess.run([sys.executable, "-c", _QUOTA_CHILD, str(tier), "40"], capture_output=True, text=True,
                           timeout=120, preexec_fn=lambda: (os.setgroups([]), os.setgid(uid), os.setuid(uid)),
                           env={**os.environ, "PYTHONPATH": str(REPO / "src")})
        assert r.returncode == 0, r.stderr[-2000:]
        st = json.loads(r.stdout.strip().splitlines()[-1])
        assert st.write_retried_nospace >= 1 and st.evicted_chunks >= 1
        assert not verify_tier(tier).errors
