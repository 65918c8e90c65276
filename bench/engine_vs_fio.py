#!/usr/bin/env python3
"""Benchmark 1: the engine's raw O_DIRECT read bandwidth vs fio, on the same files, one tier (the root disk).

For each chunk size (default 4 MiB, 48 MiB, 256 KiB) and each of ``--runs`` rounds, the same data set is read
by fio (ioengine=io_uring, direct=1, same iodepth) and by kvstream's raw reader on both engines (uring and
threads); the order rotates each round so no reader always goes first. Reported per chunk size:

- median GB/s of each reader; the median of the per-round ratios engine/fio (paired: same round, same disk
  state), against the targets >= 95 % at 4 MiB and 48 MiB and >= 85 % at 256 KiB;
- CPU seconds per GB read (user + system of the reading process: ``time.process_time`` for the engines,
  fio's own usr/sys for fio), and the device's average request size (from /proc/diskstats).

Buffer memory decides the request size on this disk (see ``kvstream.io.rawread.advise_hugepages``), so each
round is run in two modes, the same for every reader: ``thp`` (engine buffers madvise(MADV_HUGEPAGE); fio's
malloc'd buffers the same through ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``) and ``4k`` (plain pages for all).

``--cpu-per-op`` instead measures µs of CPU per op for 4 KiB, 256 KiB and 4 MiB ops, both engines, with
O_DIRECT from the disk and with buffered reads served from the page cache (engine overhead alone).

Run it alone (benchmarks must not overlap): ``flock /tmp/kvs-bench.lock .venv/bin/python bench/engine_vs_fio.py``.
fio must be installed (``apt-get install -y fio``); without it the benchmark says so and exits 3.
The data set (3 GiB by default) is created under ``--dir`` and removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvstream.commands.probe import parse_size
from kvstream.io import make_engine
from kvstream.io.rawread import direct_io_problem, drop_page_cache, filesystem_type, read_files, write_files

MiB = 1 << 20
FILE_BYTES = 384 * MiB  # a multiple of every chunk size used: 256 KiB, 4 MiB, 48 MiB
TARGETS = {4 * MiB: 0.95, 48 * MiB: 0.95, 256 << 10: 0.85}
DEFAULT_DEPTH = {256 << 10: 32, 4 * MiB: 16, 48 * MiB: 4}


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= MiB else f"{n >> 10} KiB"


FIO_THP_ENV = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}  # glibc >= 2.35: malloc'd buffers get MADV_HUGEPAGE


def block_device(path: Path) -> str | None:
    """The /proc/diskstats name of the block device holding ``path`` (partition or whole disk)."""
    st = os.stat(path)
    link = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return link.resolve().name if link.exists() else None


def diskstats(dev: str | None) -> tuple[int, int]:
    """(reads completed, sectors read) of ``dev`` so far; zeros if unknown."""
    if dev:
        with open("/proc/diskstats") as f:
            for line in f:
                p = line.split()
                if p[2] == dev:
                    return int(p[3]), int(p[5])
    return 0, 0


def run_fio(files: list[Path], chunk: int, depth: int, thp: bool) -> dict[str, float]:
    cmd = [
        "fio", "--name=kvs-bound", "--ioengine=io_uring", "--direct=1", "--rw=read", f"--bs={chunk}",
        f"--iodepth={depth}", "--numjobs=1", "--file_service_type=sequential", "--output-format=json",
        "--filename=" + ":".join(str(f).replace(":", "\\:") for f in files),
    ]
    env = {**os.environ, **(FIO_THP_ENV if thp else {})}
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    seconds = job["read"]["runtime"] / 1000
    nbytes = job["read"]["io_bytes"]
    cpu = (job["usr_cpu"] + job["sys_cpu"]) / 100 * seconds
    return {"gbps": nbytes / seconds / 1e9, "cpu_s_per_gb": cpu / (nbytes / 1e9), "bytes": nbytes}


def run_engine(name: str, files: list[Path], chunk: int, depth: int, thp: bool) -> dict[str, float]:
    r = read_files(files, engine=make_engine(name), depth=depth, op_bytes=chunk, hugepages=thp, label=f"bench-{name}")
    return {"gbps": r.gbps, "cpu_s_per_gb": r.cpu_seconds_per_gb, "bytes": r.bytes}


def bandwidth(files: list[Path], chunks: list[int], depths: dict[int, int], runs: int, modes: list[str]) -> dict[str, object]:
    readers = ["fio", "uring", "threads"]
    total = len(files) * FILE_BYTES
    dev = block_device(files[0])
    report: dict[str, object] = {}
    for mode in modes:
        thp = mode == "thp"
        per_chunk: dict[str, object] = {}
        for chunk in chunks:
            depth = depths[chunk]
            rounds: list[dict[str, dict[str, float]]] = []
            for i in range(runs):
                order = readers[i % 3 :] + readers[: i % 3]  # rotate: nobody always goes first
                one: dict[str, dict[str, float]] = {}
                for reader in order:
                    before = diskstats(dev)
                    if reader == "fio":
                        res = run_fio(files, chunk, depth, thp)
                    else:
                        res = run_engine(reader, files, chunk, depth, thp)
                    after = diskstats(dev)
                    if res["bytes"] != total:
                        raise SystemExit(f"{reader} read {res['bytes']} bytes, expected {total}")
                    n_req = after[0] - before[0]
                    res["avg_request_kib"] = (after[1] - before[1]) * 512 / n_req / 1024 if n_req > 0 else float("nan")
                    one[reader] = res
                rounds.append(one)
                print(
                    f"  {mode:>3} {_fmt_size(chunk):>8} round {i + 1}/{runs}: "
                    + "  ".join(f"{r} {one[r]['gbps']:.3f} GB/s ({one[r]['avg_request_kib']:.0f} KiB req)" for r in readers),
                    file=sys.stderr,
                )
            entry: dict[str, object] = {"depth": depth, "rounds": rounds}
            for r in readers:
                entry[f"{r}_gbps"] = statistics.median(x[r]["gbps"] for x in rounds)
                entry[f"{r}_cpu_s_per_gb"] = statistics.median(x[r]["cpu_s_per_gb"] for x in rounds)
                entry[f"{r}_avg_request_kib"] = statistics.median(x[r]["avg_request_kib"] for x in rounds)
            for r in ("uring", "threads"):
                entry[f"{r}_over_fio"] = statistics.median(x[r]["gbps"] / x["fio"]["gbps"] for x in rounds)
            entry["target"] = TARGETS.get(chunk)
            per_chunk[str(chunk)] = entry
        report[mode] = per_chunk
    return report


def cpu_per_op(files: list[Path], runs: int) -> dict[str, object]:
    """µs of process CPU per op; O_DIRECT (device) and buffered from the page cache (engine alone)."""
    plan = {4096: 20_000, 256 << 10: 4_000, 4 * MiB: 500}
    out: dict[str, object] = {}
    for op, n_ops in plan.items():
        span = op * n_ops
        specs_files = []  # (path, bytes) slices of the data set covering span bytes
        left = span
        for f in files:
            take = min(left, FILE_BYTES)
            specs_files.append((f, take))
            left -= take
            if not left:
                break
        for direct in (True, False):
            for name in ("uring", "threads"):
                samples = []
                for _ in range(runs):
                    fds = [os.open(p, os.O_RDONLY | (os.O_DIRECT if direct else 0)) for p, _ in specs_files]
                    try:
                        pairs = [(fd, n) for fd, (_, n) in zip(fds, specs_files)]
                        if not direct:  # warm the page cache so the timed pass never touches the disk
                            read_files(pairs, engine=make_engine("threads"), depth=4, op_bytes=4 * MiB)
                        r = read_files(pairs, engine=make_engine(name), depth=16, op_bytes=op)
                    finally:
                        for fd in fds:
                            os.close(fd)
                    samples.append((r.cpu_seconds / r.ops * 1e6, r.ops / r.seconds))
                key = f"{_fmt_size(op)} {'O_DIRECT' if direct else 'page cache'} {name}"
                us = statistics.median(s[0] for s in samples)
                iops = statistics.median(s[1] for s in samples)
                out[key] = {"us_cpu_per_op": us, "ops_per_s": iops}
                print(f"  {key:>32}: {us:7.1f} µs CPU/op, {iops:9.0f} ops/s", file=sys.stderr)
        drop_page_cache(p for p, _ in specs_files)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/var/tmp", help="folder on the tier to test (default /var/tmp: the root disk)")
    ap.add_argument("--data", type=parse_size, default=8 * FILE_BYTES, help="data set size (default 3072M)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--chunks", default="4M,48M,256K", help="chunk sizes, comma separated")
    ap.add_argument("--depth", type=int, default=None, help="one iodepth for every chunk size (default: 32/16/4 for 256K/4M/48M)")
    ap.add_argument("--memory", default="thp,4k", help="buffer backing, comma separated: thp (huge pages, both sides), 4k")
    ap.add_argument("--cpu-per-op", action="store_true", help="measure µs of CPU per op instead of bandwidth")
    ap.add_argument("--json", type=Path, default=None, help="also write the full report here")
    args = ap.parse_args()

    fio = shutil.which("fio")
    if fio is None:
        print("engine_vs_fio: fio is not installed; install it with `apt-get install -y fio` and run again", file=sys.stderr)
        return 3
    problem = direct_io_problem(args.dir)
    if problem:
        print(f"engine_vs_fio: {args.dir}: {problem}", file=sys.stderr)
        return 2
    if args.runs < 5 and not args.cpu_per_op:
        print("engine_vs_fio: note: fewer than 5 runs, medians are weak", file=sys.stderr)
    chunks = [parse_size(c) for c in args.chunks.split(",")]
    depths = {c: args.depth or DEFAULT_DEPTH.get(c, 16) for c in chunks}
    n_files = max(1, args.data // FILE_BYTES)
    fio_version = subprocess.run([fio, "--version"], capture_output=True, text=True).stdout.strip()

    work = Path(tempfile.mkdtemp(prefix="kvs-engine-vs-fio-", dir=args.dir))
    try:
        files = [work / f"data-{i}.bin" for i in range(n_files)]
        t0 = time.perf_counter()
        w = write_files(files, FILE_BYTES, engine=make_engine("auto"), depth=8, op_bytes=4 * MiB)
        print(
            f"data set: {n_files} x {_fmt_size(FILE_BYTES)} in {work} ({filesystem_type(work)}), written at "
            f"{w.gbps:.2f} GB/s in {time.perf_counter() - t0:.1f} s; {fio_version}; {os.cpu_count()} CPUs",
            file=sys.stderr,
        )
        report: dict[str, object] = {
            "dir": str(work), "filesystem": filesystem_type(work), "files": n_files, "file_bytes": FILE_BYTES,
            "fio": fio_version, "runs": args.runs, "kernel": os.uname().release,
        }
        if args.cpu_per_op:
            report["cpu_per_op"] = cpu_per_op(files, args.runs)
            print_cpu(report["cpu_per_op"])  # type: ignore[arg-type]
        else:
            modes = [m.strip() for m in args.memory.split(",")]
            if any(m not in ("thp", "4k") for m in modes):
                print(f"engine_vs_fio: --memory takes thp and/or 4k, got {args.memory!r}", file=sys.stderr)
                return 2
            report["bandwidth"] = bandwidth(files, chunks, depths, args.runs, modes)
            ok = True
            for mode, per_chunk in report["bandwidth"].items():  # type: ignore[union-attr]
                ok &= print_bandwidth(mode, per_chunk, args.runs)
            report["targets_met"] = ok
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=2))
        return 0 if report.get("targets_met", True) else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def print_bandwidth(mode: str, bw: dict[str, dict], runs: int) -> bool:
    backing = "2 MiB transparent huge pages (fio: GLIBC_TUNABLES=glibc.malloc.hugetlb=1)" if mode == "thp" else "4 KiB pages"
    print(f"\nbuffers on {backing}")
    print("| chunk | depth | fio GB/s | uring GB/s | uring/fio | target | threads GB/s | threads/fio | avg request KiB fio / uring / threads | CPU s/GB fio / uring / threads |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ok = True
    for chunk, e in bw.items():
        target = e["target"]
        met = target is None or e["uring_over_fio"] >= target
        ok &= met
        print(
            f"| {_fmt_size(int(chunk))} | {e['depth']} | {e['fio_gbps']:.3f} | {e['uring_gbps']:.3f} | "
            f"{e['uring_over_fio']:.1%} | {'≥ %d %%' % round(target * 100) if target else '-'} {'met' if met else 'MISSED'} | "
            f"{e['threads_gbps']:.3f} | {e['threads_over_fio']:.1%} | "
            f"{e['fio_avg_request_kib']:.0f} / {e['uring_avg_request_kib']:.0f} / {e['threads_avg_request_kib']:.0f} | "
            f"{e['fio_cpu_s_per_gb']:.3f} / {e['uring_cpu_s_per_gb']:.3f} / {e['threads_cpu_s_per_gb']:.3f} |"
        )
    print(f"medians of {runs} rounds; ratios are medians of per-round ratios (same round, same disk state)")
    return ok


def print_cpu(cpu: dict[str, dict]) -> None:
    print("\n| op size, source | uring µs CPU/op | threads µs CPU/op | uring ops/s | threads ops/s |")
    print("|---|---|---|---|---|")
    keys = list(dict.fromkeys(k.rsplit(" ", 1)[0] for k in cpu))  # measurement order: op size, then source
    for k in keys:
        u, t = cpu[f"{k} uring"], cpu[f"{k} threads"]
        print(f"| {k} | {u['us_cpu_per_op']:.1f} | {t['us_cpu_per_op']:.1f} | {u['ops_per_s']:.0f} | {t['ops_per_s']:.0f} |")


if __name__ == "__main__":
    sys.exit(main())
