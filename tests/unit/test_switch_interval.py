"""Python's thread switch interval: lowered only when asked, never raised, and a bad value is named at open.

The figure that makes the setting worth having (a busy Python thread halved a tier's reads at 5 ms) is a
benchmark: ``bench/gil_handoff.py``, BENCHMARKS.md. Here: what the setting does to the interpreter.
"""

from __future__ import annotations

import sys

import pytest

from kvstream.config import StoreConfig
from kvstream.errors import ConfigError
from kvstream.io.switch_interval import lower_switch_interval


def test_it_lowers_the_interval_and_says_what_it_replaced():
    sys.setswitchinterval(0.005)
    assert lower_switch_interval(0.001, by="test") == pytest.approx(0.005)
    assert sys.getswitchinterval() == pytest.approx(0.001)


def test_it_never_raises_an_interval_the_host_set_lower():
    sys.setswitchinterval(0.0005)
    assert lower_switch_interval(0.001, by="test") is None
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("bad", [0.0, -0.001, 1e-6, 0.5, float("nan"), float("inf"), True, "1ms"])
def test_a_value_out_of_range_is_refused_and_the_interval_kept(bad):
    sys.setswitchinterval(0.005)
    with pytest.raises(ValueError, match="test"):
        lower_switch_interval(bad, by="test")
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_the_store_option_is_checked_at_open_naming_the_field(tmp_path):
    tiers = [{"name": "local", "path": str(tmp_path / "t"), "capacity_bytes": 1 << 30}]
    with pytest.raises(ConfigError, match="python_switch_interval_s"):
        StoreConfig.from_dict({"tiers": tiers, "python_switch_interval_s": 5})
    assert StoreConfig.from_dict({"tiers": tiers}).python_switch_interval_s is None
    assert StoreConfig.from_dict({"tiers": tiers, "python_switch_interval_s": 0.001}).python_switch_interval_s == 0.001

