"""Issue 13: a configured replica is a replica. A second copy the writer had to skip (backlog, open breaker,
I/O error) is owed, survives a restart in the journal, and is written by the catch-up once the tier can take
it; a chunk evicted everywhere by policy is not owed for ever; the journal is never trusted."""

from __future__ import annotations

from pathlib import Path

import numpy as np

import kvstream
from kvstream.io import make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.replica_debt import OwedReplicas, full_replication_deficits
from kvstream.testing.store import wait_for


def config(root: Path, **kw) -> dict:
    base = {"tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": "256MiB"},
                      {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "256MiB"}],
            "memory_bytes": "32MiB", "create_dirs": True, "io_engine": "threads", "node_id": "n1"}
    base.update(kw)
    return base


def chunks(n: int, size: int = 64 * 1024) -> dict[bytes, bytes]:
    rng = np.random.default_rng(3)
    return {rng.bytes(16): rng.bytes(size) for _ in range(n)}


def wait_paid(s, timeout: float = 20.0) -> None:
    wait_for(lambda: not any(t.replicas_owed for t in s.stats().tiers.values()), timeout)
    assert s.drain(10)


def test_copies_failed_by_eio_are_owed_across_a_restart_and_written_after(disk_tmp):
    data = chunks(12)
    plan = FaultPlan(seed=2)
    plan.add(Fault(kind="eio", rings="shared-w"))  # every write to the shared tier fails
    with kvstream.open_store(config(disk_tmp), engine=FaultyEngine(make_engine("threads"), plan)) as s:
        for k, v in data.items():
            s.put(k, v)
        s.flush()
        assert s.drain(10)
        st = s.stats().tiers["shared"]
        assert st.chunks == 0 and st.replicas_owed == len(data)
        s.health[1].cooldown_s = 3600  # the breaker stays open: catch-up must not hammer a failing tier
    journal = disk_tmp / "local" / "owed" / "n1.log"
    assert journal.exists()
    with kvstream.open_store(config(disk_tmp)) as s:  # the tier is healthy again
        assert s.stats().tiers["shared"].replicas_owed == len(data)
        wait_paid(s)
        st = s.stats()
        assert st.tiers["shared"].replicas_owed == 0 and st.tiers["shared"].chunks == len(data)
        assert st.catch_up_reads >= 1  # host memory was empty after the restart: read back from local
        assert not any(full_replication_deficits(s.tiers).values())
    # The local copies are gone; every chunk is still there, from the shared tier alone.
    for f in (disk_tmp / "local" / "chunks").rglob("*.kvc"):
        f.unlink()
    with kvstream.open_store(config(disk_tmp)) as s:
        got = s.get_many(list(data))
        assert all(g is not None and bytes(g) == v for g, v in zip(got, data.values()))


def test_a_debt_whose_chunk_was_evicted_everywhere_is_dropped_not_retried(disk_tmp):
    data = chunks(3)
    with kvstream.open_store(config(disk_tmp)) as s:
        for k, v in data.items():
            s.put(k, v, tiers=["local"])
        s.flush()
        assert s.drain(10)
        gone = list(data)[0]
        for k in data:
            s.owed.owe("shared", k)
        s.remove(gone)  # policy (here: the caller) dropped it from every tier and memory
        wait_paid(s)
        assert s.stats().tiers["shared"].chunks == 2 and not s.tiers[1].contains(gone)


def test_the_journal_is_never_trusted(tmp_path):
    folder = tmp_path / "owed"
    folder.mkdir()
    good = b"\x01" * 16
    (folder / "n1.log").write_bytes(
        b"+shared " + good.hex().encode() + b"\n"
        b"+nosuchtier " + good.hex().encode() + b"\n"  # unknown tier
        b"+shared zz\n+shared " + b"ab" * 65 + b"\n"  # not hex; a key past 64 bytes
        b"\xff\xfe garbage\n+shared 0\n-shared\n"  # not ASCII; odd length; no key
        b"+local " + good.hex().encode() + b"\n-local " + good.hex().encode() + b"\n")  # owed then paid
    owed = OwedReplicas(folder, "n1", ["local", "shared"])
    assert owed.counts() == {"local": 0, "shared": 1} and owed.owes("shared", good)
    owed.close()
    assert (folder / "n1.log").read_bytes() == b"+shared " + good.hex().encode() + b"\n"  # compacted at open


def test_a_read_back_waits_while_a_serving_read_step_is_in_flight(disk_tmp):
    # An owed copy whose chunk left host memory must be read back from the other tier; doing that during a
    # serving load takes the tier's bandwidth from the critical path, so it waits for the step to end, and under
    # steps that never pause it goes on after max_deferred_rounds rounds.
    data = chunks(6)
    with kvstream.open_store(config(disk_tmp)) as s:
        s._catch_up.stop()  # its thread ends; rounds run by hand below
        s._catch_up._stop.clear()
        for k, v in data.items():
            s.put(k, v, tiers=["local"])
        s.flush()
        assert s.drain(10)
        s.evict_memory()
        owed = list(data)[:2]
        for k in owed:
            s.owed.owe("shared", k)
        serving = s.read_chunks(list(data)[2:])
        first = next(serving)  # a serving step is in flight until the generator ends
        assert s._reader.active_steps == 1
        cu = s._catch_up
        assert cu.round() == 0 and cu.reads == 0 and cu.reads_deferred == 2
        assert s.stats().tiers["shared"].replicas_owed == 2
        cu.policy.deferred_rounds = cu.policy.max_deferred_rounds  # starving: it reads anyway
        assert cu.round() == 2 and cu.reads == 2
        assert s._reader.active_steps == 1  # its own read-backs are not serving steps
        rest = list(serving)
        assert len(rest) == 3 and first[1] is not None
        assert s._reader.active_steps == 0
        assert s.drain(10)
        assert s.stats().tiers["shared"].replicas_owed == 0
        s.owed.owe("shared", list(data)[3])
        s.evict_memory()
        assert cu.round() == 1 and cu.reads == 3  # no step in flight: read back at once
        assert s.stats().catch_up_reads_deferred == 2


def test_the_policy_pays_debts_still_in_host_memory_first_newest_first():
    from kvstream.replica_debt import CatchUpPolicy

    pol = CatchUpPolicy()
    owed = [f"k{i}" for i in range(40)]  # oldest first
    resident = {"k39", "k37", "k2"}
    picked = pol.select(owed[:pol.batch], owed[::-1][:pol.batch], resident.__contains__)
    # k2 is among the oldest but not among the newest batch: it is paid in the oldest-first part, in order
    assert picked[:2] == ["k39", "k37"]
    assert picked[2:] == [k for k in owed[:pol.batch] if k not in ("k39", "k37")][: pol.batch - 2]
    assert len(picked) == pol.batch and len(set(picked)) == len(picked)
    assert pol.select([], [], resident.__contains__) == []


def test_a_round_copies_owed_chunks_from_host_memory_before_reading_any_back(disk_tmp):
    # Issue 20: debts whose chunks are still in host memory are paid from there, before older debts whose chunks
    # left memory (those cost a read-back from the tier that serves the loads). Oldest-first, the batch would have
    # been the evicted ones and every copy a read-back.
    data = chunks(24)
    keys = list(data)
    with kvstream.open_store(config(disk_tmp, memory_bytes="8MiB")) as s:
        s._catch_up.stop()  # rounds run by hand below
        s._catch_up._stop.clear()
        for k, v in data.items():
            s.put(k, v, tiers=["local"])
        s.flush()
        assert s.drain(10)
        s.evict_memory()
        old, new, other = keys[:18], keys[18:22], keys[22:]
        for k in old:
            s.owed.owe("shared", k)  # oldest debts: their chunks are no longer in host memory
        s.get_many(new)  # the newest debts' chunks are read back into memory by a serving read
        for k in new:
            s.owed.owe("shared", k)
        assert all(s.memory.peek(k) is not None for k in new)
        cu = s._catch_up
        serving = s.read_chunks(other)
        next(serving)  # a serving step in flight: read-backs wait, copies from memory do not
        assert cu.round() == len(new) and cu.reads == 0
        list(serving)
        assert s.drain(10)
        assert all(s.tiers[1].contains(k) for k in new)
        assert s.stats().tiers["shared"].replicas_owed == len(old)
