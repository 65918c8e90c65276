"""docs/config.md is generated from the config dataclasses and the LMCache plugin's keys: every field is
documented, and the file in the repository is what the generator writes now."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstream.config import FIELD_DOCS, StoreConfig, TierConfig, reference_markdown
from kvstream.errors import ConfigError
from kvstream.integrations._lmcache_config import (_STORE_OVERRIDES, KEY_DEFAULTS, KEYS, MIN_PENDING_BYTES, PLUGIN_KEYS,
                                                   PREFIX, STORE_KEYS, PluginOptions, parse_extra_config,
                                                   pending_write_default)

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "config.md"


def test_every_config_field_is_documented() -> None:
    fields = {f"{cls.__name__}.{f.name}" for cls in (StoreConfig, TierConfig) for f in dataclasses.fields(cls)}
    missing = sorted(fields - FIELD_DOCS.keys())
    assert not missing, f"add these fields to FIELD_DOCS in src/kvstream/config.py: {missing}"
    stale = sorted(FIELD_DOCS.keys() - fields)
    assert not stale, f"FIELD_DOCS names fields that no longer exist: {stale}"
    assert all(doc.strip() for doc in FIELD_DOCS.values())


def test_every_plugin_key_is_documented() -> None:
    # each kvstream.* key either sets a store field (STORE_KEYS) or has its own type and default (KEY_DEFAULTS)
    missing = sorted(set(KEYS) - set(KEY_DEFAULTS) - set(STORE_KEYS.values()))
    assert not missing, f"add these keys to KEY_DEFAULTS in _lmcache_config.py: {missing}"
    assert set(KEY_DEFAULTS) <= set(KEYS) and set(STORE_KEYS.values()) <= set(KEYS)
    text = reference_markdown()
    for key in KEYS:
        assert f"`kvstream.{key}`" in text


# -- the plugin's keys: one source (PLUGIN_KEYS, read by parse_extra_config), checked both ways -----------------
def _cells(line: str) -> list[str]:
    """The cells of a markdown table row; a ``\\|`` inside a cell does not end it."""
    parts = re.split(r"(?<!\\)\|", line.strip())[1:-1]
    return [c.strip().replace("\\|", "|") for c in parts]


def _section_rows(title: str) -> list[list[str]]:
    """The body rows of the table under the docs/config.md heading that starts with ``title``."""
    lines = DOC.read_text().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("## ") and ln[3:].startswith(title))
    rows = []
    for ln in lines[start + 1:]:
        if ln.startswith("## "):
            break
        if ln.startswith("| ") and not ln.startswith("| key ") and not set(ln) <= set("|-: "):
            rows.append(_cells(ln))
    return rows


def _plugin_rows() -> dict[str, tuple[str, str, str]]:
    """docs/config.md's "LMCache plugin only" table as written: key without the prefix -> (type, default, meaning)."""
    out = {}
    for key, typ, default, meaning in _section_rows("LMCache plugin only"):
        assert key.startswith(f"`{PREFIX}") and key.endswith("`"), key
        out[key[len(PREFIX) + 1:-1]] = (typ, default, meaning)
    return out


def _store_rows() -> dict[str, tuple[str, str]]:
    """The store and tier tables' rows that name a kvstream.* key: key -> (default cell, LMCache key cell)."""
    out = {}
    for title in ("Store", "Each tier"):
        for _field, _typ, default, _meaning, lm in _section_rows(title):
            m = re.match(rf"`{re.escape(PREFIX)}(\w+)`", lm)
            if m:
                out.setdefault(m.group(1), (default, lm))
    return out


def _options(tmp: Path, **extra: object) -> PluginOptions:
    return parse_extra_config({"kvstream.tiers": f"local={tmp}", "kvstream.capacity_bytes": "1GiB",
                               **{f"kvstream.{k}": v for k, v in extra.items()}}, default_pending_bytes=123 << 20)


# What each key with a value default is, in the options parse_extra_config builds (the behaviour, not the table).
_RECOMPUTE = {"recompute_model": "70b", "recompute_gpu": "h100"}
EFFECTIVE: dict[str, tuple[dict[str, object], Callable[[PluginOptions], object]]] = {
    "namespace": ({}, lambda o: o.namespace),
    "flush_after_ms": ({}, lambda o: round(o.flush_after_s * 1000, 9)),
    "load_threads": ({}, lambda o: o.load_threads),
    "read_into": ({}, lambda o: o.read_into),
    "prefetch_ttl_s": ({}, lambda o: o.prefetch_ttl_s),
    "close_timeout_s": ({}, lambda o: o.close_timeout_s),
    "strict": ({}, lambda o: o.strict),
    "recompute_tp": (_RECOMPUTE, lambda o: o.recompute.tp if o.recompute else None),
}


def _absent_checks(tmp: Path) -> dict[str, Callable[[], bool]]:
    """Each key without a value default: what leaving it out does (True when the code does what the docs say)."""
    cfg = tmp / "store.yaml"
    cfg.write_text(f"tiers: [{{name: local, path: {tmp / 'f'}, capacity_bytes: 1GiB}}]\ncreate_dirs: true\n")

    def raises(extra: dict[str, object], key: str) -> bool:
        try:
            parse_extra_config(extra)
        except ConfigError as exc:
            return exc.field == f"kvstream.{key}"
        return False

    o = _options(tmp)
    return {
        "config_file": lambda: "config_file" not in o.store_source,
        "tiers": lambda: "kvstream.tiers" not in parse_extra_config({"kvstream.config_file": str(cfg)}).store_source
        and raises({}, "tiers"),
        "capacity_bytes": lambda: raises({"kvstream.tiers": f"local={tmp}"}, "capacity_bytes"),
        "max_pending_write_bytes": lambda: o.max_pending_write_bytes == 123 << 20
        and pending_write_default(20) == 5 << 30 and pending_write_default(0.06) == MIN_PENDING_BYTES == 64 << 20,
        "shared_tiers": lambda: not any(t.shared for t in o.store.tiers),
        "tenant_salt_file": lambda: o.tenant_salt is None,
        "tenant_salt_env": lambda: o.tenant_salt is None,
        "recompute_model": lambda: o.recompute is None,
        "recompute_gpu": lambda: raises({"kvstream.tiers": f"local={tmp}", "kvstream.capacity_bytes": "1GiB",
                                         "kvstream.recompute_model": "70b"}, "recompute_gpu"),
    }


def test_every_plugin_key_in_the_code_is_documented_with_the_codes_default() -> None:
    """code -> docs: each PLUGIN_KEYS entry has its row in docs/config.md, with the type, default and meaning the
    code holds; a key that sets a store field is in the store tables under its kvstream.* name."""
    plugin, store = _plugin_rows(), _store_rows()
    for name, key in PLUGIN_KEYS.items():
        if key.store:
            assert name in store, f"kvstream.{name}: no store-table row names it"
            if key.tiers_default is not None:
                assert f"(default {str(key.tiers_default).lower()} with `kvstream.tiers`)" in store[name][1]
            continue
        assert name in plugin, f"kvstream.{name} is not in docs/config.md's plugin table"
        assert plugin[name] == (key.type, key.default_text(), key.doc), name
    # store keys: exactly the fields a kvstream.<field> key may override
    assert {n for n, k in PLUGIN_KEYS.items() if k.store} == set(_STORE_OVERRIDES)
    # a default lives in PluginKey.default/.absent or the store field, never typed into a key's meaning
    assert not [n for n, k in PLUGIN_KEYS.items() if "default" in k.doc.lower()]


def test_every_documented_plugin_key_exists_and_its_default_is_what_the_code_does(tmp_path: Path) -> None:
    """docs -> code: every row of docs/config.md's plugin table (and every kvstream.* key the store tables name)
    is a key parse_extra_config accepts, and the default written there is what it does when the key is absent."""
    plugin = _plugin_rows()
    assert set(plugin) == {n for n, k in PLUGIN_KEYS.items() if not k.store}
    absent = _absent_checks(tmp_path)
    assert set(EFFECTIVE) | set(absent) == set(plugin), "give every plugin key a behaviour check here"
    for name, (_typ, default, _meaning) in plugin.items():
        if name in absent:
            assert absent[name](), f"kvstream.{name}: docs say {default!r} when it is absent; the code does not"
            continue
        extra, value_of = EFFECTIVE[name]
        written: object
        if default in ("true", "false"):
            written = default == "true"
        elif default.startswith("`\"") and default.endswith("\"`"):
            written = default[2:-2]
        else:
            written = float(default)
        assert value_of(_options(tmp_path, **extra)) == written, f"kvstream.{name}: docs say {default}"
    for name, (_default, _lm) in _store_rows().items():
        assert name in PLUGIN_KEYS, f"docs/config.md names kvstream.{name}, which the plugin does not accept"
    assert _options(tmp_path).store.create_dirs is PLUGIN_KEYS["create_dirs"].tiers_default is True


def test_parse_extra_config_takes_its_defaults_from_plugin_keys(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """One source: change a key's default in PLUGIN_KEYS and parse_extra_config follows (a default typed again in
    the code would not)."""
    other = {"namespace": "ns-x", "flush_after_ms": 7.0, "load_threads": 9, "read_into": False,
             "prefetch_ttl_s": 33.0, "close_timeout_s": 44.0, "strict": True, "recompute_tp": 3}
    assert set(other) == set(EFFECTIVE)
    for name, value in other.items():
        assert value != PLUGIN_KEYS[name].default
        monkeypatch.setitem(PLUGIN_KEYS, name, dataclasses.replace(PLUGIN_KEYS[name], default=value))
        extra, value_of = EFFECTIVE[name]
        assert value_of(_options(tmp_path, **extra)) == value, name
    monkeypatch.setitem(PLUGIN_KEYS, "create_dirs", dataclasses.replace(PLUGIN_KEYS["create_dirs"], tiers_default=False))
    assert _options(tmp_path).store.create_dirs is False


_DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "deploy" / "prometheus" / "kvstream-alerts.yml"]


def test_every_kvstream_key_the_docs_name_exists() -> None:
    """A ``kvstream.<word>`` in the docs is a module, attribute or logger of the package, or a key the plugin
    accepts (a renamed or misspelt key in a YAML example fails here, not in an operator's log)."""
    import importlib.util

    import kvstream

    loggers = {m.group(1) for src in (REPO / "src").rglob("*.py")  # logger names: kvstream.store, kvstream.tier, ...
               for m in re.finditer(r"(?:getLogger|init_logger)\(\"kvstream\.(\w+)", src.read_text())}
    seen = set()
    for doc in _DOCS:
        for m in re.finditer(r"(?<![\w./-])kvstream\.(\w+)(?![\w(])", doc.read_text()):  # not a file name
            word = m.group(1)
            if (word in KEYS or word in loggers or hasattr(kvstream, word)
                    or importlib.util.find_spec(f"kvstream.{word}") is not None):
                seen.add(word)
                continue
            raise AssertionError(f"{doc.relative_to(REPO)} names kvstream.{word}: no such plugin key (known: "
                                 f"{', '.join(KEYS)})")
    assert {"tiers", "capacity_bytes", "strict", "replication"} <= seen


def test_write_backlog_bytes_is_documented() -> None:
    text = reference_markdown()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `write_backlog_bytes`"))
    assert "second" in line and "half of `memory_bytes`" in line


def test_docs_config_md_is_up_to_date() -> None:
    assert DOC.exists(), "docs/config.md is missing: run python scripts/config_reference.py"
    assert DOC.read_text() == reference_markdown(), \
        "docs/config.md is stale: run python scripts/config_reference.py"
