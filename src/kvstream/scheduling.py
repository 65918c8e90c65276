"""Request schedulers (sans-I/O): which waiting requests join the running batch, and which KV loads to start.

Three policies behind one protocol:

- :class:`FCFSScheduler` — what vLLM with LMCache does today: requests join the batch in arrival order; a request
  whose KV is on disk is loaded *synchronously* when its turn comes, and the step waits for that load (the
  decision lists it in ``blocking``). A long load at the head blocks everyone behind it.
- :class:`CachedAttentionScheduler` — CachedAttention-style (ATC'24): the same FCFS admission, plus a look-ahead
  window over the first ``window`` waiting requests whose disk KV is prefetched into host memory ahead of their
  turn (bounded by the staging memory). :meth:`~CachedAttentionScheduler.window_sessions` tells a queue-aware
  eviction policy what the window will need.
- :class:`BidawScheduler` — Bidaw's I/O-aware scheduler: a *ready* queue (KV in host memory, or none needed) and
  a *preparing* queue (KV on disk). The engine runs only ready requests, in arrival order. Preparing requests are
  loaded in disk-HRRN order — highest ``1 + waiting_time / kv_bytes`` first, so small loads go first and a large
  one's ratio grows until it wins (no starvation) — while the bytes being staged in host memory stay within
  ``staging_bytes``. A load's request moves to the ready queue when the driver reports it finished.

Driving protocol (a discrete-event simulator and a real serving loop do the same; time is always passed in)::

    sched = make_scheduler("bidaw", SchedulerConfig(max_running=64, max_prefill_tokens=16384, staging_bytes=8 << 30))
    sched.on_arrival(RequestInfo(request_id=7, arrival=t, prompt_tokens=3000, disk_bytes=2_400_000_000), now=t)
    d = sched.schedule(now=t)                    # -> StepDecision
    #   d.loads:    start these disk reads now, in this order (LoadOrder: request id, bytes)
    #   d.admit:    these requests join the running batch for the next step
    #   d.blocking: the next step may start only after these loads finish (FCFS-style synchronous loads)
    sched.on_load_finished(7, now=t2)            # the request's disk KV is in host memory
    sched.on_step_finished([3, 5], now=t3)       # after a step: these requests completed and leave
    sched.on_kv_evicted(9, disk_bytes=..., now=t4)  # optional: a waiting READY request lost its KV to eviction

Call ``schedule`` whenever something changed (arrival, load finished, step finished); it is cheap and idempotent
when nothing changed. The same calls exist as event objects for drivers that queue events:
``sched.handle(Arrival(...))`` etc.

Request lifecycle (one table, checked on every transition; an illegal one raises
:class:`~kvstream.errors.UsageError` naming the request, the event and the state)::

    arrival:        (new)     -> READY       when disk_bytes == 0
                    (new)     -> PREPARING   otherwise
    schedule:       PREPARING -> LOADING     load started (in decision.loads)
                    READY     -> RUNNING     admitted (in decision.admit)
                    PREPARING -> RUNNING     admitted with a synchronous load (FCFS, CachedAttention: in loads
                    LOADING   -> RUNNING       and/or blocking)
    load finished:  LOADING   -> READY
                    RUNNING   -> RUNNING     (a synchronous load completing; nothing changes)
    kv evicted:     READY     -> PREPARING   (its KV must come from disk again)
    step finished:  RUNNING   -> (gone)

Staging memory (``staging_bytes``): the disk bytes of requests whose load was started and which have not yet
been admitted (LOADING, or READY after a load). It bounds prefetching only; a synchronous load at admission is
part of the step and does not count. Invariant: staged bytes never exceed ``staging_bytes``, except by one load
that is larger than the whole budget, started alone when nothing else is staged (or it would never run).

Batch limits: ``max_running`` requests in the batch at once, and ``max_prefill_tokens`` new tokens to compute
per step (a request's ``prefill_tokens``); admission stops at the first request that does not fit (no
skipping), except that an empty batch always admits its first candidate.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
from sortedcontainers import SortedDict

from kvstream.errors import UsageError

__all__ = [
    "RequestInfo",
    "RequestState",
    "SchedulerConfig",
    "LoadOrder",
    "StepDecision",
    "Arrival",
    "LoadFinished",
    "StepFinished",
    "KVEvicted",
    "Scheduler",
    "FCFSScheduler",
    "CachedAttentionScheduler",
    "BidawScheduler",
    "make_scheduler",
    "disk_hrrn",
]


# ---------------------------------------------------------------------------------------------------------------
# Inputs and outputs


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestInfo:
    """What the scheduler needs to know about a request; the driver fills it in from its own request type."""

    request_id: Hashable  # unique among the requests the scheduler holds
    arrival: float  # seconds (the driver's clock); waiting time counts from here
    prompt_tokens: int  # prompt length
    prefill_tokens: int | None = None  # tokens the step must compute for it (uncached part); None: prompt_tokens
    output_tokens: int = 0  # expected answer length (informational)
    memory_bytes: int = 0  # bytes of its prefix KV already in host memory
    disk_bytes: int = 0  # bytes of its prefix KV that must be read from disk before it can run
    session: Hashable | None = None  # conversation id (for queue-aware eviction)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise UsageError(f"request {self.request_id!r}: negative token count")
        if self.prefill_tokens is not None and not 0 <= self.prefill_tokens <= self.prompt_tokens:
            raise UsageError(f"request {self.request_id!r}: prefill_tokens must be in [0, prompt_tokens]")
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise UsageError(f"request {self.request_id!r}: negative KV bytes")

    @property
    def compute_tokens(self) -> int:
        return self.prompt_tokens if self.prefill_tokens is None else self.prefill_tokens


class RequestState(enum.Enum):
    PREPARING = "preparing"  # KV on disk, no load started
    LOADING = "loading"  # disk load in flight
    READY = "ready"  # KV in host memory (or none needed); waiting for the engine
    RUNNING = "running"  # in the engine's batch


@dataclass(frozen=True, slots=True, kw_only=True)
class SchedulerConfig:
    """Limits shared by all schedulers."""

    max_running: int = 256  # requests in the running batch at once
    max_prefill_tokens: int = 1 << 62  # new tokens to compute per step (all admitted requests together)
    staging_bytes: int = 1 << 62  # host memory that started-but-not-admitted loads may hold
    window: int = 32  # CachedAttention: look-ahead window (waiting requests whose KV is prefetched)

    def __post_init__(self) -> None:
        if self.max_running < 1 or self.max_prefill_tokens < 1 or self.staging_bytes < 1 or self.window < 0:
            raise UsageError(f"scheduler config out of range: {self}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOrder:
    """Start reading one request's disk KV into host memory."""

    request_id: Hashable
    nbytes: int  # disk bytes to read
    priority: float  # the order key at decision time (disk-HRRN ratio, or queue position for FCFS-style)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDecision:
    """Output of :meth:`Scheduler.schedule`."""

    now: float
    admit: tuple[Hashable, ...] = ()  # requests joining the running batch, in order
    loads: tuple[LoadOrder, ...] = ()  # loads to start now, in this order
    blocking: tuple[Hashable, ...] = ()  # admitted requests whose loads must finish before the step runs
    running: int = 0  # requests in the batch after this decision

    @property
    def empty(self) -> bool:
        return not (self.admit or self.loads)


@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    request: RequestInfo
    now: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadFinished:
    request_id: Hashable
    now: float


@dataclass(frozen=True, slots=True, kw_only=True)
class StepFinished:
    finished: tuple[Hashable, ...]  # requests that completed in the step
    now: float


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEvicted:
    request_id: Hashable
    disk_bytes: int  # bytes it now needs from disk
    now: float


Event = Arrival | LoadFinished | StepFinished | KVEvicted


def disk_hrrn(waiting_s: float, kv_bytes: int) -> float:
    """Bidaw's disk-HRRN response ratio: ``1 + waiting_time / kv_bytes`` (seconds per byte; only the order matters)."""
    return 1.0 + waiting_s / max(kv_bytes, 1)


# ---------------------------------------------------------------------------------------------------------------
# Lifecycle


_S = RequestState
_LEGAL: dict[str, frozenset[tuple[RequestState | None, RequestState | None]]] = {
    "arrival": frozenset({(None, _S.READY), (None, _S.PREPARING)}),
    "schedule": frozenset({(_S.PREPARING, _S.LOADING), (_S.READY, _S.RUNNING), (_S.PREPARING, _S.RUNNING),
                           (_S.LOADING, _S.RUNNING)}),  # fmt: skip
    "load finished": frozenset({(_S.LOADING, _S.READY), (_S.RUNNING, _S.RUNNING)}),
    "kv evicted": frozenset({(_S.READY, _S.PREPARING)}),
    "step finished": frozenset({(_S.RUNNING, None)}),
}


class Scheduler(ABC):
    """Shared bookkeeping: request table, lifecycle checks, batch limits and staging accounting."""

    name = "abstract"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        self.config = config or SchedulerConfig()
        self._info: dict[Hashable, RequestInfo] = {}
        self._state: dict[Hashable, RequestState] = {}
        self._disk: dict[Hashable, int] = {}  # current disk bytes per waiting request (changes on eviction)
        self._staged: dict[Hashable, int] = {}  # request -> bytes it holds in staging (loaded, not admitted)
        self._staging_used = 0
        self._running: set[Hashable] = set()
        self._seq = 0
        self._order: dict[Hashable, tuple[float, int]] = {}  # request -> (arrival, seq): the FCFS key

    # -- lifecycle ----------------------------------------------------------------------------------------------
    def _move(self, rid: Hashable, event: str, to: RequestState | None) -> None:
        frm = self._state.get(rid)
        if (frm, to) not in _LEGAL[event]:
            where = "unknown" if frm is None else frm.value
            raise UsageError(
                f"{self.name} scheduler: {event} for request {rid!r} is not allowed in state {where}"
                + ("" if to is None else f" (would move to {to.value})")
            )
        if to is None:
            del self._state[rid]
        else:
            self._state[rid] = to

    def state_of(self, request_id: Hashable) -> RequestState | None:
        """The request's state, or None once it finished (or was never seen)."""
        return self._state.get(request_id)

    @property
    def running(self) -> frozenset[Hashable]:
        return frozenset(self._running)

    @property
    def staging_used(self) -> int:
        return self._staging_used

    def waiting(self) -> int:
        """Requests not yet admitted."""
        return len(self._state) - len(self._running)

    def _stage(self, rid: Hashable, nbytes: int) -> None:
        self._staged[rid] = nbytes
        self._staging_used += nbytes

    def _unstage(self, rid: Hashable) -> None:
        self._staging_used -= self._staged.pop(rid, 0)

    def _fits_staging(self, nbytes: int) -> bool:
        return self._staging_used + nbytes <= self.config.staging_bytes or self._staging_used == 0

    # -- events -------------------------------------------------------------------------------------------------
    def on_arrival(self, request: RequestInfo, *, now: float) -> None:
        rid = request.request_id
        if rid in self._state:
            raise UsageError(f"{self.name} scheduler: request {rid!r} arrived twice")
        self._move(rid, "arrival", _S.READY if request.disk_bytes == 0 else _S.PREPARING)
        self._info[rid] = request
        self._disk[rid] = request.disk_bytes
        self._seq += 1
        self._order[rid] = (request.arrival, self._seq)
        self._enqueue(rid)

    def on_load_finished(self, request_id: Hashable, *, now: float) -> None:
        if self._state.get(request_id) is _S.RUNNING:
            self._move(request_id, "load finished", _S.RUNNING)
            return
        self._move(request_id, "load finished", _S.READY)
        self._loaded(request_id)

    def on_kv_evicted(self, request_id: Hashable, *, disk_bytes: int, now: float) -> None:
        if disk_bytes <= 0:
            raise UsageError(f"{self.name} scheduler: eviction of request {request_id!r} with {disk_bytes} disk bytes")
        self._move(request_id, "kv evicted", _S.PREPARING)
        self._unstage(request_id)
        self._disk[request_id] = disk_bytes
        self._evicted(request_id)

    def on_step_finished(self, finished: Iterable[Hashable], *, now: float) -> None:
        for rid in finished:
            self._move(rid, "step finished", None)
            self._running.discard(rid)
            self._info.pop(rid, None)
            self._disk.pop(rid, None)
            self._order.pop(rid, None)

    def handle(self, event: Event) -> None:
        """Feed one event object (same as calling the matching ``on_*`` method)."""
        if isinstance(event, Arrival):
            self.on_arrival(event.request, now=event.now)
        elif isinstance(event, LoadFinished):
            self.on_load_finished(event.request_id, now=event.now)
        elif isinstance(event, StepFinished):
            self.on_step_finished(event.finished, now=event.now)
        elif isinstance(event, KVEvicted):
            self.on_kv_evicted(event.request_id, disk_bytes=event.disk_bytes, now=event.now)
        else:
            raise UsageError(f"{self.name} scheduler: unknown event {event!r}")

    # -- batch limits ---------------------------------------------------------------------------------------------
    def _admission(self) -> _Admission:
        return _Admission(self.config.max_running - len(self._running), self.config.max_prefill_tokens, not self._running)

    def _admit(self, rid: Hashable) -> None:
        self._move(rid, "schedule", _S.RUNNING)
        self._running.add(rid)
        self._unstage(rid)

    # -- policy hooks -------------------------------------------------------------------------------------------
    @abstractmethod
    def _enqueue(self, rid: Hashable) -> None: ...

    @abstractmethod
    def _loaded(self, rid: Hashable) -> None: ...

    @abstractmethod
    def _evicted(self, rid: Hashable) -> None: ...

    @abstractmethod
    def schedule(self, *, now: float) -> StepDecision: ...


class _Admission:
    """Remaining room in one step: request slots and prefill tokens; the first request of an empty batch always fits."""

    __slots__ = ("slots", "tokens", "force")

    def __init__(self, slots: int, tokens: int, force: bool) -> None:
        self.slots = slots
        self.tokens = tokens
        self.force = force

    def take(self, tokens: int) -> bool:
        if self.slots <= 0:
            return False
        if tokens > self.tokens and not self.force:
            return False
        self.force = False
        self.slots -= 1
        self.tokens -= tokens
        return True


# ---------------------------------------------------------------------------------------------------------------
# FCFS and CachedAttention


class FCFSScheduler(Scheduler):
    """Arrival order; disk KV is loaded synchronously at admission (the step waits for it). No prefetching."""

    name = "fcfs"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self._queue: SortedDict = SortedDict()  # (arrival, seq) -> request id, waiting requests

    def _enqueue(self, rid: Hashable) -> None:
        self._queue[self._order[rid]] = rid

    def _loaded(self, rid: Hashable) -> None:
        pass  # stays in the queue at its arrival position, now READY

    def _evicted(self, rid: Hashable) -> None:
        pass

    def _admit_in_order(self, now: float) -> tuple[list[Hashable], list[LoadOrder], list[Hashable]]:
        room = self._admission()
        admit: list[Hashable] = []
        loads: list[LoadOrder] = []
        blocking: list[Hashable] = []
        while self._queue:
            key, rid = self._queue.peekitem(0)
            if not room.take(self._info[rid].compute_tokens):
                break
            del self._queue[key]
            state = self._state[rid]
            if state is _S.PREPARING:
                loads.append(LoadOrder(request_id=rid, nbytes=self._disk[rid], priority=float(len(admit))))
                blocking.append(rid)
            elif state is _S.LOADING:
                blocking.append(rid)  # a prefetch still in flight: the step waits for it
            self._admit(rid)
            admit.append(rid)
        return admit, loads, blocking

    def schedule(self, *, now: float) -> StepDecision:
        admit, loads, blocking = self._admit_in_order(now)
        return StepDecision(now=now, admit=tuple(admit), loads=tuple(loads), blocking=tuple(blocking),
                            running=len(self._running))  # fmt: skip


class CachedAttentionScheduler(FCFSScheduler):
    """FCFS admission plus a look-ahead window: the disk KV of the first ``config.window`` waiting requests is
    prefetched (in queue order, within ``staging_bytes``) so it is in host memory by the time they are admitted.
    A request admitted before its prefetch finished still blocks the step (listed in ``blocking``)."""

    name = "cachedattention"

    def window_sessions(self) -> list[Hashable]:
        """Sessions of the requests in the look-ahead window (for :class:`~kvstream.eviction.QueueAwarePolicy`)."""
        out = []
        for rid in islice(self._queue.values(), self.config.window):
            s = self._info[rid].session
            if s is not None:
                out.append(s)
        return out

    def schedule(self, *, now: float) -> StepDecision:
        admit, loads, blocking = self._admit_in_order(now)
        prefetch: list[LoadOrder] = []
        for pos, rid in enumerate(islice(self._queue.values(), self.config.window)):
            if self._state[rid] is not _S.PREPARING:
                continue
            nbytes = self._disk[rid]
            if not self._fits_staging(nbytes):
                break  # keep queue order: a later request does not overtake one that does not fit yet
            self._move(rid, "schedule", _S.LOADING)
            self._stage(rid, nbytes)
            prefetch.append(LoadOrder(request_id=rid, nbytes=nbytes, priority=float(pos)))
        return StepDecision(now=now, admit=tuple(admit), loads=tuple(loads) + tuple(prefetch), blocking=tuple(blocking),
                            running=len(self._running))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Bidaw


class _HRRNQueue:
    """Preparing requests in numpy slot arrays, so that the disk-HRRN maximum over 10k requests is one vectorised
    pass (~tens of microseconds) instead of a sort. Ratios change with time, so no static order could be kept.
    Ties (equal ratio, e.g. everyone arrived just now) go to the earlier arrival.

    Invariant: ``_valid[s]`` iff slot ``s`` holds a queued request; ``_ids[s]`` is that request.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._arrival = np.zeros(capacity)
        self._seq = np.zeros(capacity)
        self._size = np.ones(capacity)
        self._valid = np.zeros(capacity, dtype=bool)
        self._ids: list[Any] = [None] * capacity
        self._slot: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        n = self._arrival.shape[0]
        self._arrival = np.concatenate([self._arrival, np.zeros(n)])
        self._seq = np.concatenate([self._seq, np.zeros(n)])
        self._size = np.concatenate([self._size, np.ones(n)])
        self._valid = np.concatenate([self._valid, np.zeros(n, dtype=bool)])
        self._ids.extend([None] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def add(self, rid: Hashable, arrival: float, seq: int, nbytes: int) -> None:
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._arrival[s], self._seq[s], self._size[s] = arrival, seq, max(nbytes, 1)
        self._valid[s] = True
        self._ids[s] = rid
        self._slot[rid] = s

    def remove(self, rid: Hashable) -> None:
        s = self._slot.pop(rid)
        self._valid[s] = False
        self._ids[s] = None
        self._free.append(s)

    def ratios(self, now: float) -> np.ndarray:
        """Disk-HRRN ratio of every slot; -inf for empty slots."""
        r = 1.0 + (now - self._arrival) / self._size
        r[~self._valid] = -np.inf
        return r

    def best(self, ratios: np.ndarray) -> int:
        """Slot with the highest ratio (earliest arrival on ties); ``ratios`` as from :meth:`ratios`."""
        top = ratios.max()
        cand = np.flatnonzero(ratios == top)
        if cand.shape[0] == 1:
            return int(cand[0])
        return int(cand[np.argmin(self._seq[cand])])

    def id_at(self, slot: int) -> Hashable:
        return self._ids[slot]


class BidawScheduler(Scheduler):
    """Bidaw's I/O-aware scheduler: ready queue (arrival order) + preparing queue (disk-HRRN loads)."""

    name = "bidaw"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self._ready: SortedDict = SortedDict()  # (arrival, seq) -> request id; READY and not admitted
        self._preparing = _HRRNQueue()  # PREPARING requests (no load started)

    def _enqueue(self, rid: Hashable) -> None:
        if self._state[rid] is _S.READY:
            self._ready[self._order[rid]] = rid
        else:
            arrival, seq = self._order[rid]
            self._preparing.add(rid, arrival, seq, self._disk[rid])

    def _loaded(self, rid: Hashable) -> None:
        self._ready[self._order[rid]] = rid  # takes its arrival-order place among the ready

    def _evicted(self, rid: Hashable) -> None:
        del self._ready[self._order[rid]]
        arrival, seq = self._order[rid]
        self._preparing.add(rid, arrival, seq, self._disk[rid])

    def preparing(self) -> int:
        return len(self._preparing)

    def schedule(self, *, now: float) -> StepDecision:
        room = self._admission()
        admit: list[Hashable] = []
        while self._ready:
            key, rid = self._ready.peekitem(0)
            if not room.take(self._info[rid].compute_tokens):
                break
            del self._ready[key]
            self._admit(rid)
            admit.append(rid)
        loads: list[LoadOrder] = []
        q = self._preparing
        if len(q):
            ratios = q.ratios(now)
            while len(q):
                slot = q.best(ratios)
                rid = q.id_at(slot)
                nbytes = self._disk[rid]
                if not self._fits_staging(nbytes):
                    break  # no backfilling: the top request waits for room, so it cannot be overtaken forever
                loads.append(LoadOrder(request_id=rid, nbytes=nbytes, priority=float(ratios[slot])))
                ratios[slot] = -np.inf
                q.remove(rid)
                self._move(rid, "schedule", _S.LOADING)
                self._stage(rid, nbytes)
        return StepDecision(now=now, admit=tuple(admit), loads=tuple(loads), running=len(self._running))


_SCHEDULERS: dict[str, type[Scheduler]] = {
    "fcfs": FCFSScheduler,
    "cachedattention": CachedAttentionScheduler,
    "bidaw": BidawScheduler,
}


def make_scheduler(name: str, config: SchedulerConfig | None = None) -> Scheduler:
    """Build a scheduler by name (``fcfs``, ``cachedattention``, ``bidaw``). Raises ``KeyError`` naming the known ones."""
    try:
        cls = _SCHEDULERS[name]
    except KeyError:
        raise KeyError(f"unknown scheduler {name!r}; known: {', '.join(sorted(_SCHEDULERS))}") from None
    return cls(config)
