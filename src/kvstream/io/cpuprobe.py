"""Where a process's CPU goes while it loads KV: per-thread CPU and run-queue wait, and the GIL's wait.

Two instruments, both cheap enough to leave on for a whole ``kvstream replay``:

- :func:`thread_times` reads ``/proc/self/task/*/schedstat`` (nanoseconds on the CPU, nanoseconds runnable but
  waiting for a CPU) for every thread of this process, named by its Python thread name where it has one, else
  by its kernel name (``/proc/self/task/TID/comm``: io_uring's ``iou-wrk-*`` workers, which run buffered reads
  and writes on the kernel side, are threads of this process too). :func:`group` folds the names into roles
  (``kvs-uring-local-r`` stays itself, ``kvs-write-local_0`` becomes ``kvs-write-local``, pool threads lose
  their index) so two runs compare role by role.
- :class:`GilProbe` is a thread that sleeps ``period_s`` at a time and measures how late it wakes. Waking needs
  the GIL, so on a machine with a free core the lateness is the time the probe waited for the GIL; with no free
  core it also includes the run-queue wait, which :func:`thread_times` reports on its own (``runq_s`` of
  ``gil-probe``). The share of wall time the probe spent waiting is what any thread that must run Python (a
  ring's reaper handing a completion to the read step, the consumer verifying a chunk) pays on top of its work.

Why not a profiler: py-spy and friends sample stacks from outside and need ptrace; what the question needs is
per-thread seconds and one GIL figure, on any machine, in the same run as the bandwidth it explains.
Linux only (``/proc``); elsewhere :func:`thread_times` returns an empty dict and the probe still runs.
"""

from __future__ import annotations

import os
import re
import threading
import time
from dataclasses import dataclass

__all__ = ["ThreadTime", "thread_times", "group", "delta", "GilProbe", "ThreadCpuMeter", "MachineLoad"]


@dataclass(frozen=True, slots=True)
class ThreadTime:
    """One thread's (or one role's) accumulated times, seconds."""

    cpu_s: float  # on a CPU (user + system)
    runq_s: float  # runnable, waiting for a CPU (CPU starvation: 2 cores, more busy threads)


def _python_names() -> dict[int, str]:
    return {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}


def thread_times() -> dict[str, ThreadTime]:
    """Every live thread of this process: ``"NAME/TID"`` -> its times since it started (empty without /proc).
    The TID keeps two threads of one name apart; :func:`group` removes it."""
    names = _python_names()
    out: dict[str, ThreadTime] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    for tid_s in tids:
        try:
            tid = int(tid_s)
            with open(f"/proc/self/task/{tid_s}/schedstat") as f:
                cpu_ns, runq_ns, *_ = (int(x) for x in f.read().split())
            name = names.get(tid)
            if name is None:
                with open(f"/proc/self/task/{tid_s}/comm") as f:
                    name = f.read().strip()
        except (OSError, ValueError):
            continue  # the thread ended between listdir and open
        out[f"{name}/{tid}"] = ThreadTime(cpu_s=cpu_ns / 1e9, runq_s=runq_ns / 1e9)
    return out


_ROLE = [
    (re.compile(r"^iou-wrk-\d+$"), "io_uring workers (kernel)"),
    (re.compile(r"^(kvs-[a-z]+-[A-Za-z0-9.:-]+?)_\d+$"), r"\1"),  # ThreadPoolExecutor: prefix_N
    (re.compile(r"^(kvs-[a-z]+-[A-Za-z0-9.:-]+?)-\d+$"), r"\1"),  # threads engine workers: kvs-LABEL-i
    (re.compile(r"^Thread-\d+.*$"), "other Python threads"),
]


def _role(name: str) -> str:
    base = name.rsplit("/", 1)[0]
    for pat, rep in _ROLE:
        if pat.match(base):
            return pat.sub(rep, base)
    return base


def group(times: dict[str, ThreadTime]) -> dict[str, ThreadTime]:
    """Fold per-thread times into roles (see the module docstring)."""
    out: dict[str, list[float]] = {}
    for name, t in times.items():
        acc = out.setdefault(_role(name), [0.0, 0.0])
        acc[0] += t.cpu_s
        acc[1] += t.runq_s
    return {k: ThreadTime(cpu_s=v[0], runq_s=v[1]) for k, v in out.items()}


def delta(before: dict[str, ThreadTime], after: dict[str, ThreadTime]) -> dict[str, ThreadTime]:
    """Per thread, ``after - before`` (threads born in between count from zero; threads that ended in between
    are lost: sample around work whose threads outlive it, or sample often)."""
    zero = ThreadTime(cpu_s=0.0, runq_s=0.0)
    return {k: ThreadTime(cpu_s=v.cpu_s - before.get(k, zero).cpu_s, runq_s=v.runq_s - before.get(k, zero).runq_s)
            for k, v in after.items()}


class GilProbe:
    """A thread that sleeps ``period_s`` at a time and adds up how late it woke (module docstring).

    ``wait_share()``: the share of the probe's wall time spent late, 0 with a free GIL and a free core. Start
    with :meth:`start`, end with :meth:`stop` (joins). The probe itself costs about one wake-up per period."""

    def __init__(self, period_s: float = 0.002) -> None:
        if not period_s > 0:
            raise ValueError(f"GilProbe: period_s must be > 0, got {period_s!r}")
        self.period_s = period_s
        self.late_s = 0.0
        self.wakes = 0
        self.max_late_s = 0.0
        self._started = 0.0
        self._ended = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)

    def start(self) -> "GilProbe":
        self._started = time.perf_counter()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._ended = time.perf_counter()

    def _run(self) -> None:
        period = self.period_s
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(period)
            late = max(time.perf_counter() - t0 - period, 0.0)
            self.late_s += late
            self.wakes += 1
            if late > self.max_late_s:
                self.max_late_s = late

    def wait_share(self) -> float:
        """Seconds late over seconds run (after :meth:`stop`, or so far)."""
        end = self._ended or time.perf_counter()
        return self.late_s / (end - self._started) if end > self._started else 0.0


class ThreadCpuMeter:
    """Per-thread CPU over a span, threads that start and end inside it included: a sampler thread reads
    :func:`thread_times` every ``period_s`` and keeps each thread's last figures (a thread that ends loses at most
    its last period). :meth:`stop` returns the span's times by role (:func:`group`); the sampler itself shows as
    ``cpu-meter``. Runs a :class:`GilProbe` beside it (``gil_wait_share``)."""

    def __init__(self, period_s: float = 0.5, gil_period_s: float = 0.002) -> None:
        self.period_s = period_s
        self._first: dict[str, ThreadTime] = {}
        self._last: dict[str, ThreadTime] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cpu-meter", daemon=True)
        self._gil = GilProbe(gil_period_s)
        self.wall_s = 0.0
        self._t0 = 0.0

    def start(self) -> "ThreadCpuMeter":
        self._first = thread_times()
        self._last = dict(self._first)
        self._t0 = time.perf_counter()
        self._gil.start()
        self._thread.start()
        return self

    def _sample(self) -> None:
        self._last.update(thread_times())

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> dict[str, ThreadTime]:
        self._stop.set()
        self._thread.join()
        self._sample()
        self._gil.stop()
        self.wall_s = time.perf_counter() - self._t0
        return group(delta(self._first, self._last))

    @property
    def gil_wait_share(self) -> float:
        return self._gil.wait_share()


def _proc_stat() -> list[int] | None:
    """The machine's CPU jiffies (user nice system idle iowait irq softirq steal), or None without /proc."""
    try:
        with open("/proc/stat") as f:
            first = f.readline().split()
        return [int(x) for x in first[1:9]]
    except (OSError, ValueError, IndexError):
        return None


def _own_jiffies() -> int | None:
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime (all threads)
    except (OSError, ValueError, IndexError):
        return None


class MachineLoad:
    """What else the machine did over a span (a replay round): the 1-minute load average at both ends and, over
    the span, the share of all CPUs that was busy, busy with this process, busy with anything else, waiting for
    I/O, and stolen by the hypervisor. A round whose ``others_share`` is high ran beside a neighbour's work, and its
    figures say so. Linux only: elsewhere the shares are None."""

    def __init__(self) -> None:
        self._stat0: list[int] | None = None
        self._own0: int | None = None
        self._load0 = 0.0
        self._t0 = 0.0

    def start(self) -> "MachineLoad":
        self._stat0, self._own0 = _proc_stat(), _own_jiffies()
        self._load0 = os.getloadavg()[0]
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> dict[str, float | None]:
        stat1, own1 = _proc_stat(), _own_jiffies()
        out: dict[str, float | None] = {"seconds": time.perf_counter() - self._t0, "loadavg_1m_start": self._load0,
                                        "loadavg_1m_end": os.getloadavg()[0], "cpus": float(os.cpu_count() or 0),
                                        "busy_share": None, "own_share": None, "others_share": None,
                                        "iowait_share": None, "steal_share": None}
        if self._stat0 is None or stat1 is None:
            return out
        d = [b - a for a, b in zip(self._stat0, stat1)]
        total = sum(d)
        if total <= 0:
            return out
        idle, iowait, steal = d[3], d[4], d[7]
        busy = total - idle - iowait
        own = (own1 - self._own0) if own1 is not None and self._own0 is not None else None
        out.update({"busy_share": busy / total, "iowait_share": iowait / total, "steal_share": steal / total})
        if own is not None:
            out["own_share"] = min(own / total, 1.0)
            out["others_share"] = max(busy - own, 0) / total
        return out
