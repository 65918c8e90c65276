"""docs/config.md is generated from the config dataclasses and the LMCache plugin's keys: every field is
documented, and the file in the repository is what the generator writes now."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvstream.config import FIELD_DOCS, StoreConfig, TierConfig, reference_markdown
from kvstream.integrations._lmcache_config import KEY_DEFAULTS, KEYS, STORE_KEYS, parse_extra_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "config.md"


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


def test_documented_plugin_defaults_are_the_real_ones(tmp_path: Path) -> None:
    o = parse_extra_config({"kvstream.tiers": f"local={tmp_path}", "kvstream.capacity_bytes": "1GiB"})
    assert o.flush_after_s * 1000 == float(KEY_DEFAULTS["flush_after_ms"][1])
    assert o.load_threads == int(KEY_DEFAULTS["load_threads"][1])
    assert o.read_into is (KEY_DEFAULTS["read_into"][1] == "true")
    assert o.prefetch_ttl_s == float(KEY_DEFAULTS["prefetch_ttl_s"][1])
    assert o.close_timeout_s == float(KEY_DEFAULTS["close_timeout_s"][1])
    assert o.namespace == ""


def test_write_backlog_bytes_is_documented() -> None:
    text = reference_markdown()
    line = next(ln for ln in text.splitlines() if ln.startswith("| `write_backlog_bytes`"))
    assert "second" in line and "half of `memory_bytes`" in line


def test_docs_config_md_is_up_to_date() -> None:
    assert DOC.exists(), "docs/config.md is missing: run python scripts/config_reference.py"
    assert DOC.read_text() == reference_markdown(), \
        "docs/config.md is stale: run python scripts/config_reference.py"
