"""The simulator's event loop (``kvstream.sim.engine.EventLoop``) against simpy on the same chain of timeouts.

Why it exists: ``sim/engine.py`` is our own heap loop rather than simpy, and says so because a callback here is
cheaper than a simpy process switch. This measures that claim (a benchmark, not a timed test: a busy machine
must not fail the suite). Medians of ``--runs`` rounds, in alternating order.

    .venv/bin/python bench/sim_loop_vs_simpy.py --events 200000 --runs 5 [--json F]

Needs ``simpy`` (``pip install simpy``; not a dependency of kvstream).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvstream.sim.engine import PRIO_IO, EventLoop


def ours(n: int) -> float:
    loop = EventLoop()
    count = [0]

    def cb() -> None:
        count[0] += 1
        if count[0] < n:
            loop.after(0.001, PRIO_IO, cb)

    t0 = time.perf_counter()
    loop.at(0.0, PRIO_IO, cb)
    loop.run()
    assert count[0] == n
    return time.perf_counter() - t0


def theirs(n: int) -> float:
    import simpy

    env = simpy.Environment()

    def proc(env):  # noqa: ANN001, ANN202 — simpy's generator protocol
        for _ in range(n):
            yield env.timeout(0.001)

    t0 = time.perf_counter()
    env.process(proc(env))
    env.run()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args(argv)
    try:
        import simpy  # noqa: F401
    except ImportError:
        print("simpy is not installed (pip install simpy): nothing to compare against", file=sys.stderr)
        return 2
    a_s, b_s = [], []
    for i in range(a.runs):
        for fn, out in ((ours, a_s), (theirs, b_s)) if i % 2 == 0 else ((theirs, b_s), (ours, a_s)):
            out.append(fn(a.events))
    mo, mt = statistics.median(a_s), statistics.median(b_s)
    res = {"events": a.events, "runs": a.runs, "ours_us_per_event": mo / a.events * 1e6,
           "simpy_us_per_event": mt / a.events * 1e6, "simpy_over_ours": mt / mo}
    print(f"EventLoop {res['ours_us_per_event']:.2f} us/event, simpy {res['simpy_us_per_event']:.2f} us/event: "
          f"ours is {res['simpy_over_ours']:.2f}x faster (median of {a.runs})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
