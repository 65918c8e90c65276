"""Storage-efficient history tensors (Bidaw §4.3): for MHA models, cache each layer's normalised input instead of
its K and V, and rebuild ``K = x W_k (+ b_k)`` (then the rotary embedding) and ``V = x W_v (+ b_v)`` on load.

Why it pays: per token and layer, K and V take ``2 x kv_heads x head_dim`` values; the normalised input ``x``
(the hidden state after the block's input norm) takes ``hidden`` values. For MHA ``kv_heads x head_dim ==
hidden``, so ``x`` is half the size, and rebuilding K and V costs two of the block's matrix products — a small
part of what caching saves (the whole forward pass of the history tokens). For GQA/MQA, K and V are already
smaller than ``x``; they are kept.

The decision is arithmetic on the model's shape (no torch): *saved FLOPs per byte* of each candidate tensor,
Bidaw's cost-efficiency measure. Per token, a layer's forward pass is ``2 x (q + k + v + o projections + MLP)``
multiply-adds (``2 x params`` FLOPs, attention scores over the context left out, as for any per-token figure);
caching K,V saves all of it (the history tokens need no forward pass), caching ``x`` saves all of it but the
K and V projections. For OPT-13B this gives 30.7 (K,V) and 51.2 (normalised input) kFLOP per byte — the paper
reports 30.5 and 51.0 — and 2.0x less space. :func:`choose_cached_tensor` picks the higher figure.

The rebuild (:func:`rebuild_kv`, needs torch, imported lazily) covers the two families in :mod:`kvstream.models`:

- Llama / Qwen style: RMSNorm input, no K/V bias (Qwen v1 has one: pass it), rotary embedding applied to K after
  the projection, "rotate half" convention (first half of each head paired with the second half), as in the
  Hugging Face implementations;
- OPT style: LayerNorm input, K/V biases, learned absolute positions already added to the residual stream before
  the first layer (so ``x`` carries them and the rebuild applies no position encoding).

Storage layout of the compact tensor for one prefix: ``[layers, tokens, hidden]`` in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from kvstream.models import ModelShape, kv_bytes_per_token

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor as _Tensor  # for annotations inside functions, where ``torch`` is a local

__all__ = [
    "TensorCost",
    "CacheChoice",
    "PAPER_KFLOP_PER_BYTE",
    "layer_flops_per_token",
    "tensor_costs",
    "choose_cached_tensor",
    "apply_rotary",
    "LayerKVProjection",
    "rebuild_kv",
    "encode_compact",
    "decode_compact",
]

# Bidaw's reported cost efficiency (saved FLOPs per byte of cache, read as kFLOP/byte = GFLOP/MB).
PAPER_KFLOP_PER_BYTE: dict[str, float] = {"kv": 30.5, "normed_input": 51.0}

TensorName = Literal["kv", "normed_input"]


def layer_flops_per_token(model: ModelShape) -> int:
    """FLOPs of one decoder block's matrix products for one token: ``2 x`` its weight count (biases and norms left out)."""
    q = model.hidden * model.heads * model.head_dim
    kv = 2 * model.hidden * model.kv_heads * model.head_dim
    o = model.heads * model.head_dim * model.hidden
    mlp = model.mlp_matrices * model.hidden * model.intermediate
    return 2 * (q + kv + o + mlp)


def _kv_projection_flops_per_token(model: ModelShape) -> int:
    return 2 * 2 * model.hidden * model.kv_heads * model.head_dim


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorCost:
    """One candidate history tensor of a model, per token over all layers."""

    tensor: TensorName
    bytes_per_token: int
    saved_flops_per_token: int  # forward-pass FLOPs a cached token spares, net of any rebuild

    @property
    def flops_per_byte(self) -> float:
        return self.saved_flops_per_token / self.bytes_per_token

    @property
    def kflops_per_byte(self) -> float:
        return self.flops_per_byte / 1000.0


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheChoice:
    """What to cache for a model, and why."""

    model: str
    attention: str  # MHA / GQA / MQA
    tensor: TensorName  # the chosen tensor
    kv: TensorCost
    normed_input: TensorCost

    @property
    def chosen(self) -> TensorCost:
        return self.kv if self.tensor == "kv" else self.normed_input

    @property
    def bytes_per_token(self) -> int:
        return self.chosen.bytes_per_token

    @property
    def space_ratio(self) -> float:
        """K,V bytes over the chosen tensor's bytes (1.0 when K,V is kept)."""
        return self.kv.bytes_per_token / self.chosen.bytes_per_token


def tensor_costs(model: ModelShape, *, dtype_bytes: int = 2) -> tuple[TensorCost, TensorCost]:
    """(K,V cost, normalised-input cost) for ``model``; see the module docstring for the counting."""
    forward = model.layers * layer_flops_per_token(model)
    kv = TensorCost(tensor="kv", bytes_per_token=kv_bytes_per_token(model, dtype_bytes), saved_flops_per_token=forward)
    normed = TensorCost(
        tensor="normed_input",
        bytes_per_token=model.layers * model.hidden * dtype_bytes,
        saved_flops_per_token=forward - model.layers * _kv_projection_flops_per_token(model),
    )
    return kv, normed


def choose_cached_tensor(model: ModelShape, *, dtype_bytes: int = 2) -> CacheChoice:
    """Cache the normalised input when it saves more FLOPs per byte than K,V *and* is smaller; else K,V.

    MHA models get the normalised input (half the bytes); GQA/MQA models keep K,V (already smaller than ``x``).
    """
    kv, normed = tensor_costs(model, dtype_bytes=dtype_bytes)
    better = normed.flops_per_byte > kv.flops_per_byte and normed.bytes_per_token < kv.bytes_per_token
    return CacheChoice(model=model.name, attention=model.attention, tensor="normed_input" if better else "kv",
                       kv=kv, normed_input=normed)  # fmt: skip


# ---------------------------------------------------------------------------------------------------------------
# Rebuild (torch)


def _torch() -> object:
    try:
        import torch
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("kvstream.compact rebuild needs torch (install the 'torch' extra)") from exc
    return torch


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, *, theta: float) -> torch.Tensor:
    """Rotary embedding, "rotate half" convention, on ``x`` of shape ``[tokens, heads, head_dim]``.

    Angles are computed in float32 (as reference implementations do) and the result is cast back to ``x``'s dtype.
    """
    torch = _torch()
    d = x.shape[-1]
    if d % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {d}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # type: ignore[attr-defined]
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # type: ignore[attr-defined]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :].to(x.dtype)  # type: ignore[attr-defined]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :].to(x.dtype)  # type: ignore[attr-defined]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # type: ignore[attr-defined]
    out: _Tensor = x * cos + rotated * sin
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerKVProjection:
    """One layer's K and V projections, in ``torch.nn.Linear`` layout (``[out_features, in_features]``)."""

    w_k: torch.Tensor  # [kv_heads * head_dim, hidden]
    w_v: torch.Tensor  # [kv_heads * head_dim, hidden]
    b_k: torch.Tensor | None = None  # [kv_heads * head_dim]
    b_v: torch.Tensor | None = None
    kv_heads: int = 1
    head_dim: int = 1
    rope_theta: float | None = None  # None: no rotary embedding (learned positions, OPT)

    def __post_init__(self) -> None:
        out = self.kv_heads * self.head_dim
        if tuple(self.w_k.shape) != tuple(self.w_v.shape) or self.w_k.shape[0] != out:
            shapes = f"{tuple(self.w_k.shape)}, {tuple(self.w_v.shape)}"
            raise ValueError(f"K/V weights must both be [{out}, hidden], got {shapes}")

    @classmethod
    def from_linear(cls, k_proj: object, v_proj: object, *, kv_heads: int, head_dim: int,
                    rope_theta: float | None = None) -> LayerKVProjection:  # fmt: skip
        """From two ``torch.nn.Linear`` modules (their weights are shared, not copied)."""
        return cls(w_k=k_proj.weight, w_v=v_proj.weight, b_k=k_proj.bias, b_v=v_proj.bias,  # type: ignore[attr-defined]
                   kv_heads=kv_heads, head_dim=head_dim, rope_theta=rope_theta)  # fmt: skip


def rebuild_kv(
    x: torch.Tensor, proj: LayerKVProjection, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer from its normalised input ``x`` (``[tokens, hidden]``), each ``[tokens, kv_heads, head_dim]``.

    ``positions`` (``[tokens]``, integer) are the tokens' positions in the sequence; needed with a rotary embedding.
    Computed in ``x``'s dtype, like the model's own projection, so a bf16 model's K,V come back to bf16 rounding.
    """
    torch = _torch()
    if x.dim() != 2 or x.shape[1] != proj.w_k.shape[1]:
        raise ValueError(f"x must be [tokens, {proj.w_k.shape[1]}], got {tuple(x.shape)}")
    linear = torch.nn.functional.linear  # type: ignore[attr-defined]
    k = linear(x, proj.w_k.to(x.dtype), None if proj.b_k is None else proj.b_k.to(x.dtype))
    v = linear(x, proj.w_v.to(x.dtype), None if proj.b_v is None else proj.b_v.to(x.dtype))
    k = k.view(x.shape[0], proj.kv_heads, proj.head_dim)
    v = v.view(x.shape[0], proj.kv_heads, proj.head_dim)
    if proj.rope_theta is not None:
        if positions is None:
            raise ValueError("positions are required to rebuild K with a rotary embedding")
        k = apply_rotary(k, positions, theta=proj.rope_theta)
    return k, v


def encode_compact(normed_inputs: Sequence[torch.Tensor], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stack per-layer normalised inputs (each ``[tokens, hidden]``) into the stored ``[layers, tokens, hidden]``."""
    torch = _torch()
    out: _Tensor = torch.stack(list(normed_inputs), dim=0)  # type: ignore[attr-defined]
    return out.to(dtype).contiguous() if dtype is not None else out.contiguous()


def decode_compact(stored: torch.Tensor, layers: Sequence[LayerKVProjection],
                   positions: torch.Tensor | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """Rebuild every layer's (K, V) from a stored ``[layers, tokens, hidden]`` tensor."""
    if stored.shape[0] != len(layers):
        raise ValueError(f"stored tensor has {stored.shape[0]} layers, {len(layers)} projections given")
    return [rebuild_kv(stored[i], proj, positions) for i, proj in enumerate(layers)]
