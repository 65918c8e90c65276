"""``kvstream verify PATH [PATH ...] [--json] [--repair] [--strict]``: check tier folders offline.

For each folder (see :mod:`kvstream.tiers.files` for the layout) it reads every chunk file and checks its header
(magic, version, header checksum), that the key in the header is the one its name says, its size, and its
payload checksum; it compares the files with the persistent index (entries without a file, files without an
entry, sizes that disagree); and it looks at temporaries, the quarantine, file modes and anything else in the
folder. Exit status: 0 if nothing is bad (warnings allowed, unless ``--strict``), 1 if something is (each bad
file is named on its own line), 2 if PATH is not a tier folder.

Errors (exit 1): a chunk file that fails any check (``corrupt``), a file under ``chunks/`` that is not a chunk
name at its place (``foreign``), an index entry whose file is gone (``missing``) or whose size differs
(``size``), an unreadable or damaged snapshot (``index``).
Warnings: a valid chunk the index does not list (``orphan``: a crash between publish and index append, or an
index written elsewhere), a temporary file (``temporary``; ``stale`` if its writer is dead or it is older than
an hour), a file or folder other users may read (``mode``), an unexpected entry in the folder (``extra``), a
torn index log tail (``log``; normal after a crash).

``--repair`` then moves bad chunk files (and foreign ones) to ``quarantine/`` (with a ``.why`` note), appends index records
(a put for each valid orphan or size disagreement, a delete for each missing or bad file), deletes stale
temporaries and drops group/other permission bits, and scans again; the exit status is the second scan's.
Run it while no store has the folder open (stores on a ``shared`` tier follow index logs and see the repair).

Nothing here deserialises data: a chunk's header is parsed by :func:`kvstream.format.decode_header` only.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvstream.errors import CorruptChunkError, UsageError
from kvstream.format import HEADER_BYTES, decode_header
from kvstream.tiers.files import MARKER, _MARKER_TEXT, _TMP_MAX_AGE_S
from kvstream.tiers.index import OP_DEL, OP_PUT, TierIndex, _decode_log, _REC_BYTES, pid_alive

__all__ = ["register", "verify_tier", "Finding", "TierReport"]

_CHUNK_NAME = re.compile(r"^([0-9a-f]{2,128})\.kvc$")
_TOP = {MARKER, "chunks", "tmp", "index", "quarantine"}
_INDEX_FILES = re.compile(r"^(log-.*\.(log|closed)|snapshot\.idx|compact\.lock|snapshot\..*\.tmp)$")
_READ_BLOCK = 4 << 20


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong (``error``) or worth knowing (``warning``) about one file."""

    severity: str  # "error" | "warning"
    kind: str  # corrupt | foreign | missing | size | index | orphan | temporary | stale | mode | extra | log | marker
    file: str  # path relative to the tier folder
    detail: str
    key: str = ""  # chunk key (hex) where there is one


@dataclass
class TierReport:
    path: str
    chunk_files: int = 0
    valid_chunks: int = 0
    index_entries: int = 0
    quarantined: int = 0
    findings: list[Finding] = field(default_factory=list)
    repaired: list[str] = field(default_factory=list)  # what --repair did, one line each
    seconds: float = 0.0

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = not self.errors
        return d


# ── scanning ───────────────────────────────────────────────────────────────────────────────────────────────


def _check_chunk(path: Path, key_hex: str) -> tuple[int, str | None]:
    """(file size, None) if the file is a valid chunk for ``key_hex``, else (size, the failed check).

    Opened with ``O_NONBLOCK`` and checked to be a regular file first: a FIFO planted at a chunk path would
    block a plain open (and ``verify``) forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return 0, "not a regular file"
    with os.fdopen(fd, "rb") as f:
        size = st.st_size
        head = f.read(HEADER_BYTES)
        try:
            header = decode_header(head, where=str(path), expect_key=bytes.fromhex(key_hex))
        except CorruptChunkError as exc:
            return size, exc.reason
        if size < header.file_size:
            return size, f"truncated file ({size} of {header.file_size} B)"
        if size > header.file_size:
            return size, f"file is {size} B, its header says {header.file_size} B"
        h = xxhash.xxh3_64()
        left = header.payload_len
        while left:
            block = f.read(min(left, _READ_BLOCK))
            if not block:
                return size, f"truncated payload ({header.payload_len - left} of {header.payload_len} B)"
            h.update(block)
            left -= len(block)
        if h.intdigest() != header.payload_sum:
            return size, "payload checksum mismatch"
    return size, None


def _mode_problem(st: os.stat_result) -> str | None:
    bits = stat.S_IMODE(st.st_mode)
    if bits & 0o077:
        return f"mode {bits:04o}: other users may {'list' if stat.S_ISDIR(st.st_mode) else 'read'} it"
    return None


def _scan(root: Path) -> tuple[TierReport, dict[str, Path], dict[bytes, int]]:
    """One read-only pass. Returns the report, valid chunk files by key hex, and the index's live set."""
    t0 = time.perf_counter()
    rep = TierReport(path=str(root))
    add = rep.findings.append
    marker = root / MARKER
    try:
        text = marker.read_text(errors="replace")
        if text != _MARKER_TEXT:
            add(Finding("error", "marker", MARKER, f"says {text.strip()[:80]!r}, expected {_MARKER_TEXT.strip()!r}"))
    except OSError as exc:
        add(Finding("error", "marker", MARKER, f"unreadable: {exc.strerror}"))

    # The index, read-only: no compaction, no log of our own.
    live: dict[bytes, int] = {}
    idx_dir = root / "index"
    if idx_dir.is_dir():
        idx = TierIndex(idx_dir, node_id="verify", writable=False)
        try:
            idx._read_snapshot()
        except ValueError as exc:
            add(Finding("error", "index", "index/snapshot.idx", str(exc).split(": ", 1)[-1]))
        live = dict(idx.items())
        for entry in sorted(os.scandir(idx_dir), key=lambda e: e.name):
            rel = f"index/{entry.name}"
            if not _INDEX_FILES.match(entry.name):
                add(Finding("warning", "extra", rel, "not an index file"))
                continue
            if entry.name.startswith("log-"):
                try:
                    data = Path(entry.path).read_bytes()
                except OSError:
                    continue
                whole = len(data) // _REC_BYTES
                good = sum(1 for _ in _decode_log(data[: whole * _REC_BYTES]))
                rest = data[good * _REC_BYTES :]
                if rest.count(0) != len(rest):  # zeros are the space a live (or crashed) writer reserved
                    add(Finding("warning", "log", rel, f"{good} valid records, then {len(data) - good * _REC_BYTES} B "
                                                       "of torn or foreign data (ignored)"))
    else:
        add(Finding("error", "index", "index", "no index folder"))
    rep.index_entries = len(live)

    valid: dict[str, Path] = {}
    seen: set[str] = set()
    chunks = root / "chunks"
    for dirpath, dirnames, filenames in os.walk(chunks):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            m = _CHUNK_NAME.match(name)
            if p.is_symlink():
                add(Finding("error", "foreign", rel, "symbolic link (the store never makes one; not followed)"))
                continue
            if not m or len(m.group(1)) % 2 or rel != f"chunks/{m.group(1)[:2]}/{m.group(1)[2:4]}/{name}":
                add(Finding("error", "foreign", rel, "not a chunk file name at its place (ignored by the store)"))
                continue
            key_hex = m.group(1)
            rep.chunk_files += 1
            try:
                size, why = _check_chunk(p, key_hex)
            except FileNotFoundError:
                continue  # evicted while we looked
            except OSError as exc:
                add(Finding("error", "corrupt", rel, f"unreadable: {exc.strerror}", key_hex))
                continue
            seen.add(key_hex)
            if why is not None:
                add(Finding("error", "corrupt", rel, why, key_hex))
                continue
            rep.valid_chunks += 1
            valid[key_hex] = p
            listed = live.get(bytes.fromhex(key_hex))
            if listed is None:
                add(Finding("warning", "orphan", rel, "valid chunk not in the index (invisible to the store)", key_hex))
            elif listed != size:
                add(Finding("error", "size", rel, f"index says {listed} B, file has {size} B", key_hex))
    for key, size in sorted(live.items()):
        h = key.hex()
        if h not in seen:
            add(Finding("error", "missing", f"chunks/{h[:2]}/{h[2:4]}/{h}.kvc", f"index lists {size} B, no file", h))

    tmp = root / "tmp"
    if tmp.is_dir():
        now = time.time()
        for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
            parts = entry.name.split(".")
            try:
                age = now - entry.stat().st_mtime
            except FileNotFoundError:
                continue
            dead = (len(parts) >= 5 and parts[-1] == "tmp" and parts[1] == os.uname().nodename
                    and parts[2].isdigit() and not pid_alive(int(parts[2])))
            if dead or age > _TMP_MAX_AGE_S:
                why = "its writer is dead" if dead else f"{age / 3600:.1f} h old"
                add(Finding("warning", "stale", f"tmp/{entry.name}", f"left by a crashed writer ({why})"))
            else:
                add(Finding("warning", "temporary", f"tmp/{entry.name}", "being written (or by a writer on another node)"))
    q = root / "quarantine"
    if q.is_dir():
        rep.quarantined = sum(1 for n in os.listdir(q) if n.endswith(".kvc"))
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name not in _TOP:
            add(Finding("warning", "extra", entry.name, "not part of a tier folder (ignored by the store)"))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            try:
                st = p.lstat()
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                continue  # a link has no mode of its own (and chmod would change its target)
            why = _mode_problem(st)
            if why:
                add(Finding("warning", "mode", str(p.relative_to(root)), why))
    try:
        why = _mode_problem(root.stat())
        if why:
            add(Finding("warning", "mode", ".", why))
    except OSError:
        pass
    rep.seconds = time.perf_counter() - t0
    return rep, valid, live


def _repair(root: Path, rep: TierReport, live: dict[bytes, int]) -> list[str]:
    done: list[str] = []
    idx = TierIndex(root / "index", node_id="verify")
    try:
        for f in rep.findings:
            key = bytes.fromhex(f.key) if f.key else None
            if f.kind == "corrupt" and key is not None:
                src = root / f.file
                dst = root / "quarantine" / f"{f.key}.{int(time.time())}.kvc"
                try:
                    os.rename(src, dst)
                    fd = os.open(str(dst) + ".why", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                    os.write(fd, f"kvstream verify: {f.detail}\n".encode())
                    os.close(fd)
                except FileNotFoundError:
                    pass
                if key in live:
                    idx.record(OP_DEL, key)
                done.append(f"quarantined {f.file} ({f.detail})")
            elif f.kind == "foreign":
                dst = root / "quarantine" / f"{os.path.basename(f.file)}.{int(time.time())}.foreign"
                try:
                    os.rename(root / f.file, dst)
                    if not dst.is_symlink():
                        os.chmod(dst, 0o600)
                    done.append(f"moved {f.file} to quarantine/{dst.name}")
                except FileNotFoundError:
                    pass
            elif f.kind == "missing" and key is not None:
                idx.record(OP_DEL, key)
                done.append(f"index: deleted the entry of {f.file} (no file)")
            elif f.kind in ("orphan", "size") and key is not None:
                try:
                    size = (root / f.file).stat().st_size
                except FileNotFoundError:
                    continue
                idx.record(OP_PUT, key, size)
                done.append(f"index: recorded {f.file} ({size} B)")
            elif f.kind == "stale":
                try:
                    os.unlink(root / f.file)
                    done.append(f"removed {f.file}")
                except FileNotFoundError:
                    pass
            elif f.kind == "mode":
                p = root / f.file
                try:
                    if p.is_symlink():
                        continue
                    os.chmod(p, stat.S_IMODE(p.lstat().st_mode) & 0o700)
                    done.append(f"chmod go-rwx {f.file}")
                except OSError:
                    pass
    finally:
        idx.close()
    return done


def verify_tier(path: str | os.PathLike[str], *, repair: bool = False) -> TierReport:
    """Check one tier folder (and repair it if asked; the returned report is then the second scan's, with
    ``repaired`` listing what was done). Raises :class:`UsageError` if ``path`` is not a tier folder."""
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder")
    if not (root / MARKER).exists() and not (root / "chunks").is_dir():
        raise UsageError(f"{root}: not a kvstream tier folder (no {MARKER} marker, no chunks/)")
    rep, _valid, live = _scan(root)
    if repair and (rep.errors or any(f.kind in ("orphan", "stale", "mode") for f in rep.findings)):
        done = _repair(root, rep, live)
        rep, _valid, _live = _scan(root)
        rep.repaired = done
    return rep


# ── command line ───────────────────────────────────────────────────────────────────────────────────────────


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("verify", help="check tier folders: headers, checksums, index consistency",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("paths", nargs="+", metavar="PATH", help="a tier folder (the one a tier's `path` names)")
    p.add_argument("--repair", action="store_true",
                   help="quarantine bad files, fix the index, remove stale temporaries, then check again")
    p.add_argument("--strict", action="store_true", help="warnings count as failures too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    reports = [verify_tier(p, repair=args.repair) for p in args.paths]
    bad = any(r.errors or (args.strict and r.warnings) for r in reports)
    if args.json:
        json.dump([r.to_dict() for r in reports], sys.stdout, indent=2)
        print()
        return 1 if bad else 0
    for r in reports:
        for line in r.repaired:
            print(f"REPAIRED {r.path}: {line}")
        for f in r.findings:
            tag = "BAD " if f.severity == "error" else "WARN"
            print(f"{tag} {os.path.join(r.path, f.file)}: {f.kind}: {f.detail}")
        print(f"{r.path}: {r.chunk_files} chunk files, {r.valid_chunks} valid, {r.index_entries} in the index, "
              f"{len(r.errors)} bad, {len(r.warnings)} warnings, {r.quarantined} quarantined ({r.seconds:.2f} s)")
    return 1 if bad else 0
