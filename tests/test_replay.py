"""``kvstream replay`` end to end on a tiny workload: real store, real files, modelled GPU clock."""

from __future__ import annotations

import json

import pytest

from kvstream.cli import build_parser


def _args(tmp_path, *extra):
    return build_parser().parse_args([
        "replay", "--requests", "8", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
        "--tier-capacity", "256MiB", "--speed", "4", "--out", str(tmp_path / "out"), "--json", *extra,
    ])


def test_replay_runs_systems_side_by_side(tmp_path, capsys):
    args = _args(tmp_path, "--systems", "kvstream,lmcache-like")
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in rep["results"]] == ["kvstream", "lmcache-like"]
    for r in rep["results"]:
        assert r["summary"]["completed"] == 8
        assert r["summary"]["ttft_mean_s"] > 0
    # both tiers under --out share a device: replay says so and labels the emulated shared tier
    assert rep["shared_tier"] == "emulated"
    assert any("SAME device" in n for n in rep["notes"])
    assert (tmp_path / "out" / "replay.png").exists()
    assert not (tmp_path / "out" / "tiers").exists()  # cleaned up
    kv = rep["results"][0]["summary"]
    # full replication: two copies of each chunk, less the second copies the slow (emulated) shared tier's
    # write backlog made the store skip
    assert 1.0 < kv["storage_write_amplification"] <= 2.0 + 1e-9
    if kv["storage_write_skipped_backlog_shared"] == 0:
        assert kv["storage_write_amplification"] == pytest.approx(2.0, rel=0.05)


def test_replay_refuses_one_tier_and_unknown_system(tmp_path):
    from kvstream.errors import UsageError

    args = _args(tmp_path, "--tier", f"local={tmp_path}/a")
    with pytest.raises(UsageError, match="exactly two tiers"):
        args.handler(args)
    args = _args(tmp_path, "--systems", "vllm")
    with pytest.raises(UsageError, match="unknown system"):
        args.handler(args)


def test_replay_takes_a_relative_out_folder(tmp_path, monkeypatch, capsys):
    # The README's demo runs `kvstream replay` with its default, relative --out; tier paths must still work.
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args([
        "replay", "--requests", "4", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
        "--tier-capacity", "256MiB", "--speed", "4", "--systems", "kvstream", "--out", "rel-out", "--json",
    ])
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["results"][0]["summary"]["completed"] == 4
    assert (tmp_path / "rel-out" / "replay.json").exists()
