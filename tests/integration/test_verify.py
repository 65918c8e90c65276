"""``kvstream verify``: every kind of damage is found and named, exit codes, ``--repair``, ``--json``."""

from __future__ import annotations

import json
import os
import time
import random
from pathlib import Path

import pytest
import xxhash

import kvstream
from kvstream.cli import main
from kvstream.commands.verify import verify_tier
from kvstream.format import _FIXED, _SUM, HEADER_BYTES
from kvstream.tiers.files import DirectoryTier
from kvstream.tiers.index import OP_PUT, TierIndex

relpath = DirectoryTier.relpath


def cfg(path: Path) -> dict:
    return {"tiers": [{"name": "t", "path": str(path), "capacity_bytes": "64MiB"}], "memory_bytes": "8MiB",
            "create_dirs": True, "io_engine": "threads"}


def make_tier(path: Path, n: int = 6, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(n)]
    with kvstream.open_store(cfg(path)) as s:
        for k in keys:
            s.put(k, rng.randbytes(20_000 + 4096 * (k[0] % 3)))
    return keys


def run(capsys, *args: str) -> tuple[int, str]:
    rc = main(["verify", *args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def listing(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def test_a_clean_tier_passes_and_verify_changes_nothing(disk_tmp, capsys):
    root = disk_tmp / "t"
    make_tier(root)
    before = listing(root)
    rc, out = run(capsys, str(root))
    assert rc == 0 and "6 chunk files, 6 valid, 6 in the index, 0 bad" in out
    assert listing(root) == before


def _set_version(raw: bytearray, version: int) -> None:
    raw[8:10] = version.to_bytes(2, "little")
    _SUM.pack_into(raw, _FIXED.size, xxhash.xxh3_64_intdigest(bytes(raw[: _FIXED.size])))


DAMAGES = {
    "payload-bit": (lambda raw, other: raw.__setitem__(HEADER_BYTES + 7, raw[HEADER_BYTES + 7] ^ 4), "payload checksum mismatch"),
    "header-bit": (lambda raw, other: raw.__setitem__(20, raw[20] ^ 1), "header checksum mismatch"),
    "truncated": (lambda raw, other: raw.__delitem__(slice(HEADER_BYTES + 4096, None)), "truncated"),
    "zero-length": (lambda raw, other: raw.clear(), "truncated header (0 B)"),
    "wrong-version": (lambda raw, other: _set_version(raw, 3), "unsupported format version 3"),
    "foreign": (lambda raw, other: raw.__setitem__(slice(None), other), "another key"),
    "extra-bytes": (lambda raw, other: raw.extend(b"\0" * 4096), "its header says"),
    "not-a-chunk": (lambda raw, other: raw.__setitem__(slice(None), b"GIF89a" + bytes(9000)), "bad magic"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_each_damaged_chunk_is_named_and_fails(disk_tmp, capsys, damage):
    root = disk_tmp / "t"
    keys = make_tier(root)
    victim = root / relpath(keys[2])
    raw = bytearray(victim.read_bytes())
    fn, reason = DAMAGES[damage]
    fn(raw, (root / relpath(keys[3])).read_bytes())
    victim.write_bytes(bytes(raw))
    rc, out = run(capsys, str(root))
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and str(victim) in bad[0] and "corrupt" in bad[0] and reason in bad[0]


def test_index_file_disagreements_and_foreign_files(disk_tmp, capsys):
    root = disk_tmp / "t"
    keys = make_tier(root)
    os.unlink(root / relpath(keys[0]))  # listed, gone
    idx = TierIndex(root / "index", node_id="test")
    idx.record(OP_PUT, keys[1], 12345)  # listed with the wrong size
    idx.close()
    (root / "chunks" / "ab").mkdir(exist_ok=True)
    (root / "chunks" / "ab" / "notes.txt").write_text("x")  # not a chunk name
    misplaced = root / "chunks" / "00" / "00" / (keys[4].hex() + ".kvc")
    misplaced.parent.mkdir(parents=True, exist_ok=True)
    misplaced.write_bytes((root / relpath(keys[4])).read_bytes())  # a chunk name, at the wrong place
    (root / "snapshot.bak").write_text("x")  # top-level clutter: a warning
    link = root / relpath(keys[5])
    link.unlink()
    link.symlink_to("/etc/hostname")  # a chunk name that points outside the tier
    rc, out = run(capsys, str(root))
    assert rc == 1
    lines = out.splitlines()

    def has(tag: str, kind: str, path: Path | str) -> bool:
        return any(line.startswith(tag) and f"{path}: {kind}:" in line for line in lines)

    assert has("WARN", "missing", root / relpath(keys[0]))  # what a crash leaves: the store reads a miss
    assert has("BAD", "size", root / relpath(keys[1])) and "index says 12345 B" in out
    assert has("BAD", "foreign", root / "chunks/ab/notes.txt")
    assert has("BAD", "foreign", misplaced)
    assert has("WARN", "extra", root / "snapshot.bak")
    assert has("BAD", "foreign", link) and "symbolic link" in out
    target = disk_tmp / "target"
    target.write_text("not ours")
    os.chmod(target, 0o644)
    link.unlink()
    link.symlink_to(target)
    rc, out = run(capsys, "--repair", str(root))
    assert f"moved {relpath(keys[5])} to quarantine/" in out
    assert target.stat().st_mode & 0o777 == 0o644 and target.read_text() == "not ours"  # links are never followed


def test_orphans_and_temporaries_are_warnings_unless_strict(disk_tmp, capsys):
    root, other = disk_tmp / "t", disk_tmp / "o"
    make_tier(root)
    okeys = make_tier(other, n=2, seed=5)
    orphan = root / relpath(okeys[0])
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes((other / relpath(okeys[0])).read_bytes())  # valid, but not in this tier's index
    stale = root / "tmp" / f"{okeys[1].hex()}.{'ab' * 8}-dead0001.abcd1234.tmp"  # a writer with no lease
    stale.write_bytes(b"partial")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    live = root / "tmp" / f"{okeys[1].hex()}.{'cd' * 8}-a11fe001.abcd1234.tmp"  # a live lease holder's, old too
    live.write_bytes(b"partial")
    os.utime(live, (old, old))
    (root / "index" / f"lease-{'cd' * 8}-a11fe001").write_text("peer\n")  # freshly touched: live
    rc, out = run(capsys, str(root))
    assert rc == 0
    assert f"WARN {orphan}: orphan:" in out and f"WARN {stale}: stale:" in out and f"WARN {live}: temporary:" in out
    rc, _ = run(capsys, "--strict", str(root))
    assert rc == 1


def test_repair_quarantines_fixes_the_index_and_the_store_agrees(disk_tmp, capsys):
    root, other = disk_tmp / "t", disk_tmp / "o"
    keys = make_tier(root)
    okeys = make_tier(other, n=1, seed=5)
    (root / relpath(keys[0])).write_bytes(b"")  # bad
    os.unlink(root / relpath(keys[1]))  # missing
    orphan = root / relpath(okeys[0])
    orphan.parent.mkdir(parents=True, exist_ok=True)
    orphan.write_bytes((other / relpath(okeys[0])).read_bytes())
    os.chmod(root / relpath(keys[2]), 0o644)
    stale = root / "tmp" / f"{okeys[0].hex()}.{'ab' * 8}-dead0001.abcd1234.tmp"
    stale.write_bytes(b"x")
    os.utime(stale, (time.time() - 7200,) * 2)
    rc, out = run(capsys, "--repair", str(root))
    assert rc == 0, out
    repaired = [line.split(": ", 1)[1] for line in out.splitlines() if line.startswith("REPAIRED")]
    assert f"quarantined {relpath(keys[0])} (truncated header (0 B))" in repaired
    assert f"index: deleted the entry of {relpath(keys[1])} (no file)" in repaired
    assert any(r.startswith(f"index: recorded {relpath(okeys[0])}") for r in repaired)
    assert f"removed tmp/{stale.name}" in repaired and f"chmod go-rwx {relpath(keys[2])}" in repaired
    assert not stale.exists() and (root / relpath(keys[2])).stat().st_mode & 0o077 == 0
    q = list((root / "quarantine").iterdir())
    assert any(p.name.startswith(keys[0].hex()) and p.suffix == ".kvc" for p in q)
    assert any(p.name.endswith(".why") and "truncated header" in p.read_text() for p in q)
    rc, out = run(capsys, "--strict", str(root))
    assert rc == 0, out
    with kvstream.open_store(cfg(root)) as s:
        assert s.contains(okeys[0]) and not s.contains(keys[0]) and not s.contains(keys[1])
        got = s.get_many([okeys[0], keys[3]])
        assert bytes(got[0]) == (other / relpath(okeys[0])).read_bytes()[HEADER_BYTES:HEADER_BYTES + len(got[0])]
        assert s.stats().tiers["t"].corrupt_chunks == 0


def test_a_damaged_snapshot_is_an_index_error(disk_tmp, capsys):
    root = disk_tmp / "t"
    make_tier(root)
    make_tier(root, n=1, seed=3)  # the second open compacts the first log into a snapshot
    [snap] = (root / "index").glob("*.snapshot.idx")
    raw = bytearray(snap.read_bytes())
    raw[-1] ^= 1
    snap.write_bytes(bytes(raw))
    rc, out = run(capsys, str(root))
    assert rc == 1 and f"BAD  {snap}: index: bad snapshot checksum" in out


@pytest.mark.parametrize("race", ["replaced", "deleted", "listed_but_never_readable"])
def test_a_snapshot_a_live_compaction_swaps_under_verify(disk_tmp, capsys, monkeypatch, race):
    """verify runs beside live stores: a snapshot that a compaction renames over (or deletes) between the
    listing and the read answers ENOENT for a moment (GlusterFS: seen in the two-node soak). That is not
    damage; a snapshot that stays listed and never reads is."""
    root = disk_tmp / "t"
    make_tier(root)
    make_tier(root, n=1, seed=3)
    [snap] = (root / "index").glob("*.snapshot.idx")
    real = Path.read_bytes
    calls = {"n": 0}

    def racing_read(self: Path) -> bytes:
        if self != snap:
            return real(self)
        calls["n"] += 1
        if race == "deleted":
            snap.unlink(missing_ok=True)
        if race == "listed_but_never_readable" or calls["n"] == 1:
            raise FileNotFoundError(2, "No such file or directory", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", racing_read)
    rc, out = run(capsys, str(root))
    if race == "listed_but_never_readable":
        assert rc == 1 and f"BAD  {snap}: index: unreadable: No such file or directory" in out
    else:
        assert calls["n"] >= 1 and "index:" not in out and rc == 0, out


def test_json_output_and_several_paths(disk_tmp, capsys):
    a, b = disk_tmp / "a", disk_tmp / "b"
    make_tier(a)
    keys = make_tier(b)
    (b / relpath(keys[0])).write_bytes(b"junk")
    rc, out = run(capsys, "--json", str(a), str(b))
    assert rc == 1
    reports = json.loads(out)
    assert [r["ok"] for r in reports] == [True, False]
    assert reports[1]["findings"][0] == {"severity": "error", "kind": "corrupt", "file": relpath(keys[0]),
                                         "detail": "truncated header (4 B)", "key": keys[0].hex()}


def test_not_a_tier_folder_is_a_usage_error(disk_tmp, capsys):
    rc, out = run(capsys, str(disk_tmp / "nope"))
    assert rc == 2 and "no such folder" in out
    (disk_tmp / "plain").mkdir()
    rc, out = run(capsys, str(disk_tmp / "plain"))
    assert rc == 2 and "not a kvstream tier folder" in out


def test_verify_tier_counts(disk_tmp):
    root = disk_tmp / "t"
    make_tier(root, n=9)
    rep = verify_tier(root)
    assert (rep.chunk_files, rep.valid_chunks, rep.index_entries, rep.errors) == (9, 9, 9, [])


def test_a_fifo_at_a_chunk_path_is_reported_not_waited_on(disk_tmp, capsys):
    import threading

    root = disk_tmp / "t"
    keys = make_tier(root, n=3)
    path = DirectoryTier.relpath(keys[0])
    os.unlink(root / path)
    os.mkfifo(root / path)
    out: list = []
    t = threading.Thread(target=lambda: out.append(run(capsys, str(root))), daemon=True)
    t.start()
    t.join(20)
    assert not t.is_alive(), "kvstream verify hung on a FIFO"
    rc, text = out[0]
    assert rc == 1 and "not a regular file" in text
