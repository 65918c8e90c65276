"""``kvstream replay``: serve a workload with the real store on real directories and a modelled GPU's clock.

    kvstream replay                                  # nothing to prepare: long agent sessions, tiers in ./kvstream-out
    kvstream replay --preset agent-small             # the earlier default (a 1.5B model on an H100)
    kvstream replay --tier local=/nvme/kv --tier shared=/lustre/kv
    kvstream replay --trace conversation_trace.jsonl --instances 20 --limit 150 --speed 8   # one instance's share
    kvstream replay --crosscheck                     # also simulate the same run with the measured bandwidths

Each system runs the same requests from a cold, empty store: ``kvstream`` (KVStream's two-tier reads + Bidaw's
scheduling and hit-potential eviction; second copies of the share of each prefix the second tier can read,
``partial:F`` sized from the tiers' read bandwidths measured in the same run, full replication when the second
tier reads at least twice as fast as the first: :func:`kvstream.replication.partial_fraction`), ``kvstream-only``
(two tiers, meet-in-the-middle, full replication as the KVStream paper has it, FCFS, LRU),
``kvstream+compute`` (kvstream-only, and the modelled GPU recomputes each blocking load's front while the tiers
read its back, stopping where they meet: :mod:`kvstream.compute`; ``recompute-only`` and ``load-only`` are its
other baselines, by name),
``bidaw-only`` (one local tier, Bidaw's ready / preparing queues with disk-HRRN and its hit-potential eviction)
and ``lmcache-like`` (one local tier, one request's read after another, FCFS, LRU, writes flushed at once). Every
forward step waits its modelled time, so all storage time is real I/O. Prints a table, writes ``replay.png``
(TTFT CDFs, bytes per tier over time) and ``replay.json`` into ``--out``. Each row's load speed (GB/s: disk bytes
its loads read, over the time a load was reading) is printed beside the bound of the same run: the read bandwidth
of the tiers that system uses, measured through the store before the systems run (one tier alone; two tiers read
at once, :mod:`kvstream.commands._tier_probe`).

Why the default (``--preset agent-long``: Qwen2.5-14B on 2x A100, 5 GiB of GPU KV, 2 GiB of host memory, 12 GiB
per disk tier): it is the papers' setting, a model and context where reading a chunk clearly beats recomputing
it. A 48 MiB chunk of Qwen2.5-14B costs 26-41 ms to recompute at 4k-24k tokens of context on 2x A100 (the GPU
class of both papers' testbeds), and 15-17 ms to read at the 2.9-3.3 GB/s this project's VM reads through the
store (one tier / both): 1.5-2.7x, the range of KVStream's "up to 2.2x". The workload is a coding agent's: 6
interleaved sessions whose prompts grow from 5k to 14-18k tokens over a shared 2k-token system prompt, short
tool calls, 87 % of prompt chunks reused, about 11 GiB of KV (five times host memory), loads of hundreds of MB, 48 requests in one minute,
so the default systems' two rounds finish in about 9 minutes. Nothing in it is set per system: they share the workload,
GPU, memory sizes and tiers. The earlier default, ``--preset agent-small`` (Qwen2.5-1.5B on an H100, 7 MiB
chunks), stays available: there recomputing a chunk (2-3 ms) costs what reading it does (2.5 ms), disk loads
were ~15 % of TTFT, and a disk KV cache would not be worth having.

If the two tiers are on the same device no parallel gain is possible; replay says so and, unless
``--no-emulate``, puts the shared tier on a RAM-backed folder throttled to ``--emulate-gbps`` instead: an
EMULATED independent channel, labelled as such everywhere.

``--speed`` re-times the requests (arrival / speed) before the run: TTFT, queueing time and the scheduler's
waiting time all use the compressed arrival.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Required, TypedDict

from kvstream.commands._folder_removal import FolderRemoval, left_aside
from kvstream.commands._tier_probe import EMULATE_RATIO, measure_tiers
from kvstream.errors import NothingMeasuredError, UsageError
from kvstream.io.switch_interval import lower_switch_interval

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Sequence

    from rich.progress import Progress

    from kvstream.eviction import AccessMeta
    from kvstream.serving.core import ServingConfig
    from kvstream.serving.gpu import CostModel
    from kvstream.serving.metrics import RequestRecord
    from kvstream.sim.driver import SystemConfig
    from kvstream.serving.storebackend import ComputeSource
    from kvstream.store import Chunk, Store
    from kvstream.workload.request import Request

__all__ = ["register", "run_replay", "SYSTEMS", "disk_warning", "check_setup", "nothing_measured"]

SYSTEMS = ("kvstream", "kvstream-only", "kvstream+compute", "bidaw-only", "lmcache-like")
# The default comparison: the full system and its ablations, two tiers or one x Bidaw's scheduling or FCFS. Each
# runs --rounds times (about a minute a run): 2 rounds of 4 are `make demo` (598-601 s from a clean clone on the
# project VM, docs/bench/replay.md says where the time goes).
DEFAULT_SYSTEMS = ("kvstream", "kvstream-only", "bidaw-only", "lmcache-like")
# The other baselines of compute joins the meet-in-the-middle (kvstream.compute), by name only:
# ``--systems kvstream+compute,kvstream-only,recompute-only,load-only`` is that comparison.
COMPUTE_SYSTEMS = ("recompute-only", "load-only")
ALL_SYSTEMS = SYSTEMS + COMPUTE_SYSTEMS
REFERENCE = "kvstream"  # every other system is compared with it (a verdict per pair)
# Also compared, when both run: two tiers against one with the scheduling held equal (FCFS, LRU).
EXTRA_PAIRS = (("kvstream-only", "lmcache-like"),)

DEFAULT_PRESET = "agent-long"
# The model, GPU and memory sizes a workload is replayed with, unless --model/--gpu/--tp/--memory/--gpu-kv/
# --tier-capacity say otherwise. "agent-long" is the default (why: the module docstring); "agent-small" is the
# default of earlier versions (a 1.5B model, where recomputing a chunk costs about what reading it does), also
# used for every other preset and for --trace.
SETUPS: dict[str, dict[str, Any]] = {
    "agent-long": {"model": "qwen2.5-14b", "gpu": "a100", "tp": 2, "memory": "2GiB", "gpu_kv": "5GiB",
                   "tier_capacity": "12GiB"},
    "agent-small": {"model": "qwen2.5-1.5b", "gpu": "h100", "tp": 1, "memory": "256MiB", "gpu_kv": "1GiB",
                    "tier_capacity": "4GiB"},
}


def setup_for(preset: str | None) -> dict[str, Any]:
    """The replay set-up of a workload preset (``None``: a trace)."""
    return SETUPS.get(preset or "", SETUPS["agent-small"])


def _with_setup(args: argparse.Namespace) -> argparse.Namespace:
    """A copy of ``args`` whose set-up options left unset take the workload's set-up (:data:`SETUPS`)."""
    out = argparse.Namespace(**vars(args))
    setup = setup_for(None if getattr(args, "trace", None) else args.preset)
    for k, v in setup.items():
        if getattr(out, k, None) is None:
            setattr(out, k, v)
    return out


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvstream.commands._common import (gpu_name, gpu_names, model_name, model_names, nonnegative_int,
                                           positive_float, positive_int, preset_name, preset_names,
                                           size_text, switch_interval_ms)

    from kvstream.commands._common import plain

    why = next((para for para in (__doc__ or "").split("\n\n") if para.startswith("Why the default")), None)
    p = subparsers.add_parser("replay", help="serve a workload on the real store with a modelled GPU clock",
                              description=__doc__.split("\n\n")[0] if __doc__ else None,
                              epilog=plain(" ".join(why.split())) if why else None)
    p.add_argument("--trace", metavar="PATH", help="a Mooncake-format trace (default: a synthetic agent workload)")
    p.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests of the trace")
    p.add_argument("--instances", type=positive_int, default=1, metavar="K",
                   help="the trace is a cluster's: replay the share one instance of K gets from a session-affine "
                        "router (each session kept whole: its turns' reuse and timing stay; 1/K of the rate); "
                        "--limit then counts that share's requests (default: 1, the whole trace)")
    p.add_argument("--preset", type=preset_name, default=DEFAULT_PRESET, metavar="NAME",
                   help=f"synthetic workload preset: {', '.join(preset_names())}; it also sets the model, GPU and "
                        f"memory sizes below unless they are given (default: {DEFAULT_PRESET})")
    p.add_argument("--requests", type=positive_int, default=None,
                   help="synthetic: number of requests (default: the preset's; a small number may read no disk)")
    p.add_argument("--speed", type=positive_float, default=1.0, help="replay arrivals this many times faster")
    p.add_argument("--tier", action="append", default=[], metavar="NAME=PATH",
                   help="a tier folder (give two: local first, then shared); default: folders under --out")
    p.add_argument("--out", default="kvstream-out", help="folder for tiers (unless --tier) and results")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help=f"comma-separated subset of {', '.join(ALL_SYSTEMS)} (default: {', '.join(DEFAULT_SYSTEMS)})")
    p.add_argument("--rounds", type=positive_int, default=2,
                   help="run every system this many times, interleaved, the order rotated each round; the table "
                        "gives medians over rounds and, for each system against kvstream, the ratio of mean and P99 "
                        "TTFT with a bootstrap 95 %% interval and a verdict (ahead / level / behind). Two rounds keep "
                        "the default run within ten minutes; more narrow the intervals (BENCHMARKS uses 5) "
                        "(default: 2)")
    long_, small = SETUPS[DEFAULT_PRESET], SETUPS["agent-small"]

    def dflt(key: str) -> str:
        return f"(default: {long_[key]} with {DEFAULT_PRESET}, {small[key]} with the other presets and --trace)"

    p.add_argument("--model", type=model_name, default=None, metavar="NAME",
                   help=f"model whose KV size and compute are modelled: {', '.join(model_names())} {dflt('model')}")
    p.add_argument("--gpu", type=gpu_name, default=None, metavar="NAME",
                   help=f"modelled GPU: {', '.join(gpu_names())} {dflt('gpu')}")
    p.add_argument("--tp", type=positive_int, default=None, help=f"tensor-parallel GPUs per instance {dflt('tp')}")
    p.add_argument("--memory", type=size_text, default=None,
                   help=f"host-memory tier size (smaller than the workload's KV, so that disks are read) {dflt('memory')}")
    p.add_argument("--gpu-kv", type=size_text, default=None,
                   help="the modelled GPU's KV capacity (HBM prefix cache); small, so that reuse reaches the store "
                        + dflt("gpu_kv"))
    p.add_argument("--tier-capacity", type=size_text, default=None,
                   help=f"capacity of each disk tier {dflt('tier_capacity')}")
    p.add_argument("--emulate-gbps", type=positive_float, default=None,
                   help=f"bandwidth of an emulated shared tier, GB/s (default: the local tier's read bandwidth measured "
                        f"in round 1's probe over {EMULATE_RATIO:g}, the ratio of the papers' testbeds)")
    p.add_argument("--no-emulate", action="store_true", help="keep both tiers on their device even if it is the same")
    p.add_argument("--slo", type=positive_float, default=1.0, help="TTFT target for SLO attainment, seconds")
    p.add_argument("--crosscheck", action="store_true",
                   help="also simulate kvstream-only with the bandwidths this run measured, and compare")
    p.add_argument("--keep", action="store_true", help="keep the tier folders afterwards")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--switch-interval-ms", type=switch_interval_ms, default=0.0, metavar="MS",
                   help="lower Python's thread switch interval to this for the whole replay, probes included, as "
                        "the store's python_switch_interval_s does (a thread running Python halved a tier's reads "
                        "at the interpreter's 5 ms; inside the replay 1 ms changed nothing measurable: "
                        "BENCHMARKS §1.6); 0: leave it")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="seed of the synthetic workload")
    p.set_defaults(handler=_run)


# -- workload -------------------------------------------------------------------------------------------------
def _workload(args: argparse.Namespace) -> tuple[list[Request], str]:
    from kvstream.workload import generate, preset, read_mooncake
    from kvstream.workload.mooncake import one_instance_share

    if args.trace:
        if args.instances == 1:
            reqs = read_mooncake(args.trace, limit=args.limit)
            return reqs, f"trace {args.trace} ({len(reqs)} requests)"
        share = one_instance_share(read_mooncake(args.trace), args.instances)[:args.limit]
        return share, (f"trace {args.trace}, one instance's share of {args.instances} (sessions kept whole; "
                       f"{len(share)} requests)")
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
class _SystemSpec(TypedDict, total=False):
    """A compared system: how many tiers (the local one first), the store's policies, the serving loop."""

    tiers: Required[int]
    router: Required[str]  # "single": the first tier's single:NAME
    replication: Required[str]  # "measured": resolved by _replication from the tiers measured in the run
    memory_eviction: Required[str]
    serving: Required[ServingConfig]
    compute: bool  # the GPU recomputes each blocking load's front (kvstream.compute)
    read_disk: bool  # False: the tiers are written, never read (recompute-only)


def _system(name: str) -> _SystemSpec:
    """Store and serving-loop settings of each compared system. The Bidaw systems (``kvstream``, ``bidaw-only``)
    run both halves of Bidaw: its scheduler and its hit-potential host-memory eviction (reads carry each
    request's session, turn, previous answer length and chunk positions); the others evict LRU, as LMCache does."""
    from kvstream.serving.core import ServingConfig

    if name == "kvstream":
        # "measured": partial:F sized from the tiers' read bandwidths measured in the same run
        # (kvstream.replication.partial_fraction; full when the second tier reads at least twice as fast).
        return {"tiers": 2, "router": "mitm", "replication": "measured", "memory_eviction": "hit-potential",
                "serving": ServingConfig(admit="ready", prefetch="hrrn")}
    if name == "kvstream-only":
        return {"tiers": 2, "router": "mitm", "replication": "full", "memory_eviction": "lru",
                "serving": ServingConfig()}
    if name == "bidaw-only":
        return {"tiers": 1, "router": "single", "replication": "single", "memory_eviction": "hit-potential",
                "serving": ServingConfig(admit="ready", prefetch="hrrn")}
    if name == "lmcache-like":
        return {"tiers": 1, "router": "single", "replication": "single", "memory_eviction": "lru",
                "serving": ServingConfig(load_mode="request", defer_writes=False)}
    # The compute comparison (kvstream.compute): kvstream-only, and the GPU recomputing each blocking load's
    # front while the tiers read its back; recompute-only (the tiers are written, never read); load-only (one
    # local tier, step loads: Cake's loading baseline).
    if name == "kvstream+compute":
        return {"tiers": 2, "router": "mitm", "replication": "full", "memory_eviction": "lru",
                "serving": ServingConfig(compute=True), "compute": True}
    if name == "recompute-only":
        return {"tiers": 2, "router": "mitm", "replication": "full", "memory_eviction": "lru",
                "serving": ServingConfig(), "read_disk": False}
    if name == "load-only":
        return {"tiers": 1, "router": "single", "replication": "single", "memory_eviction": "lru",
                "serving": ServingConfig()}
    raise UsageError(f"unknown system {name!r}; known: {', '.join(ALL_SYSTEMS)}")


class _LoadProbe:
    """The store as the replay backend sees it, recording each load's read
    (``read_chunks`` call) that reached a disk tier: its wall seconds and, per tier, the busy seconds (time with a
    read in flight), bytes and chunks its step added to the tier's counters, and the seconds of the load during which the tier had copies being written (``write_s``: what
    :func:`device_as_seen` separates the tier's read rate beside its writes from its rate without them by, and
    :func:`in_run_bound` weighs the round's probes with). A
    catch-up read step ending during a load is counted in that load (the two share the tier anyway). The replay's
    backend's loads read through :meth:`read_chunks` (``StoreBackend(read=...)``); the rest of it uses the store."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.loads: list[dict[str, Any]] = []

    def _counters(self) -> list[tuple[float, int, int, float]]:
        writing = self._store.write_busy_seconds()
        return [(t.counters.read_busy_s, t.counters.read_bytes, t.counters.read_chunks, writing[t.name])
                for t in self._store.tiers]

    def read_chunks(self, keys: Sequence[bytes], *, metas: Sequence[AccessMeta | None] | None = None,
                    compute: ComputeSource | None = None, background: bool = False
                    ) -> Iterator[tuple[int, Chunk | None]]:
        """:meth:`Store.read_chunks`, recording the load if it read a disk tier."""
        c0 = self._counters()
        t0 = time.perf_counter()
        try:
            yield from self._store.read_chunks(keys, metas=metas, compute=compute, background=background)
        finally:
            dur = time.perf_counter() - t0
            c1 = self._counters()
            if any(b[1] > a[1] for a, b in zip(c0, c1)):
                self.loads.append({"s": dur, "busy_s": [b[0] - a[0] for a, b in zip(c0, c1)],
                                   "bytes": [b[1] - a[1] for a, b in zip(c0, c1)],
                                   "chunks": [b[2] - a[2] for a, b in zip(c0, c1)],
                                   "write_s": [b[3] - a[3] for a, b in zip(c0, c1)]})


def _run_one(name: str, reqs: list[Request], tiers: list[tuple[str, Path]], args: argparse.Namespace, *,
             emulated: bool, progress: Progress | None, cost: CostModel, measured: dict[str, dict[str, float]],
             removal: FolderRemoval, label: str | None = None) -> dict[str, Any]:
    """One system's run on fresh tier folders. What ``removal`` holds (the previous run's folders, a probe's) is
    deleted while this run opens its store and makes its host memory resident; the run waits for that before its
    clock starts, and hands its own folders to ``removal`` to hold when it ends
    (:mod:`kvstream.commands._folder_removal`)."""
    from kvstream.config import parse_size
    from kvstream.io import make_engine
    from kvstream.serving.core import ServingCore
    from kvstream.serving.metrics import summarize
    from kvstream.serving.realtime import RealtimeDriver
    from kvstream.io.throttle import ThrottledEngine
    from kvstream.serving.storebackend import StoreBackend, disk_load_gbps
    from kvstream.store import open_store

    t_enter = time.perf_counter()
    sysd = _system(name)
    use = tiers[: sysd["tiers"]]
    removal.begin()  # the previous run's folders go while this run sets up
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
        "replication": _replication(sysd["replication"], [measured[tname]["read_bw"] for tname, _ in use]),
        "memory_eviction": sysd["memory_eviction"],
        "create_dirs": True,
        "chunk_bytes": chunk_bytes,  # the store refuses, at open, a tier or host memory below one chunk
    }
    engine = make_engine("auto")
    if emulated and len(use) == 2:
        bw = args.emulate_gbps * 1e9
        engine = ThrottledEngine(engine, {f"{use[1][0]}-r": bw, f"{use[1][0]}-w": bw})
    store = open_store(cfg, engine=engine)
    config = store.config  # the one schema: what the store opened with is what the crosscheck's model derives from
    # Host memory resident before the first request, as a serving engine's pinned buffers are (Store.
    # prefault_memory): otherwise the run's largest load pays for first touching fresh memory.
    store.prefault_memory(chunk_bytes)
    probe = _LoadProbe(store)
    t_wait = time.perf_counter()
    removal.wait()  # the previous run's folders are gone: their deletion never overlaps this run's clock
    removal_wait_s = time.perf_counter() - t_wait
    compute = None
    if sysd.get("compute"):
        from kvstream.compute import ComputePolicy

        # Its prior: each tier's read bandwidth measured alone before the systems ran (as the simulator's
        # policy starts from its tiers' nominal bandwidth); the loads' own measurements take over.
        compute = ComputePolicy(n_tiers=len(use), bandwidth=[measured[tname]["read_bw"] for tname, _ in use])
    backend = StoreBackend(store, read=probe.read_chunks, model=cost.model.name, chunk_bytes=chunk_bytes,
                           compute=compute,
                           read_disk=sysd.get("read_disk", True))
    serving = dataclasses.replace(
        sysd["serving"], hbm_capacity_tokens=max(parse_size(args.gpu_kv, "--gpu-kv") // cost.kv_bytes_per_token, 1),
        # prefetched KV waits pinned in host memory, within what the puts leave (staging_budget_chunks)
        prefetch_budget_chunks=backend.staging_budget_chunks() if sysd["serving"].prefetch != "none" else None)
    core = ServingCore(cost, backend.lookup, serving, chunk_bytes=chunk_bytes, compute=compute)
    on_progress: Callable[[int, int], None] | None = None
    if progress is not None:
        bar, task = progress, progress.add_task(f"{label or name:17s}", total=len(reqs))

        def on_progress(done: int, n: int) -> None:
            bar.update(task, completed=done)

    drv = RealtimeDriver(core, backend, reqs, speed=args.speed, on_progress=on_progress)
    t0 = time.perf_counter()
    # Before the clock (the JSON's "before_clock_s", not in wall_s): setting up, and waiting beyond that for the
    # previous run's folders to be deleted (kvstream.commands._folder_removal): make demo's time between runs.
    before_clock = {"set_up": t0 - t_enter - removal_wait_s, "removal_wait": removal_wait_s}
    from kvstream.io.cpuprobe import ThreadCpuMeter

    meter = ThreadCpuMeter().start()
    # Where a run's wall time goes (the JSON's "phases_s"): serving the requests, then writing what host memory
    # still held, then closing (the catch-up pays owed copies there). make demo's time is their sum, eight times.
    phases: dict[str, float] = {}
    try:
        drv.run()
        phases["serve"] = time.perf_counter() - t0
        backend.sync()
        store.flush()
        store.drain(timeout=60)
        phases["drain"] = time.perf_counter() - t0 - phases["serve"]
        stats = store.stats()
        thread_cpu = meter.stop()
    finally:
        backend.close()
        store.close()
        wall = time.perf_counter() - t0
        # closing, and reading the run's stats and thread CPU just before it (14 ms once in CI): the phases add up
        # to the wall time exactly
        phases["close"] = wall - sum(phases.values())
        if not args.keep:
            removal.hold(run_dirs)  # deleted once the next run (or the report) begins, not beside a probe
    core.metrics.storage = {"write_amplification": stats.write_amplification,
                            **{f"read_bytes_{k}": v.read_bytes for k, v in stats.tiers.items()},
                            **{f"write_bytes_{k}": v.write_bytes for k, v in stats.tiers.items()},
                            **{f"write_skipped_backlog_{k}": v.write_skipped_backlog for k, v in stats.tiers.items()},
                            "computed_chunks": backend.computed_chunks}
    s = summarize(core.metrics, slo_s=args.slo)
    # Per-load read speed against the bound of the same run: disk bytes the loads (blocking and background
    # alike) brought, over the time a load was reading; the bound is this system's tiers' read bandwidth,
    # measured through the store before the systems ran, all of its tiers at once (tier_rates).
    gbps, load_busy, load_bytes = disk_load_gbps(backend.loads)
    bound = sum(r for r, _ in tier_rates([measured[tname] for tname, _ in use])) / 1e9
    # The same loads against the bound under this run's write load (in_run_bound: each load's write overlap, the
    # round's probe of the tiers beside their writes).
    bound_run, beside = in_run_bound(probe.loads, [measured[tname] for tname, _ in use])
    s.update({"load_gbps": gbps, "load_busy_s": load_busy, "load_disk_bytes": load_bytes,
              "loads_from_disk": sum(1 for lo in backend.loads if lo.disk_bytes > 0),
              "load_bound_gbps": bound, "load_of_bound": gbps / bound if bound > 0 else math.nan,
              "load_bound_in_run_gbps": bound_run,
              "load_of_bound_in_run": gbps / bound_run if bound_run > 0 else math.nan,
              "load_bytes_beside_writes": beside})
    return {
        "system": name, "replication": cfg["replication"], "wall_s": wall, "phases_s": phases,
        "before_clock_s": before_clock, "summary": s,
        "ttfts": sorted(r.ttft for r in core.metrics.requests if not math.isnan(r.first_token)),
        "ttft_by_request": _ttft_by_request(core.metrics.requests, reqs),
        "tier_series": core.metrics.tier_series, "lag_s": drv.lag_s,
        "tier_gbps": {k: v.read_gbps for k, v in stats.tiers.items()},
        "tier_stats": {k: {kk: getattr(v, kk) for kk in ("read_bytes", "read_busy_s", "write_bytes", "write_busy_s",
                                                  "write_gbps", "direct_io",
                                                  "read_latency_p50_s", "read_latency_p99_s",
                                                  "write_latency_p50_s", "write_latency_p99_s",
                                                  "read_chunks", "duplicate_chunks", "write_skipped_backlog")}
                       for k, v in stats.tiers.items()},
        "verify_s_per_chunk": stats.verify_seconds / max(stats.disk_hits, 1),
        "store_config": config,  # what the crosscheck's model runs the store's rules from (crosscheck_system)
        "load_steps": probe.loads,
        "thread_cpu": {k: {"cpu_s": v.cpu_s, "runq_s": v.runq_s} for k, v in sorted(thread_cpu.items())},
        "gil_wait_share": meter.gil_wait_share,
        "store_counters": {"puts": stats.puts, "verify_seconds": stats.verify_seconds, "disk_hits": stats.disk_hits,
                           "read_steps": stats.read_steps, "catch_up_reads": stats.catch_up_reads,
                           "catch_up_copies": stats.catch_up_copies},
        "put_s": backend.write_s, "puts_dropped_no_memory": stats.puts_dropped_no_memory,
        "steps_read_s": [st.load_s for st in core.metrics.steps if st.load_s > 0],
        "step_read_bytes": [st.load_bytes for st in core.metrics.steps if st.load_s > 0],
    }


def _ttft_by_request(records: list[RequestRecord], reqs: list[Request]) -> list[float]:
    """Each request's TTFT in the workload's order (what the verdicts pair across systems and rounds). A request
    that got no first token counts from its arrival to the run's last first token: a lower bound, never a gain."""
    by_id = {r.request_id: r for r in records}
    served = [r.first_token for r in records if not math.isnan(r.first_token)]
    end = max(served, default=0.0)
    out = []
    for q in reqs:
        r = by_id.get(q.request_id)
        out.append(r.ttft if r is not None and not math.isnan(r.first_token)
                   else max(end - (r.arrival if r is not None else q.arrival), 0.0))
    return out


# -- the command ----------------------------------------------------------------------------------------------
def _remove_stale_emulated_tiers(base: Path) -> None:
    """Remove the RAM folders of replays that were killed before their clean-up (each holds up to a tier's
    capacity in RAM: two left behind by killed runs filled /dev/shm and the next replay was OOM-killed). Each
    folder has a sibling ``<folder>.pid`` naming its replay; the folder is stale when that pid is not running.
    A folder without one (a replay still starting, or one from before this rule) is left alone."""
    for owner in base.glob("kvstream-replay-*.pid"):
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            folder = owner.with_suffix("")
            shutil.rmtree(folder, ignore_errors=True)
            owner.unlink(missing_ok=True)
            print(f"replay: removed {folder}, the emulated tier of a replay (pid {pid}) that is gone", file=sys.stderr)
        except PermissionError:
            continue  # another user's running process


def run_replay(args: argparse.Namespace) -> dict[str, Any]:
    from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape

    args = _with_setup(args)

    out = Path(args.out).resolve()  # tier folders must be absolute (StoreConfig); --out may be relative
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    for n in names:
        _system(n)
    reqs, wl_desc = _workload(args)
    cost = CostModel(get_gpu(args.gpu), get_model_shape(args.model), args.tp)
    check_setup(args, reqs, cost)  # before anything is made
    if args.switch_interval_ms:
        lower_switch_interval(args.switch_interval_ms / 1e3, by="--switch-interval-ms")
    out.mkdir(parents=True, exist_ok=True)
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
            _remove_stale_emulated_tiers(base)
            shm_dir = Path(tempfile.mkdtemp(prefix="kvstream-replay-", dir=base))
            shm_dir.with_name(shm_dir.name + ".pid").write_text(str(os.getpid()))
            tiers[1] = (tiers[1][0], shm_dir)
            emulated = True
            notes.append(f"Using an EMULATED shared tier instead: a RAM-backed folder ({shm_dir}) throttled to a set "
                         "bandwidth. Its bandwidth is set, not measured; pass --no-emulate to keep both tiers on the "
                         "one device, or --tier NAME=PATH for real mounts.")
    notes.extend(discard_notes(tiers))
    print(f"replay: {wl_desc}; {cost.model.name} on {args.tp}x {cost.gpu.name} (modelled), "
          f"{cost.model.chunk_bytes() / 2**20:.0f} MiB chunks, GPU KV {args.gpu_kv}, host memory {args.memory}; "
          f"arrivals x{args.speed}", file=sys.stderr)
    rounds: list[dict[str, Any]] = []
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    report_cc = None
    removal = FolderRemoval()

    def _note(text: str) -> None:  # in the JSON's notes, and said now
        notes.append(text)
        print(f"replay: {text}", file=sys.stderr)

    try:
        for note in notes:
            print(f"replay: {note}", file=sys.stderr)
        # Run folders a stopped replay renamed aside and never deleted (up to a tier's capacity each): deleted before
        # the first probe (which waits for them), never left to fill the disk run after run.
        stale = [p for _, base in tiers for p in left_aside(base, "replay-")]
        if stale:
            print(f"replay: deleting {len(stale)} run folder(s) an earlier replay left behind when it was stopped: "
                  + ", ".join(str(p) for p in stale), file=sys.stderr)
            removal.start(stale)
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from kvstream.commands._common import console
        from kvstream.io.cpuprobe import MachineLoad

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=False, disable=args.json, console=console(stderr=True)) as progress:
            for rnd in range(args.rounds):
                # Each round measures the tiers afresh (the bound its rows are compared with: each tier read alone
                # through the store) and runs every system once, the order rotated so that no system always runs
                # first, or right after the same neighbour.
                order = names[rnd % len(names):] + names[:rnd % len(names)]
                removal.quiet()  # the probes measure the devices: no deletion may be using them
                load = MachineLoad().start()
                # Mixed and joint too: the rows' in-run bound. Round 1 also sets the emulated tier's bandwidth
                # from the local tier's read rate unless --emulate-gbps gave it.
                measured = measure_tiers(tiers, args, cost.model.chunk_bytes(), emulated, hand_over=removal.hold,
                                         on_emulated=lambda local, gbps: _note(_emulated_note(local, gbps)))
                print(f"replay: round {rnd + 1}/{args.rounds}: {_probe_text(measured)}", file=sys.stderr)
                for n in order:
                    r = _run_one(n, reqs, tiers, args, emulated=emulated, progress=progress, cost=cost,
                                 measured=measured, removal=removal, label=f"{n} r{rnd + 1}" if args.rounds > 1 else n)
                    r["round"] = rnd
                    runs[n].append(r)
                rounds.append({"round": rnd, "order": order, "measured_read_gbps": {
                    k: v["read_bw"] / 1e9 for k, v in measured.items()}, "mixed_read_gbps": {
                    k: v["mixed_read_bw"] / 1e9 for k, v in measured.items()},
                    **({"joint_read_gbps": {k: v["joint_read_bw"] / 1e9 for k, v in measured.items()}}
                       if len(measured) > 1 else {}),
                    "machine": load.stop()})
        if args.crosscheck and runs.get("kvstream-only"):
            removal.wait()
            last = runs["kvstream-only"][-1]
            report_cc = _crosscheck(reqs, [last], args, cost, emulated, measured)
        # The last run's folders go while the results, verdicts and figure are made (all CPU, no device measured).
        removal.begin()
        results = [_merge_rounds(runs[n]) for n in names]
        # Every run of every round must have measured something (a system idle in one round is not rescued by a median).
        problem = nothing_measured([r for n in names for r in runs[n]], args)
        verdicts = compare_systems(runs, names) if not problem else []
        warning = None if problem else disk_warning(results, args)
        if warning:
            print(f"replay: warning: {warning}", file=sys.stderr)
        from kvstream.commands._common import run_meta

        report: dict[str, Any] = {
            **run_meta(),
            "error": problem,
            "warnings": [warning] if warning else [],
            "workload": wl_desc, "model": cost.model.name, "gpu": f"{args.tp}x {cost.gpu.name}",
            "chunk_bytes": cost.model.chunk_bytes(), "gpu_kv": args.gpu_kv, "memory": args.memory,
            "speed": args.speed, "notes": notes,
            "shared_tier": "emulated" if emulated else ("same-device" if same else "real"),
            "emulate_gbps": args.emulate_gbps if emulated else None,
            "python_switch_interval_s": sys.getswitchinterval(),
            "tiers": {t[0]: str(t[1]) for t in tiers},
            "measured_read_gbps": {k: statistics.median(r["measured_read_gbps"][k] for r in rounds)
                                   for k in (rounds[0]["measured_read_gbps"] if rounds else {})},
            "mixed_read_gbps": {k: statistics.median(r["mixed_read_gbps"][k] for r in rounds)
                                for k in (rounds[0]["mixed_read_gbps"] if rounds else {})},
            "joint_read_gbps": {k: statistics.median(r["joint_read_gbps"][k] for r in rounds)
                                for k in (rounds[0].get("joint_read_gbps") or {} if rounds else {})},
            "rounds": rounds,
            "verdicts": verdicts,
            "results": [{k: v for k, v in r.items() if k not in _BULKY} for r in results],
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
    finally:
        removal.wait()
        if shm_dir is not None:
            shutil.rmtree(shm_dir, ignore_errors=True)
            shm_dir.with_name(shm_dir.name + ".pid").unlink(missing_ok=True)
        if ours and not args.keep:
            shutil.rmtree(out / "tiers", ignore_errors=True)
    if problem:
        raise NothingMeasuredError(f"{problem} (results kept in {out / 'replay.json'})")
    return {"report": report, "results": results, "runs": runs}


# Per-run detail kept out of the JSON's rows (the figure and the crosscheck use it).
_BULKY = ("ttfts", "ttft_by_request", "tier_series", "steps_read_s", "step_read_bytes", "load_steps", "store_config")


def _merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One system's row from its rounds: the median of every number of the summary (and of the load speed and
    wall time) over the rounds, each round's own figures under ``rounds``, the TTFTs of all rounds (the CDF), and
    the last round's time series and store figures."""
    last = runs[-1]
    keys = [k for k, v in last["summary"].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    summary = dict(last["summary"])
    for k in keys:
        vals = [float(r["summary"][k]) for r in runs if isinstance(r["summary"].get(k), (int, float))]
        finite = [v for v in vals if not math.isnan(v)]
        summary[k] = statistics.median(finite) if finite else math.nan
    merged = dict(last)
    merged.update({
        "summary": summary, "wall_s": statistics.median(r["wall_s"] for r in runs),
        "ttfts": sorted(t for r in runs for t in r["ttfts"]),
        "rounds": [{"round": r.get("round", i), "replication": r["replication"], "wall_s": r["wall_s"],
                    "phases_s": r.get("phases_s"), "before_clock_s": r.get("before_clock_s"),
                    "summary": r["summary"], "tier_gbps": r["tier_gbps"], "thread_cpu": r.get("thread_cpu"),
                    "gil_wait_share": r.get("gil_wait_share"), "store_counters": r["store_counters"]}
                   for i, r in enumerate(runs)],
    })
    return merged


def compare_systems(runs: dict[str, list[dict[str, Any]]], names: list[str]) -> list[dict[str, Any]]:
    """A verdict per pair: every system against :data:`REFERENCE` (when it ran), and the :data:`EXTRA_PAIRS` that
    ran; for the mean and the P99 TTFT, the ratio (first over second: below 1, the first is faster), its paired
    two-level bootstrap 95 % interval over rounds and requests, and ahead / level / behind
    (:mod:`kvstream.benchmarks.verdict`)."""
    from kvstream.benchmarks.verdict import ratio_interval, resolution

    pairs = [(REFERENCE, n) for n in names if n != REFERENCE and REFERENCE in runs]
    pairs += [p for p in EXTRA_PAIRS if p[0] in runs and p[1] in runs and p not in pairs]
    out = []
    for a, b in pairs:
        k = min(len(runs[a]), len(runs[b]))
        ta = [r["ttft_by_request"] for r in runs[a][:k]]
        tb = [r["ttft_by_request"] for r in runs[b][:k]]
        if not k or not ta[0]:
            continue
        row: dict[str, Any] = {"system": a, "against": b}
        for stat in ("mean", "p99"):
            iv = ratio_interval(ta, tb, statistic=stat)
            row[stat] = iv.as_dict()
            if stat == "mean":
                effect = read_effect(runs[a][:k], runs[b][:k])
                if effect is not None:
                    row["resolution"] = resolution(iv, effect).as_dict()
        out.append(row)
    return out


def read_effect(runs_a: list[dict[str, Any]], runs_b: list[dict[str, Any]]) -> float | None:
    """The median over rounds of the share of B's TTFT that A's larger read bound removes directly, first order
    (:func:`kvstream.benchmarks.verdict.direct_read_effect`), or None when A reads no faster than B (the same
    tiers: the pair differs in scheduling, which this does not bound)."""
    from kvstream.benchmarks.verdict import direct_read_effect

    shares = []
    for ra, rb in zip(runs_a, runs_b):
        sa, sb = ra["summary"], rb["summary"]
        fast, slow = float(sa.get("load_bound_gbps") or 0.0), float(sb.get("load_bound_gbps") or 0.0)
        if not fast > slow * 1.05:
            return None
        shares.append(direct_read_effect(load_busy_s=float(sb.get("load_busy_s") or 0.0),
                                         ttft_sum_s=float(sb["ttft_mean_s"]) * float(sb["completed"]),
                                         bound_slow_gbps=slow, bound_fast_gbps=fast))
    return float(statistics.median(shares)) if shares else None


def check_setup(args: argparse.Namespace, reqs: Sequence[Request], cost: CostModel) -> None:
    """Refuse, before anything runs, a replay that could not measure what it reports (raises
    :class:`~kvstream.errors.NothingMeasuredError` naming the option): a workload without requests, or a disk tier
    (``--tier-capacity``) or host memory (``--memory``) that cannot hold one chunk of the model's KV (a tier
    below one chunk writes nothing, so every system would read nothing from it). ``args``: set-up filled in."""
    from kvstream.config import parse_size
    from kvstream.format import file_size

    if not reqs:
        where = f"the trace {args.trace}" if getattr(args, "trace", None) else f"the workload preset {args.preset!r}"
        raise NothingMeasuredError(f"{where} has no requests: there is nothing to replay (give a trace with at "
                                   "least one request)")
    chunk = cost.model.chunk_bytes()
    need = file_size(chunk)
    at_least = f"{-(-need // 2**20)}MiB"  # one chunk file, rounded up to a size one can type
    what = (f"one chunk of {cost.model.name}'s KV ({chunk / 2**20:.3g} MiB of payload, {need} B as a file with its "
            "header)")
    cap = parse_size(args.tier_capacity, "--tier-capacity")
    if cap < need:
        raise NothingMeasuredError(f"--tier-capacity {args.tier_capacity} ({cap} B) is below {what}: the disk tiers "
                                   f"could hold nothing, so no system would write or read them; give at least "
                                   f"{at_least}, better many chunks")
    mem = parse_size(args.memory, "--memory")
    if mem < need:
        raise NothingMeasuredError(f"--memory {args.memory} ({mem} B) is below {what}: host memory could not "
                                   f"stage a single chunk; give at least {at_least}")


def nothing_measured(results: list[dict[str, Any]], args: argparse.Namespace) -> str | None:
    """One line naming why the run measured nothing of what its table compares, or None. A replay compares
    systems serving from disk tiers, so it measured nothing when a system served no request, when a system wrote
    nothing to its disk tiers, or when no system that reads the tiers read anything from them (every hit came
    from GPU KV or host memory: :func:`disk_warning`'s cause, which alone stays a warning while another system
    read from disk). ``args``: replay's, set-up filled in."""
    idle = [r["system"] for r in results if r["summary"].get("completed", 0) == 0]
    if idle:
        return (f"{', '.join(idle)} served no request (none got its first token before the run ended), so the run "
                "measured nothing")
    unwritten = [r for r in results if sum(int(t.get("write_bytes", 0)) for t in r["tier_stats"].values()) == 0]
    if unwritten:
        r = unwritten[0]
        puts = (r.get("store_counters") or {}).get("puts")
        dropped = int(r.get("puts_dropped_no_memory") or 0)
        if puts == 0:
            why = "no request put a chunk (every prompt is shorter than one chunk of KV)"
        elif dropped:
            why = f"{dropped} puts were dropped for want of host memory (--memory {args.memory})"
        else:
            why = f"every copy was skipped (tier capacity --tier-capacity {args.tier_capacity})"
        return (f"{', '.join(x['system'] for x in unwritten)} wrote nothing to the disk tiers: {why}, so the run "
                "compares no disk tier")
    readers = [r for r in results if _system(r["system"]).get("read_disk", True)]
    if readers and disk_warning(readers, args) is not None and all(
            sum(v for k, v in r["summary"].items() if k.startswith("storage_read_bytes_")) == 0 for r in readers):
        return f"no system read from the disk tiers: {disk_warning(readers, args)}"
    return None


def disk_warning(results: list[dict[str, Any]], args: argparse.Namespace) -> str | None:
    """One line naming the systems that read nothing from the disk tiers (every hit came from GPU KV or host
    memory: the workload is too small for the memory sizes, and the row says nothing about the tiers), with the
    flag to change; None if every system read from disk. ``args``: replay's, set-up filled in (``_with_setup``)."""
    idle = [r["system"] for r in results
            if sum(v for k, v in r["summary"].items() if k.startswith("storage_read_bytes_")) == 0]
    if not idle:
        return None
    who = ", ".join(idle)
    if getattr(args, "trace", None):
        more = "replay more of the trace (--limit" + (f", now {args.limit})" if args.limit else ")")
    else:
        more = "give more requests (--requests" + (f", now {args.requests})" if args.requests else ")")
    return (f"{who} read nothing from disk: every hit was in GPU KV ({args.gpu_kv}) or host memory "
            f"({args.memory}), so the workload is too small for the tiers and the disk rows say nothing; "
            f"{more} or shrink host memory (--memory) and GPU KV (--gpu-kv)")


def _emulated_note(local: float, gbps: float) -> str:
    return (f"The emulated tier's bandwidth, {gbps} GB/s, is the local tier's read bandwidth measured in round 1 "
            f"({local / 1e9:.2f} GB/s) over {EMULATE_RATIO:g}, the ratio of the papers' testbeds; --emulate-gbps "
            "sets it.")


def _probe_text(measured: dict[str, dict[str, float]]) -> str:
    """One round's probe (:func:`~kvstream.commands._tier_probe.measure_tiers`) as one line of text."""
    def rates(key: str) -> str:
        return ", ".join(f"{k} {v[key] / 1e9:.2f}" for k, v in measured.items()) + " GB/s"

    text = (f"read bandwidth, each tier alone: {rates('read_bw')}; beside a burst of its own writes: "
            f"{rates('mixed_read_bw')}")
    if len(measured) > 1:
        # The bound the two-tier rows are held to (tier_rates: each joint figure capped at its alone one), not a
        # second sum of the raw joint figures that could print a bound no row uses.
        both = sum(q for q, _ in tier_rates(list(measured.values()))) / 1e9
        text += (f"; all at once: {rates('joint_read_bw')} (bound of all: {both:.2f} GB/s, against "
                 f"{sum(v['read_bw'] for v in measured.values()) / 1e9:.2f} summed alone)")
    return text


def _replication(spec: str, read_bws: list[float]) -> str:
    """A system's replication spec, ``measured`` resolved from its tiers' read bandwidths measured alone in this
    run (:func:`kvstream.replication.partial_fraction`): ``partial:F``, or ``full`` when F reaches 1."""
    if spec != "measured":
        return spec
    from kvstream.replication import partial_fraction

    f = partial_fraction(read_bws)
    return "full" if f >= 1.0 else f"partial:{f:.2f}"


def crosscheck_system(measured: dict[str, dict[str, float]], real: dict[str, Any]) -> SystemConfig:
    """The simulator's ``kvstream-only`` for the crosscheck: the store the replay opened (``real["store_config"]``),
    as the simulator models a store (:meth:`~kvstream.sim.driver.SystemConfig.from_store`), with the tiers'
    bandwidths measured through the store (alone and while writing, :func:`~kvstream.commands._tier_probe.measure_tiers`) and the consumer's
    check as the replay measured it (``real["verify_s_per_chunk"]``). So the model runs the store's own read and
    write rules:

    - each tier's claim window in bytes and the windows' floor, which also set the read-ahead bound: with 48 MiB
      chunks and 32 MiB windows a tier refills only after the consumer has checked what landed, so
    - the consumer's check of each chunk (header and checksum, seconds per chunk as measured) is on the path;
    - the write backlog valve: a second copy past the backlog is skipped and owed, and the catch-up reads it
      back from the other tier later (without it the model kept those chunks pinned in host memory, overflowing
      it, and served from memory what the store read from disk: BENCHMARKS §3.2);
    - each tier's capacity (``--tier-capacity``; the model's tiers were unlimited, so with 2 GiB tiers it read
      17 steps from disk where the store, having evicted, read one).

    While writes are in flight reads get the share they got in the mixed probe (no extra switching loss)."""
    from kvstream.serving.core import ServingConfig
    from kvstream.sim.driver import SystemConfig

    return SystemConfig.from_store(real["store_config"], measured, name="kvstream-only (sim)",
                                   serving=ServingConfig(), verify_s=float(real.get("verify_s_per_chunk", 0.0)))


def read_breakdown(loads: list[dict[str, Any]], names: list[str], alone: dict[str, float],
                   check_s_per_chunk: float) -> dict[str, Any]:
    """Where the loads' read time went, per tier, summed over the loads that read from disk (each a dict of ``s``,
    and per tier ``busy_s``, ``bytes``, ``chunks``; the replay's :class:`_LoadProbe` records, or the simulator's
    read steps): ``busy_s`` (the tier had a read in flight), ``at_alone_s`` (its bytes at the bandwidth measured
    alone), ``device_excess_s`` = busy - at alone (the device, or the threads reaping its completions, slower than
    alone: writes, catch-up reads back, other I/O, lost CPU), ``idle_s`` = load time - busy (opens, refills
    waiting for the consumer's check under the read-ahead bound, waiting for the other tier's last chunk at the
    meeting point); ``check_s``: the consumer's checks (header and checksum) of every chunk read."""
    load_s = sum(float(lo["s"]) for lo in loads)
    tiers: dict[str, dict[str, float]] = {}
    chunks = 0
    for k, name in enumerate(names):
        busy = sum(float(lo["busy_s"][k]) for lo in loads)
        nbytes = sum(float(lo["bytes"][k]) for lo in loads)
        chunks += sum(int(lo["chunks"][k]) for lo in loads)
        bw = alone.get(name, 0.0)
        at_alone = nbytes / bw if bw > 0 else math.nan
        tiers[name] = {"gb": nbytes / 1e9, "busy_s": busy, "at_alone_s": at_alone, "device_excess_s": busy - at_alone,
                       "idle_s": max(load_s - busy, 0.0), "busy_gbps": nbytes / busy / 1e9 if busy > 0 else 0.0}
    return {"loads": len(loads), "load_s": load_s, "tiers": tiers, "check_s": chunks * check_s_per_chunk}


def tier_rates(tiers: list[dict[str, float]]) -> list[tuple[float, float]]:
    """Per tier of a system, ``(quiet, beside writes)`` read rates (bytes/s) its loads are held to. One tier, or a
    probe without joint figures: the tier read alone and beside a burst of its own writes (``read_bw``,
    ``mixed_read_bw``; ``read_bw`` twice if there is no mixed figure). Several tiers: a multi-tier load reads them
    at once, and tiers that share a device or the CPUs slow each other, so the quiet rate is the tier's rate while
    all are read at once (``joint_read_bw``, :mod:`kvstream.commands._tier_probe`) and the rate beside writes is
    the alone one scaled by the same share (the probe does not read all tiers at once beside writes: see there).

    A joint figure is capped at the tier's alone figure: reading other tiers at the same time cannot make a tier
    faster, so a joint figure above it is the probe's noise."""
    alone = [(t["read_bw"], t.get("mixed_read_bw", t["read_bw"])) for t in tiers]
    if len(tiers) > 1 and all("joint_read_bw" in t for t in tiers):
        kept = [min(t["joint_read_bw"] / q, 1.0) if q > 0 else 1.0 for t, (q, _) in zip(tiers, alone)]
        return [(q * k, m * k) for (q, m), k in zip(alone, kept)]
    return alone


def discard_notes(tiers: list[tuple[str, Path]]) -> list[str]:
    """A note for each tier folder on a file system mounted with online ``discard``
    (:func:`kvstream.tiers.mounts.online_discard`): it explains a tier that writes, and reads beside its writes,
    slower than its probe alone suggests. The tiers are used as they are; nothing is changed."""
    from kvstream.tiers.mounts import discard_note

    return [n for n in (discard_note(f"tier '{name}'", folder) for name, folder in tiers) if n]


def in_run_bound(loads: list[dict[str, Any]], tiers: list[dict[str, float]]) -> tuple[float, float]:
    """The loads' bound under the run's own write load: ``(GB/s, share of the disk bytes read beside writes)``.

    Each load (:class:`_LoadProbe`: per tier its bytes and the seconds of the load the tier had copies being
    written, ``write_s``) could at best have read at the sum over its tiers of each tier's rate in its conditions:
    ``f x beside + (1 - f) x quiet``, where ``f`` is the share of the load's time that tier was writing and the
    two rates are the round's probe (:func:`tier_rates`: the tier alone and beside a burst of its own writes,
    for a multi-tier system scaled by the share of its rate it keeps while all its tiers are read at once),
    measured before the systems ran, independent of the loads. The run's bound is the
    loads' bytes over the time each would have taken at its bound (a bytes-weighted harmonic mean), so the loads'
    GB/s over it is the share of what the devices could give them under the same write load. ``(nan, nan)`` if no
    load read a disk tier, or a tier has no mixed probe.

    Why: the bound the table prints (each tier read alone, on a quiet device) overstates what a disk that is also
    writing can give. On this VM the local disk read 0.23-0.35 GB/s under a 0.25 GB/s write stream against 1.1-1.9
    alone (BENCHMARKS §3.1), and issue 20 asks for the loads against the bound measured under the same conditions.
    The serving thread's CPU is not in it (``bench/serving_bound.py`` measures that)."""
    if any("mixed_read_bw" not in t for t in tiers):
        return math.nan, math.nan
    rates = tier_rates(tiers)
    total = bound_time = beside = 0.0
    for lo in loads:
        bytes_k = [float(b) for b in lo["bytes"]][: len(tiers)]
        nbytes = sum(bytes_k)
        if nbytes <= 0 or float(lo.get("s") or 0.0) <= 0:
            continue
        rate = 0.0
        for k, (quiet, beside_writes) in enumerate(rates):
            f = _write_share(lo, k)
            rate += f * beside_writes + (1.0 - f) * quiet
            beside += f * bytes_k[k] if k < len(bytes_k) else 0.0
        total += nbytes
        bound_time += nbytes / rate
    if total <= 0 or bound_time <= 0:
        return math.nan, math.nan
    return total / bound_time / 1e9, beside / total


IN_RUN_OVERRUN = 1.05  # loads above this share of their in-run bound: the estimate, not the loads, is off


def above_in_run_bound(results: list[dict[str, Any]]) -> list[tuple[str, float]]:
    """``(system, share)`` for each system whose loads read faster than :func:`in_run_bound` allowed (more than
    :data:`IN_RUN_OVERRUN` of it). The in-run bound is an estimate: each tier's read rate beside a *burst* of its
    own writes, probed before the runs, weighed by the loads' time beside writes. On a disk that the loop's steadier
    writes slow less than the probe's burst (the project VM of 2026-12-07: up to 172 %), it understates what the
    devices gave, and the table must not let a share over 100 % read as a gain over a bound."""
    out = []
    for r in results:
        share = (r.get("summary") or {}).get("load_of_bound_in_run")
        if isinstance(share, (int, float)) and math.isfinite(share) and share > IN_RUN_OVERRUN:
            out.append((str(r.get("system")), float(share)))
    return out


def _write_share(load: dict[str, Any], k: int) -> float:
    """The share of a load's time (``s``) tier ``k`` had copies being written (``write_s``, :class:`_LoadProbe`),
    within [0, 1] (a stretch counted from before the load can exceed it); 0 for a load recorded without
    ``write_s`` or with no duration. What :func:`in_run_bound` and :func:`device_as_seen` weigh each load by."""
    dur = float(load["s"])
    written = load.get("write_s")
    if dur <= 0 or written is None:
        return 0.0
    return min(max(float(written[k]) / dur, 0.0), 1.0)


def device_as_seen(loads: list[dict[str, Any]], k: int) -> dict[str, float] | None:
    """Tier ``k``'s read rate as the replay's loads got it, without and beside its own writes: the fit of
    ``busy = bytes x (1 - f) / r + bytes x f / (r x share)`` over the loads that read from it, least squares on the
    busy seconds, where ``f`` is the share of a load's time the tier had copies being written (``write_s`` / ``s``,
    :class:`_LoadProbe`). ``read_bw`` = r, ``read_share`` = the rate beside writes over r (at most 1: the
    simulator's device gives reads that share of its time while writes are in flight); ``bytes_beside_writes``:
    the share of the bytes read while the tier was writing. One rate over all loads (``read_share`` 1) when the
    loads do not tell the two apart (less than a tenth of the bytes read on either side, or a fit that is not
    positive). None if the tier read nothing.

    Why: the model applies a tier's write interference only while that tier writes, so a single mean rate would
    spread over every load the slowdown of the loads that ran beside writes (on the default workload the local
    tier read 2-3 % of its bytes beside its writes, the emulated tier about 40 %; BENCHMARKS §3.2)."""
    import numpy as np

    rows = [(float(lo["bytes"][k]), float(lo["busy_s"][k]), _write_share(lo, k))
            for lo in loads if lo["bytes"][k] > 0 and lo["busy_s"][k] > 0]
    if not rows:
        return None
    b = np.array([r[0] for r in rows])
    busy = np.array([r[1] for r in rows])
    f = np.array([r[2] for r in rows])
    beside_share = float((b * f).sum() / b.sum())
    mean = {"read_bw": float(b.sum() / busy.sum()), "read_share": 1.0, "bytes_beside_writes": beside_share}
    alone, beside = b * (1 - f), b * f
    if alone.sum() < 0.1 * b.sum() or beside.sum() < 0.1 * b.sum():
        return mean
    (u, v), *_ = np.linalg.lstsq(np.stack([alone, beside], axis=1), busy, rcond=None)
    if u <= 0 or v <= 0:
        return mean
    return {"read_bw": float(1.0 / u), "read_share": float(min(u / v, 1.0)), "bytes_beside_writes": beside_share}


def _sim_run(reqs: list[Request], real: dict[str, Any], args: argparse.Namespace, measured: dict[str, dict[str, float]],
             chunk: int) -> dict[str, Any]:
    """One simulated ``kvstream-only`` run of the replay's requests with ``measured`` tier bandwidths and the store's
    rules as the replay ran them: its read time per step, mean TTFT, load speed and per-load tier log."""
    from kvstream.config import parse_size
    from kvstream.serving.storebackend import LoadRecord, disk_load_gbps
    from kvstream.sim.driver import Hardware, simulate

    sysc = crosscheck_system(measured, real)
    hw = Hardware(gpu=args.gpu, model=args.model, tp=args.tp, hbm_kv_bytes=parse_size(args.gpu_kv, "--gpu-kv"))
    scaled = [dataclasses.replace(r, arrival=r.arrival / args.speed) for r in reqs]
    sim = simulate([scaled], sysc, hw, seed=args.seed)
    logs = sim.read_logs[0] if sim.read_logs else []
    gbps, busy, nbytes = disk_load_gbps([LoadRecord(start=a, end=a + d, disk_bytes=u, memory_bytes=0, background=False)
                                         for a, d, _b, u, _t in logs])
    steps = [st for st in sim.nodes[0].steps if st.load_s > 0]
    loads = [{"s": d, "busy_s": list(b), "bytes": list(tb), "chunks": [x // chunk for x in tb]}
             for (_a, d, _b, _u, tb), b in zip(logs, sim.busy_logs[0] if sim.busy_logs else [])]
    return {"sysc": sysc, "read_time_per_step_s": sim.summary["read_time_per_step_s"],
            "ttft_mean_s": sim.summary["ttft_mean_s"], "steps": steps, "load_gbps": gbps, "load_s": busy,
            "load_disk_bytes": nbytes, "loads": loads, "storage": sim.nodes[0].storage}


def _rel(sim: float, real: float) -> float:
    return (sim - real) / real if real else math.nan


def _within(sim: dict[str, Any], real_rt: float, real_ttft: float) -> bool:
    """The issue's criterion: the read time per step and the mean TTFT both within 10 % of the replay's."""
    return (real_rt > 0 and real_ttft > 0 and abs(sim["read_time_per_step_s"] - real_rt) <= 0.10 * real_rt
            and abs(sim["ttft_mean_s"] - real_ttft) <= 0.10 * real_ttft)


def _crosscheck(reqs: list[Request], results: list[dict[str, Any]], args: argparse.Namespace, cost: CostModel,
                emulated: bool, measured: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Simulate kvstream-only on the same workload with the store's read and write rules
    (:func:`crosscheck_system`) and compare the read time per step and the mean TTFT (the issue's figures), and,
    since the two runs may read different steps, the load speed (disk bytes of the loads over the time a load was
    reading, the same definition on both sides). Where the replay's time went: :func:`read_breakdown`.

    Two models run. *Predicted*: each tier's bandwidth as measured through the store alone (and while writing) by
    :func:`~kvstream.commands._tier_probe.measure_tiers`, before the systems ran: the simulator as a user would run it. *Device as the replay saw
    it*: each tier's read rates as the replay's own loads got them, without and beside its writes
    (:func:`device_as_seen`), and its write rate as its writers got it, which takes the device's in-run speed out
    of the comparison and leaves the mechanisms (which steps read, the tier split, windows, checks, the backlog valve, the scheduler's queueing):
    the local disk of this VM is slower during the replay than in the probe by a varying amount the model cannot
    know of (BENCHMARKS §3.2)."""
    real = next((r for r in results if r["system"] == "kvstream-only"), None)
    if real is None:
        return {"error": "the crosscheck needs kvstream-only among --systems"}
    chunk = cost.model.chunk_bytes()
    names = list(measured)
    alone = {k: v["read_bw"] for k, v in measured.items()}
    pred = _sim_run(reqs, real, args, measured, chunk)
    sysc = pred["sysc"]
    real_rt = real["summary"]["read_time_per_step_s"]
    real_ttft = real["summary"]["ttft_mean_s"]
    real_steps = real["steps_read_s"]
    real_gbps = real["summary"].get("load_gbps", 0.0)
    replay_breakdown = read_breakdown(real.get("load_steps") or [], names, alone, sysc.verify_s)
    st = pred["storage"]
    out: dict[str, Any] = {
        "measured_gbps": {k: {kk: vv / 1e9 for kk, vv in v.items()} for k, v in measured.items()},
        "model": {"read_window_bytes": [t.read_window_bytes for t in sysc.tiers],
                  "read_window_floor_bytes": sysc.read_window_floor_bytes, "verify_s": sysc.verify_s,
                  "write_backlog_bytes": sysc.write_backlog_bytes},
        "replay_busy_gbps": real["tier_gbps"],
        "replay_steps_with_reads": len(real_steps), "sim_steps_with_reads": len(pred["steps"]),
        "replay_read_bytes_per_step": (sum(real["step_read_bytes"]) / len(real_steps)) if real_steps else 0,
        "sim_read_bytes_per_step": (sum(s.load_bytes for s in pred["steps"]) / len(pred["steps"]))
        if pred["steps"] else 0,
        "replay_read_time_per_step_s": real_rt, "sim_read_time_per_step_s": pred["read_time_per_step_s"],
        "difference": _rel(pred["read_time_per_step_s"], real_rt),
        "within_10_percent": _within(pred, real_rt, real_ttft),
        "replay_ttft_mean_s": real_ttft, "sim_ttft_mean_s": pred["ttft_mean_s"],
        "ttft_difference": _rel(pred["ttft_mean_s"], real_ttft),
        "replay_load_gbps": real_gbps, "sim_load_gbps": pred["load_gbps"],
        "replay_load_disk_bytes": real["summary"].get("load_disk_bytes", 0), "sim_load_disk_bytes": pred["load_disk_bytes"],
        "replay_load_s": real["summary"].get("load_busy_s", 0.0), "sim_load_s": pred["load_s"],
        "load_gbps_difference": _rel(pred["load_gbps"], real_gbps),
        "replay_catch_up_reads": (real.get("store_counters") or {}).get("catch_up_reads", 0),
        "replay_read_latency_s": {k: [v.get("read_latency_p50_s"), v.get("read_latency_p99_s")]
                                  for k, v in (real.get("tier_stats") or {}).items()},
        "sim_catch_up_reads": sum(v for k, v in st.items() if k.startswith("catch_up_reads_")),
        "sim_write_skipped_backlog": sum(v for k, v in st.items() if k.startswith("write_skipped_backlog_")),
        "replay_breakdown": replay_breakdown,
        "sim_breakdown": read_breakdown(pred["loads"], names, alone, sysc.verify_s),
        "shared_tier": "emulated" if emulated else "real",
    }
    fits = {name: device_as_seen(real.get("load_steps") or [], k) for k, name in enumerate(names)}
    seen = {name: fit for name, fit in fits.items() if fit is not None}
    if len(seen) == len(names):
        # Reads at the rates the replay's loads got, without and beside the tier's writes (device_as_seen);
        # writes at what the replay's writers got (bytes over the time the tier had copies unfinished; this
        # VM's disk writes at 0.35 or at 1.9 GB/s from one probe to the next).
        wrote = {k: float((real.get("tier_stats") or {}).get(k, {}).get("write_gbps") or 0.0) * 1e9 for k in names}
        as_seen = {k: {**m, "read_bw": seen[k]["read_bw"], "mixed_read_bw": seen[k]["read_bw"] * seen[k]["read_share"],
                       "write_bw": wrote[k] if wrote[k] > 0 else m["write_bw"]} for k, m in measured.items()}
        cal = _sim_run(reqs, real, args, as_seen, chunk)
        out["device_as_seen"] = {
            "read_gbps": {k: v["read_bw"] / 1e9 for k, v in seen.items()},
            "read_share_beside_writes": {k: v["read_share"] for k, v in seen.items()},
            "bytes_read_beside_writes": {k: v["bytes_beside_writes"] for k, v in seen.items()},
            "write_gbps": {k: as_seen[k]["write_bw"] / 1e9 for k in names},
            "steps_with_reads": len(cal["steps"]),
            "read_time_per_step_s": cal["read_time_per_step_s"],
            "difference": _rel(cal["read_time_per_step_s"], real_rt),
            "ttft_mean_s": cal["ttft_mean_s"], "ttft_difference": _rel(cal["ttft_mean_s"], real_ttft),
            "within_10_percent": _within(cal, real_rt, real_ttft),
        }
    return out


def _latency_text(cc: dict[str, Any], name: str) -> str:
    """The replay's read latency percentiles of a tier (a long tail of stalled reads shows here)."""
    lat = (cc.get("replay_read_latency_s") or {}).get(name)
    if not lat or lat[0] is None or lat[1] is None:
        return ""
    return f"; replay read latency p50 {1e3 * lat[0]:.0f} ms, p99 {1e3 * lat[1]:.0f} ms"


def crosscheck_lines(cc: dict[str, Any]) -> list[str]:
    """The crosscheck's steps, load speed and the read-time breakdown (replay vs simulator), as printed under the
    table."""
    out = [f"crosscheck: steps that read: replay {cc['replay_steps_with_reads']} x "
           f"{cc['replay_read_bytes_per_step'] / 1e9:.2f} GB, simulator {cc['sim_steps_with_reads']} x "
           f"{cc['sim_read_bytes_per_step'] / 1e9:.2f} GB (host memory and disk); load speed (disk bytes of the loads "
           f"over the time a load was reading): replay {cc['replay_load_gbps']:.2f} GB/s "
           f"({cc['replay_load_disk_bytes'] / 1e9:.1f} GB in {cc['replay_load_s']:.1f} s), simulator "
           f"{cc['sim_load_gbps']:.2f} GB/s ({cc['sim_load_disk_bytes'] / 1e9:.1f} GB in {cc['sim_load_s']:.1f} s): "
           f"{100 * cc['load_gbps_difference']:+.1f} %"]
    rb, sb = cc.get("replay_breakdown"), cc.get("sim_breakdown")
    if rb and sb and rb["loads"]:
        out.append(f"crosscheck: where the loads' time went (replay / simulator), {rb['load_s']:.1f} / "
                   f"{sb['load_s']:.1f} s over {rb['loads']} / {sb['loads']} loads; consumer checks "
                   f"{rb['check_s']:.1f} / {sb['check_s']:.1f} s; catch-up reads back "
                   f"{cc.get('replay_catch_up_reads', 0)} / {cc.get('sim_catch_up_reads', 0)} chunks")
        for name, r in rb["tiers"].items():
            m = sb["tiers"].get(name)
            if m is None:
                continue
            out.append(f"  {name}: {r['gb']:.1f} / {m['gb']:.1f} GB; busy {r['busy_s']:.1f} / {m['busy_s']:.1f} s "
                       f"({r['busy_gbps']:.2f} / {m['busy_gbps']:.2f} GB/s) = at the alone bandwidth "
                       f"{r['at_alone_s']:.1f} / {m['at_alone_s']:.1f} s + slower than alone "
                       f"{r['device_excess_s']:+.1f} / {m['device_excess_s']:+.1f} s; idle in loads "
                       f"{r['idle_s']:.1f} / {m['idle_s']:.1f} s" + _latency_text(cc, name))
    return out


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


_ROUNDS_HINT_MAX = 200  # past this the extrapolation from a few rounds says only "far more than can be run"
_NOISE_SHOWN_MAX = 10.0  # ±1000 %: an interval this wide (two rounds of a noisy pair) has no useful width


def _resolution_text(r: dict[str, Any] | None) -> str:
    """The table's ``read effect / noise`` cell. The JSON keeps the exact figures; the cell caps the two that
    two rounds can blow up (a bootstrap interval over two rounds can span 0.03-37, and the rounds it would take
    then extrapolate to millions), so the table never prints a figure with no meaning."""
    if not r:
        return "-"
    cmp = ">" if r["resolvable"] else "<"
    hw = r["half_width"]
    noise = f"±{100 * hw:.1f} %" if hw <= _NOISE_SHOWN_MAX else f"±>{100 * _NOISE_SHOWN_MAX:.0f} %"
    need = r["rounds_to_resolve"]
    if r["resolvable"] or need is None:
        tail = ""
    elif need <= _ROUNDS_HINT_MAX:
        tail = f" (~{need} rounds)"
    else:
        tail = f" (>{_ROUNDS_HINT_MAX} rounds)"
    return f"{100 * r['effect']:.1f} % {cmp} {noise}{tail}"


def _verdict_text(v: str) -> str:
    return {"ahead": "[green]ahead[/]", "behind": "[red]behind[/]"}.get(v, "level")


def _gbps_text(v: object) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _share_text(v: object) -> str:
    return f"{100 * v:.0f} %" if isinstance(v, (int, float)) and math.isfinite(v) else "-"


def _run(args: argparse.Namespace) -> int:
    res = run_replay(args)
    rep = res["report"]
    if args.json:
        print(json.dumps(rep, indent=1, default=str))
        return 0
    from rich.table import Table

    from kvstream.commands._common import console

    title = f"kvstream replay: real store, modelled GPU, median of {len(rep.get('rounds') or [])} round(s)" + (" — shared tier EMULATED" if rep["shared_tier"] == "emulated" else "")
    tab = Table(title=title)
    for col in ("system", "TTFT mean", "P50", "P90", "P99", f"SLO<={args.slo:g}s", "queue s", "queue len",
                "req/s", "load GB/s", "bound GB/s", "of bound", "in-run bound", "of it", "local GB", "shared GB",
                "write amp", "wall s"):
        tab.add_column(col, justify="right")
    for r in rep["results"]:
        s = r["summary"]
        rb = {k.removeprefix("storage_read_bytes_"): v for k, v in s.items() if k.startswith("storage_read_bytes_")}
        names = list(rb)
        tab.add_row(r["system"], f"{s['ttft_mean_s']:.3f}", f"{s['ttft_p50_s']:.3f}", f"{s['ttft_p90_s']:.3f}",
                    f"{s['ttft_p99_s']:.3f}", f"{100 * s['slo_attainment']:.0f} %", f"{s['queue_mean_s']:.3f}",
                    f"{s['queue_len_mean']:.2f}", f"{s['throughput_rps']:.2f}", f"{s['load_gbps']:.2f}",
                    f"{s['load_bound_gbps']:.2f}", f"{100 * s['load_of_bound']:.0f} %" if s["load_gbps"] else "-",
                    _gbps_text(s.get("load_bound_in_run_gbps")),
                    _share_text(s.get("load_of_bound_in_run")) if s["load_gbps"] else "-",
                    f"{rb.get(names[0], 0) / 1e9:.2f}" if names else "-",
                    f"{rb.get(names[1], 0) / 1e9:.2f}" if len(names) > 1 else "-",
                    f"{s.get('storage_write_amplification', 0):.2f}", f"{r['wall_s']:.0f}")
    con = console(min_width=190)
    con.print(tab)
    if rep.get("verdicts"):
        vt = Table(title=f"each pair over {len(rep.get('rounds') or [])} round(s): ratio of TTFT (below 1: the first is "
                         "faster), bootstrap 95 % interval, verdict")
        for col in ("system", "against", "mean TTFT ratio", "95 % interval", "mean", "P99 TTFT ratio",
                    "95 % interval", "P99", "read effect / noise"):
            vt.add_column(col, justify="right")
        for v in rep["verdicts"]:
            m, p = v["mean"], v["p99"]
            vt.add_row(v["system"], v["against"], f"{m['ratio']:.3f}", f"{m['low']:.3f}-{m['high']:.3f}",
                       _verdict_text(m["verdict"]), f"{p['ratio']:.3f}", f"{p['low']:.3f}-{p['high']:.3f}",
                       _verdict_text(p["verdict"]), _resolution_text(v.get("resolution")))
        con.print(vt)
        if any(v.get("resolution") for v in rep["verdicts"]):
            con.print("read effect: the share of the second system's mean TTFT that the first's larger read bound "
                      "removes directly (its load time x (1 - its bound / the first's bound), over its summed TTFT; "
                      "median of rounds; queueing can multiply it); noise: half the 95 % interval. Where the effect "
                      "is below the noise, a 'level' verdict is what this many rounds can tell (~N rounds would "
                      "resolve the direct effect).")
    for rd in rep.get("rounds") or []:
        mach = rd.get("machine") or {}
        others = mach.get("others_share")
        con.print(f"round {rd['round'] + 1}: order {', '.join(rd['order'])}; tiers alone " + ", ".join(
            f"{k} {v:.2f}" for k, v in rd["measured_read_gbps"].items()) + " GB/s; other work on the machine "
            + (f"{100 * others:.0f} % of its CPUs" if others is not None else "unknown")
            + f", load average {mach.get('loadavg_1m_start', 0):.1f} -> {mach.get('loadavg_1m_end', 0):.1f}")
    joint = rep.get("joint_read_gbps") or {}
    con.print("load GB/s: the bytes each system's loads (blocking and background) read from disk, over the time a "
              "load was reading; bound: the read bandwidth of the tiers it uses, measured through the store before "
              "the systems ran, one tier alone (" + ", ".join(
                  f"{k} {v:.2f}" for k, v in rep["measured_read_gbps"].items()) + " GB/s)"
              + (", two read at once (" + " + ".join(f"{k} {v:.2f}" for k, v in joint.items()) + " GB/s, each capped "
                 "at its alone rate)" if joint else "") + "; in-run bound: the same "
              "loads' best under the run's own write load (each load's share of time beside each tier's writes, "
              "and each tier's read rate beside a burst of its writes, probed each round: " + ", ".join(
                  f"{k} {v:.2f}" for k, v in rep["mixed_read_gbps"].items()) + " GB/s)")
    over = above_in_run_bound(rep["results"])
    if over:
        con.print("[yellow]note:[/] loads above their in-run bound (" + ", ".join(
            f"{n} {100 * v:.0f} %" for n, v in over) + "): that bound is an estimate from a burst of each tier's own "
            "writes, and this machine's disk read faster beside the run's own writes than beside that burst; there "
            "it understates what the devices gave, so compare those systems with 'of bound' instead")
    for n in rep["notes"]:
        con.print(f"[yellow]note:[/] {n}")
    if "crosscheck" in rep:
        cc = rep["crosscheck"]
        if "error" in cc:
            con.print(f"crosscheck: {cc['error']}")
        else:
            tiers_txt = ", ".join(f"{k} read {v['read_bw']:.2f} / write {v['write_bw']:.2f} / mixed read "
                                  f"{v['mixed_read_bw']:.2f} GB/s" for k, v in cc["measured_gbps"].items())
            con.print(f"crosscheck (kvstream-only), predicted from the tiers measured alone ({tiers_txt}): read "
                      f"time per step, replay {cc['replay_read_time_per_step_s']:.4f} s vs simulator "
                      f"{cc['sim_read_time_per_step_s']:.4f} s ({100 * cc['difference']:+.1f} %); mean TTFT replay "
                      f"{cc['replay_ttft_mean_s']:.3f} s vs simulator {cc['sim_ttft_mean_s']:.3f} s "
                      f"({100 * cc['ttft_difference']:+.1f} %): {'within' if cc['within_10_percent'] else 'NOT within'} 10 %")
            seen = cc.get("device_as_seen")
            if seen:
                rates = ", ".join(f"{k} read {v:.2f} (x{seen['read_share_beside_writes'][k]:.2f} beside its writes, "
                                  f"{100 * seen['bytes_read_beside_writes'][k]:.0f} % of its bytes read there) / "
                                  f"write {seen['write_gbps'][k]:.2f}"
                                  for k, v in seen["read_gbps"].items())
                con.print(f"crosscheck, the devices as the replay's loads saw them ({rates} GB/s): read time per step "
                          f"{seen['read_time_per_step_s']:.4f} s ({100 * seen['difference']:+.1f} %), mean TTFT "
                          f"{seen['ttft_mean_s']:.3f} s ({100 * seen['ttft_difference']:+.1f} %), "
                          f"{seen['steps_with_reads']} steps read: "
                          f"{'within' if seen['within_10_percent'] else 'NOT within'} 10 %")
            for line in crosscheck_lines(cc):
                con.print(line)
    figure = f"figure: {rep['figure']}; " if rep["figure"] else ""
    con.print(f"{figure}results: {Path(args.out) / 'replay.json'}")
    return 0
