"""One chunk on storage: a fixed 4 KiB header, then the payload padded to 4 KiB (so O_DIRECT reads it whole).

Header layout (little-endian, version 1)::

    magic        8s   b"KVSCHNK\\0"
    version      H    format version (1)
    header_size  H    4096 (the payload starts here)
    flags        I    reserved, 0
    dtype        32s  element type name, ASCII, NUL padded ("bfloat16", "uint8", ...)
    ndim         B    number of dimensions (0..8), then 7 pad bytes
    shape        8Q   dimensions; unused entries 0
    fmt          32s  tensor layout name, ASCII ("KV_2LTD", "raw", ...)
    key_len      B    then 7 pad bytes
    key          64s  the store key the chunk was written under
    payload_len  Q    payload bytes (before padding)
    payload_sum  Q    xxh3-64 of the payload
    created_ns   Q    wall-clock nanoseconds at write (informational)
    header_sum   Q    xxh3-64 of every header byte before this field

Invariants: a decoded header always has a valid magic, version, sizes and header checksum; a payload handed to a
caller always matched ``payload_sum``. Nothing here deserialises objects (no pickle): only fixed fields.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import dataclass

import xxhash

from kvstream.errors import CorruptChunkError

__all__ = [
    "HEADER_BYTES",
    "MAGIC",
    "VERSION",
    "ChunkMeta",
    "ChunkHeader",
    "file_size",
    "payload_checksum",
    "write_header",
    "decode_header",
    "verify_payload",
    "dtype_itemsize",
]

HEADER_BYTES = 4096
MAGIC = b"KVSCHNK\x00"
VERSION = 1
MAX_DIMS = 8
_PAD = 4096

_FIXED = struct.Struct("<8sHHI32sB7x8Q32sB7x64sQQQ")
_SUM = struct.Struct("<Q")
_NAME_RE = re.compile(rb"^[A-Za-z0-9_.:-]*$")

_ITEMSIZE = {
    "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "int16": 2, "uint16": 2, "float16": 2, "half": 2, "bfloat16": 2, "int32": 4,
    "uint32": 4, "float32": 4, "float": 4, "int64": 8, "uint64": 8, "float64": 8, "double": 8,
}


def dtype_itemsize(dtype: str) -> int | None:
    """Bytes per element for a known dtype name (``torch.`` / ``numpy`` prefixes accepted), else None."""
    name = dtype.rsplit(".", 1)[-1]
    return _ITEMSIZE.get(name)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkMeta:
    """What a reader needs to rebuild the tensor: element type, shape and layout name."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()  # empty = one-dimensional, length = payload bytes / itemsize
    fmt: str = "raw"

    def __post_init__(self) -> None:
        for name, value in (("dtype", self.dtype), ("fmt", self.fmt)):
            raw = value.encode("ascii", "replace")
            if len(raw) > 32 or not _NAME_RE.match(raw):
                raise ValueError(f"ChunkMeta.{name} must be ≤ 32 ASCII letters, digits or _.:-, got {value!r}")
        if len(self.shape) > MAX_DIMS or any((not isinstance(d, int)) or d < 0 for d in self.shape):
            raise ValueError(f"ChunkMeta.shape must be ≤ {MAX_DIMS} non-negative ints, got {self.shape!r}")

    def expected_bytes(self) -> int | None:
        size = dtype_itemsize(self.dtype)
        if size is None or not self.shape:
            return None
        return math.prod(self.shape) * size


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    key: bytes
    meta: ChunkMeta
    payload_len: int
    payload_sum: int
    created_ns: int
    version: int = VERSION

    @property
    def file_size(self) -> int:
        return file_size(self.payload_len)


def file_size(payload_len: int) -> int:
    """Bytes on storage for a payload: the header plus the payload padded to 4 KiB."""
    return HEADER_BYTES + (payload_len + _PAD - 1) // _PAD * _PAD


def payload_checksum(payload: memoryview | bytes) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def write_header(buf: memoryview, *, key: bytes, meta: ChunkMeta, payload_len: int, payload_sum: int,
                 created_ns: int) -> None:
    """Fill ``buf[:HEADER_BYTES]`` (zeroing the unused rest, so no stale bytes reach storage)."""
    if not 0 < len(key) <= 64:
        raise ValueError(f"chunk key must be 1..64 bytes, got {len(key)}")
    expected = meta.expected_bytes()
    if expected is not None and expected != payload_len:
        raise ValueError(f"payload is {payload_len} B but {meta.dtype}{list(meta.shape)} needs {expected} B")
    shape = tuple(meta.shape) + (0,) * (MAX_DIMS - len(meta.shape))
    fixed = _FIXED.pack(MAGIC, VERSION, HEADER_BYTES, 0, meta.dtype.encode(), len(meta.shape), *shape,
                        meta.fmt.encode(), len(key), key, payload_len, payload_sum, created_ns)
    end = _FIXED.size
    buf[:end] = fixed
    _SUM.pack_into(buf, end, xxhash.xxh3_64_intdigest(fixed))
    buf[end + _SUM.size : HEADER_BYTES] = bytes(HEADER_BYTES - end - _SUM.size)


def decode_header(buf: memoryview | bytes, *, where: str = "<buffer>", expect_key: bytes | None = None) -> ChunkHeader:
    """Parse and check a header; raise :class:`CorruptChunkError` naming ``where`` and the failed check."""
    if len(buf) < _FIXED.size + _SUM.size:
        raise CorruptChunkError(where, f"truncated header ({len(buf)} B)")
    fixed = bytes(buf[: _FIXED.size])
    if fixed[:8] != MAGIC:
        raise CorruptChunkError(where, "bad magic (not a kvstream chunk)")
    (stored_sum,) = _SUM.unpack_from(buf, _FIXED.size)
    if xxhash.xxh3_64_intdigest(fixed) != stored_sum:
        raise CorruptChunkError(where, "header checksum mismatch")
    (_, version, header_size, _flags, dtype, ndim, *rest) = _FIXED.unpack(fixed)
    shape_all, (fmt, key_len, key, payload_len, payload_sum, created_ns) = rest[:MAX_DIMS], rest[MAX_DIMS:]
    if version != VERSION:
        raise CorruptChunkError(where, f"unsupported format version {version} (this build reads {VERSION})")
    if header_size != HEADER_BYTES:
        raise CorruptChunkError(where, f"header size {header_size} != {HEADER_BYTES}")
    if ndim > MAX_DIMS or not 0 < key_len <= 64:
        raise CorruptChunkError(where, "header fields out of range")
    dtype_s, fmt_s = dtype.rstrip(b"\0"), fmt.rstrip(b"\0")
    if not (_NAME_RE.match(dtype_s) and _NAME_RE.match(fmt_s)):
        raise CorruptChunkError(where, "non-ASCII dtype or layout name")
    meta = ChunkMeta(dtype=dtype_s.decode(), shape=tuple(shape_all[:ndim]), fmt=fmt_s.decode())
    expected = meta.expected_bytes()
    if expected is not None and expected != payload_len:
        raise CorruptChunkError(where, f"payload length {payload_len} does not match {meta.dtype}{list(meta.shape)}")
    k = key[:key_len]
    if expect_key is not None and k != expect_key:
        raise CorruptChunkError(where, "chunk belongs to another key (misplaced or foreign file)")
    return ChunkHeader(key=k, meta=meta, payload_len=payload_len, payload_sum=payload_sum, created_ns=created_ns,
                       version=version)


def verify_payload(header: ChunkHeader, payload: memoryview | bytes, *, where: str = "<buffer>") -> None:
    if len(payload) != header.payload_len:
        raise CorruptChunkError(where, f"truncated payload ({len(payload)} of {header.payload_len} B)")
    if payload_checksum(payload) != header.payload_sum:
        raise CorruptChunkError(where, "payload checksum mismatch")
