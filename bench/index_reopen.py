"""How long a tier's index takes to reopen: the time ``open_store`` spends per tier before it can serve.

Writes ``--entries`` put records through :class:`kvstream.tiers.index.TierIndex` (as a store's puts would),
closes it, then times (a) the first reopen, which replays the log and compacts it into a snapshot, and (b) a
reopen from the snapshot alone, the usual case. Medians of ``--runs``. A benchmark, not a test: the suite only
checks that many entries reopen correctly (``tests/unit/test_index.py``).

    flock /tmp/kvs-bench.lock .venv/bin/python bench/index_reopen.py --entries 1000000 --runs 3 [--json F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from kvstream.tiers.index import OP_PUT, TierIndex


def one_run(base: Path, n: int) -> tuple[float, float]:
    folder = Path(tempfile.mkdtemp(prefix="kvs-index-", dir=base))
    try:
        idx = TierIndex(folder, node_id="bench")
        for i in range(n):
            idx.record(OP_PUT, i.to_bytes(16, "little"), 1 << 20)
        idx.close()
        t0 = time.perf_counter()
        TierIndex(folder, node_id="bench").close()  # replays the log, compacts it into a snapshot
        replay = time.perf_counter() - t0
        t0 = time.perf_counter()
        again = TierIndex(folder, node_id="bench")
        snapshot = time.perf_counter() - t0
        if len(again) != n:
            raise SystemExit(f"reopened {len(again)} entries, wrote {n}")
        again.close()
        return replay, snapshot
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp", help="where the index goes (a real disk)")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    runs = [one_run(Path(a.dir), a.entries) for _ in range(a.runs)]
    replay = statistics.median(r[0] for r in runs)
    snap = statistics.median(r[1] for r in runs)
    res = {"entries": a.entries, "runs": a.runs, "reopen_log_s": replay, "reopen_snapshot_s": snap}
    print(f"{a.entries:,} entries: reopen from the log (and compact) {replay:.2f} s, from the snapshot "
          f"{snap:.2f} s (medians of {a.runs})")
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
