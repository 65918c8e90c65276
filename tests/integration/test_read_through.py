"""Full replication with a shared tier reads another node's prefix from the shared file system once, then
from the node's own local tier (BENCHMARKS §9: without this, every reuse on the second node paid the shared
tier again)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kvstream
from kvstream.replication import CopyOrder, FullReplication, ReadObservation


def node(root: Path, name: str) -> dict:
    return {"tiers": [{"name": "local", "path": str(root / f"local-{name}"), "capacity_bytes": "64MiB"},
                      {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "64MiB", "shared": True,
                       "require_mount": False}],
            "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads", "node_id": name,
            "node_state_path": str(root / f"state-{name}" / "node-id")}


def payload(key: bytes) -> bytes:
    return np.random.default_rng(key[0]).bytes(40_000)


def publish_from_a(root: Path, keys: list[bytes]) -> None:
    """Node a writes the chunks (local and shared tier) and closes; node b has never seen them."""
    with kvstream.open_store(node(root, "a")) as a:
        for k in keys:
            a.put(k, payload(k))
        a.flush()
        assert a.drain(10)


def test_a_peers_prefix_is_copied_to_the_local_tier_on_first_use(disk_tmp):
    keys = [bytes([i]) * 16 for i in range(8)]
    publish_from_a(disk_tmp, keys)
    with kvstream.open_store(node(disk_tmp, "b")) as b:
        assert isinstance(b.replication, FullReplication) and b.replication.read_through
        assert b.lookup(keys) == len(keys) and not any(b.tiers[0].contains(k) for k in keys)
        out = b.get_many(keys)  # first use: only the shared tier holds them
        assert [bytes(o) for o in out] == [payload(k) for k in keys]
        b.flush()
        assert b.drain(10)
        assert all(b.tiers[0].contains(k) for k in keys), "the read did not leave a local copy"
        before = b.stats().tiers["shared"].read_chunks
        b.evict_memory()
        again = b.get_many(keys)
        assert [bytes(o) for o in again] == [payload(k) for k in keys]
        st = b.stats().tiers
        assert st["local"].read_chunks >= len(keys) // 2  # local is read now (the shared tier may still meet it)
        assert st["shared"].read_chunks - before < len(keys)


def test_without_a_shared_tier_full_replication_copies_nothing_on_read():
    policy = FullReplication()
    obs = ReadObservation(now=0.0, keys=[b"k" * 16], holders=[{1}], tier_bytes=[0, 100], tier_busy_s=[0.0, 0.1])
    assert policy.on_read(obs) == []
    policy.read_through = True
    assert policy.on_read(obs) == [CopyOrder(key=b"k" * 16, tier=0)]
    held = ReadObservation(now=0.0, keys=[b"k" * 16], holders=[{0, 1}], tier_bytes=[100, 0], tier_busy_s=[0.1, 0])
    assert policy.on_read(held) == []


def test_a_peers_chunk_read_into_the_callers_buffer_gets_its_local_copy(disk_tmp):
    """``read_into`` (the LMCache plugin's path) with unaligned targets reads through host memory: the copy is
    made from there, on a node that never puts (the read step hands it to the writer itself)."""
    keys = [bytes([100 + i]) * 16 for i in range(6)]
    publish_from_a(disk_tmp, keys)
    with kvstream.open_store(node(disk_tmp, "b")) as b:
        targets = [bytearray(40_000) for _ in keys]
        assert sorted(dict(b.read_into(keys, targets))) == list(range(len(keys)))
        assert [bytes(t) for t in targets] == [payload(k) for k in keys]
        assert b.drain(10) and all(b.tiers[0].contains(k) for k in keys)


def test_a_copy_with_nothing_in_host_memory_is_owed_and_paid_by_the_catch_up(disk_tmp, monkeypatch):
    """A chunk read into an overflow buffer (host memory full) leaves nothing to copy from: the local copy is
    owed, and the catch-up reads it back from the shared tier and writes it."""
    import time

    keys = [bytes([200 + i]) * 16 for i in range(4)]
    publish_from_a(disk_tmp, keys)
    with kvstream.open_store(node(disk_tmp, "b")) as b:
        real_get = b.memory.get
        monkeypatch.setattr(b.memory, "get", lambda key, **kw: None)  # as if every read had overflowed
        assert all(o is not None for o in b.get_many(keys))
        assert b.owed.counts()["local"] == len(keys)
        monkeypatch.setattr(b.memory, "get", real_get)
        deadline = time.monotonic() + 10
        while b.owed.counts()["local"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert b.drain(10) and all(b.tiers[0].contains(k) for k in keys)
