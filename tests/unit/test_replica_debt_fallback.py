"""The owed-replicas journal outlives the failure of the tier it lives on: debts owed *to* the first tier, the
ones that arise when that tier fails, move to a journal on another tier and survive a restart."""

from __future__ import annotations

import os

from kvstream.replica_debt import OwedReplicas

KEYS = [bytes([i]) * 16 for i in range(6)]


def test_a_failing_journal_moves_to_the_fallback_with_the_whole_set(tmp_path):
    primary, fallback = tmp_path / "local" / "owed", tmp_path / "shared" / "owed" / "uid1.log"
    (tmp_path / "local").mkdir()
    (tmp_path / "shared").mkdir()
    owed = OwedReplicas(primary, "n1", ["local", "shared"], fallback=fallback)
    assert owed.path == primary / "n1.log"
    owed.owe("shared", KEYS[0])
    os.close(owed._fd)  # the first tier's file system died under the journal: the next append fails
    owed.owe("local", KEYS[1])
    owed.owe("local", KEYS[2])
    owed.paid("local", KEYS[2])
    assert owed.path == fallback and owed.journal_errors == 1
    owed.close()
    # Restart with the first tier back: the debts are the union, compacted into the first journal.
    again = OwedReplicas(primary, "n1", ["local", "shared"], fallback=fallback)
    assert again.counts() == {"local": 1, "shared": 1}
    assert again.owes("local", KEYS[1]) and again.owes("shared", KEYS[0]) and not again.owes("local", KEYS[2])
    assert again.path == primary / "n1.log" and not fallback.exists()
    again.close()


def test_without_a_fallback_the_debts_stay_in_memory_and_nothing_raises(tmp_path):
    owed = OwedReplicas(tmp_path / "owed", "n1", ["local", "shared"])
    assert owed.path is not None
    os.close(owed._fd)
    owed.owe("shared", KEYS[3])
    assert owed.path is None and owed.owes("shared", KEYS[3]) and owed.journal_errors == 1
    owed.owe("shared", KEYS[4])  # no journal any more: not even tried
    assert owed.journal_errors == 1 and owed.counts()["shared"] == 2
    owed.close()


def test_an_unwritable_first_journal_at_open_uses_the_fallback(tmp_path):
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "owed").write_bytes(b"not a folder")  # the journal's folder cannot be made
    fallback = tmp_path / "shared" / "owed" / "uid1.log"
    (tmp_path / "shared").mkdir()
    owed = OwedReplicas(tmp_path / "local" / "owed", "n1", ["local", "shared"], fallback=fallback)
    assert owed.path == fallback
    owed.owe("local", KEYS[5])
    owed.close()
    assert fallback.read_bytes() == b"+local " + KEYS[5].hex().encode() + b"\n"
