"""Chunk keys: prefix-chained, namespaced, optionally tenant-salted hashes of 256-token chunks.

Key ``i`` of a token sequence covers tokens ``0 .. (i+1)*256``: ``key_i = H_ns(key_{i-1} || tokens_i)``, so two
sequences share key ``i`` exactly when they share the whole prefix up to and including chunk ``i``.

``H_ns`` is BLAKE3 in keyed mode, truncated to 16 bytes. The key is derived from the :class:`KeyNamespace`
(model id, KV dtype, layout, and an optional per-tenant secret salt). Two namespaces never produce the same
key except by a 128-bit collision, and without the salt a tenant cannot compute (and so cannot hit, or time)
another tenant's keys: BLAKE3's keyed mode is a PRF, which xxh3 with a seed is not, hence BLAKE3 here even
though xxh3 is faster (hashing is ~1 µs per 2 KB chunk of token ids either way; the KV payload is megabytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import blake3
import numpy as np

__all__ = ["CHUNK_TOKENS", "KEY_BYTES", "MAX_KEY_BYTES", "KeyNamespace", "ChunkKeyer"]

CHUNK_TOKENS = 256
KEY_BYTES = 16
MAX_KEY_BYTES = 64  # the chunk header has room for keys up to this length
_DERIVE_CONTEXT = "kvstream 2026-12 chunk key namespace v1"
_ROOT = bytes(KEY_BYTES)  # the parent of chunk 0


def _field(b: bytes) -> bytes:
    """Length-prefixed, so ("ab", "c") and ("a", "bc") namespaces differ."""
    return len(b).to_bytes(4, "little") + b


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyNamespace:
    """Everything that must differ for two caches not to share entries."""

    model: str  # model id, e.g. "Qwen/Qwen2.5-14B-Instruct"
    kv_dtype: str  # e.g. "bfloat16"
    layout: str = "KV_2LTD"  # tensor layout of a chunk's payload
    extra: str = ""  # anything else that changes the bytes: TP world size and rank, KV quantisation, ...
    tenant_salt: bytes | None = None  # secret per tenant; None = shared namespace

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("KeyNamespace.model must not be empty")
        if not self.kv_dtype:
            raise ValueError("KeyNamespace.kv_dtype must not be empty")
        if self.tenant_salt is not None and len(self.tenant_salt) < 16:
            raise ValueError("KeyNamespace.tenant_salt must be at least 16 bytes of secret")

    def derive_key(self) -> bytes:
        h = blake3.blake3(derive_key_context=_DERIVE_CONTEXT)
        for part in (self.model, self.kv_dtype, self.layout, self.extra):
            h.update(_field(part.encode()))
        h.update(_field(self.tenant_salt or b""))
        h.update(b"\x01" if self.tenant_salt is not None else b"\x00")
        return h.digest(32)


class ChunkKeyer:
    """Makes store keys for token sequences (and for foreign keys, e.g. LMCache's) inside one namespace."""

    def __init__(self, namespace: KeyNamespace, *, chunk_tokens: int = CHUNK_TOKENS) -> None:
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
        self.namespace = namespace
        self.chunk_tokens = chunk_tokens
        self._key = namespace.derive_key()

    def chunk_keys(self, tokens: Sequence[int] | np.ndarray, *, include_partial: bool = False) -> list[bytes]:
        """One key per full chunk of ``tokens`` (plus the trailing partial chunk if ``include_partial``)."""
        arr = np.ascontiguousarray(np.asarray(tokens, dtype="<i8"))
        if arr.ndim != 1:
            raise ValueError(f"tokens must be one-dimensional, got shape {arr.shape}")
        n_full = len(arr) // self.chunk_tokens
        stops = [(i + 1) * self.chunk_tokens for i in range(n_full)]
        if include_partial and len(arr) % self.chunk_tokens:
            stops.append(len(arr))
        keys: list[bytes] = []
        parent = _ROOT
        start = 0
        raw = arr.tobytes()
        for stop in stops:
            h = blake3.blake3(key=self._key)
            h.update(parent)
            h.update((stop - start).to_bytes(4, "little"))  # a partial chunk never equals a full one
            h.update(raw[start * 8 : stop * 8])
            parent = h.digest(KEY_BYTES)
            keys.append(parent)
            start = stop
        return keys

    def chain(self, ids: Iterable[object]) -> list[bytes]:
        """Prefix-chained keys from opaque per-chunk identities (e.g. a trace's block ids): key i covers ids 0..i."""
        keys: list[bytes] = []
        parent = _ROOT
        for ident in ids:
            h = blake3.blake3(key=self._key)
            h.update(parent)
            h.update(b"id:")
            h.update(repr(ident).encode())
            parent = h.digest(KEY_BYTES)
            keys.append(parent)
        return keys

    def foreign(self, name: str | bytes) -> bytes:
        """A store key for a key minted elsewhere (LMCache's ``CacheEngineKey.to_string()``), in this namespace."""
        data = name.encode() if isinstance(name, str) else bytes(name)
        h = blake3.blake3(key=self._key)
        h.update(b"foreign:")
        h.update(data)
        return h.digest(KEY_BYTES)
