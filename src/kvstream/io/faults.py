"""A fault-injecting I/O engine for in-process drills: wrap any engine, choose faults per ring, seed them.

Nothing in the product imports it: the tests and the fault drill (``bench/faults/drill.py``) pass one to
``open_store(cfg, engine=...)``. It ships in the package so operators can run the same drills on their tiers.

    plan = FaultPlan(seed=7)
    plan.add(Fault(kind="eio", rings="local-r", p=0.3))        # 30 % of the local tier's reads fail with EIO
    plan.add(Fault(kind="delay", rings="shared-r", p=0.1, delay_s=2.0))   # stalls
    store = open_store(cfg, engine=FaultyEngine(make_engine("threads"), plan))

Rings are chosen by their label with shell-style patterns: a tier's rings are ``<tier>-r`` and ``<tier>-w``
(``local-*``, ``*-w``, ``*``). Fault kinds, and the ops they apply to:

============  ======  ============================================================================
kind          ops     effect on the completion the caller sees
============  ======  ============================================================================
``eio``       both    ``result = -EIO``
``enospc``    writes  ``result = -ENOSPC`` (``edquot``: ``-EDQUOT``; ``enodata``: ``-ENODATA``, GlusterFS's answer
                      for a file whose metadata is not settled)
``short``     reads   ``result`` cut to a random length below the one transferred (a truncated file)
``flip``      reads   one random bit of the transferred bytes inverted (inside ``window`` if given)
``delay``     both    the completion is held back ``delay_s`` seconds (a stalled device); the ring
                      underneath is free meanwhile, as when a request sits in a slow device's queue
============  ======  ============================================================================

Why a wrapper around completions and not around system calls: it works the same over io_uring and the
thread pool, it needs no change in the engine under test, and the real I/O still happens (so a failed write
leaves the same temporary file a real one would, and the store must clean it up). What the caller sees is
exactly what a failing device would give it, as the engine contract defines it (``-errno``, or fewer bytes).

Invariants:
- every op submitted to a :class:`FaultyRing` gets its callback exactly once (delayed or not), and the
  wrapper's ``inflight()`` counts it until then, so ``close()`` and ``drain()`` wait for delayed ones too;
- decisions are drawn from one ``random.Random(seed)`` under a lock, in a fixed order per op (each matching
  fault draws once), so one thread submitting the same ops gets the same faults;
- every injection is counted (``FaultPlan.injected``) and the last ``log_size`` are logged with the file's
  path, so a drill can tell an expected miss (every replica hit) from a lost chunk.
"""

from __future__ import annotations

import errno
import fnmatch
import os
import random
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvstream.errors import UsageError
from kvstream.io.engine import DEFAULT_DEPTH, DEFAULT_MAX_BYTES, IOEngine, IOOp, OpKind, Ring
from kvstream.io.timer import DueTimer

__all__ = ["Fault", "FaultEvent", "FaultPlan", "FaultyEngine", "FaultyRing", "KINDS", "parse_faults"]

KINDS = ("eio", "enospc", "edquot", "enodata", "short", "flip", "delay")
_OPS = {"eio": None, "delay": None, "enospc": OpKind.WRITE, "edquot": OpKind.WRITE, "enodata": OpKind.WRITE,
        "short": OpKind.READ, "flip": OpKind.READ}  # None: reads and writes
_ERRNO = {"eio": errno.EIO, "enospc": errno.ENOSPC, "edquot": errno.EDQUOT, "enodata": errno.ENODATA}


@dataclass(frozen=True, slots=True, kw_only=True)
class Fault:
    """One kind of fault on the rings whose label matches ``rings``, with probability ``p`` per op."""

    kind: str  # one of KINDS
    rings: str = "*"  # fnmatch pattern over ring labels: "local-r", "shared-*", "*-w"
    p: float = 1.0  # probability that a matching op is hit
    delay_s: float = 0.0  # for "delay": how long the completion is held back
    limit: int | None = None  # at most this many injections, then the fault is spent
    window: tuple[int, int] | None = None  # for "flip": byte range [lo, hi) of the op to flip a bit in

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UsageError(f"Fault.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not 0.0 <= self.p <= 1.0:
            raise UsageError(f"Fault.p must be in [0, 1], got {self.p}")
        if self.kind == "delay" and self.delay_s <= 0:
            raise UsageError("Fault(kind='delay') needs delay_s > 0")
        if self.limit is not None and self.limit < 0:
            raise UsageError(f"Fault.limit must be >= 0, got {self.limit}")
        if self.window is not None and not 0 <= self.window[0] < self.window[1]:
            raise UsageError(f"Fault.window must be (lo, hi) with 0 <= lo < hi, got {self.window}")

    def applies(self, label: str, kind: OpKind) -> bool:
        want = _OPS[self.kind]
        return (want is None or want is kind) and fnmatch.fnmatchcase(label, self.rings)


@dataclass(frozen=True, slots=True)
class FaultEvent:
    """One injection, for a drill's bookkeeping."""

    ring: str  # ring label
    kind: str  # fault kind
    path: str  # the file the op was on ("" if unknown)
    offset: int = -1  # for "flip": byte offset within the op; for "short": the length kept


def _path_of(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class FaultPlan:
    """The faults in force (changeable at any time, from any thread), a seeded generator, and counters."""

    def __init__(self, faults: Iterable[Fault] = (), *, seed: int = 0, log_size: int = 100_000) -> None:
        self._lock = threading.Lock()
        self._faults: list[Fault] = list(faults)
        self._spent: Counter[int] = Counter()  # id(fault) -> injections so far (for limits)
        self._rng = random.Random(seed)
        self.counts: Counter[tuple[str, str]] = Counter()  # (ring label, kind) -> injections
        self.ops_seen: Counter[str] = Counter()  # ring label -> ops submitted
        self.events: deque[FaultEvent] = deque(maxlen=log_size)

    # -- the faults in force --------------------------------------------------------------------------------
    def add(self, fault: Fault) -> None:
        with self._lock:
            self._faults.append(fault)

    def set(self, faults: Iterable[Fault]) -> None:
        """Replace every fault in force (the counters are kept)."""
        with self._lock:
            self._faults = list(faults)

    def clear(self) -> None:
        self.set(())

    @property
    def faults(self) -> list[Fault]:
        with self._lock:
            return list(self._faults)

    # -- counters -------------------------------------------------------------------------------------------
    def injected(self, kind: str | None = None, rings: str = "*") -> int:
        """Injections so far of ``kind`` (any if None) on rings matching ``rings``."""
        with self._lock:
            return sum(n for (label, k), n in self.counts.items()
                       if (kind is None or k == kind) and fnmatch.fnmatchcase(label, rings))

    def reset_counters(self) -> None:
        with self._lock:
            self.counts.clear()
            self.ops_seen.clear()
            self.events.clear()

    # -- decisions ------------------------------------------------------------------------------------------
    def decide(self, label: str, op: IOOp) -> list[Fault]:
        """The faults that hit this op (each matching fault draws once, in order)."""
        hit: list[Fault] = []
        with self._lock:
            self.ops_seen[label] += 1
            for f in self._faults:
                if not f.applies(label, op.kind):
                    continue
                draw = self._rng.random()
                if draw >= f.p:
                    continue
                if f.limit is not None and self._spent[id(f)] >= f.limit:
                    continue
                self._spent[id(f)] += 1
                hit.append(f)
        return hit

    def _rand(self, n: int) -> int:
        with self._lock:
            return self._rng.randrange(n)

    def _note(self, label: str, kind: str, path: str, offset: int = -1) -> None:
        with self._lock:
            self.counts[(label, kind)] += 1
            self.events.append(FaultEvent(label, kind, path, offset))


class FaultyRing(Ring):
    """A ring that passes ops to ``inner`` and changes their completions as the plan decides."""

    def __init__(self, inner: Ring, label: str, plan: FaultPlan, timer: DueTimer) -> None:
        self.inner = inner
        self.label = label
        self.plan = plan
        self._timer = timer
        self.engine_name = f"{getattr(inner, 'engine_name', 'ring')}+faults"
        self._cv = threading.Condition(threading.Lock())
        self._pending = 0  # Invariant: ops submitted here whose caller callback has not returned yet

    def submit(self, ops: Sequence[IOOp]) -> None:
        for op in ops:
            hits = self.plan.decide(self.label, op)
            op.callback = self._wrap(op, op.callback, hits)
        with self._cv:
            self._pending += len(ops)
        try:
            self.inner.submit(ops)
        except BaseException:
            with self._cv:
                self._pending -= len(ops)
                self._cv.notify_all()
            raise

    def _wrap(self, op: IOOp, user_cb: Callable[[IOOp], None], hits: list[Fault]) -> Callable[[IOOp], None]:
        path = _path_of(op.fd) if hits else ""

        def finish() -> None:
            op.callback = user_cb  # the caller gets its op back as it built it
            try:
                user_cb(op)
            finally:
                with self._cv:
                    self._pending -= 1
                    if self._pending == 0:
                        self._cv.notify_all()

        def on_complete(done: IOOp) -> None:
            delay = 0.0
            for f in hits:
                if f.kind == "delay":
                    delay += f.delay_s
                    self.plan._note(self.label, "delay", path)
                elif f.kind in _ERRNO:
                    if done.result >= 0:
                        self.plan._note(self.label, f.kind, path)
                    done.result = -_ERRNO[f.kind]
                elif f.kind == "short" and done.result > 0:
                    keep = self.plan._rand(done.result)
                    done.result = keep
                    self.plan._note(self.label, "short", path, keep)
                elif f.kind == "flip" and done.result > 0:
                    lo, hi = f.window if f.window is not None else (0, done.result)
                    hi = min(hi, done.result)
                    if lo < hi:
                        off = lo + self.plan._rand(hi - lo)
                        bit = self.plan._rand(8)
                        view = done.buf.view(done.buf_offset + off, done.buf_offset + off + 1)
                        try:
                            view[0] ^= 1 << bit
                        finally:
                            view.release()
                        self.plan._note(self.label, "flip", path, off)
            if delay > 0:
                self._timer.call_at(time.monotonic() + delay, finish)
            else:
                finish()

        return on_complete

    def inflight(self) -> int:
        return self._pending

    def drain(self, timeout: float | None = None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._pending == 0, timeout)

    def close(self) -> None:
        self.drain()
        self.inner.close()


class FaultyEngine(IOEngine):
    """Wraps ``inner`` (any :class:`IOEngine`): each ring it makes is a :class:`FaultyRing` under ``plan``."""

    def __init__(self, inner: IOEngine, plan: FaultPlan | None = None) -> None:
        self.inner = inner
        self.plan = plan if plan is not None else FaultPlan()
        self.name = f"{inner.name}+faults"
        self._timer = DueTimer(name="kvs-fault-timer")
        self.rings: dict[str, FaultyRing] = {}

    def ring(self, label: str, *, depth: int = DEFAULT_DEPTH, max_bytes: int = DEFAULT_MAX_BYTES) -> Ring:
        r = FaultyRing(self.inner.ring(label, depth=depth, max_bytes=max_bytes), label, self.plan, self._timer)
        self.rings[label] = r
        return r

    def release_stalls(self) -> None:
        """Deliver every completion held back by a ``delay`` fault now."""
        self._timer.fire_all()


def parse_faults(spec: str) -> list[Fault]:
    """``KIND:RINGS[:P[:DELAY_S]]`` items, comma separated: ``eio:local-r:0.3,delay:shared-r:0.1:2``.

    Raises :class:`UsageError` naming the item that does not parse.
    """
    out: list[Fault] = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) < 2 or len(parts) > 4:
            raise UsageError(f"fault {item!r}: expected KIND:RINGS[:P[:DELAY_S]], e.g. eio:local-r:0.3")
        try:
            p = float(parts[2]) if len(parts) > 2 else 1.0
            delay = float(parts[3]) if len(parts) > 3 else 0.0
        except ValueError:
            raise UsageError(f"fault {item!r}: P and DELAY_S must be numbers") from None
        try:
            out.append(Fault(kind=parts[0], rings=parts[1], p=p, delay_s=delay))
        except UsageError as exc:
            raise UsageError(f"fault {item!r}: {exc}") from None
    return out

