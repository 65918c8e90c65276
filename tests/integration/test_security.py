"""Security and bad input (see SECURITY.md): no deserialisation of stored data, private files, keys that cannot
escape the tier folder, tenants that cannot hit each other, and clear errors for bad config and bad traces."""

from __future__ import annotations

import ast
import os
import pickle
import random
from pathlib import Path
from dataclasses import dataclass

import numpy as np
import pytest

import kvstream
from kvstream.config import StoreConfig
from kvstream.errors import ConfigError, InputFormatError
from kvstream.integrations._lmcache_keys import KeyMapper, encode_engine_key
from kvstream.keys import ChunkKeyer, KeyNamespace
from kvstream.tiers.files import DirectoryTier

SRC = Path(kvstream.__file__).resolve().parent


def config(root: Path, **kw) -> dict:
    base = {"tiers": [{"name": "local", "path": str(root / "local"), "capacity_bytes": "64MiB"},
                      {"name": "shared", "path": str(root / "shared"), "capacity_bytes": "64MiB"}],
            "memory_bytes": "8MiB", "create_dirs": True, "io_engine": "threads"}
    base.update(kw)
    return base


# ── no deserialisation of stored data ──────────────────────────────────────────────────────────────────────

_FORBIDDEN_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
_FORBIDDEN_CALLS = {"eval", "exec", "unsafe_load", "full_load"}


def _problems(path: Path, base: Path = SRC) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in _FORBIDDEN_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _FORBIDDEN_MODULES:
            out.append(f"from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in _FORBIDDEN_CALLS:
                out.append(f"{name}()")
            if name == "load" and isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name):
                kws = {k.arg: k.value for k in node.keywords}
                if f.value.id == "yaml" and not ("Loader" in kws and "Safe" in ast.unparse(kws["Loader"])):
                    out.append("yaml.load() without a safe loader")
                if f.value.id in ("np", "numpy") and "allow_pickle" in kws and ast.unparse(kws["allow_pickle"]) != "False":
                    out.append("numpy.load(allow_pickle=...)")
                if f.value.id == "torch" and ast.unparse(kws.get("weights_only", ast.Constant(False))) != "True":
                    out.append("torch.load() without weights_only=True")
    return [f"{path.relative_to(base)}:{p}" for p in out]


def test_no_module_can_deserialise_objects():
    files = sorted(SRC.rglob("*.py"))
    assert len(files) > 20
    problems = [p for f in files for p in _problems(f)]
    assert problems == []


def test_the_checker_itself_catches_what_it_looks_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nimport yaml\nyaml.load(x)\neval('1')\nimport numpy as np\nnp.load(f, allow_pickle=True)\n"
                   "yaml.load(x, Loader=yaml.SafeLoader)\nnp.load(f)\n")
    assert len(_problems(bad, tmp_path)) == 4  # pickle, unsafe yaml.load, eval, allow_pickle; not the safe two


class _Boom:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["KVS_BOOM"]),))


def test_a_pickled_payload_comes_back_as_bytes_and_is_never_run(disk_tmp, monkeypatch):
    boom = disk_tmp / "boom"
    monkeypatch.setenv("KVS_BOOM", str(boom))
    evil = pickle.dumps(_Boom())
    with kvstream.open_store(config(disk_tmp)) as s:
        s.put(b"e" * 16, evil)
    with kvstream.open_store(config(disk_tmp)) as s:
        (i, chunk), = s.read_chunks([b"e" * 16])
        assert bytes(chunk.payload) == evil and chunk.meta.dtype == "uint8"
    assert not boom.exists()


# ── files other jobs on a shared file system cannot read ───────────────────────────────────────────────────


def test_every_file_and_folder_the_store_makes_is_private_even_with_umask_0(disk_tmp):
    old = os.umask(0)
    try:
        root = disk_tmp / "deep" / "tier"
        cfg = config(disk_tmp, tiers=[{"name": "t", "path": str(root), "capacity_bytes": "64MiB"}])
        rng = random.Random(0)
        keys = [rng.randbytes(16) for _ in range(8)]
        with kvstream.open_store(cfg) as s:
            for k in keys:
                s.put(k, rng.randbytes(10_000))
        victim = root / DirectoryTier.relpath(keys[0])
        victim.write_bytes(b"\0" * 8192)  # to make the store quarantine it (a .why note is written)
        os.chmod(victim, 0o600)
        with kvstream.open_store(cfg) as s:  # reopening compacts the log into a snapshot
            assert s.get_many(keys)[0] is None
        with kvstream.open_store(cfg) as s:
            s.put(b"n" * 16, b"x" * 5000)
    finally:
        os.umask(old)
    seen = {"snapshot.idx": False, ".why": False, "KVSTREAM_TIER": False, ".kvc": False, "compact.lock": False}
    loose = []
    for p in [root, *root.rglob("*")]:
        mode = p.stat().st_mode & 0o777
        if mode & 0o077:
            loose.append(f"{p.relative_to(root)}: {mode:04o}")
        for suffix in seen:
            seen[suffix] |= p.name.endswith(suffix)
    assert loose == []
    assert all(seen.values()), seen
    assert (disk_tmp / "deep").stat().st_mode & 0o777 == 0o700  # a parent create_dirs made, not only the tier


# ── keys and names cannot escape the tier folder ───────────────────────────────────────────────────────────


@pytest.mark.parametrize("key", [b"../../../../etc/passwd", b"/etc/shadow\0", b"..", b"\\..\\x", b"chunks/../../x",
                                 "ключ/../".encode(), b"\xff" * 64])
def test_hostile_keys_stay_inside_the_tier_as_hex_names(disk_tmp, key):
    with kvstream.open_store(config(disk_tmp)) as s:
        assert s.put(key, b"payload")
    with kvstream.open_store(config(disk_tmp)) as s:
        assert bytes(s.get_many([key])[0]) == b"payload"
    files = [p for p in disk_tmp.rglob("*.kvc")]
    assert len(files) == 2
    for tier in ("local", "shared"):
        f = disk_tmp / tier / DirectoryTier.relpath(key)
        assert f.resolve().is_relative_to((disk_tmp / tier / "chunks").resolve()) and f.exists()
        assert f.stem == key.hex()
    assert {p.name for p in disk_tmp.iterdir()} == {"local", "shared"}


@pytest.mark.parametrize("name", ["../x", "a/b", "", "x" * 33, "tier\0", "ti er"])
def test_tier_names_that_are_not_plain_words_are_refused(tmp_path, name):
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.name"):
        StoreConfig.from_any({"tiers": [{"name": name, "path": str(tmp_path), "capacity_bytes": 1 << 20}]})


# ── tenants cannot hit (or time) each other's prefixes ─────────────────────────────────────────────────────


def test_a_tenant_with_its_own_salt_never_hits_another_tenants_chunks(disk_tmp):
    tokens = np.arange(8 * 256)
    alice = ChunkKeyer(KeyNamespace(model="m", kv_dtype="bfloat16", tenant_salt=b"a" * 32)).chunk_keys(tokens)
    bob = ChunkKeyer(KeyNamespace(model="m", kv_dtype="bfloat16", tenant_salt=b"b" * 32)).chunk_keys(tokens)
    plain = ChunkKeyer(KeyNamespace(model="m", kv_dtype="bfloat16")).chunk_keys(tokens)
    with kvstream.open_store(config(disk_tmp)) as s:
        for k in alice:
            s.put(k, b"alice's KV" * 100)
    with kvstream.open_store(config(disk_tmp)) as s:
        assert s.lookup(alice) == 8  # positive control: the owner hits
        before = s.stats()
        assert s.lookup(bob) == 0 and s.get_many(bob) == [None] * 8 and s.lookup(plain) == 0
        after = s.stats()
    # Bob's lookups touched no tier and no host-memory entry: what he can time is a plain miss.
    for t in ("local", "shared"):
        assert after.tiers[t].read_chunks == before.tiers[t].read_chunks
    assert after.memory_hits == before.memory_hits and after.disk_hits == before.disk_hits


def test_models_namespace_keys():
    tokens = np.arange(512)
    a = ChunkKeyer(KeyNamespace(model="Qwen/Qwen2.5-14B", kv_dtype="bfloat16")).chunk_keys(tokens)
    b = ChunkKeyer(KeyNamespace(model="Qwen/Qwen2.5-7B", kv_dtype="bfloat16")).chunk_keys(tokens)
    assert set(a).isdisjoint(b)


# ── LMCache keys with odd characters ───────────────────────────────────────────────────────────────────────


@dataclass(frozen=True)
class _LMKey:  # duck-typed like LMCache's CacheEngineKey (hashable, the fields the mapper reads)
    model_name: str
    world_size: int
    worker_id: int
    chunk_hash: object
    dtype: str
    tags: tuple = ()


def _lm_key(model: str, chunk_hash, tags=()):
    return _LMKey(model, 1, 0, chunk_hash, "torch.bfloat16", tags)


def test_lmcache_keys_with_odd_characters_map_to_distinct_hex_safe_keys(disk_tmp):
    odd = ["m@1@0", "m%40", "../../etc", "m/\0/x", "\udcff\udcfe", "модель", "a" * 4096, "", " "]
    keys = [_lm_key(m, 5) for m in odd]
    keys += [_lm_key("m", b"\0/..\xff"), _lm_key("m", -1), _lm_key("m", 1, tags=(("t@x", "v%1"),)),
             _lm_key("m", 1, tags=(("t", "x@v"),)), _lm_key("m", 1, tags=(("t", 1),)), _lm_key("m", 1, tags=(("t", "1"),))]
    mapper = KeyMapper("ns")
    store_keys = [mapper(k) for k in keys]
    assert len(set(store_keys)) == len(keys) and all(len(k) == 16 for k in store_keys)
    assert len({encode_engine_key(k) for k in keys}) == len(keys)
    assert KeyMapper("ns")(keys[0]) == store_keys[0] and KeyMapper("other")(keys[0]) != store_keys[0]
    with kvstream.open_store(config(disk_tmp)) as s:
        for k in store_keys:
            s.put(k, b"v")
    names = {p.stem for p in (disk_tmp / "local" / "chunks").rglob("*.kvc")}
    assert names == {k.hex() for k in store_keys}


# ── bad config: clear errors naming the field ──────────────────────────────────────────────────────────────


@pytest.mark.parametrize("change,field", [
    ({"tiers": {"name": "a"}}, "tiers"),
    ({"tiers": ["local"]}, "tiers[0]"),
    ({"tiers": [{"name": "a", "path": "/x"}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": -5}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": "0GiB"}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": True}]}, "tiers[0].capacity_bytes"),
    ({"tiers": [{"name": "a", "path": "", "capacity_bytes": 1}]}, "tiers[0].path"),
    ({"tiers": [{"name": "a", "path": 7, "capacity_bytes": 1}]}, "tiers[0].path"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "read_depth": "8"}]}, "tiers[0].read_depth"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "read_depth": 0}]}, "tiers[0].read_depth"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "fsync": "yes"}]}, "tiers[0].fsync"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "direct_io": "maybe"}]}, "tiers[0].direct_io"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "shared": 1}]}, "tiers[0].shared"),
    ({"tiers": [{"name": "a", "path": "/x", "capacity_bytes": 1, "eviction": "random-ish"}]}, "tiers[0].eviction"),
    ({"hedge_after_s": -1}, "hedge_after_s"),
    ({"hedge_after_s": "fast"}, "hedge_after_s"),
    ({"node_id": 5}, "node_id"),
    ({"create_dirs": 1}, "create_dirs"),
    ({"memory_bytes": "0"}, "memory_bytes"),
    ({"chunk_bytes": "1.5"}, "chunk_bytes"),
    ({"memory_eviction": "nope"}, "memory_eviction"),
    ({"Tiers": []}, "Tiers"),
])
def test_bad_config_values_name_the_field(tmp_path, change, field):
    base = {"tiers": [{"name": "a", "path": str(tmp_path), "capacity_bytes": "1GiB"}]}
    base.update(change)
    with pytest.raises(ConfigError) as err:
        StoreConfig.from_any(base)
    assert err.value.field == field, str(err.value)


def test_a_tier_path_that_is_a_file_is_refused_at_open(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"tiers\[0\]\.path.*not a folder"):
        kvstream.open_store({"tiers": [{"name": "a", "path": str(f), "capacity_bytes": 1 << 30}]})


def test_yaml_config_errors_and_relative_paths(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("tiers: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        StoreConfig.from_any(bad)
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        StoreConfig.from_any(str(bad))
    with pytest.raises(ConfigError, match="cannot read"):
        StoreConfig.from_any(tmp_path / "missing.yaml")
    good = tmp_path / "sub" / "kv.yaml"
    good.parent.mkdir()
    good.write_text("tiers:\n  - {name: a, path: data/../tier, capacity_bytes: 1MiB}\n")
    assert StoreConfig.from_any(good).tiers[0].path == str(tmp_path / "sub" / "tier")
    with pytest.raises(ConfigError, match="<config>"):
        StoreConfig.from_any(["not", "a", "config"])


# ── bad trace files: the error names the file and the line ─────────────────────────────────────────────────


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


_MC_OK = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("bad,line,match", [
    ("{not json}\n", 2, "not valid JSON"),
    ("[1, 2]\n", 2, "expected a JSON object"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 5}\n', 2, "missing field"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [1]}\n', 2, "must not be negative"),
    ('{"timestamp": 1, "input_length": "10", "output_length": 5, "hash_ids": [1]}\n', 2, "must be an integer"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": [1, 2]}\n', 2, "expected ceil"),
    ('{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": ["a"]}\n', 2, "list of integers"),
    ("\n" + '{"timestamp": 1, "input_length": 10, "output_length": 5, "hash_ids": [true]}\n', 3, "list of integers"),
])
def test_bad_mooncake_lines_are_named(tmp_path, bad, line, match):
    from kvstream.workload.mooncake import read_mooncake

    p = _write(tmp_path, "t.jsonl", _MC_OK + bad)
    with pytest.raises(InputFormatError, match=match) as err:
        read_mooncake(p)
    assert err.value.line == line and err.value.path == str(p) and f"{p}:{line}:" in str(err.value)


def test_mooncake_timestamps_going_back_are_named(tmp_path):
    from kvstream.workload.mooncake import read_mooncake

    p = _write(tmp_path, "t.jsonl", _MC_OK.replace('"timestamp": 0', '"timestamp": 9') + _MC_OK)
    with pytest.raises(InputFormatError, match="goes backwards") as err:
        read_mooncake(p)
    assert err.value.line == 2


_BD_HEAD = "user_id time_stamp(seconds) query_length response_length round_index\n"


@pytest.mark.parametrize("body,line,match", [
    ("1 0 10 20 0\n1 5 10 20\n", 3, "expected 5 fields"),
    ("1 0 10 20 0\n1 5 x 20 1\n", 3, "must be integers"),
    ("1 0 10 -20 0\n", 2, "negative"),
    ("1 0 10 20 1\n", 2, "starts at round 1"),
    ("1 0 10 20 0\n1 5 10 20 2\n", 3, "round 2 follows round 0"),
    ("1 9 10 20 0\n1 5 10 20 1\n", 3, "before its previous"),
])
def test_bad_bidaw_lines_are_named(tmp_path, body, line, match):
    from kvstream.workload.bidaw import read_bidaw_trace

    p = _write(tmp_path, "t.txt", _BD_HEAD + body)
    with pytest.raises(InputFormatError, match=match) as err:
        read_bidaw_trace(p)
    assert err.value.line == line and f"{p}:{line}:" in str(err.value)


def test_bidaw_missing_header_is_named(tmp_path):
    from kvstream.workload.bidaw import read_bidaw_trace

    for text in ("", "1 0 10 20 0\n"):
        with pytest.raises(InputFormatError, match="header") as err:
            read_bidaw_trace(_write(tmp_path, "h.txt", text))
        assert err.value.line == 1
