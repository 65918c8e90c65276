"""Model shapes: the few numbers of a decoder-only transformer that size its KV cache and its compute.

A plain data module. Every entry is copied from the model's published configuration file (``config.json`` in
the model's public repository; the source is named beside each entry), so that KV sizes, the compact-tensor
decision (:mod:`kvstream.compact`) and the modelled GPU all work from the same figures.

    >>> m = get_model("opt-13b")
    >>> kv_bytes_per_token(m)          # 2 (K and V) x 40 layers x 40 heads x 128 dims x 2 bytes
    819200

Conventions:
- ``intermediate`` is the width of the MLP's hidden layer as it is computed (for SwiGLU models, the width of
  each of the gate / up projections). Qwen (v1) configs store twice that number (``intermediate_size`` 22016
  for an 11008-wide MLP); the table holds the effective width and says so.
- ``max_positions`` is the context the model was trained for (``max_position_embeddings`` / ``seq_length``).
- ``attention`` is derived, never stored: MHA when every query head has its own K/V head, MQA with one K/V
  head, GQA in between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelShape", "MODELS", "get_model", "kv_bytes_per_token", "known_models"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """The shape of one decoder-only transformer. Invariant: ``heads % kv_heads == 0``."""

    name: str  # lookup name, lower case, e.g. "opt-13b"
    hf_id: str  # the public repository whose config.json the numbers come from
    layers: int  # decoder blocks
    hidden: int  # residual stream width (d_model)
    heads: int  # query heads
    kv_heads: int  # key/value heads (== heads for MHA)
    head_dim: int  # dimensions per head
    intermediate: int  # MLP hidden width as computed (see the module docstring for Qwen v1)
    vocab: int  # vocabulary size (embedding rows)
    max_positions: int  # trained context length in tokens
    norm: Literal["layernorm", "rmsnorm"]  # the norm applied to each block's input (pre-norm in all entries)
    positions: Literal["learned", "rope"]  # learned absolute positions (added once) or rotary embeddings per layer
    mlp: Literal["relu", "gelu", "swiglu"]  # swiglu has three weight matrices per block, the others two
    rope_theta: float | None = None  # rotary base; None for learned positions

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab", "max_positions"):
            if getattr(self, field) <= 0:
                raise ValueError(f"model {self.name!r}: {field} must be positive")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: {self.heads} query heads not a multiple of {self.kv_heads} KV heads")
        if (self.positions == "rope") != (self.rope_theta is not None):
            raise ValueError(f"model {self.name!r}: rope_theta must be given exactly when positions == 'rope'")

    @property
    def attention(self) -> Literal["MHA", "GQA", "MQA"]:
        if self.kv_heads == self.heads:
            return "MHA"
        return "MQA" if self.kv_heads == 1 else "GQA"

    @property
    def is_mha(self) -> bool:
        return self.kv_heads == self.heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices in one MLP block (gate, up, down for SwiGLU; up, down otherwise)."""
        return 3 if self.mlp == "swiglu" else 2


def kv_bytes_per_token(model: ModelShape, dtype_bytes: int = 2) -> int:
    """Bytes of K and V that one token leaves in the cache, over all layers: ``2 x layers x kv_heads x head_dim x dtype``."""
    if dtype_bytes <= 0:
        raise ValueError(f"dtype_bytes must be positive, got {dtype_bytes}")
    return 2 * model.layers * model.kv_heads * model.head_dim * dtype_bytes


def _opt(name: str, layers: int, hidden: int, heads: int) -> ModelShape:
    # OPT: pre-LayerNorm, learned absolute positions (offset 2, added to the embeddings), ReLU MLP of 4 x hidden,
    # biases everywhere, 2048-token context.
    return ModelShape(
        name=name, hf_id=f"facebook/{name}", layers=layers, hidden=hidden, heads=heads, kv_heads=heads,
        head_dim=hidden // heads, intermediate=4 * hidden, vocab=50272, max_positions=2048,
        norm="layernorm", positions="learned", mlp="relu",
    )  # fmt: skip


_TABLE: tuple[ModelShape, ...] = (
    # --- OPT (MHA), Bidaw's evaluation models. facebook/opt-*/config.json: hidden_size, num_hidden_layers,
    # num_attention_heads, ffn_dim (= 4 x hidden), vocab_size 50272, max_position_embeddings 2048.
    _opt("opt-6.7b", 32, 4096, 32),
    _opt("opt-13b", 40, 5120, 40),
    _opt("opt-30b", 48, 7168, 56),
    # --- Qwen v1 (MHA), Bidaw's other evaluation models. Qwen/Qwen-7B and Qwen/Qwen-14B config.json:
    # intermediate_size 22016 / 27392 is twice the SwiGLU width (the code halves it), rotary_emb_base 10000,
    # seq_length 8192 (7B) and 2048 (14B).
    ModelShape(name="qwen-7b", hf_id="Qwen/Qwen-7B", layers=32, hidden=4096, heads=32, kv_heads=32, head_dim=128,
               intermediate=11008, vocab=151936, max_positions=8192, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=10000.0),
    ModelShape(name="qwen-14b", hf_id="Qwen/Qwen-14B", layers=40, hidden=5120, heads=40, kv_heads=40, head_dim=128,
               intermediate=13696, vocab=152064, max_positions=2048, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=10000.0),
    # --- Llama-2 (MHA, Llama-style): small MHA references. meta-llama/Llama-2-*-hf config.json.
    ModelShape(name="llama-2-7b", hf_id="meta-llama/Llama-2-7b-hf", layers=32, hidden=4096, heads=32, kv_heads=32,
               head_dim=128, intermediate=11008, vocab=32000, max_positions=4096, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=10000.0),
    ModelShape(name="llama-2-13b", hf_id="meta-llama/Llama-2-13b-hf", layers=40, hidden=5120, heads=40, kv_heads=40,
               head_dim=128, intermediate=13824, vocab=32000, max_positions=4096, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=10000.0),
    # --- Llama-style GQA, the 14B-110B class of KVStream's evaluation (the paper names sizes, not checkpoints;
    # these are the common public models of each size). Qwen/Qwen2.5-14B, Qwen/Qwen2.5-32B, Qwen/Qwen1.5-110B and
    # meta-llama/Meta-Llama-3-70B config.json (max_position_embeddings as published for the base models).
    # --- Small GQA models for runs on a small machine (replay defaults, tests). Qwen/Qwen2.5-0.5B and
    # Qwen/Qwen2.5-1.5B config.json.
    ModelShape(name="qwen2.5-0.5b", hf_id="Qwen/Qwen2.5-0.5B", layers=24, hidden=896, heads=14, kv_heads=2,
               head_dim=64, intermediate=4864, vocab=151936, max_positions=32768, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=1000000.0),
    ModelShape(name="qwen2.5-1.5b", hf_id="Qwen/Qwen2.5-1.5B", layers=28, hidden=1536, heads=12, kv_heads=2,
               head_dim=128, intermediate=8960, vocab=151936, max_positions=131072, norm="rmsnorm", positions="rope",
               mlp="swiglu", rope_theta=1000000.0),
    ModelShape(name="qwen2.5-14b", hf_id="Qwen/Qwen2.5-14B", layers=48, hidden=5120, heads=40, kv_heads=8,
               head_dim=128, intermediate=13824, vocab=152064, max_positions=131072, norm="rmsnorm",
               positions="rope", mlp="swiglu", rope_theta=1000000.0),
    ModelShape(name="qwen2.5-32b", hf_id="Qwen/Qwen2.5-32B", layers=64, hidden=5120, heads=40, kv_heads=8,
               head_dim=128, intermediate=27648, vocab=152064, max_positions=131072, norm="rmsnorm",
               positions="rope", mlp="swiglu", rope_theta=1000000.0),
    ModelShape(name="llama-3-70b", hf_id="meta-llama/Meta-Llama-3-70B", layers=80, hidden=8192, heads=64, kv_heads=8,
               head_dim=128, intermediate=28672, vocab=128256, max_positions=8192, norm="rmsnorm",
               positions="rope", mlp="swiglu", rope_theta=500000.0),
    ModelShape(name="qwen1.5-110b", hf_id="Qwen/Qwen1.5-110B", layers=80, hidden=8192, heads=64, kv_heads=8,
               head_dim=128, intermediate=49152, vocab=152064, max_positions=32768, norm="rmsnorm",
               positions="rope", mlp="swiglu", rope_theta=1000000.0),
)  # fmt: skip

MODELS: dict[str, ModelShape] = {m.name: m for m in _TABLE}  # name -> shape; treat as read-only


def known_models() -> list[str]:
    return sorted(MODELS)


def get_model(name: str) -> ModelShape:
    """The shape named ``name`` (case-insensitive). Raises ``KeyError`` listing the known names."""
    try:
        return MODELS[name.strip().lower()]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(known_models())}") from None
