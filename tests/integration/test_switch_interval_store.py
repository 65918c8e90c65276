"""A store opened with ``python_switch_interval_s`` lowers Python's switch interval; one opened without leaves it.

(The setting's rules are unit-tested in tests/unit/test_switch_interval.py; why it exists: bench/gil_handoff.py.)
"""

from __future__ import annotations

import sys

import pytest

from kvstream.store import open_store


def test_a_store_opened_with_the_option_lowers_the_interval_and_one_without_leaves_it(disk_tmp):
    sys.setswitchinterval(0.005)
    tiers = [{"name": "local", "path": str(disk_tmp / "a"), "capacity_bytes": 64 << 20}]
    with open_store({"tiers": tiers, "memory_bytes": 16 << 20, "create_dirs": True}):
        assert sys.getswitchinterval() == pytest.approx(0.005)
    tiers = [{"name": "local", "path": str(disk_tmp / "b"), "capacity_bytes": 64 << 20}]
    with open_store({"tiers": tiers, "memory_bytes": 16 << 20, "create_dirs": True, "python_switch_interval_s": 0.002}):
        assert sys.getswitchinterval() == pytest.approx(0.002)
