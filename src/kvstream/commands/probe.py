"""``kvstream probe PATH [PATH ...]``: measure each storage tier the way the KVStream paper's motivation does.

For every PATH (a folder on one tier) the probe creates its own files there with O_DIRECT writes, then
measures: the tier's write bandwidth alone; its read bandwidth alone, with per-chunk read latency P50/P99;
all tiers read at once for a common time window (each tier's bandwidth meanwhile, and their sum: the
aggregate-bandwidth bound a multi-tier read is held to); and
per-chunk read latency again under a concurrent write load on the same tier (the paper's third finding: P99
grows several-fold when reads and writes mix). Its files are removed at the end, also on error or Ctrl-C.

Every figure is raw engine I/O (:mod:`kvstream.io.rawread`): no chunk format, no verification.

Two PATHs on one device (one file system, or file systems on the same disk: partitions, LVM or device-mapper
volumes, md arrays, loop files) are one channel, not two: the probe warns, because their "all tiers at once"
figure then measures one device's bandwidth shared, not an aggregate. On a terminal a progress bar on stderr
shows which measurement is running (a default probe moves 512 MiB per tier four times over, plus a window of up
to 10 s with all tiers at once: tens of seconds on a slow disk).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

from kvstream.commands._common import console as _console
from kvstream.commands._common import positive_int
from kvstream.errors import UsageError
from kvstream.io import make_engine
from kvstream.io.buffers import ALIGN
from kvstream.io.engine import IOEngine
from kvstream.io.rawread import RawResult, direct_io_problem, read_files, read_tiers_concurrently, write_files
from kvstream.tiers.mounts import discard_note, mount_source

__all__ = ["register", "parse_size", "probe", "same_device_warnings", "disks_behind"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``4M``, ``48M``, ``256K``, ``1G``, ``4MiB`` or plain bytes -> bytes (binary units)."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    num, unit = (t[:-1], t[-1]) if t and t[-1] in _UNITS else (t, "")
    try:
        value = float(num) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4M, 48M, 256K, 1G)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"size must be a positive whole number of bytes, got {text!r}")
    return int(value)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "probe",
        help="measure each tier's read/write bandwidth, aggregate read bandwidth and per-chunk latency",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="a folder on each tier to probe")
    p.add_argument("--size", type=parse_size, default=4 << 20, help="bytes per file = per chunk read (default 4M)")
    p.add_argument("--total", type=parse_size, default=512 << 20, help="bytes of test files per tier (default 512M)")
    p.add_argument("--depth", type=positive_int, default=16, help="ops in flight per ring (default 16)")
    p.add_argument("--engine", choices=["auto", "uring", "threads"], default="auto", help="I/O engine (default auto)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    if args.size % ALIGN:
        raise UsageError(f"--size must be a multiple of {ALIGN} bytes for O_DIRECT, got {args.size}")
    if args.total < args.size:
        raise UsageError(f"--total ({args.total} B) must be at least --size ({args.size} B)")
    if args.depth < 1:
        raise UsageError(f"--depth must be >= 1, got {args.depth}")
    paths = [Path(p) for p in args.paths]
    if len(set(map(os.path.realpath, paths))) != len(paths):
        raise UsageError("each PATH must be a different folder")
    engine = make_engine(args.engine)
    warnings = same_device_warnings(paths)
    for w in warnings:
        print(f"probe: warning: {w}", file=sys.stderr)
    with _progress(len(paths)) as step:
        report = probe(paths, file_bytes=args.size, total_bytes=args.total, depth=args.depth, engine=engine,
                       on_step=step)
    report["warnings"] = warnings
    # What the mount does to writes (kvstream.tiers.mounts.discard_note): a note, not a warning, since the figures
    # are what this mount gives; said once the folders proved usable (a bad PATH is a one-line error, nothing more).
    report["notes"] = notes = [n for n in (discard_note("tier folder", p) for p in paths) if n]
    for n in notes:
        print(f"probe: note: {n}", file=sys.stderr)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        _print_table(report)
    return 0


def _steps(n_paths: int) -> int:
    """Measurements :func:`probe` runs: write and read each tier, all tiers at once, each tier under writes."""
    return 3 * n_paths + 1


@contextmanager
def _progress(n_paths: int, stream: TextIO | None = None) -> Iterator[Callable[[str], None]]:
    """A callback for :func:`probe`'s ``on_step``: a rich progress bar (one step per measurement, with the
    elapsed time) on ``stream`` (stderr) when it is a terminal, else nothing (logs and pipes stay clean)."""
    stream = sys.stderr if stream is None else stream
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        yield lambda _what: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("probe: {task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(file=stream, force_terminal=True), transient=True) as bar:
        task = bar.add_task("starting", total=_steps(n_paths))
        started = False

        def step(what: str) -> None:
            nonlocal started
            bar.update(task, description=what, advance=1 if started else 0)  # the previous measurement is done
            bar.refresh()  # show the new measurement now, not at the next timed refresh
            started = True

        yield step
        bar.update(task, completed=_steps(n_paths), description="done")


# ── same device ────────────────────────────────────────────────────────────────────────────────────────────


def disks_behind(path: Path, *, sysfs: Path = Path("/sys"), _depth: int = 0) -> frozenset[str]:
    """The whole block devices (``nvme0n1``, ``sda``) that the file system holding ``path`` is stored on, through
    partitions, device-mapper/LVM and md (their ``slaves``) and loop devices (their backing file); empty when
    there is none to find (tmpfs, NFS, Lustre: no local block device) or sysfs does not say."""
    dev = os.stat(path).st_dev
    node = sysfs / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}"
    if not node.exists():  # an anonymous device number (btrfs, overlay, network): the mount source may name one
        src = mount_source(dev) if sysfs == Path("/sys") else None
        if not src or not src.startswith("/dev/"):
            return frozenset()
        try:
            rdev = os.stat(src).st_rdev
        except OSError:
            return frozenset()
        node = sysfs / "dev" / "block" / f"{os.major(rdev)}:{os.minor(rdev)}"
        if not node.exists():
            return frozenset()
    return _whole_disks(node.resolve(), sysfs, _depth)


def _whole_disks(d: Path, sysfs: Path, depth: int) -> frozenset[str]:
    if depth > 8:  # a loop file on a loop device on ...: stop somewhere
        return frozenset({d.name})
    slaves = d / "slaves"
    if slaves.is_dir() and any(slaves.iterdir()):  # dm, LVM, md: every device underneath
        return frozenset().union(*(_whole_disks(s.resolve(), sysfs, depth + 1) for s in slaves.iterdir()))
    backing = d / "loop" / "backing_file"
    if backing.is_file():  # a loop device: the disks of the file system its file lives on
        try:
            under = disks_behind(Path(backing.read_text().strip()).parent, sysfs=sysfs, _depth=depth + 1)
        except OSError:
            under = frozenset()
        return under or frozenset({d.name})
    if (d / "partition").exists():  # a partition: its disk is the parent folder
        return frozenset({d.parent.name})
    return frozenset({d.name})


def same_device_warnings(paths: list[Path], *, sysfs: Path = Path("/sys")) -> list[str]:
    """One line for each pair of ``paths`` that are on one file system or one disk (see the module docstring)."""
    info = []
    for p in paths:
        try:
            info.append((p, os.stat(p).st_dev, disks_behind(p, sysfs=sysfs)))
        except OSError:  # a missing folder is reported by the measurement itself, naming the path
            continue
    out = []
    what = ("so their 'all tiers at once' figure is one device's bandwidth shared, not two channels "
            "(give each tier's own mount)")
    for i, (a, dev_a, disks_a) in enumerate(info):
        for b, dev_b, disks_b in info[i + 1:]:
            if dev_a == dev_b:
                out.append(f"{a} and {b} are on the same file system (device {os.major(dev_a)}:{os.minor(dev_a)}), "
                           + what)
            elif disks_a & disks_b:
                out.append(f"{a} and {b} are on different file systems on the same disk "
                           f"({', '.join(sorted(disks_a & disks_b))}), " + what)
    return out


# ── measurement ────────────────────────────────────────────────────────────────────────────────────────────


def _check_folder(path: Path, need_bytes: int) -> Path:
    """Make the probe's own folder inside ``path``; every refusal is a UsageError naming the path."""
    if not path.exists():
        raise UsageError(f"{path}: no such folder")
    if not path.is_dir():
        raise UsageError(f"{path}: not a folder")
    try:
        free = shutil.disk_usage(path).free
    except OSError as exc:
        raise UsageError(f"{path}: cannot read free space: {exc.strerror}") from None
    if free < need_bytes:
        raise UsageError(f"{path}: {free >> 20} MiB free, the probe needs {need_bytes >> 20} MiB (lower --total)")
    try:
        work = Path(tempfile.mkdtemp(prefix=".kvstream-probe-", dir=path))
    except OSError as exc:
        why = "read-only file system" if exc.errno == errno.EROFS else exc.strerror
        raise UsageError(f"{path}: cannot create files there ({why})") from None
    problem = direct_io_problem(work)
    if problem is not None:
        shutil.rmtree(work, ignore_errors=True)
        raise UsageError(f"{path}: {problem}; the probe would measure nothing useful there")
    return work


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), q in [0, 100]."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def _latency_ms(r: RawResult) -> dict[str, float]:
    lat = sorted(r.latencies)
    return {"p50_ms": round(_percentile(lat, 50) * 1e3, 3), "p99_ms": round(_percentile(lat, 99) * 1e3, 3)}


def _gbps(r: RawResult) -> float:
    return round(r.gbps, 3)


def _mixed(files: list[Path], load: list[Path], file_bytes: int, depth: int, engine: IOEngine) -> dict[str, Any]:
    """Read ``files`` while a writer keeps overwriting ``load`` on the same tier; both rings at ``depth``."""
    stop = threading.Event()
    started = threading.Event()
    box: dict[str, Any] = {}

    def writer() -> None:
        try:
            started.set()
            box["write"] = write_files(load, file_bytes, engine=engine, depth=depth, until=stop, sync=False, label="probe-load")
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=writer, name="probe-write-load")
    t.start()
    started.wait()
    try:
        read = read_files(files, engine=engine, depth=depth, op_bytes=file_bytes, latencies=True, label="probe-mixed")
    finally:
        stop.set()
        t.join()
    if "error" in box:
        raise box["error"]
    w: RawResult = box["write"]
    return {"read_gbps": _gbps(read), **{f"read_{k}": v for k, v in _latency_ms(read).items()}, "write_gbps": _gbps(w)}


def probe(paths: list[Path], *, file_bytes: int, total_bytes: int, depth: int, engine: IOEngine,
          on_step: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run every measurement; returns the report (the JSON output). Removes its files whatever happens.
    ``on_step(what)`` is called as each of the ``3 * len(paths) + 1`` measurements starts."""
    step = on_step or (lambda _what: None)
    n = max(1, total_bytes // file_bytes)
    n_load = max(1, n // 2)
    need = (n + n_load) * file_bytes + (64 << 20)
    works: dict[str, Path] = {}
    try:
        for p in paths:
            works[str(p)] = _check_folder(p, need)
        files = {name: [w / f"chunk-{i:05d}.bin" for i in range(n)] for name, w in works.items()}
        report: dict[str, Any] = {
            "engine": engine.name,
            "file_bytes": file_bytes,
            "files_per_tier": n,
            "depth": depth,
            "tiers": {},
        }
        for name in works:
            step(f"writing {name}")
            w = write_files(files[name], file_bytes, engine=engine, depth=depth, label="probe-write")
            report["tiers"][name] = {"write_gbps": _gbps(w)}
        slowest = 0.0
        for name in works:
            step(f"reading {name}")
            r = read_files(files[name], engine=engine, depth=depth, op_bytes=file_bytes, latencies=True, label="probe-read")
            report["tiers"][name].update({"read_gbps": _gbps(r), **{f"read_{k}": v for k, v in _latency_ms(r).items()}})
            slowest = max(slowest, r.seconds)
        # All tiers for one common window (as long as the slowest tier's pass alone, 1-10 s): each tier's
        # bandwidth while the others read too, and their sum, the aggregate-bandwidth bound.
        window = min(max(slowest, 1.0), 10.0)
        step(f"reading all tiers at once for {window:.1f} s")
        agg = read_tiers_concurrently(files, engine=engine, depth=depth, op_bytes=file_bytes, seconds=window)
        for name, r in agg.tiers.items():
            report["tiers"][name]["read_in_aggregate_gbps"] = _gbps(r)
        alone = sum(t["read_gbps"] for t in report["tiers"].values())
        report["aggregate"] = {
            "window_s": round(window, 2),
            "read_gbps": round(agg.sum_gbps, 3),
            "sum_of_alone_gbps": round(alone, 3),
            "ratio_to_sum_of_alone": round(agg.sum_gbps / alone, 3) if alone else None,
        }
        for name, work in works.items():
            load = [work / f"load-{i:05d}.bin" for i in range(n_load)]
            step(f"reading {name} under a write load")
            report["tiers"][name]["under_write_load"] = _mixed(files[name], load, file_bytes, depth, engine)
        return report
    finally:
        for work in works.values():
            shutil.rmtree(work, ignore_errors=True)


# ── output ─────────────────────────────────────────────────────────────────────────────────────────────────


def _print_table(report: dict[str, Any]) -> None:
    """One column per tier (paths are long, tiers are few), one row per measurement."""
    from rich.table import Table

    tiers = report["tiers"]
    table = Table(
        title=f"kvstream probe: {report['files_per_tier']} files of {report['file_bytes'] >> 10} KiB per tier, "
        f"depth {report['depth']}, engine {report['engine']}, O_DIRECT"
    )
    table.add_column("measurement")
    for name in tiers:
        table.add_column(name, justify="right", overflow="fold")

    def row(label: str, fmt: Any) -> None:
        table.add_row(label, *(fmt(t) for t in tiers.values()))

    row("write GB/s, alone", lambda t: f"{t['write_gbps']:.2f}")
    row("read GB/s, alone", lambda t: f"{t['read_gbps']:.2f}")
    row("read ms per chunk P50 / P99, alone", lambda t: f"{t['read_p50_ms']:.1f} / {t['read_p99_ms']:.1f}")
    row(f"read GB/s, all tiers at once ({report['aggregate']['window_s']:.1f} s)", lambda t: f"{t['read_in_aggregate_gbps']:.2f}")
    row("read GB/s, under a write load", lambda t: f"{t['under_write_load']['read_gbps']:.2f}")
    row(
        "read ms per chunk P50 / P99, under writes",
        lambda t: f"{t['under_write_load']['read_p50_ms']:.1f} / {t['under_write_load']['read_p99_ms']:.1f}",
    )
    row("write GB/s of that load", lambda t: f"{t['under_write_load']['write_gbps']:.2f}")
    a = report["aggregate"]
    console = _console()
    console.print(table)
    ratio = a["ratio_to_sum_of_alone"]
    tail = f" = {ratio:.0%} of the sum of each tier alone ({a['sum_of_alone_gbps']:.2f} GB/s)" if ratio else ""
    console.print(f"all tiers read at once (sum of the column above, the aggregate-bandwidth bound): {a['read_gbps']:.2f} GB/s{tail}")
    for w in report.get("warnings", []):  # said on stderr at the start too; repeated beside the figure it qualifies
        console.print(f"warning: {w}")
    for n in report.get("notes", []):
        console.print(f"note: {n}")
