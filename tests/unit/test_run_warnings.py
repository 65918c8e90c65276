"""Warnings that stop a run's output from misleading, and what results JSON records about the run (fast: no
replay, tiny traces)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstream import __version__
from kvstream.cli import main as cli_main
from kvstream.commands.replay import disk_warning
from kvstream.commands.simulate import overload_warning


def _row(system: str, local: int, shared: int | None = None) -> dict:
    s = {"storage_read_bytes_local": local}
    if shared is not None:
        s["storage_read_bytes_shared"] = shared
    return {"system": system, "summary": s}


def _replay_args(**kw) -> argparse.Namespace:
    base = {"trace": None, "limit": None, "requests": 20, "memory": "256MiB", "gpu_kv": "1GiB"}
    return argparse.Namespace(**{**base, **kw})


def test_replay_warns_when_a_system_read_nothing_from_disk() -> None:
    w = disk_warning([_row("kvstream", 0, 0), _row("lmcache-like", 5)], _replay_args())
    assert w is not None and "\n" not in w
    assert w.startswith("kvstream read nothing from disk") and "lmcache-like" not in w
    assert "--requests, now 20" in w and "--memory" in w and "256MiB" in w
    w = disk_warning([_row("kvstream", 0, 0)], _replay_args(trace="t.jsonl", limit=30))
    assert "--limit, now 30" in w
    assert disk_warning([_row("kvstream", 1, 0), _row("bidaw-only", 7)], _replay_args()) is None


def _reqs(queues: list[float], *, gap: float = 1.0, unfinished: int = 0) -> list[SimpleNamespace]:
    out = []
    for i, q in enumerate(queues):
        a = i * gap
        ft = math.nan if i >= len(queues) - unfinished else a + q + 0.5
        out.append(SimpleNamespace(arrival=a, started=a + q, first_token=ft))
    return out


def test_overload_warning_criterion() -> None:
    # a queue growing in step with the trace: overloaded, and the line says the criterion
    w = overload_warning(_reqs([0.5 * i for i in range(100)]))
    assert w is not None and "overloaded" in w and "criterion" in w and "--time-scale" in w and "\n" not in w
    # a steady queue of a few seconds, or a short burst at the end, is not overload
    assert overload_warning(_reqs([5.0] * 100)) is None
    assert overload_warning(_reqs([0.1] * 80 + [3.0] * 20)) is None
    # requests that never got a first token: overloaded whatever the queue did
    w = overload_warning(_reqs([0.1] * 20, unfinished=3))
    assert w is not None and "3 of 20" in w
    assert overload_warning([]) is None


def _trace(path: Path, n: int, gap_ms: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"timestamp": i * gap_ms, "input_length": 4096, "output_length": 64,
                                "hash_ids": list(range(i * 8, i * 8 + 8))}) + "\n")
    return path


def test_simulate_trace_honours_out_and_records_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    trace = _trace(tmp_path / "t.jsonl", 40, 1)  # 40 long prompts within 40 ms on a 70B model: overloaded
    out = tmp_path / "res"
    argv = ["simulate", "--trace", str(trace), "--out", str(out), "--quick"]
    monkeypatch.setattr("sys.argv", ["kvstream", *argv])
    assert cli_main(argv) == 0
    cap = capsys.readouterr()
    data = json.loads((out / "trace-kvstream.json").read_text())
    assert data["version"] == __version__ and data["quick"] is True and data["command_line"] == ["kvstream", *argv]
    assert data["requests"] == 40 and data["overloaded"] is True and data["warnings"]
    assert "simulate: warning: the modelled system is overloaded" in cap.err
    assert str(out / "trace-kvstream.json") in cap.out


def test_scenario_json_records_version_command_line_and_quick(tmp_path: Path, monkeypatch) -> None:
    from kvstream.sim import scenarios as sc

    def fake(out_dir: Path, quick: bool, seed: int) -> sc.ScenarioResult:
        return sc.ScenarioResult(name="fake", title="t", rows=[], data={"quick": quick})

    monkeypatch.setitem(sc.SCENARIOS, "fake", sc.Scenario(name="fake", targets="-", title="t", run=fake))
    monkeypatch.setattr("kvstream.commands._common.require", lambda *a, **k: None)
    argv = ["simulate", "--scenario", "fake", "--quick", "--out", str(tmp_path), "--json"]
    monkeypatch.setattr("sys.argv", ["kvstream", *argv])
    assert cli_main(argv) == 0
    data = json.loads((tmp_path / "fake.json").read_text())
    assert data["version"] == __version__ and data["quick"] is True and data["name"] == "fake"
    assert data["command_line"] == ["kvstream", *argv]
