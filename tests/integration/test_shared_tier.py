"""Many writer nodes on one shared tier (issue 12; design in docs/shared-tier.md).

Each hazard seen on GlusterFS and CephFS is made deterministic here on a local folder: two "nodes" are two
stores (or two indexes) in one process with their own node state (so their own persistent ids), and the file
system's answers (ESTALE, a transient ENOENT, ``close()`` failing after a peer's delete) are injected where the
real clients gave them. Every test here failed before the shared-tier design and passes with it.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import time
from pathlib import Path

import numpy as np
import pytest

import kvstream
from kvstream.commands.verify import verify_tier
from kvstream.errors import ConfigError
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex

CHUNK = 60 * 1024  # payload bytes: 64 KiB on disk with its 4 KiB header


def node_cfg(root: Path, name: str, *, label: str | None = None, capacity: str | int = "256MiB", **kw) -> dict:
    """One node's store: a single shared tier at ``root/shared``, this node's own state file."""
    cfg = {
        "tiers": [{"name": "shared", "path": str(root / "shared"), "capacity_bytes": capacity, "shared": True,
                   "require_mount": False}],  # a folder on the root disk stands in for a mount
        "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads", "router": "single:shared",
        "node_id": label or name, "node_state_path": str(root / f"state-{name}" / "node-id"),
    }
    cfg.update(kw)
    return cfg


def tier_stats(store: kvstream.Store, tier: str = "shared") -> dict:
    """One tier's counters as a dict, whether ``stats()`` returns a dict or a ``StoreStats`` (``.as_dict()``)."""
    st = store.stats()
    return (st.as_dict() if hasattr(st, "as_dict") else st)["tiers"][tier]


def payload(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=CHUNK, dtype=np.uint8)


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def refresh(store) -> None:
    store.tiers[0].maybe_refresh(min_interval_s=0.0)


def files_of(root: Path) -> set[str]:
    return {p.name for p in (root / "shared" / "chunks").rglob("*.kvc")}


# ── identity: a persistent random id, not the host name and a pid ──────────────────────────────────────────


def test_two_nodes_with_one_label_have_distinct_persistent_ids(disk_tmp):
    with kvstream.open_store(node_cfg(disk_tmp, "a", label="same")) as a:
        uid_a = a.tiers[0].index.uid
    with kvstream.open_store(node_cfg(disk_tmp, "b", label="same")) as b:
        assert b.tiers[0].index.uid != uid_a
    with kvstream.open_store(node_cfg(disk_tmp, "a", label="renamed")) as a2:
        assert a2.tiers[0].index.uid == uid_a  # the id survives a restart (and a new label)
    (disk_tmp / "state-a" / "node-id").write_text("not an id\n")
    with pytest.raises(ConfigError, match="node_state_path"):
        kvstream.open_store(node_cfg(disk_tmp, "a"))


def test_a_peer_with_the_same_label_in_another_pid_namespace_keeps_its_log_and_temporaries(disk_tmp, monkeypatch):
    # Node A runs in another PID namespace: its pid means nothing here (999999999 is no process of ours).
    real_getpid = os.getpid
    monkeypatch.setattr(os, "getpid", lambda: 999999999)
    a = kvstream.open_store(node_cfg(disk_tmp, "a", label="host"))
    a.put(key(1), payload(1))
    a.flush()
    a.drain()
    fd, tmp = a.tiers[0].create_temp(key(2))  # A is writing this chunk right now
    os.close(fd)
    monkeypatch.setattr(os, "getpid", real_getpid)
    logs_before = sorted((disk_tmp / "shared" / "index").glob("log-*"))
    try:
        with kvstream.open_store(node_cfg(disk_tmp, "b", label="host")) as b:  # same label, "this" namespace
            assert os.path.exists(tmp), "B removed a live peer's temporary"
            assert all(p.exists() for p in logs_before), "B compacted (deleted) a live peer's log"
            assert b.contains(key(1))
            a.put(key(3), payload(3))  # A goes on writing to its log, and B sees it
            a.flush()
            a.drain()
            refresh(b)
            assert b.contains(key(3))
    finally:
        a.close()


def _crash_mid_write(cfg: dict) -> None:
    def die(*_a, **_k):
        os._exit(9)  # the temporary is fully written; the process dies before the link

    DirectoryTier.publish = die  # type: ignore[method-assign]
    s = kvstream.open_store(cfg)
    s.put(key(7), payload(7))
    s.flush()
    s.drain()


def test_a_crashed_writers_temporaries_are_cleaned_even_with_a_dotted_node_id(disk_tmp):
    cfg = node_cfg(disk_tmp, "a", label="gpu7.cluster.example.org")  # the FQDN default on many clusters
    p = mp.get_context("spawn").Process(target=_crash_mid_write, args=(cfg,))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    assert list((disk_tmp / "shared" / "tmp").glob("*.tmp"))
    with kvstream.open_store(cfg) as s:  # the same node comes back: its dead writer's lease lock is free
        assert tier_stats(s)["removed_temporaries"] == 1
    assert not list((disk_tmp / "shared" / "tmp").glob("*.tmp"))


# ── what a node learns of others: compaction, restarts, clocks ─────────────────────────────────────────────


def test_a_peers_compaction_does_not_hide_its_chunks_from_a_long_running_node(tmp_path):
    a = TierIndex(tmp_path, node_id="A")
    b = TierIndex(tmp_path, node_id="B")
    for i in range(8):
        b.record(OP_PUT, key(i), 65536)
    b.close()  # the log becomes .closed ...
    b2 = TierIndex(tmp_path, node_id="B")  # ... and B's restart compacts it away before A ever read it
    assert b2.compacted_logs == 1
    a.refresh()
    assert all(key(i) in a for i in range(8))
    a.close()
    b2.close()


def test_a_peer_that_lists_neither_the_new_snapshot_nor_the_compacted_log_does_not_exist_any_more(tmp_path,
                                                                                                 monkeypatch):
    """GlusterFS: right after A's reopening compacted its log into a new snapshot, B's client may not list the
    snapshot for about a second. The log it covers is kept (deleted by a later compaction), so a B that loads
    then reads A's chunks from the log (the two-node restart test missed all 16 of A's chunks in 3 of 6 runs
    when the compaction deleted the log at once)."""
    a = TierIndex(tmp_path, node_id="A")
    for i in range(16):
        a.record(OP_PUT, key(i), 65536)
    a.close()
    a2 = TierIndex(tmp_path, node_id="A")  # compacts: a new snapshot, the log kept
    assert a2.compacted_logs == 1
    snap = f"{a2.uid}.snapshot.idx"
    real = TierIndex._listing

    def without_the_snapshot(self):  # B's client does not list the new snapshot yet
        logs, snaps = real(self)
        return logs, [n for n in snaps if n != snap]

    monkeypatch.setattr(TierIndex, "_listing", without_the_snapshot)
    b = TierIndex(tmp_path, node_id="B")
    assert all(key(i) in b for i in range(16))
    monkeypatch.setattr(TierIndex, "_listing", real)
    b.refresh()  # the snapshot shows up now: B reloads, and skips the log it covers
    assert all(key(i) in b for i in range(16)) and len(b) == 16
    for idx in (a2, b):
        idx.close()


def test_a_log_a_snapshot_covers_is_never_read_again_over_it(tmp_path):
    """A covered log that is kept (or still listed after its deletion) holds records the snapshot already has.
    Replaying it over the snapshot at a refresh would bring back a put that another node's delete cancelled: the
    reader must skip every log the snapshot it loaded names, at load and at every refresh."""
    a = TierIndex(tmp_path, node_id="A")
    a.record(OP_PUT, key(1), 65536)
    a.record(OP_PUT, key(2), 65536)
    a.close()
    b = TierIndex(tmp_path, node_id="B")
    b.record(OP_DEL, key(1))  # B removes A's chunk: its delete names A's gen
    a2 = TierIndex(tmp_path, node_id="A")  # A's reopening compacts its put into its snapshot; the log is kept
    a2.record(OP_PUT, key(3), 65536)
    a2.close()
    c = TierIndex(tmp_path, node_id="C")
    assert key(1) not in c and key(2) in c
    c.refresh()
    assert key(1) not in c, "a covered log was replayed over the snapshot at a refresh"
    # Later: A's snapshot is past the grace; A's next reopening deletes the first log and compacts the second.
    first = [n for n in os.listdir(tmp_path) if n.endswith(".closed") and a2.uid in n]
    assert len(first) == 2
    saved = {n: (tmp_path / n).read_bytes() for n in first}
    old = time.time() - 3600
    os.utime(tmp_path / f"{a2.uid}.snapshot.idx", (old, old))
    a3 = TierIndex(tmp_path, node_id="A")
    assert a3.deleted_covered_logs == 1 and a3.compacted_logs == 1
    for n, data in saved.items():  # a peer's client still lists (and serves) the deleted log for a while
        if not (tmp_path / n).exists():
            (tmp_path / n).write_bytes(data)
    d = TierIndex(tmp_path, node_id="D")
    assert key(1) not in d and key(2) in d and key(3) in d
    d.refresh()
    c.refresh()
    for idx in (c, d):
        assert key(1) not in idx and key(2) in idx and key(3) in idx
    for idx in (a3, b, c, d):
        idx.close()


def _crash_mid_compaction(folder: str, uid: str) -> None:
    import kvstream.tiers.index as index_mod

    def die(*_a, **_k):
        os._exit(9)  # the new snapshot is fully written as a temporary; the process dies before the rename

    index_mod.os.replace = die  # type: ignore[assignment]
    TierIndex(Path(folder), node_id="n1", node_uid=uid)


def test_a_compaction_killed_mid_way_leaves_a_temporary_that_only_its_node_removes(tmp_path):
    from kvstream.tiers.lease import Lease

    uid, peer = "0123456789abcdef", "fedcba9876543210"
    idx = TierIndex(tmp_path, node_id="n1", node_uid=uid)
    idx.record(OP_PUT, key(1), 65536)
    idx.close()
    p = mp.get_context("spawn").Process(target=_crash_mid_compaction, args=(str(tmp_path), uid))
    p.start()
    p.join(60)
    assert p.exitcode == 9
    dead = [n for n in os.listdir(tmp_path) if n.startswith(f"snapshot.{uid}-") and n.endswith(".tmp")]
    assert len(dead) == 1
    # Others that must stay: a peer node's (its lease is not ours to judge here), a live process's of this node
    # (its lease is held), and one of an older version (no token in its name) younger than the lease expiry.
    live = Lease(tmp_path, uid, "0badcafe")
    live.start()
    keep = [f"snapshot.{peer}-12345678.00000001.tmp", f"snapshot.{uid}-0badcafe.00000002.tmp",
            f"snapshot.{uid}.00000003.tmp", f"snapshot.{peer}.00000004.tmp"]
    old_untokened = f"snapshot.{uid}.00000005.tmp"
    for n in [*keep, old_untokened]:
        (tmp_path / n).write_bytes(b"x")
    old = time.time() - 3600
    for n in (old_untokened, f"snapshot.{peer}.00000004.tmp", f"snapshot.{peer}-12345678.00000001.tmp"):
        os.utime(tmp_path / n, (old, old))
    again = TierIndex(tmp_path, node_id="n1", node_uid=uid)  # the same node reopens: its dead temporaries go
    assert key(1) in again and again.compacted_logs == 1
    assert again.removed_temporaries == 2
    left = sorted(n for n in os.listdir(tmp_path) if n.endswith(".tmp"))
    assert left == sorted(keep), left
    again.close()
    live.close()


def test_a_peers_restart_does_not_replay_its_old_deletes_over_our_puts(tmp_path):
    a = TierIndex(tmp_path, node_id="A")
    b = TierIndex(tmp_path, node_id="B")
    b.record(OP_PUT, key(1), 65536)
    b.record(OP_DEL, key(1))  # B evicts its copy
    a.refresh()
    a.record(OP_PUT, key(1), 65536)  # A writes the key itself, later
    b.close()  # B's log is renamed .closed: the same records under another name
    a.refresh()
    assert key(1) in a, "A forgot a key it wrote itself"
    a.close()
    c = TierIndex(tmp_path, node_id="C")  # and a node opening afterwards agrees
    assert key(1) in c


def test_a_peers_slow_clock_does_not_order_its_put_before_an_older_delete(tmp_path, monkeypatch):
    import kvstream.tiers.index as index_mod

    a = TierIndex(tmp_path, node_id="A")
    b = TierIndex(tmp_path, node_id="B")
    a.record(OP_PUT, key(1), 65536)
    a.record(OP_DEL, key(1))  # A evicts its chunk
    b.refresh()
    real = time.time_ns
    monkeypatch.setattr(index_mod.time, "time_ns", lambda: real() - 3600 * 10**9)  # B's clock is an hour behind
    b.record(OP_PUT, key(1), 65536)  # B then publishes the key afresh: the file is there
    monkeypatch.setattr(index_mod.time, "time_ns", real)
    a.close()
    b.close()
    c = TierIndex(tmp_path, node_id="C")
    assert key(1) in c


def test_deletes_read_before_their_put_still_cancel_it(tmp_path):
    a = TierIndex(tmp_path, node_id="A")
    a.record(OP_PUT, key(1), 65536)
    b = TierIndex(tmp_path, node_id="B")
    b.record(OP_DEL, key(1))  # B removes A's chunk (a user's remove): its record names A's put
    c = TierIndex(tmp_path, node_id="C")
    assert key(1) not in c
    a.close()
    b.close()
    c.close()
    a2 = TierIndex(tmp_path, node_id="A")  # A's restart compacts its put into its snapshot; B's delete stays
    assert key(1) not in a2


# ── capacity: a per-node quota, and only a node's own chunks are evicted ───────────────────────────────────


def test_a_node_evicts_only_its_own_chunks(disk_tmp):
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        for i in range(32):
            a.put(key(i), payload(i))
        a.flush()
        a.drain()
        a_files = files_of(disk_tmp)
        assert len(a_files) == 32
        with kvstream.open_store(node_cfg(disk_tmp, "b", capacity=24 * 65536)) as b:
            refresh(b)
            assert b.lookup([key(i) for i in range(32)]) == 32
            assert b.tiers[0].used_bytes == 0  # A's chunks are read here, never counted
            for i in range(100, 108):
                b.put(key(i), payload(i))
            b.flush()
            b.drain()
            assert a_files <= files_of(disk_tmp), "B evicted chunks of a live peer"
            assert b.tiers[0].used_bytes == 8 * 65536
            for i in range(108, 130):  # past its own quota: B evicts its own chunks, still none of A's
                b.put(key(i), payload(i))
            b.flush()
            b.drain()
            assert a_files <= files_of(disk_tmp)
            assert b.tiers[0].used_bytes <= 24 * 65536


def test_a_dead_nodes_chunks_become_evictable(disk_tmp):
    a = kvstream.open_store(node_cfg(disk_tmp, "a"))
    for i in range(8):
        a.put(key(i), payload(i))
    a.flush()
    a.drain()
    lease = a.tiers[0].index.lease
    a.close()
    # A crashed instead: its lease is left behind, untouched for two hours.
    lease.path.write_text("a\n")
    old = time.time() - 7200
    os.utime(lease.path, (old, old))
    a_files = files_of(disk_tmp)
    with kvstream.open_store(node_cfg(disk_tmp, "b", capacity=8 * 65536)) as b:
        for i in range(100, 109):  # one more than B's quota: B must make room
            b.put(key(i), payload(i))
            b.flush()
            b.drain()
        assert all(b.contains(key(i)) for i in range(101, 109))
    # A's orphaned chunks went first (nobody else would ever evict them), then B's own oldest
    assert not a_files & files_of(disk_tmp) and len(files_of(disk_tmp)) == 8


# ── ENOENT and ESTALE are misses; close() errors after a peer's delete are not the read's ──────────────────


def _fail_open(monkeypatch, err: int, times: int = 10**9) -> list[int]:
    calls = [0]
    real = DirectoryTier._open_regular

    def fake(self, k):
        if calls[0] < times:
            calls[0] += 1
            raise OSError(err, os.strerror(err))
        return real(self, k)

    monkeypatch.setattr(DirectoryTier, "_open_regular", fake)
    return calls


def _stored(a, n: int) -> None:
    """Chunks 0..n-1 put, written, and out of host memory (so reads go to the tier)."""
    for i in range(n):
        a.put(key(i), payload(i))
    a.flush()
    a.drain()
    a.evict_memory()


def test_estale_on_open_is_a_miss_and_does_not_open_the_breaker(disk_tmp, monkeypatch):
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        _stored(a, 5)
        _fail_open(monkeypatch, errno.ESTALE)  # a peer's eviction, seen through this client's handle
        for i in range(5):
            assert a.get_many([key(i)]) == [None]
        st = tier_stats(a)
        assert st["read_errors"] == 0 and st["circuit"] == "closed"


def test_a_transient_enoent_on_a_valid_chunk_does_not_log_a_delete(disk_tmp, monkeypatch):
    cfg = node_cfg(disk_tmp, "a")
    with kvstream.open_store(cfg) as a:
        a.put(key(1), payload(1))
        a.flush()
        a.drain()
        a.evict_memory()
        _fail_open(monkeypatch, errno.ENOENT, times=1)  # GlusterFS: ENOENT once for a file that exists
        assert a.get_many([key(1)]) == [None]  # this read is a miss ...
        assert a.contains(key(1))  # ... the chunk stays listed ...
        got = a.get_many([key(1)])[0]
        assert got is not None and bytes(got) == payload(1).tobytes()
    monkeypatch.undo()
    with kvstream.open_store(cfg) as again:  # ... and no delete was logged for it (no orphan)
        assert again.contains(key(1))
    assert not [f for f in verify_tier(disk_tmp / "shared").findings if f.kind == "orphan"]


def test_enoent_twice_on_a_shared_tier_forgets_the_chunk_here_but_logs_no_delete(disk_tmp, monkeypatch):
    """GlusterFS can answer ENOENT to the open *and* to the second look (stat) for a file that exists: the
    two-node soak lost acknowledged chunks whose files were on disk because their delete got logged. On a shared
    tier the listing is dropped in this process only; the next open lists the chunk again. On a tier only this
    node writes, a file missing twice is gone, and its delete is logged."""
    import kvstream.tiers.files as files_mod

    cfg = node_cfg(disk_tmp, "a")
    with kvstream.open_store(cfg) as a:
        a.put(key(1), payload(1))
        a.flush()
        a.drain()
        a.evict_memory()
        _fail_open(monkeypatch, errno.ENOENT, times=1)
        real_stat = os.stat

        def stat_enoent(path, *args, **kw):
            if str(path).endswith(".kvc"):
                raise FileNotFoundError(errno.ENOENT, "No such file or directory")
            return real_stat(path, *args, **kw)

        monkeypatch.setattr(files_mod.os, "stat", stat_enoent)
        assert a.get_many([key(1)]) == [None]
        assert not a.contains(key(1))  # forgotten here: no second miss on this node
    monkeypatch.undo()
    with kvstream.open_store(cfg) as again:  # no delete was logged: the chunk is listed and served
        got = again.get_many([key(1)])[0]
        assert got is not None and bytes(got) == payload(1).tobytes()


def test_a_node_republishing_a_key_a_peer_deleted_unread_keeps_it_listed(disk_tmp):
    """B lists its chunk K; A removes K (unlink, delete of B's gen); before B reads that delete, B publishes K
    again and wins the link. B must log a new put: the old code skipped it because B still "owned" K, and the
    delete read later unlisted the new file (the GlusterFS soak lost acknowledged chunks this way)."""
    a_cfg, b_cfg = node_cfg(disk_tmp, "a"), node_cfg(disk_tmp, "b")
    with kvstream.open_store(b_cfg) as b, kvstream.open_store(a_cfg) as a:
        b.put(key(1), payload(1))
        b.flush()
        assert b.drain(10)
        shared_b = b.tiers[0]
        image = (shared_b.root / DirectoryTier.relpath(key(1))).read_bytes()  # a whole, valid chunk file
        a.tiers[0].maybe_refresh(min_interval_s=0)  # A reads B's log ...
        assert a.contains(key(1)) and a.remove(key(1))  # ... then deletes B's chunk
        assert shared_b.contains(key(1))  # B has not read A's delete yet
        fd, tmp = shared_b.create_temp(key(1))  # B writes K again (a put racing A's delete)
        os.close(fd)  # (opened O_DIRECT: write the image through a plain handle)
        Path(tmp).write_bytes(image)
        shared_b.reserve(len(image))
        assert shared_b.publish(key(1), tmp, len(image))  # the name was free: B's link won
        shared_b.maybe_refresh(min_interval_s=0)  # now B reads A's delete of its old gen
        assert shared_b.contains(key(1))
    with kvstream.open_store(node_cfg(disk_tmp, "c")) as c:  # and so does anyone opening later
        got = c.get_many([key(1)])[0]
        assert got is not None and bytes(got) == payload(1).tobytes()


class _OsCloseFails:
    """The ``os`` module, but ``close()`` closes and then reports ENOENT (a FUSE client after a peer's delete)."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def close(fd: int) -> None:
        os.close(fd)
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")


def test_close_failing_after_a_peers_delete_does_not_escape_get_many(disk_tmp, monkeypatch):
    import kvstream.reader as reader_mod

    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        _stored(a, 4)
        monkeypatch.setattr(reader_mod, "os", _OsCloseFails())
        got = a.get_many([key(i) for i in range(4)])
        assert [bytes(g) for g in got] == [payload(i).tobytes() for i in range(4)]


def test_a_write_that_meets_estale_is_retried_once_not_dropped(disk_tmp, monkeypatch):
    real = DirectoryTier.publish
    calls = [0]

    def flaky(self, k, tmp, size):
        calls[0] += 1
        if calls[0] == 1:
            raise OSError(errno.ESTALE, "Stale file handle")
        return real(self, k, tmp, size)

    monkeypatch.setattr(DirectoryTier, "publish", flaky)
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        a.put(key(1), payload(1))
        a.flush()
        a.drain()
        st = tier_stats(a)
        assert st["write_chunks"] == 1 and st["write_errors"] == 0
        assert a.tiers[0].counters.write_retried_stale == 1
    assert len(files_of(disk_tmp)) == 1


def test_a_link_into_a_fan_out_folder_a_peer_just_made_is_retried(disk_tmp, monkeypatch):
    real = os.link
    calls = [0]

    def flaky(src, dst, *a, **k):
        calls[0] += 1
        if calls[0] == 1:  # the folder a peer created a moment ago is not visible to this client yet
            raise FileNotFoundError(errno.ENOENT, "No such file or directory")
        return real(src, dst, *a, **k)

    monkeypatch.setattr(os, "link", flaky)
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        a.put(key(1), payload(1))
        a.flush()
        a.drain()
        st = tier_stats(a)
        assert st["write_chunks"] == 1 and st["write_errors"] == 0
    assert len(files_of(disk_tmp)) == 1


# ── verify on a shared tier ────────────────────────────────────────────────────────────────────────────────


def test_verify_reports_two_directory_entries_under_one_name(disk_tmp, monkeypatch):
    import kvstream.commands.verify as verify_mod

    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        a.put(key(1), payload(1))
        a.flush()
    real_walk = os.walk

    def walk_twice(top, *args, **kw):  # how GlusterFS lists a name two writers both linked (two bricks)
        for dirpath, dirnames, filenames in real_walk(top, *args, **kw):
            yield dirpath, dirnames, filenames + [n for n in filenames if n.endswith(".kvc")]

    monkeypatch.setattr(verify_mod.os, "walk", walk_twice)
    rep = verify_tier(disk_tmp / "shared")
    dup = [f for f in rep.errors if f.kind == "duplicate"]
    assert len(dup) == 1 and dup[0].key == key(1).hex()


def test_verify_repair_leaves_what_a_live_peer_may_be_writing(disk_tmp):
    other = disk_tmp / "other"
    with kvstream.open_store({**node_cfg(other, "x"), "node_state_path": str(disk_tmp / "sx" / "node-id")}) as x:
        x.put(key(9), payload(9))
        x.flush()
    src = next((other / "shared" / "chunks").rglob("*.kvc"))
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:  # a live peer holds a lease on the tier
        a.put(key(1), payload(1))
        a.flush()
        a.drain()
        dst = disk_tmp / "shared" / src.relative_to(other / "shared")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())  # a fresh valid file nobody logged yet: maybe a peer's publish
        os.chmod(dst, 0o600)
        os.unlink(a.tiers[0].path_for(key(1)))  # A's listed file not visible here (yet)
        rep = verify_tier(disk_tmp / "shared", repair=True)
        assert not rep.repaired
        skipped = {f.detail.split(":")[0] for f in rep.findings if f.kind == "skipped"}
        assert skipped == {"orphan not repaired", "missing not repaired"}
    rep = verify_tier(disk_tmp / "shared", repair=True)  # no live lease left: now it repairs
    assert any("recorded" in line for line in rep.repaired) and any("deleted" in line for line in rep.repaired)


# ── the LMCache plugin can say a tier is shared and name the node ──────────────────────────────────────────


def test_the_plugin_declares_shared_tiers_and_a_node_id(tmp_path):
    from kvstream.integrations._lmcache_config import parse_extra_config

    o = parse_extra_config({"kvstream.tiers": f"local={tmp_path / 'l'},shared={tmp_path / 's'}",
                            "kvstream.capacity_bytes": "1GiB", "kvstream.shared_tiers": "shared",
                            "kvstream.node_id": "gpu-07", "kvstream.node_state_path": str(tmp_path / "id")})
    assert [t.shared for t in o.store.tiers] == [False, True]
    assert o.store.node_id == "gpu-07" and o.store.node_state_path == str(tmp_path / "id")
    with pytest.raises(ConfigError, match=r"kvstream\.shared_tiers.*'lustre'"):
        parse_extra_config({"kvstream.tiers": f"local={tmp_path / 'l'}", "kvstream.capacity_bytes": "1GiB",
                            "kvstream.shared_tiers": "lustre"})
