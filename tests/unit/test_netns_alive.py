"""The testbed's process reaper (bench/dfs/netns.py) treats a process that vanishes mid-read as gone.

Stop 28's CI failed in the DFS fixture's tear-down: a process was reaped between the open and the read of its
/proc stat file, the read raised ProcessLookupError, and the error surfaced in an unrelated test."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))
from dfs import netns  # noqa: E402


class _VanishingStat(io.StringIO):
    def read(self, *args):  # type: ignore[override]
        raise ProcessLookupError(3, "No such process")


def test_a_process_reaped_between_open_and_read_counts_as_gone(monkeypatch):
    real_open = open

    def fake_open(path, *args, **kwargs):
        if str(path).startswith("/proc/") and str(path).endswith("/stat"):
            return _VanishingStat()
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", fake_open)
    assert netns._alive(1) is False


def test_kill_pids_ends_a_live_process_and_tolerates_a_gone_one():
    p = subprocess.Popen(["sleep", "30"])
    done = subprocess.Popen(["true"])
    done.wait()
    netns.kill_pids([p.pid, done.pid], grace_s=1.0)
    assert p.wait(5) == -signal.SIGTERM  # ended by the reaper's SIGTERM, within its grace
    assert not netns._alive(p.pid)


def test_no_such_pid_is_not_alive():
    assert netns._alive(0x7FFFFFF0) is False  # above pid_max: never a process
