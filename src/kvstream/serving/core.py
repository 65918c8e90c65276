"""The serving loop as a sans-I/O state machine, shared by the simulator and ``kvstream replay``.

The core takes events and returns actions; it never sleeps, never reads a clock (``now`` is passed in) and
never touches storage except through one synchronous *query*, ``lookup(chunk_ids) -> (present, in_host)``
(an index lookup, like the store's ``lookup``)::

    core = ServingCore(cost_model, lookup, ServingConfig(...))
    actions = core.handle(Arrival(request=r), now)          # a request arrived
    actions = core.handle(LoadDone(load_id=7, available=((rid, n), ...)), now)
    actions = core.handle(StepDone(step_id=3), now)        # the modelled forward step ended

Actions the driver must carry out, in the order given:

- :class:`StartLoad` — bring ``items`` (request id, chunk ids) into host memory, pinned, and report
  :class:`LoadDone` with how many *leading* chunks of each item are now pinned (fewer = the rest was lost;
  the core recomputes them). ``background`` loads (Bidaw's preparing queue, look-ahead prefetch) run while the
  GPU computes; the others block the next step (LMCache, KVStream).
- :class:`StartStep` — run a forward step of ``duration`` seconds of modelled GPU time, then report
  :class:`StepDone`. The duration already includes moving the step's loaded KV from host memory to HBM.
- :class:`WriteChunks` — newly computed chunks, issued when their step ends: the store buffers them in host
  memory at once (``put``; later lookups hit them there).
- :class:`Flush` — submit the buffered chunks to the disk tiers (``flush``, by the replication policy). With
  ``defer_writes`` it comes right after the next step's :class:`StartStep` (the forward pass has started) or
  when the GPU goes idle; without, right after the :class:`WriteChunks`.
- :class:`ReleaseChunks` — unpin chunks a load pinned (the GPU has them now).

Compute joins the load (``ServingConfig.compute``): a load's :class:`StartLoad` carries ``compute_s``, the
GPU seconds to recompute each chunk of each item at its prefix position (the cost model's marginal prefill
cost, over the share of the GPU free for it: :func:`kvstream.compute.gpu_share`: all of it for a blocking load,
which the GPU waits for; for a background one the smaller of the batch's free share and the GPU's recent idle
share (its steps' busy fraction), and no costs at all, so no compute, when the batch is full or the GPU never
idles). The store's read step gives every item its own front/back split
(:func:`kvstream.compute.split_load`): the GPU recomputes the items' leading chunks while the tiers read the
rest; :class:`LoadDone` says how many per item (``computed``): they are on the GPU, not pinned in host memory,
and the step's prefill treats them as cached. A background load's recompute ran beside the steps: the share of
its GPU seconds (at the whole GPU) that overlapped steps is added to the next step's duration, so the GPU's
work is conserved (otherwise the model would be optimistic: the steps would not slow down for it).

Partly ready (Bidaw with compute, and the driver's :class:`~kvstream.compute.ComputePolicy` passed as
``compute``): at arrival the core asks the policy for the front it would recompute of a request's disk KV
(:meth:`~kvstream.compute.ComputePolicy.estimate`, at the GPU share a background load gets) and tells the
scheduler (``RequestInfo.compute_bytes``): the request waits on the disk for its back only, and disk-HRRN
ranks it by those bytes (:mod:`kvstream.scheduling`). A synchronous query of the policy, like ``lookup``.

Request lifecycle in the core (one table; anything else is a bug and raises)::

    WAITING --(admitted by the scheduler)--> STEP --StepDone--> DECODING --last token--> DONE

While a request waits, its queue state (preparing / loading / ready) is the scheduler's
(:class:`kvstream.scheduling.RequestState`).

Decisions are made by a :mod:`kvstream.scheduling` policy object, which the core only drives (arrivals, loads
finished, steps finished in; admissions and loads out). The core never orders, skips or limits requests itself:
it answers the scheduler's per-candidate queries with what it knows at planning time (tokens left to compute
after its GPU prefix-cache hit, bytes that must now come from disk) and reserves GPU KV memory for each request
the scheduler admits. ``ServingConfig`` selects the policy:

- ``admit="fcfs", prefetch="none"`` -> :class:`~kvstream.scheduling.FCFSScheduler` (vLLM + LMCache): arrival
  order; what a request misses is loaded when its step starts, and the step waits.
- ``admit="fcfs", prefetch="lookahead:W"`` -> :class:`~kvstream.scheduling.CachedAttentionScheduler`: the
  disk KV of the first ``W`` waiting requests is prefetched; the head waits for its prefetch.
- ``admit="ready", prefetch="hrrn"`` -> :class:`~kvstream.scheduling.BidawScheduler`: steps take only requests
  whose KV is in host memory; the others are loaded in the background in disk-HRRN order.
- ``load_mode``: ``step`` = one read plan for all of a step's requests (KVStream) | ``request`` = one
  request's read after another (LMCache). (How a decision is carried out, not which.)
- ``max_wait_s`` (default :data:`~kvstream.scheduling.DEFAULT_MAX_WAIT_S`): the wait bound every policy keeps
  (:mod:`kvstream.scheduling` states it and its assumptions): a request that has waited this long is admitted
  no later than any request that arrived after it; Bidaw serves it next with a synchronous load if need be.
  The core calls the policy on every event, which is what the bound assumes.
- ``prefetch_budget_chunks``: the staging memory; :func:`staging_budget_chunks` sizes it so that staged KV
  and the store's write backlog never fill host memory (puts keep their room).

Queue-aware eviction: :meth:`ServingCore.window_sessions` is the policy's look-ahead window; a driver whose
host-memory eviction policy has ``set_window`` passes it on after every event (the simulator and replay do).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

from kvstream.compute import ComputePolicy, gpu_share
from kvstream.errors import UsageError
from kvstream.scheduling import (
    DEFAULT_MAX_WAIT_S,
    Candidate,
    LoadOrder,
    RequestInfo,
    Scheduler,
    SchedulerConfig,
    make_scheduler,
)
from kvstream.serving.gpu import CostModel
from kvstream.serving.hbm import HbmCache
from kvstream.serving.metrics import RequestRecord, RunMetrics, StepRecord
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = [
    "ServingConfig",
    "ServingCore",
    "scheduler_config",
    "staging_budget_chunks",
    "Arrival",
    "LoadDone",
    "StepDone",
    "StartLoad",
    "StartStep",
    "WriteChunks",
    "Flush",
    "ReleaseChunks",
    "Event",
    "Action",
    "Lookup",
    "staged_span",
]

Lookup = Callable[[Sequence[Hashable]], tuple[int, int]]  # chunk ids -> (present prefix, of which in host memory)


# -- events in ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    request: Request  # the request that arrived


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadDone:
    load_id: int  # the StartLoad this answers
    available: tuple[tuple[int, int], ...]  # (request id, leading chunks of its item now available)
    # (request id, how many of those leading chunks the GPU recomputed: on the GPU, not pinned in host memory)
    computed: tuple[tuple[int, int], ...] = ()


K = TypeVar("K")


def staged_span(item: Sequence[K], available: int, computed: int) -> Sequence[K]:
    """The chunks of a load's item that stay pinned in host memory for its request once the load is done: its
    available leading chunks (``LoadDone.available``) after the leading run the GPU recomputed
    (``LoadDone.computed``: on the GPU, never pinned). One pin per item and chunk; the core releases exactly these
    (:class:`ReleaseChunks`). The one statement of the rule both stores keep (the simulator's modelled host memory
    and replay's staged payload views) and the core releases by."""
    return item[computed:available]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    step_id: int  # the StartStep this answers


Event = Arrival | LoadDone | StepDone


# -- actions out --------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class StartLoad:
    load_id: int
    items: tuple[tuple[int, tuple[Hashable, ...]], ...]  # (request id, chunk ids to bring into host memory)
    background: bool  # True: the GPU does not wait for it
    # per item: (session, previous answer tokens, turn within the session, prefix position of the item's first
    # chunk); readers may use only the first two (the simulator's storage does)
    metas: tuple[tuple[Hashable | None, int | None, int, int], ...] = ()
    # per item: GPU seconds to recompute each of its chunks, in order (empty: the load may not recompute)
    compute_s: tuple[tuple[float, ...], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class StartStep:
    step_id: int
    duration: float  # modelled seconds of GPU time, host->HBM transfer included
    prefills: int  # requests whose prefill runs in this step
    decodes: int  # sequences decoding one token in this step


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteChunks:
    request_id: int
    chunk_ids: tuple[Hashable, ...]  # newly computed chunks, in prefix order
    first_position: int  # index of chunk_ids[0] within the request's prefix
    session: Hashable | None = None  # for eviction policies that track conversations
    prev_answer_tokens: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Flush:
    """Submit every buffered write to the disk tiers (the store's ``flush``: the step boundary)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseChunks:
    chunk_ids: tuple[Hashable, ...]  # chunks pinned by an earlier load, now on the GPU


Action = StartLoad | StartStep | WriteChunks | Flush | ReleaseChunks


# -- configuration ------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ServingConfig:
    admit: str = "fcfs"  # "fcfs" | "ready"  (with prefetch: selects the kvstream.scheduling policy)
    prefetch: str = "none"  # "none" | "hrrn" | "lookahead:W"
    load_mode: str = "step"  # "step" | "request"
    defer_writes: bool = True  # issue a step's writes once the next step has started
    max_batch_tokens: int = 32768  # prompt tokens computed per step (a longer prompt runs alone)
    max_running: int = 256  # sequences on the GPU at once (vLLM's max_num_seqs)
    max_background_loads: int = 1  # prefetch loads in flight at once
    # chunks read from disk ahead of the GPU, held until it has them (staging_budget_chunks sizes it so that puts
    # keep their room in host memory); None: unlimited (the simulator and replay size it; a bare core does not)
    prefetch_budget_chunks: int | None = None
    hbm_capacity_tokens: int | None = None  # default: the cost model's KV capacity
    compute: bool = False  # loads may recompute their items' fronts (kvstream.compute)
    # The wait bound (kvstream.scheduling): a request waiting this long is served next, in arrival order, with a
    # synchronous load if its KV is not in host memory; math.inf: none (Bidaw as published)
    max_wait_s: float = DEFAULT_MAX_WAIT_S

    def __post_init__(self) -> None:
        if self.admit not in ("fcfs", "ready"):
            raise UsageError(f"ServingConfig.admit must be 'fcfs' or 'ready', got {self.admit!r}")
        if self.load_mode not in ("step", "request"):
            raise UsageError(f"ServingConfig.load_mode must be 'step' or 'request', got {self.load_mode!r}")
        kind, _, arg = self.prefetch.partition(":")
        if kind not in ("none", "hrrn", "lookahead") or (kind == "lookahead" and not arg.isdigit()):
            raise UsageError(f"ServingConfig.prefetch must be none, hrrn or lookahead:W, got {self.prefetch!r}")
        if self.admit == "ready" and kind != "hrrn":
            raise UsageError("ServingConfig: admit='ready' needs a prefetch policy: hrrn (Bidaw)")
        if self.admit == "fcfs" and kind == "hrrn":
            raise UsageError("ServingConfig: prefetch='hrrn' is Bidaw's preparing queue: use it with admit='ready'")
        if self.max_batch_tokens < 1 or self.max_running < 1 or self.max_background_loads < 1:
            raise UsageError("ServingConfig: max_batch_tokens, max_running, max_background_loads must be >= 1")
        if not self.max_wait_s > 0:
            raise UsageError(f"ServingConfig.max_wait_s must be > 0 seconds (math.inf: no bound), got {self.max_wait_s!r}")
        if self.prefetch_budget_chunks is not None and self.prefetch_budget_chunks < 1:
            raise UsageError("ServingConfig.prefetch_budget_chunks must be >= 1 (None: unlimited)")

    @property
    def lookahead(self) -> int:
        kind, _, arg = self.prefetch.partition(":")
        return int(arg) if kind == "lookahead" else 0

    @property
    def scheduler(self) -> str:
        """The :func:`kvstream.scheduling.make_scheduler` name this configuration selects."""
        if self.admit == "ready":
            return "bidaw"
        return "cachedattention" if self.lookahead else "fcfs"

    @property
    def eviction_window(self) -> int:
        """Waiting requests whose sessions a queue-aware eviction policy protects: the look-ahead window; 32 for
        Bidaw's queues; none without prefetching (what the simulator's driver has always used)."""
        return self.lookahead or (32 if self.prefetch != "none" else 0)


def scheduler_config(cfg: ServingConfig, chunk_bytes: int) -> SchedulerConfig:
    """The limits a serving configuration gives its policy: batch slots and prefill tokens, the prefetch budget
    (held until the GPU has the KV: it stays pinned in host memory until then), background loads in flight, the
    wait bound."""
    budget = cfg.prefetch_budget_chunks
    return SchedulerConfig(
        max_running=cfg.max_running, max_prefill_tokens=cfg.max_batch_tokens,
        staging_bytes=max(budget * chunk_bytes, 1) if budget is not None else 1 << 62,
        window=cfg.eviction_window, max_loading=cfg.max_background_loads, release_staging="prefill",
        max_wait_s=cfg.max_wait_s,
    )


def staging_budget_chunks(host_chunks: int, backlog_chunks: int = 0) -> int:
    """The prefetch budget (``ServingConfig.prefetch_budget_chunks``) that leaves the store's puts their room, for a
    host memory of ``host_chunks`` chunks whose write backlog valve lets ``backlog_chunks`` second copies wait for
    a slower tier (the store's ``TierConfig.write_backlog_bytes``, half of host memory by default; 0 with one tier
    or one copy).

    Host memory holds three kinds of chunks no put can evict: KV staged for waiting requests (pinned until the GPU
    has it), second copies waiting for the slower tier (at most the valve's), and first copies on their way to the
    local tier. A put waits (and is dropped after ``Store.put_wait_s``) only when the three fill host memory. So
    staging gets half of what the valve leaves and the other half stays for the first copies:
    ``(host_chunks - backlog_chunks) // 2``, at least one. Invariant: ``2 x staging + backlog <= host_chunks``
    (when the valve leaves at least two chunks). Staging half of host memory beside a valve at the other half left
    the puts nothing (on agent traces, puts waited 31-35 s and some were dropped)."""
    return max((host_chunks - max(backlog_chunks, 0)) // 2, 1)


class Phase(Enum):
    WAITING = "waiting"  # in the scheduler's queues (preparing / loading / ready: the scheduler's state)
    STEP = "step"  # in the step being loaded or computed
    DECODING = "decoding"
    DONE = "done"


_LEGAL = {
    (Phase.WAITING, Phase.STEP),
    (Phase.STEP, Phase.DECODING),
    (Phase.STEP, Phase.DONE),
    (Phase.DECODING, Phase.DONE),
}


class _Req:
    """Per-request state. Invariant: ``pins`` lists every chunk tuple this request holds pinned in host memory."""

    __slots__ = ("req", "rid", "phase", "rec", "hbm_hit", "present", "in_host", "avail", "pins", "kv_bytes",
                 "prefetched", "computed")

    def __init__(self, req: Request, kv_bytes_per_chunk: int) -> None:
        self.req = req
        self.rid = req.request_id
        self.phase = Phase.WAITING
        self.rec = RequestRecord(
            request_id=req.request_id, arrival=req.arrival, input_tokens=req.input_tokens,
            output_tokens=req.output_tokens, chunks=len(req.chunk_ids),
        )
        self.hbm_hit = 0  # leading chunks in HBM (when last looked)
        self.present = 0  # chunks after those that host memory or a disk holds
        self.in_host = 0  # of ``present``, how many are in host memory
        self.avail = 0  # of ``present``, how many are pinned in host memory for this request
        self.pins: list[tuple[Hashable, ...]] = []
        self.kv_bytes = 0  # bytes to load from disk (when last looked)
        self.prefetched = False  # a background load ran for it: ``avail`` chunks are pinned
        self.computed = 0  # of ``avail``, the leading chunks its last load recomputed on the GPU (not pinned)

    def move(self, to: Phase) -> None:
        if (self.phase, to) not in _LEGAL:
            raise AssertionError(f"request {self.rid}: illegal transition {self.phase.value} -> {to.value}")
        self.phase = to


@dataclass(slots=True)
class _Step:
    step_id: int
    batch: list[_Req]
    n_dec: int
    sum_ctx: int
    start: float
    load_s: float = 0.0
    load_bytes: int = 0
    pending_loads: int = 0
    run_start: float = math.nan  # when its forward pass started (after its loads)


class ServingCore:
    """One serving instance (one TP group). See the module docstring for the protocol."""

    def __init__(self, cost: CostModel, lookup: Lookup, config: ServingConfig | None = None, *,
                 chunk_bytes: int | None = None, scheduler: Scheduler | None = None,
                 compute: ComputePolicy | None = None) -> None:
        self.cost = cost
        self.cfg = config or ServingConfig()
        self._lookup = lookup
        # The driver's compute policy (the store's), asked for a waiting request's front (partly ready). None:
        # the scheduler sees whole loads.
        self.compute = compute if self.cfg.compute else None
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else cost.model.chunk_bytes(CHUNK_TOKENS)
        cap = self.cfg.hbm_capacity_tokens or int(cost.kv_capacity_bytes // cost.kv_bytes_per_token)
        self.hbm = HbmCache(cap)
        self.metrics = RunMetrics()
        # The policy: ``scheduler`` (tests, custom policies) or the one the configuration names.
        self.scheduler = (scheduler if scheduler is not None
                          else make_scheduler(self.cfg.scheduler, scheduler_config(self.cfg, self.chunk_bytes)))
        self._reqs: dict[int, _Req] = {}
        self._n_waiting = 0
        self._n_finished = 0
        self._bg_inflight = 0
        self._loads: dict[int, tuple[_Step | None, list[_Req], float]] = {}  # load id -> (step, reqs, start)
        self._next_load = 0
        self._next_step = 0
        self._step: _Step | None = None  # the step being loaded or computed
        self._seq_loads: deque[tuple[int, tuple[Hashable, ...]]] = deque()  # load_mode=request: items left
        self._flush_pending = False
        # GPU seconds background loads recomputed while steps ran: charged to the next step (the GPU did that
        # work instead of the steps' work; the recompute itself was modelled at the GPU's free share)
        self._gpu_debt = 0.0
        self._gpu_busy_s = 0.0  # seconds of forward passes finished so far
        self._util = 0.0  # the GPU's recent busy fraction (an exponential average over steps)
        self._util_t: float | None = None  # when it was last updated
        self._bg_busy0: dict[int, float] = {}  # background load -> GPU busy seconds when it started
        # decoding: counter of decode steps run, heap of (finish counter, rid)
        self._dcount = 0
        self._n_dec = 0
        self._sum_ctx = 0
        self._dheap: list[tuple[int, int]] = []
        self._dstart: dict[int, int] = {}

    # -- public -------------------------------------------------------------------------------------------
    def handle(self, event: Event, now: float) -> list[Action]:
        out: list[Action] = []
        if isinstance(event, Arrival):
            self._on_arrival(event.request, now, out)
        elif isinstance(event, LoadDone):
            self._on_load_done(event, now, out)
        elif isinstance(event, StepDone):
            self._on_step_done(event, now, out)
        else:  # pragma: no cover - typing guards this
            raise UsageError(f"unknown event {event!r}")
        self._plan(now, out)
        return out

    def flush_writes(self) -> list[Action]:
        """A deferred flush still held (the run ended with the GPU idle)."""
        if not self._flush_pending:
            return []
        self._flush_pending = False
        return [Flush()]

    @property
    def idle(self) -> bool:
        return self._step is None and not self._n_dec and not self._n_waiting and not self._bg_inflight

    @property
    def waiting(self) -> int:
        return self._n_waiting

    @property
    def finished(self) -> int:
        """Requests completed so far."""
        return self._n_finished

    def window_sessions(self, window: int | None = None) -> list[Hashable]:
        """Sessions of the first ``window`` (default: ``cfg.eviction_window``) waiting requests in the policy's
        serving order: what a queue-aware eviction policy protects (``set_window``)."""
        return self.scheduler.window_sessions(self.cfg.eviction_window if window is None else window)

    # -- events -------------------------------------------------------------------------------------------
    def _on_arrival(self, req: Request, now: float, out: list[Action]) -> None:
        if req.request_id in self._reqs:
            raise UsageError(f"request {req.request_id} arrived twice")
        r = _Req(req, self.chunk_bytes)
        self._locate(r)
        self.scheduler.on_arrival(RequestInfo(
            request_id=r.rid, arrival=req.arrival, prompt_tokens=req.input_tokens, output_tokens=req.output_tokens,
            memory_bytes=r.in_host * self.chunk_bytes, disk_bytes=r.kv_bytes, session=req.session,
            compute_bytes=self._front_bytes(r),
        ), now=now)
        self._reqs[r.rid] = r
        self._n_waiting += 1
        self.metrics.requests.append(r.rec)
        self.metrics.queue_samples.append((now, self._n_waiting))

    def _on_load_done(self, ev: LoadDone, now: float, out: list[Action]) -> None:
        try:
            step, reqs, start = self._loads.pop(ev.load_id)
        except KeyError:
            raise UsageError(f"LoadDone for unknown load {ev.load_id}") from None
        avail = dict(ev.available)
        computed = dict(ev.computed)
        for r in reqs:
            n = avail.get(r.rid, 0)
            c = computed.get(r.rid, 0)
            item = self._item(r)
            if n > len(item) or c > n:
                raise UsageError(f"LoadDone {ev.load_id}: request {r.rid} has {n} chunks available ({c} computed) "
                                 f"of {len(item)} asked")
            if n > c:
                r.pins.append(tuple(staged_span(item, n, c)))
            r.avail = n
            r.computed = c
            r.present = n  # anything past the first lost chunk is recomputed
            r.rec.load_s += now - start
        if step is None:  # background
            busy0 = self._bg_busy0.pop(ev.load_id, 0.0)
            # The recompute competed with the steps that ran meanwhile: that share of its GPU seconds (at the
            # whole GPU) is the steps' loss; the rest ran while the GPU was idle.
            overlap = min(max((self._busy(now) - busy0) / (now - start), 0.0), 1.0) if now > start else 0.0
            for r in reqs:
                c = computed.get(r.rid, 0)
                if c and overlap:
                    self._gpu_debt += overlap * sum(
                        self.cost.recompute_chunk_s((r.hbm_hit + j) * CHUNK_TOKENS, CHUNK_TOKENS) for j in range(c))
            self._bg_inflight -= 1
            self.metrics.background_loads.append(now - start)
            for r in reqs:
                r.prefetched = True
                self.scheduler.on_load_finished(r.rid, now=now)
            return
        step.pending_loads -= 1
        if self._seq_loads:
            self._issue_step_load(step, [self._seq_loads.popleft()], now, out)
            return
        if step.pending_loads == 0:
            step.load_s = now - step.start
            self._start_compute(step, now, out)

    def _on_step_done(self, ev: StepDone, now: float, out: list[Action]) -> None:
        step = self._step
        if step is None or step.step_id != ev.step_id:
            raise UsageError(f"StepDone for step {ev.step_id}, but the running step is "
                             f"{step.step_id if step else None}")
        self._step = None
        ran = now - step.run_start
        self._gpu_busy_s += ran
        since = now - (self._util_t if self._util_t is not None else step.run_start)
        self._util = 0.7 * self._util + 0.3 * (min(ran / since, 1.0) if since > 0 else 1.0)
        self._util_t = now
        done: list[int] = []
        # Decodes of this step.
        if step.n_dec:
            self._dcount += 1
            self._sum_ctx += step.n_dec
            while self._dheap and self._dheap[0][0] <= self._dcount:
                _, rid = heapq.heappop(self._dheap)
                r = self._reqs[rid]
                self._n_dec -= 1
                self._sum_ctx -= r.req.input_tokens + 1 + (self._dcount - self._dstart.pop(rid))
                self._finish(r, now)
                done.append(rid)
        # Prefills of this step.
        writes: list[WriteChunks] = []
        for r in step.batch:
            r.rec.first_token = now
            hit = r.hbm_hit + r.avail
            ids = r.req.chunk_ids
            if hit < len(ids):
                writes.append(WriteChunks(
                    request_id=r.rid, chunk_ids=tuple(ids[hit:]), first_position=hit,
                    session=r.req.session, prev_answer_tokens=r.req.prev_answer_tokens,
                ))
            for p in r.pins:
                out.append(ReleaseChunks(chunk_ids=p))
            r.pins.clear()
            self.hbm.publish(r.rid, ids)  # prefix caching: later requests hit these chunks while it decodes
            if r.req.output_tokens <= 1:
                r.move(Phase.DONE)
                self._finish(r, now, moved=True)
                done.append(r.rid)
            else:
                r.move(Phase.DECODING)
                self._n_dec += 1
                self._sum_ctx += r.req.input_tokens + 1
                self._dstart[r.rid] = self._dcount
                heapq.heappush(self._dheap, (self._dcount + r.req.output_tokens - 1, r.rid))
        # The step's prefetched KV is on the GPU now (released above): the policy's staging memory is free again.
        self.scheduler.on_step_finished(done, now=now, prefilled=[r.rid for r in step.batch])
        out.extend(writes)
        if writes:
            if self.cfg.defer_writes:
                self._flush_pending = True
            else:
                out.append(Flush())
        self.metrics.steps.append(StepRecord(
            start=step.start, load_s=step.load_s, compute_s=now - step.start - step.load_s,
            prefills=len(step.batch), decodes=step.n_dec, load_bytes=step.load_bytes,
        ))

    def _finish(self, r: _Req, now: float, moved: bool = False) -> None:
        if not moved:
            r.move(Phase.DONE)
        self._n_finished += 1
        r.rec.finished = now
        self.hbm.finish(r.rid, r.req.chunk_ids)
        del self._reqs[r.rid]

    # -- planning: drive the policy, carry out its decisions ----------------------------------------------
    def _locate(self, r: _Req) -> None:
        ids = r.req.chunk_ids
        r.hbm_hit = self.hbm.match(ids)
        present, in_host = self._lookup(ids[r.hbm_hit:]) if r.hbm_hit < len(ids) else (0, 0)
        r.present, r.in_host = present, in_host
        r.kv_bytes = (present - in_host) * self.chunk_bytes

    def _item(self, r: _Req) -> tuple[Hashable, ...]:
        return tuple(r.req.chunk_ids[r.hbm_hit: r.hbm_hit + r.present])

    def _plan(self, now: float, out: list[Action]) -> None:
        if self._step is not None:  # the GPU is busy: loads only
            self._run_loads(now, out)
            return
        batch = self._pick_batch(now, out)
        if not batch and not self._n_dec:
            if self._flush_pending:  # the GPU goes idle: nothing to defer the writes behind
                self._flush_pending = False
                out.append(Flush())
            return
        step = _Step(step_id=self._next_step, batch=batch, n_dec=self._n_dec, sum_ctx=self._sum_ctx, start=now)
        self._next_step += 1
        self._step = step
        if batch:
            self.metrics.queue_samples.append((now, self._n_waiting))
        loads: list[tuple[int, tuple[Hashable, ...]]] = []
        for r in batch:
            if math.isnan(r.rec.started):
                r.rec.started = now
            if r.present and r.avail < r.present:
                # Not (fully) pinned by a prefetch: load now; the GPU waits.
                if r.pins:
                    for p in r.pins:
                        out.append(ReleaseChunks(chunk_ids=p))
                    r.pins.clear()
                r.computed = 0
                loads.append((r.rid, self._item(r)))
        if not loads:
            self._start_compute(step, now, out)
        elif self.cfg.load_mode == "request":
            self._seq_loads.extend(loads[1:])
            self._issue_step_load(step, loads[:1], now, out)
        else:
            self._issue_step_load(step, loads, now, out)

    def _issue_step_load(self, step: _Step, items: list[tuple[int, tuple[Hashable, ...]]], now: float,
                         out: list[Action]) -> None:
        lid = self._next_load
        self._next_load += 1
        reqs = [self._reqs[rid] for rid, _ in items]
        self._loads[lid] = (step, reqs, now)
        step.pending_loads += 1
        out.append(StartLoad(load_id=lid, items=tuple(items), background=False,
                             metas=tuple(self._meta(r) for r in reqs),
                             compute_s=tuple(self._compute_costs(r, len(it)) for r, (_, it) in zip(reqs, items))
                             if self.cfg.compute else ()))

    def _compute_costs(self, r: _Req, n: int, blocking: bool = True) -> tuple[float, ...]:
        """GPU seconds to recompute each of the ``n`` chunks of ``r``'s item at its prefix position, over the
        share of the GPU compute may use (``gpu_share``): a blocking load holds the step, so all of it (nothing
        else runs until it ends; the load's items share it, one chunk at a time); a background load competes
        with the running batch's prefill and decodes, so the smaller of the batch's free share and the GPU's
        recent idle share, and nothing (no costs: no compute) when the batch is full or the GPU never idles."""
        share = gpu_share(len(self.scheduler.running), self.cfg.max_running, blocking=blocking, busy=self._util)
        if share <= 0:
            return ()
        return tuple(self.cost.recompute_chunk_s((r.hbm_hit + j) * CHUNK_TOKENS, CHUNK_TOKENS) / share
                     for j in range(n))

    def _busy(self, now: float) -> float:
        """Seconds the GPU has run forward passes so far (the step running now counted up to ``now``)."""
        step = self._step
        running = now - step.run_start if step is not None and not math.isnan(step.run_start) else 0.0
        return self._gpu_busy_s + running

    def _front_bytes(self, r: _Req) -> int:
        """Of ``r``'s disk bytes, the front the compute policy would recompute in a background load now (what
        the scheduler's partly-ready ranking and staging use). Only a whole item on disk has a chain (its
        leading chunks in host memory would end it at once), so anything else is 0."""
        if (self.compute is None or self.cfg.prefetch == "none" or not r.kv_bytes or r.in_host
                or not r.present):
            return 0  # no background loads (FCFS: nothing to rank), or nothing a chain could start with
        costs = self._compute_costs(r, r.present, blocking=False)
        if not costs:
            return 0
        m = self.compute.estimate(costs, [self.chunk_bytes] * r.present)
        return min(m, r.present) * self.chunk_bytes

    @staticmethod
    def _meta(r: _Req) -> tuple[Hashable | None, int | None, int, int]:
        """What a load tells the host-memory eviction policy about its item (see :class:`StartLoad`)."""
        return (r.req.session, r.req.prev_answer_tokens, r.req.round_index, r.hbm_hit)

    def _check(self, rid: Hashable) -> Candidate:
        """The scheduler's query about an admission candidate: what its step would compute and read now."""
        r = self._reqs[rid]  # type: ignore[index]
        if not r.prefetched:
            self._locate(r)
        else:
            # Prefetched: its item chunk_ids[hbm_hit : hbm_hit + avail] is pinned in host memory. HBM may
            # have gained or lost prefix chunks since.
            hit = self.hbm.match(r.req.chunk_ids)
            if hit > r.hbm_hit:
                end = r.hbm_hit + r.avail
                r.computed = max(r.computed - (hit - r.hbm_hit), 0)  # its recomputed front: HBM has it now
                r.hbm_hit = hit
                r.avail = r.present = max(end - hit, 0)
            elif hit < r.hbm_hit:
                # A gap opened between HBM and the pinned item: look again and load (pins are dropped).
                self._locate(r)
                r.avail = 0
                r.computed = 0
        disk = 0 if r.prefetched and r.avail == r.present else r.kv_bytes
        return Candidate(tokens=max(r.req.input_tokens - (r.hbm_hit + r.present) * CHUNK_TOKENS, 1), disk_bytes=disk,
                         compute_bytes=self._front_bytes(r) if disk else 0)

    def _pick_batch(self, now: float, out: list[Action]) -> list[_Req]:
        batch: list[_Req] = []

        def reserve(rid: Hashable) -> bool:  # GPU KV memory, which the policy does not track
            r = self._reqs[rid]  # type: ignore[index]
            need = r.req.input_tokens + r.req.output_tokens
            if self.hbm.admit(r.rid, r.req.chunk_ids, r.hbm_hit, need):
                batch.append(r)
                return True
            if batch or self._n_dec or self.hbm.can_ever_fit(need):
                return False
            # Longer than the whole KV space: run it alone, its reservation clamped to the capacity (a real
            # engine would truncate or reject it); counted, so a report can say so.
            if not self.hbm.admit(r.rid, r.req.chunk_ids, r.hbm_hit, self.hbm.capacity):
                return False
            self.metrics.counters["oversize_requests"] = self.metrics.counters.get("oversize_requests", 0) + 1
            batch.append(r)
            return True

        while True:
            d = self.scheduler.schedule(now=now, check=self._check, reserve=reserve)
            if [r.rid for r in batch] != list(d.admit):
                raise AssertionError(f"scheduler admitted {d.admit} but the core reserved {[r.rid for r in batch]}")
            # Its synchronous loads (``blocking``) are this step's loads; the others start in the background.
            blocking = d.blocking
            emptied = self._start_loads([lo for lo in d.loads if lo.request_id not in blocking] if blocking
                                        else d.loads, now, out)
            if not emptied:
                break
            if batch:  # a request whose load had nothing to read is ready now: it joins the next step
                self._run_loads(now, out)
                break
            # Nothing admitted yet: ask again, now that it is ready (a fresh decision, nothing to undo).
        for r in batch:
            r.move(Phase.STEP)
            self._n_waiting -= 1
            r.rec.hbm_chunks = r.hbm_hit
            if now - r.req.arrival >= self.cfg.max_wait_s:  # served under the wait bound (kvstream.scheduling)
                self.metrics.counters["overdue_admits"] = self.metrics.counters.get("overdue_admits", 0) + 1
        return batch

    def _run_loads(self, now: float, out: list[Action]) -> None:
        while self._start_loads(self.scheduler.schedule(now=now, admit=False).loads, now, out):
            pass

    def _start_loads(self, loads: Sequence[LoadOrder], now: float, out: list[Action]) -> bool:
        """Start the policy's background loads; True if one had nothing left to read (its request became ready)."""
        emptied = False
        for lo in loads:
            r = self._reqs[lo.request_id]  # type: ignore[index]
            self._locate(r)
            if math.isnan(r.rec.started):
                r.rec.started = now
            if r.present == 0:
                # Nothing left to load (evicted everywhere): ready to recompute.
                r.prefetched = True
                r.avail = 0
                self.scheduler.on_load_finished(r.rid, now=now)
                emptied = True
                continue
            lid = self._next_load
            self._next_load += 1
            self._loads[lid] = (None, [r], now)
            self._bg_busy0[lid] = self._busy(now)
            self._bg_inflight += 1
            item = self._item(r)
            costs = self._compute_costs(r, len(item), blocking=False) if self.cfg.compute else ()
            out.append(StartLoad(load_id=lid, items=((r.rid, item),), background=True,
                                 metas=(self._meta(r),), compute_s=(costs,) if costs else ()))
        return emptied

    def _start_compute(self, step: _Step, now: float, out: list[Action]) -> None:
        prefills = []
        moved = 0
        for r in step.batch:
            cached = (r.hbm_hit + r.avail) * CHUNK_TOKENS
            prefills.append((max(r.req.input_tokens - cached, 1), min(cached, r.req.input_tokens - 1)))
            r.rec.recomputed_tokens = max(r.req.input_tokens - cached, 0)
            loaded = r.avail - r.computed  # recomputed chunks are on the GPU already: nothing to move
            host = min(loaded, r.in_host)
            r.rec.host_chunks = host
            r.rec.disk_chunks = loaded - host
            r.rec.computed_chunks = r.computed
            moved += loaded
        step.load_bytes = moved * self.chunk_bytes
        duration = self.cost.step_time_agg(prefills, step.n_dec, step.sum_ctx)
        duration += self.cost.host_load_s(step.load_bytes)
        if self._gpu_debt:  # background recompute shared the GPU with the steps since the last one
            duration += self._gpu_debt
            self.metrics.counters["background_compute_us"] = (self.metrics.counters.get("background_compute_us", 0)
                                                              + round(self._gpu_debt * 1e6))
            self._gpu_debt = 0.0
        step.run_start = now
        out.append(StartStep(step_id=step.step_id, duration=duration, prefills=len(step.batch), decodes=step.n_dec))
        if self._flush_pending:
            self._flush_pending = False
            out.append(Flush())
