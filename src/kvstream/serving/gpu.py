"""A modelled GPU node: how long a forward step takes, and how much KV its HBM holds.

Cost model (per step, one tensor-parallel group of ``tp`` GPUs)::

    linear  = 2 * P_layers * T                       # FLOPs of the weight matmuls, T = tokens in the step
    attn    = 4 * L * H_q * d * sum_i (n_i * c_i + n_i * (n_i + 1) / 2)   # QK^T and AV: the quadratic term
    bytes   = W + sum_decodes(ctx_j) * kv_bytes_per_token                # weights once, decode KV reads
    t_step  = max(linear / (tp * peak * mfu) + attn / (tp * peak * attn_eff),  bytes / (tp * hbm_bw * bw_eff))
              + step_overhead + decode_seq_overhead * n_decodes

(``n_i`` new tokens of request ``i`` on top of ``c_i`` cached ones.) A prefill-heavy step is compute bound, a
decode step memory bound; the per-step and per-sequence overheads stand for launch, all-reduce latency,
sampling and scheduling, which a roofline misses.

Sources of the constants
------------------------
Peak figures are the vendors' datasheet numbers: H100 SXM 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3, 80 GB;
A100 SXM 80 GB 312 TFLOP/s, 2.039 TB/s; A800 80 GB PCIe = A100 PCIe (312 TFLOP/s, 1.935 TB/s).
Host link: PCIe Gen5 x16 ~ 50 GB/s usable per GPU (H100), Gen4 x16 ~ 25 GB/s (A100/A800).

Calibration (the test ``tests/unit/test_serving_gpu.py`` checks the model against every point below):

* **H100 x4 (TP=4), end to end** — a public vLLM measurement note ("MFU in inference": 4x H100 SXM over
  NVLink, Llama-3.3-70B in BF16, batches of 2083-token prompts): prefill of 1 / 2 / 4 / 8 / 16 / 32 prompts
  took 0.189 / 0.350 / 0.651 / 1.296 / 2.985 / 5.853 s; decode of 1 / 32 sequences ran at 56.1 / 1403.6
  tokens/s (17.8 / 22.8 ms a step, ~590 tokens of context). With ``bw_eff`` set to 0.85 the two decode points
  give ``step_overhead`` 5.3 ms and ``decode_seq_overhead`` 0.145 ms exactly; a least-squares fit of ``mfu``
  to the six prefill points then gives 0.425 (every point within 8 %).
* **A100 x4 (TP=4)** — no end-to-end TP=4 prefill measurement was found; Vidur's published per-operator
  profiles (microsoft/vidur ``data/profiling/compute/{a100,h100}/meta-llama/Llama-2-70b-hf/mlp.csv``, 4096
  tokens, TP=4) put the linear layers at 0.70 of peak on A100 and 0.64 on H100. The A100 ``mfu`` is the H100
  end-to-end fit scaled by that ratio (0.425 * 0.70 / 0.64 = 0.465), i.e. the same share of time outside the
  GEMMs (attention, all-reduce, norms). Overheads are taken from the H100 fit.
* **Attention** — FlashAttention-2 runs the forward pass at roughly 50-70 % of A100 peak and at about 35-40 %
  of H100 peak (the FlashAttention-2 and -3 papers' benchmarks): ``attn_eff`` 0.55 (A100), 0.38 (H100).
* **Cross-check with the KVStream paper** (not a fit): for the 70B model on H100 x4 this model recomputes a
  256-token chunk at a 24k-token context in ~32 ms; reading its 80 MiB at the paper's 6 GB/s NVMe rate takes
  ~14 ms, so reading is ~2.3x faster than recomputing, against the paper's "up to 2.2x on large models"; for
  the 14B model the two are even (8.1 vs 8.4 ms), the paper's "recompute is cheap" end.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GpuSpec",
    "ModelShape",
    "CostModel",
    "GPU_PROFILES",
    "get_gpu",
    "get_model_shape",
    "MODEL_ALIASES",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class GpuSpec:
    """One GPU type and the efficiencies fitted for it (per GPU; a node multiplies by ``tp``)."""

    name: str
    peak_flops: float  # dense BF16 tensor FLOP/s per GPU (datasheet)
    hbm_bw: float  # HBM bytes/s per GPU (datasheet)
    hbm_bytes: float  # HBM capacity per GPU
    host_link_bw: float  # host <-> GPU bytes/s per GPU, usable (PCIe)
    mfu: float  # achieved share of peak on the linear layers, end to end (fitted)
    attn_eff: float  # achieved share of peak in the attention kernel
    bw_eff: float  # achieved share of HBM bandwidth in decode
    step_overhead_s: float  # per forward step: launches, all-reduce latency, scheduling
    decode_seq_overhead_s: float  # per decoding sequence in a step: sampling, per-sequence kernels
    mem_util: float = 0.90  # share of HBM the engine may use (vLLM's gpu_memory_utilization)
    activation_reserve_bytes: float = 4e9  # per GPU, kept for activations and CUDA graphs


GPU_PROFILES: dict[str, GpuSpec] = {
    "h100": GpuSpec(
        name="H100-SXM-80GB",
        peak_flops=989.4e12,
        hbm_bw=3.35e12,
        hbm_bytes=80e9,
        host_link_bw=50e9,
        mfu=0.425,
        attn_eff=0.38,
        bw_eff=0.85,
        step_overhead_s=0.00527,
        decode_seq_overhead_s=0.000145,
    ),
    "a100": GpuSpec(
        name="A100-SXM-80GB",
        peak_flops=312e12,
        hbm_bw=2.039e12,
        hbm_bytes=80e9,
        host_link_bw=25e9,
        mfu=0.465,
        attn_eff=0.55,
        bw_eff=0.85,
        step_overhead_s=0.00527,
        decode_seq_overhead_s=0.000145,
    ),
    # Bidaw's testbed: one A800 80 GB over PCIe Gen4 (same compute and HBM as an A100 PCIe).
    "a800": GpuSpec(
        name="A800-PCIe-80GB",
        peak_flops=312e12,
        hbm_bw=1.935e12,
        hbm_bytes=80e9,
        host_link_bw=25e9,
        mfu=0.465,
        attn_eff=0.55,
        bw_eff=0.85,
        step_overhead_s=0.004,
        decode_seq_overhead_s=0.000145,
    ),
}


def get_gpu(name: str) -> GpuSpec:
    try:
        return GPU_PROFILES[name.lower()]
    except KeyError:
        raise KeyError(f"unknown GPU profile {name!r}; known: {', '.join(sorted(GPU_PROFILES))}") from None


# -- model shapes -----------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """What the cost model needs of a model (a view of :class:`kvstream.models.ModelShape` plus the dtype).

    ``kv_bytes_per_token`` covers all layers' K and V (same formula as ``kvstream.models.kv_bytes_per_token``).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs plain (2)
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def layer_params(self) -> int:
        """Weights of the transformer blocks (the matmuls every token pays for)."""
        q = self.hidden * self.heads * self.head_dim
        kv = 2 * self.hidden * self.kv_heads * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        mlp = (3 if self.gated_mlp else 2) * self.hidden * self.intermediate
        return self.layers * (q + kv + o + mlp)

    @property
    def weight_bytes(self) -> int:
        """All weights, embeddings and LM head included (untied), as read once per decode step."""
        return (self.layer_params + 2 * self.vocab * self.hidden) * self.dtype_bytes

    def chunk_bytes(self, chunk_tokens: int = 256) -> int:
        return self.kv_bytes_per_token * chunk_tokens


# Small GQA models for runs on a small machine (replay's default, tests); not (yet) in kvstream.models.
# Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-1.5B config.json. Everything else comes from kvstream.models.
_EXTRA: dict[str, ModelShape] = {
    s.name: s
    for s in (
        ModelShape(name="qwen2.5-0.5b", layers=24, hidden=896, heads=14, kv_heads=2, head_dim=64, intermediate=4864, vocab=151936),
        ModelShape(name="qwen2.5-1.5b", layers=28, hidden=1536, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936),
    )
}
MODEL_ALIASES = {"14b": "qwen2.5-14b", "32b": "qwen2.5-32b", "70b": "llama-3-70b", "110b": "qwen1.5-110b"}


def get_model_shape(name: str) -> ModelShape:
    """A model by name or alias (``14b``, ``70b``, ``opt-13b``, ...) from :mod:`kvstream.models`."""
    from kvstream import models

    key = MODEL_ALIASES.get(name.strip().lower(), name.strip().lower())
    if key in _EXTRA:
        return _EXTRA[key]
    try:
        m = models.get_model(key)
    except KeyError:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(models.known_models() + list(_EXTRA)))} "
                       f"(aliases {', '.join(MODEL_ALIASES)})") from None
    return ModelShape(name=m.name, layers=m.layers, hidden=m.hidden, heads=m.heads, kv_heads=m.kv_heads,
                      head_dim=m.head_dim, intermediate=m.intermediate, vocab=m.vocab,
                      gated_mlp=m.mlp_matrices == 3)


# -- the cost model ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class CostModel:
    """Step times of one model on one TP group. Pure arithmetic: no state, no clock."""

    gpu: GpuSpec
    model: ModelShape
    tp: int = 4

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")

    # capacities
    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def kv_capacity_bytes(self) -> float:
        """HBM left for KV after weights and reserves, over the whole TP group."""
        total = self.tp * (self.gpu.hbm_bytes * self.gpu.mem_util - self.gpu.activation_reserve_bytes)
        return max(total - self.model.weight_bytes, 0.0)

    @property
    def host_link_bw(self) -> float:
        """Host memory -> HBM bytes/s for the whole group (each GPU loads its own shard)."""
        return self.tp * self.gpu.host_link_bw

    # step time
    def _compute_s(self, linear_flops: float, attn_flops: float) -> float:
        p = self.tp * self.gpu.peak_flops
        return linear_flops / (p * self.gpu.mfu) + attn_flops / (p * self.gpu.attn_eff)

    def attn_flops(self, new: int, cached: int) -> float:
        m = self.model
        return 4.0 * m.layers * m.heads * m.head_dim * (new * cached + new * (new + 1) / 2)

    def step_time(self, prefills: Sequence[tuple[int, int]] = (), decode_contexts: Sequence[int] = ()) -> float:
        """Seconds for one step: ``prefills`` = (new tokens, cached tokens) per request, plus one token per
        decoding sequence with the given context lengths. An empty step costs 0."""
        if not prefills and not decode_contexts:
            return 0.0
        m = self.model
        tokens = sum(n for n, _ in prefills) + len(decode_contexts)
        linear = 2.0 * m.layer_params * tokens
        attn = sum(self.attn_flops(n, c) for n, c in prefills) + sum(self.attn_flops(1, c) for c in decode_contexts)
        kv_read = (sum(c for _, c in prefills) + sum(decode_contexts)) * m.kv_bytes_per_token
        mem_s = (m.weight_bytes + kv_read) / (self.tp * self.gpu.hbm_bw * self.gpu.bw_eff)
        return (
            max(self._compute_s(linear, attn), mem_s)
            + self.gpu.step_overhead_s
            + self.gpu.decode_seq_overhead_s * len(decode_contexts)
        )

    def step_time_agg(self, prefills: Sequence[tuple[int, int]], n_decodes: int, sum_decode_ctx: int) -> float:
        """:meth:`step_time` with the decodes given as a count and a context sum (the serving loop's hot path)."""
        if not prefills and not n_decodes:
            return 0.0
        m = self.model
        tokens = n_decodes
        attn = 0.0
        kv = sum_decode_ctx
        for n, c in prefills:
            tokens += n
            attn += self.attn_flops(n, c)
            kv += c
        # attn_flops(1, c) summed over decodes = 4 L H d (sum c + n)
        attn += 4.0 * m.layers * m.heads * m.head_dim * (sum_decode_ctx + n_decodes)
        mem_s = (m.weight_bytes + kv * m.kv_bytes_per_token) / (self.tp * self.gpu.hbm_bw * self.gpu.bw_eff)
        comp_s = self._compute_s(2.0 * m.layer_params * tokens, attn)
        return max(comp_s, mem_s) + self.gpu.step_overhead_s + self.gpu.decode_seq_overhead_s * n_decodes

    def prefill_time(self, new: int, cached: int = 0) -> float:
        return self.step_time([(new, cached)])

    def decode_time(self, contexts: Sequence[int]) -> float:
        return self.step_time((), contexts)

    def recompute_chunk_s(self, context: int, chunk_tokens: int = 256) -> float:
        """Marginal compute time of one more chunk at a given context (no step overhead)."""
        m = self.model
        return self._compute_s(2.0 * m.layer_params * chunk_tokens, self.attn_flops(chunk_tokens, context))

    def host_load_s(self, nbytes: float) -> float:
        return nbytes / self.host_link_bw if nbytes > 0 else 0.0

    def max_batch_tokens(self) -> int:
        """A token budget per step in the spirit of vLLM's max_num_batched_tokens (chunked prefill off)."""
        return 1 << 16

    def describe(self) -> str:
        return (
            f"{self.model.name} on {self.tp}x {self.gpu.name}: {self.kv_bytes_per_token / 1024:.0f} KiB/token, "
            f"{self.model.chunk_bytes() / 2**20:.0f} MiB/chunk, KV capacity {self.kv_capacity_bytes / 1e9:.0f} GB"
        )


def fit_summary(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(max, mean) relative error of (predicted, measured) pairs."""
    errs = [abs(p - m) / m for p, m in points]
    return max(errs), math.fsum(errs) / len(errs)
