"""Reader for the Mooncake trace format (FAST'25 release): one JSON object a line.

    {"timestamp": <ms since start>, "input_length": <tokens>, "output_length": <tokens>, "hash_ids": [<int>, ...]}

``hash_ids`` has one id per 512-token block of the prompt (``len == ceil(input_length / 512)``); two requests
that share a leading run of ids share that prefix. The store works in 256-token chunks, so block ``b`` becomes
chunks ``2b`` and ``2b + 1``. Chunk ids are *prefix-chained* (the id of chunk ``j`` stands for the whole prefix
``0 .. j``), interned as small ints: ``id(j) = intern(id(j-1), hash_ids[j // 2], j % 2)``. Chaining makes the
ids correct even if a trace reused a block id under a different prefix; small ints keep the simulator fast.

A trailing partial block of ``r`` tokens yields ``r // 256`` chunks (0 or 1): a 300-token tail has one full
256-token chunk, the first half of its block, which matches the first half of the same block in a request
where that block is whole (same block id = same tokens). Tokens of a trailing partial *chunk* have no id
(``Request`` rule: they are always recomputed).

Malformed input raises :class:`kvstream.errors.InputFormatError` naming the file and the 1-based line, and
nothing else does: bytes that are not UTF-8, JSON nested past the decoder's recursion limit, numbers too long
to convert, and integer fields at or above 2**63 are bad lines like any other. Blank lines are skipped.
Timestamps must not go backwards (the released traces are sorted).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from pathlib import Path
from typing import Any

from kvstream.errors import InputFormatError
from kvstream.workload.text import MAX_TOKENS, MAX_TRACE_SECONDS, check_physical, check_utf8
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = ["BLOCK_TOKENS", "ChunkInterner", "iter_mooncake", "read_mooncake", "one_instance_share", "HUB_SHARE", "HUB_FANOUT"]

BLOCK_TOKENS = 512  # tokens per Mooncake hash block
_HALVES = BLOCK_TOKENS // CHUNK_TOKENS  # chunks per block (2)
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_INT_MAX = 2**63 - 1  # integer fields must fit int64: beyond it ``timestamp / 1000.0`` can overflow a float


class ChunkInterner:
    """Maps (parent chunk id, block id, half) to a dense int id, so equal prefixes get equal ids.

    Invariant: ids are 1, 2, 3, ... in first-seen order; 0 is the root (the empty prefix), never a chunk.
    """

    __slots__ = ("_table",)

    def __init__(self) -> None:
        self._table: dict[tuple[int, int, int], int] = {}

    def chunk_ids(self, hash_ids: list[int], n_chunks: int) -> tuple[int, ...]:
        table = self._table
        out: list[int] = []
        parent = 0
        for j in range(n_chunks):
            key = (parent, hash_ids[j // _HALVES], j % _HALVES)
            cid = table.get(key)
            if cid is None:
                cid = len(table) + 1
                table[key] = cid
            out.append(cid)
            parent = cid
        return tuple(out)

    def __len__(self) -> int:
        return len(self._table)


def _int_field(obj: dict[str, Any], name: str, path: str, line: int) -> int:
    """``obj[name]`` as an int in ``0 .. 2**63 - 1``; anything else is a bad line."""
    v = obj.get(name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise InputFormatError(path, line, f"field {name!r} must be an integer, got {v!r}")
    if v < 0:
        raise InputFormatError(path, line, f"field {name!r} must not be negative, got {v!r}")
    if v > _INT_MAX:
        raise InputFormatError(path, line, f"field {name!r} is beyond 64 bits (must be < 2**63), got {v!r}")
    return int(v)



def iter_mooncake(
    path: str | os.PathLike[str],
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
    interner: ChunkInterner | None = None,
) -> Iterator[Request]:
    """Yield the trace's requests in file order.

    ``time_scale`` divides arrival times (2.0 = replay twice as fast); ``limit`` stops after that many
    requests. Pass one ``interner`` to several calls to keep chunk ids consistent across files.
    """
    if time_scale <= 0:
        raise ValueError(f"time_scale must be positive, got {time_scale}")
    p = str(path)
    interner = interner if interner is not None else ChunkInterner()
    last_ts = -math.inf
    n = 0
    # surrogateescape: a byte that is not UTF-8 must become an error naming its line (check_utf8), not a
    # UnicodeDecodeError from inside the file iterator that names neither the file nor the line.
    with open(p, encoding="utf-8", errors="surrogateescape") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if limit is not None and n >= limit:
                return
            text = raw.strip()
            if not text:
                continue
            check_utf8(p, lineno, text)
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise InputFormatError(p, lineno, f"not valid JSON: {exc.msg} at column {exc.colno}") from None
            except RecursionError:
                # The decoder recurses once per nesting level; a trace line nests two deep, so this is garbage.
                raise InputFormatError(p, lineno, "not valid JSON: nested too deeply") from None
            except ValueError as exc:
                # Not a decode error: a number longer than Python's int conversion limit (4300 digits).
                raise InputFormatError(p, lineno, f"not valid JSON: {exc}") from None
            if not isinstance(obj, dict):
                raise InputFormatError(p, lineno, f"expected a JSON object, got {type(obj).__name__}")
            missing = [f for f in _FIELDS if f not in obj]
            if missing:
                raise InputFormatError(p, lineno, f"missing field(s) {', '.join(missing)}")
            ts = _int_field(obj, "timestamp", p, lineno)
            n_in = _int_field(obj, "input_length", p, lineno)
            n_out = _int_field(obj, "output_length", p, lineno)
            check_physical(p, lineno, "timestamp", ts, MAX_TRACE_SECONDS * 1000, "ms")
            check_physical(p, lineno, "input_length", n_in, MAX_TOKENS, "tokens")
            check_physical(p, lineno, "output_length", n_out, MAX_TOKENS, "tokens")
            hids = obj["hash_ids"]
            if not isinstance(hids, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hids):
                raise InputFormatError(p, lineno, "field 'hash_ids' must be a list of integers")
            want = -(-n_in // BLOCK_TOKENS)  # ceil in integers: float division rounds above 2**53
            if len(hids) != want:
                raise InputFormatError(
                    p, lineno, f"{len(hids)} hash_ids for input_length {n_in} (expected ceil({n_in}/512) = {want})"
                )
            if ts < last_ts:
                raise InputFormatError(p, lineno, f"timestamp {ts} goes backwards (previous line had {last_ts})")
            last_ts = ts
            yield Request(
                request_id=n,
                arrival=ts / 1000.0 / time_scale,
                input_tokens=n_in,
                output_tokens=n_out,
                chunk_ids=interner.chunk_ids(hids, n_in // CHUNK_TOKENS),
            )
            n += 1


def read_mooncake(
    path: str | os.PathLike[str], *, limit: int | None = None, time_scale: float = 1.0
) -> list[Request]:
    """All requests of a Mooncake trace file (see :func:`iter_mooncake`)."""
    return list(iter_mooncake(Path(path), limit=limit, time_scale=time_scale))


# A prefix is common to the whole service (a system prompt), not a session's, when at least this share of the
# trace's requests start with it and at least HUB_FANOUT different continuations follow it: a conversation's turns
# each extend the previous one (one continuation), a system prompt is followed by every session's own text. The
# conversation trace's first block is in 94 % of its requests.
HUB_SHARE = 0.05
HUB_FANOUT = 3


def _session_keys(reqs: Sequence[Request]) -> list[Hashable]:
    """Each request's session: the first chunk of its prompt past the prefixes common to the service (above), so
    every turn of a conversation, which starts with its first turn's prompt, gets the same key. A prompt made
    only of common prefixes (or under one chunk) is a session of its own."""
    share: Counter[Hashable] = Counter()
    after: dict[Hashable, set[Hashable]] = {}
    for r in reqs:
        ids = r.chunk_ids
        share.update(ids)
        for j in range(len(ids) - 1):
            after.setdefault(ids[j], set()).add(ids[j + 1])
    hubs = {cid for cid, n in share.items()
            if n >= HUB_SHARE * len(reqs) and len(after.get(cid, ())) >= HUB_FANOUT}
    keys: list[Hashable] = []
    for r in reqs:
        last = max((j for j, cid in enumerate(r.chunk_ids) if cid in hubs), default=-1)  # ids are prefix-chained
        keys.append(r.chunk_ids[last + 1] if last + 1 < len(r.chunk_ids) else ("request", r.request_id))
    return keys


def one_instance_share(reqs: Sequence[Request], instances: int, *, which: int = 0) -> list[Request]:
    """The requests one instance of ``instances`` gets when a session-affine router spreads the trace's sessions
    over them: each session (:func:`_session_keys`) goes whole to one instance, chosen by a hash of its key, and
    this returns instance ``which``'s, renumbered ``0..``, arrivals shifted so that the first is at 0.

    Why: a Mooncake trace is a cluster's; one modelled GPU cannot serve its rate, and its first N requests reuse
    little (a conversation's next turn comes thousands of requests later). One instance's share keeps each
    session's reuse and its timing, at 1/``instances`` of the rate. Deterministic: chunk ids are interned in file
    order, so the same file gives the same share."""
    if instances < 1 or not 0 <= which < instances:
        raise ValueError(f"one_instance_share: need instances >= 1 and 0 <= which < instances, got {instances}, "
                         f"{which}")
    if instances == 1:
        return list(reqs)
    kept = [r for r, key in zip(reqs, _session_keys(reqs))
            if zlib.crc32(repr(key).encode()) % instances == which]
    t0 = kept[0].arrival if kept else 0.0
    return [dataclasses.replace(r, request_id=i, arrival=r.arrival - t0) for i, r in enumerate(kept)]
