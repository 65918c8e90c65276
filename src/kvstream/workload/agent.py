"""Coding-agent sessions (SWE-bench-like): long growing contexts, short tool calls, tool-run think times.

An agent session is one task: a system prompt every session shares, the task (issue text, repository map), then
turns. Each turn sends the whole history (every earlier prompt and answer) plus the last tool's output, and
answers with a short tool call. The next turn arrives once the answer has been generated and the tool has run:

    arrival[k+1] = arrival[k] + output[k] * decode_s_per_token + think[k]

with ``think`` the tool's run time (tests, grep, an editor), lognormal. This is an *open-loop* approximation of
a closed loop: the generator does not know the server's TTFT, so it assumes a fixed decode speed; a turn
that queues longer than its think time can arrive before its predecessor finished (its history is then
recomputed, as a real server would if the previous KV was not yet stored).

New sessions start as a Poisson process at ``session_rate``. Prefix-chained chunk ids (the ``Request``
contract): a turn's ids are its predecessor's prompt ids plus fresh ids for the rest, and the shared system
prompt has the same ids in every session.

Invariant: the same :class:`AgentSpec` and seed give the same requests; the unlimited-cache chunk hit rate
(:func:`kvstream.workload.synthetic.reuse_rate`) of the ``"swe-bench"`` preset is in the papers' 80-96 %
(``tests/unit/test_sim_paper_figures.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstream.workload.request import CHUNK_TOKENS, Request
from kvstream.workload.synthetic import LengthDist

__all__ = ["AgentSpec", "agent_sessions", "AGENT_PRESETS"]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSpec:
    """Every knob of an agent workload (see the module docstring)."""

    n_sessions: int = 200
    session_rate: float = 0.2  # new tasks per second (Poisson)
    turns: LengthDist = LengthDist(mean=20, cv=0.5, lo=2, hi=80)  # turns per task
    system_prompt_tokens: int = 2048  # shared by every session
    task: LengthDist = LengthDist(mean=4096, cv=0.5, lo=512, hi=16384)  # issue + repository context
    tool_output: LengthDist = LengthDist(mean=1000, cv=1.2, lo=16, hi=8192)  # new prompt tokens per later turn
    output: LengthDist = LengthDist(mean=150, cv=0.8, lo=8, hi=1024)  # the tool call / reasoning
    think_mean_s: float = 15.0  # tool run time, lognormal
    think_cv: float = 1.5
    decode_s_per_token: float = 0.03  # assumed generation speed (open-loop stand-in for the answer's time)
    max_prompt_tokens: int = 128 * 1024  # a session ends before its prompt would pass this

    def __post_init__(self) -> None:
        if self.n_sessions < 0 or self.session_rate <= 0:
            raise ValueError("n_sessions must be >= 0 and session_rate positive")
        if self.think_mean_s < 0 or self.think_cv < 0 or self.decode_s_per_token < 0:
            raise ValueError("think times and decode speed must be >= 0")

    def replace(self, **kw: Any) -> "AgentSpec":
        return dataclasses.replace(self, **kw)


def _lognormal(rng: np.random.Generator, mean: float, cv: float, n: int) -> np.ndarray:
    if mean == 0 or cv == 0:
        return np.full(n, float(mean))
    s2 = math.log1p(cv * cv)
    return rng.lognormal(math.log(mean) - s2 / 2, math.sqrt(s2), n)


def agent_sessions(spec: AgentSpec, seed: int = 0) -> list[Request]:
    """The requests of ``spec`` in arrival order (ids 0..n-1; ties keep session order)."""
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / spec.session_rate, spec.n_sessions))
    sys_n = spec.system_prompt_tokens // CHUNK_TOKENS
    sys_ids: list[Any] = [("sys", i) for i in range(sys_n)]
    raw: list[tuple[float, int, int, int, int, tuple[Any, ...], int | None, int]] = []
    for s in range(spec.n_sessions):
        n_turns = int(spec.turns.sample(rng, 1)[0])
        task = int(spec.task.sample(rng, 1)[0])
        tools = spec.tool_output.sample(rng, n_turns)
        outs = spec.output.sample(rng, n_turns)
        think = _lognormal(rng, spec.think_mean_s, spec.think_cv, n_turns)
        t = float(starts[s])
        prompt = spec.system_prompt_tokens + task
        ids: list[Any] = []
        prev_out: int | None = None
        prev_prompt = 0
        for k in range(n_turns):
            if k:
                prompt += int(outs[k - 1]) + int(tools[k])
                t += int(outs[k - 1]) * spec.decode_s_per_token + float(think[k - 1])
            if prompt > spec.max_prompt_tokens:
                break
            n_chunks = prompt // CHUNK_TOKENS
            # Keep the predecessor's full chunks (the shared system prompt's first), then fresh ids.
            keep = ids if k else sys_ids[:n_chunks]
            ids = list(keep[:n_chunks]) + [(s, j) for j in range(len(keep), n_chunks)]
            new = prompt - (min(spec.system_prompt_tokens, prompt) if k == 0 else prev_prompt)
            raw.append((t, s, k, prompt, int(outs[k]), tuple(ids), prev_out, new))
            prev_out, prev_prompt = int(outs[k]), prompt
    raw.sort(key=lambda x: (x[0], x[1], x[2]))
    return [Request(request_id=i, arrival=t, input_tokens=p, output_tokens=o, chunk_ids=c, session=s, round_index=k,
                    prev_answer_tokens=pa, new_tokens=nw)
            for i, (t, s, k, p, o, c, pa, nw) in enumerate(raw)]


AGENT_PRESETS: dict[str, AgentSpec] = {
    # SWE-bench-like coding agent at paper scale: a 2k system prompt, 4k task context, ~20 turns of 1,000-token
    # tool outputs and 150-token tool calls (final contexts of 15-40k tokens), tool runs of ~15 s.
    "swe-bench": AgentSpec(),
}
