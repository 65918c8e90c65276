"""Compact tensors: K and V rebuilt from the cached normalised layer input equal the model's own K and V.

Two tiny randomly initialised decoders are built here in plain torch, written independently of
:mod:`kvstream.compact` (their rotary embedding uses complex multiplication, not the "rotate half" formula):
a Llama-style one (RMSNorm, RoPE, SwiGLU, no biases) and an OPT-style one (LayerNorm, learned positions added
to the embeddings, biases, ReLU MLP). Each forward pass records, per layer, the normalised input and the K and
V the attention actually used. No weights are downloaded.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

from kvstream.compact import LayerKVProjection, decode_compact, encode_compact, rebuild_kv

pytestmark = pytest.mark.torch

BF16_EPS = 2.0**-7  # relative spacing of bfloat16 numbers (8 bits of mantissa)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope_complex(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding as a complex rotation of (first half, second half) pairs; x: [T, H, D]."""
    d = x.shape[-1]
    half = d // 2
    inv_freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / d)
    rot = torch.polar(torch.ones(len(positions), half, dtype=torch.float64), positions.double()[:, None] * inv_freq)
    z = torch.complex(x[..., :half].double(), x[..., half:].double()) * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1).to(x.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention; q: [T, H, D], k/v: [T, KV, D] (KV heads shared by H / KV query heads)."""
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) / q.shape[-1] ** 0.5
    mask = torch.ones(q.shape[0], q.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v.float()).to(q.dtype)


class _LlamaLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, inter: int, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd, self.theta = heads, kv_heads, hidden // heads, theta
        self.norm1, self.norm2 = _RMSNorm(hidden), _RMSNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.hd, bias=False)
        self.k = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.v = nn.Linear(hidden, kv_heads * self.hd, bias=False)
        self.o = nn.Linear(heads * self.hd, hidden, bias=False)
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, rec: list) -> torch.Tensor:
        x = self.norm1(h)
        t = x.shape[0]
        q = _rope_complex(self.q(x).view(t, self.heads, self.hd), pos, self.theta)
        k = _rope_complex(self.k(x).view(t, self.kv_heads, self.hd), pos, self.theta)
        v = self.v(x).view(t, self.kv_heads, self.hd)
        rec.append((x, k, v))
        h = h + self.o(_attend(q, k, v).reshape(t, -1))
        y = self.norm2(h)
        return h + self.down(nn.functional.silu(self.gate(y)) * self.up(y))

    def projection(self) -> LayerKVProjection:
        return LayerKVProjection.from_linear(self.k, self.v, kv_heads=self.kv_heads, head_dim=self.hd, rope_theta=self.theta)


class _OPTLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, inter: int) -> None:
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        with torch.no_grad():
            for norm in (self.norm1, self.norm2):
                norm.weight.add_(0.1 * torch.randn(hidden))
                norm.bias.add_(0.1 * torch.randn(hidden))
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(hidden, inter), nn.Linear(inter, hidden)

    def forward(self, h: torch.Tensor, pos: torch.Tensor, rec: list) -> torch.Tensor:
        x = self.norm1(h)
        t = x.shape[0]
        q = self.q(x).view(t, self.heads, self.hd)
        k = self.k(x).view(t, self.heads, self.hd)
        v = self.v(x).view(t, self.heads, self.hd)
        rec.append((x, k, v))
        h = h + self.o(_attend(q, k, v).reshape(t, -1))
        return h + self.fc2(nn.functional.relu(self.fc1(self.norm2(h))))

    def projection(self) -> LayerKVProjection:
        return LayerKVProjection.from_linear(self.k, self.v, kv_heads=self.heads, head_dim=self.hd)


class _Model(nn.Module):
    def __init__(self, style: str, *, hidden: int = 64, heads: int = 4, kv_heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.style = style
        self.embed = nn.Embedding(128, hidden)
        if style == "llama":
            self.layers = nn.ModuleList(_LlamaLayer(hidden, heads, kv_heads, 3 * hidden, 10000.0) for _ in range(layers))
        else:
            self.positions = nn.Embedding(64 + 2, hidden)  # OPT's learned positions, offset by 2
            self.layers = nn.ModuleList(_OPTLayer(hidden, heads, 4 * hidden) for _ in range(layers))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> list:
        pos = torch.arange(tokens.shape[0])
        h = self.embed(tokens)
        if self.style == "opt":
            h = h + self.positions(pos + 2)
        rec: list = []
        for layer in self.layers:
            h = layer(h, pos, rec)
        return rec


def _model(style: str, dtype: torch.dtype, **kw: int) -> _Model:
    torch.manual_seed(0)
    return _Model(style, **kw).to(dtype).eval()


@pytest.mark.slow
@pytest.mark.parametrize("style", ["llama", "opt"])
def test_rebuild_matches_in_float32(style: str) -> None:
    model = _model(style, torch.float32)
    tokens = torch.randint(0, 128, (24,))
    rec = model(tokens)
    stored = encode_compact([x for x, _k, _v in rec])
    rebuilt = decode_compact(stored, [layer.projection() for layer in model.layers], torch.arange(24))
    for (_x, k, v), (k2, v2) in zip(rec, rebuilt, strict=True):
        torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v2, v, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("style", ["llama", "opt"])
def test_rebuild_matches_in_bfloat16_to_rounding_and_halves_the_bytes(style: str) -> None:
    model = _model(style, torch.bfloat16)
    tokens = torch.randint(0, 128, (32,))
    rec = model(tokens)
    stored = encode_compact([x for x, _k, _v in rec], dtype=torch.bfloat16)
    assert stored.dtype == torch.bfloat16
    kv_bytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for _x, k, v in rec)
    assert stored.numel() * stored.element_size() * 2 == kv_bytes  # MHA: the normalised input is half of K,V
    rebuilt = decode_compact(stored, [layer.projection() for layer in model.layers], torch.arange(32))
    for (_x, k, v), (k2, v2) in zip(rec, rebuilt, strict=True):
        assert torch.equal(v2, v)  # the same projection of the same input: bit for bit
        err = (k2.float() - k.float()).abs().max().item()
        # K differs only by where the rotary embedding rounds to bf16: within two bf16 steps of the largest value.
        assert err <= 2 * BF16_EPS * k.float().abs().max().item()
        if style == "opt":
            assert torch.equal(k2, k)  # no rotary embedding: exact


def test_rebuild_of_a_slice_uses_its_positions() -> None:
    model = _model("llama", torch.float32)
    rec = model(torch.randint(0, 128, (20,)))
    x, k, v = rec[1]
    proj = model.layers[1].projection()
    k2, v2 = rebuild_kv(x[7:15], proj, torch.arange(7, 15))
    torch.testing.assert_close(k2, k[7:15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2, v[7:15], rtol=1e-5, atol=1e-5)
    k_wrong, _ = rebuild_kv(x[7:15], proj, torch.arange(0, 8))  # positions matter: the wrong ones give another K
    assert not torch.allclose(k_wrong, k[7:15], atol=1e-3)


def test_rebuild_handles_gqa_shapes() -> None:
    model = _model("llama", torch.float32, heads=8, kv_heads=2)
    rec = model(torch.randint(0, 128, (16,)))
    x, k, v = rec[0]
    k2, v2 = rebuild_kv(x, model.layers[0].projection(), torch.arange(16))
    assert k2.shape == (16, 2, 8)
    torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2, v, rtol=1e-5, atol=1e-5)


def test_rebuild_argument_errors() -> None:
    model = _model("llama", torch.float32)
    proj = model.layers[0].projection()
    with pytest.raises(ValueError, match="positions are required"):
        rebuild_kv(torch.zeros(3, 64), proj)
    with pytest.raises(ValueError, match=r"x must be \[tokens, 64\]"):
        rebuild_kv(torch.zeros(3, 32), proj, torch.arange(3))
    with pytest.raises(ValueError, match="layers"):
        decode_compact(torch.zeros(3, 2, 64), [proj], torch.arange(2))


def test_core_package_imports_without_torch() -> None:
    code = (
        "import sys; import kvstream.compact, kvstream.models, kvstream.eviction, kvstream.scheduling;"
        "from kvstream.compact import choose_cached_tensor; from kvstream.models import get_model;"
        "choose_cached_tensor(get_model('opt-13b')); assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
