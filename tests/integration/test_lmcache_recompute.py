"""The LMCache plugin's shorter hit (``kvstream.recompute_*``): through real LMCache (CPU only), a lookup leaves
held chunks to vLLM's prefill when the GPU recomputes them sooner than the tiers load them.

Layout of every test: an 8-chunk prompt whose chunks 0-1 are in the store's host memory (and on the local tier),
2-3 on the local tier only and 4-7 on the shared tier only. The tiers' read-bandwidth estimates are set by
feeding the store's read-window policy an observation, as a read step does.
"""

from __future__ import annotations

from kvstream.testing.lmcache import (  # first: it sets LMCache's environment before LMCache is imported
    CHUNK,
    FakeScheduler,
    collect,
    make_chunks,
    manager,
    metric_total,
    plugin_of,
    prefetch,
    release_all,
    tiers_extra,
)

import pytest
import torch

from kvstream.errors import ConfigError
from kvstream.format import ChunkMeta
from kvstream.integrations._lmcache_config import RecomputeOptions, parse_extra_config

pytestmark = [pytest.mark.lmcache, pytest.mark.timeout(120)]

RECOMPUTE = {"kvstream.recompute_model": "qwen2.5-0.5b", "kvstream.recompute_gpu": "h100"}
N, MEMORY, LOCAL = 8, 2, 2  # chunks; in host memory; then on the local tier only (the rest: shared only)
DECLINED = "lmcache:kvstream_num_declined_chunks_total"


def _layout(sm, n_chunks: int = N):
    """Store an ``n_chunks`` prompt in the layout above, through the plugin's store; returns (infos, refs)."""
    plugin = plugin_of(sm)
    store = plugin.store
    infos, refs = make_chunks(sm, n_chunks * CHUNK)
    skeys = plugin._keys.many([k for _, _, k in infos])

    def put(i: int, tier: str) -> None:
        ref = refs[i].contiguous()
        meta = ChunkMeta(dtype="bfloat16", shape=tuple(ref.shape), fmt="KV_2LTD")
        assert store.put(skeys[i], ref.view(torch.uint8).numpy(), meta=meta, tiers=[tier])

    for i in range(MEMORY, n_chunks):
        put(i, "local" if i < MEMORY + LOCAL else "shared")
    store.flush()
    assert store.drain(10)
    store.evict_memory()
    for i in range(MEMORY):
        put(i, "local")
    store.flush()
    assert store.drain(10)
    places = store.locate_prefix(skeys)
    assert [p.memory for p in places] == [True] * MEMORY + [False] * (n_chunks - MEMORY)
    assert [p.tiers for p in places[MEMORY:]] == [(0,)] * LOCAL + [(1,)] * (n_chunks - MEMORY - LOCAL)
    assert all(p.file_bytes > refs[0].numel() * 2 for p in places[MEMORY:])
    return infos, refs


def _bandwidth(sm, *, local: float, shared: float) -> None:
    """Set each tier's read-bandwidth estimate (bytes/s) as a read step would: one observation each."""
    windows = plugin_of(sm).store.read_windows
    for tier, bw in ((0, local), (1, shared)):
        windows.forget(tier)
        windows.observe(tier, int(bw), 1.0)
    assert plugin_of(sm).store.read_bandwidth(1) == pytest.approx(shared)


FAST, SLOW = 100e9, 1e6  # a 516 KiB chunk: 5 us against ~0.5 ms of recompute; 0.5 s


# -- configuration --------------------------------------------------------------------------------------------
def _base(tmp_path) -> dict:
    return {"kvstream.tiers": f"local={tmp_path}", "kvstream.capacity_bytes": "1GiB"}


def test_recompute_keys_parse_and_default_off(tmp_path):
    assert parse_extra_config(_base(tmp_path)).recompute is None
    o = parse_extra_config({**_base(tmp_path), "kvstream.recompute_model": "70b", "kvstream.recompute_gpu": "H100"})
    assert o.recompute == RecomputeOptions(model="llama-3-70b", gpu="h100", tp=1)
    o = parse_extra_config({**_base(tmp_path), "kvstream": {"recompute_model": "qwen2.5-14b",
                                                            "recompute_gpu": "a100", "recompute_tp": "4"}})
    assert o.recompute == RecomputeOptions(model="qwen2.5-14b", gpu="a100", tp=4)


@pytest.mark.parametrize("extra, key, message", [
    ({"kvstream.recompute_model": "gpt-9", "kvstream.recompute_gpu": "h100"}, "recompute_model",
     r"unknown model 'gpt-9'; known: .*llama-3-70b.*qwen2\.5-14b"),
    ({"kvstream.recompute_model": "70b", "kvstream.recompute_gpu": "v100"}, "recompute_gpu",
     r"unknown GPU profile 'v100'; known: a100, a800, h100"),
    ({"kvstream.recompute_model": "70b", "kvstream.recompute_gpu": "h100", "kvstream.recompute_tp": 0},
     "recompute_tp", "must be at least 1"),
    ({"kvstream.recompute_model": "70b", "kvstream.recompute_gpu": "h100", "kvstream.recompute_tp": "two"},
     "recompute_tp", "expected an integer"),
    ({"kvstream.recompute_model": "70b", "kvstream.recompute_gpu": "h100", "kvstream.recompute_tp": True},
     "recompute_tp", "expected an integer"),
    ({"kvstream.recompute_model": "70b"}, "recompute_gpu", "set both"),
    ({"kvstream.recompute_gpu": "h100", "kvstream.recompute_tp": 2}, "recompute_model", "set both"),
    ({"kvstream.recompute_model": "", "kvstream.recompute_gpu": "h100"}, "recompute_model", "non-empty string"),
    ({"kvstream.recompute_modle": "70b"}, "recompute_modle", "did you mean 'kvstream.recompute_model'"),
])
def test_bad_recompute_keys_fail_naming_the_key(tmp_path, extra, key, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_extra_config({**_base(tmp_path), **extra})
    assert err.value.field == f"kvstream.{key}"


def test_plugin_start_fails_on_a_bad_recompute_key_and_strict_stops_lmcache(disk_tmp):
    from kvstream.integrations.lmcache import StrictStartError

    with pytest.raises(StrictStartError, match="kvstream.recompute_gpu"):
        with manager({**tiers_extra(disk_tmp), **RECOMPUTE, "kvstream.recompute_gpu": "tpu", "kvstream.strict": True}):
            pass


# -- lookups through the plugin -------------------------------------------------------------------------------
def test_without_the_keys_every_held_chunk_is_a_hit_however_slow_the_tier(disk_tmp):
    with manager(tiers_extra(disk_tmp)) as sm:
        infos, _ = _layout(sm)
        keys = [k for _, _, k in infos]
        _bandwidth(sm, local=FAST, shared=SLOW)
        declined = metric_total(DECLINED)
        assert plugin_of(sm).batched_contains(keys) == N
        assert sm.batched_contains(keys)[0] == N
        assert metric_total(DECLINED) == declined


def test_slow_only_tail_is_left_to_the_gpu_and_the_fast_front_stays_a_hit(disk_tmp):
    with manager({**tiers_extra(disk_tmp), **RECOMPUTE}) as sm:
        plugin = plugin_of(sm)
        infos, refs = _layout(sm)
        keys = [k for _, _, k in infos]
        _bandwidth(sm, local=FAST, shared=SLOW)
        declined = metric_total(DECLINED)
        assert plugin.batched_contains(keys) == MEMORY + LOCAL
        assert metric_total(DECLINED) == declined + N - MEMORY - LOCAL
        # what LMCache's lookup sees, pinned: only the reported chunks are pinned
        hit, mapping = sm.batched_contains(keys, pin=True)
        assert hit == MEMORY + LOCAL and mapping == {"kvstream": keys[:MEMORY + LOCAL]}
        pins = plugin.store.pins
        assert sorted(k for k in plugin._keys.many(keys) if pins.pinned(k)) == sorted(plugin._keys.many(keys[:MEMORY + LOCAL]))
        assert plugin.contains(keys[-1])  # one key: still "held" (LMCache would otherwise store it again)
        # the reported prefix loads, bit exact
        got = sm.batched_get(keys[:MEMORY + LOCAL], location="kvstream")
        try:
            assert all(o is not None and torch.equal(o.tensor, r) for o, r in zip(got, refs))
        finally:
            release_all(got)


def test_fast_tiers_or_unmeasured_tiers_report_the_whole_held_prefix(disk_tmp):
    with manager({**tiers_extra(disk_tmp), **RECOMPUTE}) as sm:
        plugin = plugin_of(sm)
        infos, _ = _layout(sm)
        keys = [k for _, _, k in infos]
        declined = metric_total(DECLINED)
        assert plugin.store.read_bandwidth(0) is None and plugin.store.read_bandwidth(1) is None
        assert plugin.batched_contains(keys) == N  # nothing measured yet: no reason to shorten
        _bandwidth(sm, local=FAST, shared=FAST)
        assert plugin.batched_contains(keys) == N
        assert sm.batched_contains(keys)[0] == N
        assert metric_total(DECLINED) == declined
        _bandwidth(sm, local=SLOW, shared=FAST)  # a slow local tier under a host-memory front: load the front
        assert plugin.batched_contains(keys) == MEMORY
        _bandwidth(sm, local=FAST, shared=0.0)  # the shared tier was busy a whole step and delivered nothing
        assert plugin.batched_contains(keys) == MEMORY + LOCAL


def test_async_lookup_reports_and_prefetches_only_the_loaded_prefix(disk_tmp):
    with manager({**tiers_extra(disk_tmp), **RECOMPUTE}, async_loading=True) as sm:
        sm.async_lookup_server = FakeScheduler()
        infos, refs = _layout(sm)
        _bandwidth(sm, local=FAST, shared=SLOW)
        prefetch(sm, "req", infos)
        n, pairs = collect(sm, "req")
        try:
            assert n == (MEMORY + LOCAL) * CHUNK
            assert [k for k, _ in pairs] == [k for _, _, k in infos[:MEMORY + LOCAL]]
            assert all(torch.equal(o.tensor, refs[i]) for i, (_, o) in enumerate(pairs))
        finally:
            release_all([o for _, o in pairs])
