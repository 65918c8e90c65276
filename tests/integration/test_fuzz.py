"""Property-based fuzzing (hypothesis) of every parser that reads bytes from outside the process: the chunk
header, the index log and snapshot, the Mooncake and Bidaw trace readers, and ``kvstream verify``.

The contract under test: a parser returns a valid object or raises its own typed error
(:class:`CorruptChunkError`, :class:`InputFormatError`, ``ValueError`` for the snapshot); never anything else,
and never an object that breaks the invariants its module states. ``KVSTREAM_FUZZ_EXAMPLES`` (default 200)
sets the number of inputs each test tries; every test counts them and checks that many really ran.
With ``KVSTREAM_FUZZ_REPORT=FILE`` the counts are appended to FILE as JSON lines (RELIABILITY.md's figures).
The coverage-guided counterpart (atheris) is in ``fuzz/``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.errors import CorruptChunkError, InputFormatError
from kvstream.format import (
    _FIXED,
    _SUM,
    HEADER_BYTES,
    VERSION,
    ChunkMeta,
    decode_header,
    payload_checksum,
    verify_payload,
    write_header,
)
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.index import _REC, IndexRecord, TierIndex, _decode_log, _encode

N = int(os.environ.get("KVSTREAM_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def run_counted(name: str, prop: Callable[..., None], *strategies: st.SearchStrategy) -> int:
    """Run ``prop`` under hypothesis, count the inputs it really got, check there were N, record the count."""
    calls = [0]

    @FUZZ
    @given(st.tuples(*strategies))
    def wrapped(args: tuple) -> None:
        calls[0] += 1
        prop(*args)

    wrapped()
    assert calls[0] >= N, f"{name}: only {calls[0]} inputs tried"
    report = os.environ.get("KVSTREAM_FUZZ_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(json.dumps({"target": name, "inputs": calls[0], "engine": "hypothesis"}) + "\n")
    return calls[0]


# ── chunk header ───────────────────────────────────────────────────────────────────────────────────────────


def _valid_header(key: bytes, meta: ChunkMeta, payload: bytes) -> bytearray:
    buf = bytearray(HEADER_BYTES)
    write_header(memoryview(buf), key=key, meta=meta, payload_len=len(payload), payload_sum=payload_checksum(payload),
                 created_ns=123)
    return buf


def _check_decoded(h) -> None:
    assert 0 < len(h.key) <= 64 and h.version == VERSION and len(h.meta.shape) <= 8
    assert h.meta.dtype.isascii() and h.meta.fmt.isascii() and h.payload_len >= 0


def test_header_parser_on_arbitrary_bytes():
    def prop(data: bytes) -> None:
        try:
            _check_decoded(decode_header(data))
        except CorruptChunkError:
            pass

    run_counted("decode_header/random-bytes", prop, st.binary(max_size=HEADER_BYTES + 64))


def test_header_parser_on_mutated_valid_headers_with_the_checksum_fixed_up():
    """Mutations past the header checksum: only the field checks stand between them and the caller."""

    def prop(key: bytes, edits: list[tuple[int, int]], fix: bool) -> None:
        raw = _valid_header(key, ChunkMeta(dtype="uint8", shape=(3, 5)), bytes(15))
        for pos, val in edits:
            raw[pos % _FIXED.size] = val
        if fix:
            _SUM.pack_into(raw, _FIXED.size, xxhash.xxh3_64_intdigest(bytes(raw[: _FIXED.size])))
        try:
            h = decode_header(raw, expect_key=key if not edits else None)
            _check_decoded(h)
        except CorruptChunkError as exc:
            assert exc.reason

    run_counted("decode_header/mutated+fixed-checksum", prop, st.binary(min_size=1, max_size=64),
                st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=6), st.booleans())


_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.:-", max_size=32)


def test_header_round_trip_and_any_payload_bit_flip_is_caught():
    def prop(key: bytes, dtype: str, fmt: str, shape: list[int], payload: bytes, flip: int) -> None:
        meta = ChunkMeta(dtype=dtype, shape=tuple(shape), fmt=fmt)
        if meta.expected_bytes() not in (None, len(payload)):
            return  # write_header refuses these (tested elsewhere)
        h = decode_header(_valid_header(key, meta, payload), expect_key=key)
        assert (h.key, h.meta, h.payload_len) == (key, meta, len(payload))
        verify_payload(h, payload)
        if payload:
            bad = bytearray(payload)
            bad[flip % len(bad)] ^= 1 << (flip % 8)
            with pytest.raises(CorruptChunkError, match="checksum"):
                verify_payload(h, bytes(bad))

    run_counted("format/round-trip+bit-flip", prop, st.binary(min_size=1, max_size=64), _names, _names,
                st.lists(st.integers(0, 2**20), max_size=8), st.binary(max_size=3000), st.integers(0, 2**31))


def test_chunk_paths_never_leave_the_tier_folder():
    root = Path("/srv/tier")

    def prop(key: bytes) -> None:
        p = os.path.normpath(root / DirectoryTier.relpath(key))
        assert p.startswith("/srv/tier/chunks/") and Path(p).stem == key.hex() and ".." not in p

    run_counted("files/relpath", prop, st.binary(min_size=1, max_size=64))


# ── index log and snapshot ─────────────────────────────────────────────────────────────────────────────────


def _raw_record(op: int, klen: int, size: int, t: int, key: bytes) -> bytes:
    body = _REC.pack(b"KVIX", op, klen, size, t, key)
    return body + xxhash.xxh32_intdigest(body).to_bytes(4, "little")


def _check_records(recs: list[IndexRecord]) -> None:
    for r in recs:
        assert r.op in (1, 2) and 0 < len(r.key) <= 64


def test_index_log_parser_on_arbitrary_bytes():
    def prop(data: bytes) -> None:
        _check_records(list(_decode_log(data[: len(data) // 96 * 96])))

    run_counted("index/log-random-bytes", prop, st.binary(max_size=96 * 6))


def test_index_log_parser_on_checksummed_records_with_any_fields():
    """Records with valid checksums but out-of-range fields (a foreign or hostile writer): never accepted."""

    def prop(fields: list[tuple[int, int, int, int, bytes]], cut: int) -> None:
        data = b"".join(_raw_record(*f) for f in fields)
        recs = list(_decode_log(data))
        _check_records(recs)
        valid = [i for i, (op, klen, *_) in enumerate(fields) if op in (1, 2) and 0 < klen <= 64]
        # a bad record is skipped and the scan resyncs: the valid ones after it are kept (issue 21, item 8)
        assert len(recs) == len(valid)
        torn = data[: cut % (len(data) + 1)]
        kept = sum(1 for i in valid if i < len(torn) // 96)
        assert list(_decode_log(torn[: len(torn) // 96 * 96])) == recs[:kept]

    rec = st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1),
                    st.binary(max_size=64))
    run_counted("index/log-checksummed-fields", prop, st.lists(rec, max_size=6), st.integers(0, 10_000))


def test_index_log_round_trip():
    def prop(recs: list[tuple[int, bytes, int, int]]) -> None:
        objs = [IndexRecord(op, key, size, t) for op, key, size, t in recs]
        assert list(_decode_log(b"".join(_encode(r) for r in objs))) == objs

    run_counted("index/log-round-trip", prop, st.lists(st.tuples(st.sampled_from([1, 2]), st.binary(min_size=1, max_size=64),
                                                                  st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)), max_size=8))


def test_index_snapshot_parser_on_arbitrary_and_mutated_bytes():
    folder = Path(tempfile.mkdtemp(prefix="kvs-fuzz-snap-"))
    try:
        idx = TierIndex(folder, node_id="fuzz")
        idx.close()
        idx._write_snapshot({b"k" * 16: 8192, b"\0x": 4096}, {"log-a.closed"})
        valid = (folder / "snapshot.idx").read_bytes()

        def prop(data: bytes, edits: list[tuple[int, int]], fix: bool) -> None:
            raw = bytearray(data if data else valid)
            for pos, val in edits:
                if raw:
                    raw[pos % len(raw)] = val
            if fix and len(raw) >= 8:
                raw[-8:] = xxhash.xxh3_64_intdigest(bytes(raw[:-8])).to_bytes(8, "little")
            (folder / "snapshot.idx").write_bytes(bytes(raw))
            try:
                live, covered = idx._read_snapshot()
            except ValueError:
                return
            assert all(0 < len(k) <= 64 and isinstance(v, int) for k, v in live.items())
            assert all(isinstance(n, str) for n in covered)

        run_counted("index/snapshot", prop, st.one_of(st.just(b""), st.binary(max_size=400)),
                    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 255)), max_size=4), st.booleans())
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ── trace readers ──────────────────────────────────────────────────────────────────────────────────────────

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                         st.text(max_size=8))
_mc_field = st.one_of(_json_scalar, st.lists(st.integers(-5, 2**66), max_size=6), st.lists(_json_scalar, max_size=3))
_mc_obj = st.fixed_dictionaries({}, optional={"timestamp": _mc_field, "input_length": _mc_field,
                                              "output_length": _mc_field, "hash_ids": _mc_field, "x": _json_scalar})
_mc_valid = st.builds(lambda ts, n, out, ids: {"timestamp": ts, "input_length": n, "output_length": out,
                                                 "hash_ids": [ids] * -(-n // 512)},
                      st.integers(0, 10**6), st.integers(0, 5000), st.integers(0, 5000), st.integers(0, 2**40))
_mc_line = st.one_of(_mc_valid.map(json.dumps), _mc_obj.map(json.dumps), st.text(max_size=40).map(lambda s: s.replace("\n", " ").replace("\r", " ")),
                     st.just(""))


def _trace_prop(reader: Callable[[Path], list], suffix: str) -> Callable[[list[str]], None]:
    folder = Path(tempfile.mkdtemp(prefix="kvs-fuzz-trace-"))

    def prop(lines: list[str]) -> None:
        p = folder / f"t{suffix}"
        p.write_text("\n".join(lines) + "\n", encoding="utf-8")
        try:
            reader(p)
        except InputFormatError as exc:
            assert exc.path == str(p) and 1 <= exc.line <= max(1, len(lines))

    prop.folder = folder  # type: ignore[attr-defined]
    return prop


def test_mooncake_reader_on_generated_lines():
    from kvstream.workload.mooncake import read_mooncake

    prop = _trace_prop(read_mooncake, ".jsonl")
    try:
        run_counted("trace/mooncake", prop, st.lists(_mc_line, max_size=8))
    finally:
        shutil.rmtree(prop.folder, ignore_errors=True)  # type: ignore[attr-defined]


_bd_token = st.one_of(st.integers(-3, 2**65).map(str), st.sampled_from(["x", "1.5", "", "１", "0x10", "1_0", "nan"]))
_bd_line = st.one_of(st.lists(_bd_token, min_size=0, max_size=7).map(" ".join),
                     st.tuples(st.integers(0, 3), st.integers(0, 100), st.integers(0, 50), st.integers(0, 50),
                               st.integers(0, 3)).map(lambda t: " ".join(map(str, t))))
_bd_head = st.sampled_from(["user_id time_stamp(seconds) query_length response_length round_index", "user a b c d",
                            "nope", ""])


def test_bidaw_reader_on_generated_lines():
    from kvstream.workload.bidaw import read_bidaw_trace

    prop = _trace_prop(read_bidaw_trace, ".txt")
    try:
        run_counted("trace/bidaw", lambda head, lines: prop([head, *lines]), _bd_head, st.lists(_bd_line, max_size=10))
    finally:
        shutil.rmtree(prop.folder, ignore_errors=True)  # type: ignore[attr-defined]


# Defects A-C of RELIABILITY.md (fuzzing), found by fuzz/ and fixed in the readers: each input used to let a
# non-InputFormatError escape (UnicodeDecodeError, OverflowError, RecursionError).


@pytest.mark.parametrize("reader", ["mooncake", "bidaw"])
def test_trace_readers_report_invalid_utf8_as_a_bad_line(tmp_path, reader):
    from kvstream.workload.bidaw import read_bidaw_trace
    from kvstream.workload.mooncake import read_mooncake

    p = tmp_path / "t"
    if reader == "mooncake":
        p.write_bytes(b'{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}\n\xff\xfe\n')
        fn = read_mooncake
    else:
        p.write_bytes(b"user_id time_stamp query response round\n1 2 3 4 0\n\xff 1 1 1 1\n")
        fn = read_bidaw_trace
    with pytest.raises(InputFormatError, match="not valid UTF-8: byte 0xff at column 1") as err:
        fn(p)
    assert err.value.path == str(p) and err.value.line == (2 if reader == "mooncake" else 3)


def test_bidaw_reader_reports_a_value_beyond_64_bits_as_a_bad_line(tmp_path):
    from kvstream.workload.bidaw import read_bidaw_trace

    p = tmp_path / "t.txt"
    p.write_text("user_id time_stamp(seconds) query_length response_length round_index\n1 0 10 " + "7" * 40 + " 0\n")
    with pytest.raises(InputFormatError, match="beyond 64 bits") as err:
        read_bidaw_trace(p)
    assert err.value.line == 2


def test_bidaw_reader_reports_a_user_history_beyond_64_bits_as_a_bad_line(tmp_path):
    """Each value fits int64 but a user's running total would not (the int64 history sum would wrap silently):
    such a value is refused at its own line, as beyond physical sense, before any sum."""
    from kvstream.workload.bidaw import read_bidaw_trace

    big = 2**62
    p = tmp_path / "t.txt"
    p.write_text("user_id time_stamp(seconds) query_length response_length round_index\n"
                 f"2 0 1 1 0\n1 0 {big} 0 0\n1 1 {big} 0 1\n")
    with pytest.raises(InputFormatError, match="'query_length' is .* beyond physical sense") as err:
        read_bidaw_trace(p)
    assert err.value.line == 3


@pytest.mark.parametrize("number,match", [("1" + "0" * 400, "beyond 64 bits"), (str(2**63), "beyond 64 bits"),
                                          ("1e300", "beyond 64 bits"), ("9" * 5000, "not valid JSON")])
def test_mooncake_reader_reports_numbers_beyond_64_bits_as_a_bad_line(tmp_path, number, match):
    """A huge timestamp used to raise OverflowError (ms to float seconds); 5000 digits, json's own ValueError
    (past Python's int conversion limit)."""
    from kvstream.workload.mooncake import read_mooncake

    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1, "input_length": 0, "output_length": 1, "hash_ids": []}\n'
                 f'{{"timestamp": {number}, "input_length": 0, "output_length": 1, "hash_ids": []}}\n')
    with pytest.raises(InputFormatError, match=match) as err:
        read_mooncake(p)
    assert err.value.line == 2


def test_mooncake_reader_reports_deeply_nested_json_as_a_bad_line(tmp_path):
    from kvstream.workload.mooncake import read_mooncake

    p = tmp_path / "t.jsonl"
    p.write_bytes(b"[" * 100_000 + b"\n")
    with pytest.raises(InputFormatError, match="nested too deeply") as err:
        read_mooncake(p)
    assert err.value.line == 1


# ── kvstream verify on arbitrary chunk files ───────────────────────────────────────────────────────────────


def test_verify_names_any_garbage_chunk_file_and_never_crashes():
    from kvstream.commands.verify import verify_tier

    folder = Path(tempfile.mkdtemp(prefix="kvs-fuzz-verify-"))
    try:
        import kvstream

        root = folder / "t"
        with kvstream.open_store({"tiers": [{"name": "t", "path": str(root), "capacity_bytes": "8MiB"}],
                                  "memory_bytes": "4MiB", "create_dirs": True, "io_engine": "threads"}) as s:
            s.put(b"k" * 16, b"v" * 5000)
        target = root / DirectoryTier.relpath(b"k" * 16)
        good = target.read_bytes()

        def prop(head: bytes, edits: list[tuple[int, int]]) -> None:
            raw = bytearray(head + good[len(head):]) if head else bytearray(good)
            for pos, val in edits:
                raw[pos % len(raw)] = val
            target.write_bytes(bytes(raw))
            rep = verify_tier(root)
            if bytes(raw) == good:
                assert not rep.errors
            else:
                bad = [f for f in rep.errors if f.file == DirectoryTier.relpath(b"k" * 16)]
                assert len(bad) <= 1 and (bad or raw[HEADER_BYTES - 8:HEADER_BYTES] == good[HEADER_BYTES - 8:HEADER_BYTES]
                                           or _only_unchecked_bytes_differ(bytes(raw), good))

        run_counted("verify/garbage-chunk", prop, st.binary(max_size=300),
                    st.lists(st.tuples(st.integers(0, 20_000), st.integers(0, 255)), max_size=3))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _only_unchecked_bytes_differ(a: bytes, b: bytes) -> bool:
    """The header's zero padding after its checksum, and the payload's padding, are covered by no checksum."""
    h = decode_header(b[:HEADER_BYTES])
    checked = list(range(0, _FIXED.size + 8)) + list(range(HEADER_BYTES, HEADER_BYTES + h.payload_len))
    return len(a) == len(b) and all(a[i] == b[i] for i in checked)

