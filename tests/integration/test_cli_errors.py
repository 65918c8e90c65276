"""Every CLI input error is one line naming the bad value (and the valid choices), exit status 2, no traceback.

Most cases run ``kvstream.cli.main`` in-process (fast); a few run the installed entry point in a subprocess so
that the exit status and the absence of a traceback are those a user sees. A missing optional dependency is
one line naming the extra that installs it; ``replay`` without matplotlib still writes its JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvstream.cli import build_parser, main
from kvstream.commands import _common

BAD = "no-such-value"


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def _assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "error:" in lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


# -- the cases the issue names, and one bad value of every option that has a rule ---------------------------
def _cases(tmp: Path) -> list[tuple[list[str], tuple[str, ...]]]:
    t = str(tmp)
    two = ["--tier", f"a={t}/a", "--tier", f"b={t}/b"]
    out = ["--out", f"{t}/out"]
    return [
        # replay
        (["replay", "--preset", "nonexistent", *out], ("'nonexistent'", "agent-small", "chat")),
        (["replay", "--model", "llama-99b", *out], ("'llama-99b'", "qwen2.5-1.5b", "llama-3-70b")),
        (["replay", "--gpu", "h200", *out], ("'h200'", "a100", "h100")),
        (["replay", "--systems", "vllm", *out], ("'vllm'", "kvstream-only", "lmcache-like")),
        (["replay", "--tp", "0", *out], ("--tp", "'0'")),
        (["replay", "--speed", "0", *out], ("--speed", "'0'")),
        (["replay", "--requests", "-1", *out], ("--requests", "'-1'")),
        (["replay", "--memory", "12XB", *out], ("--memory", "'12XB'")),
        (["replay", "--tier", "nonsense", *out], ("'nonsense'", "NAME=PATH")),
        (["replay", "--tier", f"local={t}/a", *out], ("exactly two tiers",)),
        (["replay", "--trace", f"{t}/missing.jsonl", *out], ("missing.jsonl",)),
        (["replay", "--no-such-option"], ("--no-such-option",)),
        # simulate
        (["simulate"], ("--scenario", "--trace", "--list")),
        (["simulate", "--scenario", "nope", "--out", f"{t}/sim"], ("'nope'", "bound", "'all'")),
        (["simulate", "--list", "--system", "foo"], ("'foo'", "kvstream+bidaw")),
        (["simulate", "--list", "--model", "llama-99b"], ("'llama-99b'", "70b")),
        (["simulate", "--list", "--gpu", "h200"], ("'h200'", "h100")),
        (["simulate", "--list", "--testbed", "3"], ("3", "1, 2")),
        (["simulate", "--list", "--time-scale", "-1"], ("--time-scale", "'-1'")),
        (["simulate", "--trace", f"{t}/missing.jsonl"], ("missing.jsonl",)),
        # bench
        (["bench"], ("BENCH",)),
        (["bench", "read"], ("--tier",)),
        (["bench", "read", "--tier", f"a={t}/a"], ("two or more", "got 1", "kvstream probe")),
        (["bench", "read", *two, "--router", "bogus"], ("'bogus'", "mitm", "fixed:R", "single:NAME")),
        (["bench", "read", *two, "--router", "single:c"], ("'c'", "a, b")),
        (["bench", "read", *two, "--engine", "xx"], ("'xx'", "uring", "threads")),
        (["bench", "read", *two, "--read-windows", "xx"], ("'xx'", "balanced", "fixed")),
        (["bench", "read", *two, "--chunk-bytes", "12Q"], ("'12Q'",)),
        (["bench", "read", *two, "--chunks", "0"], ("--chunks", "'0'")),
        (["bench", "read", *two, "--throttled-tier", "c"], ("'c'", "a, b")),
        (["bench", "write", *two, "--replication", "bogus"], ("'bogus'", "full", "partial:F", "selective")),
        (["bench", "write", *two, "--engine", "xx"], ("'xx'", "uring")),
        (["bench", "write", *two, "--chunks", "0"], ("--chunks", "'0'")),
        (["bench", "write", "--tier", "nonsense"], ("'nonsense'", "NAME=PATH")),
        # probe
        (["probe", f"{t}/nope"], (f"{t}/nope", "no such folder")),
        (["probe", t, "--engine", "xx"], ("'xx'", "uring")),
        (["probe", t, "--size", "12Q"], ("'12Q'",)),
        (["probe", t, "--depth", "0"], ("--depth", "'0'")),
        # study
        (["study"], ("STUDY",)),
        (["study", "eviction", "--trace", f"{t}/missing.txt", "--model", "gpt-9"], ("'gpt-9'", "opt-13b")),
        (["study", "eviction", "--trace", f"{t}/missing.txt", "--policies", "bogus"], ("bogus", "hit-potential")),
        (["study", "eviction", "--trace", f"{t}/missing.txt", "--user-fraction", "0.35"], ("0.35",)),
        (["study", "eviction", "--trace", f"{t}/missing.txt", "--memory-gb", "0"], ("--memory-gb", "'0'")),
        (["study", "eviction", "--trace", f"{t}/missing.txt"], ("missing.txt",)),
        (["study", "reuse", "--trace", f"{t}/missing.txt", "--model", "gpt-9"], ("'gpt-9'", "opt-13b")),
        (["study", "reuse", "--trace", f"{t}/missing.txt", "--window-fraction", "2"], ("--window-fraction",)),
        # verify, report
        (["verify", f"{t}/nope"], (f"{t}/nope",)),
        (["report", "--in", f"{t}/nope"], (f"{t}/nope",)),
        (["report", "--in", t], (t, "NAME.json", "replay.json")),
        # the top level
        ([], ("COMMAND",)),
        (["bogus"], ("'bogus'", "replay", "simulate")),
    ]


def test_every_bad_value_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, needles in _cases(tmp_path):
        rc, out, err = _run(argv, capsys)
        try:
            _assert_one_line_error(rc, out, err, *needles)
        except AssertionError as exc:
            raise AssertionError(f"kvstream {' '.join(argv)}: {exc}") from None


Leaf = tuple[tuple[str, ...], argparse.ArgumentParser]


def _leaves(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> list[Leaf]:
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(path, parser)]
    return [leaf for name, p in subs[0].choices.items() for leaf in _leaves(p, (*path, name))]


_CHOICE_TYPES = {"model_name", "gpu_name", "preset_name", "_study_model"}


def test_every_choice_option_of_every_subcommand_names_value_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    """Walks the parser: each option with fixed choices, or a choice-like type, gets a value it does not know."""
    checked = 0
    for path, parser in _leaves(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0:
                continue
            kind = getattr(action.type, "__name__", "")
            if action.choices is None and kind not in _CHOICE_TYPES:
                continue
            if action.choices is not None and action.type is int:
                bad, expect = str(max(action.choices) + 1), [str(c) for c in action.choices]
            elif action.choices is not None:
                bad, expect = BAD, [str(c) for c in action.choices]
            else:
                # the default is among the choices listed (replay's set-up options default to the preset's)
                bad, expect = BAD, [str(action.default) if action.default is not None else "choose from"]
            rc, out, err = _run([*path, action.option_strings[-1], bad], capsys)
            try:
                _assert_one_line_error(rc, out, err, bad, *expect)
            except AssertionError as exc:
                raise AssertionError(f"kvstream {' '.join(path)} {action.option_strings[-1]}: {exc}") from None
            checked += 1
    assert checked >= 12  # replay 3, simulate 4, bench read 2 + write 1, probe 1, study 2


_SIZE_TYPES = {"size_text", "size_bytes", "parse_size"}


def test_a_negative_size_is_named_as_not_a_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``--memory -1GiB``: argparse took ``-1GiB`` for an option and said "expected one argument"; every size
    option of every subcommand now names the value and says it is not a size."""
    checked = 0
    for path, parser in _leaves(build_parser()):
        for action in parser._actions:
            if not action.option_strings or getattr(action.type, "__name__", "") not in _SIZE_TYPES:
                continue
            for bad in ("-1GiB", "-5"):
                rc, out, err = _run([*path, action.option_strings[-1], bad], capsys)
                try:
                    _assert_one_line_error(rc, out, err, action.option_strings[-1], f"'{bad}'", "size")
                    assert "expected one argument" not in err
                except AssertionError as exc:
                    raise AssertionError(f"kvstream {' '.join(path)} {action.option_strings[-1]} {bad}: {exc}") from None
            checked += 1
    assert checked >= 8  # replay 3, bench read 2 + write 1, probe 2
    rc, out, err = _run(["replay", "--memory", "-1GiB"], capsys)
    _assert_one_line_error(rc, out, err, "value '-1GiB' is not a size")


def test_a_value_that_starts_with_a_dash_and_a_digit_is_checked_by_its_option(capsys: pytest.CaptureFixture[str]) -> None:
    """Every option with a type or choices, given ``-1x``, says what is wrong with ``-1x`` (never "expected one
    argument", which names no value)."""
    checked = 0
    for path, parser in _leaves(build_parser()):
        for action in parser._actions:
            if not action.option_strings or action.nargs == 0 or (action.type is None and action.choices is None):
                continue
            rc, out, err = _run([*path, action.option_strings[-1], "-1x"], capsys)
            try:
                _assert_one_line_error(rc, out, err, "'-1x'")
            except AssertionError as exc:
                raise AssertionError(f"kvstream {' '.join(path)} {action.option_strings[-1]}: {exc}") from None
            checked += 1
    assert checked >= 30


def test_model_list_names_each_model_once(capsys: pytest.CaptureFixture[str]) -> None:
    rc, _out, err = _run(["replay", "--model", "llama-99b"], capsys)
    assert rc == 2
    listed = re.search(r"choose from (.*?) \(aliases", err)
    assert listed is not None, err
    names = listed.group(1).split(", ")
    assert len(names) == len(set(names)) and "qwen2.5-0.5b" in names


# -- through the real entry point ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,value", [
    (["replay", "--preset", "nonexistent"], "nonexistent"),
    (["replay", "--model", "llama-99b"], "llama-99b"),
    (["replay", "--gpu", "h200"], "h200"),
    (["bench", "read", "--tier", "a=/nonexistent/a"], "two or more"),
])
def test_subprocess_exit_2_without_traceback(argv: list[str], value: str, tmp_path: Path) -> None:
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    r = subprocess.run([sys.executable, "-m", "kvstream", *argv], capture_output=True, text=True, cwd=tmp_path,
                       timeout=60, env=env)
    assert r.returncode == 2, r
    assert "Traceback" not in r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and value in r.stderr
    assert not (tmp_path / "kvstream-out").exists()  # refused before it made anything


# -- help and version ----------------------------------------------------------------------------------------
def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    from kvstream import __version__

    rc, out, _err = _run(["--version"], capsys)
    assert rc == 0 and out.strip() == f"kvstream {__version__}"


def test_help_has_no_markup_and_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    for path, _parser in [((), None), *_leaves(build_parser())]:
        rc, out, _err = _run([*path, "--help"], capsys)
        assert rc == 0
        for markup in ("``", ":mod:", ":func:", ":class:", ":meth:"):
            assert markup not in out, (path, markup)
    rc, out, _err = _run(["replay", "--help"], capsys)
    flat = " ".join(out.split())
    # the set-up options default to the preset's set-up, and say so
    for opt, default in (("--model", "qwen2.5-14b with agent-long, qwen2.5-1.5b with the other presets"),
                         ("--gpu", "a100 with agent-long, h100"), ("--tp", "2 with agent-long, 1")):
        assert re.search(rf"{opt} \S+ .*?\(default: {re.escape(default)}", flat), (opt, flat)
    assert "Why the default" in flat and "--preset agent-small" in flat  # the epilog says why, and the old default


def test_plain_strips_rst() -> None:
    assert _common.plain("``kvstream replay`` uses :mod:`kvstream.io.rawread` and :func:`~kvstream.format.decode`") \
        == "kvstream replay uses kvstream.io.rawread and decode"


def test_tables_are_not_cut_when_piped(capsys: pytest.CaptureFixture[str]) -> None:
    from rich.table import Table

    table = Table(title="wide")
    for i in range(14):
        table.add_column(f"column number {i}", justify="right")
    table.add_row(*[f"{1234567.891 * (i + 1):.3f}" for i in range(14)])
    _common.console().print(table)  # capsys: stdout is not a terminal
    out = capsys.readouterr().out
    assert "…" not in out and "column number 13" in out and "17283950.474" in out


# -- optional dependencies -----------------------------------------------------------------------------------
def test_missing_extra_is_one_line_naming_it(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "have", lambda module: False)
    trace = tmp_path / "t.txt"
    trace.write_text("")
    rc, out, err = _run(["study", "reuse", "--trace", str(trace)], capsys)
    _assert_one_line_error(rc, out, err, "scipy", "pip install 'kvstream[study]'")
    rc, out, err = _run(["simulate", "--scenario", "bound", "--quick", "--out", str(tmp_path / "sim")], capsys)
    _assert_one_line_error(rc, out, err, "matplotlib", "pip install 'kvstream[plot]'")
    assert not (tmp_path / "sim").exists()  # refused before running


def test_an_import_error_anywhere_names_the_extra(capsys: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstream.commands.report as report

    def needs(name: str):
        def handler(_args: argparse.Namespace) -> int:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return handler

    monkeypatch.setattr(report, "_run", needs("matplotlib"))
    _assert_one_line_error(*_run(["report"], capsys), "pip install 'kvstream[plot]'")
    monkeypatch.setattr(report, "_run", needs("scipy"))
    _assert_one_line_error(*_run(["report"], capsys), "pip install 'kvstream[study]'")
    monkeypatch.setattr(report, "_run", needs("not_an_extra_at_all"))
    with pytest.raises(ModuleNotFoundError):  # not an optional dependency: a bug, its traceback is kept
        main(["report"])


@pytest.mark.slow
def test_replay_without_matplotlib_writes_json_and_names_the_extra(disk_tmp: Path, capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_common, "have", lambda module: module != "matplotlib")
    out_dir = disk_tmp / "out"
    # 8 requests: enough that the run reads from disk (with fewer every hit is in memory, and replay refuses the
    # run as one that measured nothing: tests/integration/test_nothing_measured.py)
    rc = main(["replay", "--preset", "agent-small", "--requests", "8", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
               "--tier-capacity", "256MiB", "--speed", "8", "--systems", "kvstream", "--rounds", "1", "--out", str(out_dir)])
    out, err = capsys.readouterr()
    assert rc == 0
    rep = json.loads((out_dir / "replay.json").read_text())
    assert rep["figure"] is None and not (out_dir / "replay.png").exists()
    assert [ln for ln in err.splitlines() if "kvstream[plot]" in ln] == [
        "replay: figure skipped: matplotlib is not installed (pip install 'kvstream[plot]')"]
    assert "kvstream" in out and "results:" in out  # the table and the results line
    # and report gathers the replay folder
    assert main(["report", "--in", str(out_dir)]) == 0
    page = (out_dir / "report.html").read_text()
    assert "replay" in page and "no figure" in page
