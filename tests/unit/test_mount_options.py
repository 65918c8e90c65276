"""Mount options of a tier's file system (:func:`kvstream.tiers.mounts.mount_options`, ``online_discard``) and the
replay's note for a tier on a file system mounted with online discard (issue 20: on the project's VM that halves
the speed of every new chunk file's write; BENCHMARKS §1.5)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvstream.commands import replay
from kvstream.tiers import mounts
from kvstream.tiers.mounts import mount_options, online_discard


def _line(n: int, dev: int, point: str, opts: str, sup: str) -> str:
    return f"{n} 1 {os.major(dev)}:{os.minor(dev)} / {point} {opts} shared:1 - ext4 /dev/vdz {sup}"


def _mountinfo(tmp_path: Path, *lines: str) -> Path:
    p = tmp_path / "mountinfo"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_the_mount_and_super_block_options_are_both_read(tmp_path: Path):
    dev = os.stat(tmp_path).st_dev
    mi = _mountinfo(tmp_path, _line(20, dev, "/", "rw,relatime", "rw,discard,errors=remount-ro"))
    assert mount_options(tmp_path / "not-yet" / "made", mountinfo=mi) >= {"rw", "relatime", "discard", "errors"}
    assert online_discard(tmp_path, mountinfo=mi)


def test_no_discard_and_other_devices_ignored(tmp_path: Path):
    dev = os.stat(tmp_path).st_dev
    other = os.makedev(os.major(dev) + 7, os.minor(dev) + 3)
    mi = _mountinfo(tmp_path, _line(20, other, "/", "rw", "rw,discard"), _line(21, dev, "/", "rw,relatime", "rw"))
    assert not online_discard(tmp_path, mountinfo=mi)
    assert mount_options(tmp_path, mountinfo=mi) == {"rw", "relatime"}


def test_of_two_mounts_of_one_file_system_the_deepest_holding_the_path_counts(tmp_path: Path):
    dev = os.stat(tmp_path).st_dev
    deep = str(Path(os.path.realpath(tmp_path)).parent)
    mi = _mountinfo(tmp_path, _line(20, dev, "/", "rw", "rw,discard"), _line(21, dev, deep, "rw,noatime", "rw"),
                    _line(22, dev, "/somewhere/else", "ro", "ro,discard"))
    assert mount_options(tmp_path, mountinfo=mi) == {"rw", "noatime"}


def test_an_unreadable_mountinfo_says_nothing(tmp_path: Path):
    assert mount_options(tmp_path, mountinfo=tmp_path / "missing") == frozenset()
    assert not online_discard(tmp_path, mountinfo=tmp_path / "missing")


def test_the_note_names_the_tier_its_folder_and_the_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    dev = os.stat(tmp_path).st_dev
    point = str(tmp_path.parent)
    mi = _mountinfo(tmp_path, _line(20, dev, "/", "rw", "rw"), _line(21, dev, point, "rw,discard", "rw"))
    note = mounts.discard_note("tier 'local'", tmp_path / "tier", mountinfo=mi)
    assert note is not None and note.startswith(f"tier 'local' ({tmp_path / 'tier'}) is on a file system mounted")
    assert f"({point})" in note, "the note names the mount found, not the root"
    assert "nodiscard" in note and "fstrim" in note
    quiet = _mountinfo(tmp_path, _line(20, dev, "/", "rw", "rw"))
    assert mounts.discard_note("tier 'local'", tmp_path, mountinfo=quiet) is None
    assert mounts.discard_note("tier 'local'", tmp_path, mountinfo=tmp_path / "missing") is None

    def unreadable(p: Path) -> Path:
        raise PermissionError(13, "denied")

    monkeypatch.setattr(mounts, "nearest_existing", unreadable)
    assert mounts.discard_note("tier 'local'", tmp_path, mountinfo=mi) is None


def test_mountinfo_lines_are_parsed_with_their_escapes(tmp_path: Path):
    mi = _mountinfo(tmp_path,
                    "36 35 98:0 /mnt1 /mnt/my\\040disk rw,noatime master:1 - ext3 /dev/root\\040x rw,errors=continue",
                    "not a mountinfo line",
                    "37 35 0:5 / /proc rw shared:2 -",  # cut short: no type, no source
                    "38 35 0:31 / /srv/pfs rw - fuse.glusterfs node1:/kv rw,user_id=0")
    entries = mounts.mount_entries(mi)
    assert [(e.device, e.point, e.fstype, e.source) for e in entries] == [
        ("98:0", Path("/mnt/my disk"), "ext3", "/dev/root x"), ("0:31", Path("/srv/pfs"), "fuse.glusterfs", "node1:/kv")]
    assert entries[0].options == {"rw", "noatime", "errors"}
    assert mounts.mount_entries(tmp_path / "missing") == []


def test_the_mount_source_of_a_device_number(tmp_path: Path):
    """What ``kvstream probe`` looks up for an anonymous device number (btrfs, overlay): the first mount's source."""
    mi = _mountinfo(tmp_path, "40 1 0:44 / /data rw - btrfs /dev/nvme0n1p2 rw",
                    "41 1 0:44 /snap /snap rw - btrfs /dev/nvme0n1p2 rw", "42 1 0:45 / /merged rw - overlay overlay rw")
    assert mounts.mount_source(os.makedev(0, 44), mountinfo=mi) == "/dev/nvme0n1p2"
    assert mounts.mount_source(os.makedev(0, 45), mountinfo=mi) == "overlay"
    assert mounts.mount_source(os.makedev(0, 46), mountinfo=mi) is None
    assert mounts.mount_source(os.makedev(0, 44), mountinfo=tmp_path / "missing") is None


def test_the_real_mount_table_holds_every_existing_folder(tmp_path: Path):
    """On the machine the tests run on: the mount found for a folder is on its device and is one of its ancestors."""
    if not Path("/proc/self/mountinfo").is_file():
        pytest.fail("no /proc/self/mountinfo: the tests run on Linux")
    entry = mounts.mount_entry(tmp_path)
    assert entry is not None
    st = os.stat(tmp_path)
    assert entry.device == f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    assert entry.point == tmp_path.resolve() or entry.point in tmp_path.resolve().parents


@pytest.mark.parametrize("discard", [True, False])
def test_the_replay_notes_a_tier_on_a_discard_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, discard: bool):
    local, shared = tmp_path / "local", tmp_path / "shared"
    dev = os.stat(tmp_path).st_dev
    mi = _mountinfo(tmp_path, _line(20, dev, "/", "rw", "rw,discard" if discard else "rw"))
    real_entry = mounts.mount_entry

    def entry(p: Path, mountinfo: Path = mi) -> mounts.MountEntry | None:  # discard only for the local tier
        return real_entry(p, mountinfo=mi) if p == local else None

    monkeypatch.setattr(mounts, "mount_entry", entry)
    notes = replay.discard_notes([("local", local), ("shared", shared)])
    if discard:
        assert len(notes) == 1 and "'local'" in notes[0] and "nodiscard" in notes[0] and "fstrim" in notes[0]
    else:
        assert notes == []
