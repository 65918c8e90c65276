"""The modelled store of one node: host memory + disk tiers on modelled devices, driven by the real policies.

It is a :class:`~kvstream.serving.backend.ServingBackend`, as replay's real store behind the core is: it answers
the serving core's ``lookup`` and carries out its ``StartLoad`` / ``WriteChunks`` / ``Flush`` / ``ReleaseChunks``
actions (dispatched by the one :func:`kvstream.serving.backend.dispatch`) in simulated time, with the *same*
policy objects the real engine uses: a :class:`kvstream.routing.ReadRouter` decides which tier reads which chunk
of a load, a :class:`kvstream.replication.ReplicationPolicy` which tiers get each written chunk (and which copies
to add after a read), and a :class:`kvstream.eviction.EvictionPolicy` which host-memory chunk leaves.

Host memory holds clean cached chunks and pinned ones (read for a request that has not run yet, or waiting
to be written). Pinned chunks are not in the eviction policy (its protocol: pinned entries are simply not
inserted). If everything is pinned, host memory overflows rather than deadlocks; the overflow is reported. The
pins a load takes for the core (one per item and chunk of its staged span, released by ``ReleaseChunks``) are
counted in :class:`kvstream.serving.staging.StagedPins`, the ledger replay's backend keeps too; host memory holds
a staged chunk pinned while that ledger has any pin on it.

Driving a read: the load's disk chunks form one :class:`kvstream.read_step.ReadStep`, the very object the real
store's reader drives (claims, read windows, the read-ahead bound, duplicates, losses). Here its actions are
carried out on modelled devices: an ``Open`` is answered at once (file metadata is not modelled), a ``Submit``
becomes a device read, a landing is checked after ``verify_s`` of the node's one verifying CPU, and a
``Deliver`` pins the chunk in host memory. No hedging: the devices do not stall.

Compute joins the meeting (``compute``: a :class:`kvstream.compute.ComputePolicy`): a load whose
``StartLoad`` carries ``compute_s`` gives its read step a compute source, and every item of the load its own
front/back split (:func:`kvstream.compute.split_load`, the rule replay's store applies too): each item's
leading chunks that are on disk (a chunk another item shares at another position, or one in host memory, ends
its chain: the core counts pins per item) are merged into one compute order, cheapest first, which leads the
step's chunk list; an item with no chain that the GPU recomputes sooner than the tiers read it is left out of
the read (the core recomputes it in the step's prefill). The step's :class:`Compute` actions
run on the node's modelled GPU: one chunk at a time, ``seconds`` each, on the event loop; computed chunks are
reported in ``LoadDone.computed`` and never pinned. The policy measures the tiers after each load, as the read
windows do. ``read_disk=False`` (the recompute-only baseline): ``lookup`` sees host memory only, so nothing is
read from the tiers and every miss is recomputed.

Disk tiers with a capacity evict with the store's :class:`~kvstream.eviction.EvictionPolicy` objects
(``SimTier.eviction``, LRU by default, as ``tiers/files.py`` does), counted in bytes like the store.

Writes: one op per (write batch, tier) on that tier's write queue, at most ``write_depth`` in flight; a chunk
becomes readable from a tier when that op completes, and until then it is in host memory (pinned).

The write backlog valve (``write_backlog_bytes``, the store's ``TierConfig.write_backlog_bytes``; None: off, the
model's old behaviour, where a slow tier's writes queue without limit and their chunks overflow host memory): a
*second* copy of a chunk is skipped at flush while its tier's queued and unfinished write bytes are at or past the
limit, and owed (:mod:`kvstream.replica_debt`). The store's catch-up rules
(:class:`~kvstream.replica_debt.CatchUpPolicy`, the same object) pay the debts: every ``interval_s`` a pass takes
up to ``batch`` debts of each tier whose backlog is below half the limit, from host memory if the chunk is there,
else by reading it back from a tier that holds it (one read at a time, a real read on that tier's device), then
writing it; a read-back waits while a load is reading from the tiers.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, cast

from kvstream.eviction import AccessMeta, EvictionPolicy, eviction_options, make_eviction_policy
from kvstream.compute import ComputePolicy, leading_computed, split_load
from kvstream.read_step import Action, ChunkState, Compute, Deliver, Open, ReadState, ReadStep, Release, Submit
from kvstream.debt_policy import BacklogValve, CatchUpPolicy, DebtAction, ValveDecision
from kvstream.replication import CopyOrder, ReadObservation, ReplicationPolicy, WriteIntent
from kvstream.read_windows import ReadWindows
from kvstream.routing import ReadRouter
from kvstream.serving.backend import ServingBackend
from kvstream.serving.core import LoadDone, StartLoad, WriteChunks, staged_span
from kvstream.serving.staging import StagedPins
from kvstream.sim.devices import READ, WRITE, Device
from kvstream.sim.engine import PRIO_IO, EventLoop
from kvstream.tiers.contract import TierCapabilities

__all__ = ["SimTier", "SimStorage", "chunk_key"]


def chunk_key(c: Hashable) -> bytes:
    """A store-style key for a simulated chunk id (replication policies hash or log keys)."""
    if isinstance(c, bytes):
        return c
    if isinstance(c, int) and c >= 0:
        return c.to_bytes(8, "little")
    return repr(c).encode()


class _PrefixLenPolicy(Protocol):
    """A replication policy with ``needs_prefix_len`` set: it reads ``prefix_len``, which the store sets."""

    prefix_len: int


@dataclass
class SimTier:
    """A disk tier of one node: a device (possibly shared with other nodes) and this node's capacity on it.

    Implements :class:`kvstream.tiers.contract.ModelledTier` (conformance: ``tests/contract/test_sim_tier.py``):
    a chunk is published when its modelled write lands, first wins (a chunk already here keeps its place in the
    eviction order), and :meth:`fit` evicts down to ``capacity_chunks`` after a batch has landed. Its contents are
    this node's own even on a shared device (no other node's chunks become visible here): not ``shared``."""

    name: str
    device: Device
    read_window: int = 2  # chunks in flight per tier and load
    write_depth: int = 4  # write ops in flight
    capacity_chunks: int | None = None  # None = unlimited; else this node's chunks are evicted (``eviction``)
    client: int = 0  # this node's client id on a shared device
    eviction: str = "lru"  # the store's tier eviction policy name (kvstream.eviction)
    # chunk id -> its bytes (the tier's contents); only publish() and fit() change it
    chunks: OrderedDict[Hashable, int] = field(default_factory=OrderedDict)
    write_q: deque[list[Hashable]] = field(default_factory=deque)
    writes_inflight: int = 0
    policy: EvictionPolicy | None = None  # built by setup() when capacity_chunks is set
    chunk_bytes: int = 0  # bytes per chunk, set by setup(): capacity_bytes = capacity_chunks × chunk_bytes
    read_bytes: int = 0  # bytes this node read here (duplicates included)
    dup_bytes: int = 0
    write_bytes: int = 0
    evicted: int = 0
    backlog_bytes: int = 0  # write bytes queued or in flight (the store's write backlog)
    skipped_backlog: int = 0  # second copies skipped at flush by the backlog valve (owed)
    catch_up_reads: int = 0  # owed chunks read back from this tier to copy them elsewhere
    _used: int = field(default=0, init=False, repr=False)  # invariant: the sum of chunks' sizes

    _CAPABILITIES: ClassVar[TierCapabilities] = TierCapabilities(modelled=True)

    def setup(self, chunk_bytes: int) -> None:
        """Size the tier for chunks of ``chunk_bytes`` (the store's): its eviction policy, if it has a capacity,
        counts bytes like the store's."""
        self.chunk_bytes = chunk_bytes
        if self.capacity_chunks is not None and self.policy is None:
            cap = self.capacity_chunks * chunk_bytes
            self.policy = make_eviction_policy(self.eviction, **eviction_options(self.eviction, cap))

    # -- the tier contract (kvstream.tiers.contract.ModelledTier) -------------------------------------------
    @property
    def capabilities(self) -> TierCapabilities:
        return self._CAPABILITIES

    def contains(self, key: Hashable) -> bool:
        return key in self.chunks

    def file_size(self, key: Hashable) -> int | None:
        return self.chunks.get(key)

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.capacity_chunks is None else self.capacity_chunks * self.chunk_bytes

    @property
    def used_bytes(self) -> int:
        return self._used

    def publish(self, key: Hashable, nbytes: int, *, now: float) -> bool:
        """The chunk's write landed: listed (and in the eviction policy) unless it was here first (False)."""
        if key in self.chunks:
            return False
        if self.policy is not None:
            self.policy.on_insert(key, nbytes, now=now)
        self.chunks[key] = nbytes
        self._used += nbytes
        return True

    def fit(self, *, now: float) -> int:
        """Evict in the policy's order until at most ``capacity_chunks`` are held; returns the chunks evicted."""
        if self.policy is None or self.capacity_chunks is None:
            return 0
        n = 0
        while len(self.chunks) > self.capacity_chunks:
            victim = self.policy.victim(now=now)
            if victim is None:
                break
            self.policy.on_remove(victim)
            self._used -= self.chunks.pop(victim)
            n += 1
        self.evicted += n
        return n


class _Load:
    __slots__ = ("load_id", "items", "avail", "disk", "step", "holders", "on_done", "need", "start", "pinned",
                 "done", "pot0", "chain")

    def __init__(self, load_id: int, items: Sequence[tuple[int, tuple[Hashable, ...]]],
                 on_done: Callable[[LoadDone], None], start: float) -> None:
        self.load_id = load_id
        self.items = items
        self.avail = [len(ch) for _, ch in items]  # leading chunks available per item (shrinks on loss)
        self.disk: list[Hashable] = []  # unique chunks to read, in read-list order
        self.need: dict[Hashable, list[int]] = {}  # chunk -> item indices waiting for it
        self.step: ReadStep | None = None
        self.holders: list[frozenset[int]] = []
        self.on_done = on_done
        self.start = start
        self.pinned: list[list[Hashable]] = [[] for _ in items]  # item -> chunks pinned on its behalf
        self.done = False  # reported to the core (duplicate reads may still be in flight)
        self.pot0: list[float] = []  # each tier's potential-read integral when the load started
        self.chain = 0  # leading chunks of items[0] the read step's compute source may recompute


class SimStorage(ServingBackend):
    """One node's modelled store. ``lookup`` is the serving core's query; the rest carry out its actions."""

    def __init__(
        self,
        loop: EventLoop,
        *,
        tiers: Sequence[SimTier],
        router: ReadRouter,
        replication: ReplicationPolicy,
        host_eviction: EvictionPolicy,
        host_capacity_chunks: int,
        chunk_bytes: int,
        verify_s: float = 0.0,
        read_windows: ReadWindows | None = None,
        compute: ComputePolicy | None = None,
        read_disk: bool = True,
        write_backlog_bytes: Sequence[int | None] | int | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a simulated store needs at least one disk tier")
        self.loop = loop
        self.tiers = list(tiers)
        self.router = router
        self.replication = replication
        self.policy = host_eviction
        self.host_cap = max(int(host_capacity_chunks), 0)
        self.chunk_bytes = int(chunk_bytes)
        # CPU seconds the read path spends on each landed chunk (header and checksum check, hand-off) on one
        # thread, before the chunk counts as landed and its tier claims the next: a FIFO "CPU" per node.
        self.verify_s = float(verify_s)
        # The store's window policy (kvstream.read_windows), in bytes; None = each tier's fixed read_window chunks.
        self.read_windows = read_windows
        self.compute = compute
        self.read_disk = read_disk
        self.computed_chunks = 0
        self.compute_s = 0.0
        self._cpu_free = 0.0
        self._host: dict[Hashable, int] = {}  # resident chunk -> pins (one for all its staged pins, one per write)
        self._staged: StagedPins[Hashable] = StagedPins()  # staged pins per chunk, one per load item (the core's)
        self._meta: dict[Hashable, AccessMeta] = {}
        self._write_left: dict[Hashable, int] = {}  # chunk -> target tier writes still to complete
        self._buffered: dict[Hashable, int] = {}  # put, not yet flushed: chunk -> position in its prefix
        self._buffer_end = 0
        self.put_bytes = 0
        self.host_hits = 0
        self.host_evictions = 0
        self.host_overflow_max = 0
        self.puts_no_room = 0  # puts that found host memory all pinned (the store's put would wait): write()
        self.loads_done = 0
        self.duplicate_chunks = 0
        self.lost_chunks = 0
        self.copy_orders = 0
        self._sets = [t.chunks for t in self.tiers]
        for t in self.tiers:
            t.setup(self.chunk_bytes)
        self.read_log: list[tuple[float, float, float, int, tuple[int, ...]]] = []  # (start, s, bound s, bytes, per tier)
        self.busy_log: list[tuple[float, ...]] = []  # per load in read_log: each tier's busy seconds in its step
        # The write backlog valve, per tier (None: off); see the module docstring.
        if write_backlog_bytes is None or isinstance(write_backlog_bytes, int):
            write_backlog_bytes = [write_backlog_bytes] * len(self.tiers)
        elif len(write_backlog_bytes) != len(self.tiers):
            raise ValueError(f"write_backlog_bytes: {len(write_backlog_bytes)} limits for {len(self.tiers)} tiers")
        self.valve = BacklogValve(write_backlog_bytes)  # the store's own valve object (kvstream.debt_policy)
        self.backlog_limit = self.valve.limits  # per tier, None: off (the same list, not a copy)
        self._owed: list[dict[Hashable, None]] = [{} for _ in self.tiers]  # tier -> chunks owed (oldest first)
        self._catch_up_due = False  # a catch-up pass is scheduled
        self._catch_up_busy = False  # a pass is reading a chunk back
        self.catch_up = CatchUpPolicy()
        self._reading_loads = 0  # loads whose read step is running (the store's serving read steps in flight)
        self.catch_up_copies = 0

    # -- the core's query -----------------------------------------------------------------------------------
    def lookup(self, chunk_ids: Sequence[Hashable]) -> tuple[int, int]:
        host, sets = self._host, self._sets
        present = in_host = 0
        for c in chunk_ids:
            if c in host:
                in_host += 1
            elif not self.read_disk or not any(c in s for s in sets):
                break
            present += 1
        return present, in_host

    # -- host memory ----------------------------------------------------------------------------------------
    def _pin(self, c: Hashable, meta: AccessMeta | None = None) -> None:
        host = self._host
        p = host.get(c)
        if p is None:
            self._make_room()
            host[c] = 1
            if meta is not None:
                self._meta[c] = meta
            over = len(host) - self.host_cap
            if over > self.host_overflow_max:
                self.host_overflow_max = over
        else:
            if p == 0:
                self.policy.on_remove(c)
            host[c] = p + 1

    def _unpin(self, c: Hashable) -> None:
        p = self._host.get(c)
        if p is None or p <= 0:
            raise AssertionError(f"unpin of chunk {c!r} that is not pinned")
        p -= 1
        self._host[c] = p
        if p == 0:
            self.policy.on_insert(c, self.chunk_bytes, now=self.loop.now, meta=self._meta.get(c))

    def _make_room(self) -> None:
        host = self._host
        while len(host) >= self.host_cap:
            v = self.policy.victim(now=self.loop.now)
            if v is None:
                return  # everything pinned: overflow
            self.policy.on_remove(v)
            del host[v]
            self._meta.pop(v, None)
            self.host_evictions += 1

    def _stage(self, c: Hashable) -> None:
        """One staged pin on ``c`` for a load item (the ledger both backends keep, :mod:`kvstream.serving.staging`);
        its first pins the chunk in host memory."""
        if self._staged.hold(c):
            self._pin(c)

    def _unstage(self, c: Hashable) -> None:
        if self._staged.release(c):
            self._unpin(c)

    def release(self, chunk_ids: Sequence[Hashable]) -> None:
        for c in chunk_ids:
            self._unstage(c)

    # -- loads ----------------------------------------------------------------------------------------------
    def start_load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        """Pin what host memory holds and read the rest in one read step; ``post(LoadDone)`` runs as an event on the
        loop when the load is over (never from inside this call)."""
        items, metas, compute_s = action.items, action.metas, action.compute_s
        n_t = len(self.tiers)
        ld = _Load(action.load_id, items, post, self.loop.now)
        host, sets = self._host, self._sets
        for k, (_, chunks) in enumerate(items):
            if k < len(metas) and metas[k][0] is not None:
                m = AccessMeta(session=metas[k][0], prev_answer_tokens=metas[k][1])
                for c in chunks:
                    self._meta[c] = m
            for j, c in enumerate(chunks):
                if c in host:
                    self._stage(c)
                    ld.pinned[k].append(c)
                    self.host_hits += 1
                    continue
                if c in ld.need:
                    ld.need[c].append(k)
                    continue
                hs = frozenset(t for t in range(n_t) if c in sets[t])
                if not hs:
                    ld.avail[k] = j  # gone everywhere since the lookup: the rest is recomputed
                    self.lost_chunks += 1
                    break
                ld.need[c] = [k]
                ld.disk.append(c)
                ld.holders.append(hs)
        plan = None
        if self.compute is not None and compute_s and ld.disk:
            # Every item its own split (kvstream.compute.split_load): the merged chain leads the step; items
            # left to the step's prefill are not read.
            split = split_load(self.compute, [ch[: ld.avail[k]] for k, (_, ch) in enumerate(items)], ld.disk,
                               ld.holders, compute_s, self.chunk_bytes)
            for k, first in split.leave.items():
                ld.avail[k] = first
            keep = set(split.order)
            for i, c in enumerate(ld.disk):
                if i not in keep:
                    del ld.need[c]
            ld.disk = [ld.disk[i] for i in split.order]
            ld.holders = [ld.holders[i] for i in split.order]
            ld.chain = split.chain
            plan = split.plan
        if not ld.disk:
            # Host memory only: done at once (as an event, so the core is never re-entered).
            self.loop.at(self.loop.now, PRIO_IO, self._finish_load, ld)
            return
        if self.read_windows is not None:
            windows = self.read_windows.windows()
        else:
            windows = [t.read_window * self.chunk_bytes for t in self.tiers]
        ld.step = ReadStep(self.router.schedule(ld.holders, n_t, front=plan.front if plan else 0),
                           [self.chunk_bytes] * len(ld.disk), windows, compute=plan)
        self._reading_loads += 1
        for tier in self.tiers:
            tier.device._advance(self.loop.now)
        ld.pot0 = [tier.device.potential_read for tier in self.tiers]
        self._carry_out(ld, ld.step.start(self.loop.now))

    def _carry_out(self, ld: _Load, acts: list[Action]) -> None:
        """The read step's actions on modelled devices (see the module docstring)."""
        todo = list(acts)
        step = ld.step
        assert step is not None  # every caller's actions came from ld.step
        while todo:
            a = todo.pop(0)
            if isinstance(a, Open):
                todo.extend(step.opened(a.read, self.loop.now, self.chunk_bytes))
            elif isinstance(a, Submit):
                r = step.reads[a.read]
                tier = self.tiers[r.tier]
                tier.device.submit(READ, a.nbytes, self._landed, (ld, a.read), client=tier.client)
            elif isinstance(a, Deliver):
                r = step.reads[a.read]
                c = ld.disk[a.chunk]
                for k in ld.need[c]:
                    self._stage(c)
                    ld.pinned[k].append(c)
                tier = self.tiers[r.tier]
                if tier.policy is not None and c in tier.chunks:
                    tier.policy.on_access(c, now=self.loop.now)
            elif isinstance(a, Release):
                r = step.reads[a.read]
                if r.state is ReadState.DUPLICATE or (a.late and r.state is ReadState.RELEASED):
                    self.tiers[r.tier].dup_bytes += self.chunk_bytes
                    self.duplicate_chunks += 1
            elif isinstance(a, Compute):
                # The modelled GPU recomputes the chunk: it waits for this load anyway (a blocking load).
                self.loop.at(self.loop.now + a.seconds, PRIO_IO, self._computed, (ld, a.chunk))
            # Lost: read from step.chunks when the load finishes; Stalled/Busy: no hedging here

    def _landed(self, arg: tuple[_Load, int]) -> None:
        ld, rid = arg
        step = ld.step
        assert step is not None  # a read landed, so the load's read step exists
        t = step.reads[rid].tier
        self.tiers[t].read_bytes += self.chunk_bytes
        acts = step.landed(rid, self.loop.now)
        self._carry_out(ld, acts)
        if step.reads[rid].state is not ReadState.LANDED:
            return  # a read the load no longer needed (it was over)
        if self.verify_s > 0:
            self._cpu_free = max(self._cpu_free, self.loop.now) + self.verify_s
            self.loop.at(self._cpu_free, PRIO_IO, self._verified, arg)
        else:
            self._verified(arg)

    def _computed(self, arg: tuple[_Load, int]) -> None:
        ld, j = arg
        step = ld.step
        assert step is not None
        self._carry_out(ld, step.computed(j, self.loop.now))
        if step.done and not ld.done:
            self._carry_out(ld, step.close(self.loop.now))
            self._finish_load(ld)

    def _verified(self, arg: tuple[_Load, int]) -> None:
        ld, rid = arg
        step = ld.step
        assert step is not None  # a read was verified, so the load's read step exists
        if ld.done or step.reads[rid].state is not ReadState.LANDED:
            return
        self._carry_out(ld, step.checked(rid, self.loop.now, True))
        if step.done and not ld.done:
            self._carry_out(ld, step.close(self.loop.now))
            self._finish_load(ld)

    def _finish_load(self, ld: _Load) -> None:
        assert not ld.done, "a load finishes once"
        ld.done = True
        if ld.step is not None:
            self._reading_loads -= 1
            lost = [j for j, st in enumerate(ld.step.chunks) if st is ChunkState.LOST]
            if lost:
                self.lost_chunks += len(lost)
                lost_set = {ld.disk[i] for i in lost}
                for k, (_, chunks) in enumerate(ld.items):
                    for j in range(ld.avail[k]):
                        if chunks[j] in lost_set:
                            ld.avail[k] = j
                            break
        counts = [0] * len(ld.items)  # per item: the leading run the GPU recomputed (on the GPU, never pinned)
        if ld.step is not None and ld.step.computed_chunks:
            done = {ld.disk[j] for j in ld.step.computed_chunks}
            counts = leading_computed([ch for _, ch in ld.items], done, ld.avail)
            self.computed_chunks += len(done)
            self.compute_s += ld.step.compute_s
            # Chunks recomputed behind one a tier delivered: the core counts a leading run per item, so these
            # are pinned as if loaded (their host->GPU move is charged: pessimistic, by a few ms a chunk).
            for k, (_, chunks) in enumerate(ld.items):
                for c in staged_span(chunks, ld.avail[k], counts[k]):
                    if c in done:
                        self._stage(c)
                        ld.pinned[k].append(c)
        # Each item keeps its pins on its staged span only (the rule the core releases by).
        for k, (_, chunks) in enumerate(ld.items):
            keep = set(staged_span(chunks, ld.avail[k], counts[k]))
            for c in ld.pinned[k]:
                if c not in keep:
                    self._unstage(c)
        self.loads_done += 1
        if ld.step is not None:
            now = self.loop.now
            dur = now - ld.start
            pot = 0.0
            for t, tier in enumerate(self.tiers):
                tier.device._advance(now)
                pot += tier.device.potential_read - ld.pot0[t]
            useful = (len(ld.disk) - len(ld.step.computed_chunks)) * self.chunk_bytes  # recomputed: not read
            # The aggregate-bandwidth bound: the time the useful bytes take at the sum of what each tier could
            # give reads over this very interval (its write load and other tenants included).
            bound = useful * dur / pot if pot > 0 else dur
            self.read_log.append((ld.start, dur, bound, useful, tuple(ld.step.tier_bytes)))
            self.busy_log.append(tuple(ld.step.busy_s))
            if self.read_windows is not None:
                for t in range(len(self.tiers)):
                    self.read_windows.observe(t, ld.step.tier_bytes[t], ld.step.busy_s[t])
            if self.compute is not None:
                for t in range(len(self.tiers)):
                    self.compute.observe(t, ld.step.tier_bytes[t], ld.step.busy_s[t])
            orders = self.replication.on_read(ReadObservation(
                now=self.loop.now,
                keys=[chunk_key(c) for c in ld.disk],
                holders=ld.holders,
                tier_bytes=ld.step.tier_bytes,
                tier_busy_s=ld.step.busy_s,
            ))
            if orders:
                self._copy(orders, ld)
        per_item = [(rid, c) for (rid, _), c in zip(ld.items, counts) if c]
        ld.on_done(LoadDone(load_id=ld.load_id,
                            available=tuple((rid, ld.avail[k]) for k, (rid, _) in enumerate(ld.items)),
                            computed=tuple(per_item)))

    # -- writes ---------------------------------------------------------------------------------------------
    def write(self, w: WriteChunks) -> None:
        """``put``: the chunks enter host memory at once (dirty, pinned) and wait for the next :meth:`flush`. A put
        that finds host memory all pinned (staged loads, unwritten chunks) is counted (``puts_no_room``): the
        store's put would wait there for a write to finish, and drop the chunk after ``put_wait_s``; the model
        overflows instead."""
        meta = AccessMeta(session=w.session, prev_answer_tokens=w.prev_answer_tokens)
        for j, c in enumerate(w.chunk_ids):
            self.put_bytes += self.chunk_bytes
            if c in self._buffered:
                continue
            if c not in self._host:
                self._make_room()
                if len(self._host) >= self.host_cap:
                    self.puts_no_room += 1
            self._pin(c, meta)
            self._buffered[c] = w.first_position + j
        self._buffer_end = w.first_position + len(w.chunk_ids)
        if getattr(self.replication, "needs_prefix_len", False):
            # A policy that places chunks by their position *relative to the prefix length at write time*
            # (K15's baseline): WriteIntent has no prefix length, so tell it and place this batch now.
            cast(_PrefixLenPolicy, self.replication).prefix_len = self._buffer_end
            self.flush()

    def flush(self) -> None:
        """Hand every buffered chunk to the tiers the replication policy picks (one write op per tier)."""
        n_t = len(self.tiers)
        per_tier: list[list[Hashable]] = [[] for _ in range(n_t)]
        pol = self.replication
        for c, pos in self._buffered.items():
            targets = pol.targets(WriteIntent(key=chunk_key(c), nbytes=self.chunk_bytes, position=pos), n_t)
            todo = [t for t in targets if c not in self._sets[t]]
            todo = self._valve(c, todo, per_tier)
            if not todo:
                self._unpin(c)
                continue
            # The host copy stays pinned until every target has it: one pin per pending tier write.
            self._write_left[c] = self._write_left.get(c, 0) + len(todo)
            for t in todo[1:]:
                self._pin(c)
            for t in todo:
                per_tier[t].append(c)
        self._buffered.clear()
        for t, chunks in enumerate(per_tier):
            if chunks:
                self._enqueue_write(t, chunks)

    def _valve(self, c: Hashable, todo: list[int], per_tier: list[list[Hashable]]) -> list[int]:
        """The store's write backlog valve (:class:`~kvstream.debt_policy.BacklogValve`, as ``Writer.flush`` asks
        it): in tier order, a copy is skipped and owed when the chunk already has a copy (on a tier, or handed
        over in this flush) and the tier's backlog (bytes queued or in flight, this flush's included) is at or
        past its limit."""
        if not self.valve.active:
            return todo
        copies = sum(1 for s in self._sets if c in s)
        keep = []
        for t in sorted(todo):
            pending = self.tiers[t].backlog_bytes + len(per_tier[t]) * self.chunk_bytes
            verdict = self.valve.decide(t, copies=copies, backlog=pending)
            if verdict is not ValveDecision.WRITE:
                self.tiers[t].skipped_backlog += 1
                if verdict is ValveDecision.OWE:  # deferred, not dropped (SKIP: one copy wanted)
                    self._owe(t, c)
                continue
            keep.append(t)
            copies += 1
        return keep

    def _owe(self, t: int, c: Hashable) -> None:
        self._owed[t][c] = None
        if not self._catch_up_due:
            self._catch_up_due = True
            self.loop.at(self.loop.now + self.catch_up.interval_s, PRIO_IO, self._catch_up)

    def _catch_up(self) -> None:
        """One pass of the store's catch-up (``CatchUp.round``, by the same :class:`CatchUpPolicy`): per tier with
        debts and a backlog below half its limit, up to ``batch`` debts in the policy's order (those in host
        memory first); reads back run one after another."""
        self._catch_up_due = False
        if not self._catch_up_busy:
            work: list[tuple[int, Hashable]] = []
            for t, tier in enumerate(self.tiers):
                if not self._owed[t] or not CatchUpPolicy.tier_ready(True, tier.backlog_bytes, self.backlog_limit[t]):
                    continue
                owed = list(self._owed[t])
                work.extend((t, c) for c in self.catch_up.select(owed[:self.catch_up.batch],
                                                                 owed[::-1][:self.catch_up.batch],
                                                                 self._host.__contains__))
            self._catch_up_next(work)
        if any(self._owed) and not self._catch_up_due:
            self._catch_up_due = True
            self.loop.at(self.loop.now + self.catch_up.interval_s, PRIO_IO, self._catch_up)

    def _catch_up_next(self, work: list[tuple[int, Hashable]]) -> None:
        while work:
            t, c = work.pop(0)
            if c not in self._owed[t]:
                continue
            holders = [o for o in range(len(self.tiers)) if o != t and c in self._sets[o]]
            act = self.catch_up.decide(on_tier=c in self._sets[t], in_memory=c in self._host,
                                       has_holder=bool(holders), serving=self._reading_loads > 0)
            if act is DebtAction.DEFER:
                continue
            if act is not DebtAction.READ_BACK:
                del self._owed[t][c]
                if act is DebtAction.COPY:
                    self._order_copy(t, c)
                continue
            # Read it back from the first holder (one read at a time, as the store's catch-up thread does).
            src = self.tiers[holders[0]]
            src.catch_up_reads += 1
            self._catch_up_busy = True
            src.device.submit(READ, self.chunk_bytes, self._caught_up, (t, c, holders[0], work), client=src.client)
            return
        self._catch_up_busy = False
        self.catch_up.end_round()

    def _caught_up(self, arg: tuple[int, Hashable, int, list[tuple[int, Hashable]]]) -> None:
        t, c, src, work = arg
        self.tiers[src].read_bytes += self.chunk_bytes
        if c in self._owed[t]:
            del self._owed[t][c]
            if c not in self._sets[t]:
                # Into host memory as a cached chunk, kept (pinned) by the copy until it is written.
                self._pin(c)
                self._unpin(c)
                self._order_copy(t, c)
        self._catch_up_next(work)

    def _order_copy(self, t: int, c: Hashable) -> None:
        self._pin(c)
        self._write_left[c] = self._write_left.get(c, 0) + 1
        self.catch_up_copies += 1
        self._enqueue_write(t, [c])

    def _copy(self, orders: list[CopyOrder], ld: _Load) -> None:
        by_key = {chunk_key(c): c for c in ld.disk}
        per_tier: dict[int, list[Hashable]] = {}
        for o in orders:
            c = by_key.get(o.key)
            if c is None or c in self._sets[o.tier] or c not in self._host:
                continue
            self._pin(c)
            self._write_left[c] = self._write_left.get(c, 0) + 1
            per_tier.setdefault(o.tier, []).append(c)
            self.copy_orders += 1
        for t, chunks in per_tier.items():
            self._enqueue_write(t, chunks)

    def _enqueue_write(self, t: int, chunks: list[Hashable]) -> None:
        tier = self.tiers[t]
        tier.backlog_bytes += len(chunks) * self.chunk_bytes
        tier.write_q.append(chunks)
        self._pump_writes(t)

    def _pump_writes(self, t: int) -> None:
        tier = self.tiers[t]
        while tier.write_q and tier.writes_inflight < tier.write_depth:
            chunks = tier.write_q.popleft()
            tier.writes_inflight += 1
            tier.device.submit(WRITE, len(chunks) * self.chunk_bytes, self._written, (t, chunks), client=tier.client)

    def _written(self, arg: tuple[int, list[Hashable]]) -> None:
        t, chunks = arg
        tier = self.tiers[t]
        tier.writes_inflight -= 1
        tier.write_bytes += len(chunks) * self.chunk_bytes
        tier.backlog_bytes -= len(chunks) * self.chunk_bytes
        for c in chunks:
            tier.publish(c, self.chunk_bytes, now=self.loop.now)
            left = self._write_left[c] - 1
            if left:
                self._write_left[c] = left
            else:
                del self._write_left[c]
            self._unpin(c)
        tier.fit(now=self.loop.now)  # once the whole batch has landed (as before: one of its chunks may go)
        self._pump_writes(t)

    def prewarm(self, chunk_ids: Sequence[Hashable], tiers: Sequence[str] | None = None) -> None:
        """Put chunks on the tiers the replication policy picks, in no time (a cache filled before the run);
        ``tiers``: only on those of them with these names (a cold local disk: the shared tier alone)."""
        n_t = len(self.tiers)
        for j, c in enumerate(chunk_ids):
            for t in self.replication.targets(WriteIntent(key=chunk_key(c), nbytes=self.chunk_bytes, position=j), n_t):
                if tiers is not None and self.tiers[t].name not in tiers:
                    continue
                self.tiers[t].publish(c, self.chunk_bytes, now=0.0)  # before the run: time 0; no eviction

    # -- the serving backend's window and samples --------------------------------------------------------------
    @property
    def wants_window(self) -> bool:
        """The host-memory policy is queue-aware (the store's rule: ``HostMemoryTier.queue_aware``)."""
        return hasattr(self.policy, "set_window")

    def set_window(self, sessions: Sequence[Hashable]) -> None:
        set_window = getattr(self.policy, "set_window", None)
        if set_window is not None:
            set_window(sessions)

    def sample(self) -> dict[str, int]:
        return self.tier_bytes()

    # -- reports --------------------------------------------------------------------------------------------
    def busy(self) -> bool:
        return (bool(self._buffered) or any(t.write_q or t.writes_inflight for t in self.tiers)
                or any(self._owed) or self._catch_up_busy)

    def bound_ratio(self) -> float:
        """Disk read time over the aggregate-bandwidth bound, summed over every load (1.0 = at the bound)."""
        dur = sum(r[1] for r in self.read_log)
        bound = sum(r[2] for r in self.read_log)
        return dur / bound if bound > 0 else float("nan")

    def stats(self) -> dict[str, Any]:
        written = sum(t.write_bytes for t in self.tiers)
        out: dict[str, Any] = {
            "put_bytes": self.put_bytes,
            "write_amplification": written / self.put_bytes if self.put_bytes else 0.0,
            "host_evictions": self.host_evictions,
            "host_overflow_max": self.host_overflow_max,
            "puts_no_room": self.puts_no_room,
            "duplicate_chunks": self.duplicate_chunks,
            "lost_chunks": self.lost_chunks,
            "copy_orders": self.copy_orders,
            "computed_chunks": self.computed_chunks,
            "compute_s": self.compute_s,
            "disk_loads": len(self.read_log),
            "read_s": sum(r[1] for r in self.read_log),
            "read_bound_s": sum(r[2] for r in self.read_log),
        }
        valve = any(lim is not None for lim in self.backlog_limit)
        if valve:  # only then: the figures of runs without the valve keep their keys
            out["catch_up_copies"] = self.catch_up_copies
            out["catch_up_reads_deferred"] = self.catch_up.reads_deferred
        for t in self.tiers:
            out[f"read_bytes_{t.name}"] = t.read_bytes
            out[f"write_bytes_{t.name}"] = t.write_bytes
            if valve:
                out[f"write_skipped_backlog_{t.name}"] = t.skipped_backlog
                out[f"catch_up_reads_{t.name}"] = t.catch_up_reads
        return out

    def tier_bytes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tiers:
            out[f"{t.name}.read"] = t.read_bytes
            out[f"{t.name}.write"] = t.write_bytes
        return out
