"""Coverage-guided fuzzing (atheris) of the chunk-header parser: ``python fuzz/fuzz_header.py -runs=200000``.

Contract: :func:`kvstream.format.decode_header` returns a header whose fields satisfy the module's invariants or
raises :class:`CorruptChunkError`; :func:`verify_payload` accepts only the payload whose checksum the header
holds. Any other exception, or a broken invariant, is a crash (libFuzzer writes the input to ``crash-*``).
Half of the inputs are turned into headers whose checksum is valid, so the field checks behind it are reached.
"""

import sys

import atheris

with atheris.instrument_imports():
    import xxhash

    from kvstream.errors import CorruptChunkError
    from kvstream.format import _FIXED, _SUM, HEADER_BYTES, VERSION, decode_header, verify_payload


def one_input(data: bytes) -> None:
    if data[:1] == b"\x01" and len(data) > _FIXED.size:  # structure-aware half: a header with a valid checksum
        raw = bytearray(data[1:])
        raw[:8] = b"KVSCHNK\x00"
        raw = raw.ljust(HEADER_BYTES, b"\0")
        _SUM.pack_into(raw, _FIXED.size, xxhash.xxh3_64_intdigest(bytes(raw[: _FIXED.size])))
        data = bytes(raw)
    try:
        h = decode_header(data)
    except CorruptChunkError as exc:
        assert exc.reason
        return
    assert 0 < len(h.key) <= 64 and h.version == VERSION and len(h.meta.shape) <= 8
    assert h.meta.dtype.isascii() and h.meta.fmt.isascii() and h.payload_len >= 0
    payload = data[HEADER_BYTES:HEADER_BYTES + h.payload_len]
    try:
        verify_payload(h, payload)
    except CorruptChunkError:
        return
    assert xxhash.xxh3_64_intdigest(payload) == h.payload_sum and len(payload) == h.payload_len


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
