#!/usr/bin/env python3
"""Issue 20: what a chunk write costs the local disk, by where its blocks come from.

``kvstream replay``'s runs start on empty tiers, so every chunk a run writes is a fresh file: its blocks are
allocated as it is written, on this VM a file system mounted with ``discard`` on a virtual disk (the blocks of
every deleted file are handed back to the host). A store that has run for a while writes where evicted chunks
were. This measures, on the same folder and in the same run, O_DIRECT writes of whole chunk files
(``--chunk-mib``, one file per write, as the store writes them) that are:

- ``fresh``: new files in a folder nothing was deleted from just before;
- ``after-delete``: new files right after the same number of files were deleted (a run's eviction, or the
  replay's next run after the last one's folders went);
- ``overwrite``: the same files written again in place (no truncation, the blocks kept);

with 1 and 2 writes in flight (the store keeps one 48 MiB write in flight per tier: ``write_inflight_bytes``
64 MiB); and, with 1 in flight, the read bandwidth of an O_DIRECT reader of other chunk files on the same disk
while each kind of write runs, and alone (what a load gets beside the run's writes). Also the seconds per GiB to
delete such files (what the replay waits for between runs). Each cell is the median of ``--reps`` repetitions,
modes interleaved. Nothing here is a test.

Run it alone: ``flock /tmp/kvs-bench.lock .venv/bin/python bench/write_alloc.py --dir /var/tmp/kvs-walloc``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _write_files(folder: Path, n: int, buf: mmap.mmap, depth: int, create: bool) -> float:
    """Write ``n`` files of ``len(buf)`` bytes with O_DIRECT, ``depth`` at a time; GB/s."""
    def one(i: int) -> None:
        flags = os.O_WRONLY | os.O_DIRECT | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(folder / f"c{i:04d}", flags, 0o644)
        try:
            done = os.pwrite(fd, buf, 0)
            if done != len(buf):
                raise OSError(f"short write: {done} of {len(buf)} B")
        finally:
            os.close(fd)

    t = time.perf_counter()
    with ThreadPoolExecutor(depth) as ex:
        list(ex.map(one, range(n)))
    return n * len(buf) / (time.perf_counter() - t) / 1e9


class _Reader:
    """The engine's raw reader (:func:`kvstream.io.rawread.read_files`: io_uring, huge-page buffers, no
    verification) reading the files of ``folder`` round and round on a thread, ``depth`` x ``op_bytes`` in flight
    (4 x 8 MiB: a store tier's 32 MiB read window), until stopped: ``gbps``."""

    def __init__(self, folder: Path, op_bytes: int, depth: int = 4) -> None:
        import threading

        from kvstream.io import make_engine

        self._files = sorted(folder.iterdir())
        self._engine = make_engine("auto")
        self._op_bytes, self._depth = op_bytes, depth
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.gbps = 0.0

    def _run(self) -> None:
        from kvstream.io.rawread import read_files

        res = read_files(self._files, engine=self._engine, depth=self._depth, op_bytes=self._op_bytes,
                         until=self._stop)
        self.gbps = res.gbps

    def __enter__(self) -> "_Reader":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _delete(folder: Path) -> float:
    """Delete ``folder`` and sync; seconds."""
    t = time.perf_counter()
    shutil.rmtree(folder)
    os.sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", type=Path, required=True, help="a folder on the disk to measure (created, then removed)")
    ap.add_argument("--chunk-mib", type=int, default=48, help="bytes per file, MiB (default: 48, replay's chunk)")
    ap.add_argument("--files", type=int, default=32, help="files per measurement (default: 32)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions; cells are medians (default: 5)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    size = args.chunk_mib << 20
    buf = mmap.mmap(-1, size)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(1 << 20) * args.chunk_mib)  # incompressible: the host cannot dedupe or compress it
    gib = args.files * size / (1 << 30)
    args.dir.mkdir(parents=True, exist_ok=False)
    cells: dict[str, list[float]] = {}
    delete_s_per_gib: list[float] = []
    r = args.dir / "r"
    r.mkdir()
    _write_files(r, args.files, buf, 1, True)  # the reader's files (its page cache is bypassed: O_DIRECT)
    os.sync()
    try:
        for rep in range(args.reps):
            with _Reader(r, 8 << 20) as alone:
                time.sleep(2.0)
            cells.setdefault("read alone", []).append(alone.gbps)
            a = args.dir / "a"
            a.mkdir()
            os.sync()
            with _Reader(r, 8 << 20) as rd:
                w = _write_files(a, args.files, buf, 1, True)
            cells.setdefault("read beside fresh d1", []).append(rd.gbps)
            cells.setdefault("fresh d1 beside the read", []).append(w)
            with _Reader(r, 8 << 20) as rd:
                w = _write_files(a, args.files, buf, 1, False)
            cells.setdefault("read beside overwrite d1", []).append(rd.gbps)
            cells.setdefault("overwrite d1 beside the read", []).append(w)
            _delete(a)
            for depth in (1, 2):
                a, b = args.dir / "a", args.dir / "b"
                a.mkdir()
                os.sync()
                cells.setdefault(f"fresh d{depth}", []).append(_write_files(a, args.files, buf, depth, True))
                cells.setdefault(f"overwrite d{depth}", []).append(_write_files(a, args.files, buf, depth, False))
                delete_s_per_gib.append(_delete(a) / gib)
                b.mkdir()
                cells.setdefault(f"after-delete d{depth}", []).append(_write_files(b, args.files, buf, depth, True))
                _delete(b)
            print(f"rep {rep + 1}/{args.reps}: " + ", ".join(f"{k} {v[-1]:.2f}" for k, v in cells.items())
                  + " GB/s", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    out = {
        "what": "O_DIRECT writes of whole chunk files, GB/s (median of reps) by where the blocks come from",
        "dir": str(args.dir), "chunk_bytes": size, "files": args.files, "reps": args.reps,
        "median_gbps": {k: statistics.median(v) for k, v in cells.items()},
        "range_gbps": {k: [min(v), max(v)] for k, v in cells.items()},
        "delete_s_per_gib": {"median": statistics.median(delete_s_per_gib), "range": [min(delete_s_per_gib),
                                                                                     max(delete_s_per_gib)]},
    }
    for k in ("fresh d1", "after-delete d1"):
        out.setdefault("overwrite_over", {})[k] = out["median_gbps"]["overwrite d1"] / out["median_gbps"][k]
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
