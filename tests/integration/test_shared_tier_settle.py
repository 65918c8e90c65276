"""Shared-tier hazards of round 3 (issue 21, item 11): GlusterFS's double first-wins, ENODATA, orphans of killed
writers, and a test bed's owner.

- Two links of one name can both succeed on GlusterFS (4 of 8 runs of the two-node race test; ``verify``: two
  directory entries, BAD). A writer now checks, after its link, that the name is its file, and resolves a double
  win at once (``DirectoryTier._settle``); ``verify --repair`` resolves leftovers.
- ENODATA (GlusterFS's FUSE client, for a file whose metadata is not settled) was a write error the errno rules
  did not name: now a stale-name retry for writes and a miss for reads (``kvstream.errors``).
- A writer killed between a publish and its index record left a valid chunk outside every quota until ``verify
  --repair``; the temporary now stays until the record is logged, so its node (or any node once the lease has
  expired) lists the chunk at its next open.
- A pytest session removed a DFS test bed it had not started; a bed now has an owner.

Mutation checks (done when this was written): ``_settle`` returning True at once -> the double-win test fails
(two puts, the other writer's file kept, the conflict not counted); ENODATA removed from ``WRITE_RETRY`` -> the
ENODATA write test fails; ``_list_orphan`` doing nothing -> the orphan test fails; ``claim`` not checking the
owner -> the testbed tests fail.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kvstream
from kvstream.commands.verify import verify_tier
from kvstream.io.engine import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.tiers.files import DirectoryTier

SIZE = 60 * 1024
REPO = Path(__file__).resolve().parents[2]


def node_cfg(root: Path, name: str, **kw) -> dict:
    cfg = {"tiers": [{"name": "shared", "path": str(root / "shared"), "capacity_bytes": "256MiB", "shared": True,
                      "require_mount": False}],
           "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads", "router": "single:shared",
           "node_id": name, "node_state_path": str(root / f"state-{name}" / "node-id")}
    cfg.update(kw)
    return cfg


def key(i: int) -> bytes:
    return i.to_bytes(4, "big") * 4


def data(i: int, n: int = SIZE) -> bytes:
    return np.random.default_rng(i).bytes(n)


def put(s, i: int, n: int = SIZE) -> None:
    assert s.put(key(i), data(i, n))
    s.flush()
    assert s.drain(10)


# ── double first-wins ──────────────────────────────────────────────────────────────────────────────────────


def test_a_link_that_wins_over_an_existing_file_resolves_to_one_file(disk_tmp, monkeypatch):
    """GlusterFS, made deterministic: node b's link of a name node a published 'succeeds' (its entry lands on
    another brick, invisible to lookups). b sees the name resolve to a's file, removes that entry and links its
    own: one file left, a valid chunk of the key, listed by both nodes; verify finds nothing to say."""
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a, kvstream.open_store(node_cfg(disk_tmp, "b")) as b:
        put(a, 1)
        real_link = os.link
        ghost = [0]

        def gluster_link(src, dst, *args, **kw):
            if Path(dst).exists() and str(dst).endswith(".kvc") and not ghost[0]:
                ghost[0] += 1
                return None  # both links "won": ours went to another brick
            return real_link(src, dst, *args, **kw)

        monkeypatch.setattr(os, "link", gluster_link)
        assert b.put(key(1), data(1))  # b has not read a's log yet: it writes the key too
        b.flush()
        assert b.drain(10)
        sb = b.stats().tiers["shared"]
        assert ghost[0] == 1 and sb.publish_conflicts == 1 and sb.write_errors == 0
        files = list((disk_tmp / "shared" / "chunks").rglob("*.kvc"))
        assert len(files) == 1
        b_tmp_inodes = {os.stat(f).st_ino for f in files}
        assert b_tmp_inodes  # the file there is b's now (a's entry was removed)
        for s in (a, b):
            s.tiers[0].maybe_refresh(min_interval_s=0)
            s.evict_memory()
            got = s.get_many([key(1)])[0]
            assert got is not None and bytes(got) == data(1)
    rep = verify_tier(disk_tmp / "shared")
    assert not rep.errors and rep.valid_chunks == 1


def test_verify_repair_resolves_two_entries_under_one_name(disk_tmp, monkeypatch):
    import kvstream.commands.verify as verify_mod

    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        put(a, 1)
    name = DirectoryTier.relpath(key(1))
    path = disk_tmp / "shared" / name
    second = disk_tmp / "second.kvc"
    second.write_bytes(path.read_bytes())  # the other brick's copy: the same key's chunk
    dup = {"on": True}
    real_walk, real_unlink = os.walk, os.unlink

    def walk(top, *args, **kw):  # GlusterFS lists both entries while the duplicate exists
        for dirpath, dirnames, filenames in real_walk(top, *args, **kw):
            extra = [n for n in filenames if n.endswith(".kvc")] if dup["on"] else []
            yield dirpath, dirnames, filenames + extra

    def unlink(p, *args, **kw):  # removing the name exposes the other entry once
        real_unlink(p, *args, **kw)
        if str(p) == str(path) and dup["on"]:
            dup["on"] = False
            os.link(second, path)

    monkeypatch.setattr(verify_mod.os, "walk", walk)
    monkeypatch.setattr(verify_mod.os, "unlink", unlink)
    assert [f.kind for f in verify_tier(disk_tmp / "shared").errors] == ["duplicate"]
    rep = verify_tier(disk_tmp / "shared", repair=True)
    assert not rep.errors and rep.valid_chunks == 1
    assert any("resolved the duplicate" in line and "2 entries removed, one valid copy kept" in line
               for line in rep.repaired)
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as a:
        assert bytes(a.get_many([key(1)])[0]) == data(1)


# ── ENODATA ────────────────────────────────────────────────────────────────────────────────────────────────


def test_enodata_on_a_write_is_retried_once_not_a_tier_failure(disk_tmp):
    plan = FaultPlan([Fault(kind="enodata", rings="shared-w", limit=1)], seed=1)
    with kvstream.open_store(node_cfg(disk_tmp, "a"), engine=FaultyEngine(make_engine("threads"), plan)) as s:
        for i in range(4):
            put(s, i)
        st = s.stats().tiers["shared"]
        assert plan.injected("enodata") == 1
        assert st.write_retried_stale == 1 and st.write_errors == 0 and st.write_chunks == 4
        assert st.circuit == "closed" and st.replicas_owed == 0


def test_enodata_that_persists_is_a_counted_write_error_and_owed(disk_tmp):
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "local"), "capacity_bytes": "64MiB"},
                     {"name": "shared", "path": str(disk_tmp / "shared"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "16MiB", "create_dirs": True, "io_engine": "threads"}
    plan = FaultPlan([Fault(kind="enodata", rings="shared-w")], seed=1)
    with kvstream.open_store(cfg, engine=FaultyEngine(make_engine("threads"), plan)) as s:
        assert s.put(key(1), data(1))
        s.flush()
        assert s.drain(10)
        st = s.stats().tiers["shared"]
        assert st.write_retried_stale == 1 and st.write_errors == 1 and st.replicas_owed == 1


def test_enodata_on_a_read_open_is_a_miss_not_a_tier_failure(disk_tmp, monkeypatch):
    with kvstream.open_store(node_cfg(disk_tmp, "a")) as s:
        put(s, 1)
        s.evict_memory()
        tier = s.tiers[0]
        real = tier._open_regular

        def enodata(k):
            raise OSError(errno.ENODATA, "No data available")

        monkeypatch.setattr(tier, "_open_regular", enodata)
        assert s.get_many([key(1)]) == [None]
        assert s.health[0].state == "closed" and s.stats().tiers["shared"].read_errors == 0
        monkeypatch.setattr(tier, "_open_regular", real)
        assert bytes(s.get_many([key(1)])[0]) == data(1)  # still listed: the second look found the file


# ── orphans of killed writers ──────────────────────────────────────────────────────────────────────────────


def test_a_publish_killed_before_its_index_record_is_listed_by_its_node_at_the_next_open(disk_tmp):
    cfg = node_cfg(disk_tmp, "a")
    with kvstream.open_store(cfg) as s:
        put(s, 1)
        src = s.tiers[0].path_for(key(1)).read_bytes()  # a valid chunk file's bytes (key 1)
        s.remove(key(1))
        tier = s.tiers[0]
        fd, tmp = tier.create_temp(key(1))
        os.close(fd)  # (opened O_DIRECT: written through a plain descriptor instead)
        Path(tmp).write_bytes(src)
        assert tier.reserve(len(src))
        assert tier._link(tmp, tier.path_for(key(1)))  # linked, then "killed": no record, the temporary left
        tier.unreserve(len(src))
    assert [f.kind for f in verify_tier(disk_tmp / "shared").warnings].count("orphan") == 1
    with kvstream.open_store(cfg) as s:
        st = s.stats().tiers["shared"]
        assert st.orphans_listed == 1 and st.removed_temporaries == 1
        assert st.chunks == 1 and st.used_bytes == len(src)  # charged to this node's quota: evictable
        assert bytes(s.get_many([key(1)])[0]) == data(1)
    rep = verify_tier(disk_tmp / "shared")
    assert not [f for f in rep.warnings if f.kind in ("orphan", "stale", "temporary")]


# ── a DFS test bed's owner ─────────────────────────────────────────────────────────────────────────────────


@pytest.fixture
def tb(tmp_path, monkeypatch):
    sys.path.insert(0, str(REPO / "bench"))
    from dfs import netns, testbed

    monkeypatch.setattr(testbed, "OWNER_PATH", tmp_path / "kvs-dfs.owner")
    monkeypatch.setattr(testbed, "bed_exists", lambda: True)  # a bed is up (no namespaces are touched here)
    destroyed: list[int] = []
    monkeypatch.setattr(netns, "destroy", lambda: destroyed.append(1))
    testbed.destroyed = destroyed
    return testbed


def test_a_session_never_takes_down_a_bed_brought_up_by_hand(tb):
    tb.claim(tb.new_owner("manual"))  # up.py, long gone, its bed still up
    mine = tb.new_owner("pytest")
    with pytest.raises(tb.BedInUse, match=r"started by hand \(bench/dfs/up.py\).*up.py down"):
        tb.claim(mine)
    with pytest.raises(tb.BedInUse):
        tb.network_down(mine)
    assert tb.destroyed == [] and tb.read_owner()["kind"] == "manual"


def test_a_bed_of_a_live_run_is_left_alone_and_a_dead_runs_is_taken_over(tb):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tb.new_owner("pytest")
        live.update(pid=other.pid, start=tb._start_time(other.pid))
        tb.claim(live)
        mine = tb.new_owner("pytest")
        with pytest.raises(tb.BedInUse, match=f"pid {other.pid}"):
            tb.claim(mine)
        reused = dict(live, start=live["start"] + 1)  # the same pid, another process: not the owner
        tb.OWNER_PATH.write_text(json.dumps(reused))
        tb.claim(mine)  # a crashed run's leftovers: ours to clean and take over
        assert tb.owns(mine)
    finally:
        other.kill()
        other.wait()
    tb.OWNER_PATH.write_text(json.dumps(live))  # the live run's process has exited now
    time.sleep(0.05)
    tb.claim(mine)
    assert tb.network_down(mine) >= 0 and tb.destroyed == [1] and tb.read_owner() is None
