"""LMCache ``CacheEngineKey`` -> kvstream store key, one-to-one on LMCache's notion of key equality.

LMCache keys compare equal when model name, world size, worker id, chunk hash, dtype, request tags (the
``lmcache.tag.*`` request configs, in order) and, for layerwise keys, layer id are equal. Its ``to_string()``
form is not injective (a model name or tag value containing ``@`` or ``%`` can spell another key), so we
encode every field length-prefixed, with the type of the chunk hash (int or bytes; ints can be negative) and
of each tag value, and hash that with :meth:`kvstream.keys.ChunkKeyer.foreign` into a 16-byte key of the
plugin's namespace. Distinct LMCache keys therefore get distinct store keys (up to a 128-bit keyed-BLAKE3
collision) and equal ones the same key in every process, so the cache survives restarts.

Duck-typed on the key's attributes: no LMCache or torch import.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

from kvstream.keys import ChunkKeyer, KeyNamespace

__all__ = ["KeyMapper", "encode_engine_key"]

_VERSION = b"lmcache-engine-key/1"


def _field(out: bytearray, data: bytes) -> None:
    out += len(data).to_bytes(4, "little")
    out += data


def _dtype_name(key: Any) -> str:
    name = getattr(key, "_dtype_str", "") or str(getattr(key, "dtype", ""))
    return name.removeprefix("torch.")


def encode_engine_key(key: Any) -> bytes:
    """A byte string equal for two keys exactly when LMCache considers them equal."""
    out = bytearray(_VERSION)
    layer = getattr(key, "layer_id", None)
    _field(out, b"layer" if layer is not None else b"chunk")
    _field(out, str(key.model_name).encode("utf-8", "surrogatepass"))
    _field(out, str(int(key.world_size)).encode())
    _field(out, str(int(key.worker_id)).encode())
    h = key.chunk_hash
    if isinstance(h, (bytes, bytearray, memoryview)):
        _field(out, b"b:" + bytes(h))
    else:
        _field(out, b"i:" + str(int(h)).encode())
    _field(out, _dtype_name(key).encode())
    if layer is not None:
        _field(out, str(int(layer)).encode())
    tags = getattr(key, "tags", None) or ()
    _field(out, str(len(tags)).encode())
    for name, value in tags:
        _field(out, str(name).encode("utf-8", "surrogatepass"))
        _field(out, f"{type(value).__name__}:{value}".encode("utf-8", "surrogatepass"))
    return bytes(out)


class KeyMapper:
    """Maps LMCache keys to 16-byte store keys in one namespace, with a bounded memo (keys repeat a lot:
    every lookup, prefetch and get of a request asks for the same ones). Thread-safe.
    """

    def __init__(self, namespace: str = "", *, memo_size: int = 1 << 16, tenant_salt: bytes | None = None) -> None:
        ns = KeyNamespace(model="lmcache", kv_dtype="per-key", layout="lmcache-CacheEngineKey", extra=namespace,
                          tenant_salt=tenant_salt)
        self._keyer = ChunkKeyer(ns)
        self._memo: OrderedDict[Any, bytes] = OrderedDict()
        self._memo_size = memo_size
        self._lock = threading.Lock()

    def __call__(self, key: Any) -> bytes:
        with self._lock:
            hit = self._memo.get(key)
            if hit is not None:
                self._memo.move_to_end(key)
                return hit
        skey = self._keyer.foreign(encode_engine_key(key))
        with self._lock:
            self._memo[key] = skey
            if len(self._memo) > self._memo_size:
                self._memo.popitem(last=False)
        return skey

    def many(self, keys: list[Any]) -> list[bytes]:
        return [self(k) for k in keys]
