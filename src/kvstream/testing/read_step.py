"""Drive a :class:`~kvstream.read_step.ReadStep` on an ideal clock, for tests of the read step and its compute
source: no I/O, no threads, every time known in advance."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from kvstream.read_step import Action, Compute, Deliver, Open, ReadState, ReadStep, Submit

__all__ = ["run_on_ideal_clock"]


def run_on_ideal_clock(step: ReadStep, read_s: float, chunk_bytes: int = 8192) -> tuple[list[int], list[int], float]:
    """Drive a step on an ideal clock: every tier read takes ``read_s`` alone (no sharing: one read a tier at a
    time by the window), each Compute its seconds; every opened file is ``chunk_bytes`` long. Returns (computed
    chunks, read chunks, end time)."""
    q: list[tuple[float, int, str, int]] = []
    seq = 0
    reads: list[int] = []

    def push(t: float, kind: str, x: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(q, (t, seq, kind, x))

    def carry(acts: Sequence[Action], now: float) -> None:
        for a in acts:
            if isinstance(a, Open):
                carry(step.opened(a.read, now, chunk_bytes), now)
            elif isinstance(a, Submit):
                push(now + read_s, "land", a.read)
            elif isinstance(a, Compute):
                push(now + a.seconds, "gpu", a.chunk)
            elif isinstance(a, Deliver):
                reads.append(a.chunk)

    carry(step.start(0.0), 0.0)
    now = 0.0
    while q and not step.done:
        now, _, kind, x = heapq.heappop(q)
        if kind == "land":
            carry(step.landed(x, now), now)
            if step.reads[x].state is ReadState.LANDED:
                carry(step.checked(x, now, True), now)
        else:
            carry(step.computed(x, now), now)
    assert step.done
    return step.computed_chunks, reads, now
