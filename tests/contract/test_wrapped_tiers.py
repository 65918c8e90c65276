"""The tier contract's conformance suite (kvstream.testing.tier) on a DirectoryTier whose I/O engine is wrapped:
throttled (kvstream.io.throttle, as replay's emulated shared tier) and fault-injecting (kvstream.io.faults, as the
fault drills): stalls on every ring, and EIO, short reads and flipped bits on reads. The wrappers sit under the
tier, on its rings: the contract must hold through them (a faulty read fails cleanly, never returns other bytes).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstream.config import TierConfig
from kvstream.io.engine import IOEngine, make_engine
from kvstream.io.faults import Fault, FaultPlan, FaultyEngine
from kvstream.io.throttle import ThrottledEngine
from kvstream.testing.tier import CHUNK, TierConformance, key, payload
from kvstream.testing.tier_io import Failed, read_chunk
from kvstream.tiers.files import DirectoryTier


class _Wrapped(TierConformance):
    def engine(self) -> IOEngine:
        raise NotImplementedError

    @pytest.fixture
    def tier_root(self, disk_tmp: Path) -> Path:
        return disk_tmp / "tier"

    def open_tier(self, root: Path, *, node: str = "node-a") -> DirectoryTier:
        cfg = TierConfig(name="t", path=str(root), capacity_bytes=self.capacity_chunks * CHUNK, require_mount=False)
        return DirectoryTier(cfg, index=0, engine=self.engine(), node_id=node, create=True, field_prefix="tiers[0]")


class TestThrottledDirectoryTier(_Wrapped):
    def engine(self) -> IOEngine:
        return ThrottledEngine(make_engine("threads"), {"t-*": 50e6})  # 50 MB/s: 0.25 ms per chunk


class TestFaultyDirectoryTier(_Wrapped):
    read_faults = True

    def engine(self) -> IOEngine:
        plan = FaultPlan([Fault(kind="delay", rings="t-*", p=0.2, delay_s=0.01),
                          Fault(kind="eio", rings="t-r", p=0.1), Fault(kind="short", rings="t-r", p=0.1),
                          Fault(kind="flip", rings="t-r", p=0.1)], seed=22)
        return FaultyEngine(make_engine("threads"), plan)

    def test_the_faults_are_real(self, tier: DirectoryTier) -> None:
        """Not a conformance test: the wrapper does inject (some of 60 reads fail), and each failure is clean."""
        assert self.put(tier, key(0), payload(0)) is True
        outcomes = [read_chunk(tier, key(0)) for _ in range(60)]
        assert any(isinstance(o, Failed) for o in outcomes), "no read failed: the faults are not injected"
        assert all(o == payload(0) or isinstance(o, Failed) for o in outcomes)
