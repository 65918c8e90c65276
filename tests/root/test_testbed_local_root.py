"""``bench/testbed up --local-size``: the node-local tier made the way operators are advised to mount one (issue 20:
on this VM's root file system, mounted ``discard``, writes into new chunk files cost twice a write in place;
BENCHMARKS §1.5). Root only: loop devices, mounts and a blkio cgroup. Small sizes, a few seconds."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream.tiers.mounts import mount_entry, online_discard

REPO = Path(__file__).resolve().parents[2]
TESTBED = REPO / "bench" / "testbed"
sys.path.insert(0, str(REPO / "bench" / "faults"))
import kernel  # noqa: E402

pytestmark = pytest.mark.root

LOCAL = Path("/mnt/kvs-local")
IMAGE = Path("/var/tmp/kvs-local/img")


def _testbed(state: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(TESTBED), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "KVS_TESTBED_STATE": str(state)})


@pytest.fixture
def state(tmp_path: Path):
    for why in (kernel.missing_root(), kernel.missing_loop(), kernel.missing_blkio()):
        if why is not None:
            pytest.skip(why)
    for busy in (Path("/mnt/kvs-shared"), LOCAL):
        if os.path.ismount(busy):
            pytest.skip(f"{busy} is mounted (a testbed is up on this machine): the test would not touch it")
    st = tmp_path / "testbed.state"
    yield st
    _testbed(st, "down")


def test_the_local_tier_is_a_nodiscard_file_system_on_a_written_image_and_down_removes_it(state: Path):
    up = _testbed(state, "up", "--size", "64M", "--read-bps", "0", "--local-size", "96M")
    assert up.returncode == 0, up.stderr
    assert up.stdout.strip().splitlines()[-1] == "/mnt/kvs-shared"  # what scripts read stays the last line
    assert "mounted nodiscard at /mnt/kvs-local" in up.stderr
    entry = mount_entry(LOCAL)
    assert entry is not None and entry.point == LOCAL and entry.fstype == "ext4"
    assert not online_discard(LOCAL)
    loop = Path(entry.source)
    assert (Path("/sys/block") / loop.name / "loop" / "dio").read_text().strip() == "1"
    # every block of the image was written: its allocated size is its length (no holes left to allocate later)
    st = IMAGE.stat()
    assert st.st_size == 96 << 20 and st.st_blocks * 512 >= st.st_size
    status = _testbed(state, "status")
    assert status.returncode == 0 and "local tier : /mnt/kvs-local" in status.stdout, status.stdout
    # a direct-I/O write and read back on it, as the tier does
    fd = os.open(LOCAL / "probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
    try:
        import mmap
        buf = mmap.mmap(-1, 1 << 20)
        buf.write(b"k" * (1 << 20))
        assert os.pwritev(fd, [buf], 0) == 1 << 20
        back = mmap.mmap(-1, 1 << 20)
        assert os.preadv(fd, [back], 0) == 1 << 20 and back[:] == buf[:]
    finally:
        os.close(fd)
    again = _testbed(state, "up", "--local-size", "96M")  # idempotent
    assert again.returncode == 0, again.stderr
    down = _testbed(state, "down")
    assert down.returncode == 0, down.stderr
    assert not os.path.ismount(LOCAL) and not IMAGE.exists()
    assert str(loop) not in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout


def test_a_bad_local_size_is_refused_before_anything_is_made(state: Path):
    bad = _testbed(state, "up", "--size", "64M", "--local-size", "lots")
    assert bad.returncode != 0 and "--local-size must look like 16G or 512M, got 'lots'" in bad.stderr
    assert not state.exists() and not os.path.ismount("/mnt/kvs-shared") and not IMAGE.exists()


def test_a_testbed_up_without_a_local_tier_says_how_to_get_one(state: Path):
    assert _testbed(state, "up", "--size", "64M", "--read-bps", "0").returncode == 0
    more = _testbed(state, "up", "--local-size", "96M")
    assert more.returncode != 0 and "down', then up again with --local-size" in more.stderr
    assert not os.path.ismount(LOCAL)
