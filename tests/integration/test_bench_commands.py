"""`kvstream bench read` / `bench write` end to end on tiny inputs: the JSON contract the issue names, and
numbers that are consistent with each other (not their speed: that is what the benchmarks are for)."""

from __future__ import annotations

import json

import pytest

from kvstream.cli import build_parser


@pytest.mark.parametrize("router,windows", [("mitm", "balanced"), ("fixed:0.5", "fixed"), ("single:a", "balanced")])
def test_bench_read_json(disk_tmp, capsys, router, windows):
    args = build_parser().parse_args([
        "bench", "read", "--tier", f"a={disk_tmp}/a", "--tier", f"b={disk_tmp}/b", "--chunks", "6",
        "--chunk-bytes", "64K", "--repeat", "2", "--warmup", "1", "--router", router, "--read-windows", windows,
        "--engine", "threads", "--json",
    ])
    assert args.handler(args) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("router", "bytes", "seconds", "gbps", "bound_seconds", "over_bound", "duplicate_chunks", "per_tier"):
        assert key in r
    assert r["router"] == router and r["read_windows"] == windows and r["warmup"] == 1
    assert r["bytes"] == 6 * (64 * 1024 + 4096)
    assert r["depth"] == 16 and r["inflight_bytes"] == 16 * (64 * 1024 + 4096)  # like the raw reader's queue
    runs = sorted(r["over_bound_runs"])
    assert len(runs) == 2 and r["over_bound"] == pytest.approx((runs[0] + runs[1]) / 2)  # the median of the runs
    assert r["bound_seconds"] > 0 and r["gbps"] == pytest.approx(r["bytes"] / r["seconds"] / 1e9)
    chunks = {n: t["chunks"] for n, t in r["per_tier"].items()}
    # every chunk landed at least once; extra reads are duplicates (a late duplicate is dropped unread, so it
    # counts as a duplicate without counting as a chunk read)
    assert 6 <= sum(chunks.values()) <= 6 + r["duplicate_chunks"]
    if router == "single:a":
        assert chunks["b"] == 0


def test_bench_write_json(disk_tmp, capsys):
    args = build_parser().parse_args([
        "bench", "write", "--tier", f"a={disk_tmp}/a", "--tier", f"b={disk_tmp}/b", "--chunks", "4",
        "--chunk-bytes", "64K", "--steps", "2", "--read-chunks", "2", "--write-chunks", "1", "--compute-ms", "5",
        "--engine", "threads", "--json",
    ])
    assert args.handler(args) == 0
    r = json.loads(capsys.readouterr().out)
    w = r["write"]
    assert w["write_amplification"] == 2.0  # full replication: both tiers got every chunk
    assert all(t["chunks"] == 4 and t["bytes"] == w["put_bytes"] for t in w["per_tier"].values())
    assert w["over_bound"] == pytest.approx(w["seconds"] / w["bound_seconds"] - 1)
    for mode in ("alone", "eager", "deferred"):
        assert r["steps"][mode]["read_seconds_total"] > 0
