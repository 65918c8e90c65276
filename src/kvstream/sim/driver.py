"""The simulator's driver: the serving core and the modelled store of each node on one event loop.

Entities (a :class:`SimNode` per serving instance: its :class:`~kvstream.serving.core.ServingCore` and its
:class:`~kvstream.sim.storage.SimStorage`), models (:class:`~kvstream.serving.gpu.CostModel`,
:class:`~kvstream.sim.devices.Device`) and events (the core's own :mod:`kvstream.serving.core` events, on the
:class:`~kvstream.sim.engine.EventLoop`) are kept apart: the node hands each event to
:func:`kvstream.serving.backend.deliver`, the code ``kvstream replay``'s driver uses too, which carries the core's
storage actions out on the :class:`~kvstream.serving.backend.ServingBackend` (here the modelled store); only the
clock is the simulator's own (a forward step is an event on the loop).

Several nodes share a tier when its :class:`TierModel` says ``shared=True`` (one PFS for the cluster).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstream.config import StoreConfig
from kvstream.eviction import EvictionPolicy, make_eviction_policy
from kvstream.replication import parse_replication
from kvstream.read_windows import ReadWindows, make_read_windows
from kvstream.routing import parse_router
from kvstream.serving.backend import Record, deliver, dispatch, window_wanted
from kvstream.serving.core import (
    Action,
    Arrival,
    Event,
    ServingConfig,
    ServingCore,
    StartStep,
    StepDone,
    staging_budget_chunks,
)
from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape
from kvstream.serving.metrics import RunMetrics, summarize
from kvstream.sim.devices import Background, Bursty, Device, LatencyTail, Periodic, Steady
from kvstream.sim.engine import PRIO_ARRIVAL, PRIO_SAMPLE, PRIO_STEP, EventLoop
from kvstream.sim.storage import SimStorage, SimTier
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = ["TierModel", "SystemConfig", "Hardware", "SimNode", "SimResult", "simulate", "parse_background"]


_BACKGROUND_FORMS = {"steady": "steady:SHARE", "periodic": "periodic:SHARE:PERIOD_S:DUTY[:PHASE_S]",
                     "bursty": "bursty:SHARE:MEAN_ON_S:MEAN_OFF_S[:CV]"}
_BACKGROUND_ARITY = {"steady": (1, 1), "periodic": (3, 4), "bursty": (3, 4)}


def parse_background(spec: str | None, seed: int = 0) -> Background | None:
    """``steady:SHARE`` | ``periodic:SHARE:PERIOD:DUTY[:PHASE]`` | ``bursty:SHARE:MEAN_ON:MEAN_OFF[:CV]`` | None.
    A wrong kind, a wrong number of values, a value that is not a number, a share outside [0, 1] or a
    non-positive time raise ValueError naming the form expected (before, an extra value became the name)."""
    if not spec or spec == "none":
        return None
    kind, *args = spec.split(":")
    if kind not in _BACKGROUND_FORMS:
        raise ValueError(f"unknown background traffic {spec!r}; expected one of: "
                         f"{', '.join(_BACKGROUND_FORMS.values())} or none")
    lo, hi = _BACKGROUND_ARITY[kind]
    if not lo <= len(args) <= hi:
        raise ValueError(f"background traffic {spec!r}: expected {_BACKGROUND_FORMS[kind]}")
    try:
        vals = [float(a) for a in args]
    except ValueError:
        raise ValueError(f"background traffic {spec!r}: every value must be a number "
                         f"({_BACKGROUND_FORMS[kind]})") from None
    if not all(math.isfinite(v) for v in vals) or not 0.0 <= vals[0] <= 1.0:
        raise ValueError(f"background traffic {spec!r}: SHARE must be in [0, 1] and every value finite")
    if kind == "steady":
        return Steady(share=vals[0])
    if any(v <= 0 for v in vals[1:3]):
        raise ValueError(f"background traffic {spec!r}: the times must be > 0 ({_BACKGROUND_FORMS[kind]})")
    if kind == "periodic":
        if not 0.0 <= vals[2] <= 1.0:
            raise ValueError(f"background traffic {spec!r}: DUTY must be in [0, 1]")
        return Periodic(share=vals[0], period=vals[1], duty=vals[2], phase=vals[3] if len(vals) > 3 else 0.0)
    return Bursty(share=vals[0], mean_on=vals[1], mean_off=vals[2], cv=vals[3] if len(vals) > 3 else 1.5, seed=seed)


@dataclass(frozen=True, kw_only=True)
class TierModel:
    """A modelled disk tier (see :mod:`kvstream.sim.devices` for what each field means)."""

    name: str
    read_bw: float  # bytes/s, alone
    write_bw: float  # bytes/s, alone
    interference: float = 0.0  # slowdown while reads and writes mix (0.06 / 0.27 in the paper)
    read_share: float = 0.5  # share of the channel's time reads get while both kinds are in flight
    tail: LatencyTail = LatencyTail()
    background: str | None = None  # other tenants, e.g. "periodic:0.6:20:0.5"
    shared: bool = False  # one device for all nodes (a PFS)
    read_window: int = 2  # chunks in flight per load on this tier
    # The store's claim window in bytes (TierConfig.read_inflight_bytes), instead of read_window chunks: a
    # tier claims a read while it fits whole, and may always have one. None: read_window chunks.
    read_window_bytes: int | None = None
    write_depth: int = 4
    capacity_bytes: float | None = None  # this node's share; None = unlimited
    client_bw: float | None = None  # shared tier: each node's link to it (bytes/s); None = uncapped


@dataclass(frozen=True, kw_only=True)
class SystemConfig:
    """One column of a comparison: tiers, policies and the serving loop's configuration."""

    name: str
    tiers: tuple[TierModel, ...]
    router: str = "mitm"
    replication: str | Callable[[], Any] = "full"  # a spec, or a factory of a policy object (one per node)
    serving: ServingConfig = ServingConfig()
    host_memory_bytes: float = 512e9
    host_eviction: str = "lru"
    verify_s: float = 0.0  # CPU seconds per chunk read (checksum check, hand-off); 0 = free
    # "fixed": each tier keeps read_window chunks in flight (the paper's setting, and what the published
    # figures in docs/bench/sim.md used); "balanced": the store's default, kvstream.read_windows.
    read_windows: str = "fixed"
    # The smallest a tier's window may shrink to (the store's: StoreConfig.chunk_bytes, or 0 when it is not set).
    # It also sets the read-ahead bound (the sum of the windows: refills stop while that many bytes have landed
    # unchecked), so a store whose windows are smaller than a chunk refills only after the consumer checked a read.
    # None: one chunk.
    read_window_floor_bytes: int | None = None
    # The store's write backlog valve (TierConfig.write_backlog_bytes; the store's default is half its host memory):
    # a second copy is skipped and owed while its tier's unfinished writes exceed it, and paid back by a catch-up
    # pass (kvstream.sim.storage). None: off (writes queue without limit; the published figures used that).
    write_backlog_bytes: float | None = None
    # Compute joins the meeting: blocking loads may recompute their first request's front on the GPU while the
    # tiers read the rest (kvstream.compute; needs serving.compute, which kvstream's system helper sets).
    compute: bool = False
    read_disk: bool = True  # False: the recompute-only baseline (the tiers are written, never read)

    def replace(self, **kw: Any) -> "SystemConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_store(cls, config: StoreConfig, rates: Mapping[str, Mapping[str, float]], *, name: str,
                   serving: ServingConfig | None = None, verify_s: float = 0.0,
                   read_window: int = 4) -> "SystemConfig":
        """The simulator's model of a store opened with ``config``: the one place a :class:`StoreConfig` becomes a
        system. The store's settings carry over: its tiers (names, capacities, claim windows in bytes:
        ``read_inflight_bytes``), host memory and its eviction policy, router, replication, window policy, the
        windows' floor (``chunk_bytes``, or 0 when it is not set: it also sets the read-ahead bound) and the write
        backlog valve (the largest tier limit, :meth:`StoreConfig.write_backlog_limit`). What a configuration does
        not say comes from ``rates`` (per tier name: ``read_bw``, ``write_bw`` and ``mixed_read_bw``, the read rate
        while the tier writes, in bytes/s; reads get that share of the device while writes are in flight, with no
        extra switching loss), ``verify_s`` (the consumer's check, seconds per chunk read) and ``serving`` (None: the
        default serving loop).
        ``read_window``: chunks in flight per tier where a window is not given in bytes (it always is here)."""
        tiers = []
        for t in config.tiers:
            r = rates[t.name]
            tiers.append(TierModel(name=t.name, read_bw=r["read_bw"], write_bw=r["write_bw"], read_window=read_window,
                                   read_window_bytes=t.read_inflight_bytes, capacity_bytes=t.capacity_bytes,
                                   read_share=min(r["mixed_read_bw"] / r["read_bw"], 1.0), interference=0.0))
        return cls(name=name, tiers=tuple(tiers), router=config.router, replication=config.replication,
                   serving=serving or ServingConfig(), host_memory_bytes=config.memory_bytes,
                   host_eviction=config.memory_eviction, read_windows=config.read_windows,
                   read_window_floor_bytes=config.chunk_bytes or 0, verify_s=verify_s,
                   write_backlog_bytes=max(config.write_backlog_limit(t) for t in config.tiers))


@dataclass(frozen=True, kw_only=True)
class Hardware:
    gpu: str = "h100"
    model: str = "14b"
    tp: int = 4
    hbm_kv_bytes: float | None = None  # override the cost model's KV capacity
    storage_scale: float = 1.0  # stored bytes per chunk relative to K,V (0.5: Bidaw's compact tensor for MHA)

    def cost_model(self) -> CostModel:
        return CostModel(get_gpu(self.gpu), get_model_shape(self.model), self.tp)


class SimNode:
    """One serving instance in the simulation: core + store + its arrivals."""

    def __init__(self, loop: EventLoop, core: ServingCore, storage: SimStorage, requests: Sequence[Request],
                 *, on_change: Callable[[], None] | None = None, record: Record | None = None) -> None:
        self.loop = loop
        self.core = core
        self.storage = storage
        self.requests = requests
        self._next = 0
        self._on_change = on_change
        self.record = record
        self._window = window_wanted(core, storage)  # the rule replay's driver uses

    @property
    def arrivals_left(self) -> int:
        return len(self.requests) - self._next

    def start(self) -> None:
        if self.requests:
            self.loop.at(self.requests[0].arrival, PRIO_ARRIVAL, self._arrive)

    def _arrive(self) -> None:
        r = self.requests[self._next]
        self._next += 1
        if self._next < len(self.requests):
            self.loop.at(max(self.requests[self._next].arrival, self.loop.now), PRIO_ARRIVAL, self._arrive)
        self.deliver(Arrival(request=r))

    def deliver(self, ev: Event) -> None:
        deliver(self.core, self.storage, ev, self.loop.now, post=self.deliver, start_step=self._start_step,
                window=self._window, record=self.record)
        if self._on_change is not None:
            self._on_change()

    def _start_step(self, a: StartStep) -> None:
        self.loop.at(self.loop.now + a.duration, PRIO_STEP, self.deliver, StepDone(step_id=a.step_id))

    def dispatch(self, actions: Sequence[Action]) -> None:
        dispatch(actions, self.storage, post=self.deliver, start_step=self._start_step)

    @property
    def done(self) -> bool:
        return self.arrivals_left == 0 and self.core.idle


@dataclass
class SimResult:
    system: str
    nodes: list[RunMetrics]
    summary: dict[str, Any]  # over all nodes' requests
    per_node: list[dict[str, Any]]
    sim_time_s: float
    wall_s: float
    events: int
    requests: int
    # Per node, each disk load: (start, seconds, bound seconds, bytes read, bytes per tier) (SimStorage.read_log)
    read_logs: list[list[tuple[float, float, float, int, tuple[int, ...]]]] = dataclasses.field(default_factory=list)
    busy_logs: list[list[tuple[float, ...]]] = dataclasses.field(default_factory=list)  # each load's busy s per tier

    @property
    def requests_per_wall_s(self) -> float:
        return self.requests / self.wall_s if self.wall_s > 0 else math.inf


def _build_tiers(loop: EventLoop, tiers: Sequence[TierModel], chunk_bytes: int, node: int,
                 shared_devices: dict[str, Device], rng: np.random.Generator, seed: int) -> list[SimTier]:
    out = []
    for k, tm in enumerate(tiers):
        if tm.shared and tm.name in shared_devices:
            dev = shared_devices[tm.name]
        else:
            dev = Device(loop, tm.name if not tm.shared else f"{tm.name}", read_bw=tm.read_bw, write_bw=tm.write_bw,
                         interference=tm.interference, read_share=tm.read_share, tail=tm.tail,
                         background=parse_background(tm.background, seed=seed * 1000 + k),
                         rng=np.random.default_rng(rng.integers(0, 2**63)), client_bw=tm.client_bw)
            if tm.shared:
                shared_devices[tm.name] = dev
        cap = None if tm.capacity_bytes is None else max(int(tm.capacity_bytes // chunk_bytes), 1)
        out.append(SimTier(name=tm.name, device=dev, read_window=tm.read_window, write_depth=tm.write_depth,
                           capacity_chunks=cap, client=node if tm.shared else 0))
    return out


def simulate(
    workloads: Sequence[Sequence[Request]],
    system: SystemConfig,
    hardware: Hardware = Hardware(),
    *,
    seed: int = 0,
    slo_s: float = 1.0,
    sample_every_s: float | None = None,
    until: float | None = None,
    record: Record | None = None,
    prewarm: Sequence[Sequence[Sequence[Any]]] | None = None,
    prewarm_tiers: Sequence[str] | None = None,
) -> SimResult:
    """Run one configuration: ``workloads[i]`` is node ``i``'s request list (arrival order).

    ``prewarm[i]``: prefixes (chunk-id lists) already on node ``i``'s tiers when the run starts (only on the
    tiers named in ``prewarm_tiers``, if given).
    """
    t_wall = time.perf_counter()
    loop = EventLoop()
    cost = hardware.cost_model()
    chunk_bytes = int(cost.model.chunk_bytes(CHUNK_TOKENS) * hardware.storage_scale)
    rng = np.random.default_rng(seed)
    shared: dict[str, Device] = {}
    nodes: list[SimNode] = []
    serving = system.serving
    if system.compute and not serving.compute:
        serving = dataclasses.replace(serving, compute=True)
    if serving.prefetch != "none" and serving.prefetch_budget_chunks is None:
        # Prefetched KV waits pinned in host memory: half of what the write backlog valve leaves (second copies
        # exist with two tiers or more), the rest stays for puts (staging_budget_chunks).
        backlog = int(system.write_backlog_bytes or 0) if len(system.tiers) > 1 else 0
        serving = dataclasses.replace(serving, prefetch_budget_chunks=staging_budget_chunks(
            int(system.host_memory_bytes // chunk_bytes), backlog // chunk_bytes))
    if hardware.hbm_kv_bytes is not None and serving.hbm_capacity_tokens is None:
        serving = dataclasses.replace(serving, hbm_capacity_tokens=int(hardware.hbm_kv_bytes // cost.kv_bytes_per_token))

    def check_done() -> None:
        if all(n.done for n in nodes):
            for n in nodes:
                n.dispatch(n.core.flush_writes())
            if not any(n.storage.busy() for n in nodes):
                loop.stop()

    for i, reqs in enumerate(workloads):
        tiers = _build_tiers(loop, system.tiers, chunk_bytes, i, shared, rng, seed)
        compute = None
        if system.compute:
            from kvstream.compute import ComputePolicy

            # Its prior: each tier's nominal read bandwidth, as replay measures each tier before it runs (the
            # policy's own measurements take over from the first load that reads a tier).
            compute = ComputePolicy(n_tiers=len(system.tiers),
                                    bandwidth=[min(t.read_bw, t.client_bw or t.read_bw) for t in system.tiers])
        storage = SimStorage(
            loop, tiers=tiers, router=parse_router(system.router, [t.name for t in system.tiers]),
            replication=parse_replication(system.replication) if isinstance(system.replication, str)
            else system.replication(), host_eviction=_eviction(system),
            host_capacity_chunks=int(system.host_memory_bytes // chunk_bytes), chunk_bytes=chunk_bytes,
            verify_s=system.verify_s,
            read_windows=_read_windows(system, chunk_bytes),
            compute=compute, read_disk=system.read_disk,
            write_backlog_bytes=None if system.write_backlog_bytes is None else int(system.write_backlog_bytes),
        )
        if prewarm is not None:
            for prefix in prewarm[i]:
                storage.prewarm(prefix, prewarm_tiers)
        core = ServingCore(cost, storage.lookup, serving, chunk_bytes=chunk_bytes, compute=compute)
        node = SimNode(loop, core, storage, reqs, on_change=check_done, record=record)
        nodes.append(node)

    def sampler() -> None:
        for n in nodes:
            n.core.metrics.tier_series.append((loop.now, n.storage.tier_bytes()))
        check_done()
        assert sample_every_s is not None  # scheduled only when sampling is on
        loop.at(loop.now + sample_every_s, PRIO_SAMPLE, sampler)

    def write_watch() -> None:
        # Writes finishing after the last request do not call the core; poll until they drain.
        check_done()
        loop.at(loop.now + 1.0, PRIO_SAMPLE, write_watch)

    for n in nodes:
        n.start()
    if sample_every_s:
        loop.at(0.0, PRIO_SAMPLE, sampler)
    loop.at(1.0, PRIO_SAMPLE, write_watch)
    if until is None:
        # A guard against a run that never drains (a bug): far past any sensible makespan.
        last = max((w[-1].arrival for w in workloads if w), default=0.0)
        until = 20 * last + 86400.0
    loop.run(until=until)
    metrics = []
    for n in nodes:
        n.core.metrics.storage = n.storage.stats()
        n.core.metrics.tier_series.append((loop.now, n.storage.tier_bytes()))
        metrics.append(n.core.metrics)
    per_node = [summarize(m, slo_s=slo_s) for m in metrics]
    merged = RunMetrics()
    for m in metrics:
        merged.requests.extend(m.requests)
        merged.steps.extend(m.steps)
        merged.background_loads.extend(m.background_loads)
        merged.queue_samples.extend(m.queue_samples)
        for k, v in m.counters.items():
            merged.counters[k] = merged.counters.get(k, 0) + v
    merged.queue_samples.sort(key=lambda x: x[0])
    merged.storage = _sum_storage([m.storage for m in metrics])
    summary = summarize(merged, slo_s=slo_s)
    if len(metrics) > 1:
        summary["queue_len_mean"] = sum(p["queue_len_mean"] for p in per_node)
    return SimResult(
        system=system.name, nodes=metrics, summary=summary, per_node=per_node, sim_time_s=loop.now,
        wall_s=time.perf_counter() - t_wall, events=loop.events_run, requests=sum(len(w) for w in workloads),
        read_logs=[n.storage.read_log for n in nodes], busy_logs=[n.storage.busy_log for n in nodes],
    )


def _read_windows(system: SystemConfig, chunk_bytes: int) -> ReadWindows | None:
    """The store's window policy over the tiers' budgets in bytes; None: each tier's fixed ``read_window`` chunks
    (the model's original form, kept bit for bit when no byte budget or floor is given)."""
    by_bytes = system.read_window_floor_bytes is not None or any(t.read_window_bytes is not None for t in system.tiers)
    if system.read_windows == "fixed" and not by_bytes:
        return None
    budgets = [t.read_window_bytes if t.read_window_bytes is not None else t.read_window * chunk_bytes
               for t in system.tiers]
    floor = chunk_bytes if system.read_window_floor_bytes is None else system.read_window_floor_bytes
    return make_read_windows(system.read_windows, budgets, min_bytes=floor)


def _eviction(system: SystemConfig) -> EvictionPolicy:
    if system.host_eviction == "hit-potential":
        return make_eviction_policy("hit-potential", capacity_bytes=int(system.host_memory_bytes))
    return make_eviction_policy(system.host_eviction)


def _sum_storage(stats: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for s in stats:
        for k, v in s.items():
            if k == "write_amplification":
                continue
            out[k] = out.get(k, 0) + v if not k.endswith("_max") else max(out.get(k, 0), v)
    put = out.get("put_bytes", 0)
    out["read_over_bound"] = out["read_s"] / out["read_bound_s"] - 1.0 if out.get("read_bound_s") else 0.0
    written = sum(v for k, v in out.items() if k.startswith("write_bytes_"))
    out["write_amplification"] = written / put if put else 0.0
    return out
