"""Config parsing: every bad value fails with a message naming the field."""

from __future__ import annotations

import pytest

import kvstream
from kvstream.config import StoreConfig, parse_size, parse_tier_specs
from kvstream.errors import ConfigError


def cfg(tmp_path, **kw):
    base = {"tiers": [{"name": "local", "path": str(tmp_path / "a"), "capacity_bytes": "1GiB"}], "create_dirs": True}
    base.update(kw)
    return base


@pytest.mark.parametrize("value,expect", [(4096, 4096), ("4KiB", 4096), ("4k", 4096), ("2GB", 2 * 10**9), ("1.5M", 1_572_864), ("48MiB", 48 << 20)])
def test_sizes(value, expect):
    assert parse_size(value, "f") == expect


@pytest.mark.parametrize(
    "change,field",
    [
        ({"routr": "mitm"}, "routr"),
        ({"tiers": [{"name": "a", "path": "/x", "capcity_bytes": 1}]}, "tiers[0].capcity_bytes"),
        ({"tiers": [{"name": "a", "path": "rel/x", "capacity_bytes": 1}]}, "tiers[0].path"),
        ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 0}]}, "tiers[0].capacity_bytes"),
        ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": "lots"}]}, "tiers[0].capacity_bytes"),
        ({"tiers": [{"name": "a/../b", "path": "/x", "capacity_bytes": 1}]}, "tiers[0].name"),
        ({"tiers": []}, "tiers"),
        ({"router": "fastest"}, "router"),
        ({"replication": "twice"}, "replication"),
        ({"io_engine": "aio"}, "io_engine"),
        ({"memory_bytes": 10}, "memory_bytes"),
        ({"verify_reads": "yes"}, "verify_reads"),
        ({"chunk_bytes": "4GiB"}, "tiers[0].capacity_bytes"),
    ],
)
def test_bad_config_names_the_field(tmp_path, change, field):
    with pytest.raises(ConfigError) as err:
        StoreConfig.from_any(cfg(tmp_path, **change))
    assert err.value.field == field
    assert f"'{field}'" in str(err.value)


def test_misspelt_key_gets_a_suggestion(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'replication'"):
        StoreConfig.from_any(cfg(tmp_path, replicaton="full"))


def test_missing_folder_fails_at_open_unless_created(tmp_path):
    c = cfg(tmp_path, create_dirs=False)
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path.*does not exist"):
        kvstream.open_store(c)
    kvstream.open_store(cfg(tmp_path)).close()


def test_read_only_folder_fails_at_open(tmp_path):
    import os
    import subprocess

    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    immutable = False
    if os.access(ro, os.W_OK):  # root ignores mode bits: mark the folder immutable instead (ext4 chattr)
        immutable = subprocess.run(["chattr", "+i", str(ro)], capture_output=True).returncode == 0
        if not immutable:
            pytest.skip("root on a file system without chattr +i: no way to make a folder read-only here")
    try:
        with pytest.raises(ConfigError, match=r"tiers\[0\]\.path.*not writable"):
            kvstream.open_store({"tiers": [{"name": "a", "path": str(ro), "capacity_bytes": 1 << 30}]})
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(ro)], check=True)
        os.chmod(ro, 0o700)


def test_yaml_relative_paths_are_relative_to_the_file(tmp_path):
    (tmp_path / "store.yaml").write_text("tiers:\n  - {name: local, path: data/a, capacity_bytes: 1GiB}\nrouter: mitm:2\n")
    c = StoreConfig.from_any(str(tmp_path / "store.yaml"))
    assert c.tiers[0].path == str(tmp_path / "data" / "a") and c.router == "mitm:2"


def test_yaml_errors(tmp_path):
    (tmp_path / "bad.yaml").write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        StoreConfig.from_any(str(tmp_path / "bad.yaml"))
    with pytest.raises(ConfigError, match="cannot read"):
        StoreConfig.from_any(str(tmp_path / "missing.yaml"))


def test_tier_specs():
    assert [t["name"] for t in parse_tier_specs(["local=/a,shared=/b"], capacity_bytes=1)] == ["local", "shared"]
    with pytest.raises(ConfigError, match="NAME=PATH"):
        parse_tier_specs(["local"], capacity_bytes=1)


@pytest.mark.parametrize("field,value,match", [
    ("memory_eviction", "belady", "simulator only"),
    ("memory_eviction", "hit-potentail", "did you mean 'hit-potential'"),
    ("read_windows", "balancd", "did you mean 'balanced'"),
])
def test_policy_names_are_checked_with_suggestions(tmp_path, field, value, match):
    with pytest.raises(ConfigError, match=match) as ei:
        StoreConfig.from_dict(cfg(tmp_path, **{field: value}))
    assert ei.value.field == field


def test_policies_that_need_options_open_in_a_store(tmp_path):
    # hit-potential needs a capacity: the store passes its tier's, so naming it in a config just works
    c = cfg(tmp_path, memory_eviction="hit-potential", read_windows="fixed")
    c["tiers"][0]["eviction"] = "hit-potential"
    with kvstream.open_store(c) as s:
        s.put(b"k" * 16, b"x" * 1000)
        assert s.get_many([b"k" * 16])[0] is not None


def test_two_processes_creating_a_new_tier_folder_at_once(tmp_path):
    # Two nodes opening a shared tier nobody has used yet race to create its folder; both must open.
    import threading

    cfgs = [cfg(tmp_path, node_id=f"n{i}") for i in range(8)]
    for c in cfgs:
        c["tiers"][0]["path"] = str(tmp_path / "new" / "tier")
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(cfgs))

    def open_one(c):
        barrier.wait()
        try:
            kvstream.open_store(c).close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(c,)) for c in cfgs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
