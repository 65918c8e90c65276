"""The tier contract's conformance suite (kvstream.testing.tier) on the simulator's modelled tier: membership,
first wins and capacity apply; the byte-level, crash, pin and shared-node tests skip (capability modelled)."""

from __future__ import annotations

from pathlib import Path

from kvstream.sim.devices import Device
from kvstream.sim.engine import EventLoop
from kvstream.sim.storage import SimTier
from kvstream.testing.tier import CHUNK, TierConformance


class TestSimTier(TierConformance):
    def open_tier(self, root: Path, *, node: str = "node-a") -> SimTier:
        dev = Device(EventLoop(), "sim", read_bw=1e9, write_bw=1e9)
        tier = SimTier(name="sim", device=dev, capacity_chunks=self.capacity_chunks)
        tier.setup(CHUNK)
        return tier
