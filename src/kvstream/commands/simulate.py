"""``kvstream simulate``: the discrete-event simulator, by scenario or on one trace.

    kvstream simulate --list
    kvstream simulate --scenario bound [--quick] [--out DIR] [--json]
    kvstream simulate --scenario all --out sim-out          # every scenario, then `kvstream report --in sim-out`
    kvstream simulate --trace conversation_trace.jsonl --system kvstream --model 70b --gpu h100

A scenario prints the paper's figures beside its own and writes ``NAME.png`` and ``NAME.json`` into ``--out``.
``--trace`` runs one system on a Mooncake-format trace, reports the simulated requests per wall second and
writes ``trace-SYSTEM.json`` into ``--out``; it warns when the modelled system is overloaded (its queue grows
through the run: see :func:`overload_warning`). Every JSON records the version, the command line and ``--quick``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvstream.errors import NothingMeasuredError, UsageError

__all__ = ["register", "overload_warning"]

_SYSTEMS = ("kvstream", "lmcache", "bidaw", "kvstream+bidaw", "kvstream+compute", "recompute-only", "load-only")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from kvstream.commands._common import (gpu_name, gpu_names, model_aliases, model_name, nonnegative_int,
                                           positive_float, positive_int)

    p = subparsers.add_parser("simulate", help="run the discrete-event simulator (paper scenarios or a trace)",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--scenario", metavar="NAME", help="a scenario name, or 'all'")
    g.add_argument("--trace", metavar="PATH", help="a Mooncake-format trace (jsonl) to run one system on")
    g.add_argument("--list", action="store_true", help="list the scenarios and the TARGETS.md rows they cover")
    p.add_argument("--quick", action="store_true", help="shrink the workloads (a first look; the docs use full runs)")
    p.add_argument("--out", default="sim-out",
                   help="folder for results: NAME.png and NAME.json of a scenario, trace-SYSTEM.json of --trace "
                        "(default ./sim-out)")
    p.add_argument("--seed", type=nonnegative_int, default=0, help="random seed of the workloads")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    p.add_argument("--system", choices=_SYSTEMS, default="kvstream", help="with --trace: the system to run")
    p.add_argument("--model", type=model_name, default="70b", metavar="NAME",
                   help=f"with --trace: model, a name or an alias ({', '.join(model_aliases())}, opt-13b, ...; "
                        "an unknown name lists them all)")
    p.add_argument("--gpu", type=gpu_name, default="h100", metavar="NAME", help=f"with --trace: {', '.join(gpu_names())}")
    p.add_argument("--testbed", type=int, choices=(1, 2), default=1, help="with --trace: tier profile")
    p.add_argument("--time-scale", type=positive_float, default=1.0, help="with --trace: replay this many times faster")
    p.add_argument("--instances", type=positive_int, default=1, metavar="K",
                   help="with --trace: simulate the share one instance of K gets from a session-affine router "
                        "(sessions kept whole; default: 1, the whole trace)")
    p.add_argument("--host-gb", type=positive_float, default=512.0, help="with --trace: host memory per node, GB")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from kvstream.sim.scenarios import SCENARIOS, run_scenario

    if args.list:
        for sc in SCENARIOS.values():
            print(f"{sc.name:12s} {sc.targets:14s} {sc.title}")
        return 0
    if args.trace:
        return _run_trace(args)
    names = list(SCENARIOS) if args.scenario == "all" else [args.scenario]
    for n in names:
        if n not in SCENARIOS:
            raise UsageError(f"unknown scenario {n!r}; known: {', '.join(SCENARIOS)} (or 'all')")
    from kvstream.commands._common import require, run_meta

    require("matplotlib", "simulate --scenario (each scenario writes its figure)")
    out = Path(args.out)
    meta = run_meta(quick=args.quick)
    results = []
    for n in names:
        res = run_scenario(n, out, quick=args.quick, seed=args.seed, meta=meta)
        results.append(res)
        if not args.json:
            print(res.table())
            print()
            sys.stdout.flush()
    if args.json:
        print(json.dumps([{**meta, **r.to_json()} for r in results], indent=1))
    return 0


def _run_trace(args: argparse.Namespace) -> int:
    from kvstream.sim.driver import Hardware, SystemConfig, simulate
    from kvstream.sim.scenarios import GB, compute_systems, kvstream, lmcache, testbed_tiers
    from kvstream.workload.mooncake import one_instance_share, read_mooncake

    reqs = one_instance_share(read_mooncake(args.trace, time_scale=args.time_scale), args.instances)
    if not reqs:
        raise NothingMeasuredError(f"the trace {args.trace} has no requests: there is nothing to simulate (give a "
                                   "trace with at least one request)")
    tiers = testbed_tiers(args.testbed)
    host = args.host_gb * GB

    def compute_system(k: str) -> SystemConfig:
        return compute_systems(tiers, host)[k]

    systems: dict[str, Callable[[], SystemConfig]] = {
        "kvstream": lambda: kvstream(tiers, host),
        "lmcache": lambda: lmcache(tiers, host),
        "bidaw": lambda: kvstream((tiers[0],), host, name="Bidaw", router="single:nvme", replication="single",
                                  admit="ready", prefetch="hrrn"),
        "kvstream+bidaw": lambda: kvstream(tiers, host, name="kvstream+bidaw", admit="ready", prefetch="hrrn"),
        # compute joins the meet-in-the-middle, and its baselines (kvstream.sim.scenarios.compute_systems)
        **{k: functools.partial(compute_system, k) for k in ("kvstream+compute", "recompute-only", "load-only")},
    }
    system = systems[args.system]()
    res = simulate([reqs], system, Hardware(gpu=args.gpu, model=args.model), seed=args.seed)
    s = res.summary
    from kvstream.commands._common import run_meta

    done = [r for node in res.nodes for r in node.requests]
    served = sum(1 for r in done if not math.isnan(r.first_token))
    warning = overload_warning(done)
    out = {
        **run_meta(quick=args.quick),
        "trace": str(args.trace), "model": args.model, "gpu": args.gpu, "testbed": args.testbed,
        "time_scale": args.time_scale, "host_gb": args.host_gb, "seed": args.seed,
        "system": system.name, "requests": res.requests, "wall_s": res.wall_s,
        "simulated_requests_per_s": res.requests_per_wall_s, "events": res.events, "sim_time_s": res.sim_time_s,
        **{k: s[k] for k in ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "queue_mean_s", "queue_len_mean",
                             "throughput_rps", "slo_attainment", "read_time_per_step_s", "hit_hbm", "hit_host",
                             "hit_disk", "storage_write_amplification", "storage_read_over_bound")},
        "overloaded": warning is not None, "warnings": [warning] if warning else [],
    }
    dest = Path(args.out)
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / f"trace-{args.system}.json"
    path.write_text(json.dumps(out, indent=1, default=str))
    if served == 0:  # every TTFT would be NaN: the table would describe nothing
        raise NothingMeasuredError(f"none of the {len(reqs)} requests got its first token by the end of the simulated "
                                   f"run, so it measured nothing; {warning or 'the modelled system served nothing'} "
                                   f"(results kept in {path})")
    if warning:
        print(f"simulate: warning: {warning}", file=sys.stderr)
    if args.json:
        print(json.dumps(out, indent=1, default=str))
    else:
        skip = ("command_line", "warnings")
        for k, v in out.items():
            if k not in skip:
                print(f"{k:28s} {v:.4g}" if isinstance(v, float) else f"{k:28s} {v}")
        print(f"results: {path}")
    return 0


def overload_warning(requests: Sequence[Any], *, share: float = 0.2, growth: float = 3.0,
                     span_share: float = 0.1, floor_s: float = 1.0) -> str | None:
    """One line if the modelled system was overloaded, else None.

    Overloaded means requests arrive faster than the system serves them, so the queue grows for as long as the
    trace lasts and TTFT measures the length of the trace rather than the system. Two signs, either enough:
    a request that never got its first token by the end of the run; or, with at least 10 requests, the last
    ``share`` of them by arrival waited (arrival to first load or compute) on average more than ``growth``
    times as long as the first ``share``, more than ``floor_s`` seconds, and longer by more than ``span_share``
    of the time the arrivals span (a queue that grows in step with the trace, not a burst).
    ``requests``: objects with ``arrival``, ``started`` and ``first_token``
    (:class:`kvstream.serving.metrics.RequestRecord`).
    """
    reqs = sorted(requests, key=lambda r: r.arrival)
    n = len(reqs)
    if n == 0:
        return None
    advice = "Slow the arrivals (--time-scale below 1) or model more capacity (--gpu, --model, --host-gb)"
    unfinished = sum(1 for r in reqs if math.isnan(r.first_token))
    if unfinished:
        return (f"the modelled system is overloaded: {unfinished} of {n} requests got no first token by the end "
                f"of the run; TTFT and throughput describe a queue that never drains. {advice}")
    if n < 10:
        return None
    k = max(int(n * share), 1)

    def mean_queue(rs: Sequence[Any]) -> float:
        qs = [r.started - r.arrival for r in rs if not math.isnan(r.started)]
        return sum(qs) / len(qs) if qs else 0.0

    first, last = mean_queue(reqs[:k]), mean_queue(reqs[-k:])
    span = reqs[-1].arrival - reqs[0].arrival
    if last > floor_s and last > growth * first and last - first > span_share * span:
        pct = round(100 * share)
        return (f"the modelled system is overloaded: the last {pct} % of requests (by arrival) queued "
                f"{last:.4g} s on average, the first {pct} % {first:.4g} s, over {span:.4g} s of arrivals "
                f"(criterion: over {growth:g}x, and longer by over {100 * span_share:g} % of that span); the queue "
                f"grows through the run, so TTFT reflects the trace's length, not the system. {advice}")
    return None
