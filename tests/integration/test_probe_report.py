"""`kvstream probe`: the same-device warning and the progress bar; `kvstream report`: how each result was made."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path

import pytest

from kvstream.cli import main
from kvstream.commands import probe as probe_mod
from kvstream.commands.probe import disks_behind, probe, same_device_warnings
from kvstream.tiers.mounts import discard_note, online_discard
from kvstream.io import make_engine


# -- same device --------------------------------------------------------------------------------------------------
def test_two_folders_of_one_file_system_are_warned_about(disk_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = disk_tmp / "a", disk_tmp / "b"
    a.mkdir()
    b.mkdir()
    warnings = same_device_warnings([a, b])
    assert len(warnings) == 1 and str(a) in warnings[0] and str(b) in warnings[0]
    assert "same file system" in warnings[0] and "not two channels" in warnings[0]
    assert same_device_warnings([a]) == []
    rc = main(["probe", str(a), str(b), "--size", "64K", "--total", "256K", "--depth", "2", "--engine", "threads",
               "--json"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert json.loads(out)["warnings"] == warnings
    # the discard note is said of every folder on a discard mount (this machine's disk may be one), nothing else
    notes = json.loads(out)["notes"]
    assert notes == ([discard_note("tier folder", a), discard_note("tier folder", b)] if online_discard(a) else [])
    assert err.splitlines() == [f"probe: warning: {warnings[0]}"] + [f"probe: note: {n}" for n in notes]  # no bar


def test_different_file_systems_without_a_common_disk_are_not_warned_about(disk_tmp: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(disk_tmp).st_dev:
        pytest.skip("needs /dev/shm on a file system of its own")
    assert disks_behind(shm) == frozenset()  # tmpfs: no block device behind it
    assert same_device_warnings([disk_tmp, shm]) == []


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(target, link.parent))


def _fake_sysfs(root: Path, dev_a: int, dev_b: int, loop_file: Path) -> Path:
    """A sysfs with the shape the kernel gives it: ``dev_a`` is an LVM volume (dm-0) over sda2 and sdb1,
    ``dev_b`` is partition sda1 of the same disk sda, and loop0 is backed by ``loop_file``."""
    sys_ = root / "sys"
    blk = sys_ / "devices" / "pci0000:00" / "block"
    for part, disk in (("sda1", "sda"), ("sda2", "sda"), ("sdb1", "sdb")):
        (blk / disk / part).mkdir(parents=True)
        (blk / disk / part / "partition").write_text("1\n")
    dm = sys_ / "devices" / "virtual" / "block" / "dm-0"
    _link(dm / "slaves" / "sda2", blk / "sda" / "sda2")
    _link(dm / "slaves" / "sdb1", blk / "sdb" / "sdb1")
    loop = sys_ / "devices" / "virtual" / "block" / "loop0"
    (loop / "loop").mkdir(parents=True)
    (loop / "loop" / "backing_file").write_text(f"{loop_file}\n")
    _link(sys_ / "dev" / "block" / f"{os.major(dev_a)}:{os.minor(dev_a)}", dm)
    _link(sys_ / "dev" / "block" / f"{os.major(dev_b)}:{os.minor(dev_b)}", blk / "sda" / "sda1")
    return sys_


def test_file_systems_on_one_disk_are_found_through_partitions_lvm_and_loop_files(disk_tmp: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or os.stat(shm).st_dev == os.stat(disk_tmp).st_dev:
        pytest.skip("needs two file systems (here: the test folder's and /dev/shm)")
    img = disk_tmp / "disk.img"
    img.write_bytes(b"")
    sysfs = _fake_sysfs(disk_tmp, os.stat(disk_tmp).st_dev, os.stat(shm).st_dev, img)
    assert disks_behind(disk_tmp, sysfs=sysfs) == {"sda", "sdb"}  # dm-0's slaves, each partition's disk
    assert disks_behind(shm, sysfs=sysfs) == {"sda"}
    # a loop device's disks are those of the file system its backing file lives on (here: dm-0's)
    loop0 = (sysfs / "devices" / "virtual" / "block" / "loop0").resolve()
    assert probe_mod._whole_disks(loop0, sysfs, 0) == {"sda", "sdb"}
    warnings = same_device_warnings([disk_tmp, shm], sysfs=sysfs)
    assert len(warnings) == 1 and "different file systems on the same disk (sda)" in warnings[0]


# -- progress -----------------------------------------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_probe_reports_each_measurement_and_the_bar_shows_on_a_terminal_only(disk_tmp: Path) -> None:
    a, b = disk_tmp / "a", disk_tmp / "b"
    a.mkdir()
    b.mkdir()
    steps: list[str] = []
    report = probe([a, b], file_bytes=64 << 10, total_bytes=256 << 10, depth=2, engine=make_engine("threads"),
                   on_step=steps.append)
    assert report["files_per_tier"] == 4
    window = report["aggregate"]["window_s"]
    assert steps == [f"writing {a}", f"writing {b}", f"reading {a}", f"reading {b}",
                     f"reading all tiers at once for {window:.1f} s",
                     f"reading {a} under a write load", f"reading {b} under a write load"]
    assert len(steps) == probe_mod._steps(2)

    term = _Terminal()
    with probe_mod._progress(2, stream=term) as step:
        for s in steps:
            step(s)
    shown = term.getvalue()
    assert "probe: writing" in shown and "\x1b[" in shown  # drawn with terminal control codes
    pipe = io.StringIO()
    with probe_mod._progress(2, stream=pipe) as step:
        for s in steps:
            step(s)
    assert pipe.getvalue() == ""


# -- report -------------------------------------------------------------------------------------------------------
def _cli(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    """Run the CLI as a shell would: ``sys.argv`` is what results record as their command line."""
    monkeypatch.setattr(sys, "argv", ["/opt/venv/bin/kvstream", *argv])
    return main(list(argv))


def test_report_shows_version_command_line_and_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from kvstream import __version__

    out = tmp_path / "sim"
    assert _cli(monkeypatch, "simulate", "--scenario", "bound", "--quick", "--out", str(out)) == 0
    assert _cli(monkeypatch, "report", "--in", str(out)) == 0
    capsys.readouterr()
    page = (out / "report.html").read_text()
    assert f"run: kvstream {__version__} · <code>kvstream simulate --scenario bound --quick --out {out}</code>" in page
    assert "<b>--quick</b>: a shrunk run" in page
    assert "1 of 1 results ran with --quick" in page
    assert f"this page: kvstream {__version__}, <code>kvstream report --in {out}</code>" in page

    # a full run says so, and a result from before run records says those are missing
    data = json.loads((out / "bound.json").read_text())
    (out / "bound.json").write_text(json.dumps({**data, "quick": False}))
    old = {k: v for k, v in data.items() if k not in ("version", "command_line", "quick")}
    (out / "older.json").write_text(json.dumps({**old, "name": "older"}))
    assert _cli(monkeypatch, "report", "--in", str(out)) == 0
    page = (out / "report.html").read_text()
    assert "full run (no --quick)" in page and "ran with --quick" not in page
    assert "version and command line not recorded in this result" in page
