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
    monkeypatch.setattr(mounts, "online_discard", lambda p: True)
    note = mounts.discard_note("tier 'local'", tmp_path / "tier")
    assert note is not None and note.startswith(f"tier 'local' ({tmp_path / 'tier'}) is on a file system mounted")
    assert "nodiscard" in note and "fstrim" in note
    monkeypatch.setattr(mounts, "online_discard", lambda p: False)
    assert mounts.discard_note("tier 'local'", tmp_path) is None

    def unreadable(p: Path) -> bool:
        raise PermissionError(13, "denied")

    monkeypatch.setattr(mounts, "online_discard", unreadable)
    assert mounts.discard_note("tier 'local'", tmp_path) is None


@pytest.mark.parametrize("discard", [True, False])
def test_the_replay_notes_a_tier_on_a_discard_mount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, discard: bool):
    local, shared = tmp_path / "local", tmp_path / "shared"
    monkeypatch.setattr(mounts, "online_discard", lambda p: discard and p == local)
    notes = replay.discard_notes([("local", local), ("shared", shared)])
    if discard:
        assert len(notes) == 1 and "'local'" in notes[0] and "nodiscard" in notes[0] and "fstrim" in notes[0]
    else:
        assert notes == []
