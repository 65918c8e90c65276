"""Issue 21 item 6: closing the store while other threads read. The contract (``Store.close``): a read call in
progress when close starts returns within bounded time; what it delivered stays valid, what had not landed is
a miss (``None``, or ``ok=False`` with reason ``closed`` for ``read_into``); a call started after close raises
:class:`kvstream.errors.StoreClosedError`. It used to leave some readers blocked for ever (4 of 12 trials):
close cancelled the tiers' queued opens, whose reads then never answered their step."""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path

import pytest

import kvstream
from kvstream.errors import StoreClosedError
from kvstream.format import HEADER_BYTES
from kvstream.io.buffers import AlignedBuffer
from kvstream.testing.store import engines, payload_for

SIZE = 64 << 10
N_KEYS = 96


def populate(cfg: dict, keys: list[bytes]) -> None:
    with kvstream.open_store(cfg) as s:
        for k in keys:
            s.put(k, payload_for(k, SIZE))
        s.flush()
        assert s.drain(30)


def _reader(s: kvstream.Store, keys: list[bytes], seed: int, out: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    mine = {"calls": 0, "wrong": 0, "errors": 0, "closed": 0}
    targets = [AlignedBuffer(SIZE + HEADER_BYTES) for _ in range(8)]
    try:
        while True:
            want = rng.sample(keys, 8)
            kind = rng.randrange(3)
            try:
                if kind == 0:
                    got = list(zip(want, s.get_many(want)))
                elif kind == 1:
                    got = [(want[i], c.payload if c is not None else None) for i, c in s.read_chunks(want)]
                else:
                    got = []
                    for i, res in s.read_into(want, [t.view() for t in targets]):
                        got.append((want[i], bytes(targets[i].view(0, res.nbytes)) if res.ok else None))
            except StoreClosedError:
                mine["closed"] += 1
                return
            mine["calls"] += 1
            for k, v in got:
                if v is not None and bytes(v) != payload_for(k, SIZE):
                    mine["wrong"] += 1
            if rng.random() < 0.3:
                try:
                    s.evict_memory()
                except StoreClosedError:
                    pass
    except Exception as exc:  # anything but StoreClosedError from a read is a failure
        mine["errors"] += 1
        mine["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        with lock:
            out[seed] = mine


@pytest.mark.slow
@pytest.mark.parametrize("engine", engines())
def test_close_while_many_threads_read_lets_every_reader_return(disk_tmp: Path, engine: str):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "4MiB", "create_dirs": True, "io_engine": engine}
    rng = random.Random(5)
    keys = [rng.randbytes(16) for _ in range(N_KEYS)]
    populate(cfg, keys)
    stuck_trials = 0
    for trial in range(8):
        s = kvstream.open_store(cfg)
        out: dict = {}
        lock = threading.Lock()
        threads = [threading.Thread(target=_reader, args=(s, keys, trial * 100 + i, out, lock), daemon=True)
                   for i in range(12)]
        for t in threads:
            t.start()
        time.sleep(0.05 + 0.05 * (trial % 4))
        t0 = time.monotonic()
        report = s.close(timeout=5)
        assert time.monotonic() - t0 < 10
        assert report.drained and not report.stuck_tiers, report
        deadline = time.monotonic() + 10
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t for t in threads if t.is_alive()]
        stuck_trials += bool(stuck)
        assert not any(m["errors"] for m in out.values()), [m.get("error") for m in out.values() if m["errors"]]
        assert sum(m["wrong"] for m in out.values()) == 0
        assert sum(m["calls"] for m in out.values()) > 0
    assert stuck_trials == 0, f"readers blocked after close in {stuck_trials} of 8 trials"
