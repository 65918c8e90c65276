"""Request schedulers (sans-I/O): which waiting requests join the running batch, and which KV loads to start.

Three policies behind one protocol:

- :class:`FCFSScheduler` — what vLLM with LMCache does today: requests join the batch in arrival order; a request
  whose KV is on disk is loaded *synchronously* when its turn comes, and the step waits for that load (the
  decision lists it in ``blocking``). A long load at the head blocks everyone behind it.
- :class:`CachedAttentionScheduler` — CachedAttention-style (ATC'24): FCFS admission plus a look-ahead window
  over the first ``window`` waiting requests whose disk KV is prefetched into host memory ahead of their turn
  (bounded by the staging memory). A head of the queue whose prefetch is still to come or in flight waits for it
  (no skipping; the GPU keeps decoding); only a head that could never be staged (the staging memory is held by
  requests queued behind it) is admitted with a synchronous load, as FCFS would.
- :class:`BidawScheduler` — Bidaw's I/O-aware scheduler: a *ready* queue (KV in host memory, or none needed) and
  a *preparing* queue (KV on disk). The engine runs only ready requests, in arrival order. Preparing requests are
  loaded in disk-HRRN order — highest ``1 + waiting_time / kv_bytes`` first, so small loads go first and a large
  one's ratio grows until it wins — while the bytes being staged in host memory stay within ``staging_bytes`` and
  at most ``max_loading`` loads are in flight. A load's request takes its arrival-order place in the ready queue
  when the driver reports it finished. Disk-HRRN alone does not bound a wait: a large load is passed over by
  every small one whose ratio is higher, and waits ``kv_bytes / small_bytes`` times as long as they do (on agent
  traces, 137 s where FCFS took 6-19 s); so Bidaw here adds a deadline, the *wait bound* below.

Wait bound (``SchedulerConfig.max_wait_s``, ``W``; every policy keeps it, FCFS-style ones by construction): a
request that has waited ``W`` (``now - arrival >= W``) is *overdue*, and no request that arrived after an overdue
request is admitted before it, except while the overdue request's own prefetch is in flight. Bidaw serves overdue
requests first, in arrival order, as FCFS does: a ready one is admitted (with a synchronous load if its KV left
host memory: it never goes back to the preparing queue), a preparing one is admitted with a synchronous load (in
``blocking``), and one whose prefetch is in flight is admitted at the first decision after its load lands, ahead
of every later arrival (it is then the oldest ready request). From ``W / 2`` on, a preparing request's load goes
before every disk-HRRN load, oldest first, so that most are ready by their deadline and the GPU need not wait.
Hence an overdue request waits at most ``W``, plus the step in flight at its deadline, plus, for itself and each
earlier arrival still waiting then, one load and one step (a step with its synchronous loads). Assumptions: the
driver calls ``schedule`` on every event (arrival, load finished, step finished) and admits whenever the GPU
takes new requests (the deadline is checked then: there is no timer; Bidaw keeps a load or a step in flight
while anything waits, so the events keep coming); loads and steps finish in bounded time; and the batch limits
and the driver's ``reserve`` let some request in within bounded time (running requests finish). ``math.inf``: no
bound (Bidaw as published).

*Partly ready* requests (compute joins the meet-in-the-middle, :mod:`kvstream.compute`): a driver whose GPU can
recompute a request's front while the tiers read its back says how many of its disk bytes that front is
(``RequestInfo.compute_bytes``, or later :meth:`Scheduler.on_split`). That front is compute work the GPU can do
now, not disk work: the request waits on the disk for its back only. Bidaw's disk-HRRN ranks it by those bytes
(``1 + waiting_time / (disk_bytes - compute_bytes)``), so it is loaded (and then admitted) ahead of a fully
preparing request exactly when that ratio is the higher, and staging holds its back only (the front goes to the
GPU, not to host memory). Its state is still PREPARING / LOADING (one lifecycle); :meth:`Scheduler.partly_ready`
says which. FCFS-style policies keep arrival order; their staging counts the back only too.

:meth:`Scheduler.window_sessions` tells a queue-aware eviction policy (:class:`~kvstream.eviction.QueueAwarePolicy`)
the sessions of the first waiting requests, in the order the policy will serve them.

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
    sched.on_split(7, compute_bytes=..., now=t5)    # optional: a PREPARING request's recomputable front changed

Call ``schedule`` whenever something changed (arrival, load finished, step finished); it is cheap and idempotent
when nothing changed. Each call that admits is one step's admission (a fresh prefill-token budget). A driver
whose GPU is busy asks for loads only (``schedule(now=t, admit=False)``) and admits when it plans the next step.
The same calls exist as event objects for drivers that queue events: ``sched.handle(Arrival(...))`` etc.

A driver that knows more than the scheduler at admission time (a serving loop: its prefix cache may hold more of
a prompt than at arrival, host memory may have lost a waiting request's KV, GPU memory may be full) passes two
synchronous queries, asked for each candidate in the policy's order::

    d = sched.schedule(now=t, check=lambda rid: Candidate(tokens=..., disk_bytes=...),  # or None: stop here
                       reserve=lambda rid: gpu_has_room_for(rid))                      # False: stop here

``check`` reports what the candidate needs *now* (``disk_bytes`` > 0 for a READY request: its KV left host
memory; Bidaw sends it back to preparing, FCFS-style policies load it synchronously); ``reserve`` is asked once
the candidate fits the batch limits, and must take the resource it checks (it is the last word before admission).
The policy decides everything else: order, limits, which loads start, what waits.

Request lifecycle (one table, checked on every transition; an illegal one raises
:class:`~kvstream.errors.UsageError` naming the request, the event and the state)::

    arrival:        (new)     -> READY       when disk_bytes == 0
                    (new)     -> PREPARING   otherwise
    schedule:       PREPARING -> LOADING     load started (in decision.loads)
                    READY     -> RUNNING     admitted (in decision.admit; with a synchronous load if its
                                             KV left host memory and FCFS-style or overdue)
                    PREPARING -> RUNNING     admitted with a synchronous load (FCFS, CachedAttention's
                                             fallback, Bidaw's overdue: in loads and blocking)
    load finished:  LOADING   -> READY
                    RUNNING   -> RUNNING     (a synchronous load completing; nothing changes)
    kv evicted:     READY     -> PREPARING   (its KV must come from disk again)
    split:          PREPARING -> PREPARING   (its recomputable front changed: compute_bytes)
    step finished:  RUNNING   -> (gone)

Staging memory (``staging_bytes``): the disk bytes of requests whose load was started and which have not yet
been admitted (LOADING, or READY after a load) — or, with ``release_staging="prefill"``, not yet prefilled (the
driver lists them in ``on_step_finished(..., prefilled=...)``: a serving loop holds the staged KV until the GPU
has it). It bounds prefetching only; a synchronous load at admission is part of the step and does not count.
Invariant: staged bytes never exceed ``staging_bytes``, except by one load that is larger than the whole budget,
started alone when nothing else is staged (or it would never run; it then holds its own KV only, which the GPU
needs in host memory to run it, as a synchronous load of it would). A driver sizes ``staging_bytes`` to leave its
writes room in host memory (:func:`kvstream.serving.core.staging_budget_chunks`).

Batch limits: ``max_running`` requests in the batch at once, and ``max_prefill_tokens`` new tokens to compute
per step (a request's ``prefill_tokens``, or what ``check`` says); admission stops at the first request that
does not fit (no skipping), except that the first request a decision admits always fits the token budget (a
prompt longer than the budget is its step's only prefill).
"""

from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
from sortedcontainers import SortedDict  # type: ignore[import-untyped]  # no stubs published

from kvstream.errors import UsageError

__all__ = [
    "RequestInfo",
    "RequestState",
    "SchedulerConfig",
    "Candidate",
    "LoadOrder",
    "StepDecision",
    "Arrival",
    "LoadFinished",
    "StepFinished",
    "KVEvicted",
    "Split",
    "Scheduler",
    "FCFSScheduler",
    "CachedAttentionScheduler",
    "BidawScheduler",
    "make_scheduler",
    "disk_hrrn",
    "DEFAULT_MAX_WAIT_S",
]


# ---------------------------------------------------------------------------------------------------------------
# Inputs and outputs

# The wait bound's default (SchedulerConfig.max_wait_s, ServingConfig.max_wait_s): why this value, BENCHMARKS §11.
DEFAULT_MAX_WAIT_S = 60.0


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
    # of disk_bytes, the front the GPU can recompute while the tiers read the rest (partly ready; kvstream.compute)
    compute_bytes: int = 0
    session: Hashable | None = None  # conversation id (for queue-aware eviction)

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.output_tokens < 0:
            raise UsageError(f"request {self.request_id!r}: negative token count")
        if self.prefill_tokens is not None and not 0 <= self.prefill_tokens <= self.prompt_tokens:
            raise UsageError(f"request {self.request_id!r}: prefill_tokens must be in [0, prompt_tokens]")
        if self.memory_bytes < 0 or self.disk_bytes < 0:
            raise UsageError(f"request {self.request_id!r}: negative KV bytes")
        if not 0 <= self.compute_bytes <= self.disk_bytes:
            raise UsageError(f"request {self.request_id!r}: compute_bytes must be in [0, disk_bytes]")

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
    max_loading: int = 1 << 62  # prefetch loads in flight at once (LOADING requests)
    release_staging: str = "admit"  # "admit" | "prefill": when a staged request's bytes stop counting
    # Bidaw: a request waiting this long is served next, in arrival order (the wait bound; module docstring);
    # math.inf: never (Bidaw as published, where disk-HRRN alone keeps a large load from waiting forever)
    max_wait_s: float = DEFAULT_MAX_WAIT_S

    def __post_init__(self) -> None:
        if (self.max_running < 1 or self.max_prefill_tokens < 1 or self.staging_bytes < 1 or self.window < 0
                or self.max_loading < 1 or self.release_staging not in ("admit", "prefill")
                or not self.max_wait_s > 0):
            raise UsageError(f"scheduler config out of range: {self}")


class Candidate(NamedTuple):
    """A driver's answer about an admission candidate (``schedule(check=...)``): what it needs now. (A named
    tuple, not a dataclass: a serving loop builds one per candidate per step.)"""

    tokens: int  # tokens the step must compute for it now (>= 0)
    disk_bytes: int = 0  # bytes of its KV that must come from disk now (0: in host memory, or staged by its load)
    compute_bytes: int = 0  # of disk_bytes, the front the GPU can recompute (partly ready, if it goes back)


Check = Callable[[Hashable], "Candidate | None"]  # None: the candidate cannot join this step (admission stops)
Reserve = Callable[[Hashable], bool]  # False: a resource the scheduler does not track is full (admission stops)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadOrder:
    """Start reading one request's disk KV into host memory."""

    request_id: Hashable
    nbytes: int  # disk bytes to read
    priority: float  # the order key at decision time (disk-HRRN ratio, or queue position for FCFS-style)
    compute_bytes: int = 0  # of nbytes, the front the GPU is expected to recompute (partly ready)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDecision:
    """Output of :meth:`Scheduler.schedule`."""

    now: float
    admit: tuple[Hashable, ...] = ()  # requests joining the running batch, in order
    loads: tuple[LoadOrder, ...] = ()  # loads to start now, in this order
    # admitted requests whose loads must finish before the step runs (FCFS-style; Bidaw: overdue ones only)
    blocking: tuple[Hashable, ...] = ()
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
    prefilled: tuple[Hashable, ...] = ()  # running requests whose prefill ran in the step


@dataclass(frozen=True, slots=True, kw_only=True)
class KVEvicted:
    request_id: Hashable
    disk_bytes: int  # bytes it now needs from disk
    now: float
    compute_bytes: int = 0  # of those, the front the GPU can recompute


@dataclass(frozen=True, slots=True, kw_only=True)
class Split:
    request_id: Hashable
    compute_bytes: int  # of its disk bytes, the front the GPU can recompute now
    now: float


Event = Arrival | LoadFinished | StepFinished | KVEvicted | Split


def disk_hrrn(waiting_s: float, kv_bytes: int) -> float:
    """Bidaw's disk-HRRN response ratio: ``1 + waiting_time / kv_bytes`` (seconds per byte; only the order matters)."""
    return 1.0 + waiting_s / max(kv_bytes, 1)


# ---------------------------------------------------------------------------------------------------------------
# Lifecycle


_S = RequestState
_LEGAL: dict[str, frozenset[tuple[RequestState | None, RequestState | None]]] = {
    "arrival": frozenset({(None, _S.READY), (None, _S.PREPARING)}),
    "schedule": frozenset({(_S.PREPARING, _S.LOADING), (_S.READY, _S.RUNNING), (_S.PREPARING, _S.RUNNING)}),
    "load finished": frozenset({(_S.LOADING, _S.READY), (_S.RUNNING, _S.RUNNING)}),
    "kv evicted": frozenset({(_S.READY, _S.PREPARING)}),
    "split": frozenset({(_S.PREPARING, _S.PREPARING)}),
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
        self._front: dict[Hashable, int] = {}  # of those, the recomputable front (partly ready); absent: 0
        self._staged: dict[Hashable, int] = {}  # request -> bytes it holds in staging (loaded, not admitted)
        self._staging_used = 0
        self._running: set[Hashable] = set()
        self._n_loading = 0  # LOADING requests (prefetch loads in flight)
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

    def _wait_bytes(self, rid: Hashable) -> int:
        """The disk bytes the request waits for: its back (its front, if any, is compute the GPU does now)."""
        return self._disk[rid] - self._front.get(rid, 0)

    def partly_ready(self, request_id: Hashable) -> bool:
        """Waiting for a load whose front the GPU recomputes (PREPARING or LOADING with compute bytes)."""
        return (self._state.get(request_id) in (_S.PREPARING, _S.LOADING)
                and self._front.get(request_id, 0) > 0)

    def _fits_staging(self, nbytes: int) -> bool:
        return self._staging_used + nbytes <= self.config.staging_bytes or self._staging_used == 0

    def _can_start_load(self, nbytes: int) -> bool:
        return self._n_loading < self.config.max_loading and self._fits_staging(nbytes)

    def _start_load(self, rid: Hashable, priority: float) -> LoadOrder:
        nbytes = self._disk[rid]
        front = self._front.get(rid, 0)
        self._move(rid, "schedule", _S.LOADING)
        self._stage(rid, nbytes - front)  # the front goes to the GPU, not to host memory
        self._n_loading += 1
        return LoadOrder(request_id=rid, nbytes=nbytes, priority=priority, compute_bytes=front)

    # -- events -------------------------------------------------------------------------------------------------
    def on_arrival(self, request: RequestInfo, *, now: float) -> None:
        rid = request.request_id
        if rid in self._state:
            raise UsageError(f"{self.name} scheduler: request {rid!r} arrived twice")
        self._move(rid, "arrival", _S.READY if request.disk_bytes == 0 else _S.PREPARING)
        self._info[rid] = request
        self._disk[rid] = request.disk_bytes
        if request.compute_bytes:
            self._front[rid] = request.compute_bytes
        self._seq += 1
        self._order[rid] = (request.arrival, self._seq)
        self._enqueue(rid)

    def on_load_finished(self, request_id: Hashable, *, now: float) -> None:
        if self._state.get(request_id) is _S.RUNNING:
            self._move(request_id, "load finished", _S.RUNNING)
            return
        self._move(request_id, "load finished", _S.READY)
        self._n_loading -= 1
        self._loaded(request_id)

    def on_kv_evicted(self, request_id: Hashable, *, disk_bytes: int, now: float, compute_bytes: int = 0) -> None:
        if disk_bytes <= 0 or not 0 <= compute_bytes <= disk_bytes:
            raise UsageError(f"{self.name} scheduler: eviction of request {request_id!r} with {disk_bytes} disk bytes"
                             f" ({compute_bytes} recomputable)")
        self._move(request_id, "kv evicted", _S.PREPARING)
        self._unstage(request_id)
        self._disk[request_id] = disk_bytes
        self._set_front(request_id, compute_bytes)
        self._evicted(request_id)

    def on_split(self, request_id: Hashable, *, compute_bytes: int, now: float) -> None:
        """A PREPARING request's recomputable front changed (the driver's compute policy re-estimated it)."""
        self._move(request_id, "split", _S.PREPARING)
        if not 0 <= compute_bytes <= self._disk[request_id]:
            raise UsageError(f"{self.name} scheduler: request {request_id!r}: compute_bytes {compute_bytes} out of "
                             f"[0, {self._disk[request_id]}]")
        if compute_bytes != self._front.get(request_id, 0):
            self._set_front(request_id, compute_bytes)
            self._resplit(request_id)

    def _set_front(self, rid: Hashable, compute_bytes: int) -> None:
        if compute_bytes:
            self._front[rid] = compute_bytes
        else:
            self._front.pop(rid, None)

    def _resplit(self, rid: Hashable) -> None:
        """Hook: a queued PREPARING request's wait bytes changed (Bidaw re-keys its disk-HRRN entry)."""

    def on_step_finished(self, finished: Iterable[Hashable], *, now: float, prefilled: Iterable[Hashable] = ()) -> None:
        """``finished``: requests that completed in the step and leave. ``prefilled``: running requests whose prefill
        ran in the step (their staged KV is on the GPU now; matters with ``release_staging="prefill"``)."""
        for rid in prefilled:
            if self._state.get(rid) is not _S.RUNNING:
                where = self._state.get(rid)
                raise UsageError(f"{self.name} scheduler: request {rid!r} reported prefilled in state "
                                 f"{'unknown' if where is None else where.value}")
            self._unstage(rid)
        for rid in finished:
            self._move(rid, "step finished", None)
            self._unstage(rid)
            self._running.discard(rid)
            self._info.pop(rid, None)
            self._disk.pop(rid, None)
            self._front.pop(rid, None)
            self._order.pop(rid, None)

    def handle(self, event: Event) -> None:
        """Feed one event object (same as calling the matching ``on_*`` method)."""
        if isinstance(event, Arrival):
            self.on_arrival(event.request, now=event.now)
        elif isinstance(event, LoadFinished):
            self.on_load_finished(event.request_id, now=event.now)
        elif isinstance(event, StepFinished):
            self.on_step_finished(event.finished, now=event.now, prefilled=event.prefilled)
        elif isinstance(event, KVEvicted):
            self.on_kv_evicted(event.request_id, disk_bytes=event.disk_bytes, now=event.now,
                               compute_bytes=event.compute_bytes)
        elif isinstance(event, Split):
            self.on_split(event.request_id, compute_bytes=event.compute_bytes, now=event.now)
        else:
            raise UsageError(f"{self.name} scheduler: unknown event {event!r}")

    # -- batch limits ---------------------------------------------------------------------------------------------
    def _admission(self) -> _Admission:
        return _Admission(self.config.max_running - len(self._running), self.config.max_prefill_tokens)

    def _ask(self, rid: Hashable, check: Check | None) -> Candidate | None:
        """What the candidate needs now: the driver's answer, or what the scheduler was told."""
        if check is not None:
            return check(rid)
        return Candidate(tokens=self._info[rid].compute_tokens,
                         disk_bytes=0 if self._state[rid] is _S.READY else self._disk[rid])

    def _admit(self, rid: Hashable) -> None:
        self._move(rid, "schedule", _S.RUNNING)
        self._running.add(rid)
        if self.config.release_staging == "admit":
            self._unstage(rid)

    # -- queue-aware eviction ------------------------------------------------------------------------------------
    def window_sessions(self, window: int | None = None) -> list[Hashable]:
        """Sessions of the first ``window`` (default ``config.window``) waiting requests, in the order this policy
        will serve them (for :class:`~kvstream.eviction.QueueAwarePolicy`'s ``set_window``)."""
        n = self.config.window if window is None else window
        out: list[Hashable] = []
        if n <= 0:
            return out
        for rid in self._serving_order():
            s = self._info[rid].session
            if s is not None:
                out.append(s)
            n -= 1
            if n == 0:
                break
        return out

    # -- policy hooks -------------------------------------------------------------------------------------------
    @abstractmethod
    def _enqueue(self, rid: Hashable) -> None: ...

    @abstractmethod
    def _loaded(self, rid: Hashable) -> None: ...

    @abstractmethod
    def _evicted(self, rid: Hashable) -> None: ...

    @abstractmethod
    def _serving_order(self) -> Iterable[Hashable]:
        """Waiting requests, lazily, in the order this policy will admit them (as far as it is known now)."""

    @abstractmethod
    def schedule(self, *, now: float, admit: bool = True, check: Check | None = None,
                 reserve: Reserve | None = None) -> StepDecision:
        """Decide loads and (with ``admit``) one step's admission. ``check`` / ``reserve``: see the module docstring."""


class _Admission:
    """Remaining room in one step: request slots and prefill tokens; the decision's first request always fits the
    token budget (a prompt longer than the budget runs as its step's only prefill)."""

    __slots__ = ("slots", "tokens", "first")

    def __init__(self, slots: int, tokens: int) -> None:
        self.slots = slots
        self.tokens = tokens
        self.first = True

    def fits(self, tokens: int) -> bool:
        return self.slots > 0 and (tokens <= self.tokens or self.first)

    def take(self, tokens: int) -> None:
        self.first = False
        self.slots -= 1
        self.tokens -= tokens


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

    def _serving_order(self) -> Iterable[Hashable]:
        order: Iterable[Hashable] = self._queue.values()
        return order

    def _head_waits(self, rid: Hashable, state: RequestState) -> bool:
        """True: admission stops at this head (CachedAttention: it waits for its prefetch)."""
        return False

    def _admit_in_order(self, check: Check | None, reserve: Reserve | None
                        ) -> tuple[list[Hashable], list[LoadOrder], list[Hashable]]:
        room = self._admission()
        admit: list[Hashable] = []
        loads: list[LoadOrder] = []
        blocking: list[Hashable] = []
        queue = self._queue
        while queue and room.slots > 0:
            key, rid = queue.peekitem(0)
            if self._head_waits(rid, self._state[rid]):
                break
            c = check(rid) if check is not None else self._ask(rid, None)
            if c is None or not room.fits(c.tokens) or (reserve is not None and not reserve(rid)):
                break
            room.take(c.tokens)
            del queue[key]
            if c.disk_bytes > 0:  # loaded synchronously: part of the step, which waits for it
                loads.append(LoadOrder(request_id=rid, nbytes=c.disk_bytes, priority=float(len(admit))))
                blocking.append(rid)
            self._admit(rid)
            admit.append(rid)
        return admit, loads, blocking

    def schedule(self, *, now: float, admit: bool = True, check: Check | None = None,
                 reserve: Reserve | None = None) -> StepDecision:
        if not admit:
            return StepDecision(now=now, running=len(self._running))
        adm, loads, blocking = self._admit_in_order(check, reserve)
        return StepDecision(now=now, admit=tuple(adm), loads=tuple(loads), blocking=tuple(blocking),
                            running=len(self._running))  # fmt: skip


class CachedAttentionScheduler(FCFSScheduler):
    """FCFS admission plus a look-ahead window: the disk KV of the first ``config.window`` waiting requests is
    prefetched (in queue order, within ``staging_bytes`` and ``max_loading``) so it is in host memory by the time
    they are admitted. The head of the queue waits while its prefetch is in flight, or still to start: requests
    behind it do not pass (FCFS), but the step does not wait for a load either (the GPU keeps decoding). A head
    that could never be staged — everything staged is queued behind it, so nothing would free room — or any head
    with ``window=0`` is admitted with a synchronous load, as :class:`FCFSScheduler` does."""

    name = "cachedattention"

    def _head_waits(self, rid: Hashable, state: RequestState) -> bool:
        if state is _S.LOADING:
            return True
        return state is _S.PREPARING and self.config.window > 0 and self._fits_staging(self._wait_bytes(rid))

    def _prefetch_window(self) -> list[LoadOrder]:
        out: list[LoadOrder] = []
        if self._n_loading >= self.config.max_loading:
            return out
        for pos, rid in enumerate(islice(self._queue.values(), self.config.window)):
            if self._state[rid] is not _S.PREPARING:
                continue
            if not self._can_start_load(self._wait_bytes(rid)):
                break  # keep queue order: a later request does not overtake one that cannot start yet
            out.append(self._start_load(rid, float(pos)))
        return out

    def schedule(self, *, now: float, admit: bool = True, check: Check | None = None,
                 reserve: Reserve | None = None) -> StepDecision:
        adm, loads, blocking = self._admit_in_order(check, reserve) if admit else ([], [], [])
        prefetch = self._prefetch_window()  # after admission: the window is over the requests still waiting
        return StepDecision(now=now, admit=tuple(adm), loads=tuple(loads) + tuple(prefetch), blocking=tuple(blocking),
                            running=len(self._running))  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Bidaw


class _HRRNQueue:
    """Preparing requests in numpy slot arrays, so that the disk-HRRN maximum over 10k requests is one vectorised
    pass (~tens of microseconds) instead of a sort. Ratios change with time, so no static order could be kept.
    Ties (equal ratio, e.g. everyone arrived just now) go to the earlier arrival.

    Invariant: ``_valid[s]`` iff slot ``s`` holds a queued request; ``_ids[s]`` is that request. ``_sizes`` is a
    heap holding ``(bytes, slot)`` of every queued request (plus stale entries of removed ones, dropped lazily), so
    the smallest load is known without a pass: when even it cannot fit the staging memory, nothing is computed.
    """

    def __init__(self, capacity: int = 1024) -> None:
        self._arrival = np.zeros(capacity)
        self._seq = np.zeros(capacity)
        self._size = np.ones(capacity)
        self._valid = np.zeros(capacity, dtype=bool)
        self._ids: list[Any] = [None] * capacity
        self._slot: dict[Hashable, int] = {}
        self._free = list(range(capacity - 1, -1, -1))
        self._sizes: list[tuple[int, int, int]] = []  # (bytes, stamp, slot); stale when _stamp[slot] differs
        self._stamp = [0] * capacity

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        n = self._arrival.shape[0]
        self._arrival = np.concatenate([self._arrival, np.zeros(n)])
        self._seq = np.concatenate([self._seq, np.zeros(n)])
        self._size = np.concatenate([self._size, np.ones(n)])
        self._valid = np.concatenate([self._valid, np.zeros(n, dtype=bool)])
        self._ids.extend([None] * n)
        self._stamp.extend([0] * n)
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def add(self, rid: Hashable, arrival: float, seq: int, nbytes: int) -> None:
        if not self._free:
            self._grow()
        s = self._free.pop()
        self._arrival[s], self._seq[s], self._size[s] = arrival, seq, max(nbytes, 1)
        self._valid[s] = True
        self._ids[s] = rid
        self._slot[rid] = s
        self._stamp[s] += 1
        heapq.heappush(self._sizes, (max(nbytes, 1), self._stamp[s], s))

    def smallest(self) -> int:
        """Bytes of the smallest queued load (the queue must not be empty)."""
        h = self._sizes
        while not self._valid[h[0][2]] or h[0][1] != self._stamp[h[0][2]]:
            heapq.heappop(h)
        return h[0][0]

    def remove(self, rid: Hashable) -> None:
        s = self._slot.pop(rid)
        self._valid[s] = False
        self._ids[s] = None
        self._free.append(s)
        if len(self._sizes) > 2 * len(self._slot) + 64:  # drop the stale entries: the heap stays O(queued)
            self._sizes = [e for e in self._sizes if self._valid[e[2]] and e[1] == self._stamp[e[2]]]
            heapq.heapify(self._sizes)

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

    def oldest_due(self, cutoff: float) -> int:
        """Slot of the earliest-queued request that arrived at or before ``cutoff``; -1 if none did."""
        due = np.flatnonzero(self._valid & (self._arrival <= cutoff))
        if due.shape[0] == 0:
            return -1
        return int(due[np.argmin(self._seq[due])])

    def id_at(self, slot: int) -> Hashable:
        rid: Hashable = self._ids[slot]
        return rid


class BidawScheduler(Scheduler):
    """Bidaw's I/O-aware scheduler: ready queue (arrival order) + preparing queue (disk-HRRN loads), with the wait
    bound (``config.max_wait_s``): an overdue request is served next, in arrival order, as FCFS serves it.

    Invariant: ``_waiting`` holds every request not yet admitted, keyed by (arrival, seq); ``_ready`` the READY
    ones among them, ``_preparing`` the PREPARING ones."""

    name = "bidaw"

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self._ready: SortedDict = SortedDict()  # (arrival, seq) -> request id; READY and not admitted
        self._preparing = _HRRNQueue()  # PREPARING requests (no load started)
        self._waiting: SortedDict = SortedDict()  # (arrival, seq) -> request id; every request not yet admitted

    def _queue_preparing(self, rid: Hashable) -> None:
        arrival, seq = self._order[rid]
        self._preparing.add(rid, arrival, seq, self._wait_bytes(rid))  # partly ready: its back only

    def _enqueue(self, rid: Hashable) -> None:
        self._waiting[self._order[rid]] = rid
        if self._state[rid] is _S.READY:
            self._ready[self._order[rid]] = rid
        else:
            self._queue_preparing(rid)

    def _loaded(self, rid: Hashable) -> None:
        self._ready[self._order[rid]] = rid  # takes its arrival-order place among the ready

    def _evicted(self, rid: Hashable) -> None:
        del self._ready[self._order[rid]]
        self._queue_preparing(rid)

    def _resplit(self, rid: Hashable) -> None:
        self._preparing.remove(rid)
        self._queue_preparing(rid)

    def preparing(self) -> int:
        return len(self._preparing)

    def _serving_order(self) -> Iterable[Hashable]:
        # The ready queue runs first; then the preparing requests, in arrival order (their load order changes
        # with time). Requests whose load is in flight are left out: their KV is staged, not evictable.
        yield from self._ready.values()
        state = self._state
        for rid in self._waiting.values():
            if state[rid] is _S.PREPARING:
                yield rid

    def _take(self, key: tuple[float, int], rid: Hashable, c: Candidate, room: _Admission,
              adm: list[Hashable], loads: list[LoadOrder], blocking: list[Hashable]) -> None:
        """Admit ``rid`` (its queue entry ``key``), with a synchronous load when its KV is on disk now."""
        room.take(c.tokens)
        del self._waiting[key]
        if self._state[rid] is _S.READY:
            del self._ready[key]
        else:
            self._preparing.remove(rid)
        if c.disk_bytes > 0:  # loaded synchronously: part of the step, which waits for it (as FCFS does)
            loads.append(LoadOrder(request_id=rid, nbytes=c.disk_bytes, priority=float(len(adm)),
                                   compute_bytes=min(c.compute_bytes, c.disk_bytes)))
            blocking.append(rid)
        self._admit(rid)
        adm.append(rid)

    def _admit_overdue(self, now: float, room: _Admission, check: Check | None, reserve: Reserve | None,
                       adm: list[Hashable], loads: list[LoadOrder], blocking: list[Hashable]) -> bool:
        """Admit the overdue requests (waited ``max_wait_s`` or more) in arrival order, as FCFS would: a ready one
        (with a synchronous load if its KV left host memory), a preparing one with a synchronous load; one whose
        prefetch is in flight is passed, and is admitted at the first decision after its load lands. True:
        admission stops (the batch, or the driver, is full), so nothing that arrived later may be admitted now."""
        cutoff = now - self.config.max_wait_s
        waiting = self._waiting
        i = 0
        while i < len(waiting):
            key, rid = waiting.peekitem(i)
            if key[0] > cutoff:
                return False  # not overdue, nor is anything after it
            if self._state[rid] is _S.LOADING:
                i += 1  # its load lands within one load time; then it is the oldest ready request
                continue
            if room.slots <= 0:
                return True
            c = self._ask(rid, check)
            if c is None or not room.fits(c.tokens) or (reserve is not None and not reserve(rid)):
                return True
            self._take(key, rid, c, room, adm, loads, blocking)
        return False

    def schedule(self, *, now: float, admit: bool = True, check: Check | None = None,
                 reserve: Reserve | None = None) -> StepDecision:
        adm: list[Hashable] = []
        loads: list[LoadOrder] = []
        blocking: list[Hashable] = []
        if admit:
            room = self._admission()
            held = self._admit_overdue(now, room, check, reserve, adm, loads, blocking)
            ready = self._ready
            while not held and ready and room.slots > 0:
                key, rid = ready.peekitem(0)
                c = self._ask(rid, check)
                if c is None:
                    break
                if c.disk_bytes > 0:
                    # Its KV left host memory while it waited: back to the preparing queue.
                    self.on_kv_evicted(rid, disk_bytes=c.disk_bytes, now=now,
                                       compute_bytes=min(c.compute_bytes, c.disk_bytes))
                    continue
                if not room.fits(c.tokens) or (reserve is not None and not reserve(rid)):
                    break  # the batch limits, then the driver's own resources (reserve takes what it checks)
                self._take(key, rid, c, room, adm, loads, blocking)
        loads += self._prefetch(now)
        return StepDecision(now=now, admit=tuple(adm), loads=tuple(loads), blocking=tuple(blocking),
                            running=len(self._running))

    def _prefetch(self, now: float) -> list[LoadOrder]:
        """Background loads: the preparing requests that have waited half of ``max_wait_s`` first, oldest first
        (so that most are ready by their deadline and need no synchronous load), then disk-HRRN order; none
        overtakes one that cannot start yet (no backfilling: the staging memory drains for it)."""
        out: list[LoadOrder] = []
        q = self._preparing
        if not len(q) or self._n_loading >= self.config.max_loading:
            return out
        cutoff = now - self.config.max_wait_s / 2
        while len(q) and self._n_loading < self.config.max_loading:
            slot = q.oldest_due(cutoff)
            if slot < 0:
                break
            rid = q.id_at(slot)
            if not self._can_start_load(self._wait_bytes(rid)):
                return out
            q.remove(rid)
            out.append(self._start_load(rid, disk_hrrn(now - self._order[rid][0], self._wait_bytes(rid))))
        if len(q) and self._n_loading < self.config.max_loading and self._fits_staging(q.smallest()):
            ratios = q.ratios(now)
            while len(q):
                slot = q.best(ratios)
                rid = q.id_at(slot)
                if not self._can_start_load(self._wait_bytes(rid)):
                    break  # no backfilling: the top request waits for room, so it cannot be overtaken forever
                q.remove(rid)
                out.append(self._start_load(rid, float(ratios[slot])))
                ratios[slot] = -np.inf
        return out


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
