"""``kvstream replay`` end to end on a tiny workload: real store, real files, modelled GPU clock."""

from __future__ import annotations

import json

import pytest

from kvstream.cli import build_parser
from kvstream.commands.replay import tier_rates


def _args(tmp_path, *extra):
    return build_parser().parse_args([
        "replay", "--preset", "agent-small", "--requests", "8", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
        "--tier-capacity", "256MiB", "--speed", "4", "--out", str(tmp_path / "out"), "--json", "--rounds", "1", *extra,
    ])


@pytest.mark.slow
def test_replay_runs_systems_side_by_side(tmp_path, capsys):
    args = _args(tmp_path, "--systems", "kvstream,lmcache-like", "--rounds", "2")
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["system"] for r in rep["results"]] == ["kvstream", "lmcache-like"]
    # --switch-interval-ms' default leaves the interpreter's switch interval as it was (conftest: 5 ms)
    assert rep["python_switch_interval_s"] == pytest.approx(0.005)
    # two rounds, the order rotated, each with its own tier probe and machine load
    assert [rd["order"] for rd in rep["rounds"]] == [["kvstream", "lmcache-like"], ["lmcache-like", "kvstream"]]
    assert all(rd["machine"]["seconds"] > 0 for rd in rep["rounds"])
    for r in rep["results"]:
        assert len(r["rounds"]) == 2
        for k, run in enumerate(r["rounds"]):
            s = run["summary"]
            # where the run's wall time went: serving, then the writes host memory still held, then closing
            assert set(run["phases_s"]) == {"serve", "drain", "close"}
            assert all(v >= 0 for v in run["phases_s"].values())
            assert sum(run["phases_s"].values()) == pytest.approx(run["wall_s"], abs=0.01)
            # and the time before its clock: setting up, and waiting for the previous run's folders to go
            assert set(run["before_clock_s"]) == {"set_up", "removal_wait"}
            assert all(v >= 0 for v in run["before_clock_s"].values())
            assert s["completed"] == 8
            # --speed 4: every time is on the compressed clock (a TTFT or queueing time is never negative)
            assert s["ttft_mean_s"] > 0 and s["ttft_p50_s"] > 0 and s["queue_mean_s"] >= 0
            # per-load GB/s beside the bound of the same round: its tiers' bandwidths as the round's probe measured
            # them; two tiers read at once (the probe's joint window: the emulated tier's reads share the CPUs),
            # which is never above the two read alone
            tiers = ("local", "shared") if r["system"] == "kvstream" else ("local",)
            rd = rep["rounds"][k]
            measured, mixed, joint = rd["measured_read_gbps"], rd["mixed_read_gbps"], rd["joint_read_gbps"]
            assert set(joint) == {"local", "shared"} and all(v > 0 for v in joint.values())
            rates = tier_rates([{"read_bw": measured[t], "mixed_read_bw": mixed[t],
                                 **({"joint_read_bw": joint[t]} if len(tiers) > 1 else {})} for t in tiers])
            assert s["load_bound_gbps"] == pytest.approx(sum(q for q, _ in rates))
            assert s["load_bound_gbps"] <= sum(measured[t] for t in tiers) * 1.0001
            if len(tiers) == 1:
                assert s["load_bound_gbps"] == pytest.approx(measured["local"])
            assert s["load_gbps"] >= 0 and (s["load_of_bound"] == pytest.approx(s["load_gbps"] / s["load_bound_gbps"]))
            # and against the bound under the run's own write load: between each tier's rate beside its writes
            # (the round's mixed probe) and quiet, summed over the system's tiers
            if s["loads_from_disk"]:
                lo, hi = sum(min(q, m) for q, m in rates), sum(max(q, m) for q, m in rates)
                assert lo * 0.999 <= s["load_bound_in_run_gbps"] <= hi * 1.001
                assert s["load_of_bound_in_run"] == pytest.approx(s["load_gbps"] / s["load_bound_in_run_gbps"])
                assert 0.0 <= s["load_bytes_beside_writes"] <= 1.0
        # the row is the median over the rounds
        means = sorted(run["summary"]["ttft_mean_s"] for run in r["rounds"])
        assert r["summary"]["ttft_mean_s"] == pytest.approx(sum(means) / 2)
    assert any(run["summary"]["loads_from_disk"] for r in rep["results"] for run in r["rounds"])  # bounds checked
    # one verdict per pair, for the mean and the P99, with an interval around the measured ratio
    (v,) = rep["verdicts"]
    assert (v["system"], v["against"]) == ("kvstream", "lmcache-like")
    for stat in ("mean", "p99"):
        assert v[stat]["low"] <= v[stat]["ratio"] <= v[stat]["high"] or v[stat]["verdict"] != "level"
        assert v[stat]["verdict"] in ("ahead", "level", "behind") and v[stat]["rounds"] == 2
        assert v[stat]["requests"] == 8
    # both tiers under --out share a device: replay says so and labels the emulated shared tier
    assert rep["shared_tier"] == "emulated"
    assert any("SAME device" in n for n in rep["notes"])
    assert any("emulated tier's bandwidth" in n and "round 1" in n for n in rep["notes"])
    assert (tmp_path / "out" / "replay.png").exists()
    assert not (tmp_path / "out" / "tiers").exists()  # cleaned up
    kv = rep["results"][0]["summary"]
    # kvstream replicates the share of each prefix the shared tier can read, sized from this run's measured
    # bandwidths (partial:F, or full when the shared tier is at least twice as fast); lmcache-like has one copy
    from kvstream.replication import partial_fraction

    last = rep["rounds"][-1]["measured_read_gbps"]
    f = partial_fraction([last["local"], last["shared"]])
    assert rep["results"][0]["rounds"][-1]["replication"] == ("full" if f >= 1.0 else f"partial:{f:.2f}")
    assert rep["results"][1]["replication"] == "single"
    # about 1 + F copies per chunk (evenly spread by position; short prompts round), less the second copies
    # the slow (emulated) shared tier's write backlog made the store skip
    assert 1.0 < kv["storage_write_amplification"] <= min(2.0, 1.0 + f + 0.25) + 1e-9


def test_replay_refuses_one_tier_and_unknown_system(tmp_path):
    from kvstream.errors import UsageError

    args = _args(tmp_path, "--tier", f"local={tmp_path}/a")
    with pytest.raises(UsageError, match="exactly two tiers"):
        args.handler(args)
    args = _args(tmp_path, "--systems", "vllm")
    with pytest.raises(UsageError, match="unknown system"):
        args.handler(args)


@pytest.mark.slow
def test_replay_takes_a_relative_out_folder(tmp_path, monkeypatch, capsys):
    # The README's demo runs `kvstream replay` with its default, relative --out; tier paths must still work.
    monkeypatch.chdir(tmp_path)
    args = build_parser().parse_args([
        "replay", "--preset", "agent-small", "--requests", "4", "--model", "qwen2.5-0.5b", "--memory", "32MiB", "--gpu-kv", "8MiB",
        "--tier-capacity", "256MiB", "--speed", "4", "--systems", "kvstream", "--out", "rel-out", "--json",
    ])
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["results"][0]["summary"]["completed"] == 4
    assert (tmp_path / "rel-out" / "replay.json").exists()


@pytest.mark.slow
def test_replay_runs_at_the_switch_interval_asked_for(tmp_path, capsys):
    import sys

    sys.setswitchinterval(0.005)
    args = _args(tmp_path, "--systems", "kvstream", "--requests", "4", "--switch-interval-ms", "1")
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["python_switch_interval_s"] == pytest.approx(0.001)
    assert sys.getswitchinterval() == pytest.approx(0.001)
    with pytest.raises(SystemExit):  # below the range: argparse names the option, nothing runs
        _args(tmp_path, "--switch-interval-ms", "0.01")


@pytest.mark.slow
def test_replay_deletes_run_folders_a_stopped_replay_left_aside(tmp_path, capsys):
    # A replay killed while it held a run's folders (renamed aside, up to a tier's capacity each) leaves them
    # behind; the next replay on the same tiers deletes them before its first probe and says so.
    out = tmp_path / "out"
    left = [out / "tiers" / "local" / "replay-kvstream.removing-0badc0de", out / "tiers" / "local" /
            "replay-probe.removing-12345678"]
    for d in left:
        (d / "chunks").mkdir(parents=True)
        (d / "chunks" / "x.kvc").write_bytes(b"x" * 4096)
    args = build_parser().parse_args([
        "replay", "--preset", "agent-small", "--requests", "4", "--model", "qwen2.5-0.5b", "--memory", "32MiB",
        "--gpu-kv", "8MiB", "--tier-capacity", "256MiB", "--speed", "4", "--systems", "kvstream", "--out", str(out),
        "--keep", "--json",
    ])
    assert args.handler(args) == 0
    err = capsys.readouterr().err
    assert "2 run folder(s) an earlier replay left behind" in err and str(left[0]) in err
    assert not any(d.exists() for d in left)
    assert (out / "tiers" / "local" / "replay-kvstream").is_dir()  # --keep: this replay's own folder stays


def test_replay_with_the_agent_small_preset_keeps_the_earlier_defaults():
    from kvstream.commands.replay import DEFAULT_PRESET, _with_setup

    p = build_parser()
    old = _with_setup(p.parse_args(["replay", "--preset", "agent-small"]))
    assert (old.model, old.gpu, old.tp, old.memory, old.gpu_kv, old.tier_capacity) == \
        ("qwen2.5-1.5b", "h100", 1, "256MiB", "1GiB", "4GiB")
    new = _with_setup(p.parse_args(["replay"]))
    assert new.preset == DEFAULT_PRESET == "agent-long"
    assert (new.model, new.gpu, new.tp) == ("qwen2.5-14b", "a100", 2)
    mine = _with_setup(p.parse_args(["replay", "--model", "qwen2.5-0.5b", "--memory", "1GiB"]))  # flags win
    assert (mine.model, mine.memory, mine.gpu) == ("qwen2.5-0.5b", "1GiB", "a100")
    tr = _with_setup(p.parse_args(["replay", "--trace", "t.jsonl"]))  # a trace keeps the small set-up
    assert tr.model == "qwen2.5-1.5b"


def test_the_default_is_a_setting_where_reading_beats_recomputing():
    """What the default stands for (the module docstring): a 14B-class model whose chunk reads clearly beat
    recomputing them, long agent sessions with 80-96 % of prompt chunks reused, KV several times host memory."""
    import numpy as np

    from kvstream.commands.replay import DEFAULT_PRESET, setup_for
    from kvstream.config import parse_size
    from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape
    from kvstream.workload import generate, preset
    from kvstream.workload.synthetic import reuse_rate

    setup = setup_for(DEFAULT_PRESET)
    cost = CostModel(get_gpu(setup["gpu"]), get_model_shape(setup["model"]), setup["tp"])
    assert cost.model.layer_params > 12e9  # 14B class
    reqs = generate(preset(DEFAULT_PRESET), 0)
    assert 0.80 <= reuse_rate(reqs) <= 0.96
    ctx = int(np.median([r.input_tokens for r in reqs]))
    assert ctx >= 8192  # long contexts
    read_s = cost.model.chunk_bytes() / 2.9e9  # this project's VM disk through the store (one tier)
    assert cost.recompute_chunk_s(ctx) > 1.5 * read_s
    kv = len({c for r in reqs for c in r.chunk_ids}) * cost.model.chunk_bytes()
    assert kv > 4 * parse_size(setup["memory"], "memory")
    assert kv < parse_size(setup["tier_capacity"], "tier")  # the disk tiers hold it all
    assert reqs[-1].arrival < 75  # minutes for four systems, not hours


@pytest.mark.slow
def test_kvstream_plus_compute_recomputes_fronts_through_the_real_store(tmp_path, capsys):
    """kvstream+compute on the real store (``Store.read_chunks(compute=...)``): with a shared tier emulated at
    50 MB/s, reading is slow enough that the modelled GPU takes some chunks from the front of the blocking
    loads, and every request still completes with finite TTFTs."""
    args = _args(tmp_path, "--systems", "kvstream+compute", "--requests", "12", "--emulate-gbps", "0.05")
    assert args.handler(args) == 0
    rep = json.loads(capsys.readouterr().out)
    s = rep["results"][0]["summary"]
    assert s["completed"] == 12 and s["ttft_mean_s"] > 0
    assert s["storage_computed_chunks"] > 0


def test_a_killed_replays_emulated_tier_is_removed_by_the_next(tmp_path):
    """Found when two killed replays left 9 GiB each in /dev/shm and the next one was OOM-killed: a RAM folder
    whose replay is gone is removed; a live replay's, and one without an owner file, are kept."""
    import os
    import subprocess

    from kvstream.commands.replay import _remove_stale_emulated_tiers

    dead = subprocess.Popen(["true"])
    dead.wait()
    for name, pid in (("kvstream-replay-dead", dead.pid), ("kvstream-replay-live", os.getpid())):
        (tmp_path / name).mkdir()
        (tmp_path / name / "chunk").write_bytes(b"x")
        (tmp_path / f"{name}.pid").write_text(str(pid))
    (tmp_path / "kvstream-replay-starting").mkdir()
    _remove_stale_emulated_tiers(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kvstream-replay-live", "kvstream-replay-live.pid",
                                                          "kvstream-replay-starting"]


@pytest.mark.slow
def test_the_table_names_each_bound_it_compares_with(tmp_path, capsys):
    # The human table (no --json): each row against its bound, and the legend says what the bound is: one tier
    # alone, two read at once (the round's joint probe), and the in-run bound beside the tiers' writes.
    args = _args(tmp_path, "--systems", "kvstream,lmcache-like")
    args.json = False
    assert args.handler(args) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "in-run bound" in out and "bound GB/s" in out
    assert "one tier alone (local" in out and "two read at once (local" in out and "shared" in out
    rep = json.loads((tmp_path / "out" / "replay.json").read_text())
    assert set(rep["joint_read_gbps"]) == {"local", "shared"}
