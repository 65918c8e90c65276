"""Reader for Bidaw's interactive conversation trace (FAST'26; ``shared/data/traces/bidaw-conversation``).

Format: one header line ``user_id time_stamp(seconds) query_length response_length round_index``, then one
request a line, whitespace separated, five non-negative integers. Lengths are tokens. A user's rounds are
numbered 0, 1, 2, ... in time order; round ``r`` reuses the KV of everything the user said and was answered
in rounds ``0 .. r-1`` (the trace has no prefix hashes: reuse is implied by the user id).

What the reader checks, and reports as :class:`~kvstream.errors.InputFormatError` naming the file and line
(no other exception escapes for bad content):
- every line is UTF-8;
- the header is present (its wording is compared loosely: five fields, the first starting with ``user``);
- every line has five integer fields, none negative and none beyond 64 bits (``< 2**63``: the columns are int64);
- a user's rounds are consecutive (``round_index`` of a user's line is one more than its previous line's,
  and the first line of a user is round 0) and its time stamps never go back;
- a user's query and response tokens, summed over its rounds so far, stay below ``2**63`` (its history column).
Lines need not be sorted by time across users (the published parts are); :func:`read_bidaw_parts` merges
several parts in time order. Blank lines are skipped.

Two outputs:
- :class:`BidawRecord` objects, streamed one a line (:func:`iter_bidaw_records`);
- :class:`BidawTrace`, the same columns as numpy arrays with the derived history (what round ``r`` reloads),
  for the studies that replay 500k accesses (:func:`read_bidaw_trace`, :func:`read_bidaw_parts`).
:func:`to_requests` turns records into the shared :class:`~kvstream.workload.request.Request` type.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstream.errors import InputFormatError
from kvstream.workload.text import MAX_ROUNDS, MAX_TOKENS, MAX_TRACE_SECONDS, check_physical, check_utf8
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = [
    "BidawRecord",
    "BidawTrace",
    "iter_bidaw_records",
    "read_bidaw_trace",
    "read_bidaw_parts",
    "trace_files",
    "to_requests",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class BidawRecord:
    """One line of the trace: one round of one user's conversation."""

    user_id: int  # anonymised user id; one conversation per user
    time: float  # arrival, seconds since the trace's start
    query_tokens: int  # the user's new input this round
    response_tokens: int  # the model's answer this round
    round_index: int  # 0 for the user's first request
    line: int = 0  # line number in its file (1 = header), for messages


_INT_MAX = 2**63 - 1  # every value must fit the int64 columns of BidawTrace (numpy raises OverflowError past it)


def _parse_line(path: str, line_no: int, text: str) -> tuple[int, int, int, int, int]:
    check_utf8(path, line_no, text)
    fields = text.split()
    if len(fields) != 5:
        raise InputFormatError(path, line_no, f"expected 5 fields (user time query response round), got {len(fields)}")
    try:
        user, ts, q, r, rnd = (int(f) for f in fields)
    except ValueError:
        raise InputFormatError(path, line_no, f"fields must be integers, got {text.strip()!r}") from None
    if ts < 0 or q < 0 or r < 0 or rnd < 0:
        raise InputFormatError(path, line_no, f"negative value in {text.strip()!r}")
    if max(user, ts, q, r, rnd) > _INT_MAX or user < -_INT_MAX - 1:
        raise InputFormatError(path, line_no, f"value beyond 64 bits (must be < 2**63) in {text.strip()!r}")
    check_physical(path, line_no, "time_stamp", ts, MAX_TRACE_SECONDS, "s")
    check_physical(path, line_no, "query_length", q, MAX_TOKENS, "tokens")
    check_physical(path, line_no, "response_length", r, MAX_TOKENS, "tokens")
    check_physical(path, line_no, "round_index", rnd, MAX_ROUNDS, "rounds")
    return user, ts, q, r, rnd


def _check_header(path: str, text: str) -> None:
    check_utf8(path, 1, text)
    fields = text.split()
    if len(fields) != 5 or not fields[0].lower().startswith("user"):
        raise InputFormatError(
            path, 1, f"expected header 'user_id time_stamp(seconds) query_length response_length round_index', got {text.strip()!r}"
        )


def iter_bidaw_records(path: str | os.PathLike[str], *, limit: int | None = None) -> Iterator[BidawRecord]:
    """Stream the records of one trace file, checking each line (see the module docstring).

    ``limit`` stops after that many records (for tests and quick looks at a part).
    """
    spath = str(path)
    for line_no, user, ts, q, r, rnd in _checked_lines(spath, limit):
        yield BidawRecord(user_id=user, time=float(ts), query_tokens=q, response_tokens=r, round_index=rnd, line=line_no)


def _checked_lines(spath: str, limit: int | None) -> Iterator[tuple[int, int, int, int, int, int]]:
    """``(line, user, time, query, response, round)`` of each record of one file, every check applied
    (header, fields, per-user order and totals); at most ``limit`` records."""
    last: dict[int, tuple[int, int, int]] = {}  # user -> (last round, last time, tokens so far)
    n = 0
    # surrogateescape: a byte that is not UTF-8 must become an error naming its line (check_utf8), not a
    # UnicodeDecodeError from inside the file iterator that names neither the file nor the line.
    with open(spath, encoding="utf-8", errors="surrogateescape") as fh:
        header = fh.readline()
        if not header:
            raise InputFormatError(spath, 1, "empty file (no header)")
        _check_header(spath, header)
        for line_no, text in enumerate(fh, start=2):
            if not text.strip():
                continue
            if limit is not None and n >= limit:
                return
            user, ts, q, r, rnd = _parse_line(spath, line_no, text)
            _check_order(spath, line_no, last, user, ts, rnd, q + r)
            n += 1
            yield line_no, user, ts, q, r, rnd


def _check_order(
    path: str, line_no: int, last: dict[int, tuple[int, int, int]], user: int, ts: int, rnd: int, tokens: int
) -> None:
    """Check a line against its user's previous one; ``last`` maps user -> (round, time, query + response
    tokens over its rounds so far) and is updated. ``_derive`` sums the tokens in int64, where an overflow would
    wrap silently: the per-line bounds (``MAX_TOKENS`` per field, ``MAX_ROUNDS`` rounds) keep a total under
    2**45, and the check below says so should those bounds ever be raised."""
    prev = last.get(user)
    total = tokens
    if prev is None:
        if rnd != 0:
            raise InputFormatError(path, line_no, f"user {user} starts at round {rnd}, expected round 0")
    else:
        prev_round, prev_time, prev_total = prev
        if rnd != prev_round + 1:
            raise InputFormatError(path, line_no, f"user {user}: round {rnd} follows round {prev_round}")
        if ts < prev_time:
            raise InputFormatError(path, line_no, f"user {user}: time {ts} is before its previous round's {prev_time}")
        total += prev_total
    if total > _INT_MAX:
        raise InputFormatError(path, line_no, f"user {user}: {total} tokens over its rounds so far, beyond 64 bits")
    last[user] = (rnd, ts, total)


@dataclass(frozen=True, slots=True, kw_only=True)
class BidawTrace:
    """A trace as columns, in arrival order (stable by time; ties keep file order). All arrays have one row per request.

    Invariant: for every user, rows appear in round order; ``history_tokens[i]`` is the sum of that user's
    query and response tokens over its earlier rounds (0 for round 0); ``is_last[i]`` marks its final round.
    """

    user: np.ndarray  # int64 user id
    time: np.ndarray  # float64 arrival, seconds
    query: np.ndarray  # int64 query tokens
    response: np.ndarray  # int64 response tokens
    round_index: np.ndarray  # int64
    history_tokens: np.ndarray  # int64 tokens reused from earlier rounds (the KV this request loads)
    prev_response: np.ndarray  # int64 previous round's response tokens; -1 for round 0
    is_last: np.ndarray  # bool, the user's last round in this trace
    part: np.ndarray  # int16 index into ``sources`` of the file each row came from
    sources: tuple[str, ...]  # file paths, in the order given

    def __len__(self) -> int:
        return int(self.user.shape[0])

    @property
    def n_users(self) -> int:
        return int(np.unique(self.user).shape[0])

    def select(self, mask: np.ndarray) -> BidawTrace:
        """Rows where ``mask`` is true. Keep whole users (a mask over users), or the history columns lie."""
        return BidawTrace(
            user=self.user[mask], time=self.time[mask], query=self.query[mask], response=self.response[mask],
            round_index=self.round_index[mask], history_tokens=self.history_tokens[mask],
            prev_response=self.prev_response[mask], is_last=self.is_last[mask], part=self.part[mask],
            sources=self.sources,
        )  # fmt: skip

    def sample_users(self, fraction: float) -> BidawTrace:
        """Keep a deterministic ``fraction`` of users, the way the trace's authors thin the load: users sorted by
        id, user ``i`` kept when ``i % 10 < round(10 * fraction)`` (so 0.3 keeps 3 of every 10)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"user fraction must be in (0, 1], got {fraction}")
        if fraction == 1:
            return self
        keep_per_10 = round(10 * fraction)
        if keep_per_10 < 1 or abs(keep_per_10 - 10 * fraction) > 1e-9:
            raise ValueError(f"user fraction must be a multiple of 0.1, got {fraction}")
        users = np.unique(self.user)
        kept = users[np.arange(users.shape[0]) % 10 < keep_per_10]
        return self.select(np.isin(self.user, kept))


def _derive(user: np.ndarray, query: np.ndarray, response: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """History tokens, previous response and last-round flags for rows already in per-user round order."""
    n = user.shape[0]
    order = np.argsort(user, kind="stable")  # rows grouped by user, each group in round order
    u = user[order]
    start = np.ones(n, dtype=bool)
    start[1:] = u[1:] != u[:-1]
    tokens = (query + response)[order]
    csum = np.cumsum(tokens)
    group_start = np.maximum.accumulate(np.where(start, np.arange(n), 0))
    before = csum - tokens  # tokens of all earlier rows (any user)
    history_sorted = before - before[group_start]
    prev_sorted = np.full(n, -1, dtype=np.int64)
    resp_sorted = response[order]
    prev_sorted[1:] = np.where(start[1:], -1, resp_sorted[:-1])
    last_sorted = np.ones(n, dtype=bool)
    last_sorted[:-1] = u[1:] != u[:-1]
    history = np.empty(n, dtype=np.int64)
    prev = np.empty(n, dtype=np.int64)
    last = np.empty(n, dtype=bool)
    history[order] = history_sorted
    prev[order] = prev_sorted
    last[order] = last_sorted
    return history, prev, last


def read_bidaw_parts(paths: Sequence[str | os.PathLike[str]], *, limit: int | None = None) -> BidawTrace:
    """Read one or more trace files into one :class:`BidawTrace`, merged in time order.

    A user must not appear in two files (the published parts are split by user); this is checked.
    ``limit`` caps the records read from each file.
    """
    cols: list[list[int]] = [[], [], [], [], [], []]
    owner: dict[int, int] = {}  # user -> file index
    sources = tuple(str(p) for p in paths)
    if not sources:
        raise ValueError("no trace files given")
    for idx, spath in enumerate(sources):
        users, times, queries, responses, rounds, parts = cols
        for line_no, user, ts, q, r, rnd in _checked_lines(spath, limit):
            if rnd == 0:
                prev_owner = owner.setdefault(user, idx)
                if prev_owner != idx:
                    raise InputFormatError(spath, line_no, f"user {user} also appears in {sources[prev_owner]}")
            users.append(user)
            times.append(ts)
            queries.append(q)
            responses.append(r)
            rounds.append(rnd)
            parts.append(idx)
    user_col = np.asarray(cols[0], dtype=np.int64)
    time = np.asarray(cols[1], dtype=np.float64)
    order = np.argsort(time, kind="stable")  # per user, time order == round order (checked above)
    user_col = user_col[order]
    query = np.asarray(cols[2], dtype=np.int64)[order]
    response = np.asarray(cols[3], dtype=np.int64)[order]
    history, prev, last = _derive(user_col, query, response)
    return BidawTrace(
        user=user_col, time=time[order], query=query, response=response,
        round_index=np.asarray(cols[4], dtype=np.int64)[order], history_tokens=history, prev_response=prev,
        is_last=last, part=np.asarray(cols[5], dtype=np.int16)[order], sources=sources,
    )  # fmt: skip


def trace_files(path: str | os.PathLike[str]) -> list[Path]:
    """The trace files at ``path``: the file itself, or every ``*.txt`` in a folder (sorted by name)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix == ".txt" and f.is_file())
        if not files:
            raise FileNotFoundError(f"no *.txt trace files in {p}")
        return files
    if not p.exists():
        raise FileNotFoundError(f"trace not found: {p}")
    return [p]


def read_bidaw_trace(path: str | os.PathLike[str], *, limit: int | None = None) -> BidawTrace:
    """Read a trace file, or all parts in a folder (see :func:`trace_files`)."""
    return read_bidaw_parts(trace_files(path), limit=limit)


def to_requests(records: Iterable[BidawRecord], *, chunk_tokens: int = CHUNK_TOKENS) -> Iterator[Request]:
    """Turn records (in arrival order) into :class:`Request` objects with prefix-chained chunk ids.

    Round ``r``'s prompt is the user's history (all earlier queries and responses) plus this round's query; it
    generates ``response_tokens``. A user's history only grows, so chunk ``i`` of a user always covers the same
    tokens and ``(user_id, i)`` is a valid prefix-chained id: two requests share chunk ``i`` exactly when they are
    the same user's. ``request_id`` counts from 0 in the order given. Only ``chunk_tokens == CHUNK_TOKENS`` fits
    the :class:`Request` contract; the parameter exists to fail loudly if someone changes one without the other.
    """
    if chunk_tokens != CHUNK_TOKENS:
        raise ValueError(f"Request chunks are {CHUNK_TOKENS} tokens; got chunk_tokens={chunk_tokens}")
    history: dict[int, tuple[int, int]] = {}  # user -> (history tokens, last response tokens)
    last_time = float("-inf")
    for rid, rec in enumerate(records):
        if rec.time < last_time:
            raise ValueError(f"records out of time order at user {rec.user_id} round {rec.round_index} (line {rec.line})")
        last_time = rec.time
        hist, prev_resp = history.get(rec.user_id, (0, -1))
        if (rec.round_index == 0) != (rec.user_id not in history):
            raise ValueError(f"user {rec.user_id}: round {rec.round_index} out of sequence (line {rec.line})")
        prompt = hist + rec.query_tokens
        n_chunks = prompt // chunk_tokens
        yield Request(
            request_id=rid,
            arrival=rec.time,
            input_tokens=prompt,
            output_tokens=rec.response_tokens,
            chunk_ids=tuple((rec.user_id, i) for i in range(n_chunks)),
            session=rec.user_id,
            round_index=rec.round_index,
            prev_answer_tokens=prev_resp if prev_resp >= 0 else None,
        )
        history[rec.user_id] = (prompt + rec.response_tokens, rec.response_tokens)
