"""The cost model against the published measurements it was calibrated on (see kvstream/serving/gpu.py)."""

from __future__ import annotations

import pytest

from kvstream.serving.gpu import CostModel, get_gpu, get_model_shape

# Public vLLM measurement note "MFU in inference": 4x H100 SXM (NVLink), Llama-3.3-70B BF16.
# Prefill of B prompts of 2083 tokens: elapsed seconds.
H100_70B_PREFILL = [(1, 0.189), (2, 0.350), (4, 0.651), (8, 1.296), (16, 2.985), (32, 5.853)]
# Decode: B sequences (138-token prompts, ~450 tokens generated on average): seconds per step.
H100_70B_DECODE = [(1, 1 / 56.15), (32, 32 / 1403.57)]


@pytest.fixture
def h100_70b() -> CostModel:
    return CostModel(get_gpu("h100"), get_model_shape("70b"), 4)


@pytest.mark.parametrize("batch, measured", H100_70B_PREFILL)
def test_h100_prefill_matches_measurements(h100_70b, batch, measured):
    assert h100_70b.step_time([(2083, 0)] * batch) == pytest.approx(measured, rel=0.08)


@pytest.mark.parametrize("batch, measured", H100_70B_DECODE)
def test_h100_decode_matches_measurements(h100_70b, batch, measured):
    assert h100_70b.decode_time([138 + 450] * batch) == pytest.approx(measured, rel=0.03)


def test_vidur_gemm_efficiency_ratio_sets_a100():
    # Vidur's per-operator profiles (Llama-2-70B, 4096 tokens, TP=4): linear layers at 0.70 of peak on A100,
    # 0.64 on H100; the A100 end-to-end MFU is the H100 fit scaled by that ratio.
    assert get_gpu("a100").mfu == pytest.approx(get_gpu("h100").mfu * 0.70 / 0.64, rel=0.01)


def test_kv_bytes_per_token_and_chunk_sizes():
    # DESIGN.md: a 14B GQA chunk is 48 MiB, a 70B one 80 MiB.
    assert get_model_shape("14b").chunk_bytes() == 48 << 20
    assert get_model_shape("70b").chunk_bytes() == 80 << 20
    assert get_model_shape("32b").kv_bytes_per_token == 2 * 64 * 8 * 128 * 2
    assert get_model_shape("110b").kv_bytes_per_token == 2 * 80 * 8 * 128 * 2
    # MHA models: K and V of every head
    assert get_model_shape("opt-13b").kv_bytes_per_token == 2 * 40 * 5120 * 2
    assert get_model_shape("opt-6.7b").kv_bytes_per_token == 2 * 32 * 4096 * 2
    assert get_model_shape("opt-30b").kv_bytes_per_token == 2 * 48 * 7168 * 2


def test_reading_beats_recompute_more_for_big_models():
    # The paper: recompute cost grows with depth faster than KV bytes; reading wins up to 2.2x on large models.
    ratios = {}
    for name in ("14b", "32b", "70b", "110b"):
        cm = CostModel(get_gpu("h100"), get_model_shape(name), 4)
        ratios[name] = cm.recompute_chunk_s(24_000) / (cm.model.chunk_bytes() / 6e9)
    assert ratios["14b"] < ratios["32b"] < ratios["70b"] < ratios["110b"]
    assert 0.8 < ratios["14b"] < 1.3
    assert 1.8 < ratios["70b"] < 2.8


def test_attention_term_is_quadratic(h100_70b):
    a1 = h100_70b.attn_flops(4096, 0)
    a2 = h100_70b.attn_flops(8192, 0)
    assert a2 / a1 == pytest.approx(4.0, rel=0.01)
    # cached context adds n * c
    assert h100_70b.attn_flops(100, 10_000) > 100 * h100_70b.attn_flops(1, 9_999) * 0.99


def test_step_time_agg_equals_step_time(h100_70b):
    pre = [(300, 5000), (1000, 0)]
    dec = [100, 2000, 30000]
    assert h100_70b.step_time_agg(pre, len(dec), sum(dec)) == pytest.approx(h100_70b.step_time(pre, dec))
    assert h100_70b.step_time() == 0.0


def test_capacities_are_plausible():
    # ~140 GB for KV on a 4x80 GB node after a 70B model's weights (the paper's figure)
    cm = CostModel(get_gpu("h100"), get_model_shape("70b"), 4)
    assert 110e9 < cm.kv_capacity_bytes < 160e9
    assert CostModel(get_gpu("a800"), get_model_shape("opt-13b"), 1).kv_capacity_bytes > 30e9
