"""One node's kvstream process for the multi-node tests: reads JSON commands on stdin, answers JSON on stdout.

Run inside a node's namespaces (see :class:`client.NodeProcess`), it opens a store whose local tier is a folder
on this machine's disk and whose shared tier is a folder on that node's own FUSE mount, and does what the test
says: puts (acknowledged = put, flushed, drained, and listed by the shared tier), reads (every byte compared
with what the key's payload must be), loops of either, removes, stats, close.

Why a long-lived process driven over a pipe rather than one process per step: a test needs a store that stays
open while the other node does something (a restart, an eviction storm), and a process it can SIGKILL in the
middle of a flush.

Accounting of deletions: every chunk file this process unlinks under the shared tier's ``chunks/`` is appended
to ``--journal`` (``<key hex> <op>`` lines, written *before* the unlink, with O_APPEND, so a SIGKILL cannot lose
the record of a deletion that happened). A test can then tell a chunk that was evicted or removed (a miss is
allowed) from one that vanished without anyone deleting it (acknowledged and lost). The hook wraps ``os.unlink``
in this process only, so it sees every deletion whatever code path the engine uses.

Payloads are a pure function of the key (:func:`payload_for`), so any reader can check any chunk.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

_JOURNAL_FD: int | None = None
_SHARED_CHUNKS: str | None = None
_JOURNAL_LOCK = threading.Lock()
_HOST_PID = 0


def key_for(tag: str, i: int) -> bytes:
    """The ``i``-th key of a test's key family ``tag`` (16 bytes)."""
    return hashlib.blake2b(f"{tag}:{i}".encode(), digest_size=16).digest()


def payload_for(key: bytes, size: int) -> bytes:
    """The only correct payload of ``key``: seeded from the key, so a reader needs no side channel."""
    return np.random.default_rng(int.from_bytes(key[:8], "little")).bytes(size)


# ── deletion journal ────────────────────────────────────────────────────────────────────────────────────────


def _install_unlink_journal(path: str) -> None:
    """Journal lines: ``<key hex> unlink <unix time> <host pid>`` (the pid says which process deleted it, so a
    test can tell a deletion by a process it later killed from one by a process that lived on)."""
    global _JOURNAL_FD, _HOST_PID
    _HOST_PID = int(os.readlink("/proc/self"))  # our pid in the host's pid namespace (os.getpid() is the node's)
    _JOURNAL_FD = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    real_unlink = os.unlink

    def unlink(p: Any, *a: Any, **kw: Any) -> None:
        s = os.fsdecode(p) if not isinstance(p, int) else ""
        if _SHARED_CHUNKS and s.startswith(_SHARED_CHUNKS) and s.endswith(".kvc"):
            with _JOURNAL_LOCK:
                os.write(_JOURNAL_FD, f"{os.path.basename(s)[:-4]} unlink {time.time():.3f} {_HOST_PID}\n".encode())
        real_unlink(p, *a, **kw)

    os.unlink = unlink  # type: ignore[assignment]
    os.remove = unlink  # type: ignore[assignment]


# ── the store's work ────────────────────────────────────────────────────────────────────────────────────────


class Node:
    def __init__(self) -> None:
        self.store: Any = None
        self.shared_tier: Any = None
        self.out_lock = threading.Lock()

    def emit(self, obj: dict[str, Any]) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(obj) + "\n")
            sys.stdout.flush()

    # -- helpers --------------------------------------------------------------------------------------------
    def _shared_has(self, key: bytes) -> bool:
        return self.shared_tier is not None and self.shared_tier.contains(key)

    def _put_batch(self, keys: list[bytes], size: int, drain_s: float) -> tuple[list[str], bool, int]:
        """Put, flush, drain; returns (acknowledged keys, drained, puts accepted)."""
        accepted = 0
        for k in keys:
            accepted += bool(self.store.put(k, payload_for(k, size)))
        self.store.flush()
        drained = self.store.drain(drain_s)
        if not drained:
            return [], False, accepted
        # A copy that lost the publish race to a peer is as good as ours, but this node learns of the peer's
        # copy from the peer's index log at its next refresh: give that refresh a few seconds (forcing it),
        # then acknowledge what the shared tier lists.
        deadline = time.monotonic() + 3.0
        while True:
            pending = [k for k in keys if not self._shared_has(k)]
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(0.1)
            refresh = getattr(self.shared_tier, "maybe_refresh", None)
            if refresh is not None:
                refresh(0.0)
        acked = [k.hex() for k in keys if k not in pending]
        return acked, drained, accepted

    def _read(self, keys: list[bytes], size: int) -> dict[str, Any]:
        """One multi-key read from the tiers (host memory emptied first), every byte checked."""
        self.store.evict_memory()
        res: dict[str, Any] = {"hits": 0, "misses": 0, "wrong": 0, "missing": [], "wrong_keys": [], "sources": {}}
        for i, chunk in self.store.read_chunks(keys):
            k = keys[i]
            if chunk is None:
                res["misses"] += 1
                res["missing"].append(k.hex())
                continue
            res["hits"] += 1
            res["sources"][chunk.source] = res["sources"].get(chunk.source, 0) + 1
            if bytes(chunk.payload) != payload_for(k, size):
                res["wrong"] += 1
                res["wrong_keys"].append(k.hex())
        return res

    def _tier_stats(self) -> dict[str, Any]:
        st = self.store.stats().as_dict()
        st = st.as_dict() if hasattr(st, "as_dict") else st  # a StoreStats (kvstream.stats) or the older dict
        keep = ("chunks", "used_bytes", "read_errors", "corrupt_chunks", "missing_files", "write_chunks",
                "write_errors", "write_skipped_full", "write_skipped_unhealthy", "write_skipped_backlog",
                "already_present", "evicted_chunks", "circuit", "circuit_opened", "direct_io", "removed_temporaries")
        return {n: {k: t.get(k) for k in keep} for n, t in st["tiers"].items()} | {
            "misses": st["misses"], "disk_hits": st["disk_hits"], "lost_chunks": st["lost_chunks"]}

    # -- commands -------------------------------------------------------------------------------------------
    def op_open(self, cmd: dict[str, Any]) -> dict[str, Any]:
        import kvstream

        global _SHARED_CHUNKS
        cfg = cmd["config"]
        for t in cfg["tiers"]:
            if t.get("shared"):
                _SHARED_CHUNKS = os.path.join(t["path"], "chunks") + os.sep
        t0 = time.monotonic()
        self.store = kvstream.open_store(cfg)
        self.shared_tier = next((t for t in self.store.tiers if t.cfg.shared), None)
        return {"open_s": time.monotonic() - t0, "node_id": self.store.config.node_id,
                "hostname": socket.gethostname(), "ns_pid": os.getpid(),
                "direct": {t.name: t.direct for t in self.store.tiers}}

    def op_put(self, cmd: dict[str, Any]) -> dict[str, Any]:
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        size, batch = cmd["size"], cmd.get("batch", 16)
        acked: list[str] = []
        drained_all, accepted = True, 0
        for i in range(0, len(keys), batch):
            a, d, n = self._put_batch(keys[i:i + batch], size, cmd.get("drain_s", 60))
            acked += a
            drained_all &= d
            accepted += n
            if cmd.get("pause_s"):
                time.sleep(cmd["pause_s"])
        return {"acked": acked, "drained": drained_all, "accepted": accepted}

    def op_stream(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Write ``tag:start..`` in batches until ``count`` keys or ``seconds``; an ``acked`` event per batch
        (sent only after that batch is flushed, drained and listed: what a SIGKILL must not lose)."""
        tag, size, batch = cmd["tag"], cmd["size"], cmd.get("batch", 8)
        i, end = cmd.get("start", 0), time.monotonic() + cmd.get("seconds", 1e9)
        stop = i + cmd.get("count", 1 << 30)
        total = 0
        while i < stop and time.monotonic() < end:
            keys = [key_for(tag, j) for j in range(i, min(i + batch, stop))]
            i += len(keys)
            acked, _, _ = self._put_batch(keys, size, cmd.get("drain_s", 60))
            total += len(acked)
            self.emit({"event": "acked", "keys": acked, "next": i})
            if cmd.get("pause_s"):
                time.sleep(cmd["pause_s"])
        return {"next": i, "acked_total": total}

    def op_get(self, cmd: dict[str, Any]) -> dict[str, Any]:
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        return self._read(keys, cmd["size"])

    def op_lookup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        return {"prefix": self.store.lookup(keys), "contains": sum(self.store.contains(k) for k in keys)}

    def op_read_loop(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """For ``seconds``: read samples of the keys ``tag:0..count`` this store lists (so reads race the
        writer's evictions rather than reading keys long gone), every byte checked. Exceptions out of the
        store are counted, not raised: the point is to see whether any occur."""
        tag, size, n = cmd["tag"], cmd["size"], cmd["count"]
        keys = [key_for(tag, j) for j in range(n)]
        rng = random.Random(cmd.get("seed", 0))
        res: dict[str, Any] = {"reads": 0, "hits": 0, "misses": 0, "wrong": 0, "exceptions": 0, "errors": []}
        end = time.monotonic() + cmd["seconds"]
        while time.monotonic() < end:
            try:
                listed = [k for k in keys if self.store.contains(k)]
                if not listed:
                    time.sleep(0.05)
                    continue
                r = self._read(rng.sample(listed, min(16, len(listed))), size)
            except Exception as exc:  # noqa: BLE001 - counted: an exception here is the failure being looked for
                res["exceptions"] += 1
                if len(res["errors"]) < 3:
                    res["errors"].append(f"{type(exc).__name__}: {exc}")
                    if len(res["errors"]) == 1:
                        res["first_traceback"] = traceback.format_exc()[-2500:]
                continue
            res["reads"] += r["hits"] + r["misses"]
            res["hits"] += r["hits"]
            res["misses"] += r["misses"]
            res["wrong"] += r["wrong"]
        return res

    # -- benchmark commands (bench/dfs/reuse.py) -------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        st = self.store.stats()
        return st.as_dict() if hasattr(st, "as_dict") else st  # type: ignore[no-any-return]

    def op_bench_read(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One timed multi-key read from the tiers (host memory emptied first): seconds until the last chunk
        landed, chunks and bytes per tier; every byte is compared with the key's payload afterwards (untimed)."""
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        self.store.evict_memory()
        before = self._stats()["tiers"]
        got: dict[int, Any] = {}
        t0 = time.perf_counter()
        for i, chunk in self.store.read_chunks(keys):
            got[i] = chunk
        seconds = time.perf_counter() - t0
        after = self._stats()["tiers"]
        sources: dict[str, int] = {}
        misses = wrong = 0
        for i, chunk in got.items():
            if chunk is None:
                misses += 1
                continue
            sources[chunk.source] = sources.get(chunk.source, 0) + 1
            if cmd.get("check", True) and bytes(chunk.payload) != payload_for(keys[i], cmd["size"]):
                wrong += 1
        got.clear()
        self.store.evict_memory()
        per_tier = {n: {"bytes": after[n]["read_bytes"] - before[n]["read_bytes"],
                        "chunks": after[n]["read_chunks"] - before[n]["read_chunks"],
                        "duplicates": after[n]["duplicate_chunks"] - before[n]["duplicate_chunks"]} for n in after}
        return {"seconds": seconds, "sources": sources, "misses": misses, "wrong": wrong, "per_tier": per_tier}

    def op_rawread(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The raw O_DIRECT reader (:mod:`kvstream.io.rawread`) on the chunk files of ``keys`` in the named
        tiers of this node's store: alone (one tier) or all at once (the aggregate-bandwidth bound)."""
        from kvstream.io import make_engine
        from kvstream.io.rawread import read_files, read_tiers_concurrently

        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        if getattr(self, "_engine", None) is None:
            self._engine = make_engine(cmd.get("io_engine", "auto"))
        files = {t.name: [str(t.path_for(k)) for k in keys] for t in self.store.tiers if t.name in cmd["tiers"]}
        depth = cmd.get("depth", 8)
        if len(files) == 1:
            (name, fl), = files.items()
            r = read_files(fl, engine=self._engine, depth=depth)
            return {"seconds": r.seconds, "bytes": r.bytes, "gbps": {name: r.gbps}}
        conc = read_tiers_concurrently(files, engine=self._engine, depth=depth)
        gbps = {n: r.gbps for n, r in conc.tiers.items()}
        one_copy = conc.bytes / len(files)
        return {"seconds": conc.seconds, "bytes": conc.bytes, "gbps": gbps,
                "bound_seconds": one_copy / (sum(gbps.values()) * 1e9)}

    def op_copy_local(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A read-through copy done by the caller: read ``keys`` (from wherever the store finds them), put each
        into the named tier only (``tiers=[...]``: the replica it lacks), flush and drain. Timed in two parts."""
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        tier = cmd.get("tier", "local")
        self.store.evict_memory()
        t0 = time.perf_counter()
        chunks = dict(self.store.read_chunks(keys))
        t1 = time.perf_counter()
        self.store.evict_memory()  # the views stay valid (pinned); the puts below take their own buffers
        put = sum(bool(self.store.put(keys[i], c.payload, tiers=[tier])) for i, c in chunks.items() if c is not None)
        self.store.flush()
        drained = self.store.drain(300)
        t2 = time.perf_counter()
        chunks.clear()
        self.store.evict_memory()
        tiers = {t.name: t for t in self.store.tiers}
        return {"read_s": t1 - t0, "write_s": t2 - t1, "put": put, "drained": drained,
                "held": sum(tiers[tier].contains(k) for k in keys)}

    def op_refresh(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Look at the shared tier's index folder now (a refresh, whatever the last one's time); returns the
        index's full reloads and load retries (a file vanished under a load) so far, and the refresh's seconds."""
        t0 = time.perf_counter()
        self.shared_tier.maybe_refresh(0.0)
        idx = self.shared_tier.index
        return {"reloads": idx.reloads, "load_retries": getattr(idx, "load_retries", 0),
                "seconds": time.perf_counter() - t0}

    def op_watch(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Until the file ``until_file`` exists (at most ``seconds``): refresh the shared tier's index every
        ``interval_s`` (forced) and count how many of ``keys`` it lists after each; returns the samples where some
        were missing, the lowest count, and the index's reloads and load retries (a file vanished under a load)
        meanwhile. (This worker reads its commands one at a time, so the test stops it through a file.)"""
        keys = [bytes.fromhex(h) for h in cmd["keys"]]
        idx = self.shared_tier.index
        r0, l0 = idx.reloads, getattr(idx, "load_retries", 0)
        t0 = time.monotonic()
        short: list[tuple[float, int]] = []
        lowest, samples, slowest = len(keys), 0, 0.0
        until = cmd.get("until_file")
        stopped = False
        while time.monotonic() - t0 < cmd["seconds"]:
            if until and os.path.exists(until):
                stopped = True
                break
            t = time.monotonic()
            self.shared_tier.maybe_refresh(0.0)
            slowest = max(slowest, time.monotonic() - t)
            n = sum(1 for k in keys if self.shared_tier.contains(k))
            samples += 1
            lowest = min(lowest, n)
            if n < len(keys) and len(short) < 20:
                short.append((round(t - t0, 2), n))
            time.sleep(cmd.get("interval_s", 0.1))
        return {"samples": samples, "lowest": lowest, "short": short, "reloads": idx.reloads - r0,
                "load_retries": getattr(idx, "load_retries", 0) - l0, "slowest_refresh_s": slowest,
                "stopped": stopped, "watched_s": time.monotonic() - t0}

    def op_remove(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return {"removed": sum(self.store.remove(bytes.fromhex(h)) for h in cmd["keys"])}

    def op_stats(self, cmd: dict[str, Any]) -> dict[str, Any]:
        return self._tier_stats()

    def op_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        st = self._tier_stats()
        self.store.close()
        self.store = None
        return {"stats": st}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--journal", required=True, help="append a line per chunk file unlinked on the shared tier")
    args = ap.parse_args()
    _install_unlink_journal(args.journal)
    node = Node()
    node.emit({"event": "ready", "host_pid": int(os.readlink("/proc/self")), "ns_pid": os.getpid(),
               "hostname": socket.gethostname()})
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "exit":
            break
        try:
            reply = getattr(node, f"op_{op}")(cmd)
            node.emit({"event": "reply", "op": op, "ok": True, **reply})
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails with it
            node.emit({"event": "reply", "op": op, "ok": False, "error": f"{type(exc).__name__}: {exc}",
                       "traceback": traceback.format_exc()[-4000:]})
    if node.store is not None:
        node.store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
