"""The persistent tier index: reopen, compaction, torn records, other writers' logs."""

from __future__ import annotations

import os
import time

import pytest

from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex


def test_survives_reopen_and_compacts_closed_logs(tmp_path):
    idx = TierIndex(tmp_path, node_id="n1")
    for i in range(100):
        idx.record(OP_PUT, i.to_bytes(16, "big"), 8192 + i)
    idx.record(OP_DEL, (5).to_bytes(16, "big"))
    idx.close()
    again = TierIndex(tmp_path, node_id="n1")
    assert len(again) == 99 and again.get((7).to_bytes(16, "big")) == 8199 and (5).to_bytes(16, "big") not in again
    assert again.compacted_logs == 1 and (tmp_path / f"{again.uid}.snapshot.idx").exists()
    # The merged log is kept (a peer may not see the new snapshot yet) and named by the snapshot as covered.
    kept = [n for n in os.listdir(tmp_path) if n.endswith(".closed")]
    assert len(kept) == 1 and again.deleted_covered_logs == 0
    again.close()
    # A later open deletes it once the snapshot covering it is past the grace (here: no grace).
    third = TierIndex(tmp_path, node_id="n1", covered_grace_s=0.0)
    assert len(third) == 99 and third.deleted_covered_logs == 1 and not (tmp_path / kept[0]).exists()
    third.close()


def test_a_covered_log_is_kept_while_its_snapshot_is_younger_than_the_grace(tmp_path):
    """Two quick restarts: the second compaction must not delete the log the first one covered (its snapshot is
    seconds old: a peer may still list neither), and still names it, so no reader counts it twice."""
    import kvstream.tiers.index as index_mod

    uid = "0123456789abcdef"
    for i in range(3):
        idx = TierIndex(tmp_path, node_id="n1", node_uid=uid)
        idx.record(OP_PUT, bytes([i]) * 16, 8192)
        idx.close()
    idx = TierIndex(tmp_path, node_id="n1", node_uid=uid)
    closed = sorted(n for n in os.listdir(tmp_path) if n.endswith(".closed"))
    assert len(closed) == 3 and idx.deleted_covered_logs == 0  # all kept: every snapshot was young
    snap = index_mod._parse_snapshot((tmp_path / f"{uid}.snapshot.idx").read_bytes(), "snap")
    assert set(closed) <= snap.covered and len(idx) == 3
    idx.close()
    old = time.time() - 3600  # the snapshot is an hour old now: its covered logs go at the next open
    os.utime(tmp_path / f"{uid}.snapshot.idx", (old, old))
    idx = TierIndex(tmp_path, node_id="n1", node_uid=uid)
    left = sorted(n for n in os.listdir(tmp_path) if n.endswith(".closed"))
    assert idx.deleted_covered_logs == 3 and not left and len(idx) == 3
    snap = index_mod._parse_snapshot((tmp_path / f"{uid}.snapshot.idx").read_bytes(), "snap")
    assert set(closed) <= snap.covered  # the deleted ones stay named: a peer may still list them for a while
    idx.record(OP_PUT, b"x" * 16, 8192)
    idx.close()
    idx = TierIndex(tmp_path, node_id="n1", node_uid=uid)  # the next snapshot written drops their names
    snap = index_mod._parse_snapshot((tmp_path / f"{uid}.snapshot.idx").read_bytes(), "snap")
    assert not set(closed) & snap.covered and len(snap.covered) == 1 and len(idx) == 4
    idx.close()


def test_torn_last_record_is_ignored(tmp_path):
    idx = TierIndex(tmp_path, node_id="n1")
    idx.record(OP_PUT, b"a" * 16, 8192)
    idx.record(OP_PUT, b"b" * 16, 8192)
    name = idx._own_name
    idx.close()
    closed = tmp_path / name.replace(".log", ".closed")
    data = closed.read_bytes()
    closed.write_bytes(data[:-10])  # crash mid-append
    again = TierIndex(tmp_path, node_id="n1")
    assert b"a" * 16 in again and b"b" * 16 not in again


def test_log_of_a_crashed_writer_on_this_node_is_recovered(tmp_path):
    idx = TierIndex(tmp_path, node_id="n1")
    idx.record(OP_PUT, b"k" * 16, 4096 * 3)
    os.close(idx._own_fd)  # simulate a crash: no close(), the log keeps its .log name, the lease stops
    idx.lease._stop.set()
    os.close(idx.lease._fd)  # the process is gone: the kernel drops its lock on the lease (the file stays)
    again = TierIndex(tmp_path, node_id="n1")
    assert again.get(b"k" * 16) == 4096 * 3 and again.compacted_logs == 1


def test_other_writers_are_seen_by_refresh_and_a_delete_names_the_put_it_deletes(tmp_path):
    a = TierIndex(tmp_path, node_id="nodeA")
    b = TierIndex(tmp_path, node_id="nodeB")
    a.record(OP_PUT, b"x" * 16, 8192)
    assert b"x" * 16 not in b
    b.refresh()
    assert b.get(b"x" * 16) == 8192
    b.record(OP_DEL, b"x" * 16)
    a.refresh()
    assert b"x" * 16 not in a
    a.close()
    b.close()
    c = TierIndex(tmp_path, node_id="nodeC")
    assert b"x" * 16 not in c


@pytest.mark.slow
def test_many_entries_reopen(tmp_path):
    """200,000 entries survive a compaction and a reopen from the snapshot. How fast: bench/index_reopen.py
    (a benchmark, not a timed test)."""
    n = 200_000
    idx = TierIndex(tmp_path, node_id="n1")
    rec = idx.record
    for i in range(n):
        rec(OP_PUT, i.to_bytes(16, "little"), 4096 * 2)
    idx.close()
    TierIndex(tmp_path, node_id="n1").close()  # compacts into a snapshot
    again = TierIndex(tmp_path, node_id="n1")
    assert len(again) == n and again.get((12345).to_bytes(16, "little")) == 8192
    assert again.get((n - 1).to_bytes(16, "little")) == 8192 and again.get(n.to_bytes(16, "little")) is None


def test_a_snapshot_that_cannot_be_read_now_is_never_replaced_by_the_new_logs_alone(tmp_path, monkeypatch):
    """GlusterFS can answer ENOENT for a file that exists, or a stale copy that fails its checksum, right after
    another process of the node replaced the snapshot. Compaction must then wait, not start from an empty
    snapshot: that dropped every chunk the old one listed (the two-node soak lost acknowledged chunks so)."""
    import kvstream.tiers.index as index_mod

    UID = "0123456789abcdef"  # noqa: N806 — a node's persistent id: 16 hex digits
    first = TierIndex(tmp_path, node_id="n1", node_uid=UID)
    first.record(OP_PUT, b"a" * 16, 8192)
    first.close()
    compacting = TierIndex(tmp_path, node_id="n1", node_uid=UID)  # compacts: "a" is in the snapshot now
    assert compacting.compacted_logs == 1
    compacting.close()
    second = TierIndex(tmp_path, node_id="n1", node_uid=UID)
    second.record(OP_PUT, b"b" * 16, 8192)
    second.close()
    real = index_mod._read_fresh
    for err in (FileNotFoundError(2, "No such file or directory"), ValueError("bad snapshot checksum")):
        def flaky(path, start=0, _err=err):
            if str(path).endswith(index_mod.SNAPSHOT_SUFFIX):
                raise _err
            return real(path, start)

        monkeypatch.setattr(index_mod, "_read_fresh", flaky)
        TierIndex(tmp_path, node_id="n1", node_uid=UID).close()  # compaction must not run on nothing
        monkeypatch.setattr(index_mod, "_read_fresh", real)
        again = TierIndex(tmp_path, node_id="n1", node_uid=UID, writable=False)
        assert b"a" * 16 in again and b"b" * 16 in again, type(err).__name__


def test_a_peer_closing_between_our_listing_and_our_read_does_not_unlist_its_entries(tmp_path, monkeypatch):
    """A peer's close renames its log ``.log`` -> ``.closed``; if that happens after our listing and before our
    read, the load met a vanished file and must list again (the two-node suite saw a restarting node's chunks
    unlisted on its peer: 0 of 16)."""
    import kvstream.tiers.index as index_mod

    a = TierIndex(tmp_path, node_id="a", node_uid="aaaaaaaaaaaaaaaa")
    for i in range(16):
        a.record(OP_PUT, i.to_bytes(16, "big"), 8192)
    real = index_mod._read_fresh
    renamed = []

    def close_under_us(path, start=0):
        if str(path).endswith(".log") and "aaaaaaaaaaaaaaaa" in str(path) and not renamed:
            renamed.append(path)
            a.close()  # the peer closes right now: its .log becomes .closed
        return real(path, start)

    monkeypatch.setattr(index_mod, "_read_fresh", close_under_us)
    b = TierIndex(tmp_path, node_id="b", node_uid="bbbbbbbbbbbbbbbb")
    assert renamed and len(b) == 16
    b.close()
