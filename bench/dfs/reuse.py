"""Cross-node reuse on a real distributed file system (issue 12): node B serves a prefix node A wrote.

    sudo .venv/bin/python bench/dfs/reuse.py --fs gluster,ceph --runs 5 --json reuse.json

For each file system (brought up and torn down here, `bench/dfs`, TESTBED recipe 3; or `--use-running` with a
testbed `up.py` left up), two kvstream workers: A on node ``kvs-dfs-a``, B on ``kvs-dfs-b``, each with a local
tier on this machine's disk and the shared tier on its own FUSE mount. Every run writes fresh keys, so B's
client has never seen them:

1. A puts two prefixes of ``--chunks`` chunks (X and its twin Y, the same sizes), each chunk the KV of 256
   tokens of ``--model``; acknowledged = flushed, drained and listed by A's shared tier. B waits until it lists
   them (its index refresh).
2. **raw, cold**: the raw O_DIRECT reader (``kvstream.io.rawread``) reads Y's files through B's mount: the
   bound for a first read (B's client never saw them either).
3. **B, first use**: B's store reads X (host memory emptied), from the shared tier only (B has no local copy).
4. **raw, same files**: the raw reader on X's files right after (B's client may have kept some: shown, not the
   bound).
5. **B, second use, default config**: with ``replication: full`` and a shared tier the store copies what the
   first use read into B's local tier (read-through), so the second use reads X from there (``sources``
   shows where its chunks came from).
6. **copy**: B puts what it read into its local tier (``put(..., tiers=["local"])``): with read-through every
   chunk is there already and nothing is written (kept to measure stores configured without it).
7. **B, with its local copy**: B reads X again, now from both tiers (meet-in-the-middle), against the bound
   ``bytes / (raw local + raw shared, read concurrently)`` measured on the same files right after.

Against the modelled recompute time of the prefix (``kvstream.serving.gpu.CostModel.prefill_time``: the
modelled GPU that ``kvstream replay`` uses; default Qwen2.5-14B on 2x A100, replay's ``agent-long``). Medians
over ``--runs`` (after ``--warmup`` discarded runs). Holds ``/tmp/kvs-bench.lock`` (flock) while it runs, so
benchmarks on this machine do not overlap (``--no-bench-lock`` when the caller holds it already).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dfs import netns, testbed  # noqa: E402
from dfs.client import NodeProcess  # noqa: E402
from dfs.node import key_for  # noqa: E402

BENCH_LOCK = "/tmp/kvs-bench.lock"


def _file_size(payload: int) -> int:
    from kvstream.format import file_size

    return file_size(payload)


def node_config(work: Path, shared: Path, node: str, chunk_bytes: int, chunks: int, depth: int) -> dict[str, Any]:
    prefix = 2 * chunks * _file_size(chunk_bytes)  # X and Y
    inflight = depth * _file_size(chunk_bytes)  # the store keeps as many bytes in flight per tier as the raw reader
    tier = {"read_inflight_bytes": inflight, "read_depth": max(depth, 8)}
    return {
        "tiers": [{"name": "local", "path": str(work / f"local-{node}"), "capacity_bytes": 4 * prefix, **tier},
                  {"name": "shared", "path": str(shared), "capacity_bytes": 4 * prefix, "shared": True,
                   "write_backlog_bytes": 2 * prefix, **tier}],
        "memory_bytes": 3 * chunks * _file_size(chunk_bytes) + (256 << 20), "create_dirs": True,
        "io_engine": "auto", "replication": "full", "router": "mitm", "chunk_bytes": chunk_bytes,
    }


def hexes(keys: list[bytes]) -> list[str]:
    return [k.hex() for k in keys]


def wait_listed(p: NodeProcess, keys: list[bytes], timeout: float = 30.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if p.call("lookup", keys=hexes(keys))["contains"] == len(keys):
            return time.monotonic() - t0
        time.sleep(0.2)
    raise RuntimeError(f"node {p.node} lists only some of the {len(keys)} chunks after {timeout:.0f} s")


def one_run(a: NodeProcess, b: NodeProcess, tag: str, chunks: int, size: int, depth: int) -> dict[str, Any]:
    x = [key_for(f"{tag}-x", i) for i in range(chunks)]
    y = [key_for(f"{tag}-y", i) for i in range(chunks)]
    t0 = time.monotonic()
    put = a.call("put", keys=hexes(x + y), size=size, batch=4, drain_s=600, timeout=1200)
    if len(put["acked"]) != 2 * chunks:
        raise RuntimeError(f"node a acknowledged {len(put['acked'])} of {2 * chunks} chunks")
    write_s = time.monotonic() - t0
    visible_s = wait_listed(b, x + y)
    raw_cold = b.call("rawread", keys=hexes(y), tiers=["shared"], depth=depth, timeout=600)
    first = b.call("bench_read", keys=hexes(x), size=size, timeout=600)
    raw_same = b.call("rawread", keys=hexes(x), tiers=["shared"], depth=depth, timeout=600)
    again = b.call("bench_read", keys=hexes(x), size=size, timeout=600)
    copy = b.call("copy_local", keys=hexes(x), tier="local", timeout=600)
    if copy["held"] != chunks:
        raise RuntimeError(f"node b's local tier holds {copy['held']} of {chunks} chunks after the copy: {copy}")
    local = b.call("bench_read", keys=hexes(x), size=size, timeout=600)
    raw_both = b.call("rawread", keys=hexes(x), tiers=["local", "shared"], depth=depth, timeout=600)
    for r in (first, again, local):
        if r["misses"] or r["wrong"]:
            raise RuntimeError(f"node b: {r['misses']} misses, {r['wrong']} wrong chunks: {r}")
    # Clean up: A's remove deletes the shared files (and A's local copies), B's its local copies.
    a.call("remove", keys=hexes(x + y), timeout=600)
    b.call("remove", keys=hexes(x), timeout=600)
    return {"a_write_s": write_s, "b_visible_s": visible_s, "raw_cold": raw_cold, "first": first,
            "raw_same": raw_same, "again": again, "copy": copy, "local": local, "raw_both": raw_both}


def summarise(runs: list[dict[str, Any]], nbytes: int, recompute_s: float) -> dict[str, Any]:
    med = statistics.median
    first = med(r["first"]["seconds"] for r in runs)
    raw_cold = med(r["raw_cold"]["seconds"] for r in runs)
    raw_same = med(r["raw_same"]["seconds"] for r in runs)
    again = med(r["again"]["seconds"] for r in runs)
    local = med(r["local"]["seconds"] for r in runs)
    bound = med(r["raw_both"]["bound_seconds"] for r in runs)
    return {
        "bytes": nbytes, "recompute_s": recompute_s,
        "first_s": first, "raw_cold_s": raw_cold, "first_vs_raw_cold": med(r["first"]["seconds"] / r["raw_cold"]["seconds"] for r in runs),
        "raw_same_s": raw_same,
        "again_s": again, "again_sources": runs[len(runs) // 2]["again"]["sources"],
        "copy_write_s": med(r["copy"]["write_s"] for r in runs),
        "local_s": local, "local_sources": [r["local"]["sources"] for r in runs],
        "bound_both_s": bound, "local_vs_bound": med(r["local"]["seconds"] / r["raw_both"]["bound_seconds"] for r in runs),
        "raw_both_gbps": {t: med(r["raw_both"]["gbps"][t] for r in runs) for t in ("local", "shared")},
        "first_vs_recompute": first / recompute_s, "again_vs_recompute": again / recompute_s,
        "local_vs_recompute": local / recompute_s,
        "runs_first_s": [r["first"]["seconds"] for r in runs], "runs_raw_cold_s": [r["raw_cold"]["seconds"] for r in runs],
        "runs_local_s": [r["local"]["seconds"] for r in runs],
    }


def bench_fs(fs: str, mounts: dict[str, Path], args: argparse.Namespace, cost: dict[str, Any]) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="kvs-dfs-reuse-", dir=args.tmp))
    folder = f"reuse-{os.urandom(3).hex()}"
    procs: list[NodeProcess] = []
    try:
        for node in ("a", "b"):
            p = NodeProcess(node, work / f"journal-{node}.txt", work / f"node-{node}.log")
            procs.append(p)
            p.call("open", config=node_config(work, mounts[node] / folder, node, cost["chunk_bytes"], args.chunks,
                                              args.depth), timeout=300)
        a, b = procs
        runs = []
        for r in range(args.warmup + args.runs):
            run = one_run(a, b, f"{folder}-{r}", args.chunks, cost["chunk_bytes"], args.depth)
            run["warmup"] = r < args.warmup
            runs.append(run)
            print(f"  {fs} run {r + 1}/{args.warmup + args.runs}{' (warm-up)' if run['warmup'] else ''}: "
                  f"first {run['first']['seconds']:.3f} s (raw cold {run['raw_cold']['seconds']:.3f} s), "
                  f"again {run['again']['seconds']:.3f} s, local copy {run['local']['seconds']:.3f} s "
                  f"(bound {run['raw_both']['bound_seconds']:.3f} s), sources {run['local']['sources']}",
                  flush=True)
        measured = [r for r in runs if not r["warmup"]]
        return {"fs": fs, **summarise(measured, args.chunks * cost["chunk_bytes"], cost["recompute_s"]),
                "runs": runs}
    finally:
        for p in procs:
            p.stop()
        shutil.rmtree(mounts["a"] / folder, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


def table(results: list[dict[str, Any]], cost: dict[str, Any]) -> str:
    gb = lambda n, s: n / s / 1e9  # noqa: E731
    lines = [f"prefix: {cost['chunks']} chunks x {cost['chunk_bytes'] / 2**20:.0f} MiB = {cost['tokens']} tokens of "
             f"{cost['model']} ({cost['bytes'] / 2**20:.0f} MiB); modelled recompute (prefill from scratch, "
             f"{cost['tp']}x {cost['gpu']}): {cost['recompute_s']:.3f} s",
             "",
             "| shared tier on | B reads the prefix | seconds (median) | GB/s | bound, same run | time / bound | time / recompute |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        n = r["bytes"]
        lines += [
            f"| {r['fs']} | first use: shared tier only (no local copy) | {r['first_s']:.3f} | {gb(n, r['first_s']):.2f} "
            f"| raw cold {r['raw_cold_s']:.3f} s ({gb(n, r['raw_cold_s']):.2f} GB/s; same files after: "
            f"{r['raw_same_s']:.3f} s) | {r['first_vs_raw_cold']:.2f}x | {r['first_vs_recompute']:.2f}x |",
            f"| {r['fs']} | second use, default config (read-through: local copy since the first use; sources "
            f"{r['again_sources']}) | {r['again_s']:.3f} | {gb(n, r['again_s']):.2f} | – | – | {r['again_vs_recompute']:.2f}x |",
            f"| {r['fs']} | copy into B's local tier (caller's put, tiers=[local]; nothing left to write) | {r['copy_write_s']:.3f} | "
            f"{gb(n, r['copy_write_s']):.2f} | – | – | – |",
            f"| {r['fs']} | with B's local copy (local + shared, meet in the middle) | {r['local_s']:.3f} | "
            f"{gb(n, r['local_s']):.2f} | {r['bound_both_s']:.3f} s (raw concurrent: local "
            f"{r['raw_both_gbps']['local']:.2f} + shared {r['raw_both_gbps']['shared']:.2f} GB/s) | "
            f"{r['local_vs_bound']:.2f}x | {r['local_vs_recompute']:.2f}x |",
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fs", default="gluster,ceph", help="comma-separated: gluster, ceph")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=16, help="chunks in the prefix (256 tokens each)")
    ap.add_argument("--model", default="qwen2.5-14b", help="kvstream.serving.gpu model name or alias (14b, 70b)")
    ap.add_argument("--gpu", default="a100")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--depth", type=int, default=8, help="reads in flight (raw reader); the store gets as many bytes")
    ap.add_argument("--tmp", default="/var/tmp", help="state and local tiers (a real disk)")
    ap.add_argument("--use-running", action="store_true", help="use a testbed `up.py` left up (one --fs)")
    ap.add_argument("--no-bench-lock", action="store_true", help=f"the caller holds {BENCH_LOCK} already")
    ap.add_argument("--json", help="write every run and the medians here")
    args = ap.parse_args()

    from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape

    shape = get_model_shape(args.model)
    cm = CostModel(get_gpu(args.gpu), shape, tp=args.tp)
    tokens = args.chunks * 256
    cost = {"model": shape.name, "gpu": get_gpu(args.gpu).name, "tp": args.tp, "chunks": args.chunks,
            "chunk_bytes": shape.chunk_bytes(256), "tokens": tokens, "bytes": args.chunks * shape.chunk_bytes(256),
            "recompute_s": cm.prefill_time(tokens, 0), "host_to_gpu_s": cm.host_load_s(args.chunks * shape.chunk_bytes(256))}
    why = netns.missing()
    if why:
        print(f"cannot run here: {why}", file=sys.stderr)
        return 2
    lock_fd = None
    if not args.no_bench_lock:
        lock_fd = os.open(BENCH_LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        print(f"waiting for {BENCH_LOCK} ...", flush=True)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
    results = []
    try:
        tmp = Path(args.tmp)
        if args.use_running:
            for fs in args.fs.split(","):
                mounts = {n: Path(f"/mnt/kvs-dfs-{fs}-{n}") for n in netns.NODES}
                if not all(os.path.ismount(m) for m in mounts.values()):
                    print(f"--use-running: {fs} is not mounted at {list(map(str, mounts.values()))}", file=sys.stderr)
                    return 1
                results.append(bench_fs(fs, mounts, args, cost))
        else:
            fd = testbed.lock(timeout_s=600)
            owner = testbed.new_owner("bench")
            try:
                testbed.claim(owner)  # BedInUse: someone else's testbed is up (use --use-running)
                testbed.network_up(tmp)
                try:
                    for fs in args.fs.split(","):
                        cluster = testbed.fs_up(fs, tmp)
                        try:
                            results.append(bench_fs(fs, cluster.mounts, args, cost))
                        finally:
                            cluster.stop()
                finally:
                    testbed.network_down(owner)
            finally:
                testbed.release(owner)
                testbed.unlock(fd)
    finally:
        if lock_fd is not None:
            fcntl.flock(lock_fd, fcntl.LOCK_UN)
            os.close(lock_fd)
    print(table(results, cost))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cost": cost, "args": vars(args), "results": results,
                       "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
