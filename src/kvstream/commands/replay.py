"""``kvstream replay``: serve a workload with the real store on real directories and a modelled GPU's clock.

    kvstream replay                                  # nothing to prepare: a small agent workload, tiers in ./kvstream-out
    kvstream replay --tier local=/nvme/kv --tier shared=/lustre/kv
    kvstream replay --trace conversation_trace.jsonl --limit 300 --speed 20
    kvstream replay --crosscheck                     # also simulate the same run with the measured bandwidths

Each system runs the same requests from a cold, empty store: ``kvstream`` (KVStream's two-tier reads + Bidaw's
scheduling), ``kvstream-only`` (two tiers, meet-in-the-middle, FCFS), ``bidaw-only`` (one local tier, ready /
preparing queues with disk-HRRN) and ``lmcache-like`` (one local tier, one request's read after another,
FCFS, writes flushed at once). Every forward step waits its modelled time, so all storage time is real I/O.
Prints a table, writes ``replay.png`` (TTFT CDFs, bytes per tier over time) and ``replay.json`` into ``--out``.

If the two tiers are on the same device no parallel gain is possible; replay says so and, unless
``--no-emulate``, puts the shared tier on a RAM-backed folder throttled to ``--emulate-gbps`` instead: an
EMULATED independent channel, labelled as such everywhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvstream.errors import UsageError

__all__ = ["register", "run_replay", "SYSTEMS"]

SYSTEMS = ("kvstream", "kvstream-only", "bidaw-only", "lmcache-like")


def register(subparsers: argparse._SubParsersAction) -> None:
    from kvstream.commands._common import (gpu_name, gpu_names, model_name, model_names, nonnegative_int,
                                           positive_float, positive_int, preset_name, preset_names,
                                           size_text)

    p = subparsers.add_parser("replay", help="serve a workload on the real store with a modelled GPU clock",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--trace", metavar="PATH", help="a Mooncake-format trace (default: a synthetic agent workload)")
    p.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests of the trace")
    p.add_argument("--preset", type=preset_name, default="agent-small", metavar="NAME",
                   help=f"synthetic workload preset: {', '.join(preset_names())}")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="synthetic: number of requests (default: the preset's; a small number may read no disk)")
    p.add_argument("--speed", type=positive_float, default=1.0, help="replay arrivals this many times faster")
    p.add_argument("--tier", action="append", default=[], metavar="NAME=PATH",
                   help="a tier folder (give two: local first, then shared); default: folders under --out")
    p.add_argument("--out", default="kvstream-out", help="folder for tiers (unless --tier) and results")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated subset of {', '.join(SYSTEMS)}")
    p.add_argument("--model", type=model_name, default="qwen2.5-1.5b", metavar="NAME",
                   help=f"model whose KV size and compute are modelled: {', '.join(model_names())}")
    p.add_argument("--gpu", type=gpu_name, default="h100", metavar="NAME",
                   help=f"modelled GPU: {', '.join(gpu_names())}")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel GPUs per instance")
    p.add_argument("--memory", type=size_text, default="256MiB",
                   help="host-memory tier size (small, so that disks are read)")
    p.add_argument("--gpu-kv", type=size_text, default="1GiB",
                   help="the modelled GPU's KV capacity (HBM prefix cache); small, so that reuse reaches the store")
    p.add_argument("--tier-capacity", type=size_text, default="4GiB", help="capacity of each disk tier")
    p.add_argument("--emulate-gbps", type=positive_float, default=0.4, help="bandwidth of an emulated shared tier, GB/s")
    p.add_argument("--no-emulate", action="store_true", help="keep both tiers on their device even if it is the same")
    p.add_argument("--slo", type=positive_float, default=1.0, help="TTFT target for SLO attainment, seconds")
    p.add_argument("--crosscheck", action="store_true",
                   help="also simulate kvstream-only with the bandwidths this run measured, and compare")
    p.add_argument("--keep", action="store_true", help="keep the tier folders afterwards")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the synthetic workload")
    p.set_defaults(handler=_run)


# -- workload -------------------------------------------------------------------------------------------------
def _workload(args: argparse.Namespace) -> tuple[list[Any], str]:
    from kvstream.workload import generate, preset, read_mooncake

    if args.trace:
        reqs = read_mooncake(args.trace, limit=args.limit)
        return reqs, f"trace {args.trace} ({len(reqs)} requests)"
    spec = preset(args.preset)
    if args.requests:
        spec = spec.replace(n_requests=args.requests)
    reqs = generate(spec, args.seed)
    return reqs, (f"synthetic '{args.preset}': {len(reqs)} requests, {spec.active} interleaved sessions, "
                  f"reuse {spec.reuse}, CV {spec.cv}")


# -- tiers ----------------------------------------------------------------------------------------------------
def _tier_paths(args: argparse.Namespace, out: Path) -> tuple[list[tuple[str, Path]], bool]:
    """(name, folder) of the local and shared tier; True if the folders are under --out (ours to delete)."""
    if args.tier:
        from kvstream.config import parse_tier_specs

        specs = parse_tier_specs(args.tier, capacity_bytes=1)
        if len(specs) != 2:
            raise UsageError("--tier: give exactly two tiers, local first (e.g. --tier local=/nvme --tier shared=/pfs)")
        return [(s["name"], Path(s["path"]).resolve()) for s in specs], False
    return [("local", out / "tiers" / "local"), ("shared", out / "tiers" / "shared")], True


def _same_device(a: Path, b: Path) -> bool:
    a.mkdir(parents=True, exist_ok=True)
    b.mkdir(parents=True, exist_ok=True)
    return os.stat(a).st_dev == os.stat(b).st_dev


# -- systems --------------------------------------------------------------------------------------------------
def _system(name: str) -> dict[str, Any]:
    """Store and serving-loop settings of each compared system."""
    from kvstream.serving.core import ServingConfig

    if name == "kvstream":
        return {"tiers": 2, "router": "mitm", "replication": "full", "memory_eviction": "lru",
                "serving": ServingConfig(admit="ready", prefetch="hrrn")}
    if name == "kvstream-only":
        return {"tiers": 2, "router": "mitm", "replication": "full", "memory_eviction": "lru",
                "serving": ServingConfig()}
    if name == "bidaw-only":
        return {"tiers": 1, "router": "single", "replication": "single", "memory_eviction": "lru",
                "serving": ServingConfig(admit="ready", prefetch="hrrn")}
    if name == "lmcache-like":
        return {"tiers": 1, "router": "single", "replication": "single", "memory_eviction": "lru",
                "serving": ServingConfig(load_mode="request", defer_writes=False)}
    raise UsageError(f"unknown system {name!r}; known: {', '.join(SYSTEMS)}")


def _run_one(name: str, reqs: list[Any], tiers: list[tuple[str, Path]], args: argparse.Namespace, *,
             emulated: bool, progress: Any, cost: Any) -> dict[str, Any]:
    from kvstream.config import parse_size
    from kvstream.io import make_engine
    from kvstream.serving.core import ServingCore
    from kvstream.serving.metrics import summarize
    from kvstream.serving.realtime import RealtimeDriver
    from kvstream.io.throttle import ThrottledEngine
    from kvstream.serving.storebackend import StoreBackend
    from kvstream.store import open_store

    sysd = _system(name)
    use = tiers[: sysd["tiers"]]
    run_dirs = []
    for tname, base in use:
        d = base / f"replay-{name}"
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        run_dirs.append(d)
    chunk_bytes = cost.model.chunk_bytes()
    cap = parse_size(args.tier_capacity, "--tier-capacity")
    cfg = {
        "tiers": [{"name": tname, "path": str(d), "capacity_bytes": cap} for (tname, _), d in zip(use, run_dirs)],
        "memory_bytes": parse_size(args.memory, "--memory"),
        "router": sysd["router"] if sysd["router"] != "single" else f"single:{use[0][0]}",
        "replication": sysd["replication"],
        "memory_eviction": sysd["memory_eviction"],
        "create_dirs": True,
    }
    engine = make_engine("auto")
    if emulated and len(use) == 2:
        bw = args.emulate_gbps * 1e9
        engine = ThrottledEngine(engine, {f"{use[1][0]}-r": bw, f"{use[1][0]}-w": bw})
    store = open_store(cfg, engine=engine)
    backend = StoreBackend(store, model=cost.model.name, chunk_bytes=chunk_bytes)
    mem = parse_size(args.memory, "--memory")
    serving = dataclasses.replace(
        sysd["serving"], hbm_capacity_tokens=max(parse_size(args.gpu_kv, "--gpu-kv") // cost.kv_bytes_per_token, 1),
        # prefetched KV waits in staging buffers of the same size as the host-memory tier's half
        prefetch_budget_chunks=max(mem // chunk_bytes // 2, 1) if sysd["serving"].prefetch != "none" else None)
    core = ServingCore(cost, backend.lookup, serving, chunk_bytes=chunk_bytes)
    task = progress.add_task(f"{name:14s}", total=len(reqs)) if progress is not None else None
    drv = RealtimeDriver(core, backend, reqs, speed=args.speed,
                         on_progress=(lambda done, n: progress.update(task, completed=done)) if progress else None)
    t0 = time.perf_counter()
    try:
        drv.run()
        store.flush()
        store.drain(timeout=60)
        stats = store.stats()
    finally:
        backend.close()
        store.close()
        if not args.keep:
            for d in run_dirs:
                shutil.rmtree(d, ignore_errors=True)
    wall = time.perf_counter() - t0
    core.metrics.storage = {"write_amplification": stats["write_amplification"],
                            **{f"read_bytes_{k}": v["read_bytes"] for k, v in stats["tiers"].items()},
                            **{f"write_bytes_{k}": v["write_bytes"] for k, v in stats["tiers"].items()},
                            **{f"write_skipped_backlog_{k}": v["write_skipped_backlog"] for k, v in stats["tiers"].items()}}
    s = summarize(core.metrics, slo_s=args.slo)
    return {
        "system": name, "wall_s": wall, "summary": s, "ttfts": sorted(r.ttft for r in core.metrics.requests
                                                                          if not math.isnan(r.first_token)),
        "tier_series": core.metrics.tier_series, "lag_s": drv.lag_s,
        "tier_gbps": {k: v["read_gbps"] for k, v in stats["tiers"].items()},
        "tier_stats": {k: {kk: v[kk] for kk in ("read_bytes", "read_busy_s", "write_bytes", "direct_io",
                                                  "read_latency_p50_s", "read_latency_p99_s")}
                       for k, v in stats["tiers"].items()},
        "verify_s_per_chunk": stats["verify_seconds"] / max(stats["disk_hits"], 1),
        "steps_read_s": [st.load_s for st in core.metrics.steps if st.load_s > 0],
        "step_read_bytes": [st.load_bytes for st in core.metrics.steps if st.load_s > 0],
    }


# -- the command ----------------------------------------------------------------------------------------------
def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape

    out = Path(args.out).resolve()  # tier folders must be absolute (StoreConfig); --out may be relative
    out.mkdir(parents=True, exist_ok=True)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    for n in names:
        _system(n)
    reqs, wl_desc = _workload(args)
    cost = CostModel(get_gpu(args.gpu), get_model_shape(args.model), args.tp)
    tiers, ours = _tier_paths(args, out)
    same = _same_device(tiers[0][1], tiers[1][1])
    emulated = False
    notes = []
    shm_dir = None
    if same:
        notes.append(f"tiers '{tiers[0][0]}' ({tiers[0][1]}) and '{tiers[1][0]}' ({tiers[1][1]}) are on the SAME "
                     "device: reading both at once cannot be faster than reading one.")
        if not args.no_emulate:
            base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
            shm_dir = Path(tempfile.mkdtemp(prefix="kvstream-replay-", dir=base))
            tiers[1] = (tiers[1][0], shm_dir)
            emulated = True
            notes.append(f"Using an EMULATED shared tier instead: a RAM-backed folder ({shm_dir}) throttled to "
                         f"{args.emulate_gbps} GB/s. Its bandwidth is set, not measured; pass --no-emulate to keep "
                         "both tiers on the one device, or --tier NAME=PATH for real mounts.")
    for note in notes:
        print(f"replay: {note}", file=sys.stderr)
    print(f"replay: {wl_desc}; {cost.model.name} on {args.tp}x {cost.gpu.name} (modelled), "
          f"{cost.model.chunk_bytes() / 2**20:.0f} MiB chunks, GPU KV {args.gpu_kv}, host memory {args.memory}; "
          f"arrivals x{args.speed}", file=sys.stderr)
    results = []
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from kvstream.commands._common import console

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=False, disable=args.json, console=console(stderr=True)) as progress:
            for n in names:
                results.append(_run_one(n, reqs, tiers, args, emulated=emulated, progress=progress, cost=cost))
        report_cc = _crosscheck(reqs, results, args, cost, emulated, tiers) if args.crosscheck else None
    finally:
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
        if ours and not args.keep:
            shutil.rmtree(out / "tiers", ignore_errors=True)
    report: dict[str, Any] = {
        "workload": wl_desc, "model": cost.model.name, "gpu": f"{args.tp}x {cost.gpu.name}",
        "chunk_bytes": cost.model.chunk_bytes(), "gpu_kv": args.gpu_kv, "memory": args.memory,
        "speed": args.speed, "notes": notes,
        "shared_tier": "emulated" if emulated else ("same-device" if same else "real"),
        "tiers": {t[0]: str(t[1]) for t in tiers},
        "results": [{k: v for k, v in r.items() if k not in ("ttfts", "tier_series", "steps_read_s",
                                                             "step_read_bytes")} for r in results],
    }
    if report_cc is not None:
        report["crosscheck"] = report_cc
    from kvstream.commands._common import have

    png = out / "replay.png"
    if have("matplotlib"):
        _plot(results, png, emulated)
        report["figure"] = str(png)
    else:  # the core install has no plotting: the JSON and the table are the results, the figure is extra
        report["figure"] = None
        print("replay: figure skipped: matplotlib is not installed (pip install 'kvstream[plot]')", file=sys.stderr)
    (out / "replay.json").write_text(json.dumps(report, indent=1, default=str))
    return {"report": report, "results": results}


def _measure_tiers(tiers: list[tuple[str, Path]], args: argparse.Namespace, cost: Any, emulated: bool,
                   n: int = 40) -> dict[str, dict[str, float]]:
    """Each tier through the store, alone, independent of the workload: write bandwidth (``n`` chunks put and
    flushed), read bandwidth (read back in one step, host memory dropped), and read bandwidth while ``n`` more
    chunks are being written (the read/write interference the replay's deferred writes cause)."""
    import threading

    from kvstream.io import make_engine
    from kvstream.io.throttle import ThrottledEngine
    from kvstream.store import open_store

    chunk = cost.model.chunk_bytes()
    out: dict[str, dict[str, float]] = {}
    payload = bytes(chunk)
    for k, (name, base) in enumerate(tiers):
        d = base / "replay-probe"
        shutil.rmtree(d, ignore_errors=True)
        engine = make_engine("auto")
        if emulated and k == 1:
            bw = args.emulate_gbps * 1e9
            engine = ThrottledEngine(engine, {f"{name}-r": bw, f"{name}-w": bw})
        cap = (2 * n + 8) * (chunk + (1 << 20))
        store = open_store({"tiers": [{"name": name, "path": str(d), "capacity_bytes": cap}], "memory_bytes": cap,
                            "router": f"single:{name}", "replication": "single", "create_dirs": True}, engine=engine)
        try:
            keys = [f"probe-{i}".encode() for i in range(n)]
            t0 = time.perf_counter()
            for key in keys:
                store.put(key, payload)
            store.flush()
            store.drain(timeout=300)
            write_bw = n * chunk / (time.perf_counter() - t0)
            store.evict_memory()
            t0 = time.perf_counter()
            got = sum(1 for _, c in store.read_chunks(keys) if c is not None)
            read_bw = got * chunk / (time.perf_counter() - t0)
            store.evict_memory()

            def writer() -> None:
                for i in range(n):
                    store.put(f"probe-w{i}".encode(), payload)
                store.flush()

            th = threading.Thread(target=writer)
            th.start()
            time.sleep(0.02)
            t0 = time.perf_counter()
            got = sum(1 for _, c in store.read_chunks(keys) if c is not None)
            mixed_bw = got * chunk / (time.perf_counter() - t0)
            th.join()
            store.drain(timeout=300)
            out[name] = {"read_bw": read_bw, "write_bw": write_bw, "mixed_read_bw": mixed_bw}
        finally:
            store.close()
            shutil.rmtree(d, ignore_errors=True)
    return out


def _crosscheck(reqs: list[Any], results: list[dict[str, Any]], args: argparse.Namespace, cost: Any,
                emulated: bool, tiers_paths: list[tuple[str, Path]]) -> dict[str, Any]:
    """Simulate kvstream-only on the same workload with each tier's bandwidth measured through the store
    (alone, by :func:`_measure_tiers`), and compare the read time per step with the replay's."""
    from kvstream.config import parse_size
    from kvstream.serving.core import ServingConfig
    from kvstream.sim.driver import Hardware, SystemConfig, TierModel, simulate

    real = next((r for r in results if r["system"] == "kvstream-only"), None)
    if real is None:
        return {"error": "the crosscheck needs kvstream-only among --systems"}
    measured = _measure_tiers(tiers_paths, args, cost, emulated)
    # While writes are in flight reads get the share they got in the mixed probe (no extra switching loss).
    tiers = [TierModel(name=name, read_bw=m["read_bw"], write_bw=m["write_bw"], read_window=4,
                       read_share=min(m["mixed_read_bw"] / m["read_bw"], 1.0), interference=0.0)
             for name, m in measured.items()]
    # The store sizes its read windows by measured tier speed (read_windows: balanced): so does the model.
    sysc = SystemConfig(name="kvstream-only (sim)", tiers=tuple(tiers), router="mitm", replication="full",
                        serving=ServingConfig(), host_memory_bytes=parse_size(args.memory, "--memory"),
                        read_windows="balanced")
    hw = Hardware(gpu=args.gpu, model=args.model, tp=args.tp, hbm_kv_bytes=parse_size(args.gpu_kv, "--gpu-kv"))
    scaled = [dataclasses.replace(r, arrival=r.arrival / args.speed) for r in reqs]
    sim = simulate([scaled], sysc, hw, seed=args.seed)
    real_rt = real["summary"]["read_time_per_step_s"]
    sim_rt = sim.summary["read_time_per_step_s"]
    sim_steps = [st for st in sim.nodes[0].steps if st.load_s > 0]
    real_steps = real["steps_read_s"]
    return {
        "measured_gbps": {k: {kk: vv / 1e9 for kk, vv in v.items()} for k, v in measured.items()},
        "replay_busy_gbps": real["tier_gbps"],
        "replay_steps_with_reads": len(real_steps), "sim_steps_with_reads": len(sim_steps),
        "replay_read_bytes_per_step": (sum(real["step_read_bytes"]) / len(real_steps)) if real_steps else 0,
        "sim_read_bytes_per_step": (sum(st.load_bytes for st in sim_steps) / len(sim_steps)) if sim_steps else 0,
        "replay_read_time_per_step_s": real_rt, "sim_read_time_per_step_s": sim_rt,
        "difference": (sim_rt - real_rt) / real_rt if real_rt else math.nan,
        "within_10_percent": abs(sim_rt - real_rt) <= 0.10 * real_rt if real_rt else False,
        "shared_tier": "emulated" if emulated else "real",
    }


def _plot(results: list[dict[str, Any]], png: Path, emulated: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for r in results:
        t = np.array(r["ttfts"])
        if len(t):
            ax[0].plot(t, np.arange(1, len(t) + 1) / len(t), label=r["system"])
    ax[0].set_xscale("log")
    ax[0].set_xlabel("TTFT (s)")
    ax[0].set_ylabel("share of requests")
    ax[0].set_title("TTFT CDF (real I/O, modelled GPU)")
    ax[0].legend(fontsize=8)
    for k, r in enumerate(results):
        series = r["tier_series"]
        if not series:
            continue
        ts = [s[0] for s in series]
        keys = sorted({kk for _, d in series for kk in d if kk.endswith(".read")})
        for key in keys:
            ax[1].plot(ts, [d.get(key, 0) / 1e9 for _, d in series], color=f"C{k}",
                       ls="-" if key.startswith("local") else "--", label=f"{r['system']} {key}")
    ax[1].set_xlabel("time (s)")
    ax[1].set_ylabel("GB read (cumulative)")
    ax[1].set_title("bytes read per tier" + (" (shared tier EMULATED)" if emulated else ""))
    ax[1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _run(args: argparse.Namespace) -> int:
    res = run_replay(args)
    rep = res["report"]
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
        return 0
    from rich.table import Table

    from kvstream.commands._common import console

    title = "kvstream replay: real store, modelled GPU" + (" — shared tier EMULATED" if rep["shared_tier"] == "emulated" else "")
    tab = Table(title=title)
    for col in ("system", "TTFT mean", "P50", "P90", "P99", f"SLO<={args.slo:g}s", "queue s", "queue len",
                "req/s", "read/step s", "local GB", "shared GB", "write amp", "wall s"):
        tab.add_column(col, justify="right")
    for r in rep["results"]:
        s = r["summary"]
        rb = {k.removeprefix("storage_read_bytes_"): v for k, v in s.items() if k.startswith("storage_read_bytes_")}
        names = list(rb)
        tab.add_row(r["system"], f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                    f"{s['ttft_p99_s']:.3f}", f"{100 * s['slo_attainment']:.0f} %", f"{s['queue_mean_s']:.3f}",
                    f"{s['queue_len_mean']:.2f}", f"{s['throughput_rps']:.2f}", f"{s['read_time_per_step_s']:.3f}",
                    f"{rb.get(names[0], 0) / 1e9:.2f}" if names else "-",
                    f"{rb.get(names[1], 0) / 1e9:.2f}" if len(names) > 1 else "-",
                    f"{s.get('storage_write_amplification', 0):.2f}", f"{r['wall_s']:.0f}")
    con = console(min_width=170)
    con.print(tab)
    for n in rep["notes"]:
        con.print(f"[yellow]note:[/] {n}")
    if "crosscheck" in rep:
        cc = rep["crosscheck"]
        if "error" in cc:
            con.print(f"crosscheck: {cc['error']}")
        else:
            tiers_txt = ", ".join(f"{k} read {v['read_bw']:.2f} / write {v['write_bw']:.2f} / mixed read "
                                  f"{v['mixed_read_bw']:.2f} GB/s" for k, v in cc["measured_gbps"].items())
            con.print(f"crosscheck (kvstream-only): read time per step, replay {cc['replay_read_time_per_step_s']:.4f} s vs "
                      f"simulator {cc['sim_read_time_per_step_s']:.4f} s with the measured {tiers_txt}: "
                      f"{100 * cc['difference']:+.1f} % ({'within' if cc['within_10_percent'] else 'NOT within'} 10 %)")
    figure = f"figure: {rep['figure']}; " if rep["figure"] else ""
    con.print(f"{figure}results: {Path(args.out) / 'replay.json'}")
    return 0
