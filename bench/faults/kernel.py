"""Real kernel fault mechanisms for the root fault suite and the drills: a small loop-mounted ext4 per tier,
and ways to make it fail for real.

==================  ====================================================================================
fault               mechanism
==================  ====================================================================================
EIO on read         the loop device's size is cut below the chunk files (``LOOP_SET_STATUS64`` with a
                    ``lo_sizelimit``): the block layer fails every bio past the end with EIO, as a dead
                    disk region does; restored by setting the limit back to 0. With device-mapper:
                    a ``dm-error`` table swapped in under the mounted file system, or ``dm-flakey``.
stall               blkio (cgroup v1) throttle of the device for this process; with device-mapper:
                    ``dm-delay``.
ENOSPC              the file system is smaller than the tier's configured capacity.
EDQUOT              ext4 ``quota`` feature + ``usrquota`` (needs CONFIG_QUOTA and a non-root writer).
read-only tier      a read-only bind mount over the tier folder (``remount,ro`` of the whole file system
                    is refused while the store holds its index log open for writing).
vanished tier       ``umount -l`` while the store has it open (and mount again).
==================  ====================================================================================

Everything made here (images under /dev/shm, loop devices, dm devices, mounts under /mnt/kvs-fault-*,
cgroups) is named ``kvs-fault-<tag>-<pid>`` and torn down by the context manager's exit, also on error;
nothing else is touched. ``missing_*()`` return None when a mechanism is usable, else the exact reason.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["LoopFS", "loop_fs", "missing_root", "missing_loop", "missing_xfs", "missing_dm", "missing_blkio",
           "missing_quota", "first_block", "throttle_reads"]

_LOOP_SET_STATUS64 = 0x4C04
_LOOP_GET_STATUS64 = 0x4C05
_LOOP_INFO64 = "QQQQQIIII64s64s32sQQ"  # struct loop_info64; lo_sizelimit is field 4
_FIBMAP = 1
_BLKIO = Path("/sys/fs/cgroup/blkio")


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


# ── what this machine allows ───────────────────────────────────────────────────────────────────────────────


def missing_root() -> str | None:
    if os.geteuid() != 0:
        return f"not root (euid {os.geteuid()}): loop devices, mounts, device-mapper and cgroups need root"
    return None


def missing_loop() -> str | None:
    if (why := missing_root()) is not None:
        return why
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/dev/loop-control").exists():
        return "no /dev/loop-control: this kernel has no loop device driver"
    if not Path("/dev/shm").is_dir():
        return "no /dev/shm to hold the loop image"
    return None


def missing_xfs() -> str | None:
    """None if a loop-mounted XFS can be made here (``loop_fs(..., fstype="xfs")``) and shut down (``xfs_io``)."""
    if (why := missing_loop()) is not None:
        return why
    for tool in ("mkfs.xfs", "xfs_io"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt xfsprogs; scripts/setup.sh installs it)"
    return None


def missing_dm(target: str) -> str | None:
    """None if device-mapper with ``target`` (error, flakey, delay, linear) works here."""
    if (why := missing_root()) is not None:
        return why
    if shutil.which("dmsetup") is None:
        return "dmsetup is not installed"
    try:
        misc = Path("/proc/misc").read_text()
    except OSError:
        misc = ""
    if "device-mapper" not in misc:
        r = _run("dmsetup", "targets", check=False)
        first = (r.stderr or r.stdout).strip().splitlines()[:1]
        return (f"device-mapper is not in this kernel ({os.uname().release}): /proc/misc has no 'device-mapper' "
                f"entry; dmsetup says: {first[0] if first else 'nothing'}")
    r = _run("dmsetup", "targets", check=False)
    names = {line.split()[0] for line in r.stdout.splitlines() if line.strip()}
    if target not in names:
        return f"device-mapper has no '{target}' target here (targets: {', '.join(sorted(names)) or 'none'})"
    return None


def missing_blkio() -> str | None:
    if (why := missing_root()) is not None:
        return why
    ctl = _BLKIO / "blkio.throttle.read_bps_device"
    if not ctl.exists():
        return f"no cgroup v1 blkio throttling here ({ctl} is missing)"
    return None


# ── a loop-mounted ext4 ────────────────────────────────────────────────────────────────────────────────────


class LoopFS:
    """One small ext4 on a loop device (optionally under a dm-linear device), mounted at ``mountpoint``."""

    def __init__(self, tag: str, size_bytes: int, *, dm: bool = False, quota: bool = False,
                 fstype: str = "ext4", inodes: int | None = None) -> None:
        self.name = f"kvs-fault-{tag}-{os.getpid()}"
        self.fstype = fstype  # "ext4" or "xfs" (XFS for its shutdown ioctl: EIO on everything, like a dead disk)
        self.size_bytes = size_bytes
        self.workdir = Path("/dev/shm") / self.name
        self.image = self.workdir / "img"
        self.mountpoint = Path("/mnt") / self.name
        self.loop: str | None = None
        self.dm_name: str | None = self.name if dm else None
        self.dm_active = False
        self.device: str | None = None  # what is mounted: the loop or the dm device
        self.mounted = False
        self.quota = quota
        self._shrunk = False
        self._binds: list[Path] = []  # read-only bind mounts made by freeze_readonly()
        self.frozen = False  # fsfreeze -f: every write blocks until unfreeze()
        self.inodes = inodes  # ext4: this few inodes (mkfs -N; the kernel rounds it up per block group)

    # set-up and tear-down
    def setup(self) -> "LoopFS":
        self.workdir.mkdir(mode=0o700)
        with open(self.image, "wb") as f:
            f.truncate(self.size_bytes)
        self.loop = _run("losetup", "-f", "--show", "--direct-io=on", str(self.image)).stdout.strip()
        self.device = self.loop
        if self.dm_name:
            _run("dmsetup", "create", self.dm_name, "--table", self._linear())
            self.dm_active = True
            self.device = f"/dev/mapper/{self.dm_name}"
        features = "quota,^has_journal" if self.quota else "^has_journal"  # no journal: nothing hidden past a cut
        extended = "nodiscard" + (",quotatype=usrquota" if self.quota else "")
        if self.fstype == "xfs":
            _run("mkfs.xfs", "-q", "-f", str(self.device))
        else:
            few = ("-N", str(self.inodes)) if self.inodes else ()
            _run("mkfs.ext4", "-q", "-F", "-m", "0", "-b", "4096", *few, "-O", features, "-E", extended,
                 str(self.device))
        self.mountpoint.mkdir(mode=0o700)
        self.mount()
        return self

    def teardown(self) -> list[str]:
        """Undo everything, best effort, in reverse order; returns what could not be undone."""
        problems: list[str] = []
        if self.frozen:  # a frozen file system cannot be unmounted
            with contextlib.suppress(subprocess.CalledProcessError):
                self.unfreeze()
        if self._shrunk:
            try:
                self.restore_size()
            except OSError as exc:
                problems.append(f"restore loop size: {exc}")
        if self.dm_active:
            _run("dmsetup", "resume", self.dm_name, check=False)  # a suspended device cannot be unmounted
            with contextlib.suppress(subprocess.CalledProcessError):
                self.dm_table(self._linear())
        for path in reversed(self._binds):
            r = _run("umount", str(path), check=False)
            if r.returncode and _run("umount", "-l", str(path), check=False).returncode:
                problems.append(f"umount {path}: {r.stderr.strip()}")
        self._binds.clear()
        if self.mounted:
            r = _run("umount", str(self.mountpoint), check=False)
            if r.returncode:
                r = _run("umount", "-l", str(self.mountpoint), check=False)
            if r.returncode:
                problems.append(f"umount {self.mountpoint}: {r.stderr.strip()}")
            self.mounted = False
        if self.dm_active:
            r = _run("dmsetup", "remove", "--retry", self.dm_name, check=False)
            if r.returncode:
                problems.append(f"dmsetup remove {self.dm_name}: {r.stderr.strip()}")
            else:
                self.dm_active = False
        if self.loop:
            for _ in range(20):  # a lazily unmounted file system lets go of the device when its last file closes
                r = _run("losetup", "-d", self.loop, check=False)
                if r.returncode == 0:
                    break
                time.sleep(0.1)
            if r.returncode:
                problems.append(f"losetup -d {self.loop}: {r.stderr.strip()}")
            self.loop = None
        with contextlib.suppress(OSError):
            self.mountpoint.rmdir()
        shutil.rmtree(self.workdir, ignore_errors=True)
        return problems

    # mounts
    def mount(self, *opts: str) -> None:
        o = ",".join(("noatime", *opts, *(("usrquota",) if self.quota else ())))
        _run("mount", "-o", o, str(self.device), str(self.mountpoint))
        self.mounted = True

    def remount(self, mode: str) -> None:
        """``ro`` or ``rw``."""
        _run("mount", "-o", f"remount,{mode}", str(self.mountpoint))

    def freeze_readonly(self, path: Path) -> None:
        """Make ``path`` read-only from now on: a read-only bind mount over itself. Files already open for
        writing keep working (a plain ``remount,ro`` refuses while they exist); every new create fails EROFS."""
        _run("mount", "--bind", str(path), str(path))
        self._binds.append(path)
        _run("mount", "-o", "remount,bind,ro", str(path))

    def freeze(self) -> None:
        """``fsfreeze -f``: every write (and create) blocks until :meth:`unfreeze`; reads go on."""
        _run("fsfreeze", "-f", str(self.mountpoint))
        self.frozen = True

    def unfreeze(self) -> None:
        _run("fsfreeze", "-u", str(self.mountpoint))
        self.frozen = False

    def shutdown(self) -> None:
        """XFS only: ``xfs_io -x -c shutdown``: from now on every operation on the file system fails with EIO,
        as when a disk dies under it. Unmounting (tear-down) still works."""
        _run("xfs_io", "-x", "-c", "shutdown", str(self.mountpoint))

    def thaw(self, path: Path) -> None:
        _run("umount", str(path))
        self._binds.remove(path)

    def detach(self) -> None:
        """Lazily unmount (the tier vanishes under open files, as when a network mount drops)."""
        _run("umount", "-l", str(self.mountpoint))
        self.mounted = False

    # EIO by cutting the loop device short
    def _loop_status(self, sizelimit: int) -> None:
        assert self.loop is not None
        fd = os.open(self.loop, os.O_RDONLY)
        try:
            buf = bytearray(struct.calcsize(_LOOP_INFO64))
            fcntl.ioctl(fd, _LOOP_GET_STATUS64, buf)
            fields = list(struct.unpack(_LOOP_INFO64, buf))
            fields[4] = sizelimit
            fcntl.ioctl(fd, _LOOP_SET_STATUS64, struct.pack(_LOOP_INFO64, *fields))
        finally:
            os.close(fd)

    def shrink(self, size_bytes: int) -> None:
        """Every read or write past ``size_bytes`` of the device fails with EIO from now on."""
        self._shrunk = True
        self._loop_status(size_bytes)

    def restore_size(self) -> None:
        self._loop_status(0)
        self._shrunk = False

    # device-mapper
    def sectors(self) -> int:
        return self.size_bytes // 512

    def _linear(self) -> str:
        return f"0 {self.sectors()} linear {self.loop} 0"

    def dm_table(self, table: str) -> None:
        """Swap the dm table under the mounted file system (``linear``, ``error``, ``flakey``, ``delay`` lines)."""
        assert self.dm_name
        _run("dmsetup", "suspend", "--nolockfs", self.dm_name)
        try:
            _run("dmsetup", "load", self.dm_name, "--table", table)
        finally:
            _run("dmsetup", "resume", self.dm_name)

    def table(self, kind: str, *args: object) -> str:
        """A table over the whole device: ``table("error")``, ``table("delay", ms)``, ``table("flakey", up, down)``."""
        n = self.sectors()
        if kind == "linear":
            return self._linear()
        if kind == "error":
            return f"0 {n} error"
        if kind == "delay":
            return f"0 {n} delay {self.loop} 0 {int(args[0])}"
        if kind == "flakey":
            return f"0 {n} flakey {self.loop} 0 {int(args[0])} {int(args[1])}"
        raise ValueError(kind)

    def maj_min(self) -> str:
        st = os.stat(str(self.device))
        return f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"


@contextlib.contextmanager
def loop_fs(tag: str, size_bytes: int, *, dm: bool = False, quota: bool = False,
            fstype: str = "ext4", inodes: int | None = None) -> Iterator[LoopFS]:
    """A :class:`LoopFS`, set up and always torn down. Raises RuntimeError if tear-down left something behind."""
    fs = LoopFS(tag, size_bytes, dm=dm, quota=quota, fstype=fstype, inodes=inodes)
    try:
        fs.setup()
        yield fs
    finally:
        problems = fs.teardown()
        if problems:
            raise RuntimeError("fault suite tear-down incomplete: " + "; ".join(problems))


def missing_quota() -> str | None:
    """None if an ext4 with the quota feature mounts here (EDQUOT can then be made for a non-root writer)."""
    if (why := missing_loop()) is not None:
        return why
    try:
        with loop_fs("quota-probe", 16 << 20, quota=True):
            return None
    except subprocess.CalledProcessError as exc:
        log = _run("dmesg", check=False).stdout if shutil.which("dmesg") else ""
        tail = [line for line in log.splitlines() if "quota" in line.lower()][-1:]
        return (f"an ext4 with the quota feature does not mount here ({' '.join(exc.cmd[:2])} failed"
                f"{'; kernel: ' + tail[0].split('] ', 1)[-1] if tail else ''})")
    except RuntimeError as exc:
        return str(exc)


def first_block(path: Path) -> int:
    """Byte offset on the device of the file's first block (FIBMAP; root only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        blk = struct.unpack("i", fcntl.ioctl(fd, _FIBMAP, struct.pack("i", 0)))[0]
        return blk * os.fstatvfs(fd).f_bsize
    finally:
        os.close(fd)


@contextlib.contextmanager
def throttle_reads(maj_min: str, bytes_per_s: int, tag: str = "stall") -> Iterator[None]:
    """Throttle this process's reads of one device (blkio cgroup v1) for the ``with`` body."""
    group = _BLKIO / f"kvs-fault-{tag}-{os.getpid()}"
    own = next((line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if line.split(":")[1] == "blkio"), "/")
    home = _BLKIO / own.lstrip("/") / "cgroup.procs"
    group.mkdir()
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{maj_min} {bytes_per_s}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            home.write_text(f"{os.getpid()}\n")
    finally:
        for _ in range(50):
            try:
                group.rmdir()
                break
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.05)

