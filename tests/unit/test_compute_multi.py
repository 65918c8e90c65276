"""Every request of a load gets its own front/back split (:func:`kvstream.compute.split_load`).

A random load of several requests (some sharing a document prefix, some with their first chunks in host
memory, each with its own per-chunk GPU costs growing with position) is split by the policy the way both
drivers do it (the simulator's store reorders the step's chunks; replay's store is handed its keys in
:func:`~kvstream.compute.compute_order_hint`'s order and keeps them), and the read step is driven by random
events in any order a driver could produce. What must hold:

- every chunk of the load is resolved exactly once, by exactly one source (a tier's Deliver, a Lost, or the
  GPU's ``computed``), and all of them are when the step runs to its end;
- per request, recomputed chunks are claimed strictly in prefix order: when the GPU claims a request's chunk
  ``p``, every chunk before ``p`` of every request holding it is resolved (recomputed or delivered);
- the split point is inside each request's prefix: the chunks of a request the merged chain holds are a leading
  run of it (positions ``0..h-1``, all read, none in host memory), everything the GPU recomputed is in it, and
  the request's leading recomputed run (what a driver reports per request) is at most ``h``;
- both drivers' ways of applying the rule give the step the same chain.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstream.compute import (
    ComputePolicy, compute_order_hint, item_chains, leading_computed, merge_chains, split_load,
)
from kvstream.read_step import ChunkState, Compute, Deliver, Lost, Open, ReadState, ReadStep, Release, Submit
from kvstream.routing import FixedSplit, MeetInTheMiddle, SingleTier
from kvstream.testing.read_step import run_on_ideal_clock  # the same ideal-clock driver of one step

CHUNK = 8192


@st.composite
def loads(draw):
    """(items, in-memory chunks, holders by chunk, per-item costs)."""
    n_docs = draw(st.integers(1, 3))
    docs = [[f"d{d}c{i}" for i in range(draw(st.integers(0, 5)))] for d in range(n_docs)]
    items = []
    for k in range(draw(st.integers(2, 4))):
        doc = docs[draw(st.integers(0, n_docs - 1))]
        doc = doc[draw(st.integers(0, min(1, len(doc)))):]  # 1: its first chunk in HBM (a shifted prefix)
        own = [f"q{k}c{i}" for i in range(draw(st.integers(0 if doc else 1, 4)))]
        items.append(doc + own)
    everything = sorted({c for ch in items for c in ch})
    memory = set(draw(st.lists(st.sampled_from(everything), max_size=2, unique=True)))
    holders = {c: frozenset(draw(st.sampled_from([{0, 1}, {0, 1}, {0}, {1}, set()]))) for c in everything}
    costs = []
    for ch in items:
        base = draw(st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]))
        n = draw(st.integers(0, len(ch)))  # the core may send fewer costs than chunks (or none)
        if draw(st.booleans()):  # the cost model's shape: growing with position
            costs.append(tuple(base * (1 + 0.2 * p) for p in range(n)))
        else:  # any costs: the prefix order must hold whatever they are
            costs.append(tuple(draw(st.lists(st.sampled_from([1e-5, 1e-4, 1e-3, 1e-2]), min_size=n, max_size=n))))
    return items, memory, holders, costs


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(load=loads(),
       bandwidth=st.sampled_from([None, (1e6, 1e6), (1e8, 1e7), (1e9, 1e9)]),
       router=st.sampled_from(["mitm", "mitm2", "fixed", "single"]),
       driver=st.sampled_from(["sim", "replay"]),
       data=st.data())
def test_every_request_splits_and_every_chunk_has_one_source(load, bandwidth, router, driver, data):
    items, memory, holders_of, costs = load
    pol = ComputePolicy(n_tiers=2, bandwidth=list(bandwidth) if bandwidth else [])
    # The load's disk chunks, deduplicated, in item order (the simulator's store) or in the order replay's
    # store hands the keys over (the hint, with host memory known exactly here).
    if driver == "sim":
        seen: list = []
        for ch in items:
            seen += [c for c in ch if c not in memory and c not in seen]
        disk = seen
    else:
        disk = [c for c in compute_order_hint(items, costs, memory) if c not in memory]
    holders = [holders_of[c] for c in disk]
    split = split_load(pol, items, disk, holders, costs, CHUNK, reorder=(driver == "sim"))
    step_disk = [disk[i] for i in split.order]
    chains = item_chains(items, set(disk), [len(c) for c in costs])
    # What is not read is exactly what the items left to the step's prefill hold from their first disk chunk:
    # items with no chain, whose chunks no other item needs.
    left = {c for k, first in split.leave.items() for c in items[k][first:] if c in disk}
    assert sorted(split.order) == sorted(i for i, c in enumerate(disk) if c not in left)
    for k, first in split.leave.items():
        assert chains[k] == 0 and items[k][first] in disk and all(c not in disk for c in items[k][:first])
        assert not any(c in other for c in items[k][first:] if c in disk for other in items if other is not items[k])
    # Both drivers give the step the same chain.
    head, head_costs = merge_chains(items, chains, costs)
    assert step_disk[: split.chain] == head and split.cost_s == tuple(head_costs)
    # The split is inside each prefix: a request's chunks in the chain are a leading run of it.
    in_head = set(head)
    h = []
    for k, ch in enumerate(items):
        run = 0
        while run < len(ch) and ch[run] in in_head:
            run += 1
        assert not any(c in in_head for c in ch[run:]) or any(
            c in in_head and c in other and other.index(c) == ch.index(c)
            for c in ch[run:] for other in items if other is not ch), f"item {k}: chain chunks after a gap"
        assert all(c not in memory for c in ch[:run])
        assert split.fronts[k] <= run
        h.append(run)

    r = {"mitm": MeetInTheMiddle(batch=1), "mitm2": MeetInTheMiddle(batch=2), "fixed": FixedSplit((0.5, 0.5)),
         "single": SingleTier(0)}[router]
    plan = split.plan
    step = ReadStep(r.schedule([set(x) for x in [holders[i] for i in split.order]], 2,
                               front=plan.front if plan else 0),
                    [CHUNK] * len(step_disk), [2 * CHUNK, 2 * CHUNK], compute=plan)
    resolved: dict[int, str] = {}
    opened: set[int] = set()
    taken: set[int] = set()
    pending: dict[int, str] = {}  # read -> "open" | "flight" | "landed"
    computing: list[int] = []
    position = {c: {k: ch.index(c) for k, ch in enumerate(items) if c in ch} for c in step_disk}

    def resolve(j, how):
        assert j not in resolved, f"chunk {step_disk[j]} resolved twice ({resolved[j]}, then {how})"
        resolved[j] = how

    def apply(acts):
        for a in acts:
            if isinstance(a, Open):
                assert a.chunk not in taken, "a chunk taken for compute was opened by a tier"
                opened.add(a.chunk)
                pending[a.read] = "open"
            elif isinstance(a, Submit):
                pending[a.read] = "flight"
            elif isinstance(a, Deliver):
                resolve(a.chunk, "delivered")
            elif isinstance(a, Lost):
                resolve(a.chunk, "lost")
            elif isinstance(a, Compute):
                j = a.chunk
                assert j < split.chain, "compute left the merged chain"
                assert not computing, "two chunks computed at once"
                c = step_disk[j]
                for k, p in position[c].items():  # strictly in prefix order, for every request holding it
                    for before in items[k][:p]:
                        jb = step_disk.index(before)
                        assert resolved.get(jb) in ("computed", "delivered"), \
                            f"request {k}: chunk {p} recomputed while chunk {items[k].index(before)} is " \
                            f"{resolved.get(jb, 'pending')}"
                if j not in opened:
                    taken.add(j)
                computing.append(j)
            else:
                assert isinstance(a, Release)

    apply(step.start(0.0))
    now = 0.0
    for _ in range(10_000):
        choices = [("gpu", computing[0])] if computing else []
        choices += [(state, rid) for rid, state in sorted(pending.items())]
        if not choices:
            break
        kind, x = data.draw(st.sampled_from(choices))
        now += 1e-4
        if kind == "gpu":
            computing.pop()
            before = step.chunks[x]
            acts = step.computed(x, now)
            if before is ChunkState.PENDING and step.chunks[x] is ChunkState.COMPUTED:
                resolve(x, "computed")
            apply(acts)
        elif kind == "open":
            del pending[x]
            if data.draw(st.sampled_from([True, True, True, False])):
                apply(step.opened(x, now, CHUNK))
            else:
                apply(step.open_failed(x, now))
        elif kind == "flight":
            del pending[x]
            acts = step.landed(x, now)
            if step.reads[x].state is ReadState.LANDED:
                pending[x] = "landed"
            apply(acts)
        else:
            del pending[x]
            apply(step.checked(x, now, data.draw(st.sampled_from([True, True, True, False]))))
    assert step.done and len(resolved) == len(step_disk), "a chunk was never resolved"
    for j, how in resolved.items():
        assert {"delivered": ChunkState.DELIVERED, "lost": ChunkState.LOST,
                "computed": ChunkState.COMPUTED}[how] is step.chunks[j]
    computed = {step_disk[j] for j in step.computed_chunks}
    assert computed <= in_head
    counts = leading_computed(items, computed, [len(ch) for ch in items])
    assert all(0 <= c <= hk for c, hk in zip(counts, h))
    step.close(now)


# -- several requests, slow tiers: each gets a split -----------------------------------------------------------
def test_every_request_of_a_load_gets_its_own_split():
    """Three requests of 12 chunks each, one tier reading a chunk in 10 ms, the GPU recomputing one in 2-4.2 ms
    (growing with position): each request's front is recomputed (the cheap early chunks of all three, not just
    the first request's), the tier reads the backs, and the load ends sooner than with one request's split.
    Remove the per-request split (only item 0 may recompute) and request 1 and 2 get nothing: the test fails."""
    n, k = 12, 3
    items = [[f"r{i}c{j}" for j in range(n)] for i in range(k)]
    disk = [c for ch in items for c in ch]
    holders = [{0}] * len(disk)
    costs = [tuple(0.002 + 0.0002 * j for j in range(n)) for _ in range(k)]

    def load(cost_s):
        pol = ComputePolicy(n_tiers=1, bandwidth=[CHUNK / 0.010])
        split = split_load(pol, items, disk, holders, cost_s, CHUNK)
        d = [disk[i] for i in split.order]
        plan = split.plan
        assert plan is not None
        step = ReadStep(SingleTier(0).schedule(holders, 1, front=plan.front), [CHUNK] * len(d), [CHUNK],
                        compute=plan)
        done, _, end = run_on_ideal_clock(step, 0.010)
        per_item = leading_computed(items, {d[j] for j in done}, [n] * k)
        return split, per_item, end

    split, per_item, end = load(costs)
    assert all(f > 0 for f in split.fronts), split.fronts  # the policy's split, per request
    assert all(c > 0 for c in per_item), per_item  # and what the step recomputed, per request
    assert max(per_item) - min(per_item) <= 2  # equal costs: the fronts are about equal
    _, only_first, end_first = load([costs[0], (), ()])  # the old rule: one request's front
    assert only_first[1:] == [0, 0]
    assert end < 0.85 * end_first, (end, end_first)


def test_shared_prefix_is_recomputed_once_and_counts_for_every_request():
    """Two questions on one document: the document's chunks are one chain (recomputed once, at the cost of the
    first to reach them), and each question continues its own chain after it."""
    doc = ["d0", "d1", "d2"]
    items = [doc + ["a0", "a1"], doc + ["b0"]]
    chains = item_chains(items, {c for ch in items for c in ch}, [5, 4])
    assert chains == [5, 4]
    order, costs = merge_chains(items, chains, [(1, 2, 3, 4, 5), (1, 2, 3, 3.5)])
    assert order == ["d0", "d1", "d2", "b0", "a0", "a1"] and costs == [1, 2, 3, 3.5, 4, 5]
    assert leading_computed(items, {"d0", "d1", "d2", "b0"}, [5, 4]) == [3, 4]
    # a chunk another request holds at another position ends both chains there (its prefix differs)
    assert item_chains([["x", "y"], ["y"]], {"x", "y"}) == [1, 0]
    # a leading chunk in host memory: no chain for that request
    assert item_chains([["m", "z"], ["w"]], {"z", "w"}) == [0, 1]


# -- replay's store applies the same rule ------------------------------------------------------------------------

def test_store_backend_gives_every_request_of_a_load_its_own_split():
    """Replay's store: the keys go to ``Store.read_chunks`` in the order kvstream.compute.split_load gives the
    step (the merged chain of the requests' fronts first), the compute request's plan covers every request's
    front, and LoadDone reports each request's leading recomputed run (nothing of it staged)."""
    from kvstream.compute import ComputePolicy
    from kvstream.serving.core import StartLoad
    from kvstream.serving.storebackend import StoreBackend
    from kvstream.store import RECOMPUTED, Chunk

    class Store:
        memory: set = set()

        def read_chunks(self, keys, *, metas=None, compute=None):
            self.keys = list(keys)
            req = compute(list(keys), [[0]] * len(keys))
            self.plan = req.plan
            for i, k in enumerate(keys):
                if i < req.plan.front:
                    yield i, RECOMPUTED
                else:
                    yield i, Chunk(key=k, meta=RECOMPUTED.meta, payload=memoryview(bytes(4096)), source="local")

    st = Store()
    pol = ComputePolicy(n_tiers=1, bandwidth=[4096 / 0.010])  # 10 ms a chunk; the GPU: 2-3.1 ms
    be = StoreBackend(st, model="m", chunk_bytes=4096, workers=1, compute=pol)
    try:
        items = ((7, tuple(f"a{j}" for j in range(8))), (8, tuple(f"b{j}" for j in range(8))))
        cost = tuple(0.002 + 0.00015 * j for j in range(8))
        got: list = []
        be._load(StartLoad(load_id=0, items=items, background=False, compute_s=(cost, cost)), got.append)
        (done,) = got
        front = st.plan.front
        assert 2 <= front < 16
        head = [st.keys[i] for i in range(front)]
        assert {be.key(c) for c in items[0][1][: front // 2]} | {be.key(c) for c in items[1][1][: front // 2]} \
            <= set(head)  # both requests' fronts, interleaved cheapest first
        per = dict(done.computed)
        assert per[7] > 0 and per[8] > 0 and per[7] + per[8] == front
        assert done.available == ((7, 8), (8, 8))
        assert be.staged_bytes == 4096 * (16 - front)  # recomputed chunks are on the GPU: nothing staged
    finally:
        be.close()
