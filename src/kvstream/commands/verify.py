"""``kvstream verify [PATH ...] [--config FILE] [--json] [--repair] [--strict]``: check tier folders offline.

For each folder (see :mod:`kvstream.tiers.files` for the layout) it reads every chunk file and checks its header
(magic, version, header checksum), that the key in the header is the one its name says, its size, and its
payload checksum; it compares the files with the persistent index (entries without a file, files without an
entry, sizes that disagree); and it looks at temporaries, the quarantine, file modes and anything else in the
folder. Exit status: 0 if nothing is bad (warnings allowed, unless ``--strict``), 1 if something is (each bad
file is named on its own line), 2 if PATH is not a tier folder.

Errors (exit 1): a chunk file that fails any check (``corrupt``; a header whose key is not the one the name
says is one), a file under ``chunks/`` that is not a chunk name at its place (``foreign``), two directory
entries under one chunk name (``duplicate``: two writers both won the publish, which GlusterFS allows now and
then; readers check the header, so it costs a miss at most), an index entry whose file size differs
(``size``), an unreadable or damaged snapshot, or damaged records in the middle of an index log (``index``:
records after them are still read, but the chunks the damaged ones listed are orphans).
Warnings: a valid chunk the index does not list (``orphan``: a crash between publish and index append, or an
index written elsewhere), an index entry whose file is gone (``missing``: a crash between an eviction's unlink
and its delete record; the store reads it as a miss, so verify agrees with it right after a crash), a temporary file (``temporary``; ``stale`` if its writer's lease is gone and it is
older than the lease expiry, or it has no lease in its name and is older than an hour), a file or folder other
users may read (``mode``), an unexpected entry in the folder (``extra``), a torn index log tail (``log``;
normal after a crash), a repair left for later (``skipped``).

``--repair`` then moves bad chunk files (and foreign ones) to ``quarantine/`` (with a ``.why`` note), moves damaged
snapshots there too and rewrites damaged logs of finished writers with their valid records only (the index is
rebuilt from the chunk files: every valid orphan is listed again), appends index records
(a put for each valid orphan or size disagreement, a delete for each missing or bad file), deletes stale
temporaries and drops group/other permission bits, and scans again; the exit status is the second scan's.
It is safe beside running stores, on a shared tier too: what a node holding a live lease may be writing (an
orphan younger than the lease expiry: a publish whose put is not logged yet; a missing entry of a live node:
perhaps a listing this client does not see yet) is not touched but reported as ``skipped``. Stores on a
``shared`` tier follow index logs and see the repair.

``--config FILE`` also opens the store that FILE describes and reports its replicas per tier: copies owed (the
journal of copies the writer had to skip, :mod:`kvstream.replica_debt`) and, with ``replication: full``, chunks
of the first tier another tier lacks (a crash before the journal reached the disk leaves those). A replica still
missing is a warning (its other copy serves reads); ``--repair`` owes every deficit and lets the store's
catch-up write them all, then reports what is left.

Nothing here deserialises data: a chunk's header is parsed by :func:`kvstream.format.decode_header` only.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvstream.errors import UsageError
from kvstream.tiers.recheck import check_chunk_file
from kvstream.tiers.files import MARKER, TMP_RE, _MARKER_TEXT, _TMP_MAX_AGE_S
from kvstream.tiers.index import OP_DEL, OP_PUT, SNAPSHOT_SUFFIX, TierIndex, _encode, _parse_snapshot, _scan_log, log_owner
from kvstream.replica_debt import ReplicaReport

__all__ = ["register", "verify_tier", "Finding", "TierReport"]

_CHUNK_NAME = re.compile(r"^([0-9a-f]{2,128})\.kvc$")
# node-id: the node's persistent id (tiers/lease.py); owed: the journal of replicas still owed (replica_debt.py)
_TOP = {MARKER, "chunks", "tmp", "index", "quarantine", "node-id", "owed"}
_INDEX_FILES = re.compile(r"^(log-.*\.(log|closed)|([0-9a-f]{16}\.)?snapshot\.idx|([0-9a-f]{16}\.)?compact\.lock|"
                          r"snapshot\..*\.tmp|lease-[0-9a-f]{16}-[0-9a-f]{8})$")


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing wrong (``error``) or worth knowing (``warning``) about one file."""

    severity: str  # "error" | "warning"
    kind: str  # corrupt | foreign | duplicate | missing | size | index | orphan | temporary | stale | mode | extra
    #            | log | marker | skipped
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
    """(file size, None) if the file is a valid chunk for ``key_hex``, else (size, the failed check): the
    store's own check (:func:`kvstream.tiers.recheck.check_chunk_file`)."""
    size, _ino, why = check_chunk_file(path, bytes.fromhex(key_hex))
    return size, why


def _mode_problem(st: os.stat_result) -> str | None:
    bits = stat.S_IMODE(st.st_mode)
    if bits & 0o077:
        return f"mode {bits:04o}: other users may {'list' if stat.S_ISDIR(st.st_mode) else 'read'} it"
    return None


@dataclass
class _Context:
    """What a repair needs from the scan: the index's owners of each key, the live leases, file ages."""

    owners: dict[bytes, set[str]] = field(default_factory=dict)  # key -> node ids listing it
    live_uids: set[str] = field(default_factory=set)  # nodes holding a live lease on this tier
    expiry_s: float = 0.0
    ages: dict[str, float] = field(default_factory=dict)  # chunk file (relative) -> seconds since its mtime
    live_writers: dict[str, str] = field(default_factory=dict)  # uid-token -> uid of every live lease


# A listed index file that a live node's compaction replaced (rename over it) or deleted may answer ENOENT
# (ESTALE on a network file system) between our listing and our open; on GlusterFS a rename seen from another
# client can do so until that client's cached name lookup expires (FUSE entry timeout, 1 s by default for
# glusterfs) even though the name exists again. Seen in the two-node soak: a snapshot reported "unreadable:
# No such file or directory" by a verify that ran right after the last store's closing compaction. The pauses
# outlast two entry timeouts; they are paid only when a listed file does not open.
_VANISHED = (errno.ENOENT, errno.ESTALE)
_RELOOK_S = (0.1, 0.4, 1.0, 1.5)


def _read_listed(path: Path) -> bytes | None:
    """The bytes of an index file our listing named, or None if it is gone: a live compaction's rename or
    delete, not damage. A name that still resolves but will not read is raised, so it is reported."""
    for pause in _RELOOK_S:
        try:
            return path.read_bytes()
        except OSError as exc:
            if exc.errno not in _VANISHED:
                raise
        time.sleep(pause)
    try:
        return path.read_bytes()
    except OSError as exc:
        if exc.errno not in _VANISHED or path.name in os.listdir(path.parent):
            raise  # listed yet unreadable every time we looked: say so
        return None


def _scan(root: Path) -> tuple[TierReport, dict[str, Path], dict[bytes, int], _Context]:
    """One read-only pass. Returns the report, valid chunk files by key hex, the index's live set and what a
    repair needs to leave live nodes' work alone."""
    t0 = time.perf_counter()
    rep = TierReport(path=str(root))
    add = rep.findings.append
    why: str | None  # a finding's reason (None: no problem), reused below
    marker = root / MARKER
    try:
        text = marker.read_text(errors="replace")
        if text != _MARKER_TEXT:
            add(Finding("error", "marker", MARKER, f"says {text.strip()[:80]!r}, expected {_MARKER_TEXT.strip()!r}"))
    except OSError as exc:
        add(Finding("error", "marker", MARKER, f"unreadable: {exc.strerror}"))

    # The index, read-only: no compaction, no log of our own.
    live: dict[bytes, int] = {}
    ctx = _Context()
    idx_dir = root / "index"
    if idx_dir.is_dir():
        idx = TierIndex(idx_dir, node_id="verify", writable=False)
        for entry in sorted(os.scandir(idx_dir), key=lambda e: e.name):
            if entry.name == "snapshot.idx" or entry.name.endswith(SNAPSHOT_SUFFIX):
                try:
                    data = _read_listed(Path(entry.path))
                    if data is None:
                        continue  # replaced or deleted by a live compaction since the listing: not damage
                    _parse_snapshot(data, entry.name)
                except (ValueError, OSError) as exc:
                    why = str(exc).split(": ", 1)[-1] if isinstance(exc, ValueError) else f"unreadable: {exc.strerror}"
                    add(Finding("error", "index", f"index/{entry.name}", why))
        live = dict(idx.items())
        ctx.owners = {k: idx.owners(k) for k in live}
        ctx.live_uids = idx.lease.live_uids()
        ctx.expiry_s = idx.lease.expiry_s
        live_writers = idx.lease.live()
        ctx.live_writers = live_writers
        now = idx.lease.reference()
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
                scan = _scan_log(data, whole=entry.name.endswith(".closed"))
                if scan.damaged:  # valid records after bad ones, or junk in a closed log: damage, not a torn tail
                    where = ", ".join(f"{n} B at byte {off}" for off, n in scan.holes[:5])
                    add(Finding("error", "index", rel, f"{scan.damaged_records} damaged record(s) ({where}) among "
                                                       f"{len(scan.records)} valid ones; the chunks they listed are "
                                                       "orphans until --repair lists them again"))
                if scan.tail_junk:  # zeros are the space a live (or crashed) writer reserved
                    add(Finding("warning", "log", rel, f"{len(scan.records)} valid records, then {scan.tail_junk} B "
                                                       "of torn or foreign data (ignored)"))
    else:
        add(Finding("error", "index", "index", "no index folder"))
        live_writers, now = {}, time.time()
    rep.index_entries = len(live)

    valid: dict[str, Path] = {}
    seen: set[str] = set()
    chunks = root / "chunks"
    for dirpath, dirnames, filenames in os.walk(chunks):
        dirnames.sort()
        counts: dict[str, int] = {}
        for name in filenames:
            counts[name] = counts.get(name, 0) + 1
        for name in sorted(counts):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if counts[name] > 1:  # GlusterFS: two links of one name both succeeded (two files, one name)
                m = _CHUNK_NAME.match(name)
                add(Finding("error", "duplicate", rel, f"{counts[name]} directory entries under one name (two "
                                                       "writers both won the publish)", m.group(1) if m else ""))
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
                ctx.ages[rel] = now - p.stat().st_mtime
                size, why = _check_chunk(p, key_hex)
            except OSError as exc:
                if exc.errno not in (errno.ENOENT, errno.ESTALE):
                    add(Finding("error", "corrupt", rel, f"unreadable: {exc.strerror}", key_hex))
                continue  # gone (evicted while we looked): nothing to check
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
            # A warning, as the store sees it: a listed chunk without its file reads as a miss (and its listing is
            # dropped). A crash between an eviction's unlink and its delete record leaves exactly this, so verify
            # must agree with the store right after a crash; --repair logs the delete.
            add(Finding("warning", "missing", f"chunks/{h[:2]}/{h[2:4]}/{h}.kvc",
                        f"index lists {size} B, no file (reads as a miss; --repair drops the listing)", h))

    tmp = root / "tmp"
    if tmp.is_dir():
        for entry in sorted(os.scandir(tmp), key=lambda e: e.name):
            m = TMP_RE.match(entry.name)
            try:
                age = now - entry.stat().st_mtime
            except OSError:
                continue
            # A lease-named temporary is stale once its writer's lease is not live and the lease expiry has
            # passed over it too; others (older versions) after an hour. Never a live writer's, on any node.
            dead = m is not None and f"{m.group(1)}-{m.group(2)}" not in live_writers and age > ctx.expiry_s
            if dead or (m is None and age > _TMP_MAX_AGE_S):
                why = "its writer's lease is gone" if dead else f"{age / 3600:.1f} h old"
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
    return rep, valid, live, ctx


def _live_work(f: Finding, ctx: _Context) -> str | None:
    """Why a repair of ``f`` could race a live node (then it is skipped), or None."""
    if f.kind == "orphan" and ctx.live_uids and ctx.ages.get(f.file, 0.0) <= ctx.expiry_s:
        return "a live node may not have logged this publish yet"
    if f.kind in ("missing", "size") and f.key:
        holders = ctx.owners.get(bytes.fromhex(f.key), set()) & ctx.live_uids
        if holders:
            return f"listed by live node(s) {', '.join(sorted(holders))}: this client may not see the file yet"
    return None


def _repair(root: Path, rep: TierReport, live: dict[bytes, int], ctx: _Context) -> tuple[list[str], list[Finding]]:
    done: list[str] = []
    skipped: list[Finding] = []
    idx = TierIndex(root / "index", node_id="verify")
    try:
        for f in rep.findings:
            key = bytes.fromhex(f.key) if f.key else None
            if (why := _live_work(f, ctx)) is not None:
                skipped.append(Finding("warning", "skipped", f.file, f"{f.kind} not repaired: {why}", f.key))
                continue
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
            elif f.kind == "duplicate" and key is not None:
                line = _resolve_duplicate(root, f.file, key, ctx)
                if line.startswith("skipped: "):
                    skipped.append(Finding("warning", "skipped", f.file, f"duplicate not resolved: {line[9:]}"))
                elif line:
                    done.append(line)
            elif f.kind == "index" and f.file.startswith("index/"):
                line = _repair_index_file(root, f.file, ctx)
                if line.startswith("skipped: "):
                    skipped.append(Finding("warning", "skipped", f.file, f"index not repaired: {line[9:]}"))
                elif line:
                    done.append(line)
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
    return done, skipped


def _resolve_duplicate(root: Path, rel: str, key: bytes, ctx: _Context) -> str:
    """Two directory entries under one chunk name (two links both won, GlusterFS): leave exactly one. The file the
    name resolves to is copied aside if it is a valid chunk of the key, every entry under the name is removed
    (each unlink removes the one the name resolves to), and the copy is linked back (the same key's valid bytes:
    the index's listings stay right). Only with no live node on the tier: a live node may be reading it."""
    if ctx.live_uids:
        return "skipped: nodes hold live leases on this tier (they may be reading it; run again once they closed)"
    path = root / rel
    try:
        _size, _ino, why = check_chunk_file(path, key)
    except OSError as exc:
        return f"skipped: {rel}: {exc.strerror}"
    copy = root / "quarantine" / f".{path.name}.{int(time.time())}.dup.tmp"
    if why is None:
        shutil.copyfile(path, copy)
        os.chmod(copy, 0o600)
    removed = 0
    for _ in range(8):
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            break
    kept = ""
    if why is None:
        try:
            os.link(copy, path)
            kept = ", one valid copy kept"
        except FileExistsError:
            kept = ", a writer published it again meanwhile"
        finally:
            copy.unlink(missing_ok=True)
    return f"resolved the duplicate {rel}: {removed} entries removed{kept}"


def _repair_index_file(root: Path, rel: str, ctx: _Context) -> str:
    """Repair one damaged index file; returns what was done ("skipped: why" if nothing may be).

    A damaged snapshot lists nothing any store can read: it is moved to ``quarantine/`` (its owner's next
    compaction writes a new one from its logs); a damaged log whose writer is gone (closed, or its lease not
    live) is rewritten in place (temporary + rename, same name, so its owner still owns and compacts it) with
    its valid records only. The chunks the lost records listed are orphans, listed again by this repair's own
    log (the orphan findings). A live writer's log is left to it (reported as skipped)."""
    name = rel[len("index/"):]
    path = root / rel
    q = root / "quarantine"
    stamp = int(time.time())
    if name == "snapshot.idx" or name.endswith(SNAPSHOT_SUFFIX):
        try:
            os.rename(path, q / f"{name}.{stamp}.damaged")
        except FileNotFoundError:
            return ""
        return f"moved the damaged snapshot {rel} to quarantine/ (its chunks are listed again from the files)"
    if name.startswith("log-"):
        owner = log_owner(name)
        if name.endswith(".log") and owner is not None and f"{owner[0]}-{owner[1]}" in ctx.live_writers:
            return "skipped: its writer is live (repair it once that writer has closed it)"
        try:
            scan = _scan_log(path.read_bytes(), whole=name.endswith(".closed"))
        except FileNotFoundError:
            return ""
        tmp = q / f".{name}.{stamp}.repair.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"".join(_encode(r) for r in scan.records))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return (f"rewrote {rel} without its {scan.damaged_records} damaged record(s) ({len(scan.records)} valid "
                "records kept)")
    return ""


def verify_tier(path: str | os.PathLike[str], *, repair: bool = False) -> TierReport:
    """Check one tier folder (and repair it if asked; the returned report is then the second scan's, with
    ``repaired`` listing what was done). Raises :class:`UsageError` if ``path`` is not a tier folder."""
    root = Path(path)
    if not root.is_dir():
        raise UsageError(f"{root}: no such folder")
    if not (root / MARKER).exists() and not (root / "chunks").is_dir():
        raise UsageError(f"{root}: not a kvstream tier folder (no {MARKER} marker, no chunks/)")
    rep, _valid, live, ctx = _scan(root)
    if repair and (rep.errors or any(f.kind in ("orphan", "stale", "mode") for f in rep.findings)):
        done, skipped = _repair(root, rep, live, ctx)
        rep, _valid, _live, _ctx = _scan(root)
        rep.repaired = done
        rep.findings += skipped
    return rep


# ── command line ───────────────────────────────────────────────────────────────────────────────────────────


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("verify", help="check tier folders: headers, checksums, index consistency",
                              description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("paths", nargs="*", metavar="PATH", help="a tier folder (the one a tier's `path` names)")
    p.add_argument("--config", metavar="FILE",
                   help="also open the store this YAML describes and report its replicas: copies owed and, with "
                        "`replication: full`, chunks of the first tier another tier lacks (--repair writes them)")
    p.add_argument("--repair", action="store_true",
                   help="quarantine bad files, fix the index, remove stale temporaries, then check again")
    p.add_argument("--strict", action="store_true", help="warnings count as failures too")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_run)


def _replicas(config: str, repair: bool) -> ReplicaReport:
    from kvstream.store import open_store

    with open_store(config) as store:
        return store.check_replicas(repair=repair)


def _run(args: argparse.Namespace) -> int:
    if not args.paths and not args.config:
        raise UsageError("verify: give tier folders (PATH ...), --config FILE, or both")
    reports = [verify_tier(p, repair=args.repair) for p in args.paths]
    replicas = _replicas(args.config, args.repair) if args.config else None
    # A replica still missing reads fine from its other copy: a warning (an error with --strict).
    bad = any(r.errors or (args.strict and r.warnings) for r in reports) or bool(
        args.strict and replicas is not None and replicas.missing)
    if args.json:
        out: object = [r.to_dict() for r in reports]
        if replicas is not None:
            out = {"tiers": out, "replicas": replicas.to_dict()}
        json.dump(out, sys.stdout, indent=2)
        print()
        return 1 if bad else 0
    if replicas is not None:
        for tier in replicas.owed:
            owed, lacking = replicas.owed[tier], replicas.deficits.get(tier, 0)
            tag = "WARN" if owed or lacking else "OK  "
            print(f"{tag} replicas on {tier}: {owed} copies owed, {lacking} chunks of the first tier missing"
                  + (" (after --repair)" if replicas.repaired else ""))
    for r in reports:
        for line in r.repaired:
            print(f"REPAIRED {r.path}: {line}")
        for f in r.findings:
            tag = "BAD " if f.severity == "error" else "WARN"
            print(f"{tag} {os.path.join(r.path, f.file)}: {f.kind}: {f.detail}")
        print(f"{r.path}: {r.chunk_files} chunk files, {r.valid_chunks} valid, {r.index_entries} in the index, "
              f"{len(r.errors)} bad, {len(r.warnings)} warnings, {r.quarantined} quarantined ({r.seconds:.2f} s)")
    return 1 if bad else 0
