"""Helpers for tests that drive a whole store: keys and payloads any process can check, a two-tier configuration,
put-and-flush and check-everything loops, the I/O engines to parametrise over, and a folder on a real disk.

Payloads are a function of the key (:func:`payload_for`), so a reader in another process, or after a crash, can
tell right bytes from wrong or torn ones without being told what was put. :func:`engines` needs pytest (the
``test`` extra); the rest needs nothing beyond kvstream.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["payload_for", "make_keys", "two_tier_config", "put_and_flush", "check_all", "wait_pool_empty",
           "wait_for", "engines", "disk_tmp_root"]


def payload_for(key: bytes, size: int) -> bytes:
    """Deterministic bytes of a key (seeded by its first 8 bytes): any process can tell a right payload from a
    wrong (or torn) one."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


def make_keys(n: int, seed: int = 0) -> list[bytes]:
    """``n`` random 16-byte keys, the same for the same ``seed``."""
    rng = random.Random(seed)
    return [rng.randbytes(16) for _ in range(n)]


def two_tier_config(local: Path, shared: Path, **kw: Any) -> dict[str, Any]:
    """A store configuration with two 1 GiB tiers, ``local`` then ``shared``, 64 MiB of host memory and the
    thread-pool engine; ``kw`` overrides top-level keys."""
    base: dict[str, Any] = {
        "tiers": [{"name": "local", "path": str(local), "capacity_bytes": "1GiB"},
                  {"name": "shared", "path": str(shared), "capacity_bytes": "1GiB"}],
        "memory_bytes": "64MiB", "create_dirs": True, "io_engine": "threads"}
    base.update(kw)
    return base


def put_and_flush(s: Any, keys: list[bytes], size: int, every: int = 4) -> float:
    """Put ``every`` keys at a time (their :func:`payload_for` bytes), flushing after each group; returns the
    slowest put+flush in seconds (the serving path must never wait on a failing tier)."""
    worst = 0.0
    for i in range(0, len(keys), every):
        t0 = time.monotonic()
        for k in keys[i:i + every]:
            s.put(k, payload_for(k, size))
        s.flush()
        worst = max(worst, time.monotonic() - t0)
    return worst


def check_all(s: Any, keys: list[bytes], size: int) -> None:
    """Every key comes back, with exactly the bytes that were put (after host memory is emptied)."""
    s.evict_memory()
    out = s.get_many(keys)
    assert [o is not None for o in out] == [True] * len(keys)
    assert all(bytes(o) == payload_for(k, size) for k, o in zip(keys, out))


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    """Poll ``cond()`` every 50 ms until it is true (True) or ``timeout`` seconds pass (False): for what a store's
    background threads (the catch-up, the writers) do in their own time."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_pool_empty(store: Any, timeout: float = 3.0) -> None:
    """Empty the store's host memory until its buffer pool holds nothing in use (late reads end on ring
    threads: allow them ``timeout``), then assert it does."""
    deadline = time.monotonic() + timeout
    while True:
        store.evict_memory()
        if store.memory.pool.in_use_bytes == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert store.memory.pool.in_use_bytes == 0


def engines() -> list[Any]:
    """The I/O engines as pytest parameters (ids: the engine names); one unavailable here is a skip naming why."""
    import pytest

    from kvstream.io.engine import available_engines

    out = []
    for name, reason in available_engines().items():
        marks = [pytest.mark.skip(reason=f"io_uring unavailable here: {reason}")] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def disk_tmp_root(fallback: Path | None = None) -> Path:
    """A folder on a file system that supports O_DIRECT (tmpfs does not): $KVSTREAM_TEST_DIR, else /var/tmp, else
    ``fallback`` (default: ``.test-tmp`` in the current folder), else the system's temporary folder."""
    fallback = fallback if fallback is not None else Path.cwd() / ".test-tmp"
    for cand in (os.environ.get("KVSTREAM_TEST_DIR"), "/var/tmp", str(fallback)):
        if cand and os.path.isdir(os.path.dirname(cand.rstrip("/")) or "/"):
            try:
                os.makedirs(cand, exist_ok=True)
                return Path(cand)
            except OSError:
                continue
    return Path(tempfile.gettempdir())
