"""Background-traffic specs for modelled shared tiers: every form parses, every malformed one is a ValueError
naming the form (found by the type check: an extra value became the traffic's name, a fifth a TypeError)."""

from __future__ import annotations

import pytest

from kvstream.sim.devices import Bursty, Periodic, Steady
from kvstream.sim.driver import parse_background


def test_every_form_parses():
    assert parse_background(None) is None and parse_background("none") is None
    st = parse_background("steady:0.4")
    assert isinstance(st, Steady) and st.share == 0.4 and st.name == "steady"
    p = parse_background("periodic:0.6:20:0.5:3")
    assert isinstance(p, Periodic) and (p.share, p.period, p.duty, p.phase) == (0.6, 20.0, 0.5, 3.0)
    b = parse_background("bursty:0.7:3:10:2.0", seed=4)
    assert isinstance(b, Bursty) and (b.share, b.mean_on, b.mean_off) == (0.7, 3.0, 10.0)


@pytest.mark.parametrize("spec", ["steady:0.4:0.5", "periodic:0.6:20", "bursty:0.7:3:10:1.5:9", "steady:x",
                                  "steady:1.5", "steady:nan", "periodic:0.6:0:0.5", "periodic:0.6:20:2",
                                  "bursty:0.7:-3:10", "tsunami:0.5", "steady"])
def test_malformed_specs_name_the_form(spec):
    with pytest.raises(ValueError, match="background traffic"):
        parse_background(spec)
