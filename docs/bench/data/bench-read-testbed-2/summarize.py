#!/usr/bin/env python3
"""Summarize run.sh's JSON files: per configuration, the median over every repeat of every round of
(store seconds / bound seconds - 1), the per-round medians, GB/s and chunks per tier, and the raw reader's
concurrent GB/s per tier (what the bound is made of: blkio lets it run over a throttle by a few %).
Usage: summarize.py DIR"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path

runs: dict[str, list[dict]] = defaultdict(list)
for f in sorted(Path(sys.argv[1]).glob("r*_*.json")):
    try:
        d = json.loads(f.read_text())
    except (json.JSONDecodeError, OSError):
        continue
    runs[f.stem.split("_", 1)[1]].append(d)
print(f"{'config':24} {'rounds':>6} {'over bound (all repeats)':>26} {'per-round medians':>28} {'GB/s':>6}  "
      f"chunks local/shared  raw GB/s local/shared")
for name, ds in sorted(runs.items()):
    every = [x for d in ds for x in d["over_bound_runs"]]
    per_round = ", ".join(f"{d['over_bound'] * 100:+.1f}" for d in ds)
    gbps = statistics.median(d["gbps"] for d in ds)
    tiers = " / ".join(str(statistics.median(d["per_tier"][t]["chunks"] for d in ds)) for t in ds[0]["per_tier"])
    raw = " / ".join(f"{statistics.median(d['per_tier'][t]['raw_concurrent_gbps'] for d in ds):.2f}"
                     for t in ds[0]["per_tier"])
    print(f"{name:24} {len(ds):>6} {statistics.median(every) * 100:>+25.1f}% {per_round:>28} {gbps:>6.2f}  "
          f"{tiers:>19}  {raw}")
