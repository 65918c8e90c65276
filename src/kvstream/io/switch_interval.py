"""The interpreter's thread switch interval, lowered on request: how long a thread waiting for the GIL waits.

Every chunk a step reads passes through Python on several threads: the ring's reaper hands the completion to
the read step, a tier's open thread opens the next file, the consumer checks the header and reacquires the GIL
after hashing the payload (xxh3 runs with it released). A thread that wants the GIL while another runs Python
waits until that one blocks, or until the switch interval (``sys.getswitchinterval()``, 5 ms by default) has
passed. With one 48 MiB read in flight per tier (15 ms on this VM's disk) each of those waits leaves the device
idle, and a few of them per chunk cost as much as the read.

Measured on 2026-12-06 (``bench/gil_handoff.py``: 24 chunks of 48 MiB read through a store in steps of 8,
medians of 6 passes, the local disk and an emulated 1.1 GB/s tier; "busy": one other Python thread running a loop
the whole time): at 5 ms the busy thread took one tier from 3.17 to 1.69 GB/s and two tiers from 3.58 to 2.12; at
1 ms they read 2.68 and 2.96. Inside ``kvstream replay``, whose serving, put and probe threads wait on the GIL
6-10 % of the time, 1 ms changed nothing measurable (four runs, alternated: kvstream's local tier read 0.77-0.88
GB/s per busy second at 5 ms and 0.71-0.90 at 1 ms; BENCHMARKS §1.6): it matters where the host keeps a thread
running Python.

This is process-wide: it changes how every thread of the process shares the GIL. A library must not do that
behind its host's back, so it happens only when asked (``StoreConfig.python_switch_interval_s``,
``kvstream.python_switch_interval_s`` for LMCache, ``kvstream replay --switch-interval-ms``), only ever lowers
the interval (a host that chose a smaller one keeps it), and logs what it changed. It is not restored at a
store's close: another store, or the host, may rely on it by then.
"""

from __future__ import annotations

import logging
import math
import sys

__all__ = ["MIN_SWITCH_INTERVAL_S", "MAX_SWITCH_INTERVAL_S", "check_switch_interval", "lower_switch_interval"]

log = logging.getLogger(__name__)

# Below 0.1 ms the interpreter spends its time handing the GIL over; above 100 ms it is no longer "lowering".
MIN_SWITCH_INTERVAL_S = 1e-4
MAX_SWITCH_INTERVAL_S = 0.1


def check_switch_interval(seconds: float) -> str | None:
    """Why ``seconds`` cannot be a switch interval, or None if it can."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not math.isfinite(seconds):
        return f"must be a number of seconds, got {seconds!r}"
    if not MIN_SWITCH_INTERVAL_S <= seconds <= MAX_SWITCH_INTERVAL_S:
        return (f"must be between {MIN_SWITCH_INTERVAL_S} and {MAX_SWITCH_INTERVAL_S} s "
                f"(0.001 is what the benchmarks use), got {seconds}")
    return None


def lower_switch_interval(seconds: float, *, by: str) -> float | None:
    """Set the interpreter's switch interval to ``seconds`` if it is longer now; returns the interval it replaced
    (None: left as it was). ``by`` names the setting that asked, for the log line."""
    why = check_switch_interval(seconds)
    if why is not None:
        raise ValueError(f"{by}: {why}")
    old = sys.getswitchinterval()
    if old <= seconds:
        return None
    sys.setswitchinterval(seconds)
    log.info("%s: Python's thread switch interval lowered from %.2g ms to %.2g ms (process-wide)",
             by, old * 1e3, seconds * 1e3)
    return old
