"""Issue 13: nothing accepted at open fails later. Hypothesis builds configs from good and bad values of every
field; ``open_store`` either raises :class:`ConfigError` naming a field of the config, or every operation works
and returns the bytes that were put."""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import kvstream
from kvstream.errors import ConfigError

NUMBERS = [None, 0, -1, 0.05, 1, 2.5, float("nan"), float("inf"), -float("inf"), 1e308, True, "1", [], 10**400]
SIZES = [0, 1, 4095, 4096, "64KiB", "32MiB", "1GiB", -1, "9" * 400, "1e9", "lots", 1.5, 2**70, None, True,
         "0.5MiB", float("nan"), 2**62, "1TiB", "16TiB"]
STRINGS = ["mitm", "mitm:2", "fixed:0.7", "fixed:nan", "fixed:inf", "fixed:-1", "single:local", "single:x", "",
           "threads", "auto", "uring", "lru", "nope", "a/b", "x" * 5000, "node-1", ".", "..", "n\0", 7, None]
CHUNK = 64 << 10


def _field_values(root: Path) -> dict[str, list]:
    return {
        "memory_bytes": SIZES, "chunk_bytes": SIZES + [CHUNK], "hedge_after_s": NUMBERS, "router": STRINGS,
        "replication": ["full", "partial", "nope", 3, None], "io_engine": STRINGS, "memory_eviction": STRINGS,
        "node_id": STRINGS, "read_windows": ["balanced", "fixed", "x", 1], "verify_reads": [True, False, "yes"],
        "tier.read_inflight_bytes": SIZES, "tier.write_inflight_bytes": SIZES, "tier.read_depth": NUMBERS,
        "tier.write_depth": NUMBERS, "tier.write_backlog_bytes": SIZES, "tier.eviction": STRINGS,
        "tier.direct_io": ["auto", "on", "off", "maybe", True], "tier.capacity_bytes": SIZES,
        "tier.path": [str(root / "l"), str(root / "s"), str(root / "l" / "in"), str(root / "n\0ul"), "relative",
                      str(root / "l") + "/../s", ""],
    }


@st.composite
def configs(draw, root: Path) -> dict:
    cfg: dict = {"tiers": [{"name": "local", "path": str(root / "l"), "capacity_bytes": "64MiB"},
                           {"name": "shared", "path": str(root / "s"), "capacity_bytes": "64MiB"}],
                 "memory_bytes": "32MiB", "create_dirs": True, "io_engine": "threads"}
    values = _field_values(root)
    for name in draw(st.lists(st.sampled_from(sorted(values)), min_size=1, max_size=3, unique=True)):
        value = draw(st.sampled_from(values[name]))
        if name.startswith("tier."):
            cfg["tiers"][draw(st.integers(0, 1))][name[5:]] = value
        else:
            cfg[name] = value
    return cfg


def _fields_of(cfg: dict) -> set[str]:
    names = {k for k in cfg if k != "tiers"} | {"tiers"}
    for i, t in enumerate(cfg["tiers"]):
        names |= {f"tiers[{i}]"} | {f"tiers[{i}].{k}" for k in t}
    return names


@pytest.mark.slow
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_open_fails_naming_a_field_or_everything_works(data):
    root = Path(tempfile.mkdtemp(prefix="kvs-cfgprop-", dir="/var/tmp"))
    try:
        cfg = data.draw(configs(root))
        try:
            store = kvstream.open_store(cfg)
        except ConfigError as exc:
            event("rejected")
            assert exc.field in _fields_of(cfg), f"{exc} names no field of the config"
            return
        event("opened")
        keys = [bytes([i]) * 16 for i in range(6)]
        payloads = [np.random.default_rng(i).bytes(CHUNK) for i in range(6)]
        with store:
            for k, p in zip(keys, payloads):
                store.put(k, p)
            store.flush()
            assert store.drain(20)
            store.evict_memory()
            got = store.get_many(keys)
            # A chunk may be missing (tiers too small, a put dropped for memory) but never wrong.
            assert all(g is None or bytes(g) == p for g, p in zip(got, payloads))
            store.evict_memory()
            targets = [bytearray(CHUNK) for _ in keys]
            for i, res in store.read_into(keys, targets):
                assert not res.ok or bytes(targets[i]) == payloads[i]
            assert math.isfinite(store.stats().tiers["local"].used_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
