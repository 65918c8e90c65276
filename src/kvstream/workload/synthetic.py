"""Synthetic workloads with the knobs the papers vary.

- **Burstiness**: inter-arrival gaps form a renewal process with a target coefficient of variation (CV = std /
  mean of the gaps; 0 = evenly spaced, 1 = Poisson, 4.3 = production traffic, 8 = extreme). Gaps are drawn
  from a gamma distribution with shape ``1/CV²`` (CV 1 is exactly exponential). A finite sample's CV scatters
  around the target (for CV 8 the shape is 1/64 and one sample of 2000 gaps can be 20 % off), so by default
  the drawn gaps are *calibrated*: raised to the power ``a`` that makes their sample CV equal the target
  (bisection; ``x ** a`` keeps the order of the gaps and spreads them monotonically in ``a``), then scaled to
  the target mean. ``exact_cv=False`` keeps the raw gamma draw.
- **Correlated bursts** (``arrival="mmpp"``): a two-state Markov-modulated Poisson process with the same target
  CV (:mod:`kvstream.workload.arrivals`): short gaps come in runs, as in production traffic, instead of
  independently as in the gamma renewal process.
- **Reuse rate**: the share of prompt chunks whose (prefix-chained) id already appeared in an earlier
  request, i.e. the hit rate of an unlimited cache, the figure the Mooncake README quotes (0.37 / 0.64) and the
  KVStream paper varies (88 % / 77 % / 4 %). Each request either continues one of the active contexts or
  starts a fresh one; with ``reuse`` set, that choice is made by a feedback rule that keeps the running
  reuse rate at the target (whichever choice leaves the running rate nearer the target wins, ties continue).
  With ``reuse=None`` a context lives for a drawn number of turns.
- **Contexts**: ``mode="session"``: a multi-turn conversation or agent loop, turn ``k`` sends the whole
  history (previous prompt + previous answer) plus new tokens; ``mode="document"``: a document reused by
  several questions, each prompt = document + question (LooGLE-like).
- **Session interleaving**: ``active`` contexts are open at once and each request picks one of them at
  random; 1 = one session's turns back to back, large = many sessions interleave and each turn's history is
  buried under the others' KV (the paper's 1.05x vs 3.12x case).
- **Lengths**: lognormal with a given mean and CV for the context's opening prefix, the new tokens per turn
  and the output; plus an optional system prompt shared by every context.

Only the answer's *length* is modelled: the answer's tokens enter the next turn's prompt as new chunks (a
chunk is cached only once it was part of some prompt, as in the Mooncake traces).

Determinism: the same :class:`SyntheticSpec` and seed give the same requests (one ``numpy`` Generator, drawn
in a fixed order).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvstream.workload.arrivals import calibrate_cv, mmpp_gaps, sample_cv
from kvstream.workload.request import CHUNK_TOKENS, Request

__all__ = [
    "LengthDist",
    "SyntheticSpec",
    "generate",
    "arrival_gaps",
    "sample_cv",
    "reuse_rate",
    "PRESETS",
    "preset",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthDist:
    """Token counts drawn lognormally with this mean and CV, rounded and clipped to ``[lo, hi]``."""

    mean: float  # tokens
    cv: float = 0.0  # std / mean; 0 = always ``mean``
    lo: int = 1
    hi: int = 1 << 20

    def __post_init__(self) -> None:
        if self.mean < 0 or self.cv < 0 or self.lo < 0 or self.hi < self.lo:
            raise ValueError(f"bad LengthDist {self}")

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.cv == 0 or self.mean == 0:
            x = np.full(n, self.mean)
        else:
            s2 = math.log1p(self.cv**2)
            x = rng.lognormal(math.log(self.mean) - s2 / 2, math.sqrt(s2), n)
        out: np.ndarray = np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticSpec:
    """Every knob of a synthetic workload; see the module docstring for their meaning."""

    n_requests: int = 1000
    rate: float = 1.0  # mean arrivals per second
    cv: float = 1.0  # target CV of inter-arrival gaps
    exact_cv: bool = True  # calibrate the drawn gaps to the exact target CV
    arrival: str = "gamma"  # "gamma": renewal process (independent gaps) | "mmpp": correlated bursts (arrivals.py)
    mode: str = "session"  # "session" (history grows each turn) | "document" (prefix fixed, new question each time)
    reuse: float | None = 0.8  # target unlimited-cache chunk hit rate; None = contexts live for ``turns`` turns
    active: int = 16  # contexts open at once (session interleaving degree)
    turns: LengthDist = LengthDist(mean=8, cv=0.5)  # turns per context when ``reuse`` is None
    shared_prefix_tokens: int = 0  # system prompt common to every context
    prefix: LengthDist = LengthDist(mean=2048, cv=0.5)  # a context's own opening (document, task description)
    new_tokens: LengthDist = LengthDist(mean=512, cv=1.0)  # new prompt tokens per request (query, tool output)
    output: LengthDist = LengthDist(mean=256, cv=1.0)  # output tokens per request
    max_prompt_tokens: int = 128 * 1024  # a turn that would exceed this starts a fresh context instead

    def __post_init__(self) -> None:
        if self.n_requests < 0:
            raise ValueError("n_requests must be >= 0")
        if self.rate <= 0:
            raise ValueError(f"rate must be positive, got {self.rate}")
        if self.cv < 0:
            raise ValueError(f"cv must be >= 0, got {self.cv}")
        if self.arrival not in ("gamma", "mmpp"):
            raise ValueError(f"arrival must be 'gamma' or 'mmpp', got {self.arrival!r}")
        if self.arrival == "mmpp" and self.cv <= 1.0:
            raise ValueError(f"an MMPP's gaps are burstier than Poisson's: cv must be > 1, got {self.cv}")
        if self.mode not in ("session", "document"):
            raise ValueError(f"mode must be 'session' or 'document', got {self.mode!r}")
        if self.reuse is not None and not 0.0 <= self.reuse <= 1.0:
            raise ValueError(f"reuse must be in [0, 1], got {self.reuse}")
        if self.active < 1:
            raise ValueError(f"active must be >= 1, got {self.active}")

    def replace(self, **kw: Any) -> "SyntheticSpec":
        return dataclasses.replace(self, **kw)


# -- arrivals ---------------------------------------------------------------------------------------------
# sample_cv and calibrate_cv live in kvstream.workload.arrivals (shared with the MMPP generator).
def arrival_gaps(rng: np.random.Generator, n: int, *, mean: float, cv: float, exact: bool = True) -> np.ndarray:
    """``n`` inter-arrival gaps with the given mean and CV (gamma renewal process; see module docstring)."""
    if n <= 0:
        return np.zeros(0)
    if cv == 0:
        return np.full(n, mean)
    k = 1.0 / cv**2
    g = rng.gamma(k, mean / k, n)
    if exact and n >= 2:
        g = calibrate_cv(g, cv)
    m = g.mean()
    return g * (mean / m) if m > 0 else np.full(n, mean)


# -- contexts ---------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Context:
    cid: int  # context (session / document) id
    prefix_ids: list[int]  # chunk ids of the last prompt (session) or of the document prefix (document)
    prompt_tokens: int  # tokens of the last prompt (session) or of the document (document)
    turn: int = 0  # requests served so far
    turns_left: int = 0  # only used when reuse is None
    last_output: int = 0
    fresh_ids: list[int] = field(default_factory=list)


def generate(spec: SyntheticSpec, seed: int | np.random.Generator = 0) -> list[Request]:
    """The requests of ``spec``, in arrival order, ids 0..n-1. Same spec and seed → same list."""
    rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
    n = spec.n_requests
    gaps = arrival_gaps(rng, max(n - 1, 0), mean=1.0 / spec.rate, cv=spec.cv, exact=spec.exact_cv)
    if spec.arrival == "mmpp":
        # The gamma gaps above are still drawn (and dropped) so every later draw, hence every session and
        # length, is the same as the renewal workload's with this seed: only the timing differs. The MMPP
        # draws from a child stream, which leaves ``rng`` itself untouched.
        gaps = mmpp_gaps(rng.spawn(1)[0], max(n - 1, 0), mean=1.0 / spec.rate, cv=spec.cv, exact=spec.exact_cv)
    arrivals = np.concatenate(([0.0], np.cumsum(gaps))) if n else np.zeros(0)
    new_tok = spec.new_tokens.sample(rng, n)
    out_tok = spec.output.sample(rng, n)
    picks = rng.integers(0, spec.active, n)
    # Fresh contexts draw their lengths from their own streams, so the arrival and per-request draws above
    # do not shift when the reuse rule starts more or fewer contexts.
    ctx_rng = np.random.default_rng(rng.integers(0, 2**63))

    next_id = 1
    shared_n = spec.shared_prefix_tokens // CHUNK_TOKENS
    shared_ids = list(range(next_id, next_id + shared_n))
    next_id += shared_n
    shared_seen = False
    seen_hits = 0  # running reused chunks
    seen_total = 0  # running prompt chunks
    slots: list[_Context | None] = [None] * spec.active
    n_ctx = 0
    reqs: list[Request] = []

    def new_context() -> _Context:
        nonlocal n_ctx
        pre = int(spec.prefix.sample(ctx_rng, 1)[0])
        turns = int(spec.turns.sample(ctx_rng, 1)[0]) if spec.reuse is None else 0
        c = _Context(cid=n_ctx, prefix_ids=[], prompt_tokens=spec.shared_prefix_tokens + pre, turns_left=max(turns, 1))
        n_ctx += 1
        return c

    # The next fresh context is drawn ahead, so the reuse rule can weigh its real length.
    pending = new_context()

    for i in range(n):
        slot = int(picks[i])
        ctx = slots[slot]
        q = int(new_tok[i])
        # What continuing would look like.
        cont_ok = ctx is not None
        if cont_ok:
            assert ctx is not None
            if spec.mode == "session":
                cont_prompt = ctx.prompt_tokens + ctx.last_output + q
            else:
                cont_prompt = ctx.prompt_tokens + q
            cont_hit = len(ctx.prefix_ids)
            cont_ok = cont_prompt <= spec.max_prompt_tokens and (spec.reuse is not None or ctx.turns_left > 0)
        if spec.reuse is None:
            fresh = not cont_ok
        elif not cont_ok:
            fresh = True
        else:
            # Feedback rule: compare the running reuse after either choice with the target.
            fresh_prompt = pending.prompt_tokens + q
            fresh_hit = min(shared_n, fresh_prompt // CHUNK_TOKENS) if shared_seen else 0
            r_cont = (seen_hits + cont_hit) / max(seen_total + cont_prompt // CHUNK_TOKENS, 1)
            r_fresh = (seen_hits + fresh_hit) / max(seen_total + fresh_prompt // CHUNK_TOKENS, 1)
            fresh = abs(r_fresh - spec.reuse) < abs(r_cont - spec.reuse)
        if fresh:
            ctx, pending = pending, new_context()
            slots[slot] = ctx
            prompt = ctx.prompt_tokens + q
            reused_ids = shared_ids[: prompt // CHUNK_TOKENS]
            new_tokens = prompt - min(spec.shared_prefix_tokens, prompt)
            prev_answer = None
        else:
            assert ctx is not None
            prompt = cont_prompt
            reused_ids = ctx.prefix_ids
            new_tokens = prompt - ctx.prompt_tokens
            prev_answer = ctx.last_output
        n_chunks = prompt // CHUNK_TOKENS
        n_new = n_chunks - len(reused_ids)
        ids = list(reused_ids[:n_chunks]) + list(range(next_id, next_id + max(n_new, 0)))
        next_id += max(n_new, 0)
        # Continuing: every id of the context's last prompt (or document) was seen. Fresh: only the shared
        # system prompt can hit, and only once some earlier request carried it.
        hits = len(reused_ids) if not fresh else (len(reused_ids) if shared_seen else 0)
        if fresh and reused_ids:
            shared_seen = True
        seen_hits += hits
        seen_total += n_chunks
        reqs.append(
            Request(
                request_id=i,
                arrival=float(arrivals[i]),
                input_tokens=prompt,
                output_tokens=int(out_tok[i]),
                chunk_ids=tuple(ids),
                session=ctx.cid,
                round_index=ctx.turn,
                prev_answer_tokens=prev_answer,
                new_tokens=new_tokens,
            )
        )
        # Advance the context.
        ctx.turn += 1
        ctx.turns_left -= 1
        ctx.last_output = int(out_tok[i])
        if spec.mode == "session":
            ctx.prefix_ids = ids
            ctx.prompt_tokens = prompt
        elif fresh:
            # The document's own chunks: those fully inside the shared prefix + document (not the question).
            doc_chunks = (prompt - q) // CHUNK_TOKENS
            ctx.prefix_ids = ids[:doc_chunks]
            ctx.prompt_tokens = prompt - q
    return reqs


def reuse_rate(requests: list[Request]) -> float:
    """Share of prompt chunks whose id appeared in an earlier request (unlimited-cache chunk hit rate)."""
    seen: set[Hashable] = set()
    hit = total = 0
    for r in requests:
        for c in r.chunk_ids:
            total += 1
            if c in seen:
                hit += 1
        seen.update(r.chunk_ids)
    return hit / total if total else 0.0


# -- presets ----------------------------------------------------------------------------------------------
PRESETS: dict[str, SyntheticSpec] = {
    # A multi-turn coding agent sized for a small machine (2 cores, one disk): short answers (tool calls),
    # long growing histories, many interleaved sessions, production-like burstiness.
    "agent-small": SyntheticSpec(
        n_requests=120,
        rate=2.0,
        cv=4.3,
        mode="session",
        reuse=0.85,
        active=12,
        shared_prefix_tokens=1024,
        prefix=LengthDist(mean=2048, cv=0.5, lo=256, hi=8192),
        new_tokens=LengthDist(mean=384, cv=1.0, lo=16, hi=4096),
        output=LengthDist(mean=64, cv=0.8, lo=4, hi=512),
        max_prompt_tokens=24 * 1024,
    ),
    # Long agent sessions (a coding agent: a 2k-token system prompt, histories growing from 5k to 14-18k tokens,
    # short tool calls and tool outputs, ~88 % of prompt chunks reused), sized so that a 14B-class model's KV (48 MiB chunks) is read
    # in loads of hundreds of MB, the sessions' KV (about 11 GiB) far exceeds host memory, and a replay of four
    # systems still takes minutes on a small machine: replay's default (kvstream.commands.replay says why, and
    # which model and GPU it is paired with). Not fewer requests to shorten the demo: 42 keep the same sessions'
    # KV (242 chunks) but write it over 51 s instead of 59, and on this VM's disk the runs then took 57-64 s
    # with TTFTs 1.5x higher (2026-12-06, one round each of kvstream and lmcache-like).
    "agent-long": SyntheticSpec(
        n_requests=48,
        rate=0.8,
        cv=2.0,
        mode="session",
        reuse=0.9,
        active=6,
        shared_prefix_tokens=2048,
        prefix=LengthDist(mean=6144, cv=0.5, lo=2048, hi=16384),
        new_tokens=LengthDist(mean=512, cv=1.0, lo=64, hi=4096),
        output=LengthDist(mean=48, cv=0.8, lo=8, hi=512),
        max_prompt_tokens=24 * 1024,
    ),
    # The same shape at paper scale (SWE-bench-like agent sessions).
    "agent": SyntheticSpec(
        n_requests=2000,
        rate=1.0,
        cv=4.3,
        mode="session",
        reuse=0.88,
        active=64,
        shared_prefix_tokens=2048,
        prefix=LengthDist(mean=8192, cv=0.6, lo=512, hi=32768),
        new_tokens=LengthDist(mean=1024, cv=1.0, lo=16, hi=16384),
        output=LengthDist(mean=128, cv=1.0, lo=4, hi=2048),
        max_prompt_tokens=128 * 1024,
    ),
    # Long documents reused by several questions (LooGLE-like offline set).
    "documents": SyntheticSpec(
        n_requests=1000,
        rate=1.0,
        cv=1.0,
        mode="document",
        reuse=0.85,
        active=64,
        prefix=LengthDist(mean=24 * 1024, cv=0.5, lo=2048, hi=120 * 1024),
        new_tokens=LengthDist(mean=64, cv=0.5, lo=8, hi=512),
        output=LengthDist(mean=32, cv=0.5, lo=4, hi=256),
    ),
    # Chat with a code-generation flavour (the paper's Bailian trace shape): moderate prompts and answers.
    "chat": SyntheticSpec(
        n_requests=2000,
        rate=2.0,
        cv=4.3,
        mode="session",
        reuse=0.8,
        active=128,
        shared_prefix_tokens=512,
        prefix=LengthDist(mean=4096, cv=0.8, lo=256, hi=32768),
        new_tokens=LengthDist(mean=512, cv=1.0, lo=8, hi=8192),
        output=LengthDist(mean=256, cv=1.0, lo=4, hi=2048),
    ),
}


def preset(name: str, **overrides: Any) -> SyntheticSpec:
    """A named spec with fields replaced, e.g. ``preset("agent", cv=8.0, reuse=0.04)``."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown workload preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return base.replace(**overrides) if overrides else base
