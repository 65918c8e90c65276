"""Mean and tail TTFT of replay's four systems in the simulator, on the built-in workloads and the Mooncake traces:
what the wait bound (``ServingConfig.max_wait_s``) and the staging budget (``staging_budget_chunks``) cost and buy.

Each system is the simulator's copy of a ``kvstream replay`` system (same tiers, policies and serving loop; the
store's read windows, checks and write backlog valve as the cross-check models them, ``crosscheck_system``), on
the devices replay measures on this VM (local disk 2.6 GB/s read, 1.9 GB/s write, 1.2 GB/s read beside writes;
the emulated shared tier 0.4 GB/s), with each workload's replay set-up (model, GPU, host memory, GPU KV)::

    kvs-run .venv/bin/python bench/scheduler_tail.py                       # every workload, seeds 0-2
    kvs-run .venv/bin/python bench/scheduler_tail.py --workloads agent-long,starve --seeds 0,1,2,3,4
    kvs-run .venv/bin/python bench/scheduler_tail.py --max-wait inf        # Bidaw without the wait bound
    kvs-run .venv/bin/python bench/scheduler_tail.py --json out.json

Prints, per workload, the median over seeds of each system's mean, P50 and P99 TTFT, its worst TTFT, the puts
that found host memory all pinned (``storage_puts_no_room``: the store's put would have waited there) and the
requests served under the wait bound (``overdue_admits``). ``--max-wait`` and ``--staging`` override the two
settings for the Bidaw systems (``--staging half``: half of host memory, the earlier rule).

Workloads: the presets at their own size and set-up (``agent-long``: replay's default; the others with the
``agent-small`` set-up, as replay runs them; ``agent``, ``chat`` and ``documents`` cut to 500 requests),
``agent-long-20`` (its first 20 requests, the issue's run length) and the Mooncake traces with replay's ``--trace``
set-up (``mooncake-conv``, ``mooncake-syn``: the first 300 requests, at the trace's own pace, 20x faster as
``docs/bench/replay.md``'s example runs them, and slower, ``-x0.2`` to ``-x0.5``, where one modelled GPU keeps up
with them part of the time: at x1 and faster every system queues for minutes).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TRACES = Path(__file__).resolve().parents[2] / "shared" / "data" / "traces" / "mooncake"
SYSTEMS = ("kvstream", "kvstream-only", "bidaw-only", "lmcache-like")
FCFS_SYSTEMS = ("kvstream-only", "lmcache-like")
BIDAW_SYSTEMS = ("kvstream", "bidaw-only")


def _workloads() -> dict[str, tuple[Callable[[int], list[Any]], str | None, bool]]:
    """name -> (requests of a seed, replay set-up preset (None: a trace's), varies with the seed)."""
    from kvstream.workload import generate, preset, read_mooncake

    def p(name: str, n: int | None = None) -> Callable[[int], list[Any]]:
        def make(seed: int) -> list[Any]:
            spec = preset(name)
            return generate(spec.replace(n_requests=n) if n else spec, seed)
        return make

    def trace(name: str, speed: float) -> Callable[[int], list[Any]]:
        def make(seed: int) -> list[Any]:
            reqs = read_mooncake(str(TRACES / f"{name}_trace.jsonl"), limit=300)
            return [dataclasses.replace(r, arrival=r.arrival / speed) for r in reqs] if speed != 1 else reqs
        return make

    return {
        "agent-long": (p("agent-long"), "agent-long", True),
        "agent-long-20": (p("agent-long", 20), "agent-long", True),
        "agent-small": (p("agent-small"), "agent-small", True),
        "agent": (p("agent", 500), "agent-small", True),
        "chat": (p("chat", 500), "agent-small", True),
        "documents": (p("documents", 500), "agent-small", True),
        "mooncake-conv-x0.2": (trace("conversation", 0.2), None, False),
        "mooncake-conv-x0.3": (trace("conversation", 0.3), None, False),
        "mooncake-conv-x0.5": (trace("conversation", 0.5), None, False),
        "mooncake-conv": (trace("conversation", 1.0), None, False),
        "mooncake-conv-x20": (trace("conversation", 20.0), None, False),
        "mooncake-syn-x0.5": (trace("synthetic", 0.5), None, False),
        "mooncake-syn": (trace("synthetic", 1.0), None, False),
        "mooncake-syn-x20": (trace("synthetic", 20.0), None, False),
    }


def systems(memory: int, chunk: int, max_wait: float | None, staging: str | None) -> dict[str, Any]:
    """The simulator's copies of replay's systems (``kvstream.commands.replay._system``)."""
    from kvstream.config import StoreConfig, TierConfig
    from kvstream.replication import partial_fraction
    from kvstream.serving.core import ServingConfig
    from kvstream.sim.driver import SystemConfig

    measured = {"local": {"read_bw": 2.6e9, "write_bw": 1.9e9, "mixed_read_bw": 1.2e9},
                "shared": {"read_bw": 0.4e9, "write_bw": 0.4e9, "mixed_read_bw": 0.38e9}}
    # Replay's store: 32 MiB claim windows, the valve at half of host memory; no chunk size (window floor 0) and
    # tiers far larger than the workload's KV (no tier eviction), as these figures were first taken.
    store = StoreConfig(tiers=tuple(TierConfig(name=n, path=f"/kv/{n}", capacity_bytes=1 << 50) for n in measured),
                        memory_bytes=memory)
    base = SystemConfig.from_store(store, measured, name="kvstream-only (sim)", verify_s=0.0025)
    kw: dict[str, Any] = {}
    if max_wait is not None:
        kw["max_wait_s"] = max_wait
    if staging == "half":
        kw["prefetch_budget_chunks"] = max(memory // chunk // 2, 1)
    bidaw = ServingConfig(admit="ready", prefetch="hrrn", **kw)
    f = partial_fraction([m["read_bw"] for m in measured.values()])
    return {
        "kvstream": base.replace(name="kvstream", serving=bidaw, host_eviction="hit-potential",
                                 replication="full" if f >= 1 else f"partial:{f:.2f}"),
        "kvstream-only": base.replace(name="kvstream-only"),
        "bidaw-only": base.replace(name="bidaw-only", tiers=base.tiers[:1], router="single:local",
                                   replication="single", serving=bidaw, host_eviction="hit-potential"),
        "lmcache-like": base.replace(name="lmcache-like", tiers=base.tiers[:1], router="single:local",
                                     replication="single",
                                     serving=ServingConfig(load_mode="request", defer_writes=False)),
    }


def run_one(reqs: list[Any], setup_name: str | None, max_wait: float | None, staging: str | None,
            names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    from kvstream.commands.replay import setup_for
    from kvstream.config import parse_size
    from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape
    from kvstream.sim.driver import Hardware, simulate

    setup = setup_for(setup_name)
    memory = parse_size(setup["memory"], "memory")
    hw = Hardware(gpu=setup["gpu"], model=setup["model"], tp=setup["tp"],
                  hbm_kv_bytes=parse_size(setup["gpu_kv"], "gpu_kv"))
    chunk = CostModel(get_gpu(setup["gpu"]), get_model_shape(setup["model"]), setup["tp"]).model.chunk_bytes()
    out = {}
    for name, sysc in systems(memory, chunk, max_wait, staging).items():
        if name not in names:
            continue
        sim = simulate([reqs], sysc, hw, seed=0)
        t = np.array([r.ttft for r in sim.nodes[0].requests])
        s = sim.summary
        out[name] = {"mean": float(t.mean()), "p50": float(np.median(t)), "p99": float(np.percentile(t, 99)),
                     "max": float(t.max()), "puts_no_room": float(s.get("storage_puts_no_room", math.nan)),
                     "overdue": float(s.get("overdue_admits", 0))}
    return out


def main(argv: list[str]) -> int:
    wl = _workloads()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--workloads", default=",".join(wl), help=f"comma-separated: {', '.join(wl)}")
    ap.add_argument("--seeds", default="0,1,2", help="seeds of the synthetic workloads (traces run once)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--max-wait", type=float, default=None, help="Bidaw systems' max_wait_s (inf: no bound)")
    ap.add_argument("--staging", choices=("half",), default=None, help="half: the earlier staging rule")
    ap.add_argument("--json", default=None, help="write every run's figures here")
    a = ap.parse_args(argv)
    names = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    seeds = [int(x) for x in a.seeds.split(",")]
    runs: dict[str, list[dict[str, dict[str, float]]]] = {}
    print(f"{'workload':18s} {'system':14s} {'mean s':>8s} {'P50 s':>8s} {'P99 s':>8s} {'max s':>8s} "
          f"{'no-room puts':>12s} {'overdue':>8s}")
    for w in (x.strip() for x in a.workloads.split(",") if x.strip()):
        make, setup_name, seeded = wl[w]
        runs[w] = [run_one(make(seed), setup_name, a.max_wait, a.staging, names) for seed in (seeds if seeded else [0])]
        for name in names:
            med = {k: statistics.median(r[name][k] for r in runs[w]) for k in runs[w][0][name]}
            print(f"{w:18s} {name:14s} {med['mean']:8.2f} {med['p50']:8.2f} {med['p99']:8.2f} {med['max']:8.2f} "
                  f"{med['puts_no_room']:12.0f} {med['overdue']:8.0f}")
        sys.stdout.flush()
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
