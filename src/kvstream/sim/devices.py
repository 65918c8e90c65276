"""Modelled storage channels: bandwidth, long-tailed per-op latency, read/write interference, other tenants.

A :class:`Device` is one independent channel: a node's NVMe, or a parallel file system that several nodes
(and other jobs) share. Its model:

- **Processor sharing.** Ops of one kind (reads or writes) in flight share that kind's bandwidth equally, so
  ``n`` reads of a channel with read bandwidth ``B`` each progress at ``B / n``. Implemented exactly with a
  virtual clock per kind (each op finishes when the kind's virtual work counter reaches its own finish
  mark), so a change in load or bandwidth costs O(log n), not O(n).
- **Long tails.** Each op's work is its bytes times a lognormal factor with mean 1 (the channel's average
  bandwidth is kept) and a spread fitted to the paper's latency percentiles: ``sigma = ln(P99/P50) / 2.326``
  (NVMe alone: 216/123 ms -> 0.24; NVMe with writes: 898/123 -> 0.85; PFS: 795/102 -> 0.88). The mixed spread
  applies to reads that start while writes are in flight.
- **Read/write interference.** While both kinds are in flight the channel time-shares between them
  (``read_share`` of its time to reads) and loses ``interference`` of its speed to the switching: the paper's
  concurrent 512 GB read + 512 GB write took 6 % (testbed 1) / 27 % (testbed 2) longer than the two apart,
  i.e. ``interference`` 0.06 / 0.27.
- **Shared by nodes.** Ops carry a client (node) id; a client's share is capped by its own link
  (``client_bw``), water-filling the rest to the other clients.
- **Other tenants.** A :class:`Background` gives the share of the channel's bandwidth taken by other jobs as
  a piecewise-constant function of time (steady, periodic, bursty); each change is an event.

Invariants: every submitted op completes exactly once, in simulated time no earlier than
``bytes / bandwidth`` after it started; bytes served per kind never exceed bandwidth x time.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstream.sim.engine import PRIO_ENV, PRIO_IO, EventLoop

__all__ = ["READ", "WRITE", "LatencyTail", "Background", "Steady", "Periodic", "Bursty", "Device", "sigma_from_pcts"]

READ = 0
WRITE = 1


def sigma_from_pcts(p50: float, p99: float) -> float:
    """Lognormal sigma whose P99/P50 ratio matches."""
    return math.log(p99 / p50) / 2.3263478740408408


@dataclass(frozen=True, slots=True, kw_only=True)
class LatencyTail:
    sigma_alone: float = 0.0  # lognormal sigma of per-op work, reads alone
    sigma_mixed: float = 0.0  # ... reads issued while writes are in flight
    sigma_write: float = 0.0  # ... writes

    def factor(self, rng: np.random.Generator, sigma: float) -> float:
        if sigma <= 0:
            return 1.0
        return math.exp(sigma * rng.standard_normal() - 0.5 * sigma * sigma)


# -- other tenants ------------------------------------------------------------------------------------------
class Background:
    """Share of a channel's bandwidth other jobs take, piecewise constant. Subclasses set the shape."""

    name = "none"

    def share_at(self, t: float) -> float:
        return 0.0

    def next_change(self, t: float) -> float:
        """First time > t at which the share changes (inf if never)."""
        return math.inf


@dataclass
class Steady(Background):
    share: float = 0.4
    name: str = "steady"

    def share_at(self, t: float) -> float:
        return self.share


@dataclass
class Periodic(Background):
    """``share`` taken during the first ``duty`` of every ``period`` seconds."""

    share: float = 0.6
    period: float = 20.0
    duty: float = 0.5
    phase: float = 0.0
    name: str = "periodic"

    def share_at(self, t: float) -> float:
        x = ((t + self.phase) % self.period) / self.period
        return self.share if x < self.duty else 0.0

    def next_change(self, t: float) -> float:
        base = t + self.phase
        k = math.floor(base / self.period)
        on_end = k * self.period + self.duty * self.period
        nxt = on_end if base < on_end - 1e-12 else (k + 1) * self.period
        return nxt - self.phase


class Bursty(Background):
    """On/off bursts: ``share`` taken during on-periods; on and off lengths lognormal (heavy-ish tails)."""

    name = "bursty"

    def __init__(self, share: float = 0.7, mean_on: float = 3.0, mean_off: float = 10.0, cv: float = 1.5,
                 seed: int = 0) -> None:
        self.share = share
        self.mean_on = mean_on
        self.mean_off = mean_off
        self.cv = cv
        self._rng = np.random.default_rng(seed)
        self._edges: list[float] = [0.0]  # change times; even index i starts an off-period
        s2 = math.log1p(cv * cv)
        self._sig = math.sqrt(s2)
        self._mu_on = math.log(mean_on) - s2 / 2
        self._mu_off = math.log(mean_off) - s2 / 2

    def _extend(self, t: float) -> None:
        # Interval i = [edges[i], edges[i+1]): even intervals are quiet, odd ones are bursts.
        while self._edges[-1] <= t:
            i = len(self._edges) - 1
            mu = self._mu_on if i % 2 == 1 else self._mu_off
            self._edges.append(self._edges[-1] + float(self._rng.lognormal(mu, self._sig)))

    def _index(self, t: float) -> int:
        self._extend(t)
        return bisect.bisect_right(self._edges, t) - 1

    def share_at(self, t: float) -> float:
        return self.share if self._index(t) % 2 == 1 else 0.0

    def next_change(self, t: float) -> float:
        return self._edges[self._index(t) + 1]


# -- the channel --------------------------------------------------------------------------------------------
class _Op:
    __slots__ = ("kind", "client", "nbytes", "work", "cb", "arg", "start")

    def __init__(self, kind: int, client: int, nbytes: int, work: float, cb: Callable[[Any], None], arg: Any,
                 start: float) -> None:
        self.kind = kind
        self.client = client
        self.nbytes = nbytes
        self.work = work
        self.cb = cb
        self.arg = arg
        self.start = start


class _Queue:
    """The ops of one kind from one client: processor-shared, finish marks on a virtual work clock."""

    __slots__ = ("heap", "v", "rate")

    def __init__(self) -> None:
        self.heap: list[tuple[float, int, _Op]] = []
        self.v = 0.0  # work served per op so far
        self.rate = 0.0  # bytes/s given to this client's ops of this kind, together


class Device:
    """One storage channel; see the module docstring. Ops complete by calling ``cb(arg)`` at completion time.

    Several *clients* (nodes) may share a device (a PFS): each kind's bandwidth is divided among the ops in
    flight, every op alike, except that a client never gets more than ``client_bw`` (its network link); what a
    capped client cannot use goes to the others (water-filling). One client = plain processor sharing.
    """

    def __init__(
        self,
        loop: EventLoop,
        name: str,
        *,
        read_bw: float,
        write_bw: float,
        interference: float = 0.0,
        read_share: float = 0.5,
        tail: LatencyTail = LatencyTail(),
        background: Background | None = None,
        rng: np.random.Generator | None = None,
        client_bw: float | None = None,
    ) -> None:
        if read_bw <= 0 or write_bw <= 0:
            raise ValueError(f"device {name}: bandwidths must be positive")
        self.loop = loop
        self.name = name
        self.bw = (float(read_bw), float(write_bw))
        self.interference = interference
        self.read_share = read_share
        self.tail = tail
        self.background = background or Background()
        self.rng = rng or np.random.default_rng(0)
        self.client_bw = client_bw
        self._q: list[dict[int, _Queue]] = [{}, {}]  # kind -> client -> its queue (only non-empty ones)
        self._n = [0, 0]  # ops in flight per kind
        self._seq = 0
        self._last = 0.0
        self._token = 0  # invalidates stale completion events
        self.bytes_done = [0, 0]  # bytes completed per kind
        self.busy_s = [0.0, 0.0]  # time with at least one op of the kind in flight
        self.ops_done = [0, 0]
        self.potential_read = 0.0  # integral of the read rate one client alone would get now (bytes)
        self._bg_share = self.background.share_at(0.0)
        nxt = self.background.next_change(0.0)
        if math.isfinite(nxt):
            loop.at(nxt, PRIO_ENV, self._on_bg_change)

    # -- public ---------------------------------------------------------------------------------------------
    def inflight(self, kind: int) -> int:
        return self._n[kind]

    def submit(self, kind: int, nbytes: int, cb: Callable[[Any], None], arg: Any = None, *, client: int = 0) -> None:
        """Start an op of ``nbytes`` now for ``client``; ``cb(arg)`` runs when it completes."""
        now = self.loop.now
        self._advance(now)
        if kind == READ:
            sigma = self.tail.sigma_mixed if self._n[WRITE] else self.tail.sigma_alone
        else:
            sigma = self.tail.sigma_write
        work = nbytes * self.tail.factor(self.rng, sigma)
        q = self._q[kind].get(client)
        if q is None:
            q = self._q[kind][client] = _Queue()
        op = _Op(kind, client, nbytes, work, cb, arg, now)
        self._seq += 1
        heapq.heappush(q.heap, (q.v + work, self._seq, op))
        self._n[kind] += 1
        self._reschedule(now)

    def read_rate_alone(self) -> float:
        """Read bytes/s one client would get now with its reads alone on the device (the bound's term)."""
        f = 1.0 - self._bg_share
        r = self.bw[READ] * f
        if self._n[WRITE]:
            r *= self.read_share / (1.0 + self.interference)
        return min(r, self.client_bw) if self.client_bw else r

    # -- internals ------------------------------------------------------------------------------------------
    def _rates(self) -> None:
        f = 1.0 - self._bg_share
        nr, nw = self._n
        for k in (READ, WRITE):
            if not self._n[k]:
                continue
            if nr and nw:
                share = self.read_share if k == READ else 1.0 - self.read_share
                total = self.bw[k] * f * share / (1.0 + self.interference)
            else:
                total = self.bw[k] * f
            qs = self._q[k]
            if len(qs) == 1 or not self.client_bw:
                n = self._n[k]
                for q in qs.values():
                    r = total * len(q.heap) / n
                    q.rate = min(r, self.client_bw) if self.client_bw else r
                continue
            # Water-filling: every op alike, no client above its link's bandwidth.
            client_bw = self.client_bw
            assert client_bw is not None  # the branch above took the uncapped case
            order = sorted(qs.values(), key=lambda q: client_bw / len(q.heap))
            left_bw, left_ops = total, self._n[k]
            for q in order:
                fair = left_bw * len(q.heap) / left_ops
                q.rate = min(fair, client_bw)
                left_bw -= q.rate
                left_ops -= len(q.heap)

    def _advance(self, now: float) -> None:
        dt = now - self._last
        if dt > 0:
            self.potential_read += dt * self.read_rate_alone()
            for k in (READ, WRITE):
                if self._n[k]:
                    self.busy_s[k] += dt
                    for q in self._q[k].values():
                        q.v += dt * q.rate / len(q.heap)
        self._last = now

    def _reschedule(self, now: float) -> None:
        self._rates()
        best = math.inf
        for k in (READ, WRITE):
            for q in self._q[k].values():
                if q.rate > 0:
                    t = now + (q.heap[0][0] - q.v) * len(q.heap) / q.rate
                    if t < best:
                        best = t
        self._token += 1
        if math.isfinite(best):
            self.loop.at(max(best, now), PRIO_IO, self._on_complete, self._token)

    def _on_complete(self, token: int) -> None:
        if token != self._token:
            return
        now = self.loop.now
        self._advance(now)
        done: list[_Op] = []
        for k in (READ, WRITE):
            qs = self._q[k]
            for c in list(qs):
                q = qs[c]
                h = q.heap
                while h and h[0][0] <= q.v + 1e-6 * max(h[0][2].work, 1.0):
                    done.append(heapq.heappop(h)[2])
                if not h:
                    del qs[c]
        for op in done:
            self._n[op.kind] -= 1
            self.bytes_done[op.kind] += op.nbytes
            self.ops_done[op.kind] += 1
        # The survivors' rates change now; reschedule before the callbacks submit more.
        self._reschedule(now)
        for op in done:
            op.cb(op.arg)

    def _on_bg_change(self) -> None:
        now = self.loop.now
        self._advance(now)
        self._bg_share = self.background.share_at(now)
        self._reschedule(now)
        nxt = self.background.next_change(now)
        if math.isfinite(nxt):
            self.loop.at(nxt, PRIO_ENV, self._on_bg_change)
