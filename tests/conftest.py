"""Shared fixtures. Tier folders live on the real disk (not tmpfs), so O_DIRECT is exercised."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TRACES = SHARED / "data" / "traces"


def _disk_tmp_root() -> Path:
    """A folder on a file system that supports O_DIRECT (tmpfs does not): $KVSTREAM_TEST_DIR, else /var/tmp."""
    for cand in (os.environ.get("KVSTREAM_TEST_DIR"), "/var/tmp", str(REPO / ".test-tmp")):
        if cand and os.path.isdir(os.path.dirname(cand.rstrip("/")) or "/"):
            try:
                os.makedirs(cand, exist_ok=True)
                return Path(cand)
            except OSError:
                continue
    return Path(tempfile.gettempdir())


@pytest.fixture
def disk_tmp():
    root = Path(tempfile.mkdtemp(prefix="kvstream-test-", dir=_disk_tmp_root()))
    yield root
    shutil.rmtree(root, ignore_errors=True)


def engines() -> list:
    from kvstream.io.engine import available_engines

    out = []
    for name, reason in available_engines().items():
        marks = [pytest.mark.skip(reason=f"io_uring unavailable here: {reason}")] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


def wait_pool_empty(store, timeout: float = 3.0) -> None:
    """Empty the store's host memory until its buffer pool holds nothing in use (late reads end on ring
    threads: allow them ``timeout``), then assert it does."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        store.evict_memory()
        if store.memory.pool.in_use_bytes == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert store.memory.pool.in_use_bytes == 0
