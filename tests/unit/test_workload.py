"""Workloads: the Mooncake reader (format, chunk mapping, errors with file and line) and the generator."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kvstream.errors import InputFormatError
from kvstream.workload import Request, generate, preset, read_mooncake, reuse_rate
from kvstream.workload.mooncake import ChunkInterner
from kvstream.workload.synthetic import LengthDist, SyntheticSpec, arrival_gaps, sample_cv

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"


def _write(tmp_path: Path, lines: list[str]) -> Path:
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def _line(ts=0, n_in=1024, n_out=8, ids=None) -> str:
    ids = ids if ids is not None else list(range(math.ceil(n_in / 512)))
    return json.dumps({"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids})


# -- Mooncake -------------------------------------------------------------------------------------------------
def test_mooncake_maps_blocks_to_two_chunks_prefix_chained(tmp_path):
    p = _write(tmp_path, [
        _line(0, 1024, 5, [7, 8]),  # 2 blocks -> 4 chunks
        _line(1500, 1300, 6, [7, 9, 10]),  # shares block 7 only; 1300 tokens -> 5 chunks (tail block: 276 tokens)
        _line(3000, 600, 1, [8, 3]),  # block 8 at position 0 is a different prefix from block 8 at position 1
    ])
    a, b, c = read_mooncake(p)
    assert (a.arrival, a.input_tokens, a.output_tokens) == (0.0, 1024, 5)
    assert b.arrival == 1.5
    assert len(a.chunk_ids) == 4 and len(b.chunk_ids) == 5 and len(c.chunk_ids) == 2
    assert a.chunk_ids[:2] == b.chunk_ids[:2]  # shared first block = shared two chunks
    assert a.chunk_ids[2] != b.chunk_ids[2]
    assert len(set(a.chunk_ids)) == 4
    assert not set(c.chunk_ids) & set(a.chunk_ids)  # chained: same block id under another prefix is new
    assert [r.request_id for r in (a, b, c)] == [0, 1, 2]


def test_mooncake_trailing_partial_block():
    it = ChunkInterner()
    # 300-token tail block -> one full chunk, the first half of that block
    assert len(it.chunk_ids([1, 2], (512 + 300) // 256)) == 3
    full = it.chunk_ids([1, 2], 4)
    part = it.chunk_ids([1, 2], 3)
    assert part == full[:3]


@pytest.mark.parametrize(
    "line, msg",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1}', "missing field(s) hash_ids"),
        ('{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1]}', "1 hash_ids for input_length 1024"),
        ('{"timestamp": -5, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "must not be negative"),
        ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}', "must be an integer"),
        ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": ["a"]}', "list of integers"),
        ('{"timestamp": 9000000000000000000, "input_length": 10, "output_length": 1, "hash_ids": [1]}',
         "'timestamp' is 9000000000000000000 ms, beyond physical sense"),
        ('{"timestamp": 5, "input_length": 10, "output_length": 9000000000000000000, "hash_ids": [1]}',
         "'output_length' is 9000000000000000000 tokens, beyond physical sense"),
    ],
)
def test_mooncake_rejects_malformed_lines_with_file_and_line(tmp_path, line, msg):
    p = _write(tmp_path, [_line(0), "", line])
    with pytest.raises(InputFormatError) as ei:
        read_mooncake(p)
    assert ei.value.line == 3 and ei.value.path == str(p)
    assert msg in str(ei.value)
    assert str(ei.value).startswith(f"{p}:3: ")


def test_mooncake_rejects_time_going_backwards(tmp_path):
    p = _write(tmp_path, [_line(1000), _line(999)])
    with pytest.raises(InputFormatError, match=r":2: timestamp 999 goes backwards"):
        read_mooncake(p)


def test_mooncake_limit_and_time_scale(tmp_path):
    p = _write(tmp_path, [_line(0), _line(2000), _line(4000)])
    rs = read_mooncake(p, limit=2, time_scale=2.0)
    assert [r.arrival for r in rs] == [0.0, 1.0]


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"trace folder absent: {TRACES}")
def test_mooncake_conversation_trace_reads_whole():
    rs = read_mooncake(MOONCAKE)
    assert len(rs) == 12031
    assert all(len(r.chunk_ids) == r.input_tokens // 256 for r in rs)
    # The README's unlimited-cache block hit rate is about 0.37; chunk-level is the same within a hair.
    assert 0.34 < reuse_rate(rs) < 0.40


def _sessions_trace(tmp_path: Path, n_sessions: int = 12, turns: int = 3) -> Path:
    """Sessions whose turns grow (each turn's prompt starts with the previous one's), interleaved, every prompt
    behind one common block (a system prompt, id 0)."""
    lines, ts = [], 0
    for t in range(turns):
        for s in range(n_sessions):
            ids = [0] + [1000 * (s + 1) + k for k in range(t + 1)]
            lines.append(_line(ts, 512 * len(ids), 4, ids))
            ts += 250
    return _write(tmp_path, lines)


def test_one_instance_share_keeps_each_session_whole_and_splits_the_sessions(tmp_path):
    from kvstream.workload.mooncake import one_instance_share

    reqs = read_mooncake(_sessions_trace(tmp_path))
    shares = [one_instance_share(reqs, 3, which=w) for w in range(3)]
    assert sum(len(s) for s in shares) == len(reqs)
    firsts = []
    for share in shares:
        if not share:
            continue
        assert [r.request_id for r in share] == list(range(len(share)))  # renumbered
        assert share[0].arrival == 0.0 and all(a.arrival <= b.arrival for a, b in zip(share, share[1:]))
        firsts.append({r.chunk_ids[2] for r in share})  # a session's own first block (chunks 2, 3)
        # a session's every turn is in this share: each later turn's prompt extends one kept earlier
        for r in share:
            if len(r.chunk_ids) > 4:
                assert any(q.chunk_ids == r.chunk_ids[:-2] for q in share)
    assert all(not (a & b) for i, a in enumerate(firsts) for b in firsts[i + 1:])  # no session in two shares
    assert len(firsts) >= 2  # 12 sessions over 3 instances: not all in one
    assert one_instance_share(reqs, 1) == reqs
    with pytest.raises(ValueError, match="instances"):
        one_instance_share(reqs, 2, which=2)


@pytest.mark.skipif(not MOONCAKE.exists(), reason=f"trace folder absent: {TRACES}")
def test_one_instance_share_of_the_conversation_trace_reuses_more_within_its_first_requests():
    # The whole trace's first 150 requests reuse ~4 % (a conversation's next turn comes thousands of requests
    # later); one instance's share of 20 keeps each conversation whole, so its first 150 reuse ~40 %.
    from kvstream.workload.mooncake import one_instance_share

    rs = read_mooncake(MOONCAKE)
    assert reuse_rate(rs[:150]) < 0.1
    share = one_instance_share(rs, 20)
    assert 500 < len(share) < 700 and reuse_rate(share[:150]) > 0.3


# -- the generator --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cv", [0.0, 1.0, 4.3, 8.0])
def test_generator_hits_target_cv(cv):
    rs = generate(SyntheticSpec(n_requests=3000, rate=5.0, cv=cv, reuse=0.5), seed=3)
    gaps = np.diff([r.arrival for r in rs])
    assert sample_cv(gaps) == pytest.approx(cv, abs=0.01)
    assert gaps.mean() == pytest.approx(0.2, rel=1e-6)


@pytest.mark.parametrize("cv", [1.0, 4.3])
def test_raw_gamma_gaps_are_near_target_cv(cv):
    # Without calibration the draw is a plain gamma renewal process; large samples land near the target.
    g = arrival_gaps(np.random.default_rng(0), 200_000, mean=1.0, cv=cv, exact=False)
    assert sample_cv(g) == pytest.approx(cv, rel=0.08)


@pytest.mark.parametrize("reuse", [0.04, 0.5, 0.77, 0.88])
@pytest.mark.parametrize("mode", ["session", "document"])
def test_generator_hits_target_reuse(reuse, mode):
    spec = SyntheticSpec(n_requests=1500, reuse=reuse, mode=mode,
                         prefix=LengthDist(mean=16384, cv=0.5), new_tokens=LengthDist(mean=256, cv=0.5))
    rs = generate(spec, seed=11)
    assert reuse_rate(rs) == pytest.approx(reuse, abs=0.02)


def test_same_seed_same_workload_and_different_seed_differs():
    spec = preset("agent-small")
    a, b = generate(spec, seed=5), generate(spec, seed=5)
    assert a == b
    assert generate(spec, seed=6) != a


def test_sessions_grow_and_interleave():
    rs = generate(SyntheticSpec(n_requests=400, reuse=None, active=8, turns=LengthDist(mean=5, cv=0)), seed=1)
    by_session: dict = {}
    for r in rs:
        by_session.setdefault(r.session, []).append(r)
    for turns in by_session.values():
        assert [t.round_index for t in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:]):
            assert cur.input_tokens > prev.input_tokens
            assert cur.chunk_ids[: len(prev.chunk_ids)] == prev.chunk_ids  # history is a prefix
            assert cur.prev_answer_tokens == prev.output_tokens
    # interleaving: consecutive requests mostly belong to different sessions
    switches = sum(a.session != b.session for a, b in zip(rs, rs[1:]))
    assert switches > 0.7 * len(rs)
    one = generate(SyntheticSpec(n_requests=100, reuse=None, active=1, turns=LengthDist(mean=5, cv=0)), seed=1)
    assert sum(a.session != b.session for a, b in zip(one, one[1:])) == 100 // 5 - 1


def test_length_distributions_have_their_means():
    rs = generate(SyntheticSpec(n_requests=4000, reuse=0.0, output=LengthDist(mean=300, cv=1.0)), seed=2)
    assert np.mean([r.output_tokens for r in rs]) == pytest.approx(300, rel=0.06)


def test_request_validates_chunk_count():
    with pytest.raises(ValueError, match="expected 2"):
        Request(request_id=0, arrival=0.0, input_tokens=600, output_tokens=1, chunk_ids=(1,))
