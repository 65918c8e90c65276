"""ShareGPT-style conversations with Poisson timestamps (Bidaw's public workload, B9).

ShareGPT has conversations but no timestamps, so Bidaw's authors drew them from a Poisson process. Here:
users arrive as a Poisson process at ``user_rate``; each user's conversation has a lognormal number of rounds
(mean 5.7, the paper's figure for ShareGPT); each later round arrives an *exponential* gap after the previous
one, with the same mean whatever the previous answer's length. That last point is what the paper blames for
the smaller gain on ShareGPT: the answer length no longer predicts the reuse distance, so hit-potential
eviction has nothing to learn. Query and answer lengths follow ShareGPT's shape (short questions, longer
answers); a conversation ends before its prompt plus answer would pass the model's context (OPT: 2048).

Records come out as :class:`~kvstream.workload.bidaw.BidawRecord` (one per round, time-ordered), so the
Bidaw reader's :func:`~kvstream.workload.bidaw.to_requests` turns them into requests with per-user
prefix-chained chunk ids, exactly as for the industrial trace.

Invariants: the same :class:`ShareGPTSpec` and seed give the same records; a user's round r+1 arrives strictly
after its round r; no request's prompt plus answer passes ``context_tokens``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstream.workload.bidaw import BidawRecord, to_requests
from kvstream.workload.request import Request
from kvstream.workload.synthetic import LengthDist

__all__ = ["ShareGPTSpec", "sharegpt_records", "sharegpt_requests"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShareGPTSpec:
    """Every knob of a ShareGPT-like workload (see the module docstring)."""

    n_users: int = 600
    user_rate: float = 1.0  # new conversations per second (Poisson)
    rounds: LengthDist = LengthDist(mean=5.7, cv=0.8, lo=1, hi=40)
    query: LengthDist = LengthDist(mean=70, cv=1.5, lo=4, hi=1024)
    response: LengthDist = LengthDist(mean=200, cv=0.9, lo=4, hi=1024)
    gap_mean_s: float = 60.0  # mean time between a user's rounds (exponential, independent of the answer)
    context_tokens: int = 2048  # the model's context: a round whose prompt + answer would pass it is not sent

    def __post_init__(self) -> None:
        if self.n_users < 0 or self.user_rate <= 0 or self.gap_mean_s <= 0 or self.context_tokens < 1:
            raise ValueError(f"bad ShareGPTSpec {self}")

    def replace(self, **kw: Any) -> "ShareGPTSpec":
        return dataclasses.replace(self, **kw)


def sharegpt_records(spec: ShareGPTSpec, seed: int = 0) -> list[BidawRecord]:
    """One record per round, sorted by time (ties: user, then round)."""
    rng = np.random.default_rng(seed)
    starts = np.cumsum(rng.exponential(1.0 / spec.user_rate, spec.n_users))
    recs: list[BidawRecord] = []
    for u in range(spec.n_users):
        n = int(spec.rounds.sample(rng, 1)[0])
        qs = spec.query.sample(rng, n)
        rs = spec.response.sample(rng, n)
        gaps = rng.exponential(spec.gap_mean_s, n)
        t = float(starts[u])
        hist = 0
        for k in range(n):
            if k:
                t += float(gaps[k])
            q, r = int(qs[k]), int(rs[k])
            if hist + q + r > spec.context_tokens:
                break
            recs.append(BidawRecord(user_id=u, time=t, query_tokens=q, response_tokens=r, round_index=k))
            hist += q + r
    recs.sort(key=lambda x: (x.time, x.user_id, x.round_index))
    return recs


def sharegpt_requests(spec: ShareGPTSpec, seed: int = 0) -> list[Request]:
    return list(to_requests(sharegpt_records(spec, seed)))
