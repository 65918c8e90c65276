"""Model shapes and the per-model compact-tensor decision (pure arithmetic, no torch)."""

from __future__ import annotations

import pytest

from kvstream.compact import PAPER_KFLOP_PER_BYTE, choose_cached_tensor, layer_flops_per_token, tensor_costs
from kvstream.models import MODELS, ModelShape, get_model, known_models, kv_bytes_per_token


def test_kv_bytes_per_token_from_published_shapes() -> None:
    # OPT-13B: 2 x 40 layers x 5120 x 2 bytes = 800 KiB per token (the trace authors' 800 KB figure).
    assert kv_bytes_per_token(get_model("opt-13b")) == 800 * 1024
    # DESIGN.md: a 256-token chunk is 48 MiB for the 14B GQA model and 80 MiB for the 70B one.
    assert 256 * kv_bytes_per_token(get_model("qwen2.5-14b")) == 48 * 2**20
    assert 256 * kv_bytes_per_token(get_model("llama-3-70b")) == 80 * 2**20
    assert kv_bytes_per_token(get_model("opt-13b"), dtype_bytes=4) == 2 * 800 * 1024
    with pytest.raises(ValueError):
        kv_bytes_per_token(get_model("opt-13b"), dtype_bytes=0)


def test_lookup_is_case_insensitive_and_errors_list_known_names() -> None:
    assert get_model(" OPT-13B ") is MODELS["opt-13b"]
    with pytest.raises(KeyError, match="known: .*opt-13b.*qwen2.5-14b"):
        get_model("gpt-5")
    assert known_models() == sorted(MODELS)


def test_attention_kind_follows_head_counts() -> None:
    for m in MODELS.values():
        assert m.heads % m.kv_heads == 0
        assert (m.attention == "MHA") == (m.kv_heads == m.heads) == m.is_mha
    assert {m.name for m in MODELS.values() if m.is_mha} >= {"opt-6.7b", "opt-13b", "opt-30b", "qwen-7b", "qwen-14b"}
    with pytest.raises(ValueError, match="not a multiple"):
        ModelShape(name="bad", hf_id="x", layers=1, hidden=8, heads=3, kv_heads=2, head_dim=4, intermediate=8,
                   vocab=8, max_positions=8, norm="rmsnorm", positions="rope", mlp="swiglu", rope_theta=1e4)  # fmt: skip


def test_compact_decision_mha_vs_gqa() -> None:
    for m in MODELS.values():
        choice = choose_cached_tensor(m)
        if m.is_mha:
            assert choice.tensor == "normed_input"
            assert choice.space_ratio == pytest.approx(2.0)  # >= 1.9 (TARGETS B8)
            assert choice.normed_input.flops_per_byte > choice.kv.flops_per_byte
        else:
            assert choice.tensor == "kv"
            assert choice.space_ratio == 1.0
            assert choice.kv.flops_per_byte > choice.normed_input.flops_per_byte


def test_saved_flops_per_byte_against_the_paper() -> None:
    # OPT-13B: 24 h^2 FLOPs per token and layer over 4h bytes of K,V = 6h; the normalised input saves 20 h^2 over
    # 2h bytes = 10h. With h = 5120: 30.72 and 51.2 kFLOP/byte; the paper reports 30.5 and 51.0.
    m = get_model("opt-13b")
    assert layer_flops_per_token(m) == 24 * m.hidden**2
    kv, normed = tensor_costs(m)
    assert kv.flops_per_byte == pytest.approx(6 * m.hidden)
    assert normed.flops_per_byte == pytest.approx(10 * m.hidden)
    assert kv.kflops_per_byte == pytest.approx(PAPER_KFLOP_PER_BYTE["kv"], rel=0.01)
    assert normed.kflops_per_byte == pytest.approx(PAPER_KFLOP_PER_BYTE["normed_input"], rel=0.01)
