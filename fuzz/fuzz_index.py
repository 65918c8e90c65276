"""Coverage-guided fuzzing (atheris) of the index log and snapshot parsers: ``python fuzz/fuzz_index.py -runs=N``.

Contract: ``_decode_log`` yields only records with op 1 or 2 and a key of 1..64 bytes and never raises; a
snapshot is either parsed into such keys or refused with ``ValueError``. The first input byte picks the
target; for the log, records are re-checksummed half of the time so the field checks are reached.
"""

import os
import sys
import tempfile
from pathlib import Path

import atheris

with atheris.instrument_imports():
    import xxhash

    from kvstream.tiers.index import _REC, _REC_BYTES, TierIndex, _decode_log

# fuzz/run.py passes a folder it removes afterwards (libFuzzer ends the process without running atexit)
_DIR = Path(os.environ.get("KVS_FUZZ_TMP") or tempfile.mkdtemp(prefix="kvs-fuzz-index-",
                                                                dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
_IDX = TierIndex.__new__(TierIndex)
_IDX.folder = _DIR


def one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0], data[1:]
    if mode % 3 == 0:  # log, as is
        recs = list(_decode_log(body[: len(body) // _REC_BYTES * _REC_BYTES]))
    elif mode % 3 == 1:  # log, every record's checksum made valid
        raw = bytearray(body[: len(body) // _REC_BYTES * _REC_BYTES])
        for off in range(0, len(raw), _REC_BYTES):
            raw[off:off + 4] = b"KVIX"
            raw[off + _REC.size:off + _REC_BYTES] = xxhash.xxh32_intdigest(bytes(raw[off:off + _REC.size])).to_bytes(4, "little")
        recs = list(_decode_log(bytes(raw)))
    else:  # snapshot, with its checksum made valid
        raw = bytearray(b"KVIXSNP1" + body)
        if len(raw) >= 8:
            raw += xxhash.xxh3_64_intdigest(bytes(raw)).to_bytes(8, "little")
        (_DIR / "snapshot.idx").write_bytes(bytes(raw))
        try:
            live, covered = _IDX._read_snapshot()
        except ValueError:
            return
        assert all(0 < len(k) <= 64 for k in live) and all(isinstance(n, str) for n in covered)
        return
    for r in recs:
        assert r.op in (1, 2) and 0 < len(r.key) <= 64


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
