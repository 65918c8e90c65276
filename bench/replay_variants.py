"""`kvstream replay` with diagnostic variants of the `kvstream` system: which part of the second tier costs what.

Why it exists: on this project's VM the full system (two tiers + Bidaw) is level with `bidaw-only` (one tier +
Bidaw) on mean TTFT (BENCHMARKS §3.0: ratio 1.058, 95 % interval 0.924-1.227, five rounds), although the
simulator, given the same tiers, says it should lead. These variants take the second tier apart, one change
each, and run beside the ordinary systems in the same replay:

- ``kv-writes-only``: both tiers written (full replication), only the local tier read: the second copy's cost
  without its read gain;
- ``kvstream-backlog``: the shared tier's write backlog valve at ``--backlog`` bytes instead of half of host
  memory (more copies owed and caught up later);
- ``kvstream-partial``: ``partial:F`` replication (``--partial F``: the share of each prefix's chunks, at its
  back, that get the second copy; KVStream's suggestion when the second tier is short of write bandwidth).

They are not product systems, so they live here, wrapping the replay command's table of systems::

    flock /tmp/kvs-bench.lock .venv/bin/python bench/replay_variants.py [--backlog 256MiB] [--partial 0.4] -- \\
        --systems kv-writes-only,kvstream,bidaw-only --out /tmp/var --json

Every other argument after ``--`` is ``kvstream replay``'s. ``--simulate`` instead runs the simulator on the
default workload with the cross-check's store rules and Bidaw serving, kvstream against bidaw-only, with the
tiers at ``--local-gbps`` / ``--shared-gbps`` (what the design predicts for the same set-up)::

    .venv/bin/python bench/replay_variants.py --simulate --local-gbps 2.6 --shared-gbps 0.4
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import kvstream.commands.replay as replay
import kvstream.store as store_module
from kvstream.cli import main as kvstream_main
from kvstream.config import parse_size

VARIANTS = ("kv-writes-only", "kvstream-backlog", "kvstream-partial")


def install(backlog: int, partial: float) -> None:
    """Add the variants to the replay command's systems (this process only)."""
    base = replay._system
    open_store = store_module.open_store

    def system(name: str) -> dict[str, Any]:
        if name == "kv-writes-only":
            return {**base("kvstream"), "router": "single"}
        if name == "kvstream-backlog":
            return dict(base("kvstream"))
        if name == "kvstream-partial":
            return {**base("kvstream"), "replication": f"partial:{partial}"}
        return base(name)

    def open_with_backlog(cfg: Any, **kw: Any) -> Any:
        # The replay names each system's tier folders replay-<system>: the backlog variant's shared tier gets it.
        if isinstance(cfg, dict) and any("replay-kvstream-backlog" in str(t.get("path")) for t in cfg["tiers"]):
            cfg = {**cfg, "tiers": [dict(t) for t in cfg["tiers"]]}
            cfg["tiers"][1]["write_backlog_bytes"] = backlog
        return open_store(cfg, **kw)

    replay._system = system  # type: ignore[assignment]
    replay.ALL_SYSTEMS = replay.ALL_SYSTEMS + VARIANTS
    store_module.open_store = open_with_backlog  # type: ignore[assignment]


def simulate_pair(local_gbps: float, shared_gbps: float) -> dict[str, dict[str, float]]:
    """kvstream and bidaw-only in the simulator: the default replay's requests, hardware and store rules (32 MiB
    read windows, 2.5 ms checks, the 1 GiB write backlog valve), tiers at the given read bandwidths (local writes
    1.9 GB/s and mixed reads 1.2 GB/s, as the replay's tiers measured; the shared tier writes at its read rate)."""
    from kvstream.config import StoreConfig, TierConfig
    from kvstream.serving.core import ServingConfig
    from kvstream.sim.driver import Hardware, SystemConfig, simulate
    from kvstream.workload import generate, preset

    measured = {"local": {"read_bw": local_gbps * 1e9, "write_bw": 1.9e9, "mixed_read_bw": 1.2e9},
                "shared": {"read_bw": shared_gbps * 1e9, "write_bw": shared_gbps * 1e9,
                           "mixed_read_bw": shared_gbps * 0.95e9}}
    # Replay's store: 2 GiB of host memory, 32 MiB claim windows, the valve at 1 GiB (half of it); no chunk size
    # (window floor 0) and tiers far larger than the workload's KV (no tier eviction), as these figures were taken.
    store = StoreConfig(tiers=tuple(TierConfig(name=n, path=f"/kv/{n}", capacity_bytes=1 << 50) for n in measured),
                        memory_bytes=2 << 30)
    base = SystemConfig.from_store(store, measured, name="kvstream-only (sim)", verify_s=0.0025)
    bidaw = ServingConfig(admit="ready", prefetch="hrrn")
    systems = {"kvstream": base.replace(name="kvstream", serving=bidaw, host_eviction="hit-potential"),
               "bidaw-only": base.replace(name="bidaw-only", tiers=base.tiers[:1], router="single:local",
                                          replication="single", serving=bidaw, host_eviction="hit-potential")}
    reqs = generate(preset("agent-long"), 0)
    hw = Hardware(gpu="a100", model="qwen2.5-14b", tp=2, hbm_kv_bytes=5 * 2**30)
    out = {}
    for name, sysc in systems.items():
        s = simulate([reqs], sysc, hw, seed=0).summary
        out[name] = {"ttft_mean_s": s["ttft_mean_s"], "ttft_p99_s": s["ttft_p99_s"]}
    return out


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backlog", default="256MiB", help="kvstream-backlog's shared-tier write backlog")
    p.add_argument("--partial", type=float, default=0.4, help="kvstream-partial's replicated share")
    p.add_argument("--simulate", action="store_true", help="the simulator's kvstream vs bidaw-only instead")
    p.add_argument("--local-gbps", type=float, default=2.6)
    p.add_argument("--shared-gbps", type=float, default=0.4)
    args = p.parse_args(argv[:cut])
    if args.simulate:
        for name, r in simulate_pair(args.local_gbps, args.shared_gbps).items():
            print(f"{name}: mean TTFT {r['ttft_mean_s']:.3f} s, P99 {r['ttft_p99_s']:.3f} s")
        return 0
    if not 0.0 < args.partial < 1.0:
        p.error("--partial must be between 0 and 1")
    install(parse_size(args.backlog, "--backlog"), args.partial)
    return kvstream_main(["replay", *argv[cut + 1:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
