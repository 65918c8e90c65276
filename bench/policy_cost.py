"""Per-decision cost of the scheduling and eviction policies at realistic sizes (TARGETS B6).

    flock /tmp/kvs-cpu.lock .venv/bin/python bench/policy_cost.py [--queued 10000] [--chunks 1000000] [--json]

What is timed (``time.perf_counter_ns`` around each single call; medians and 99th percentiles):

- **scheduling decision**: the policy object exactly as the serving core (:mod:`kvstream.serving.core`) builds
  and calls it: the :class:`~kvstream.serving.core.ServingConfig` of each system (``fcfs``: FCFS;
  ``cachedattention``: ``prefetch="lookahead:32"``; ``bidaw``: ``admit="ready", prefetch="hrrn"``), turned into
  the policy's limits by ``serving.core.scheduler_config`` (64 running, prefetched KV held until prefilled within
  a 4 GB budget, one background load in flight: the core's default), and one step's decision
  ``schedule(now, check=..., reserve=...)`` with the core's two per-candidate queries answered from a table (the
  core's own index lookups are not the policy's cost). ``--queued`` requests wait (half with their KV in host
  memory, half on disk); each decision admits the requests that fit the slots freed by the previous step and
  starts the load that fits. Between decisions (not timed) two running requests finish (``on_step_finished`` with
  the admitted ones as ``prefilled``, as the core reports a step), the load in flight finishes, and as many
  requests arrive as were admitted, so the queue stays at its size. The loads-only call the core makes on every
  event while the GPU is busy (``schedule(now, admit=False)``) is timed too (``loads_only_*``).
- **eviction**: one ``victim()`` plus the ``on_remove()`` of that victim, with ``--chunks`` resident chunks
  (``--chunks / 20`` conversations of 20 chunks); between evictions (not timed) a chunk of a conversation's new
  round is inserted, so the resident set stays at its size. The insert is timed separately.
- **ghost-cache update**: Bidaw's background Belady cache processing one conversation visit (queueing it and
  processing the visit that leaves the look-back horizon), with the ghost holding as many conversations as the
  chunks above make.

The paper reports 0.62 ms per scheduling decision, 0.35 ms per eviction and 2.86 ms per ghost-cache update;
the project's goal is 0.1 ms for each.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from collections.abc import Callable

from kvstream.eviction import AccessMeta, HitPotentialPolicy, _GhostBelady, make_eviction_policy
from kvstream.scheduling import Candidate, RequestInfo, make_scheduler
from kvstream.serving.core import ServingConfig, scheduler_config

PAPER_MS = {"scheduling": 0.62, "eviction": 0.35, "ghost": 2.86}
GOAL_MS = 0.1
CHUNK_BYTES = 256 * 819_200  # one 256-token chunk of OPT-13B, bytes
# The serving configuration of each system, as the simulator and replay give it to the core.
SERVING = {
    "fcfs": {},
    "cachedattention": {"prefetch": "lookahead:32"},
    "bidaw": {"admit": "ready", "prefetch": "hrrn"},
}


def _summary(samples_ns: list[int]) -> dict[str, float]:
    s = sorted(samples_ns)
    return {
        "median_ms": statistics.median(s) / 1e6,
        "p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))] / 1e6,
        "n": len(s),
    }


def bench_scheduler(name: str, queued: int, decisions: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    serving = ServingConfig(max_running=64, prefetch_budget_chunks=4_000_000_000 // CHUNK_BYTES, **SERVING[name])
    sched = make_scheduler(serving.scheduler, scheduler_config(serving, CHUNK_BYTES))
    cfg = sched.config
    fresh: dict[int, Candidate] = {}  # the core's answer to check(): tokens left after its GPU cache, disk bytes
    next_id = 0
    now = 0.0

    def arrive(on_disk: bool) -> None:
        nonlocal next_id
        disk = rng.randrange(50, 2048) * 819_200 if on_disk else 0
        tokens = rng.randrange(100, 2048)
        sched.on_arrival(RequestInfo(request_id=next_id, arrival=now, prompt_tokens=tokens,
                                     disk_bytes=disk, session=next_id), now=now)  # fmt: skip
        fresh[next_id] = Candidate(tokens=tokens, disk_bytes=0 if name == "bidaw" else disk)
        next_id += 1

    def check(rid: int) -> Candidate:
        return fresh[rid]

    def reserve(rid: int) -> bool:
        return True

    for i in range(queued):
        now += 0.001
        arrive(on_disk=i % 2 == 1)
    running: list[int] = []
    loading: list[int] = []
    samples: list[int] = []
    loads_only: list[int] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(decisions):
            t0 = time.perf_counter_ns()
            d = sched.schedule(now=now, check=check, reserve=reserve)
            samples.append(time.perf_counter_ns() - t0)
            running.extend(d.admit)
            loading.extend(lo.request_id for lo in d.loads if lo.request_id not in d.blocking)
            now += 0.025
            t0 = time.perf_counter_ns()
            d2 = sched.schedule(now=now, admit=False)  # an event while the step runs
            loads_only.append(time.perf_counter_ns() - t0)
            loading.extend(lo.request_id for lo in d2.loads)
            now += 0.025
            done, running = running[:2], running[2:]
            if len(running) + 2 > cfg.max_running:  # keep the batch below its limit so slots free up
                done += running[:2]
                running = running[2:]
            sched.on_step_finished(done, now=now, prefilled=[r for r in d.admit if r not in done])
            for rid in loading[:2]:
                sched.on_load_finished(rid, now=now)
            loading = loading[2:]
            for j in range(len(d.admit)):  # replace the admitted requests: the queue keeps its size
                arrive(on_disk=j % 2 == 1)
    finally:
        gc.enable()
    out = _summary(samples)
    lo = _summary(loads_only)
    out["loads_only_median_ms"] = lo["median_ms"]
    out["loads_only_p99_ms"] = lo["p99_ms"]
    out["queued_at_end"] = float(sched.waiting())
    return out


def _fill_policy(name: str, chunks: int, seed: int) -> tuple[object, list[tuple[int, int]], Callable[[int], AccessMeta]]:
    sessions = max(1, chunks // 20)
    rng = random.Random(seed)
    answers = [rng.randrange(1, 400) for _ in range(sessions)]
    rounds = [0] * sessions
    if name == "belady":
        policy = make_eviction_policy("belady", next_use=lambda key, now: float(hash(key) % 1_000_003) + now)
    elif name == "hit-potential":
        policy = HitPotentialPolicy(capacity_bytes=chunks * CHUNK_BYTES)
    else:
        policy = make_eviction_policy(name)

    def meta(s: int) -> AccessMeta:
        return AccessMeta(session=s, prev_answer_tokens=answers[s], round_index=rounds[s], position=None)

    keys: list[tuple[int, int]] = []
    # Insert conversation by conversation in an interleaved order so sessions have varied recency.
    per = chunks // sessions
    for step in range(per):
        for s in range(sessions):
            key = (s, step)
            policy.on_insert(key, CHUNK_BYTES, now=0.0, meta=AccessMeta(session=s, prev_answer_tokens=answers[s],
                                                                       round_index=0, position=step))  # fmt: skip
            keys.append(key)
    return policy, keys, meta


def bench_eviction(name: str, chunks: int, evictions: int, seed: int) -> dict[str, float]:
    policy, _keys, _meta = _fill_policy(name, chunks, seed)
    rng = random.Random(seed + 1)
    sessions = max(1, chunks // 20)
    next_pos = [chunks // sessions] * sessions
    rounds = [1] * sessions
    ev_samples: list[int] = []
    ins_samples: list[int] = []
    now = 1.0
    gc.collect()
    gc.disable()
    try:
        for _ in range(evictions):
            t0 = time.perf_counter_ns()
            v = policy.victim(now=now)
            policy.on_remove(v)
            ev_samples.append(time.perf_counter_ns() - t0)
            s = rng.randrange(sessions)
            key = (s, next_pos[s])
            next_pos[s] += 1
            rounds[s] += 1
            m = AccessMeta(session=s, prev_answer_tokens=rng.randrange(1, 400), round_index=rounds[s], position=next_pos[s])
            t0 = time.perf_counter_ns()
            policy.on_insert(key, CHUNK_BYTES, now=now, meta=m)
            ins_samples.append(time.perf_counter_ns() - t0)
            now += 0.001
    finally:
        gc.enable()
    out = _summary(ev_samples)
    ins = _summary(ins_samples)
    out["insert_median_ms"] = ins["median_ms"]
    out["insert_p99_ms"] = ins["p99_ms"]
    out["resident"] = float(len(policy))  # type: ignore[arg-type]
    return out


def bench_ghost(chunks: int, updates: int, seed: int) -> dict[str, float]:
    rng = random.Random(seed)
    sessions = max(1, chunks // 20)
    size = 20 * CHUNK_BYTES
    capacity = sessions * size // 2  # the ghost holds half of the conversations: evictions on most updates
    ghost = _GhostBelady(capacity, horizon=4 * capacity, n_buckets=10, half_life=20000)
    # Warm up until the lag queue is full and the ghost is at capacity.
    warm = 6 * sessions
    for _ in range(warm):
        rec = ghost.add_visit(rng.randrange(sessions), 0, rng.randrange(-1, 10))
        ghost.add_bytes(rec, size)
        ghost.drain()
    samples: list[int] = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(updates):
            s = rng.randrange(sessions)
            b = rng.randrange(-1, 10)
            t0 = time.perf_counter_ns()
            rec = ghost.add_visit(s, 0, b)
            ghost.add_bytes(rec, size)
            ghost.drain()
            samples.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    out = _summary(samples)
    out["processed"] = float(ghost.processed)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queued", type=int, default=10_000, help="requests waiting in the scheduler")
    ap.add_argument("--chunks", type=int, default=1_000_000, help="resident chunks in the eviction policy")
    ap.add_argument("--decisions", type=int, default=3000)
    ap.add_argument("--evictions", type=int, default=20000)
    ap.add_argument("--schedulers", nargs="+", default=["fcfs", "cachedattention", "bidaw"])
    ap.add_argument("--policies", nargs="+", default=["lru", "fifo", "lfu", "queue-aware", "inclusive", "belady", "hit-potential"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    results: dict[str, dict[str, dict[str, float]]] = {"scheduling": {}, "eviction": {}, "ghost": {}}
    for name in args.schedulers:
        results["scheduling"][name] = bench_scheduler(name, args.queued, args.decisions, args.seed)
        _progress(args, "scheduling", name, results["scheduling"][name])
    for name in args.policies:
        results["eviction"][name] = bench_eviction(name, args.chunks, args.evictions, args.seed)
        _progress(args, "eviction", name, results["eviction"][name])
    results["ghost"]["hit-potential"] = bench_ghost(args.chunks, args.evictions, args.seed)
    _progress(args, "ghost", "hit-potential", results["ghost"]["hit-potential"])
    meta = {"queued": args.queued, "chunks": args.chunks, "python": sys.version.split()[0], "paper_ms": PAPER_MS,
            "goal_ms": GOAL_MS}  # fmt: skip
    if args.json:
        print(json.dumps({"setup": meta, "results": results}, indent=2))
        return 0
    print(f"\n{'operation':12s} {'policy':16s} {'median ms':>10s} {'p99 ms':>9s} {'paper ms':>9s} {'goal ms':>8s}")
    for kind, per in results.items():
        for name, r in per.items():
            print(f"{kind:12s} {name:16s} {r['median_ms']:10.4f} {r['p99_ms']:9.4f} {PAPER_MS[kind]:9.2f} {GOAL_MS:8.2f}")
    for name, r in results["scheduling"].items():
        print(f"{'loads-only':12s} {name:16s} {r['loads_only_median_ms']:10.4f} {r['loads_only_p99_ms']:9.4f}")
    for name, r in results["eviction"].items():
        print(f"{'insert':12s} {name:16s} {r['insert_median_ms']:10.4f} {r['insert_p99_ms']:9.4f}")
    return 0


def _progress(args: argparse.Namespace, kind: str, name: str, r: dict[str, float]) -> None:
    if not args.json:
        print(f"  {kind} {name}: median {r['median_ms']:.4f} ms (n={int(r['n'])})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
