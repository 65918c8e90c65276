"""No false success (issue 23): a measuring command that could not measure what its output claims exits 2 with
one line naming the cause, instead of exit 0 and a table of zeros or NaN.

``kvstream replay`` compares systems serving from disk tiers, so it refuses, before anything runs, an empty
workload and a tier or host memory below one chunk (``check_setup``; the store also refuses such a tier at open,
now that replay passes ``chunk_bytes``), and after the run a system that served no request, wrote nothing to
its tiers, or a run in which no system read from disk (``nothing_measured``). ``kvstream simulate --trace``
refuses an empty trace and a run in which no request got its first token; ``kvstream bench`` a step that did
not read all its chunks and a write phase that did not publish all its chunks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstream.cli import main
from kvstream.commands import replay
from kvstream.commands.replay import disk_warning, nothing_measured
from kvstream.errors import NothingMeasuredError

SMALL = ["--preset", "agent-small", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
         "--tier-capacity", "256MiB", "--speed", "8", "--systems", "kvstream", "--rounds", "1"]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str, ran: bool = False) -> str:
    """Exit 2, no traceback, one error line naming ``needles``: all of stderr, or (``ran``: the command ran and
    printed its progress first) its last line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert [ln for ln in lines if "error:" in ln] == lines[-1:], err
    assert ran or len(lines) == 1, err
    for n in needles:
        assert n in lines[-1], (n, lines[-1])
    assert not out.strip(), out  # no table of a run that measured nothing
    return lines[-1]


# -- replay: refused before anything runs ------------------------------------------------------------------------
def test_replay_refuses_a_tier_below_one_chunk_before_making_anything(disk_tmp: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # the case: 1 KiB tiers wrote nothing, and the run exited 0 blaming the workload
    out = disk_tmp / "out"
    line = _one_line_error(capsys, ["replay", *SMALL, "--requests", "3", "--tier-capacity", "1KiB", "--out", str(out)],
                           "--tier-capacity 1KiB", "below one chunk", "qwen2.5-0.5b", "give at least 4MiB")
    assert "workload" not in line  # the cause is the capacity, not the workload
    assert not out.exists()


def test_replay_refuses_host_memory_below_one_chunk(disk_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = disk_tmp / "out"
    _one_line_error(capsys, ["replay", *SMALL, "--requests", "3", "--memory", "2MiB", "--out", str(out)],
                    "--memory 2MiB", "below one chunk")
    assert not out.exists()


def test_replay_and_simulate_refuse_an_empty_trace(disk_tmp: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = disk_tmp / "empty.jsonl"
    trace.write_text("")
    out = disk_tmp / "out"
    _one_line_error(capsys, ["replay", "--trace", str(trace), "--out", str(out)], str(trace), "has no requests")
    assert not out.exists()
    _one_line_error(capsys, ["simulate", "--trace", str(trace), "--out", str(out)], str(trace), "has no requests")
    assert not out.exists()


def test_the_store_itself_refuses_a_replay_tier_below_one_chunk(disk_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Replay passes ``chunk_bytes`` to each system's store, so the store checks the capacity at open even where
    replay's own early check is bypassed (here: switched off)."""
    monkeypatch.setattr(replay, "check_setup", lambda *a, **k: None)
    _one_line_error(capsys, ["replay", *SMALL, "--requests", "3", "--tier-capacity", "1MiB", "--out",
                             str(disk_tmp / "out")], "capacity_bytes", "below one chunk", ran=True)


# -- replay: refused after a run that measured nothing -----------------------------------------------------------
@pytest.mark.slow
def test_a_replay_that_read_nothing_from_disk_exits_2_naming_the_cause(disk_tmp: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Three requests fit in host memory: every hit is in memory, so the comparison of disk tiers measured
    nothing. It exits 2 with the cause and the flags to change; the JSON is kept and records the error."""
    out = disk_tmp / "out"
    _one_line_error(capsys, ["replay", *SMALL, "--requests", "3", "--out", str(out)],
                    "no system read from the disk tiers", "kvstream read nothing from disk", "--requests, now 3",
                    "--memory", "replay.json", ran=True)
    rep = json.loads((out / "replay.json").read_text())
    assert rep["error"].startswith("no system read from the disk tiers") and rep["warnings"] == []
    assert rep["results"][0]["summary"]["completed"] == 3


def _result(system: str, *, completed: int = 5, read: int = 1, written: int = 1, puts: int = 4,
            dropped: int = 0) -> dict:
    return {"system": system, "summary": {"completed": completed, "storage_read_bytes_local": read},
            "tier_stats": {"local": {"write_bytes": written}}, "store_counters": {"puts": puts},
            "puts_dropped_no_memory": dropped}


def _args(**kw) -> argparse.Namespace:
    base = {"trace": None, "limit": None, "requests": 20, "memory": "256MiB", "gpu_kv": "1GiB",
            "tier_capacity": "4GiB"}
    return argparse.Namespace(**{**base, **kw})


def test_nothing_measured_names_each_cause() -> None:
    assert nothing_measured([_result("kvstream"), _result("bidaw-only")], _args()) is None
    # a system that served nothing
    why = nothing_measured([_result("kvstream"), _result("bidaw-only", completed=0)], _args())
    assert why is not None and why.startswith("bidaw-only served no request")
    # a system that wrote nothing: no chunk put, puts dropped for memory, or copies skipped
    why = nothing_measured([_result("kvstream", written=0, puts=0)], _args())
    assert why is not None and "wrote nothing" in why and "shorter than one chunk" in why
    why = nothing_measured([_result("kvstream", written=0, dropped=7)], _args())
    assert why is not None and "7 puts were dropped" in why and "--memory 256MiB" in why
    why = nothing_measured([_result("kvstream", written=0)], _args())
    assert why is not None and "--tier-capacity 4GiB" in why
    # no system read from disk: an error; one system reading nothing while another did: a warning only
    why = nothing_measured([_result("kvstream", read=0), _result("lmcache-like", read=0)], _args())
    assert why is not None and why.startswith("no system read from the disk tiers: kvstream, lmcache-like read")
    partly = [_result("kvstream", read=0), _result("lmcache-like", read=9)]
    assert nothing_measured(partly, _args()) is None and disk_warning(partly, _args()) is not None
    # recompute-only never reads the tiers (by design): it does not count as a reader
    assert nothing_measured([_result("recompute-only", read=0), _result("kvstream", read=3)], _args()) is None
    assert nothing_measured([_result("recompute-only", read=0)], _args()) is None


# -- simulate ------------------------------------------------------------------------------------------------------
def test_simulate_refuses_a_run_where_no_request_got_a_first_token(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    import kvstream.sim.driver as driver

    real = driver.simulate

    def nobody_served(*a, **k):
        res = real(*a, **k)
        for node in res.nodes:
            for r in node.requests:
                r.first_token = math.nan
        return res

    monkeypatch.setattr(driver, "simulate", nobody_served)
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 8,
                                         "hash_ids": [i, i + 1]}) + "\n" for i in range(3)))
    out = tmp_path / "res"
    _one_line_error(capsys, ["simulate", "--trace", str(trace), "--out", str(out), "--quick"],
                    "none of the 3 requests got its first token", "results kept in", ran=True)
    assert (out / "trace-kvstream.json").exists()


# -- bench ---------------------------------------------------------------------------------------------------------
def test_bench_read_refuses_a_step_that_lost_chunks(disk_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk damaged on both tiers after the fill: the store's step returns a miss for it, so its time is not
    a whole step's (it raised RuntimeError with a traceback before)."""
    import kvstream.benchmarks.read as rb

    real_fill = rb._fill

    def fill_then_damage(store, keys, chunk_bytes):
        n = real_fill(store, keys, chunk_bytes)
        for t in store.tiers:
            path = t.path_for(keys[-1])
            with open(path, "r+b") as f:
                f.seek(-1, 2)
                last = f.read(1)
                f.seek(-1, 2)
                f.write(bytes([last[0] ^ 0xFF]))
        return n

    monkeypatch.setattr(rb, "_fill", fill_then_damage)
    _one_line_error(capsys, ["bench", "read", "--tier", f"a={disk_tmp}/a", "--tier", f"b={disk_tmp}/b", "--chunks",
                             "4", "--chunk-bytes", "256K", "--repeat", "1", "--warmup", "0", "--json"],
                    "only 3 of 4 chunks came back", "corrupt", ran=True)


def test_bench_write_refuses_unpublished_chunks_and_zero_writes_per_step(disk_tmp: Path,
                                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream.benchmarks.write import _check_written

    def tier(chunks: int, errors: int = 0) -> SimpleNamespace:
        return SimpleNamespace(write_chunks=chunks, write_errors=errors, write_skipped_full=0)

    _check_written(SimpleNamespace(tiers={"a": tier(8), "b": tier(3)}), 8)  # partial copies on b: fine
    with pytest.raises(NothingMeasuredError, match="a: 5 written"):
        _check_written(SimpleNamespace(tiers={"a": tier(5), "b": tier(8)}), 8)
    with pytest.raises(NothingMeasuredError, match="1 write errors"):
        _check_written(SimpleNamespace(tiers={"a": tier(8), "b": tier(7, errors=1)}), 8)
    # part 2 measures the interference of new writes with the reads: none per step would measure nothing
    _one_line_error(capsys, ["bench", "write", "--tier", f"a={disk_tmp}/a", "--write-chunks", "0"],
                    "--write-chunks", "'0'")
