"""Is a tier's folder on the file system it is meant to be on? (Checked at open, before anything is created.)

Why: a shared tier lives on a mounted network or parallel file system (``/lustre/kvstream``). If a node starts
before that file system is mounted, its mount point is an empty folder on the root disk, and with
``create_dirs`` (LMCache's default) the store used to create the tier there and run as if it were shared: every
copy written to the root disk, invisible to the other nodes, and hidden under the real mount once it comes up.

The check looks at the file system that holds the tier folder, or would hold it: that of the folder's nearest
existing ancestor (``st_dev``), and finds that file system's mount point (the highest ancestor on the same
device, stopping at a mount point). With ``require_mount`` (the default for ``shared: true`` tiers) that mount
point must not be ``/``: a tier folder on the root file system is refused. With ``mount_point: PATH`` the file
system must be the one mounted exactly at PATH. Nothing is created when the check fails.

Limits: a file system mounted elsewhere than ``/`` but not the intended one (``/var`` on its own disk, the tier
meant for ``/var/lib/pfs``) passes ``require_mount``; name the mount with ``mount_point`` for that.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["nearest_existing", "mount_point_of", "mount_problem", "MountEntry", "mount_entries", "mount_entry",
           "mount_source", "mount_options", "online_discard", "discard_note"]


def nearest_existing(path: Path) -> Path:
    """``path`` if it exists, else its nearest existing ancestor. Raises ``OSError`` if one cannot be looked
    at (a dead FUSE mount: ENOTCONN)."""
    p = Path(os.path.abspath(path))
    while True:
        try:
            os.stat(p)
            return p
        except FileNotFoundError:
            if p.parent == p:
                return p
            p = p.parent


def mount_point_of(path: Path) -> Path:
    """The mount point of the file system holding the existing ``path`` (symbolic links resolved)."""
    p = Path(os.path.realpath(path))
    dev = os.stat(p).st_dev
    while p.parent != p:
        if os.path.ismount(p):
            return p
        if os.stat(p.parent).st_dev != dev:
            return p
        p = p.parent
    return p


def mount_problem(folder: Path, *, require_mount: bool, mount_point: str | None) -> str | None:
    """Why the tier folder ``folder`` is not (or would not be) on the file system it must be on, or None.
    Raises ``OSError`` if the folder's ancestors cannot be examined."""
    if not require_mount and mount_point is None:
        return None
    here = nearest_existing(folder)
    mp = mount_point_of(here)
    what = "is" if here == Path(os.path.abspath(folder)) else f"would be created (under {here})"
    if mount_point is not None:
        want = Path(os.path.abspath(mount_point))
        if not os.path.ismount(want):
            return (f"{folder} must be on the file system mounted at {want} (mount_point), but nothing is mounted "
                    f"there: mount it, then open the store again (nothing was created)")
        if mp != Path(os.path.realpath(want)):
            return (f"{folder} {what} on the file system mounted at {mp}, not on the one mounted at {want} "
                    "(mount_point): nothing was created")
        return None
    if mp == Path("/"):
        return (f"{folder} {what} on the root file system (/), not on a mounted file system: is the file system "
                "meant for this tier mounted? Mount it and open the store again (nothing was created), or set "
                "require_mount: false if this tier is meant to be on the root disk")
    return None


@dataclass(frozen=True)
class MountEntry:
    """One line of ``/proc/self/mountinfo``: a mount of a file system."""

    device: str  # the file system's device number, "major:minor" (st_dev of every file on it)
    point: Path  # where it is mounted
    options: frozenset[str]  # option names, the mount's own and its super block's: discard, ro, relatime
    fstype: str
    source: str  # /dev/vda, a remote name (host:/export), or a pseudo name (tmpfs, overlay)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in names as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_entries(mountinfo: Path = Path("/proc/self/mountinfo")) -> list[MountEntry]:
    """Every mount ``mountinfo`` lists, in its order; empty when it cannot be read (not Linux, a sandbox). Lines
    that are not in mountinfo's format are skipped."""
    try:
        lines = mountinfo.read_text().splitlines()
    except OSError:
        return []
    entries = []
    for line in lines:
        fields = line.split()
        # id parent major:minor root mount_point mount_options [optional...] - fstype source super_options
        if len(fields) < 10 or "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        if len(fields) < sep + 3:
            continue
        names = {o.split("=", 1)[0] for o in fields[5].split(",")}
        if len(fields) > sep + 3:
            names |= {o.split("=", 1)[0] for o in fields[sep + 3].split(",")}
        entries.append(MountEntry(device=fields[2], point=Path(_unescape(fields[4])), options=frozenset(names),
                                  fstype=fields[sep + 1], source=_unescape(fields[sep + 2])))
    return entries


def _device(st_dev: int) -> str:
    return f"{os.major(st_dev)}:{os.minor(st_dev)}"


def mount_entry(path: Path, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> MountEntry | None:
    """The mount holding ``path`` (or its nearest existing ancestor), or None when mountinfo cannot be read or
    does not list it. Of several mounts of one file system (bind mounts), the one whose mount point is the longest
    prefix of the path. Raises ``OSError`` if the path's ancestors cannot be examined."""
    here = Path(os.path.realpath(nearest_existing(path)))
    want = _device(os.stat(here).st_dev)
    holding = [e for e in mount_entries(mountinfo) if e.device == want and (e.point == here or e.point in here.parents)]
    return max(holding, key=lambda e: len(e.point.parts), default=None)


def mount_source(st_dev: int, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """The source (``/dev/...``, a remote name) of the first mount of the file system with device number
    ``st_dev``, or None. Used for anonymous device numbers (btrfs, overlay), which sysfs does not name."""
    want = _device(st_dev)
    return next((e.source for e in mount_entries(mountinfo) if e.device == want), None)


def mount_options(path: Path, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> frozenset[str]:
    """The option names of the mount holding ``path`` (:func:`mount_entry`): empty when it cannot be found."""
    entry = mount_entry(path, mountinfo=mountinfo)
    return entry.options if entry else frozenset()


def online_discard(path: Path, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> bool:
    """Whether the file system holding ``path`` is mounted with online ``discard``: every freed block is discarded
    as it is freed. On the project's VM (ext4 on a virtio disk) that made each write into a new chunk file cost the
    disk about twice a write in place (BENCHMARKS §1.5); the usual advice is ``nodiscard`` and a periodic
    ``fstrim``."""
    return "discard" in mount_options(path, mountinfo=mountinfo)


def discard_note(label: str, folder: Path, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> str | None:
    """What ``kvstream replay`` and ``kvstream probe`` say of a tier folder on a file system mounted with online
    ``discard`` (:func:`online_discard`), or None (not such a mount, or it cannot be looked at). ``label``: how the
    tier is named in the note (``tier 'local'``)."""
    try:
        entry = mount_entry(folder, mountinfo=mountinfo)
    except OSError:
        return None
    if entry is None or "discard" not in entry.options:
        return None
    return (f"{label} ({folder}) is on a file system mounted with online discard ({entry.point}): on the project's "
            "VM that made every new chunk file write at about half the speed of a write in place, and reads beside "
            "those writes slower (BENCHMARKS 1.5). For serving, mount it with nodiscard and run fstrim periodically.")
