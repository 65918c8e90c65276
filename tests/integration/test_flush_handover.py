"""Issue 21 item 10: ``flush()`` + ``drain()`` on one thread waits for the copies another thread's flush is
still handing to the tiers' writers. ``flush`` takes the whole pending list at once and hands it over outside
the store's lock, so a second flush finds nothing pending; its ``drain`` returned True while the first flush
had not yet counted those copies in flight."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import kvstream


def test_drain_waits_for_copies_another_threads_flush_is_still_handing_over(disk_tmp: Path):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "32MiB", "create_dirs": True, "io_engine": "threads"}
    keys = [bytes([i]) * 16 for i in range(16)]
    with kvstream.open_store(cfg) as s:
        for k in keys:
            assert s.put(k, k * 1024)
        real = s.replication.targets
        handing = threading.Event()

        def slow_targets(intent, n_tiers):  # a flush that takes a while to hand its copies over
            handing.set()
            time.sleep(0.02)
            return real(intent, n_tiers)

        s.replication.targets = slow_targets  # type: ignore[method-assign]
        b = threading.Thread(target=s.flush, name="flush-b")
        b.start()
        assert handing.wait(5)
        s.flush()  # thread A: nothing is pending any more (B took it all)
        assert s.drain(10)
        # drain() True: every put acknowledged before A's flush has its copies published.
        missing = [k for k in keys if not all(t.contains(k) for t in s.tiers)]
        assert not missing, f"drain returned with {len(missing)} of {len(keys)} chunks still being handed over"
        b.join(10)
