"""Run the atheris harnesses and record how many inputs each tried: ``python fuzz/run.py [--runs N | --seconds S]``.

For each target it writes a seed corpus (valid chunks, index logs and snapshots made by kvstream itself, the
first lines of the real traces in ``shared/data/traces`` when present) to ``fuzz/corpus/<target>/``, runs
libFuzzer through atheris with no length ramp (``-len_control=0``: a chunk header is 4 KiB, far past the
default starting length), and parses its summary (``Done N runs in S second(s)``, the last ``cov:`` and
``corp:`` figures). Results go to ``fuzz/RESULTS.json`` and are printed as a table; a crash leaves its input in
``fuzz/artifacts/`` and is listed. ``--tolerate`` passes ``KVS_FUZZ_TOLERATE`` to the trace harness (known
defects that would otherwise stop the search at the first hit).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TRACES = REPO.parent / "shared" / "data" / "traces"
TARGETS = {"header": "fuzz_header.py", "index": "fuzz_index.py", "traces": "fuzz_traces.py"}


def seeds(target: str, out: Path) -> int:
    """Write a small seed corpus for ``target``; returns the number of seeds."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0

    def put(name: str, data: bytes) -> None:
        nonlocal n
        (out / name).write_bytes(data)
        n += 1

    if target in ("header", "index"):
        import kvstream

        root = Path(tempfile.mkdtemp(prefix="kvs-fuzz-seed-"))
        try:
            cfg = {"tiers": [{"name": "t", "path": str(root / "t"), "capacity_bytes": "64MiB"}],
                   "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads"}
            cfg["tiers"][0]["direct_io"] = "off"  # the seeds may live on tmpfs
            import numpy as np

            with kvstream.open_store(cfg) as s:
                s.put(b"k" * 16, b"x" * 100)
                s.put(b"a" * 64, np.arange(24, dtype=np.float32).reshape(2, 3, 4))
            with kvstream.open_store(cfg) as s:  # compacts the first log into a snapshot
                s.put(b"\0" * 16, b"")
            if target == "header":
                for i, p in enumerate(sorted((root / "t" / "chunks").rglob("*.kvc"))):
                    put(f"chunk{i}", p.read_bytes())
                    put(f"chunk{i}-fixed", b"\x01" + p.read_bytes()[:4200])
            else:
                for i, p in enumerate(sorted((root / "t" / "index").glob("log-*"))):
                    put(f"log{i}", b"\x00" + p.read_bytes())
                    put(f"log{i}-fixed", b"\x01" + p.read_bytes())
                snap = (root / "t" / "index" / "snapshot.idx").read_bytes()
                put("snapshot", b"\x02" + snap[8:-8])
        finally:
            shutil.rmtree(root, ignore_errors=True)
    else:
        put("mooncake-min", b"\x00" + b'{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n')
        put("bidaw-min", b"\x01" + b"user_id time_stamp(seconds) query_length response_length round_index\n1 0 10 20 0\n")
        for f in sorted((TRACES / "mooncake").glob("*.jsonl"))[:2]:
            with open(f, "rb") as fh:
                put(f"mc-{f.stem}", b"\x00" + b"".join(fh.readline() for _ in range(5)))
        for f in sorted((TRACES / "bidaw-conversation").glob("*.txt"))[:2]:
            with open(f, "rb") as fh:
                put(f"bd-{f.stem}", b"\x01" + b"".join(fh.readline() for _ in range(8)))
    return n


def run(target: str, runs: int | None, seconds: int | None, tolerate: str) -> dict:
    corpus = HERE / "corpus" / target
    n_seeds = seeds(target, corpus)
    artifacts = HERE / "artifacts" / target
    artifacts.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(HERE / TARGETS[target]), str(corpus), "-len_control=0", "-max_len=8192",
           f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]
    cmd += [f"-runs={runs}"] if runs else [f"-max_total_time={seconds}"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    if tolerate and target == "traces":
        env["KVS_FUZZ_TOLERATE"] = tolerate
    scratch = tempfile.mkdtemp(prefix=f"kvs-fuzz-{target}-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    env["KVS_FUZZ_TMP"] = scratch
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    wall = time.monotonic() - t0
    log = p.stdout + p.stderr
    done = re.findall(r"Done (\d+) runs in (\d+) second", log)
    execs = re.findall(r"stat::number_of_executed_units:\s*(\d+)", log)
    cov = re.findall(r"cov: (\d+) ft: (\d+) corp: (\d+)/", log)
    crash = re.findall(r"(?:Test unit written to|artifact_prefix.*?; Test unit written to) (\S+)", log)
    exc = re.findall(r"=== Uncaught Python exception: ===\n(.+)", log)
    return {
        "target": target, "engine": "atheris " + _atheris_version(), "seeds": n_seeds,
        "inputs": int(done[-1][0]) if done else int(execs[-1]) if execs else None,
        "seconds": round(wall, 1), "coverage_edges": int(cov[-1][0]) if cov else None,
        "features": int(cov[-1][1]) if cov else None, "corpus": int(cov[-1][2]) if cov else None,
        "exit": p.returncode, "crashes": crash, "exception": exc[-1].strip() if exc else None,
        "tolerated": tolerate if target == "traces" else "",
        "command": " ".join(["python", f"fuzz/{TARGETS[target]}", f"fuzz/corpus/{target}", *cmd[3:]]).replace(
            str(artifacts), f"fuzz/artifacts/{target}"),
    }


def _atheris_version() -> str:
    try:
        from importlib.metadata import version

        return version("atheris")
    except Exception:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--runs", type=int, help="inputs per target")
    g.add_argument("--seconds", type=int, help="time per target")
    ap.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    ap.add_argument("--tolerate", default="", help="exception names the trace harness lets pass (known defects)")
    args = ap.parse_args(argv)
    try:
        import atheris  # noqa: F401
    except ImportError:
        print("atheris is not installed (pip install atheris into .venv); the hypothesis fuzz tests in "
              "tests/integration/test_fuzz.py run without it", file=sys.stderr)
        return 2
    results = [run(t, args.runs if args.runs or args.seconds else 100_000, args.seconds, args.tolerate)
               for t in args.targets]
    (HERE / "RESULTS.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"{'target':8} {'inputs':>10} {'s':>6} {'edges':>6} {'corpus':>6}  result")
    for r in results:
        what = "no crash" if r["exit"] == 0 else f"CRASH: {r['exception']} -> {', '.join(r['crashes']) or '?'}"
        print(f"{r['target']:8} {r['inputs'] or 0:>10} {r['seconds']:>6} {r['coverage_edges'] or 0:>6} "
              f"{r['corpus'] or 0:>6}  {what}")
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
