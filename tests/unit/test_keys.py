"""Chunk keys: prefix chaining, namespaces and tenant isolation."""

from __future__ import annotations

import numpy as np
import pytest

from kvstream.keys import ChunkKeyer, KeyNamespace


def keyer(**kw):
    base = dict(model="m", kv_dtype="bfloat16")
    base.update(kw)
    return ChunkKeyer(KeyNamespace(**base))


def test_prefix_chained():
    k = keyer()
    a = np.arange(1024)
    b = a.copy()
    b[600] = -1  # differs inside chunk 2
    ka, kb = k.chunk_keys(a), k.chunk_keys(b)
    assert len(ka) == 4 and ka[:2] == kb[:2] and ka[2] != kb[2] and ka[3] != kb[3]
    assert k.chunk_keys(a[:512]) == ka[:2]


def test_partial_chunk_only_when_asked_and_never_equal_to_a_full_one():
    k = keyer()
    assert len(k.chunk_keys(np.arange(300))) == 1
    ks = k.chunk_keys(np.arange(300), include_partial=True)
    assert len(ks) == 2 and ks[1] not in k.chunk_keys(np.arange(512))


@pytest.mark.parametrize("change", [dict(model="m2"), dict(kv_dtype="float16"), dict(layout="X"), dict(extra="tp=4"),
                                    dict(tenant_salt=b"s" * 16)])
def test_namespaces_never_share_keys(change):
    toks = np.arange(512)
    assert set(keyer().chunk_keys(toks)).isdisjoint(keyer(**change).chunk_keys(toks))


def test_two_tenants_with_salts_cannot_hit_each_other():
    toks = np.arange(2048)
    a = keyer(tenant_salt=b"A" * 32).chunk_keys(toks)
    b = keyer(tenant_salt=b"B" * 32).chunk_keys(toks)
    assert set(a).isdisjoint(b)
    assert keyer(tenant_salt=b"A" * 32).chunk_keys(toks) == a  # deterministic for the same tenant


def test_short_salt_rejected():
    with pytest.raises(ValueError, match="salt"):
        KeyNamespace(model="m", kv_dtype="x", tenant_salt=b"short")


def test_foreign_and_chain_keys_are_namespaced():
    assert keyer().foreign("model@1@0@abc@bf16") != keyer(model="n").foreign("model@1@0@abc@bf16")
    c = keyer().chain([1, 2, 3])
    assert c[:2] == keyer().chain([1, 2]) and keyer().chain([1, 5, 3])[2] != c[2]
