"""Workloads: one request type, trace readers (Mooncake jsonl, Bidaw conversation txt) and a synthetic generator."""

from kvstream.workload.request import Request

__all__ = ["Request"]
