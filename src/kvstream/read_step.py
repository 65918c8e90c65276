"""One read step as a sans-I/O state machine: the store's reader and the simulator drive the same object.

A *step* is one call's disk reads (``get_many``, ``read_iter``, ``read_chunks``, ``read_into``, ``get_meta``'s
header reads) or one simulated load. The :class:`ReadStep` owns every decision of the step: which tier reads
which chunk next (it runs the router's :class:`~kvstream.routing.ReadSchedule`), how many bytes each tier may
have in flight (its read window), how far reads may run ahead of a consumer that has not checked what landed,
when a read is stuck past ``hedge_after_s`` and which other holder reads it again, which landed copy is
delivered and which is a duplicate, when a chunk is lost, and (``read_into``) which read goes straight into the
caller's target and when a target whose read is stuck may be reported busy. It performs no I/O, reads no clock
and takes no lock: a driver feeds it events with the time and carries out the actions it returns.

Events (methods)                          Actions returned
  ``start(now)``                            :class:`Open`     open chunk file ``chunk`` on ``tier``
  ``opened(read, now, nbytes)``             :class:`Submit`   read it (``nbytes``; ``in_place``: into the target)
  ``open_failed(read, now)``                :class:`Deliver`  hand this read's payload to the caller
  ``landed(read, now)``                     :class:`Release`  free this read's buffer and descriptor
  ``checked(read, now, ok)``                :class:`Lost`     no holder can deliver ``chunk``: a miss
  ``tick(now, usable)``                     :class:`Busy`     ``chunk``'s target is still being written (read_into)
  ``close(now)``                            :class:`Stalled`  ``tier`` has a read stuck past the hedge deadline
  ``computed(chunk, now)``                  :class:`Compute`  recompute ``chunk`` on the GPU (``seconds`` of it)

``landed`` is the I/O completion (any result); ``checked`` is the consumer's verdict after verifying what landed
(header, key, length, checksum; ``ok=False`` for an I/O error too). Opens are actions because an ``open()``
on a network file system, a throttled device or a FIFO planted at a chunk path can block: the driver runs them
off the step's lock and the hedge deadline covers them like any slow read.

Chunk-read lifecycle (one read of one chunk on one tier)::

    state        event         next state   action(s)
    -----------  ------------  -----------  --------------------------------------------------------------
    OPENING      opened        IN_FLIGHT    Submit
    OPENING      open_failed   FAILED       (chunk back to its other holders, or Lost)
    OPENING      abandon       ABANDONED
    OPENING      not needed    RELEASED     Release (the chunk was resolved before this read was issued)
    IN_FLIGHT    landed        LANDED       (its tier may claim more)
    IN_FLIGHT    abandon       ABANDONED    (Busy, for a stuck read into a target)
    LANDED       checked ok    DELIVERED    Deliver (first good copy, or the copy in the target)
    LANDED       checked ok    WAITING      (a read into the same target is still in flight)
    LANDED       checked ok    DUPLICATE    Release (another copy was delivered)
    LANDED       checked bad   FAILED       Release (chunk back to its other holders, or Lost)
    LANDED       abandon       RELEASED     Release (the step is over)
    WAITING      deliver       DELIVERED    Deliver (the read into the target failed)
    WAITING      supersede     DUPLICATE    Release (the read into the target is good, or reported busy)
    WAITING      abandon       RELEASED     Release
    ABANDONED    opened        RELEASED     Release (nobody reads it any more)
    ABANDONED    open_failed   RELEASED
    ABANDONED    not needed    RELEASED     Release
    ABANDONED    landed        RELEASED     Release (a busy target is free from here)
    DELIVERED, DUPLICATE, FAILED, RELEASED: final.

Memory hits never enter the machine: the reader pins them when the step is planned (``planned -> pinned``,
:meth:`kvstream.tiers.memory.HostMemoryTier.pin`), and a delivered read's buffer is pinned by the view the
caller holds until the caller drops it (``delivered -> released``; :mod:`kvstream.io.buffers`).

A chunk is PENDING until exactly one of: DELIVERED (one Deliver), LOST (one Lost), BUSY (one Busy), COMPUTED
(one ``computed`` event after its Compute). An illegal transition of either raises :class:`ReadStepError`
naming the read, the event and the state.

Compute joins the meeting (a :class:`ComputePlan`, from :class:`kvstream.compute.ComputePolicy`): the GPU is a
third source. It recomputes the step's first ``len(plan.cost_s)`` chunks (the *chain*: the fronts of the load's
requests merged into one order that keeps each request's prefix order, :func:`kvstream.compute.split_load`)
one at a time, from the front: a chunk can only be recomputed once the ones before it are, so it
claims chunk 0, then 1, ... (passing over chunks a tier has delivered: they are there) and stops for good at
the chain's end, at a lost chunk, or at a chunk whose compute would end after the tiers are expected to have
read everything else (``cost_s[j] * (1 + margin)`` over
the pending bytes at the tiers' summed ``bandwidth``: the rule that makes compute do nothing when the tiers are
fast). A chunk a tier has claimed but not delivered is recomputed too (a hedge: the first copy wins, the other
is a duplicate), so a long-tailed read in the meeting region never holds the step. The tiers claim from the
back (``router.schedule(..., front=plan.front)``), and leave a claim to compute when compute would reach that
chunk before their read could land (``_compute_first``). Compute-source lifecycle::

    state      event      next state   action
    ---------  ---------  -----------  -------------------------------------------------
    IDLE       claim      BUSY         Compute (the chain's next chunk)
    IDLE       stop       STOPPED      (the chain ended, a lost chunk, or the next would not pay)
    IDLE       close      STOPPED
    BUSY       computed   IDLE         (the chunk is COMPUTED, or a tier won the hedge and its copy is used)
    BUSY       close      ABANDONED
    ABANDONED  computed   STOPPED      (the step was over: the result is not used)
    STOPPED: final.

Invariants (tested with hypothesis against a model, ``tests/unit/test_read_step.py``): every chunk is resolved
exactly once; a delivered read is from a tier holding the chunk and was checked ok; every read that got a
buffer (Submit) is released or delivered exactly once; no read goes into a target while another read into it
is in flight, and a chunk is delivered only once no read into its target is in flight (or it is reported
busy); a tier's bytes in flight stay within its window, but for the one read it may always have. With a
compute source (``tests/unit/test_compute_source.py``): chunks are computed strictly in chain order (compute claims
chunk j only once every chain chunk before it is resolved: computed by it or delivered by a tier), a chunk
taken for compute is never read by a tier, and each chunk is resolved by exactly one source.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from kvstream.routing import ReadSchedule

__all__ = [
    "ReadStep", "ReadStepError", "ReadState", "ChunkState",
    "Open", "Submit", "Deliver", "Release", "Lost", "Busy", "Stalled", "Compute", "Action", "ComputePlan",
    "ComputeState",
]


class ReadStepError(RuntimeError):
    """An event the read step's lifecycle does not allow (a driver bug): names the read, event and state."""


class ReadState(Enum):
    OPENING = "opening"
    IN_FLIGHT = "in flight"
    LANDED = "landed"
    WAITING = "waiting for the read into its target"
    DELIVERED = "delivered"
    DUPLICATE = "duplicate"
    FAILED = "failed"
    ABANDONED = "abandoned"
    RELEASED = "released"


class ChunkState(Enum):
    PENDING = "pending"
    DELIVERED = "delivered"
    LOST = "lost"
    BUSY = "busy"
    COMPUTED = "computed"


class ComputeState(Enum):
    IDLE = "idle"
    BUSY = "computing"
    ABANDONED = "abandoned"
    STOPPED = "stopped"


_R = ReadState
# The lifecycle table: state -> {event: next state}. Anything not listed raises.
_READ_TRANSITIONS: dict[ReadState, dict[str, ReadState]] = {
    _R.OPENING: {"opened": _R.IN_FLIGHT, "open_failed": _R.FAILED, "abandon": _R.ABANDONED,
                 "not_needed": _R.RELEASED},
    _R.IN_FLIGHT: {"landed": _R.LANDED, "abandon": _R.ABANDONED},
    _R.LANDED: {"deliver": _R.DELIVERED, "wait": _R.WAITING, "duplicate": _R.DUPLICATE, "fail": _R.FAILED,
                "abandon": _R.RELEASED},
    _R.WAITING: {"deliver": _R.DELIVERED, "supersede": _R.DUPLICATE, "abandon": _R.RELEASED},
    _R.ABANDONED: {"opened": _R.RELEASED, "open_failed": _R.RELEASED, "landed": _R.RELEASED,
                   "not_needed": _R.RELEASED},
    _R.DELIVERED: {}, _R.DUPLICATE: {}, _R.FAILED: {}, _R.RELEASED: {},
}
_C = ChunkState
_CHUNK_TRANSITIONS: dict[ChunkState, dict[str, ChunkState]] = {
    _C.PENDING: {"deliver": _C.DELIVERED, "lose": _C.LOST, "busy": _C.BUSY, "compute": _C.COMPUTED},
    _C.DELIVERED: {}, _C.LOST: {}, _C.BUSY: {}, _C.COMPUTED: {},
}
_K = ComputeState
_COMPUTE_TRANSITIONS: dict[ComputeState, dict[str, ComputeState]] = {
    _K.IDLE: {"claim": _K.BUSY, "stop": _K.STOPPED, "close": _K.STOPPED},
    _K.BUSY: {"computed": _K.IDLE, "close": _K.ABANDONED},
    _K.ABANDONED: {"computed": _K.STOPPED},
    _K.STOPPED: {},
}
_ACTIVE = (_R.OPENING, _R.IN_FLIGHT)  # holding a place in the tier's window


@dataclass(frozen=True, slots=True)
class Open:
    read: int
    tier: int
    chunk: int
    hedged: bool = False  # a second read of a chunk stuck on another tier


@dataclass(frozen=True, slots=True)
class Submit:
    read: int
    nbytes: int
    in_place: bool  # the payload goes straight into the chunk's target (read_into)


@dataclass(frozen=True, slots=True)
class Deliver:
    read: int
    chunk: int


@dataclass(frozen=True, slots=True)
class Release:
    read: int
    late: bool = False  # nobody checked the read's result (a straggler, or landed after the consumer was done)


@dataclass(frozen=True, slots=True)
class Lost:
    chunk: int


@dataclass(frozen=True, slots=True)
class Busy:
    chunk: int
    read: int  # the stuck read into the target: its Release frees the target


@dataclass(frozen=True, slots=True)
class Stalled:
    tier: int


@dataclass(frozen=True, slots=True)
class Compute:
    chunk: int
    seconds: float  # modelled GPU seconds: the prefill cost of this chunk at its position, at the GPU's load


Action = Open | Submit | Deliver | Release | Lost | Busy | Stalled | Compute


@dataclass(frozen=True, slots=True)
class ComputePlan:
    """What the step's compute source may do (decided by :class:`kvstream.compute.ComputePolicy`).

    ``cost_s[j]``: GPU seconds to recompute chunk ``j`` of the step (``j < len(cost_s)``: the chain, the load's
    requests' fronts merged, each in prefix order; cost grows with position). ``bandwidth``: the tiers' read bytes/s as last
    measured (the claim rule). ``front``: the estimated meeting point, given to the router as ``front`` (the
    step itself only uses it as a report). ``margin``: compute claims a chunk only if it ends this much before
    the tiers' expected end (estimates err; a late compute would hold the whole step)."""

    cost_s: tuple[float, ...]
    bandwidth: tuple[float, ...]
    front: int = 0
    margin: float = 0.1


class _Read:
    __slots__ = ("rid", "tier", "chunk", "state", "started", "nbytes", "in_place", "busy", "unread")

    def __init__(self, rid: int, tier: int, chunk: int, started: float, nbytes: int) -> None:
        self.rid = rid
        self.tier = tier
        self.chunk = chunk
        self.state = ReadState.OPENING
        self.started = started
        self.nbytes = nbytes  # bytes charged to the tier's window (planned size, then the real one)
        self.in_place = False
        self.busy = False  # reported Busy: its Release frees the target
        self.unread = False  # landed, counted in the read-ahead bound until checked


class ReadStep:
    """One step's reads; see the module docstring.

    ``schedule``: the router's schedule for the step's chunks (``holders`` given to the router). ``nbytes[j]``:
    bytes a read of chunk ``j`` moves (its file, or its header for ``get_meta``). ``windows[t]``: tier ``t``'s
    read window in bytes: a tier claims a read only if it fits whole (the step's largest read), and always may
    have one read in flight. ``readahead_bytes``: refills stop while
    this many bytes have landed and are not checked yet (None: the sum of the windows, at least one largest read
    per tier). ``hedge_after_s``: a
    read in flight (or opening) longer than this is stuck: its tier is reported :class:`Stalled` and the chunk
    may be read by another usable holder (None or 0: no hedging). ``in_place[j]``: the capacity of chunk ``j``'s
    target if a read may go straight into it (0: never); only ``in_place_tier`` reads in place (a read into a
    target cannot be taken back, so it goes to the tier that is fastest). ``report_busy``: a stuck read into a
    target may be given up (the chunk reported :class:`Busy`) once everything else is resolved.
    """

    def __init__(self, schedule: ReadSchedule, nbytes: Sequence[int], windows: Sequence[int], *,
                 hedge_after_s: float | None = None, readahead_bytes: int | None = None,
                 in_place: Sequence[int] | None = None, in_place_tier: int = -1, report_busy: bool = False,
                 header_bytes: int = 0, bandwidth: Sequence[float | None] | None = None,
                 compute: ComputePlan | None = None) -> None:
        if len(nbytes) != schedule.n:
            raise ValueError(f"read step: {schedule.n} chunks but {len(nbytes)} sizes")
        if len(windows) != schedule.n_tiers:
            raise ValueError(f"read step: {schedule.n_tiers} tiers but {len(windows)} windows")
        self.sched = schedule
        self.n_tiers = schedule.n_tiers
        self.nbytes = list(nbytes)
        self._read_size = max(self.nbytes, default=0)  # what the next claim may add to a tier's bytes in flight
        self.windows = [max(int(w), 1) for w in windows]
        self.hedge_after_s = hedge_after_s or None
        # Default: the windows' sum, but never less than one largest read per tier. With 48 MiB chunks and a 32 MiB
        # local window (+ a few MiB for a slow tier) one landed chunk was over the bound, so a tier refilled only
        # after the consumer had checked it: 2-3 ms of idle disk per chunk, ~9 % of a load (replay, traced).
        largest = max(self.nbytes, default=0)
        self.readahead_bytes = (max(sum(self.windows), self.n_tiers * largest) if readahead_bytes is None
                                else readahead_bytes)
        self.in_place = list(in_place) if in_place is not None else None
        self.in_place_tier = in_place_tier if in_place is not None else -1
        self.report_busy = report_busy
        self.header_bytes = header_bytes  # an in-place read's header goes to a buffer; the rest to the target
        self.reads: dict[int, _Read] = {}
        self.chunks = [ChunkState.PENDING] * schedule.n
        self.unresolved = schedule.n
        self._next_rid = 0
        self._active: list[dict[int, _Read]] = [{} for _ in range(self.n_tiers)]  # tier -> rid -> read
        self._inflight_bytes = [0] * self.n_tiers
        self._in_place_read: dict[int, _Read] = {}  # chunk -> the read writing into its target (until it ends)
        self._waiting: dict[int, _Read] = {}  # chunk -> a good copy waiting for the read into its target
        self._unread = 0
        self._lost_seen = 0
        self._stalled: dict[int, float] = {}  # tier -> when its stuck reads were last reported
        self._busy_since: list[float | None] = [None] * self.n_tiers
        self.busy_s = [0.0] * self.n_tiers  # seconds each tier had a read of this step open or in flight
        self.tier_bytes = [0] * self.n_tiers  # bytes each tier landed and the consumer checked ok
        self.closed = False
        self.steals_declined = 0
        self._now = 0.0
        self._last_tick = float("-inf")
        self.bandwidth = list(bandwidth) if bandwidth is not None else [None] * self.n_tiers
        if all(b for b in self.bandwidth):
            schedule.steal_filter = self._steal_pays
        # The compute source (module docstring). Invariant: computed_chunks is increasing, and when chunk j was
        # claimed every chain chunk before it was resolved.
        self.compute = compute
        if compute is not None and len(compute.cost_s) > schedule.n:
            raise ValueError(f"read step: a compute chain of {len(compute.cost_s)} chunks in a step of {schedule.n}")
        self.compute_state = _K.IDLE if compute is not None and compute.cost_s else _K.STOPPED
        self._c_next = 0  # the chain's next chunk
        self._c_busy: int | None = None  # the chunk being computed
        self.computed_chunks: list[int] = []
        self.compute_s = 0.0  # GPU seconds spent on chunks that were used
        self._pending_bytes = sum(self.nbytes)  # of unresolved chunks: what the tiers still have to bring
        self._c_cum = [0.0]  # prefix sums of the chain's costs: compute's time to reach a chunk
        for c in (compute.cost_s if compute is not None else ()):
            self._c_cum.append(self._c_cum[-1] + c)
        self.claims_declined = 0  # tier claims left to compute (it would get there first)
        self.compute_hedges = 0  # chunks compute recomputed while a tier had them (the meeting region)
        self._lost_by_tiers: set[int] = set()  # failed on every tier while compute recomputes it
        self.compute_wasted_s = 0.0  # GPU seconds of hedges a tier won

    # -- state ----------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """Every chunk is resolved and no copy waits: the consumer may stop (reads may still be in flight)."""
        return self.unresolved == 0 and not self._waiting

    def active(self, tier: int | None = None) -> int:
        """Reads opening or in flight (on ``tier``, or on all tiers)."""
        if tier is not None:
            return len(self._active[tier])
        return sum(len(a) for a in self._active)

    def inflight_bytes(self, tier: int) -> int:
        return self._inflight_bytes[tier]

    def next_deadline(self) -> float | None:
        """When the oldest active read becomes stuck (the driver's next ``tick``), or None."""
        if self.hedge_after_s is None:
            return None
        oldest = min((r.started for a in self._active for r in a.values()), default=None)
        if oldest is None:
            return None
        # Reads already stuck at the last tick wait for the next hedge period, not for every wake-up.
        return max(oldest, self._last_tick) + self.hedge_after_s

    def in_place_pending(self) -> list[int]:
        """Reads into targets that are still opening or in flight (the driver must not return their targets)."""
        return [r.rid for r in self._in_place_read.values() if r.state in (_R.OPENING, _R.IN_FLIGHT, _R.ABANDONED)
                and not r.busy]

    # -- events ---------------------------------------------------------------------------------------------
    def start(self, now: float) -> list[Action]:
        out: list[Action] = []
        self._settle_lost(out)
        self._compute_next(out)  # compute claims the front before the tiers fill their windows
        for t in range(self.n_tiers):
            self._fill(t, now, out)
        self._settle_stuck(out)
        return out

    def opened(self, rid: int, now: float, nbytes: int) -> list[Action]:
        """The read's file is open and ``nbytes`` is what to read."""
        r = self._read(rid)
        out: list[Action] = []
        if r.state is _R.ABANDONED:
            return self._end_abandoned(r, "opened")
        if self.chunks[r.chunk] is not _C.PENDING:  # delivered (or busy) while this file was opening
            return self._drop_unissued(r, now)
        self._move(r, "opened")
        self._inflight_bytes[r.tier] += nbytes - r.nbytes
        r.nbytes = nbytes
        cap = self.in_place[r.chunk] if self.in_place is not None else 0
        if (r.tier == self.in_place_tier and cap and r.chunk not in self._in_place_read
                and self.header_bytes < nbytes <= self.header_bytes + cap):
            r.in_place = True
            self._in_place_read[r.chunk] = r
        out.append(Submit(rid, nbytes, r.in_place))
        return out

    def needed(self, rid: int) -> bool:
        """Whether a read still opening is worth opening: its step is going on and its chunk unresolved. A driver
        asks before an ``open()`` that may be slow (opens queue behind each other on a tier) and answers
        :meth:`not_needed` when it is not."""
        r = self._read(rid)
        return r.state is _R.OPENING and not self.closed and self.chunks[r.chunk] is _C.PENDING

    def not_needed(self, rid: int, now: float) -> list[Action]:
        """The driver did not open the read's file (see :meth:`needed`)."""
        r = self._read(rid)
        if r.state is _R.ABANDONED:
            return self._end_abandoned(r, "not_needed")
        return self._drop_unissued(r, now)

    def _end_abandoned(self, r: _Read, event: str, *, holds: bool = True) -> list[Action]:
        """The end of a read the step gave up on (its open or its I/O came back): released, and a late Release
        for what it holds (``holds``: a descriptor, and a buffer or target once submitted)."""
        self._move(r, event)
        self._forget_in_place(r)
        return [Release(r.rid, late=True)] if holds else []

    def _drop_unissued(self, r: _Read, now: float) -> list[Action]:
        self._move(r, "not_needed")
        self._leave_window(r, now)
        self.sched.on_dropped(r.tier, r.chunk)
        out: list[Action] = [Release(r.rid)]
        self._after_change(now, out)
        return out

    def open_failed(self, rid: int, now: float) -> list[Action]:
        """The file could not be opened (gone, I/O error, not a regular file)."""
        r = self._read(rid)
        out: list[Action] = []
        if r.state is _R.ABANDONED:
            return self._end_abandoned(r, "open_failed", holds=False)
        self._move(r, "open_failed")
        self._leave_window(r, now)
        self.sched.on_failed(r.tier, r.chunk)
        self._after_change(now, out)
        return out

    def landed(self, rid: int, now: float) -> list[Action]:
        """The read's I/O completed (successfully or not: the consumer's check says which)."""
        r = self._read(rid)
        out: list[Action] = []
        if r.state is _R.ABANDONED:
            return self._end_abandoned(r, "landed")
        self._move(r, "landed")
        self._leave_window(r, now)
        r.unread = True
        self._unread += r.nbytes
        if not self.closed and self._unread <= self.readahead_bytes:
            self._fill(r.tier, now, out)
        return out

    def checked(self, rid: int, now: float, ok: bool) -> list[Action]:
        """The consumer checked a landed read: ``ok`` if its header, key, length and checksum are right."""
        r = self._read(rid)
        if r.state is not _R.LANDED:
            raise ReadStepError(f"read {rid} (chunk {r.chunk}, tier {r.tier}): event 'checked' in state "
                                f"{r.state.value!r}")
        out: list[Action] = []
        if r.unread:
            r.unread = False
            self._unread -= r.nbytes
        j = r.chunk
        if r.in_place:
            self._in_place_read.pop(j, None)
        if not ok:
            self._move(r, "fail")
            out.append(Release(rid))
            self.sched.on_failed(r.tier, j)
            waiting = self._waiting.pop(j, None)
            if r.in_place and waiting is not None and self.chunks[j] is _C.PENDING:
                self._deliver(waiting, out)  # the target's read failed: the good copy goes in
        else:
            self.tier_bytes[r.tier] += r.nbytes
            first = self.sched.on_landed(r.tier, j)
            if self.chunks[j] is not _C.PENDING:
                self._move(r, "duplicate")
                out.append(Release(rid))
            elif r.in_place:
                self._deliver(r, out)
                waiting = self._waiting.pop(j, None)
                if waiting is not None:
                    self._move(waiting, "supersede")
                    out.append(Release(waiting.rid))
            elif j in self._in_place_read:
                if j in self._waiting or not first:  # a copy already waits: one is enough
                    self._move(r, "duplicate")
                    out.append(Release(rid))
                else:
                    self._move(r, "wait")
                    self._waiting[j] = r
            else:
                self._deliver(r, out)
        self._after_change(now, out)
        return out

    def tick(self, now: float, usable: Collection[int] | None = None) -> list[Action]:
        """Time passes: reads stuck past ``hedge_after_s`` report their tier and are read again elsewhere
        (``usable``: tiers whose breaker lets them be used; None = all)."""
        out: list[Action] = []
        if self.hedge_after_s is None or self.closed:
            return out
        self._last_tick = now
        for t in range(self.n_tiers):
            stuck = [r.chunk for r in self._active[t].values() if now - r.started > self.hedge_after_s]
            if not stuck:
                self._stalled.pop(t, None)
                continue
            last = self._stalled.get(t)
            if last is None or now - last >= self.hedge_after_s:  # one failure per hedge period, not per read
                self._stalled[t] = now
                out.append(Stalled(t))
            for u in range(self.n_tiers):
                if u == t or (usable is not None and u not in usable):
                    continue
                for j in self.sched.hedge(u, stuck):
                    out.append(self._open(u, j, now, hedged=True))
        if self.report_busy and self.sched.finished and self._waiting:
            for j, w in list(self._waiting.items()):
                r = self._in_place_read.get(j)
                if r is None or r.state not in _ACTIVE or now - r.started <= self.hedge_after_s:
                    continue
                # Everything else may be done: give up on the target, the stuck read frees it when it ends.
                self._move(r, "abandon")
                self._leave_window(r, now)
                r.busy = True
                self._resolve(j, "busy")
                out.append(Busy(j, r.rid))
                del self._waiting[j]
                self._move(w, "supersede")
                out.append(Release(w.rid))
        self._after_change(now, out)
        return out

    def computed(self, j: int, now: float) -> list[Action]:
        """The GPU finished recomputing chunk ``j`` (the :class:`Compute` the step asked for)."""
        if self._c_busy != j:
            raise ReadStepError(f"compute: chunk {j} reported computed, but the source is "
                                f"{self.compute_state.value!r} on chunk {self._c_busy}")
        abandoned = self.compute_state is _K.ABANDONED
        self._c_move("computed")
        self._c_busy = None
        out: list[Action] = []
        if abandoned:
            return out
        assert self.compute is not None
        if self.chunks[j] is not _C.PENDING:  # a hedge the tier won: its copy is used
            self.compute_wasted_s += self.compute.cost_s[j]
        else:
            self._resolve(j, "compute")
            self.computed_chunks.append(j)
            self.compute_s += self.compute.cost_s[j]
        self._compute_next(out)
        self._after_change(now, out)
        return out

    def close(self, now: float) -> list[Action]:
        """The consumer is done (or stopped early): no more claims; landed and waiting reads are released;
        reads still opening or in flight are abandoned (each is released when it ends). Returns Release actions
        for what can be freed now."""
        out: list[Action] = []
        if self.closed:
            return out
        self.closed = True
        for r in list(self.reads.values()):
            if r.state in _ACTIVE:
                self._move(r, "abandon")
                self._leave_window(r, now, abandoned=True)
            elif r.state in (_R.LANDED, _R.WAITING):
                unchecked = r.state is _R.LANDED  # its result was never looked at: the driver accounts for it
                if r.unread:
                    r.unread = False
                    self._unread -= r.nbytes
                self._move(r, "abandon")
                self._forget_in_place(r)
                out.append(Release(r.rid, late=unchecked))
        self._waiting.clear()
        if self.compute_state in (_K.IDLE, _K.BUSY):
            self._c_move("close")
        for t in range(self.n_tiers):
            self._end_busy(t, now)
        return out

    # -- internals ------------------------------------------------------------------------------------------
    def _steal_pays(self, tier: int, j: int) -> bool:
        """Whether a second read of chunk ``j`` on ``tier`` can land before the copy in flight elsewhere. A deep
        device queue serves its reads side by side, so the owner's read ends about when the owner's bytes in
        flight have drained at its measured bandwidth, less the time the read has already had; the stealer's
        ends when its own bytes in flight plus this read have drained at its bandwidth. A steal that cannot
        win only spends both tiers' bandwidth (measured: up to 16 wasted 4 MiB reads per step when two equal
        tiers on one disk met)."""
        owner = next((r for a in self._active for r in a.values() if r.chunk == j and r.tier != tier), None)
        if owner is None:
            return True
        bw_owner, bw_self = self.bandwidth[owner.tier], self.bandwidth[tier]
        owner_left = self._inflight_bytes[owner.tier] / bw_owner - (self._now - owner.started)  # type: ignore[operator]
        self_time = (self._inflight_bytes[tier] + self.nbytes[j]) / bw_self  # type: ignore[operator]
        if self_time < owner_left:
            return True
        self.steals_declined += 1
        return False

    def _c_move(self, event: str) -> None:
        nxt = _COMPUTE_TRANSITIONS[self.compute_state].get(event)
        if nxt is None:
            raise ReadStepError(f"compute: event {event!r} in state {self.compute_state.value!r}")
        self.compute_state = nxt

    def _compute_next(self, out: list[Action]) -> None:
        """An idle compute source claims the chain's next chunk, or stops for good (module docstring)."""
        if self.compute_state is not _K.IDLE:
            return
        plan = self.compute
        assert plan is not None
        j = self._c_next
        # A chunk a tier delivered is on its way to the GPU: compute goes on behind it (its predecessors are
        # all there). A lost one ends the chain: nothing after it is usable.
        while j < len(plan.cost_s) and self.chunks[j] is _C.DELIVERED:
            j += 1
        self._c_next = j
        if self.closed or j >= len(plan.cost_s) or self.chunks[j] is not _C.PENDING:
            self._c_move("stop")
            return
        if self.sched.claimed(j):
            # A tier has it (they met): compute recomputes it too, a hedge of the tier's read. It costs GPU time
            # the step waits through anyway (the step ends when every chunk is resolved, not when compute
            # does) and no bandwidth, and a long-tailed read (a PFS chunk can take 5x its share) no longer
            # holds the step: the first copy wins, the other is a duplicate. No claim rule, for that reason.
            self.compute_hedges += 1
        elif not self._compute_pays(j) or not self.sched.take_for_compute(j):
            self._c_move("stop")
            return
        self._c_move("claim")
        self._c_busy = j
        self._c_next = j + 1
        out.append(Compute(j, plan.cost_s[j]))

    def _compute_first(self, t: int) -> bool:
        """Whether tier ``t``'s next claim is better left to compute: compute would reach that chunk (finishing
        every chunk before it) before the tier's read could land, at the tier's measured bandwidth behind its
        bytes in flight. The rule that lets compute take everything from a tier slower than the GPU. Never
        before the tier has claimed once in the step (so every step measures it, and a stale estimate heals)
        nor once compute has stopped (the tiers then bring everything left)."""
        plan = self.compute
        if plan is None or self.compute_state is not _K.BUSY:
            return False
        bw = plan.bandwidth[t] if t < len(plan.bandwidth) else 0.0
        if not bw or bw <= 0 or not self.sched.stats[t].claimed:
            return False
        nxt = self.sched.peek(t, 1)
        if not nxt or nxt[0] >= len(plan.cost_s) or nxt[0] < self._c_next:
            return False  # past the chain (only a tier can bring it), or behind compute's front
        j = nxt[0]
        start = self._c_busy if self._c_busy is not None else self._c_next
        reach = self._c_cum[j + 1] - self._c_cum[start]
        land = (self._inflight_bytes[t] + self.nbytes[j]) / bw
        if land > reach:
            self.claims_declined += 1
            return True
        return False

    def _compute_pays(self, j: int) -> bool:
        """Whether recomputing chunk ``j`` ends before the tiers are expected to have read every other pending
        chunk: otherwise the step would wait for the GPU, and a tier reads it instead. Bytes already in flight
        count whole (a small bias toward computing, which ``margin`` covers)."""
        plan = self.compute
        assert plan is not None
        bw = sum(b for b in plan.bandwidth if b and b > 0)
        if bw <= 0:
            return True
        return plan.cost_s[j] * (1.0 + plan.margin) <= (self._pending_bytes - self.nbytes[j]) / bw

    def _read(self, rid: int) -> _Read:
        r = self.reads.get(rid)
        if r is None:
            raise ReadStepError(f"read {rid}: not a read of this step")
        return r

    def _move(self, r: _Read, event: str) -> None:
        nxt = _READ_TRANSITIONS[r.state].get(event)
        if nxt is None:
            raise ReadStepError(f"read {r.rid} (chunk {r.chunk}, tier {r.tier}): event {event!r} in state "
                                f"{r.state.value!r}")
        r.state = nxt

    def _resolve(self, j: int, event: str) -> None:
        nxt = _CHUNK_TRANSITIONS[self.chunks[j]].get(event)
        if nxt is None:
            raise ReadStepError(f"chunk {j}: event {event!r} in state {self.chunks[j].value!r}")
        self.chunks[j] = nxt
        self.unresolved -= 1
        self._pending_bytes -= self.nbytes[j]

    def _deliver(self, r: _Read, out: list[Action]) -> None:
        self._move(r, "deliver")
        self._resolve(r.chunk, "deliver")
        out.append(Deliver(r.rid, r.chunk))

    def _forget_in_place(self, r: _Read) -> None:
        if r.in_place and self._in_place_read.get(r.chunk) is r:
            del self._in_place_read[r.chunk]

    def _open(self, t: int, j: int, now: float, hedged: bool = False) -> Open:
        rid = self._next_rid
        self._next_rid += 1
        r = _Read(rid, t, j, now, self.nbytes[j])
        self.reads[rid] = r
        if not self._active[t]:
            self._busy_since[t] = now
        self._active[t][rid] = r
        self._inflight_bytes[t] += r.nbytes
        return Open(rid, t, j, hedged)

    def _leave_window(self, r: _Read, now: float, abandoned: bool = False) -> None:
        a = self._active[r.tier]
        if a.pop(r.rid, None) is None:
            return
        self._inflight_bytes[r.tier] -= r.nbytes
        if not a:
            self._end_busy(r.tier, now)

    def _end_busy(self, t: int, now: float) -> None:
        since = self._busy_since[t]
        if since is not None:
            self.busy_s[t] += now - since
            self._busy_since[t] = None

    def _fill(self, t: int, now: float, out: list[Action]) -> None:
        self._now = now
        # A read is claimed only if it fits the window whole (a tier always may have one read in flight): a
        # window of 1.05 chunks means one read at a time, not two.
        while not self.closed and (self._inflight_bytes[t] + self._read_size <= self.windows[t]
                                   or not self._active[t]):
            if self._compute_first(t):
                return
            claim = self.sched.next_claim(t)
            if not claim:
                return
            for j in claim:
                out.append(self._open(t, j, now))

    def _settle_lost(self, out: list[Action]) -> None:
        lost = self.sched.lost()
        for j in lost[self._lost_seen:]:
            if j == self._c_busy and self.compute_state is _K.BUSY:
                # Every tier failed it, but the GPU is recomputing it (a hedge): compute is its last holder.
                self._lost_by_tiers.add(j)
            elif self.chunks[j] is _C.PENDING:
                self._resolve(j, "lose")
                out.append(Lost(j))
        self._lost_seen = len(lost)
        for j in [j for j in self._lost_by_tiers if j != self._c_busy or self.compute_state is not _K.BUSY]:
            self._lost_by_tiers.discard(j)
            if self.chunks[j] is _C.PENDING and not self.closed:  # compute ended without it: now it is lost
                self._resolve(j, "lose")
                out.append(Lost(j))

    def _settle_stuck(self, out: list[Action]) -> None:
        """Nothing active, nothing landed or waiting, chunks unresolved and no tier will claim them (their
        holders refused them all): they are lost."""
        if (self.closed or not self.unresolved or self.active() or self._unread or self._waiting
                or self.compute_state is _K.BUSY):
            return
        if any(r.state is _R.LANDED for r in self.reads.values()):
            return
        for j, st in enumerate(self.chunks):
            if st is _C.PENDING:
                self._resolve(j, "lose")
                out.append(Lost(j))

    def _after_change(self, now: float, out: list[Action]) -> None:
        self._settle_lost(out)
        if not self.closed and self._unread <= self.readahead_bytes:
            for t in range(self.n_tiers):
                self._fill(t, now, out)
        self._settle_stuck(out)
