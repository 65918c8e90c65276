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

Request lifecycle (one table; anything else is a bug and raises)::

    WAITING --(blocking load or compute planned)--> STEP --StepDone--> DECODING --last token--> DONE
    WAITING --(needs disk, prefetching policy)--> PREPARING --StartLoad(bg)--> LOADING --LoadDone--> READY
    READY --(admitted)--> STEP;   READY --(its host chunks were evicted meanwhile)--> PREPARING

Policies, as configuration (the decision functions are small and live in :mod:`kvstream.serving._policy`
until issue #3's ``kvstream.scheduling`` objects replace them):

- ``admit="fcfs"``: steps take waiting requests in arrival order and load what they miss before computing;
  with prefetching on, the head of the queue waits for its prefetch (CachedAttention's look-ahead).
- ``admit="ready"``: steps take only requests whose KV is in host memory (Bidaw's ready queue); requests
  that need disk wait in the preparing queue, loaded in the background in ``prefetch`` order.
- ``prefetch``: ``none`` | ``hrrn`` (disk-HRRN: highest ``1 + waiting / kv_bytes`` first) | ``lookahead:W``.
- ``load_mode``: ``step`` = one read plan for all of a step's requests (KVStream) | ``request`` = one
  request's read after another (LMCache).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from enum import Enum

from kvstream.errors import UsageError
from kvstream.serving.gpu import CostModel
from kvstream.serving.hbm import HbmCache
from kvstream.serving.metrics import RequestRecord, RunMetrics, StepRecord
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = [
    "ServingConfig",
    "ServingCore",
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
]

Lookup = Callable[[Sequence[Hashable]], tuple[int, int]]  # chunk ids -> (present prefix, of which in host memory)


# -- events in ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class Arrival:
    request: Request  # the request that arrived


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadDone:
    load_id: int  # the StartLoad this answers
    available: tuple[tuple[int, int], ...]  # (request id, leading chunks of its item now pinned in host memory)


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
    metas: tuple[tuple[Hashable | None, int | None], ...] = ()  # per item: (session, previous answer tokens)


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
    admit: str = "fcfs"  # "fcfs" | "ready"
    prefetch: str = "none"  # "none" | "hrrn" | "lookahead:W"
    load_mode: str = "step"  # "step" | "request"
    defer_writes: bool = True  # issue a step's writes once the next step has started
    max_batch_tokens: int = 32768  # prompt tokens computed per step (a longer prompt runs alone)
    max_running: int = 256  # sequences on the GPU at once (vLLM's max_num_seqs)
    max_background_loads: int = 1  # prefetch loads in flight at once
    prefetch_budget_chunks: int | None = None  # chunks prefetched and pinned, waiting for the GPU, at most
    hbm_capacity_tokens: int | None = None  # default: the cost model's KV capacity

    def __post_init__(self) -> None:
        if self.admit not in ("fcfs", "ready"):
            raise UsageError(f"ServingConfig.admit must be 'fcfs' or 'ready', got {self.admit!r}")
        if self.load_mode not in ("step", "request"):
            raise UsageError(f"ServingConfig.load_mode must be 'step' or 'request', got {self.load_mode!r}")
        kind, _, arg = self.prefetch.partition(":")
        if kind not in ("none", "hrrn", "lookahead") or (kind == "lookahead" and not arg.isdigit()):
            raise UsageError(f"ServingConfig.prefetch must be none, hrrn or lookahead:W, got {self.prefetch!r}")
        if self.admit == "ready" and kind == "none":
            raise UsageError("ServingConfig: admit='ready' needs a prefetch policy (hrrn or lookahead:W)")
        if self.max_batch_tokens < 1 or self.max_running < 1 or self.max_background_loads < 1:
            raise UsageError("ServingConfig: max_batch_tokens, max_running, max_background_loads must be >= 1")

    @property
    def lookahead(self) -> int:
        kind, _, arg = self.prefetch.partition(":")
        return int(arg) if kind == "lookahead" else 0


class Phase(Enum):
    WAITING = "waiting"  # queued; loads (if any) happen when a step takes it
    PREPARING = "preparing"  # needs disk; waits for a background load
    LOADING = "loading"  # background load in flight
    READY = "ready"  # KV in host memory (pinned if it was loaded)
    STEP = "step"  # in the step being loaded or computed
    DECODING = "decoding"
    DONE = "done"


_LEGAL = {
    (Phase.WAITING, Phase.STEP),
    (Phase.WAITING, Phase.PREPARING),
    (Phase.WAITING, Phase.READY),
    (Phase.PREPARING, Phase.LOADING),
    (Phase.LOADING, Phase.READY),
    (Phase.READY, Phase.STEP),
    (Phase.READY, Phase.PREPARING),
    (Phase.STEP, Phase.DECODING),
    (Phase.STEP, Phase.DONE),
    (Phase.DECODING, Phase.DONE),
}


class _Req:
    """Per-request state. Invariant: ``pins`` lists every chunk tuple this request holds pinned in host memory."""

    __slots__ = ("req", "rid", "phase", "rec", "hbm_hit", "present", "in_host", "avail", "pins", "kv_bytes",
                 "join", "prefetched", "bg_chunks")

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
        self.kv_bytes = 0  # bytes to load from disk (disk-HRRN's denominator)
        self.join = 0  # decode counter when it joined decoding
        self.prefetched = False
        self.bg_chunks = 0  # chunks its background load counted against the prefetch budget

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


class ServingCore:
    """One serving instance (one TP group). See the module docstring for the protocol."""

    def __init__(self, cost: CostModel, lookup: Lookup, config: ServingConfig | None = None, *,
                 chunk_bytes: int | None = None) -> None:
        self.cost = cost
        self.cfg = config or ServingConfig()
        self._lookup = lookup
        self.chunk_bytes = chunk_bytes if chunk_bytes is not None else cost.model.chunk_bytes(CHUNK_TOKENS)
        cap = self.cfg.hbm_capacity_tokens or int(cost.kv_capacity_bytes // cost.kv_bytes_per_token)
        self.hbm = HbmCache(cap)
        self.metrics = RunMetrics()
        self._reqs: dict[int, _Req] = {}
        self._fcfs: deque[_Req] = deque()  # admit=fcfs: waiting requests, arrival order
        self._ready: deque[_Req] = deque()  # admit=ready: ready queue
        self._preparing: list[_Req] = []  # needs a background load (PREPARING)
        self._n_waiting = 0
        self._n_finished = 0
        self._bg_inflight = 0
        self._prefetched_chunks = 0  # chunks pinned by background loads of requests not yet computed
        self._loads: dict[int, tuple[_Step | None, list[_Req], float]] = {}  # load id -> (step, reqs, start)
        self._next_load = 0
        self._next_step = 0
        self._step: _Step | None = None  # the step being loaded or computed
        self._seq_loads: deque[tuple[int, tuple[Hashable, ...]]] = deque()  # load_mode=request: items left
        self._flush_pending = False
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

    def window_sessions(self, window: int) -> list[Hashable]:
        """Sessions of the first ``window`` waiting requests (a queue-aware eviction policy protects them)."""
        out = []
        queue = self._ready if self.cfg.admit == "ready" else self._fcfs
        for i, r in enumerate(queue):
            if i >= window:
                break
            if r.req.session is not None:
                out.append(r.req.session)
        if self.cfg.admit == "ready":
            out.extend(r.req.session for r in self._preparing[: max(window - len(out), 0)] if r.req.session is not None)
        return out

    # -- events -------------------------------------------------------------------------------------------
    def _on_arrival(self, req: Request, now: float, out: list[Action]) -> None:
        if req.request_id in self._reqs:
            raise UsageError(f"request {req.request_id} arrived twice")
        r = _Req(req, self.chunk_bytes)
        self._reqs[r.rid] = r
        self._n_waiting += 1
        self.metrics.requests.append(r.rec)
        self.metrics.queue_samples.append((now, self._n_waiting))
        if self.cfg.prefetch == "none":
            self._fcfs.append(r)
            return
        self._locate(r)
        needs_disk = r.present > r.in_host
        if self.cfg.admit == "fcfs":
            self._fcfs.append(r)
            if needs_disk:
                r.move(Phase.PREPARING)
                self._preparing.append(r)
        elif needs_disk:
            r.move(Phase.PREPARING)
            self._preparing.append(r)
        else:
            r.move(Phase.READY)
            self._ready.append(r)

    def _on_load_done(self, ev: LoadDone, now: float, out: list[Action]) -> None:
        try:
            step, reqs, start = self._loads.pop(ev.load_id)
        except KeyError:
            raise UsageError(f"LoadDone for unknown load {ev.load_id}") from None
        avail = dict(ev.available)
        for r in reqs:
            n = avail.get(r.rid, 0)
            item = self._item(r)
            if n > len(item):
                raise UsageError(f"LoadDone {ev.load_id}: request {r.rid} has {n} chunks pinned of {len(item)} asked")
            if n:
                r.pins.append(item[:n])
            r.avail = n
            r.present = n  # anything past the first lost chunk is recomputed
            r.rec.load_s += now - start
        if step is None:  # background
            self._bg_inflight -= 1
            self.metrics.background_loads.append(now - start)
            for r in reqs:
                r.prefetched = True
                if r.phase is Phase.LOADING:
                    if self.cfg.admit == "ready":
                        r.move(Phase.READY)
                        self._ready.append(r)
                    else:
                        r.move(Phase.READY)
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
        # Prefills of this step.
        writes: list[WriteChunks] = []
        for r in step.batch:
            r.rec.first_token = now
            self._prefetched_chunks -= r.bg_chunks
            r.bg_chunks = 0
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
            else:
                r.move(Phase.DECODING)
                self._n_dec += 1
                self._sum_ctx += r.req.input_tokens + 1
                self._dstart[r.rid] = self._dcount
                heapq.heappush(self._dheap, (self._dcount + r.req.output_tokens - 1, r.rid))
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

    # -- planning -----------------------------------------------------------------------------------------
    def _locate(self, r: _Req) -> None:
        ids = r.req.chunk_ids
        r.hbm_hit = self.hbm.match(ids)
        present, in_host = self._lookup(ids[r.hbm_hit:]) if r.hbm_hit < len(ids) else (0, 0)
        r.present, r.in_host = present, in_host
        r.kv_bytes = (present - in_host) * self.chunk_bytes

    def _item(self, r: _Req) -> tuple[Hashable, ...]:
        return tuple(r.req.chunk_ids[r.hbm_hit: r.hbm_hit + r.present])

    def _plan(self, now: float, out: list[Action]) -> None:
        if self.cfg.prefetch != "none":
            self._plan_prefetch(now, out)
        if self._step is not None:
            return
        batch = self._pick_batch(now)
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
                             metas=tuple((r.req.session, r.req.prev_answer_tokens) for r in reqs)))

    def _pick_batch(self, now: float) -> list[_Req]:
        budget = self.cfg.max_batch_tokens
        room = self.cfg.max_running - self._n_dec
        batch: list[_Req] = []
        queue = self._ready if self.cfg.admit == "ready" else self._fcfs
        prefetching = self.cfg.prefetch != "none"
        while queue and room > 0:
            r = queue[0]
            if self.cfg.admit == "fcfs" and prefetching and r.phase in (Phase.PREPARING, Phase.LOADING):
                break  # look-ahead: the head waits for its prefetch
            if r.phase is not Phase.READY or not r.prefetched:
                self._locate(r)
                if self.cfg.admit == "ready" and r.present > r.in_host:
                    # Its host-memory chunks were evicted while it waited: back to preparing.
                    queue.popleft()
                    r.move(Phase.PREPARING)
                    self._preparing.append(r)
                    continue
            else:
                # Prefetched: its item chunk_ids[hbm_hit : hbm_hit + avail] is pinned in host memory. HBM may
                # have gained or lost prefix chunks since.
                hit = self.hbm.match(r.req.chunk_ids)
                if hit > r.hbm_hit:
                    end = r.hbm_hit + r.avail
                    r.hbm_hit = hit
                    r.avail = r.present = max(end - hit, 0)
                elif hit < r.hbm_hit:
                    # A gap opened between HBM and the pinned item: look again and load (pins are dropped).
                    self._locate(r)
                    r.avail = 0
            new = max(r.req.input_tokens - (r.hbm_hit + r.present) * CHUNK_TOKENS, 1)
            if batch and new > budget:
                break
            need = r.req.input_tokens + r.req.output_tokens
            if not self.hbm.admit(r.rid, r.req.chunk_ids, r.hbm_hit, need):
                if batch or self._n_dec or self.hbm.can_ever_fit(need):
                    break
                # Longer than the whole KV space: run it alone, its reservation clamped to the capacity (a real
                # engine would truncate or reject it); counted, so a report can say so.
                if not self.hbm.admit(r.rid, r.req.chunk_ids, r.hbm_hit, self.hbm.capacity):
                    break
                self.metrics.counters["oversize_requests"] = self.metrics.counters.get("oversize_requests", 0) + 1
            queue.popleft()
            r.move(Phase.STEP)
            self._n_waiting -= 1
            budget -= new
            room -= 1
            r.rec.hbm_chunks = r.hbm_hit
            batch.append(r)
        return batch

    def _plan_prefetch(self, now: float, out: list[Action]) -> None:
        budget = self.cfg.prefetch_budget_chunks
        while self._bg_inflight < self.cfg.max_background_loads and self._preparing:
            if budget is not None and self._prefetched_chunks >= budget:
                return
            r = self._pick_prefetch(now)
            if r is None:
                return
            self._preparing.remove(r)
            self._locate(r)
            r.move(Phase.LOADING)
            if math.isnan(r.rec.started):
                r.rec.started = now
            if r.present == 0:
                # Nothing left to load (evicted everywhere): ready to recompute.
                self._loads_done_empty(r)
                continue
            lid = self._next_load
            self._next_load += 1
            self._loads[lid] = (None, [r], now)
            self._bg_inflight += 1
            self._prefetched_chunks += r.present
            r.bg_chunks = r.present
            out.append(StartLoad(load_id=lid, items=((r.rid, self._item(r)),), background=True,
                                 metas=((r.req.session, r.req.prev_answer_tokens),)))

    def _loads_done_empty(self, r: _Req) -> None:
        r.prefetched = True
        r.avail = 0
        r.move(Phase.READY)
        if self.cfg.admit == "ready":
            self._ready.append(r)

    def _pick_prefetch(self, now: float) -> _Req | None:
        from kvstream.serving._policy import pick_prefetch

        return pick_prefetch(self.cfg.prefetch, self._preparing, self._fcfs, now)

    def _start_compute(self, step: _Step, now: float, out: list[Action]) -> None:
        prefills = []
        moved = 0
        for r in step.batch:
            cached = (r.hbm_hit + r.avail) * CHUNK_TOKENS
            prefills.append((max(r.req.input_tokens - cached, 1), min(cached, r.req.input_tokens - 1)))
            r.rec.recomputed_tokens = max(r.req.input_tokens - cached, 0)
            host = min(r.avail, r.in_host)
            r.rec.host_chunks = host
            r.rec.disk_chunks = r.avail - host
            moved += r.avail
        step.load_bytes = moved * self.chunk_bytes
        duration = self.cost.step_time_agg(prefills, step.n_dec, step.sum_ctx)
        duration += self.cost.host_load_s(step.load_bytes)
        out.append(StartStep(step_id=step.step_id, duration=duration, prefills=len(step.batch), decodes=step.n_dec))
        if self._flush_pending:
            self._flush_pending = False
            out.append(Flush())
