"""Issue 13: the LMCache plugin's secret tenant salt. Two deployments on one folder with different salts share
nothing (no key of one is a key of the other); with the same salt they share everything; the secret is read from a
file or an environment variable, checked for length, and never printed."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

import kvstream
from kvstream.errors import ConfigError
from kvstream.integrations._lmcache_config import parse_extra_config
from kvstream.integrations._lmcache_keys import KeyMapper

@dataclass(frozen=True)
class EngineKey:
    """The fields of LMCache's CacheEngineKey the plugin's key mapping reads."""

    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: int
    dtype: str = "bfloat16"


SECRET_A = b"tenant-a-0123456789abcdef-secret"
SECRET_B = b"tenant-b-fedcba9876543210-secret"


def options(tmp_path, **extra):
    return parse_extra_config({"kvstream.tiers": f"local={tmp_path / 'tier'}", "kvstream.capacity_bytes": "64MiB",
                               **{f"kvstream.{k}": v for k, v in extra.items()}})


def test_the_salt_comes_from_a_file_or_a_variable_and_is_never_printed(tmp_path, monkeypatch):
    (tmp_path / "salt").write_bytes(SECRET_A + b"\n")
    assert options(tmp_path, tenant_salt_file=str(tmp_path / "salt")).tenant_salt == SECRET_A
    monkeypatch.setenv("KVS_TEST_SALT", SECRET_B.decode())
    opts = options(tmp_path, tenant_salt_env="KVS_TEST_SALT")
    assert opts.tenant_salt == SECRET_B and SECRET_B.decode() not in repr(opts)
    assert options(tmp_path).tenant_salt is None
    monkeypatch.setenv("KVS_TEST_SALT", "short-secret")
    with pytest.raises(ConfigError, match=r"kvstream\.tenant_salt_env.*\$KVS_TEST_SALT holds 12 bytes") as err:
        options(tmp_path, tenant_salt_env="KVS_TEST_SALT")
    assert "short-secret" not in str(err.value)
    with pytest.raises(ConfigError, match=r"kvstream\.tenant_salt_file.*cannot read"):
        options(tmp_path, tenant_salt_file=str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"kvstream\.tenant_salt_env.*not set"):
        options(tmp_path, tenant_salt_env="KVS_TEST_NO_SUCH_VARIABLE")


def test_deployments_with_different_salts_share_nothing_and_with_the_same_salt_everything(disk_tmp):
    engine_keys = [EngineKey("model", 1, 0, 1000 + i) for i in range(64)]
    cfg = {"tiers": [{"name": "local", "path": str(disk_tmp / "tier"), "capacity_bytes": "64MiB"}],
           "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads"}
    a, b, a2, none = (KeyMapper("ns", tenant_salt=SECRET_A), KeyMapper("ns", tenant_salt=SECRET_B),
                      KeyMapper("ns", tenant_salt=SECRET_A), KeyMapper("ns"))
    with kvstream.open_store(cfg) as store:
        for k in engine_keys:
            store.put(a(k), b"kv of tenant a " + repr(k).encode())
        store.flush()
        assert store.drain(10)
        assert store.lookup([a2(k) for k in engine_keys]) == len(engine_keys)  # same salt: everything
        assert not any(store.contains(b(k)) for k in engine_keys)  # another salt: nothing
        assert not any(store.contains(none(k)) for k in engine_keys)  # no salt: nothing either
    assert not {a(k) for k in engine_keys} & {b(k) for k in engine_keys}
