"""The tier contract's conformance suite (kvstream.testing.tier) on DirectoryTier: a node-local tier (io_uring
where it works, and the thread pool), one with buffered I/O, and a shared one (two nodes on one folder).

Mutation checks (done when the suite was written; each rule broken alone, the named tests fail):
- publish by ``rename`` instead of ``link`` (replaces): the first-publish-wins, lost-republish and racing
  publishers tests;
- ``recheck.read_size`` not capped by the capacity: the file-that-lies-about-its-size test;
- no regular-file check in ``_open_regular`` (buffered I/O: O_DIRECT refuses a FIFO by itself): the FIFO test;
- ``_list_orphan`` listing a dead writer's temporary without checking that its link won: the killed-writer test;
- ``_delete_file`` emptying the file before unlinking it: the open-descriptor and racing-readers tests;
- ``reserve`` not counting reservations: the reserve/unreserve test;
- pins: ``hold`` leaving the chunk in the policy *and* ``_take_victim`` not skipping pinned keys: the pinned-chunk
  test (each of the two protections alone is enough: removing one leaves it passing);
- ``SimTier.publish`` without its first-wins check: the first-publish-wins and lost-republish tests
  (``test_sim_tier.py``);
- the state machine (``test_matches_the_model``) fails on its own with publish replacing, with ``drop`` not giving
  back the chunk's bytes, and (``SimTier``) with ``fit`` evicting the newest chunk instead of the policy's victim.
"""

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
