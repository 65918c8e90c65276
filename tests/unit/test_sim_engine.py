"""The event loop's one ordering key, and the modelled devices."""

from __future__ import annotations

import numpy as np
import pytest

from kvstream.sim.devices import READ, WRITE, Bursty, Device, LatencyTail, Periodic, Steady, sigma_from_pcts
from kvstream.sim.engine import PRIO_ARRIVAL, PRIO_ENV, PRIO_IO, PRIO_STEP, EventLoop


def test_order_is_time_then_priority_then_sequence():
    loop = EventLoop()
    seen = []
    loop.at(1.0, PRIO_ARRIVAL, seen.append, "arrival")
    loop.at(1.0, PRIO_STEP, seen.append, "step")
    loop.at(1.0, PRIO_IO, seen.append, "io-1")
    loop.at(1.0, PRIO_IO, seen.append, "io-2")
    loop.at(1.0, PRIO_ENV, seen.append, "env")
    loop.at(0.5, PRIO_ARRIVAL, seen.append, "early")
    loop.run()
    assert seen == ["early", "env", "io-1", "io-2", "step", "arrival"]
    with pytest.raises(ValueError, match="before now"):
        loop.at(0.1, PRIO_IO, seen.append, "past")


def test_run_until_and_stop():
    loop = EventLoop()
    seen = []

    def tick():
        seen.append(loop.now)
        loop.after(1.0, PRIO_IO, tick)

    loop.at(0.0, PRIO_IO, tick)
    loop.run(until=3.5)
    assert seen == [0.0, 1.0, 2.0, 3.0] and loop.now == 3.5
    loop.at(4.0, PRIO_IO, loop.stop)
    loop.run()
    assert seen[-1] == 4.0


def _run_ops(dev: Device, loop: EventLoop, ops):
    done = {}
    for kind, nbytes, tag, client in ops:
        dev.submit(kind, nbytes, lambda t: done.__setitem__(t, loop.now), tag, client=client)
    loop.run(until=1e6)
    return done


def test_processor_sharing_keeps_bandwidth():
    loop = EventLoop()
    d = Device(loop, "nvme", read_bw=2e9, write_bw=1e9)
    done = _run_ops(d, loop, [(READ, 10**9, i, 0) for i in range(4)])
    assert max(done.values()) == pytest.approx(2.0)
    assert all(t == pytest.approx(2.0) for t in done.values())  # equal shares finish together


def test_read_write_interference_matches_paper_definition():
    # concurrent R + W takes (1 + interference) x (R/Br + W/Bw): the paper's 27 % (testbed 2)
    loop = EventLoop()
    d = Device(loop, "nvme", read_bw=2e9, write_bw=1e9, interference=0.27)
    done = _run_ops(d, loop, [(READ, 2 * 10**9, "r", 0), (WRITE, 10**9, "w", 0)])
    assert max(done.values()) == pytest.approx(2.0 * 1.27)


def test_shared_device_caps_each_client():
    loop = EventLoop()
    d = Device(loop, "pfs", read_bw=10e9, write_bw=5e9, client_bw=3e9)
    done = _run_ops(d, loop, [(READ, 3 * 10**9, c, c) for c in range(2)])
    assert done[0] == pytest.approx(1.0) and done[1] == pytest.approx(1.0)  # capped at 3 GB/s each
    loop = EventLoop()
    d = Device(loop, "pfs", read_bw=10e9, write_bw=5e9, client_bw=3e9)
    done = _run_ops(d, loop, [(READ, 10**9, c, c) for c in range(5)])
    assert max(done.values()) == pytest.approx(0.5)  # 10 GB/s split five ways


def test_background_traffic_takes_its_share():
    loop = EventLoop()
    d = Device(loop, "pfs", read_bw=1e9, write_bw=1e9, background=Periodic(share=0.5, period=10, duty=0.5))
    done = _run_ops(d, loop, [(READ, 10**10, "r", 0)])
    assert done["r"] == pytest.approx(15.0)  # 2.5 GB in each busy 5 s, 5 GB in each quiet 5 s
    loop = EventLoop()
    d = Device(loop, "pfs", read_bw=1e9, write_bw=1e9, background=Steady(share=0.4))
    assert _run_ops(d, loop, [(READ, 6 * 10**8, "r", 0)])["r"] == pytest.approx(1.0)
    b = Bursty(share=0.7, mean_on=2, mean_off=5, seed=3)
    shares = [b.share_at(t) for t in np.linspace(0, 2000, 20001)]
    assert 0.15 < np.mean(shares) / 0.7 < 0.45  # on about 2 / 7 of the time


def test_tails_keep_mean_bandwidth_and_spread_latency():
    loop = EventLoop()
    sig = sigma_from_pcts(102, 795)
    d = Device(loop, "pfs", read_bw=1e9, write_bw=1e9, tail=LatencyTail(sigma_alone=sig),
               rng=np.random.default_rng(1))
    lat = []
    t_end = [0.0]

    def one(i):
        if i < 2000:
            start = loop.now
            d.submit(READ, 10**7, lambda _: (lat.append(loop.now - start), t_end.__setitem__(0, loop.now), one(i + 1)))

    one(0)
    loop.run(until=1e6)
    lat = np.array(lat)
    assert t_end[0] == pytest.approx(2000 * 0.01, rel=0.1)  # mean work per op = its bytes
    assert np.percentile(lat, 99) / np.percentile(lat, 50) == pytest.approx(795 / 102, rel=0.35)
