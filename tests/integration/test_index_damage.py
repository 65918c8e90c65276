"""A damaged index hides nothing that is still on disk (issue 21, item 8).

Before: the log reader stopped at the first record that failed its checksum, so a bit flip or a zeroed hole in a
closed log silently hid every later record (139 of 200 chunks in the issue's case, no warning, ``verify`` exit 0);
a damaged snapshot was skipped at load and never replaced (compaction refused to write over it), and ``verify
--repair`` could not fix either. Now: the log scan resyncs past damage (warns, counts ``index_damaged_records``);
a store that meets damage lists every whole chunk file no index lists again (``kvstream.tiers.rebuild``) and sets
its own damaged snapshot aside (its next compaction writes a new one); ``verify`` exits 1 naming the damage and
``--repair`` rewrites a finished log without its damaged records, moves a damaged snapshot aside and lists the
orphans again.

Damage is drawn by hypothesis: bit flips and zeroed holes at any offset of the log or the snapshot.

Mutation check (done when this was written): with ``_scan_log`` stopping at the first bad record again (the old
``_decode_log``), the log tests fail (up to 199 chunks hidden); with ``DirectoryTier._rebuild`` doing nothing,
every test fails on the chunks the damaged records or snapshot listed.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvstream
from kvstream.cli import main
from kvstream.commands.verify import verify_tier
from kvstream.tiers import index as index_mod
from kvstream.tiers.files import DirectoryTier

N = 200
PAYLOAD = 1000
EXAMPLES = int(os.environ.get("KVSTREAM_DAMAGE_EXAMPLES", "10"))
DAMAGE = settings(max_examples=EXAMPLES, deadline=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def cfg(root: Path) -> dict:
    return {"tiers": [{"name": "t", "path": str(root), "capacity_bytes": "64MiB"}], "memory_bytes": "4MiB",
            "create_dirs": True, "io_engine": "threads", "node_id": "damage-test"}


def key(i: int) -> bytes:
    return b"\xda\x7a" + i.to_bytes(4, "little") * 3 + b"kv"  # one fan-out folder: each example copies the tier


def data(i: int) -> bytes:
    return np.random.default_rng(i).bytes(PAYLOAD)


@pytest.fixture(scope="module")
def templates(tmp_path_factory):
    """Two tiers of N chunks: one whose index is a single closed log, one whose index is a single snapshot (its
    covered log deleted, as a compaction past the grace does)."""
    base = Path(os.environ.get("KVSTREAM_TEST_DIR", "/var/tmp")) / f"kvs-damage-{os.getpid()}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    log_t = base / "log"
    with kvstream.open_store(cfg(log_t)) as s:
        for i in range(N):
            assert s.put(key(i), data(i))
    snap_t = base / "snap"
    shutil.copytree(log_t, snap_t)
    with kvstream.open_store(cfg(snap_t)):  # compacts the closed log into the node's snapshot
        pass
    [snap] = (snap_t / "index").glob("*.snapshot.idx")
    for p in (snap_t / "index").glob("log-*"):
        p.unlink()  # the covered log (past the grace) and the empty log of the open above
    [log] = (log_t / "index").glob("log-*.closed")
    assert log.stat().st_size == N * index_mod._REC_BYTES
    yield {"log": log_t, "snap": snap_t, "log_file": log.relative_to(log_t), "snap_file": snap.relative_to(snap_t)}
    shutil.rmtree(base, ignore_errors=True)


def _damage(path: Path, how: str, offset: int, length: int) -> None:
    raw = bytearray(path.read_bytes())
    offset %= len(raw)
    if how == "flip":
        raw[offset] ^= 1 << (length % 8)
    else:
        raw[offset: offset + length] = bytes(len(raw[offset: offset + length]))
    path.write_bytes(bytes(raw))


def _all_listed(root: Path) -> tuple[int, int]:
    """(chunks listed, damaged records counted) by a store opened on ``root``; every listed chunk read back."""
    with kvstream.open_store(cfg(root)) as s:
        n = s.lookup([key(i) for i in range(N)])
        sample = [key(i) for i in range(0, N, 17)]
        s.evict_memory()
        got = s.get_many(sample)
        assert all(g is not None and bytes(g) == data(int.from_bytes(k[2:6], "little")) for g, k in zip(got, sample))
        return n, s.stats().tiers["t"].index_damaged_records


def _run_verify(*args: str) -> int:
    return main(["verify", *args])


@pytest.mark.slow
@pytest.mark.parametrize("how", ["flip", "zeros"])
def test_damage_in_a_log_hides_nothing_still_on_disk(templates, disk_tmp, how):
    @DAMAGE
    @given(offset=st.integers(0, N * 96 - 1), length=st.integers(1, 3000))
    def prop(offset: int, length: int) -> None:
        root = disk_tmp / "t"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(templates["log"], root)
        _damage(root / templates["log_file"], how, offset, length)
        rep = verify_tier(root)
        hit = any(f.kind == "index" for f in rep.errors)
        assert hit or how == "zeros"  # a flip always damages one record; zeros may land on zero bytes
        if hit:
            assert _run_verify(str(root)) == 1
        listed, damaged = _all_listed(root)
        assert listed == N, f"{N - listed} chunks hidden"
        assert (damaged >= 1) == hit
        if hit:
            assert _run_verify(str(root)) == 1  # the store listed its chunks again; the log is still damaged
        assert _run_verify("--repair", str(root)) == 0
        assert _run_verify(str(root)) == 0
        listed, damaged = _all_listed(root)
        assert listed == N and damaged == 0

    prop()


@pytest.mark.parametrize("how", ["flip", "zeros"])
def test_a_damaged_snapshot_is_replaced_at_open_and_hides_nothing(templates, disk_tmp, how):
    size = (templates["snap"] / templates["snap_file"]).stat().st_size

    @DAMAGE
    @given(offset=st.integers(0, size - 1), length=st.integers(1, 200))
    def prop(offset: int, length: int) -> None:
        root = disk_tmp / "t"
        shutil.rmtree(root, ignore_errors=True)
        shutil.copytree(templates["snap"], root)
        snap = root / templates["snap_file"]
        before = snap.read_bytes()
        _damage(snap, how, offset, length)
        if snap.read_bytes() == before:
            return  # zeros over zeros: nothing damaged
        assert _run_verify(str(root)) == 1
        listed, _ = _all_listed(root)
        assert listed == N, f"{N - listed} chunks hidden"
        # replaced at open: the damaged one is in quarantine/, a readable one is in the index
        assert list((root / "quarantine").glob("*.snapshot.idx.*.damaged"))
        new = root / templates["snap_file"]
        if new.exists():
            index_mod._parse_snapshot(new.read_bytes(), "new")
        assert _run_verify(str(root)) == 0
        assert _all_listed(root)[0] == N

    prop()


def test_verify_repair_replaces_a_damaged_snapshot_no_store_opened(templates, disk_tmp, capsys):
    root = disk_tmp / "t"
    shutil.copytree(templates["snap"], root)
    _damage(root / templates["snap_file"], "flip", 1000, 3)
    assert _run_verify(str(root)) == 1
    out = capsys.readouterr().out
    assert "index: bad snapshot checksum" in out and out.count(": orphan:") == N
    assert _run_verify("--repair", str(root)) == 0
    out = capsys.readouterr().out
    assert "moved the damaged snapshot" in out and f"{N} in the index" in out
    assert _all_listed(root) == (N, 0)


def test_verify_names_damaged_log_records(templates, disk_tmp, capsys):
    root = disk_tmp / "t"
    shutil.copytree(templates["log"], root)
    _damage(root / templates["log_file"], "zeros", 96 * 61, 96 * 3)
    assert _run_verify(str(root)) == 1
    out = capsys.readouterr().out
    assert f"index: 3 damaged record(s) (288 B at byte {96 * 61}) among {N - 3} valid ones" in out
    assert out.count(": orphan:") == 3


def _v1_log(records: list[tuple[int, bytes, int, int]]) -> bytes:
    """A log of the first format (magic KVIX, a wall-clock time where the gen is)."""
    out = b""
    for op, k, size, t in records:
        body = index_mod._REC.pack(b"KVIX", op, len(k), size, t, k)
        out += body + xxhash.xxh32_intdigest(body).to_bytes(4, "little")
    return out


def _v1_snapshot(entries: dict[bytes, int], covered: set[str]) -> bytes:
    arr = np.zeros(len(entries), dtype=index_mod._SNAP_DTYPE)
    arr["key"] = list(entries)
    arr["klen"] = [len(k) for k in entries]
    arr["size"] = list(entries.values())
    names = "\n".join(sorted(covered)).encode()
    body = struct.pack("<8sQQI", b"KVIXSNP1", len(entries), 1, len(names)) + names + arr.tobytes()
    return body + xxhash.xxh3_64_intdigest(body).to_bytes(8, "little")


def test_an_index_of_the_first_format_still_opens_and_resyncs_past_damage(templates, disk_tmp):
    """Older tiers: the shared ``snapshot.idx`` (KVIXSNP1) and logs of KVIX records, no gens. Half the chunks in
    the snapshot, half in a log with a damaged record in its middle: all listed, the damaged one from its file."""
    root = disk_tmp / "t"
    shutil.copytree(templates["log"], root)
    for p in (root / "index").iterdir():
        p.unlink()
    sizes = {key(i): (root / DirectoryTier.relpath(key(i))).stat().st_size for i in range(N)}
    (root / "index" / "snapshot.idx").write_bytes(_v1_snapshot({key(i): sizes[key(i)] for i in range(N // 2)}, set()))
    log = _v1_log([(1, key(i), sizes[key(i)], 1_000 + i) for i in range(N // 2, N)])
    raw = bytearray(log)
    raw[96 * 10 + 50] ^= 0x40
    (root / "index" / "log-old.log").write_bytes(bytes(raw))
    listed, damaged = _all_listed(root)
    assert listed == N and damaged == 1
