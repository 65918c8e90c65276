"""``kvstream bench read``: the store's multi-tier read beside the aggregate-bandwidth bound, same run."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvstream.config import parse_tier_specs

if TYPE_CHECKING:  # imported where used: `kvstream bench` loads the benchmark only when it runs
    from kvstream.benchmarks.read import ReadBenchConfig

__all__ = ["register"]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvstream.commands._common import nonnegative_float, nonnegative_int, positive_int, size_bytes

    bench = subparsers.add_parser("bench", help="benchmarks that print the bound they are compared with")
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True
    p = sub.add_parser("read", help="read N chunks from the tiers with a router; compare with the raw-reader bound")
    p.add_argument("--tier", action="append", required=True, metavar="NAME=PATH",
                   help="a tier folder (give two or more; the first is the primary). For one tier's raw "
                        "bandwidth use kvstream probe")
    p.add_argument("--chunks", type=positive_int, default=64, help="chunks in the step (default 64)")
    p.add_argument("--chunk-bytes", type=size_bytes, default=4 << 20, help="payload bytes per chunk (default 4M)")
    p.add_argument("--router", default="mitm", help="mitm | mitm:M | fixed:R | single:NAME (default mitm)")
    p.add_argument("--repeat", type=positive_int, default=5, help="measurements; medians are reported (default 5)")
    p.add_argument("--warmup", type=nonnegative_int, default=3,
                   help="untimed store reads before measuring (buffer pool first use, read windows; default 3)")
    p.add_argument("--engine", choices=["auto", "uring", "threads"], default="auto", help="I/O engine")
    p.add_argument("--inflight", type=size_bytes, default=None,
                   help="read bytes in flight per tier (default: depth x one chunk file, as the bound's raw reader)")
    p.add_argument("--depth", type=positive_int, default=16, help="ring depth per tier (default 16)")
    p.add_argument("--read-windows", choices=["balanced", "fixed"], default="balanced",
                   help="per-tier read windows sized by measured speed (balanced, default) or all --inflight")
    p.add_argument("--write-load", action="store_true", help="a concurrent write stream on the first tier")
    p.add_argument("--bandwidth-schedule", metavar="T=BPS,...",
                   help="throttle changes during each measurement, e.g. 0=400MB,0.3=150MB,0.6=400MB "
                        "(needs --throttle-control and --throttle-device, see bench/testbed)")
    p.add_argument("--throttle-control", default="/sys/fs/cgroup/blkio/kvstream-bench/blkio.throttle.read_bps_device",
                   help="the cgroup file the bandwidth schedule writes")
    p.add_argument("--throttle-device", help="MAJ:MIN of the throttled device (bench/testbed status prints it)")
    p.add_argument("--throttled-tier", help="name of the tier the schedule throttles (default: the last)")
    p.add_argument("--no-verify", action="store_true", help="skip payload checksums (to measure their cost)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(handler=_read)

    w = sub.add_parser("write", help="deferred replicated writes: throughput, bytes per tier, read/write interference")
    w.add_argument("--tier", action="append", required=True, metavar="NAME=PATH",
                   help="a tier folder (repeat for each tier)")
    w.add_argument("--chunks", type=positive_int, default=64, help="chunks written in part 1 (default 64)")
    w.add_argument("--chunk-bytes", type=size_bytes, default=4 << 20, help="payload bytes per chunk (default 4M)")
    w.add_argument("--replication", default="full", help="full | single | partial:F | lazy | selective")
    w.add_argument("--engine", choices=["auto", "uring", "threads"], default="auto", help="I/O engine")
    w.add_argument("--steps", type=positive_int, default=8, help="steps of the serving loop in part 2 (default 8)")
    w.add_argument("--read-chunks", type=positive_int, default=16, help="chunks read per step (default 16)")
    w.add_argument("--write-chunks", type=positive_int, default=4,
                   help="new chunks written per step (default 4; part 2 measures their interference with the reads)")
    w.add_argument("--compute-ms", type=nonnegative_float, default=100.0, help="modelled forward pass per step (default 100)")
    w.add_argument("--json", action="store_true", help="print JSON")
    w.set_defaults(handler=_write)


def _same_device(paths: list[str]) -> bool:
    devs = set()
    for p in paths:
        q = p
        while not os.path.exists(q):
            q = os.path.dirname(q) or "/"
        devs.add(os.stat(q).st_dev)
    return len(devs) < len(paths)


def _read(args: argparse.Namespace) -> int:
    from kvstream.benchmarks.read import BandwidthSchedule, ReadBenchConfig, run_read_bench
    from kvstream.errors import UsageError

    tiers = [(t["name"], t["path"]) for t in parse_tier_specs(args.tier, capacity_bytes=1)]
    if len(tiers) < 2:
        raise UsageError(f"needs two or more --tier NAME=PATH, got {len(tiers)} ({', '.join(n for n, _ in tiers)}); "
                         "it compares a multi-tier read with the tiers' aggregate bound. For one tier's raw "
                         "bandwidth and latency use `kvstream probe PATH`")
    if args.chunks < 1 or args.repeat < 1:
        raise UsageError("--chunks and --repeat must be at least 1")
    from kvstream.routing import parse_router

    parse_router(args.router, [n for n, _ in tiers], field_name="--router")  # a bad spec fails before any I/O
    if args.throttled_tier and args.throttled_tier not in [n for n, _ in tiers]:
        raise UsageError(f"--throttled-tier {args.throttled_tier!r} is not a tier; tiers: "
                         f"{', '.join(n for n, _ in tiers)}")
    sched = None
    if args.bandwidth_schedule:
        if not args.throttle_device:
            raise UsageError("--bandwidth-schedule needs --throttle-device MAJ:MIN")
        sched = BandwidthSchedule.parse(args.throttle_control, args.throttle_device, args.bandwidth_schedule)
    shared_dev = _same_device([p for _, p in tiers])
    if shared_dev and not args.json:
        print("note: these tier folders are on the same device, so reading them in parallel cannot beat one "
              "tier; use bench/testbed for an independent second channel.", file=sys.stderr)
    cfg = ReadBenchConfig(tiers=tiers, chunks=args.chunks, chunk_bytes=args.chunk_bytes, router=args.router,
                          repeat=args.repeat, io_engine=args.engine, inflight_bytes=args.inflight, depth=args.depth,
                          read_windows=args.read_windows, warmup=args.warmup,
                          write_load=args.write_load, bandwidth_schedule=sched,
                          scheduled_tier=args.throttled_tier or tiers[-1][0], verify=not args.no_verify)
    result = _run_with_progress(cfg, run_read_bench, quiet=args.json)
    result["tiers_share_a_device"] = shared_dev
    if args.json:
        result.pop("runs")
        print(json.dumps(result, indent=2))
    else:
        _print_read(result)
    return 0


def _run_with_progress(cfg: ReadBenchConfig, fn: Callable[..., dict[str, Any]], quiet: bool) -> dict[str, Any]:
    if quiet:
        return fn(cfg)
    from rich.progress import Progress

    from kvstream.commands._common import console

    with Progress(transient=True, console=console(stderr=True)) as prog:
        task = prog.add_task(f"bench read ({cfg.router})", total=cfg.repeat)
        return fn(cfg, progress=lambda done, total: prog.update(task, completed=done))


def _print_read(r: dict[str, Any]) -> None:
    from rich.table import Table

    from kvstream.commands._common import console

    gb = r["bytes"] / 1e9
    t = Table(title=f"bench read: {r['chunks']} × {r['chunk_bytes'] / 2**20:g} MiB = {gb:.2f} GB, router "
                    f"{r['router']}, engine {r['io_engine']}, {r['inflight_bytes'] / 2**20:g} MiB in flight per "
                    f"tier (raw reader: depth {r['depth']}), median of {r['repeat']}")
    for col in ("tier", "store bytes", "chunks", "duplicates", "store GB/s", "raw alone GB/s", "raw concurrent GB/s"):
        t.add_column(col, justify="right")
    for name, p in r["per_tier"].items():
        t.add_row(name, f"{p['bytes'] / 1e9:.3f} GB", str(p["chunks"]), str(p["duplicates"]), f"{p['gbps']:.3f}",
                  f"{r['tier_alone_gbps'][name]:.3f}", f"{p['raw_concurrent_gbps']:.3f}")
    con = console()
    con.print(t)
    con.print(f"store: {r['seconds']:.3f} s ({r['gbps']:.3f} GB/s)   bound: {r['bound_seconds']:.3f} s   "
              f"over bound: {r['over_bound'] * 100:+.1f} % (runs: "
              + ", ".join(f"{x * 100:+.1f}" for x in r["over_bound_runs"]) + ")")
    con.print(f"payload verification: {r['verify_seconds']:.3f} s of CPU in the read loop "
              f"({r['verify_seconds'] / max(r['seconds'], 1e-9) * 100:.1f} % of the read time)")


def _write(args: argparse.Namespace) -> int:
    from kvstream.benchmarks.write import WriteBenchConfig, run_write_bench

    from kvstream.replication import parse_replication

    tiers = [(t["name"], t["path"]) for t in parse_tier_specs(args.tier, capacity_bytes=1)]
    parse_replication(args.replication, field_name="--replication")  # a bad spec fails before any I/O
    cfg = WriteBenchConfig(tiers=tiers, chunks=args.chunks, chunk_bytes=args.chunk_bytes,
                           replication=args.replication, io_engine=args.engine, steps=args.steps,
                           read_chunks=args.read_chunks, write_chunks=args.write_chunks,
                           compute_s=args.compute_ms / 1000)
    r = run_write_bench(cfg)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    from rich.table import Table

    from kvstream.commands._common import console

    con = console()
    w = r["write"]
    t = Table(title=f"bench write: {cfg.chunks} × {cfg.chunk_bytes / 2**20:g} MiB, replication {cfg.replication}, "
                    f"engine {r['io_engine']}")
    for col in ("tier", "bytes written", "chunks", "raw concurrent write GB/s"):
        t.add_column(col, justify="right")
    for name, p in w["per_tier"].items():
        t.add_row(name, f"{p['bytes'] / 1e9:.3f} GB", str(p["chunks"]), f"{w['raw_concurrent_write_gbps'][name]:.3f}")
    con.print(t)
    con.print(f"all published in {w['seconds']:.3f} s; bound {w['bound_seconds']:.3f} s "
              f"({w['over_bound'] * 100:+.1f} %); write amplification {w['write_amplification']:.2f}")
    s = r["steps"]
    con.print(f"serving loop, {s['steps']} steps × ({s['read_chunks']} reads + {s['write_chunks']} writes), "
              f"{s['compute_s'] * 1000:g} ms compute: read time per step (median) alone "
              f"{s['alone']['read_seconds_per_step_median'] * 1000:.1f} ms, writes deferred "
              f"{s['deferred']['read_seconds_per_step_median'] * 1000:.1f} ms "
              f"({s['deferred_read_slowdown'] * 100:+.1f} % total), writes eager "
              f"{s['eager']['read_seconds_per_step_median'] * 1000:.1f} ms ({s['eager_read_slowdown'] * 100:+.1f} % total)")
    return 0
