"""The modelled store driven by the real routing / replication / eviction objects, and whole simulated runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstream.eviction import make_eviction_policy
from kvstream.replication import parse_replication
from kvstream.routing import parse_router
from kvstream.serving.core import LoadDone, ServingConfig, StartLoad, WriteChunks
from kvstream.sim.devices import Device, LatencyTail
from kvstream.sim.driver import Hardware, SystemConfig, TierModel, simulate
from kvstream.sim.engine import EventLoop
from kvstream.sim.storage import SimStorage, SimTier
from kvstream.workload import generate, preset, read_mooncake
from kvstream.workload.synthetic import SyntheticSpec

TRACES = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces"
MB = 1 << 20


def _store(router="mitm", replication="full", bws=(3e9, 1e9), host_chunks=1000, chunk=64 * MB, window=2):
    loop = EventLoop()
    tiers = [SimTier(name=f"t{i}", device=Device(loop, f"t{i}", read_bw=bw, write_bw=bw), read_window=window)
             for i, bw in enumerate(bws)]
    st = SimStorage(loop, tiers=tiers, router=parse_router(router, [t.name for t in tiers]),
                    replication=parse_replication(replication), host_eviction=make_eviction_policy("lru"),
                    host_capacity_chunks=host_chunks, chunk_bytes=chunk)
    return loop, st


def _load(loop, st, ids):
    got = []
    st.start_load(StartLoad(load_id=0, items=((7, tuple(ids)),), background=False), got.append)
    loop.run(until=1e6)
    return got


def test_mitm_read_is_at_the_aggregate_bound():
    loop, st = _store()
    ids = list(range(1, 201))
    st.prewarm(ids)
    assert st.lookup(ids) == (200, 0)
    got = _load(loop, st, ids)
    assert got == [LoadDone(load_id=0, available=((7, 200),))]
    start, dur, bound, useful, per_tier = st.read_log[0]
    assert bound == pytest.approx(200 * 64 * MB / 4e9, rel=1e-6)
    assert dur / bound < 1.02  # within 2 % of the bound
    assert per_tier[0] > 2.5 * per_tier[1]  # the faster tier read about three quarters
    assert st.lookup(ids) == (200, 200)  # now pinned in host memory
    st.release(ids)
    assert all(p == 0 for p in st._host.values())


def test_fixed_split_loses_when_ratio_is_wrong_and_single_tier_reads_one():
    loop, st = _store(router="fixed:0.5")
    ids = list(range(1, 201))
    st.prewarm(ids)
    _load(loop, st, ids)
    dur, bound = st.read_log[0][1], st.read_log[0][2]
    assert dur / bound == pytest.approx(2.0, rel=0.02)  # 50 % from a tier with 25 % of the bandwidth
    loop, st = _store(router="single:t0", replication="single")
    st.prewarm(ids)
    _load(loop, st, ids)
    assert st.tiers[1].read_bytes == 0


def test_writes_follow_replication_and_become_readable_when_done():
    loop, st = _store(replication="partial:0.4")
    st.write(WriteChunks(request_id=1, chunk_ids=tuple(range(1, 101)), first_position=0))
    assert st.lookup(list(range(1, 101))) == (100, 100)  # buffered in host memory at once
    assert not st.tiers[0].chunks
    st.flush()
    loop.run(until=1e6)
    assert len(st.tiers[0].chunks) == 100
    assert 30 <= len(st.tiers[1].chunks) <= 50  # ~40 % get a second copy
    s = st.stats()
    assert s["write_amplification"] == pytest.approx(1 + len(st.tiers[1].chunks) / 100)
    assert all(p == 0 for p in st._host.values())  # write pins released


def test_host_memory_evicts_unpinned_only():
    loop, st = _store(host_chunks=10)
    st.write(WriteChunks(request_id=1, chunk_ids=tuple(range(1, 21)), first_position=0))
    assert len(st._host) == 20 and st.host_overflow_max == 10  # all pinned (unwritten): overflow, no loss
    st.flush()
    loop.run(until=1e6)
    st.write(WriteChunks(request_id=2, chunk_ids=(99,), first_position=0))
    assert len(st._host) <= 11 and st.host_evictions >= 10


def _small_run(seed: int, record=None):
    reqs = generate(SyntheticSpec(n_requests=120, rate=4.0, cv=2.0, reuse=0.8, active=12), seed=1)
    tiers = (TierModel(name="nvme", read_bw=6e9, write_bw=3e9, interference=0.27,
                       tail=LatencyTail(sigma_alone=0.24, sigma_mixed=0.85)),
             TierModel(name="pfs", read_bw=2e9, write_bw=1e9, tail=LatencyTail(sigma_alone=0.88), background="bursty:0.6:2:5"))
    sysc = SystemConfig(name="kvstream", tiers=tiers, host_memory_bytes=2e9,
                        serving=ServingConfig(admit="ready", prefetch="hrrn"))
    return simulate([reqs], sysc, Hardware(gpu="h100", model="14b", hbm_kv_bytes=4e9), seed=seed, record=record)


def test_same_seed_same_trace():
    rec_a, rec_b, rec_c = [], [], []
    a = _small_run(3, rec_a)
    b = _small_run(3, rec_b)
    c = _small_run(4, rec_c)
    assert a.summary == b.summary and rec_a == rec_b
    assert a.summary["completed"] == 120
    assert rec_c != rec_a  # the seed drives the latency tails and the background traffic


def test_host_memory_pins_all_released_after_a_run():
    res = _small_run(0)
    assert res.summary["completed"] == 120 and res.summary["storage_lost_chunks"] == 0


@pytest.mark.skipif(not (TRACES / "mooncake").exists(), reason=f"trace folder absent: {TRACES}")
def test_mooncake_sample_runs_every_system():
    reqs = read_mooncake(TRACES / "mooncake" / "conversation_trace.jsonl", limit=300)
    from kvstream.sim.scenarios import GB, kvstream, lmcache, testbed_tiers

    tiers = testbed_tiers(1)
    for sysc in (lmcache(tiers, 128 * GB), kvstream(tiers, 128 * GB),
                 kvstream(tiers, 128 * GB, admit="ready", prefetch="hrrn")):
        s = simulate([reqs], sysc, Hardware(gpu="h100", model="70b"), seed=0).summary
        assert s["completed"] == 300
        assert s["ttft_mean_s"] > 0


def test_quick_scenario_prints_paper_beside_its_own(tmp_path):
    from kvstream.sim.scenarios import run_scenario

    res = run_scenario("bound", tmp_path, quick=True)
    assert (tmp_path / "bound.png").exists() and (tmp_path / "bound.json").exists()
    k1 = [r for r in res.rows if r.target == "K1"][0]
    assert k1.paper.startswith("<= 4.3 %") and k1.verdict == "reproduced"
    assert "K2" in res.table()


def _step_ratios(windows, n_loads=12, per_load=12):
    from kvstream.read_windows import make_read_windows

    loop = EventLoop()
    chunk = 7 * MB
    tiers = [SimTier(name=f"t{i}", device=Device(loop, f"t{i}", read_bw=bw, write_bw=bw), read_window=6)
             for i, bw in enumerate((1.5e9, 0.4e9))]
    st = SimStorage(loop, tiers=tiers, router=parse_router("mitm", ["t0", "t1"]),
                    replication=parse_replication("full"), host_eviction=make_eviction_policy("lru"),
                    host_capacity_chunks=4, chunk_bytes=chunk,
                    read_windows=make_read_windows(windows, [6 * chunk, 6 * chunk], min_bytes=chunk)
                    if windows != "fixed" else None)
    ids = list(range(1, n_loads * per_load + 1))
    st.prewarm(ids)
    for k in range(n_loads):  # one load after another, as a serving loop's steps are
        got = []
        st.start_load(StartLoad(load_id=k, items=((k, tuple(ids[k * per_load:(k + 1) * per_load])),),
                                background=False), got.append)
        loop.run(until=loop.now + 10)
        assert got and got[0].available == ((k, per_load),)
        st.release(ids[k * per_load:(k + 1) * per_load])
    return [dur / bound for _, dur, bound, _, _ in st.read_log]


def test_balanced_windows_cut_the_slow_tiers_tail():
    # Same-size windows leave the slow tier a long tail of reads in flight when the pool runs dry, and those
    # reads delay its part of the next step too; windows sized by speed drain together.
    fixed = _step_ratios("fixed")
    balanced = _step_ratios("balanced")
    # (fixed: the slow tier lands nothing, every step is at the fast tier's own speed, 1.27x the bound;
    # balanced: about 1.16x once measured)
    assert sorted(balanced)[len(balanced) // 2] < 0.95 * sorted(fixed)[len(fixed) // 2]
    assert max(balanced[2:]) < 1.2
