"""Trace studies: cache-only replay, weighted reuse distance, the correlation windows and the ``study`` command."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from kvstream.cli import main
from kvstream.study.cache_replay import STUDY_POLICIES, build_accesses, replay
from kvstream.study.reuse import (
    WindowSpec,
    answer_distance_correlation,
    authors_windows,
    lower_bounds,
    weighted_reuse_distances,
)
from kvstream.workload.bidaw import read_bidaw_trace

HEADER = "user_id time_stamp(seconds) query_length response_length round_index\n"
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
BIDAW = TRACES / "bidaw-conversation"


def _synthetic(path: Path, *, users: int = 120, seed: int = 0, think_per_token: float = 1.0) -> Path:
    """Users start over the first hour and come back after a think time of ``think_per_token`` seconds per token
    of the answer they got (plus noise): the relation Bidaw observed. Answers take 25 distinct lengths."""
    rng = random.Random(seed)
    rows = []
    path.parent.mkdir(parents=True, exist_ok=True)
    for u in range(1, users + 1):
        t = rng.uniform(0, 3600)
        for rnd in range(rng.randrange(3, 25)):
            q, a = rng.randrange(5, 80), 12 * rng.randrange(1, 26)
            rows.append((int(t), u, q, a, rnd))
            t += 5 + think_per_token * a + rng.expovariate(1 / 20)
    rows.sort()
    path.write_text(HEADER + "".join(f"{u} {t} {q} {a} {r}\n" for t, u, q, a, r in rows))
    return path


# ---------------------------------------------------------------------------------------------------------------
# replay


def test_replay_counts_hits_and_misses_by_hand(tmp_path: Path) -> None:
    # a: rounds at 0, 10, 20; b: rounds at 5, 15. Each round stores 10 tokens more; 1 byte per token.
    p = tmp_path / "t.txt"
    p.write_text(HEADER + "1 0 5 5 0\n2 5 5 5 0\n1 10 5 5 1\n2 15 5 5 1\n1 20 5 5 2\n")
    stream = build_accesses(read_bidaw_trace(p), bytes_per_token=1)
    assert stream.store_bytes.tolist() == [10, 10, 20, 20, 30]
    assert stream.counted.tolist() == [False, False, True, True, True]
    big = replay(stream, "lru", 1000)
    assert (big.hits, big.misses) == (3, 0)
    # Room for 25 bytes: a(10) + b(10); at t=10 a hits and grows to 20 -> 30 > 25: LRU evicts b (older). At t=15
    # b misses and comes back at 20 bytes; it is b's last round, so it is dropped after use; at t=20 a hits.
    small = replay(stream, "lru", 25)
    assert (small.hits, small.misses) == (2, 1)
    # Keeping finished conversations: b's 20 bytes stay, LRU evicts a (last used at 10) and a misses at t=20.
    kept = replay(stream, "lru", 25, drop_finished=False)
    assert (kept.hits, kept.misses) == (1, 2)


def test_belady_bounds_every_policy_on_equal_sizes(tmp_path: Path) -> None:
    trace = read_bidaw_trace(_synthetic(tmp_path / "total_traces_part1.txt", users=80))
    stream = build_accesses(trace, bytes_per_token=1, context_cap=1)  # every conversation weighs one byte
    results = {name: replay(stream, name, 12) for name in STUDY_POLICIES}
    for name, r in results.items():
        assert r.accesses == int(stream.counted.sum())
        assert results["belady"].misses <= r.misses, name
    assert results["belady"].misses < results["lru"].misses


def test_hit_potential_beats_lru_when_answer_length_predicts_return(tmp_path: Path) -> None:
    trace = read_bidaw_trace(_synthetic(tmp_path / "total_traces_part1.txt", users=200, think_per_token=2.0))
    stream = build_accesses(trace, bytes_per_token=1, context_cap=1)
    lru = replay(stream, "lru", 25)
    hp = replay(stream, "hit-potential", 25)
    assert hp.miss_rate < lru.miss_rate


def test_queue_aware_replay_protects_the_next_requests(tmp_path: Path) -> None:
    trace = read_bidaw_trace(_synthetic(tmp_path / "total_traces_part1.txt", users=60))
    stream = build_accesses(trace, bytes_per_token=1, context_cap=1)
    qa = replay(stream, "queue-aware", 10, lookahead=5)
    lru = replay(stream, "lru", 10)
    assert qa.misses < lru.misses  # the next 5 requests' conversations are never evicted just before use
    assert replay(stream, "queue-aware", 10, lookahead=0).misses == lru.misses


# ---------------------------------------------------------------------------------------------------------------
# reuse distance and correlation


def test_weighted_reuse_distance_counts_distinct_users_latest_size() -> None:
    users = np.array([1, 2, 3, 2, 1, 3])
    weights = np.array([10, 20, 30, 25, 11, 31])
    d = weighted_reuse_distances(users, weights)
    assert np.isnan(d[:3]).all()
    assert d[3] == 30  # user 2: only user 3 in between
    assert d[4] == 30 + 25  # user 1: user 3 (30) and user 2 at its latest size (25), once each
    assert d[5] == 25 + 11  # user 3: user 2 (25) and user 1 (11)


def test_lower_bounds_drop_low_outliers() -> None:
    answers = np.array([5, 5, 5, 5, 5, 9, 9])
    dists = np.array([1.0, 100.0, 101.0, 102.0, 103.0, 50.0, 60.0])
    xs, ys = lower_bounds(answers, dists)
    assert xs.tolist() == [5, 9]
    assert ys.tolist() == [100.0, 50.0]  # 1.0 is below Q1 - 1.5 IQR for length 5


def test_correlation_is_high_only_when_think_time_follows_answer_length(tmp_path: Path) -> None:
    spec = WindowSpec(label="8:00", source="total_traces_part1.txt", cohort_start=0.0, fraction=1.0,
                      window_start=600.0, window_len=3000.0)  # fmt: skip
    related = read_bidaw_trace(_synthetic(tmp_path / "a" / "total_traces_part1.txt", users=300, think_per_token=1.0))
    unrelated = read_bidaw_trace(_synthetic(tmp_path / "b" / "total_traces_part1.txt", users=300, think_per_token=0.0))
    r1 = answer_distance_correlation(related, spec, bytes_per_token=1, context_cap=None)
    r0 = answer_distance_correlation(unrelated, spec, bytes_per_token=1, context_cap=None)
    assert r1.points >= 20 and r0.points >= 20
    assert r1.rho > 0.8
    assert r1.rho > r0.rho + 0.3


def test_authors_windows_available_only_for_loaded_parts(tmp_path: Path) -> None:
    trace = read_bidaw_trace(_synthetic(tmp_path / "total_traces_part1.txt", users=10))
    have, missing = authors_windows(trace)
    assert [w.label for w in have] == ["8:00"]
    assert len(missing) == 11


# ---------------------------------------------------------------------------------------------------------------
# the command


def test_study_eviction_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _synthetic(tmp_path / "total_traces_part1.txt", users=60)
    rc = main(["study", "eviction", "--trace", str(path), "--memory-gb", "1", "4", "--policies", "lru", "hit-potential",
               "queue-aware", "fifo", "lfu", "belady", "--compact", "--json"])  # fmt: skip
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["kv_bytes_per_token"] == 819200
    assert {r["policy"] for r in out["results"]} == {"lru", "hit-potential", "queue-aware", "fifo", "lfu", "belady",
                                                     "hit-potential+compact"}  # fmt: skip
    for r in out["results"]:
        assert r["hits"] + r["misses"] > 0
        assert r["hit_rate"] == pytest.approx(1 - r["miss_rate"])
    by = {(r["memory_gib"], r["policy"]): r["miss_rate"] for r in out["results"]}
    assert by[(4.0, "lru")] <= by[(1.0, "lru")]
    assert by[(1.0, "hit-potential+compact")] <= by[(1.0, "hit-potential")] + 0.05
    assert len(out["b3"]) == 2 and out["compact"]["space_ratio"] == pytest.approx(2.0)


def test_study_eviction_human_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _synthetic(tmp_path / "total_traces_part1.txt", users=30)
    assert main(["study", "eviction", "--trace", str(path), "--memory-gb", "2", "--policies", "lru", "hit-potential",
                 "queue-aware"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "B3" in text and "B8" in text and "hit-potential" in text


def test_study_reuse_command_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _synthetic(tmp_path / "total_traces_part1.txt", users=200)
    assert main(["study", "reuse", "--trace", str(path), "--json", "--min-cohort", "50", "--window-fraction", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["distribution"][0]["reuses"] > 0
    assert 0 <= out["distribution"][0]["share_beyond"]["200"] <= 1
    assert any(c["kind"] == "hourly" for c in out["correlation"])
    assert len(out["b4"]["authors_windows_missing"]) == 11


def test_study_rejects_a_malformed_trace_with_exit_code_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text(HEADER + "1 0 5 5 0\n1 x 5 5 1\n")
    assert main(["study", "eviction", "--trace", str(bad)]) == 2
    assert f"{bad}:3:" in capsys.readouterr().err
    assert main(["study", "eviction", "--trace", str(bad), "--model", "gpt-9"]) == 2
    assert "unknown model" in capsys.readouterr().err


@pytest.mark.skipif(not BIDAW.is_dir(), reason=f"Bidaw trace folder not found at {BIDAW}")
def test_real_trace_slice_replays(capsys: pytest.CaptureFixture[str]) -> None:
    path = BIDAW / "total_traces_part7.txt"
    assert main(["study", "eviction", "--trace", str(path), "--limit", "3000", "--memory-gb", "20",
                 "--policies", "lru", "hit-potential", "belady", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    by = {r["policy"]: r for r in out["results"]}
    assert by["lru"]["hits"] + by["lru"]["misses"] > 2000
    assert by["belady"]["misses"] <= by["lru"]["misses"]
