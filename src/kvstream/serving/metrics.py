"""What a serving run measured: one record per request and per step, and the summary every driver prints.

TTFT = first token time - arrival (the first token is out when the step that ran the request's prefill ends).
Queueing time = time from arrival until the request's KV load or compute first starts.
Throughput = completed requests (and tokens) per second of makespan (first arrival to last completion).
SLO attainment = share of requests whose TTFT is at most the target.
Read time per step = how long a step waited for its blocking KV loads (0 for steps that read nothing), and,
for background (prefetch) loads, how long each load took.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["RequestRecord", "StepRecord", "RunMetrics", "summarize", "percentile"]


@dataclass(slots=True)
class RequestRecord:
    request_id: int
    arrival: float
    input_tokens: int
    output_tokens: int
    chunks: int  # full prompt chunks
    hbm_chunks: int = 0  # chunks found in HBM
    host_chunks: int = 0  # chunks loaded from host memory
    disk_chunks: int = 0  # chunks loaded from the disk tiers
    recomputed_tokens: int = 0  # prompt tokens computed (missed or partial-chunk)
    computed_chunks: int = 0  # stored chunks the GPU recomputed during the load instead (compute joins the meeting)
    started: float = math.nan  # first load or compute start
    load_s: float = 0.0  # time in KV loads on its behalf (blocking or background)
    first_token: float = math.nan
    finished: float = math.nan

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def queue_s(self) -> float:
        return self.started - self.arrival


@dataclass(slots=True)
class StepRecord:
    start: float  # when the step was planned (load start if it loaded)
    load_s: float  # blocking KV load time before compute
    compute_s: float  # modelled forward time (incl. host->GPU transfer)
    prefills: int
    decodes: int
    load_bytes: int  # bytes the blocking load brought from host memory and disks


def percentile(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if len(x) else math.nan


@dataclass
class RunMetrics:
    """Everything one run produced; :func:`summarize` turns it into the table's row."""

    requests: list[RequestRecord] = field(default_factory=list)
    steps: list[StepRecord] = field(default_factory=list)
    queue_samples: list[tuple[float, int]] = field(default_factory=list)  # (time, requests waiting)
    background_loads: list[float] = field(default_factory=list)  # duration of each prefetch load
    storage: dict[str, Any] = field(default_factory=dict)  # backend stats: bytes per tier, write amplification
    tier_series: list[tuple[float, dict[str, int]]] = field(default_factory=list)  # (time, cumulative bytes per tier)
    counters: dict[str, int] = field(default_factory=dict)  # rare events worth reporting (oversize requests, ...)


def summarize(m: RunMetrics, *, slo_s: float = 1.0) -> dict[str, Any]:
    done = [r for r in m.requests if not math.isnan(r.first_token)]
    ttft = np.array([r.ttft for r in done])
    queue = np.array([r.queue_s for r in done if not math.isnan(r.started)])
    finished = [r for r in m.requests if not math.isnan(r.finished)]
    t0 = min((r.arrival for r in m.requests), default=0.0)
    t1 = max((r.finished for r in finished), default=t0)
    span = max(t1 - t0, 1e-9)
    load_steps = [s for s in m.steps if s.load_s > 0]
    # Time-weighted mean queue length.
    qlen = 0.0
    if len(m.queue_samples) >= 2:
        ts = np.array([t for t, _ in m.queue_samples])
        qs = np.array([q for _, q in m.queue_samples], dtype=float)
        dt = np.diff(ts)
        qlen = float((qs[:-1] * dt).sum() / dt.sum()) if dt.sum() > 0 else float(qs.mean())
    chunks = sum(r.chunks for r in done) or 1
    out = {
        "requests": len(m.requests),
        "completed": len(finished),
        "ttft_mean_s": float(ttft.mean()) if len(ttft) else math.nan,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p90_s": percentile(ttft, 90),
        "ttft_p99_s": percentile(ttft, 99),
        "queue_mean_s": float(queue.mean()) if len(queue) else math.nan,
        "queue_len_mean": qlen,
        "throughput_rps": len(finished) / span,
        "throughput_tok_s": sum(r.input_tokens + r.output_tokens for r in finished) / span,
        "makespan_s": span,
        "slo_s": slo_s,
        "slo_attainment": float((ttft <= slo_s).mean()) if len(ttft) else math.nan,
        "steps": len(m.steps),
        "read_time_per_step_s": float(np.mean([s.load_s for s in load_steps])) if load_steps else 0.0,
        "read_time_total_s": float(sum(s.load_s for s in m.steps)) + float(sum(m.background_loads)),
        "background_load_mean_s": float(np.mean(m.background_loads)) if m.background_loads else 0.0,
        "hit_hbm": sum(r.hbm_chunks for r in done) / chunks,
        "hit_host": sum(r.host_chunks for r in done) / chunks,
        "hit_disk": sum(r.disk_chunks for r in done) / chunks,
    }
    out.update({f"storage_{k}": v for k, v in m.storage.items()})
    out.update(m.counters)
    return out
