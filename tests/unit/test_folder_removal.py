"""The replay's background removal of a finished run's tier folders (kvstream.commands._folder_removal): the
folders go, a name can be reused at once, and nothing measured starts before the removal has finished."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from kvstream.commands import _folder_removal
from kvstream.commands._folder_removal import FolderRemoval


def _fill(d: Path, n: int = 3) -> None:
    (d / "chunks" / "ab").mkdir(parents=True)
    for i in range(n):
        (d / "chunks" / "ab" / f"{i}.kvc").write_bytes(b"x" * 4096)


def _gated_rmtree(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every rmtree of the removal blocks until ``gate`` is set; ``entered`` is set once one has begun."""
    gate = threading.Event()
    entered = threading.Event()
    real = _folder_removal.shutil.rmtree

    def slow_rmtree(path: Path, ignore_errors: bool = False) -> None:
        entered.set()
        assert gate.wait(10)
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(_folder_removal.shutil, "rmtree", slow_rmtree)
    return gate, entered


def test_folders_are_gone_after_wait_and_the_name_is_free_at_once(tmp_path: Path) -> None:
    a, b = tmp_path / "replay-kvstream", tmp_path / "replay-lmcache-like"
    _fill(a)
    _fill(b)
    removal = FolderRemoval()
    aside = removal.start([a, b, tmp_path / "never-made"])
    # renamed aside before start returns: a run that reuses the name makes a fresh folder, never one being deleted
    assert not a.exists() and not b.exists() and len(aside) == 2
    a.mkdir()
    (a / "new").write_bytes(b"new run")
    removal.wait()
    assert not any(p.exists() for p in aside)
    assert (a / "new").read_bytes() == b"new run"  # the new run's folder of the same name was not touched


def test_wait_blocks_until_the_removal_has_finished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The guarantee the replay's measurements rest on: wait() returns only after the deletion is over (here the
    rmtree is held until the test lets it go: wait must not return before)."""
    gate, entered = _gated_rmtree(monkeypatch)
    d = tmp_path / "replay-kvstream"
    _fill(d)
    removal = FolderRemoval()
    aside = removal.start([d])
    assert entered.wait(10)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (removal.wait(), done.set()))
    waiter.start()
    assert not done.wait(0.3)  # still deleting: wait() has not returned
    assert aside[0].exists()
    gate.set()
    assert done.wait(10)
    waiter.join()
    assert not aside[0].exists()


def test_a_second_start_waits_for_the_first(tmp_path: Path) -> None:
    removal = FolderRemoval()
    first, second = tmp_path / "one", tmp_path / "two"
    _fill(first)
    _fill(second)
    a1 = removal.start([first])
    a2 = removal.start([second])
    assert not any(p.exists() for p in a1)  # the first was finished before the second began
    removal.wait()
    assert not any(p.exists() for p in a2)
    removal.wait()  # nothing in flight: returns at once


def test_held_folders_are_untouched_until_begin_and_quiet_does_not_delete_them(tmp_path: Path) -> None:
    """A round's last run's folders are held while the next probe runs: renamed aside at once, their files left
    alone (no deletion beside the probe), then deleted by begin() (the next run's set-up) or wait()."""
    d = tmp_path / "replay-kvstream"
    _fill(d)
    removal = FolderRemoval()
    aside = removal.hold([d])
    assert not d.exists() and len(aside) == 1
    removal.quiet()  # what the probe waits for: nothing in flight; the held folder stays
    assert (aside[0] / "chunks" / "ab" / "0.kvc").read_bytes() == b"x" * 4096
    probe = tmp_path / "replay-probe"
    _fill(probe)
    aside += removal.hold([probe])  # the probe's own folder joins the held set
    removal.begin()
    removal.wait()
    assert not any(p.exists() for p in aside)


def test_wait_deletes_what_is_held_even_without_begin(tmp_path: Path) -> None:
    # The replay's finally: whatever was held when a run failed is deleted before the command returns.
    d = tmp_path / "replay-lmcache-like"
    _fill(d)
    removal = FolderRemoval()
    aside = removal.hold([d])
    removal.wait()
    assert not aside[0].exists()
    removal.begin()  # nothing held: no thread
    removal.quiet()


def test_begin_waits_for_the_deletion_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At most one deletion at a time: begin() with one in flight returns only once it has finished."""
    gate, entered = _gated_rmtree(monkeypatch)
    first, second = tmp_path / "one", tmp_path / "two"
    _fill(first)
    _fill(second)
    removal = FolderRemoval()
    a1 = removal.start([first])
    assert entered.wait(10)
    removal.hold([second])
    done = threading.Event()
    beginner = threading.Thread(target=lambda: (removal.begin(), done.set()))
    beginner.start()
    assert not done.wait(0.3)  # the first is still being deleted
    gate.set()
    assert done.wait(10)
    beginner.join()
    assert not any(p.exists() for p in a1)
    removal.wait()


def test_folders_on_two_devices_are_deleted_side_by_side(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay's local tier (disk) and emulated shared tier (RAM) are deleted by a thread each: the RAM folder
    does not wait behind the disk's deletion; two folders on one device go one after the other."""
    import os
    import tempfile

    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("needs /dev/shm on a device other than the test's tmp_path")
    ram = Path(tempfile.mkdtemp(dir=shm, prefix="kvstream-test-removal-"))
    gate = threading.Event()
    order: list[str] = []
    real = _folder_removal.shutil.rmtree

    def gated_rmtree(path: Path, ignore_errors: bool = False) -> None:
        order.append(Path(path).name.split(".removing-")[0])
        if Path(path).is_relative_to(tmp_path):
            assert gate.wait(10)  # the disk's deletion is held until the RAM folder is gone
        real(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(_folder_removal.shutil, "rmtree", gated_rmtree)
    disk_a, disk_b, ram_d = tmp_path / "local-a", tmp_path / "local-b", ram / "shared"
    for d in (disk_a, disk_b, ram_d):
        _fill(d)
    removal = FolderRemoval()
    try:
        aside = removal.start([disk_a, ram_d, disk_b])
        ram_aside = next(p for p in aside if p.is_relative_to(ram))
        for _ in range(200):  # the RAM folder goes while the disk's thread is held
            if not ram_aside.exists():
                break
            threading.Event().wait(0.02)
        assert not ram_aside.exists()
        assert order.count("local-a") == 1 and "local-b" not in order  # one device: one folder at a time
        gate.set()
        removal.wait()
        assert not any(p.exists() for p in aside) and order.index("local-a") < order.index("local-b")
    finally:
        gate.set()
        removal.wait()
        real(ram, ignore_errors=True)


def test_folders_left_aside_by_a_stopped_replay_are_found_and_deleted_as_they_are(tmp_path: Path) -> None:
    from kvstream.commands._folder_removal import left_aside

    stale = tmp_path / "replay-kvstream.removing-0badc0de"
    probe = tmp_path / "replay-probe.removing-12345678"
    live = tmp_path / "replay-lmcache-like"  # a run's folder, not renamed aside: not stale
    other = tmp_path / "mine.removing-00000000"  # not a replay's
    for d in (stale, probe, live, other):
        _fill(d)
    found = left_aside(tmp_path, "replay-")
    assert found == [stale, probe] or found == sorted([stale, probe])
    removal = FolderRemoval()
    aside = removal.start(found)
    assert aside == found  # deleted under their own names: not renamed aside a second time
    removal.wait()
    assert not stale.exists() and not probe.exists() and live.exists() and other.exists()
    assert left_aside(tmp_path / "missing", "replay-") == []
