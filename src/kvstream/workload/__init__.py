"""Workloads: one request type, trace readers (Mooncake jsonl, Bidaw conversation txt) and a synthetic generator."""

from kvstream.workload.mooncake import iter_mooncake, read_mooncake
from kvstream.workload.request import CHUNK_TOKENS, Request
from kvstream.workload.synthetic import PRESETS, LengthDist, SyntheticSpec, generate, preset, reuse_rate

__all__ = [
    "CHUNK_TOKENS",
    "Request",
    "read_mooncake",
    "iter_mooncake",
    "SyntheticSpec",
    "LengthDist",
    "generate",
    "preset",
    "PRESETS",
    "reuse_rate",
]
