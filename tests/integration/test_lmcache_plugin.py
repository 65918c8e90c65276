"""The LMCache storage plugin, driven through LMCache's own StorageManager and ChunkedTokenDatabase (CPU only).

CI installs torch==2.13.0 and lmcache==0.5.6; these tests import both unconditionally (a missing install is a
failure, not a skip). Every manager is closed in ``finally`` (LMCache's threads would otherwise keep the
process alive) and every test has a time limit.
"""

from __future__ import annotations

from kvstream.testing.lmcache import (  # first: it sets LMCache's environment before LMCache is imported
    CHUNK,
    HEAD_DIM,
    HEADS,
    LAYERS,
    PLUGIN,
    FakeScheduler,
    collect,
    engine_config,
    get_chunks,
    lmcache_metadata,
    make_chunks,
    manager,
    metric_total,
    plugin_of,
    prefetch,
    put_chunks,
    release_all,
    tiers_extra,
    wait_stored,
)

import contextlib
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml
from lmcache.utils import CacheEngineKey, LayerCacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.memory_management import MemoryFormat
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.storage_manager import StorageManager
from prometheus_client import REGISTRY

from kvstream.errors import ConfigError
from kvstream.integrations._lmcache_config import parse_extra_config
from kvstream.integrations._lmcache_keys import KeyMapper
from kvstream.integrations.lmcache import KVStreamBackend, StrictStartError

pytestmark = [pytest.mark.lmcache, pytest.mark.timeout(120)]


# -- store, read back, restart --------------------------------------------------------------------------------
def test_chunks_read_back_bit_exact(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        infos, refs = make_chunks(sm, 4 * CHUNK + 100)  # four full chunks and a partial one
        keys = [k for _, _, k in infos]
        t0 = time.perf_counter()
        put_chunks(sm, infos, refs)
        assert time.perf_counter() - t0 < 0.5
        wait_stored(sm, keys)
        assert sm.batched_contains(keys)[0] == len(keys)
        got = get_chunks(sm, keys)
        try:
            assert len(got) == len(keys)
            for obj, ref in zip(got, refs):
                assert obj is not None
                assert obj.get_memory_format() == MemoryFormat.KV_2LTD
                assert obj.get_shape() == ref.shape and obj.get_dtype() == torch.bfloat16
                assert torch.equal(obj.tensor, ref)
                assert obj.get_ref_count() == 1
        finally:
            release_all(got)


def test_cache_survives_restart_and_lmcache_disk_tier_does_not(disk_tmp):
    disk = str(disk_tmp / "lmcache-disk")
    with manager(tiers_extra(disk_tmp), local_disk=disk) as sm:
        infos, refs = make_chunks(sm, 3 * CHUNK)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        time.sleep(0.2)  # LocalDiskBackend writes on its own pool
    hits_before = metric_total("lmcache:kvstream_num_hit_chunks_total", tier="memory")
    with manager(tiers_extra(disk_tmp), local_disk=disk) as sm:
        assert sm.storage_backends["LocalDiskBackend"].batched_contains(keys) == 0  # its index was in RAM
        assert plugin_of(sm).batched_contains(keys) == len(keys)
        hit, mapping = sm.batched_contains(keys)
        assert hit == len(keys) and list(mapping) == [PLUGIN]
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
        # read from the tier files, not from any memory
        assert metric_total("lmcache:kvstream_num_hit_chunks_total", tier="memory") == hits_before
        stats = plugin_of(sm).store.stats()
        assert stats.disk_hits == len(keys)


class _ReadGate:
    """Test shim over the store's per-tier read rings: records which tiers get reads, and holds the ``hold``
    tier's completions back until the ``first`` tier has delivered one read (then hands them on, in order).

    Why: meet in the middle lets the faster tier take everything, including (once the pool is empty) the other
    tier's in-flight chunks, so which tier *delivers* which chunk is a race. On a loaded 2-core machine the
    shared tier's ring thread can be descheduled for the ~5 ms the local tier needs to read all 12 small chunks;
    the shared tier then delivers nothing and its reads end as duplicates. That is correct routing, and it made
    an unconditional "both tiers delivered" assertion flaky. Holding the local tier's completions until the
    shared tier has delivered one makes "both tiers deliver chunks of one batch" deterministic without changing
    what the store and plugin do with them.
    """

    def __init__(self, store, *, first: str, hold: str, timeout_s: float = 10.0) -> None:
        self.first, self.hold = first, hold
        self.lock = threading.Lock()
        self.submitted: dict[str, int] = {}
        self.released = False
        self.held: list = []
        self._timer = threading.Timer(timeout_s, self.release)  # never hang the test if `first` never delivers
        self._timer.daemon = True
        self._timer.start()
        for tier in store.tiers:
            tier.read_ring.submit = self._submit(tier.name, tier.read_ring.submit)

    def _submit(self, name: str, real):
        def submit(ops) -> None:
            for op in ops:
                op.callback = self._callback(name, op.callback)
            with self.lock:
                self.submitted[name] = self.submitted.get(name, 0) + len(ops)
            real(ops)
        return submit

    def _callback(self, name: str, real):
        def callback(op) -> None:
            if name == self.hold:
                with self.lock:
                    if not self.released:
                        self.held.append((real, op))
                        return
            real(op)
            if name == self.first and op.result > 0:
                self.release()
        return callback

    def release(self) -> None:
        with self.lock:
            self.released = True
            held, self.held = self.held, []
        self._timer.cancel()
        for real, op in held:
            real(op)


def test_read_is_one_multi_tier_batch(disk_tmp):
    """One store read for the batch: one read step with reads on both tiers at once (meet in the middle), and
    chunks delivered by both tiers come back bit exact. (Which tier delivers which chunk is a race; see _ReadGate.)"""
    conf = disk_tmp / "kvstream.yaml"
    conf.write_text(  # small per-tier read windows, so even this small batch is split between the tiers
        "tiers:\n"
        f"  - {{name: local, path: {disk_tmp / 'local'}, capacity_bytes: 256MiB, read_inflight_bytes: 1MiB}}\n"
        f"  - {{name: shared, path: {disk_tmp / 'shared'}, capacity_bytes: 256MiB, read_inflight_bytes: 1MiB}}\n"
        "memory_bytes: 16MiB\ncreate_dirs: true\nreplication: full\nrouter: mitm\n")
    extra = {"kvstream.config_file": str(conf)}
    with manager(extra) as sm:
        infos, refs = make_chunks(sm, 12 * CHUNK)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
    with manager(extra) as sm:
        plugin = plugin_of(sm)
        tiers = plugin.store.stats().tiers
        assert tiers["local"].chunks == tiers["shared"].chunks == len(keys), tiers  # full replication
        calls = []
        assert plugin._zero_copy  # the store offers get_meta + read_into: payloads land in LMCache's objects
        real = plugin.store.read_into
        plugin.store.read_into = lambda ks, ts, **kw: (calls.append(len(ks)), real(ks, ts, **kw))[1]
        # The headers first (get_meta reads them from the local tier after a restart): the gate below must see
        # only the batch's reads, or it would hold get_meta's header reads and release before the batch.
        assert all(m is not None for m in plugin.store.get_meta(plugin._keys.many(keys)))
        gate = _ReadGate(plugin.store, first="shared", hold="local")
        before = plugin.store.stats()
        steps, hits = before.read_steps, before.disk_hits
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert calls == [len(keys)]  # the plugin hands the store the whole batch at once
            assert all(torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
        st = plugin.store.stats()
        assert st.read_steps == steps + 1  # ... which the store reads as one step
        assert gate.submitted.get("local", 0) > 0 and gate.submitted.get("shared", 0) > 0, gate.submitted
        tiers = st.tiers
        assert tiers["local"].read_chunks > 0 and tiers["shared"].read_chunks > 0, tiers
        assert st.disk_hits == hits + len(keys)  # one copy of each chunk used, whichever tier it came from
        # the fast tier's chunks were read straight into their LMCache objects, the other tier's copied in
        assert st.read_into_direct > 0 and st.read_into_direct + st.read_into_copied == len(keys)


# -- async lookup and prefetch --------------------------------------------------------------------------------
def test_async_lookup_and_prefetch_returns_the_stored_prefix(disk_tmp):
    with manager(tiers_extra(disk_tmp), async_loading=True) as sm:
        infos, refs = make_chunks(sm, 5 * CHUNK + 40)
        put_chunks(sm, infos[:3], refs[:3])  # only the first three chunks are stored
        wait_stored(sm, [k for _, _, k in infos[:3]])
    with manager(tiers_extra(disk_tmp), async_loading=True) as sm:
        sm.async_lookup_server = FakeScheduler()
        prefetch(sm, "req-a", infos)
        prefetch(sm, "req-b", infos[:2])
        n_a, pairs_a = collect(sm, "req-a")
        n_b, pairs_b = collect(sm, "req-b")
        try:
            assert n_a == 3 * CHUNK and n_b == 2 * CHUNK
            assert [k for k, _ in pairs_a] == [k for _, _, k in infos[:3]]
            assert all(torch.equal(o.tensor, refs[i]) for i, (_, o) in enumerate(pairs_a))
            assert all(torch.equal(o.tensor, refs[i]) for i, (_, o) in enumerate(pairs_b))
        finally:
            release_all([o for _, o in pairs_a + pairs_b])
        prefetch(sm, "req-miss", make_chunks(sm, 2 * CHUNK, seed=7)[0])
        assert collect(sm, "req-miss")[0] == 0


def test_prefetches_of_several_requests_load_in_parallel(disk_tmp):
    """LMCache serialises every backend's batched_get_non_blocking; ours start in batched_async_contains."""
    delay = 0.4
    with manager(tiers_extra(disk_tmp), async_loading=True) as sm:
        sm.async_lookup_server = FakeScheduler()
        seqs = [make_chunks(sm, 2 * CHUNK, seed=s) for s in (1, 2, 3)]
        for infos, refs in seqs:
            put_chunks(sm, infos, refs)
            wait_stored(sm, [k for _, _, k in infos])
        plugin = plugin_of(sm)
        real = plugin.store.read_chunks

        def slow_read(keys, **kw):
            time.sleep(delay)  # a slow tier: each batch read takes `delay`
            yield from real(keys, **kw)

        plugin.store.read_chunks = slow_read
        t0 = time.perf_counter()
        for i, (infos, _) in enumerate(seqs):
            prefetch(sm, f"r{i}", infos)
        results = [collect(sm, f"r{i}") for i in range(len(seqs))]
        elapsed = time.perf_counter() - t0
        try:
            for (n, pairs), (infos, refs) in zip(results, seqs):
                assert n == infos[-1][1]
                assert all(torch.equal(o.tensor, r) for (_, o), r in zip(pairs, refs))
        finally:
            release_all([o for _, pairs in results for _, o in pairs])
        assert elapsed < delay * (len(seqs) - 0.5), f"prefetches ran one after another ({elapsed:.2f} s)"


# -- damaged files are misses ---------------------------------------------------------------------------------
def _damage(path: Path, how: str) -> None:
    if how == "missing":
        path.unlink()
    elif how == "truncated":
        size = path.stat().st_size
        os.truncate(path, size // 2)
    elif how == "corrupted":
        with open(path, "r+b") as f:
            f.seek(4096 + 1000)  # inside the payload
            b = f.read(1)
            f.seek(4096 + 1000)
            f.write(bytes([b[0] ^ 0xFF]))
    else:  # pragma: no cover
        raise AssertionError(how)


@pytest.mark.parametrize("how", ["missing", "corrupted", "truncated"])
def test_damaged_chunk_file_is_a_miss(disk_tmp, how):
    extra = tiers_extra(disk_tmp, two=False)
    with manager(extra) as sm:
        infos, refs = make_chunks(sm, 4 * CHUNK)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        skey = plugin_of(sm)._keys(keys[2])
        path = plugin_of(sm).store.tiers[0].path_for(skey)
    assert path.exists()
    _damage(path, how)
    with manager(extra) as sm:
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert [o is not None for o in got] == [True, True, False, False]
            assert all(torch.equal(o.tensor, r) for o, r in zip(got[:2], refs))
        finally:
            release_all(got)
        assert metric_total("lmcache:kvstream_num_miss_chunks_total", reason="unreadable") >= 1


def test_damaged_replica_is_read_from_the_other_tier(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        infos, refs = make_chunks(sm, 3 * CHUNK)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        plugin = plugin_of(sm)
        paths = [plugin.store.tiers[0].path_for(plugin._keys(k)) for k in keys]
    for p in paths:
        _damage(p, "corrupted")
    with manager(tiers_extra(disk_tmp)) as sm:
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
        assert plugin_of(sm).store.stats().tiers["local"].corrupt_chunks >= 1


@pytest.mark.parametrize("zero_copy", [True, False], ids=["read_into", "copy"])
def test_both_read_paths_return_exact_chunks_and_miss_a_corrupt_one(disk_tmp, zero_copy):
    """The zero-copy path (Store.get_meta + read_into, O_DIRECT into LMCache's objects) and the copying path
    (read_chunks, then a copy) give the same answer: exact tensors up to the corrupted chunk, misses after it."""
    extra = tiers_extra(disk_tmp, two=False)
    with manager(extra) as sm:
        infos, refs = make_chunks(sm, 4 * CHUNK + 10, seed=3)  # a partial last chunk too
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        path = plugin_of(sm).store.tiers[0].path_for(plugin_of(sm)._keys(keys[3]))
    _damage(path, "corrupted")
    with manager(extra) as sm:
        plugin = plugin_of(sm)
        assert plugin._zero_copy
        plugin._zero_copy = zero_copy
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert [o is not None for o in got] == [True, True, True, False, False]
            assert all(torch.equal(o.tensor, r) for o, r in zip(got[:3], refs))
        finally:
            release_all(got)
        st = plugin.store.stats()
        assert st.read_into_direct == (4 if zero_copy else 0)  # 0-2 and 4 (4 is dropped after the gap)
        assert st.tiers["local"].corrupt_chunks == 1
        got = sm.batched_get(keys[:2] + [make_chunks(sm, CHUNK, seed=9)[0][0][2]], location=PLUGIN)
        try:
            assert [o is not None for o in got] == [True, True, False]
            assert all(torch.equal(o.tensor, r) for o, r in zip(got[:2], refs))
        finally:
            release_all(got)

# -- writes ---------------------------------------------------------------------------------------------------
def test_put_returns_at_once_holds_references_and_close_waits(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        plugin = plugin_of(sm)
        real_put = plugin.store.put

        def slow_put(*a, **kw):
            time.sleep(0.3)
            return real_put(*a, **kw)

        plugin.store.put = slow_put
        infos, refs = make_chunks(sm, 3 * CHUNK, seed=5)
        keys = [k for _, _, k in infos]
        objs = []
        for ref in refs:
            o = sm.allocate(ref.shape, ref.dtype, MemoryFormat.KV_2LTD)
            o.tensor.copy_(ref)
            objs.append(o)
        for o in objs:
            o.ref_count_up()  # the test's own reference, to watch the plugin's
        t0 = time.perf_counter()
        sm.batched_put(keys, objs)  # the manager drops its reference on return
        assert time.perf_counter() - t0 < 0.2
        assert all(plugin.exists_in_put_tasks(k) for k in keys)
        assert all(o.get_ref_count() == 2 for o in objs)  # ours + the pending write's
        again = []
        for ref in refs:  # a second put of the pending keys (new objects, as LMCache would pass) is not queued
            o = sm.allocate(ref.shape, ref.dtype, MemoryFormat.KV_2LTD)
            o.ref_count_up()
            again.append(o)
        sm.batched_put(keys, again)
        assert all(o.get_ref_count() == 1 for o in again)  # only ours is left
        for o in objs + again:
            o.ref_count_down()
    # close() waited for the slow puts and the disk writes
    assert all(o.get_ref_count() == 0 for o in objs)
    with manager(tiers_extra(disk_tmp)) as sm:
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)


def test_a_chunk_pinned_by_an_lmcache_lookup_is_never_evicted_and_puts_that_need_it_are_refused(disk_tmp):
    """Issue 21, item 4: LMCache's contract (pin_count, can_evict) reaches kvstream's disk eviction. The tier
    holds 3 chunks; a lookup with pin=True pins the first two; more puts evict only the unpinned one, and once
    every chunk on the tier is pinned a put is refused (counted, retryable) instead of evicting one."""
    extra = {"kvstream.tiers": f"local={disk_tmp / 'local'}", "kvstream.capacity_bytes": "2MiB",
             "kvstream.memory_bytes": "16MiB"}
    with manager(extra) as sm:
        plugin = plugin_of(sm)
        store = plugin.store
        infos, refs = make_chunks(sm, 8 * CHUNK, seed=4)
        keys = [k for _, _, k in infos]
        sk = plugin._keys.many(keys)

        def stored(i: int, *, written: bool = True) -> None:
            put_chunks(sm, [infos[i]], [refs[i]])
            wait_stored(sm, [keys[i]])
            store.flush()
            assert store.drain(10) is written  # refused on disk: acknowledged, unstored, owed (not drained)

        for i in range(3):
            stored(i)
        assert sm.batched_contains(keys[:2], pin=True)[0] == 2  # vLLM's lookup: pins what it reports
        stored(3)  # evicts chunk 2, the only unpinned one
        on_disk = lambda i: store.tiers[0].contains(sk[i])  # noqa: E731
        assert on_disk(0) and on_disk(1) and not on_disk(2) and on_disk(3)
        assert plugin.pin(keys[3])  # now all three on the tier are pinned
        refused = metric_total("lmcache:kvstream_num_refused_pinned_total", tier="local")
        stored(4, written=False)
        assert [on_disk(i) for i in range(5)] == [True, True, False, True, False]
        plugin._tick()  # publish the store's counters
        assert metric_total("lmcache:kvstream_num_refused_pinned_total", tier="local") >= refused + 1
        assert store.stats().unstored_chunks == 1  # kept in host memory until a copy lands
        store.evict_memory()
        got = get_chunks(sm, keys[:2])
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs[:2]))
        finally:
            release_all(got)
        sm.batched_unpin(keys[:2])
        assert plugin.unpin(keys[3])
        deadline = time.monotonic() + 20  # unpinned: the catch-up pays chunk 4's owed copy, evicting the LRU
        while not (on_disk(4) and store.drain(1)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert on_disk(4) and store.stats().unstored_chunks == 0
        stored(5)  # the least recently used goes again
        assert sum(on_disk(i) for i in (0, 1, 3)) == 1 and on_disk(4) and on_disk(5)


def test_a_shared_tier_whose_file_system_is_not_mounted_is_down_and_kvstream_serves_from_local(disk_tmp, caplog):
    """Issue 21, item 5: LMCache's create_dirs default used to create the shared tier on the root disk under its
    empty mount point. Now the tier is opened down (logged as an error, lmcache:kvstream_tier_down), nothing is
    created there, and kvstream serves from its local tier (LMCache keeps kvstream)."""
    from kvstream.tiers.mounts import mount_point_of

    if mount_point_of(disk_tmp) != Path("/"):
        pytest.skip(f"{disk_tmp} is not on the root file system here: no unmounted mount point to stage")
    mnt = disk_tmp / "mnt"
    mnt.mkdir()
    extra = {"kvstream.tiers": f"local={disk_tmp / 'local'},shared={mnt / 'kvstream'}",
             "kvstream.capacity_bytes": "256MiB", "kvstream.memory_bytes": "16MiB", "kvstream.shared_tiers": "shared",
             "kvstream.node_state_path": str(disk_tmp / "node-id")}
    with manager(extra) as sm:
        plugin = plugin_of(sm)
        infos, refs = make_chunks(sm, 2 * CHUNK, seed=9)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        plugin.store.flush()
        assert plugin.store.drain(10)
        plugin.store.evict_memory()
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
        plugin._tick()
        assert metric_total("lmcache:kvstream_tier_down", tier="shared") == 1
        assert metric_total("lmcache:kvstream_tier_down", tier="local") == 0
    assert list(mnt.iterdir()) == []
    assert any("tier shared is DOWN" in r.getMessage() and "root file system" in r.getMessage()
               for r in caplog.records)


def test_remove_pin_unpin(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        plugin = plugin_of(sm)
        infos, refs = make_chunks(sm, 2 * CHUNK)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        assert plugin.batched_contains(keys, pin=True) == 2
        assert plugin.unpin(keys[0]) and not plugin.unpin(keys[0])
        assert plugin.pin(keys[1]) and plugin.unpin(keys[1]) and plugin.unpin(keys[1])
        sm.batched_unpin(keys)  # what LMCache does after a pinned lookup: unknown pins are just False
        assert plugin.remove(keys[1])
        assert not plugin.contains(keys[1]) and plugin.contains(keys[0])
        assert not plugin.remove(keys[1])
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert got[0] is not None and got[1] is None
        finally:
            release_all(got)


# -- keys -----------------------------------------------------------------------------------------------------
def test_keys_distinct_across_models_dtypes_world_sizes_workers_tags_and_layers():
    base = dict(model_name="m", world_size=2, worker_id=0, chunk_hash=-12345, dtype=torch.bfloat16)
    variants = [
        CacheEngineKey(**base),
        CacheEngineKey(**{**base, "model_name": "m2"}),
        CacheEngineKey(**{**base, "dtype": torch.float16}),
        CacheEngineKey(**{**base, "world_size": 4}),
        CacheEngineKey(**{**base, "worker_id": 1}),
        CacheEngineKey(**{**base, "chunk_hash": 12345}),
        CacheEngineKey(**base, request_configs={"lmcache.tag.user": "a"}),
        CacheEngineKey(**base, request_configs={"lmcache.tag.user": "b"}),
        CacheEngineKey(**base, request_configs={"lmcache.tag.user": "a", "lmcache.tag.x": "y"}),
        LayerCacheEngineKey(**base, layer_id=0),
        LayerCacheEngineKey(**base, layer_id=1),
        # spell the same to_string() in two ways: '@' inside the model name / tag values
        CacheEngineKey(model_name="a@2@0", world_size=1, worker_id=0, chunk_hash=1, dtype=torch.bfloat16),
        CacheEngineKey(model_name="a", world_size=2, worker_id=0, chunk_hash=1, dtype=torch.bfloat16,
                       request_configs={"lmcache.tag.t": "1@x%y"}),
        CacheEngineKey(model_name="a", world_size=2, worker_id=0, chunk_hash=1, dtype=torch.bfloat16,
                       request_configs={"lmcache.tag.t": "1", "lmcache.tag.x": "y"}),
    ]
    mapper = KeyMapper()
    skeys = [mapper(k) for k in variants]
    assert len(set(skeys)) == len(variants)
    assert all(len(s) == 16 for s in skeys)
    # equal keys map equally, in any process (a fresh mapper), and non-tag request configs do not matter
    same = CacheEngineKey(**base, request_configs={"other_setting": 1})
    assert KeyMapper()(same) == skeys[0]
    assert KeyMapper(namespace="other")(variants[0]) != skeys[0]


# -- configuration --------------------------------------------------------------------------------------------
def test_misconfigured_plugin_fails_naming_the_key(disk_tmp):
    with pytest.raises(ConfigError, match=r"kvstream\.tiers"):
        parse_extra_config({"kvstream.memory_bytes": "1GiB"})
    with pytest.raises(ConfigError, match=r"kvstream\.teirs.*did you mean 'kvstream\.tiers'"):
        parse_extra_config({"kvstream.teirs": "a=/x"})
    with pytest.raises(ConfigError, match=r"kvstream\.capacity_bytes"):
        parse_extra_config({"kvstream.tiers": f"local={disk_tmp}"})
    with pytest.raises(ConfigError, match=r"kvstream\.router"):
        parse_extra_config({**tiers_extra(disk_tmp), "kvstream.router": "zigzag"})
    with pytest.raises(ConfigError, match=r"kvstream\.config_file"):
        parse_extra_config({"kvstream.config_file": str(disk_tmp / "nope.yaml")})
    bad_file = disk_tmp / "store.yaml"
    bad_file.write_text("tiers: [{name: local, path: /x, capacity_bytes: 1GiB}]\nreplication: twice\n")
    with pytest.raises(ConfigError, match=r"kvstream\.config_file.*replication"):
        parse_extra_config({"kvstream.config_file": str(bad_file)})

    # Through LMCache: it catches the constructor's error, logs it and runs without the plugin.
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    lm_logger = logging.getLogger("lmcache.v1.storage_backend")
    lm_logger.addHandler(handler)
    try:
        with manager({**tiers_extra(disk_tmp), "kvstream.replication": "twice"}) as sm:
            assert PLUGIN not in sm.storage_backends
    finally:
        lm_logger.removeHandler(handler)
    assert any("kvstream.replication" in r and PLUGIN in r for r in records), records


def _loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "storage-manager-event-loop"]


@pytest.mark.parametrize("fault", ["bad_key", "dead_tier"])
def test_strict_stops_lmcache_start_and_default_serves_without_kvstream(disk_tmp, fault):
    """kvstream.strict: a store that cannot open (a bad key, a tier folder that cannot exist) stops LMCache's start
    instead of leaving it to serve without kvstream; without it LMCache starts without the plugin, as before."""
    if fault == "bad_key":
        extra = {**tiers_extra(disk_tmp), "kvstream.replication": "twice"}
        key = "kvstream.replication"
    else:  # the tier's folder would be under a regular file: a file system that cannot hold it
        (disk_tmp / "not-a-dir").write_text("x")
        extra = {**tiers_extra(disk_tmp), "kvstream.tiers": f"local={disk_tmp / 'not-a-dir' / 'kv'}"}
        key = "kvstream.tiers"
    for off in ({}, {"kvstream.strict": False}, {"kvstream.strict": "false"}):
        with manager({**extra, **off}) as sm:  # the default: LMCache serves, without kvstream
            assert PLUGIN not in sm.storage_backends
            assert "LocalCPUBackend" in sm.storage_backends
    before = set(_loop_threads())
    cfg = engine_config({**extra, "kvstream.strict": "true"})
    PinMonitor.GetOrCreate(cfg)
    with pytest.raises(StrictStartError, match=key) as info:
        StorageManager(cfg, lmcache_metadata(), EventManager())
    assert isinstance(info.value.__cause__, ConfigError) and key in str(info.value.__cause__)
    assert not isinstance(info.value, Exception)  # LMCache's `except Exception` must not swallow it
    # the half-built manager's event loop is stopped: its (non-daemon) thread would keep the process alive
    deadline = time.monotonic() + 5
    while set(_loop_threads()) - before:
        assert time.monotonic() < deadline, "LMCache's event loop thread still runs after a strict failure"
        time.sleep(0.02)


def test_strict_with_a_good_config_serves_and_an_unreadable_value_is_strict(disk_tmp):
    with manager({**tiers_extra(disk_tmp), "kvstream.strict": True}) as sm:
        plugin = plugin_of(sm)
        assert plugin.options.strict is True
        infos, refs = make_chunks(sm, 2 * CHUNK, seed=5)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
    with manager(tiers_extra(disk_tmp)) as sm:
        assert plugin_of(sm).options.strict is False
    # a value we cannot read was still written by someone who cared: refuse to start rather than guess "off"
    cfg = engine_config({**tiers_extra(disk_tmp), "kvstream.strict": "maybe"})
    PinMonitor.GetOrCreate(cfg)
    with pytest.raises(StrictStartError, match=r"kvstream\.strict"):
        StorageManager(cfg, lmcache_metadata(), EventManager())


@contextlib.contextmanager
def _log_lines():
    """Messages logged by LMCache's storage-backend factory and by the plugin, while the block runs."""
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    loggers = [logging.getLogger("lmcache.v1.storage_backend"), logging.getLogger("kvstream.lmcache")]
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield records
    finally:
        for lg in loggers:
            lg.removeHandler(handler)


def test_scheduler_role_names_the_role_and_the_setting_to_change(disk_tmp):
    """LMCache builds its storage backends in vLLM's scheduler process too when enable_scheduler_bypass_lookup is
    set, and there it creates no CPU backend. The plugin said "set max_local_cpu_size > 0" (it was set); it now
    says that this is the scheduler role and what to change, opens nothing there, and with kvstream.strict
    stops the start with the same message."""
    meta = LMCacheMetadata(model_name="test/model", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), role="scheduler")

    def config(extra: dict) -> LMCacheEngineConfig:
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.06, storage_plugins=[PLUGIN],
            enable_scheduler_bypass_lookup=True,
            extra_config={f"storage_plugin.{PLUGIN}.module_path": "kvstream.integrations.lmcache",
                          f"storage_plugin.{PLUGIN}.class_name": "KVStreamBackend", **extra})
        PinMonitor.GetOrCreate(cfg)
        return cfg

    with _log_lines() as lines:
        sm = StorageManager(config(tiers_extra(disk_tmp)), meta, EventManager())
        try:
            assert PLUGIN not in sm.storage_backends
        finally:
            sm.close()
    said = [ln for ln in lines if "kvstream" in ln and "scheduler" in ln]
    assert said, lines
    for ln in said:
        assert "role 'scheduler'" in ln and "enable_scheduler_bypass_lookup: false" in ln and "worker" in ln, ln
        assert "max_local_cpu_size > 0" not in ln, ln
    assert not any("max_local_cpu_size > 0" in ln for ln in lines), lines
    assert not (disk_tmp / "local").exists()  # nothing opened in the scheduler
    with pytest.raises(StrictStartError, match=r"enable_scheduler_bypass_lookup.*role 'scheduler'"):
        StorageManager(config({**tiers_extra(disk_tmp), "kvstream.strict": True}), meta, EventManager())


def test_a_worker_without_lmcaches_cpu_backend_is_told_to_give_it_memory() -> None:
    from types import SimpleNamespace

    from kvstream.integrations.lmcache import _no_cpu_backend

    err = _no_cpu_backend(SimpleNamespace(max_local_cpu_size=0), SimpleNamespace(role="worker"))
    assert err.field == "max_local_cpu_size" and "set max_local_cpu_size > 0" in str(err) and "is 0" in str(err)
    err = _no_cpu_backend(SimpleNamespace(max_local_cpu_size=5, enable_scheduler_bypass_lookup=True),
                          SimpleNamespace(role="scheduler"))
    assert err.field == "enable_scheduler_bypass_lookup" and "max_local_cpu_size" not in str(err)


def test_the_pending_write_budget_defaults_to_a_quarter_of_lmcaches_cpu_pool(disk_tmp):
    """kvstream.max_pending_write_bytes' documented default (PLUGIN_KEYS) is what the plugin gets under LMCache."""
    from kvstream.integrations._lmcache_config import pending_write_default

    with manager(tiers_extra(disk_tmp)) as sm:
        assert plugin_of(sm).options.max_pending_write_bytes == pending_write_default(sm.config.max_local_cpu_size)
        assert pending_write_default(sm.config.max_local_cpu_size) == 64 << 20  # 0.06 GB: the floor


_LOG_CHILD = r"""
import os, sys, torch
from pathlib import Path
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.event_manager import EventManager
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.pin_monitor import PinMonitor
from lmcache.v1.storage_backend.storage_manager import StorageManager

root = Path(sys.argv[1])
meta = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                       kv_dtype=torch.bfloat16, kv_shape=(2, 2, 256, 2, 64))
plugin = {"storage_plugin.kvstream.module_path": "kvstream.integrations.lmcache",
          "storage_plugin.kvstream.class_name": "KVStreamBackend", "kvstream.capacity_bytes": "64MiB",
          "kvstream.memory_bytes": "8MiB"}
for tiers in (f"local={root / 'file' / 'kv'}", f"local={root / 'local'}"):
    cfg = LMCacheEngineConfig.from_defaults(chunk_size=256, local_cpu=False, max_local_cpu_size=0.06,
                                            storage_plugins=["kvstream"],
                                            extra_config={**plugin, "kvstream.tiers": tiers})
    PinMonitor.GetOrCreate(cfg)
    sm = StorageManager(cfg, meta, EventManager())
    print("PLUGIN", "kvstream" in sm.storage_backends, flush=True)
    sm.close()
"""


@pytest.mark.slow
def test_plugin_warnings_are_in_lmcache_log_format(disk_tmp):
    """What an operator sees on stderr: the plugin's own warnings and the store's (a tier folder made by another
    format) come out in LMCache's log format, level and source named, not as bare text."""
    import re
    import subprocess
    import sys

    (disk_tmp / "file").write_text("x")  # the first start's tier folder cannot exist under it
    (disk_tmp / "local").mkdir()
    (disk_tmp / "local" / "KVSTREAM_TIER").write_text("some other format\n")  # the second start warns about it
    env = {**os.environ, "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "LMCACHE_LOG_LEVEL": "INFO"}
    env.pop("PYTHONWARNINGS", None)
    r = subprocess.run([sys.executable, "-c", _LOG_CHILD, str(disk_tmp)], env=env, capture_output=True, text=True,
                       timeout=100)
    assert r.returncode == 0, r.stderr[-4000:]
    assert r.stdout.split() == ["PLUGIN", "False", "PLUGIN", "True"], r.stdout
    err = r.stderr
    ansi = r"(?:\x1b\[[0-9;]*m)*"
    head = r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+\] LMCache WARNING:" + ansi + " "
    ours = re.search(head + r"kvstream: could not start: .*kvstream\.tiers.*LMCache serves WITHOUT kvstream.* "
                     + ansi + r"\(lmcache\.py:\d+:kvstream\.lmcache\)", err)
    assert ours, err[-4000:]
    store = re.search(head + r"tier local: .*KVSTREAM_TIER says 'some other format'.* " + ansi
                      + r"\(files\.py:\d+:kvstream\.tier\)", err)
    assert store, err[-4000:]
    # nothing of ours printed bare (Python's last-resort handler writes just the message at a line's start)
    assert not re.search(r"(?m)^(tier local|kvstream):", err), err[-4000:]


def test_env_var_form_and_lmcache_yaml_load_the_plugin(disk_tmp, monkeypatch):
    extra = {f"storage_plugin.{PLUGIN}.module_path": "kvstream.integrations.lmcache",
             f"storage_plugin.{PLUGIN}.class_name": "KVStreamBackend", **tiers_extra(disk_tmp)}
    for k, v in {"LMCACHE_CHUNK_SIZE": "256", "LMCACHE_LOCAL_CPU": "false", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.06",
                 "LMCACHE_STORAGE_PLUGINS": PLUGIN, "LMCACHE_EXTRA_CONFIG": json.dumps(extra)}.items():
        monkeypatch.setenv(k, v)
    yaml_file = disk_tmp / "lmcache.yaml"
    yaml_file.write_text(yaml.safe_dump({"chunk_size": 256, "local_cpu": False, "max_local_cpu_size": 0.06,
                                         "storage_plugins": [PLUGIN], "extra_config": extra}))
    for cfg in (LMCacheEngineConfig.from_env(), LMCacheEngineConfig.from_file(str(yaml_file))):
        PinMonitor.GetOrCreate(cfg)
        sm = StorageManager(cfg, lmcache_metadata(), EventManager())
        try:
            assert isinstance(sm.storage_backends.get(PLUGIN), KVStreamBackend)
        finally:
            sm.close()


def test_config_forms(disk_tmp):
    opts = parse_extra_config({"kvstream.tiers": f"a={disk_tmp / 'a'},b={disk_tmp / 'b'}",
                               "kvstream.capacity_bytes": "a=1GiB,b=2GiB", "kvstream.replication": "single",
                               "kvstream.create_dirs": "false", "kvstream.flush_after_ms": "5",
                               "kvstream.python_switch_interval_s": "0.001"})
    assert [(t.name, t.capacity_bytes) for t in opts.store.tiers] == [("a", 1 << 30), ("b", 2 << 30)]
    assert opts.store.replication == "single" and opts.store.create_dirs is False
    assert opts.store.python_switch_interval_s == pytest.approx(0.001)
    assert opts.flush_after_s == pytest.approx(0.005)
    f = disk_tmp / "kv.yaml"
    f.write_text("tiers:\n  - {name: local, path: local, capacity_bytes: 1GiB}\nrouter: mitm:2\n")
    opts = parse_extra_config({"kvstream": {"config_file": str(f), "io_engine": "threads"}})
    assert opts.store.tiers[0].path == str(disk_tmp / "local") and opts.store.router == "mitm:2"
    assert opts.store.io_engine == "threads"


# -- metrics --------------------------------------------------------------------------------------------------
def test_per_tier_metrics_in_lmcache_style(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        infos, refs = make_chunks(sm, 6 * CHUNK, seed=11)
        keys = [k for _, _, k in infos]
        put_chunks(sm, infos, refs)
        wait_stored(sm, keys)
    labels = {"model_name": "test/model", "worker_id": "0"}
    before = {t: metric_total("lmcache:kvstream_num_hit_chunks_total", tier=t, **labels) for t in ("local", "shared")}
    with manager(tiers_extra(disk_tmp)) as sm:
        got = sm.batched_get(keys, location=PLUGIN)
        release_all(got)
    hits = {t: metric_total("lmcache:kvstream_num_hit_chunks_total", tier=t, **labels) - before[t]
            for t in ("local", "shared")}
    assert sum(hits.values()) == len(keys)
    assert metric_total("lmcache:kvstream_num_read_bytes_total", tier="local") > 0
    assert metric_total("lmcache:kvstream_time_to_chunk_count", tier="local") > 0
    assert metric_total("lmcache:kvstream_num_written_bytes_total", tier="shared") > 0
    assert metric_total("lmcache:kvstream_time_to_get_count", path="sync") > 0
    # per-tier write latency: one observation per published copy (6 chunks, full replication)
    for t in ("local", "shared"):
        assert metric_total("lmcache:kvstream_time_to_write_count", tier=t, **labels) >= 6
        assert 0 < metric_total("lmcache:kvstream_time_to_write_sum", tier=t, **labels) < 60


def _scrape(model: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """What a Prometheus server would read from this process: the text exposition of the default registry,
    parsed back, keeping the samples of one model's series (sample name -> [(labels, value)])."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.labels.get("model_name") == model:
                out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def _value(scrape: dict, name: str, **labels: str) -> float | None:
    """The sum of the samples of ``name`` with these labels, or None if there is no such series."""
    hits = [v for lab, v in scrape.get(name, []) if all(lab.get(k) == v for k, v in labels.items())]
    return sum(hits) if hits else None


def test_scraped_metrics_show_capacity_usage_evictions_hits_misses_and_latencies(disk_tmp):
    """Real traffic through LMCache's StorageManager, then the exposition text a scrape gets: per-tier capacity,
    used bytes and chunks (published while serving, not only at close), evictions, hits, misses by reason, and
    read and put latency histograms, each equal to what the store itself counted."""
    model = "test/metrics-scrape"  # series of their own: counters of other tests in this process do not mix in
    prefix = "lmcache:kvstream_"
    extra = {**tiers_extra(disk_tmp), "kvstream.capacity_bytes": "local=2MiB,shared=256MiB"}  # local holds 3 chunks
    with manager(extra, metadata=lmcache_metadata(model)) as sm:
        plugin = plugin_of(sm)
        # published when the plugin starts (the first periodic update is a second away)
        assert _value(_scrape(model), prefix + "capacity_bytes", tier="local") == 2 << 20
        infos, refs = make_chunks(sm, 6 * CHUNK, seed=21)
        keys = [k for _, _, k in infos]
        for half in (slice(0, 3), slice(3, 6)):  # the second half's writes evict the first half's from local
            put_chunks(sm, infos[half], refs[half])
            wait_stored(sm, keys[half])
            plugin.store.flush()
            assert plugin.store.drain(10.0)
        got = sm.batched_get(keys, location=PLUGIN)
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)
        unknown = [k for _, _, k in make_chunks(sm, 2 * CHUNK, seed=22)[0]]
        assert sm.batched_get(unknown, location=PLUGIN) == [None, None]
        # The gauges are published once a second on the plugin's writer thread, while it serves.
        st = plugin.store.stats()
        deadline = time.monotonic() + 5.0
        while True:
            live = _scrape(model)
            if (_value(live, prefix + "chunks", tier="local") == st.tiers["local"].chunks
                    and _value(live, prefix + "num_evicted_chunks_total", tier="local")):
                break
            assert time.monotonic() < deadline, {k: v for k, v in live.items() if "chunks" in k}
            time.sleep(0.1)
        assert _value(live, prefix + "capacity_bytes", tier="local") == 2 << 20
        assert _value(live, prefix + "capacity_bytes", tier="shared") == 256 << 20
        assert _value(live, prefix + "capacity_bytes", tier="memory") == 16 << 20
    st = plugin.store.stats()  # final: close() published these too
    scrape = _scrape(model)
    tiers = st.tiers
    assert tiers["local"].evicted_chunks >= 3 and tiers["shared"].evicted_chunks == 0
    for tier in ("local", "shared"):
        t = tiers[tier]
        assert _value(scrape, prefix + "used_bytes", tier=tier) == t.used_bytes
        assert _value(scrape, prefix + "chunks", tier=tier) == t.chunks
        assert _value(scrape, prefix + "num_evicted_chunks_total", tier=tier) == t.evicted_chunks
        assert _value(scrape, prefix + "num_evicted_bytes_total", tier=tier) == t.evicted_bytes
        assert _value(scrape, prefix + "num_written_chunks_total", tier=tier) == t.write_chunks == 6
        assert _value(scrape, prefix + "tier_circuit_open", tier=tier) == 0
    assert tiers["local"].used_bytes <= 2 << 20 and tiers["local"].chunks == 3
    assert _value(scrape, prefix + "used_bytes", tier="memory") == st.memory.used_bytes
    # reads: every chunk a hit (by the tier that served it), two misses, one sync batch read each
    assert _value(scrape, prefix + "num_hit_chunks_total") == len(keys)
    assert _value(scrape, prefix + "num_read_bytes_total") == sum(r.numel() * r.element_size() for r in refs)
    assert _value(scrape, prefix + "num_miss_chunks_total", reason="absent") == 2
    assert _value(scrape, prefix + "num_miss_chunks_total") == 2
    assert _value(scrape, prefix + "time_to_get_count", path="sync") == 2
    assert _value(scrape, prefix + "time_to_get_bucket", path="sync", le="+Inf") == 2
    assert _value(scrape, prefix + "time_to_chunk_count") == len(keys)
    assert 0 < _value(scrape, prefix + "time_to_chunk_sum") < 60
    # writes: six puts timed, none pending
    assert _value(scrape, prefix + "num_stored_chunks_total") == 6
    assert _value(scrape, prefix + "time_to_put_count") == 6
    assert 0 < _value(scrape, prefix + "time_to_put_sum") < 60
    assert _value(scrape, prefix + "pending_puts") == 0
    # series that counted nothing are there, at 0 (an alert on rate() needs the series)
    assert _value(scrape, prefix + "num_write_errors_total", tier="local") == 0
    assert _value(scrape, prefix + "num_skipped_copies_total", tier="shared", reason="full") == 0
