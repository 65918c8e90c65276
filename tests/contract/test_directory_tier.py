"""The tier contract's conformance suite (kvstream.testing.tier) on DirectoryTier: a node-local tier (io_uring
where it works, and the thread pool), one with buffered I/O, and a shared one (two nodes on one folder)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstream.config import TierConfig
from kvstream.io.engine import available_engines, make_engine
from kvstream.testing.tier import CHUNK, TierConformance
from kvstream.tiers.files import DirectoryTier


class _Directory(TierConformance):
    engine = "threads"
    shared = False
    direct_io = "auto"

    @pytest.fixture
    def tier_root(self, disk_tmp: Path) -> Path:
        return disk_tmp / "tier"  # on a real disk (O_DIRECT), not tmpfs

    def open_tier(self, root: Path, *, node: str = "node-a") -> DirectoryTier:
        cfg = TierConfig(name="t", path=str(root), capacity_bytes=self.capacity_chunks * CHUNK, shared=self.shared,
                         direct_io=self.direct_io, require_mount=False)
        return DirectoryTier(cfg, index=0, engine=make_engine(self.engine), node_id=node, create=True,
                             field_prefix="tiers[0]")


class TestLocalDirectoryTier(_Directory):
    pass


@pytest.mark.skipif(available_engines()["uring"] is not None, reason=f"io_uring: {available_engines()['uring']}")
class TestLocalDirectoryTierUring(_Directory):
    engine = "uring"


class TestBufferedDirectoryTier(_Directory):
    direct_io = "off"


class TestSharedDirectoryTier(_Directory):
    shared = True
