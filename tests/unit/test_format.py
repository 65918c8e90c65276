"""Chunk header round trip, corruption detection, and a fuzz of the header parser."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstream.errors import CorruptChunkError
from kvstream.format import (
    HEADER_BYTES,
    ChunkMeta,
    decode_header,
    file_size,
    payload_checksum,
    verify_payload,
    write_header,
)

KEY = bytes(range(16))


def make(payload: bytes, meta: ChunkMeta | None = None, key: bytes = KEY) -> bytearray:
    meta = meta or ChunkMeta(dtype="uint8", shape=(len(payload),))
    buf = bytearray(file_size(len(payload)))
    write_header(memoryview(buf), key=key, meta=meta, payload_len=len(payload),
                 payload_sum=payload_checksum(payload), created_ns=123)
    buf[HEADER_BYTES : HEADER_BYTES + len(payload)] = payload
    return buf


def test_round_trip_keeps_key_meta_and_sizes():
    meta = ChunkMeta(dtype="bfloat16", shape=(2, 4, 256, 8), fmt="KV_2LTD")
    payload = bytes(range(256)) * (2 * 4 * 256 * 8 * 2 // 256)
    buf = make(payload, meta)
    h = decode_header(buf, expect_key=KEY)
    assert (h.key, h.meta, h.payload_len, h.created_ns) == (KEY, meta, len(payload), 123)
    assert len(buf) % 4096 == 0 and h.file_size == len(buf)
    verify_payload(h, memoryview(buf)[HEADER_BYTES : HEADER_BYTES + h.payload_len])


@pytest.mark.parametrize("offset", [0, 9, 20, 100, 200])
def test_any_flipped_header_byte_is_detected(offset):
    buf = make(b"x" * 1000)
    buf[offset] ^= 0x40
    with pytest.raises(CorruptChunkError):
        decode_header(buf)


def test_flipped_payload_byte_fails_the_checksum():
    buf = make(b"abc" * 1000)
    buf[HEADER_BYTES + 1500] ^= 1
    h = decode_header(buf)
    with pytest.raises(CorruptChunkError, match="checksum"):
        verify_payload(h, memoryview(buf)[HEADER_BYTES : HEADER_BYTES + h.payload_len])


def test_truncated_payload_and_header_are_reported():
    buf = make(b"q" * 5000)
    h = decode_header(buf)
    with pytest.raises(CorruptChunkError, match="truncated"):
        verify_payload(h, memoryview(buf)[HEADER_BYTES : HEADER_BYTES + 100])
    with pytest.raises(CorruptChunkError, match="truncated header"):
        decode_header(buf[:100])


def test_wrong_key_and_foreign_files_are_rejected():
    buf = make(b"z" * 10)
    with pytest.raises(CorruptChunkError, match="another key"):
        decode_header(buf, expect_key=b"other-key-000000")
    with pytest.raises(CorruptChunkError, match="magic"):
        decode_header(b"\x89PNG\r\n\x1a\n" + bytes(4096))


def test_meta_must_match_payload_length():
    with pytest.raises(ValueError, match="needs"):
        write_header(memoryview(bytearray(4096)), key=KEY, meta=ChunkMeta(dtype="float16", shape=(10,)),
                     payload_len=21, payload_sum=0, created_ns=0)


@pytest.mark.parametrize("bad", [dict(dtype="x" * 40), dict(dtype="é"), dict(shape=(1,) * 9), dict(shape=(-1,))])
def test_meta_validation(bad):
    with pytest.raises(ValueError):
        ChunkMeta(**bad)


@settings(max_examples=2000, deadline=None)
@given(st.binary(min_size=0, max_size=400))
def test_header_parser_never_crashes_on_garbage(data):
    try:
        decode_header(data + bytes(max(0, 4096 - len(data))))
    except CorruptChunkError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 300), st.integers(0, 255))
def test_header_parser_rejects_single_byte_mutations(pos, value):
    buf = make(b"k" * 64)
    original = bytes(buf)
    buf[pos] = value
    if bytes(buf) == original:
        return
    if pos >= 8 + 2 + 2 + 4 + 32 + 8 + 64 + 32 + 8 + 64 + 24 + 8:  # past the checksummed fields: unused bytes
        return
    with pytest.raises(CorruptChunkError):
        decode_header(buf)
