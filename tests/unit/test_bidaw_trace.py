"""The Bidaw conversation trace reader: parsing, checks with file and line, derived columns, Request objects."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvstream.errors import InputFormatError
from kvstream.workload.bidaw import (
    iter_bidaw_records,
    read_bidaw_parts,
    read_bidaw_trace,
    to_requests,
    trace_files,
)
from kvstream.workload.request import CHUNK_TOKENS

HEADER = "user_id time_stamp(seconds) query_length response_length round_index\n"
TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
BIDAW = TRACES / "bidaw-conversation"


def _write(tmp_path: Path, body: str, name: str = "t.txt", header: str = HEADER) -> Path:
    p = tmp_path / name
    p.write_text(header + body)
    return p


def test_reads_records_and_derives_history(tmp_path: Path) -> None:
    p = _write(tmp_path, "1 0 100 200 0\n2 5 10 20 0\n1 60 300 40 1\n\n1 90 7 8 2\n")
    recs = list(iter_bidaw_records(p))
    assert [(r.user_id, r.round_index, r.line) for r in recs] == [(1, 0, 2), (2, 0, 3), (1, 1, 4), (1, 2, 6)]
    tr = read_bidaw_trace(p)
    assert tr.history_tokens.tolist() == [0, 0, 300, 640]
    assert tr.prev_response.tolist() == [-1, -1, 200, 40]
    assert tr.is_last.tolist() == [False, True, False, True]
    assert len(tr) == 4 and tr.n_users == 2


@pytest.mark.parametrize(
    ("body", "line", "message"),
    [
        ("1 0 10 10 0\n1 5 10 10\n", 3, "expected 5 fields"),
        ("1 0 10 10 0\n1 5 ten 10 1\n", 3, "integers"),
        ("1 0 10 -3 0\n", 2, "negative"),
        ("1 0 10 10 0\n1 5 10 10 2\n", 3, "round 2 follows round 0"),
        ("1 0 10 10 0\n2 3 10 10 1\n", 3, "starts at round 1"),
        ("1 10 10 10 0\n1 5 10 10 1\n", 3, "before its previous round"),
        ("1 0 10 10 0\n1 9000000000000000000 10 10 1\n", 3, "'time_stamp' is 9000000000000000000 s, beyond physical"),
        ("1 0 1125899906842624 10 0\n", 2, "'query_length' is 1125899906842624 tokens, beyond physical"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, body: str, line: int, message: str) -> None:
    p = _write(tmp_path, body)
    for read in (lambda: list(iter_bidaw_records(p)), lambda: read_bidaw_trace(p)):
        with pytest.raises(InputFormatError, match=message) as err:
            read()
        assert err.value.path == str(p)
        assert err.value.line == line
        assert str(err.value).startswith(f"{p}:{line}: ")


def test_missing_header_is_rejected(tmp_path: Path) -> None:
    p = _write(tmp_path, "1 0 10 10 0\n", header="")
    with pytest.raises(InputFormatError, match="expected header") as err:
        read_bidaw_trace(p)
    assert err.value.line == 1
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(InputFormatError, match="empty file"):
        list(iter_bidaw_records(empty))


def test_parts_merge_in_time_order_and_must_not_share_users(tmp_path: Path) -> None:
    a = _write(tmp_path, "1 0 10 10 0\n1 20 10 10 1\n", "a.txt")
    b = _write(tmp_path, "2 10 5 5 0\n2 30 5 5 1\n", "b.txt")
    tr = read_bidaw_parts([a, b])
    assert tr.time.tolist() == [0, 10, 20, 30]
    assert tr.user.tolist() == [1, 2, 1, 2]
    assert tr.part.tolist() == [0, 1, 0, 1]
    assert [f.name for f in trace_files(tmp_path)] == ["a.txt", "b.txt"]
    c = _write(tmp_path, "1 40 5 5 0\n", "c.txt")
    with pytest.raises(InputFormatError, match="also appears in") as err:
        read_bidaw_parts([a, c])
    assert err.value.path == str(c) and err.value.line == 2


def test_to_requests_builds_prefix_chained_chunks(tmp_path: Path) -> None:
    p = _write(tmp_path, "7 0 300 100 0\n8 1 50 50 0\n7 9 200 90 1\n7 20 10 10 2\n")
    reqs = list(to_requests(iter_bidaw_records(p)))
    r0, other, r1, r2 = reqs
    assert [r.request_id for r in reqs] == [0, 1, 2, 3]
    assert r0.input_tokens == 300 and r0.chunk_ids == ((7, 0),)
    assert r1.input_tokens == 300 + 100 + 200 and r1.output_tokens == 90
    assert r1.chunk_ids == ((7, 0), (7, 1))
    assert r2.input_tokens == 600 + 90 + 10 and len(r2.chunk_ids) == 700 // CHUNK_TOKENS
    assert r2.chunk_ids[: len(r1.chunk_ids)] == r1.chunk_ids  # a later round extends the earlier prefix
    assert other.chunk_ids == () and other.session == 8
    assert (r1.session, r1.round_index, r1.prev_answer_tokens) == (7, 1, 100)
    assert r0.prev_answer_tokens is None
    with pytest.raises(ValueError, match="chunk_tokens"):
        list(to_requests(iter_bidaw_records(p), chunk_tokens=512))


def test_sample_users_keeps_three_in_ten(tmp_path: Path) -> None:
    body = "".join(f"{u} {u} 1 1 0\n" for u in range(1, 101))
    tr = read_bidaw_trace(_write(tmp_path, body))
    kept = tr.sample_users(0.3)
    assert kept.n_users == 30
    assert set(kept.user.tolist()) == {u for u in range(1, 101) if (u - 1) % 10 < 3}
    with pytest.raises(ValueError):
        tr.sample_users(0.25)


@pytest.mark.skipif(not BIDAW.is_dir(), reason=f"Bidaw trace folder not found at {BIDAW}")
def test_real_trace_part_reads_and_converts() -> None:
    part = BIDAW / "total_traces_part7.txt"
    tr = read_bidaw_trace(part, limit=3000)
    assert len(tr) == 3000
    assert np.all(np.diff(tr.time) >= 0)
    # Every user's rounds start at 0 and history grows by the previous round's query and response.
    order = np.lexsort((tr.round_index, tr.user))
    u, r, h = tr.user[order], tr.round_index[order], tr.history_tokens[order]
    q, a = tr.query[order], tr.response[order]
    same = u[1:] == u[:-1]
    assert np.all(r[1:][same] == r[:-1][same] + 1)
    assert np.all(h[1:][same] == h[:-1][same] + q[:-1][same] + a[:-1][same])
    reqs = list(to_requests(iter_bidaw_records(part, limit=3000)))
    assert len(reqs) == 3000
    assert sum(r.input_tokens for r in reqs) == int((tr.history_tokens + tr.query).sum())
