"""The storage side of a serving run, one interface for the simulator and ``kvstream replay``, and the one place the
serving core's actions are carried out.

A :class:`ServingBackend` answers the core's ``lookup`` query and carries out its storage actions: the simulator's
modelled store (:class:`kvstream.sim.storage.SimStorage`, on simulated time) and the real store behind a real-time
run (:class:`kvstream.serving.storebackend.StoreBackend`, on threads) implement it. Both drivers hand each event to
:func:`deliver`, which runs the core and dispatches its actions with :func:`dispatch`: the only code that turns
:class:`~kvstream.serving.core.StartLoad`, :class:`~kvstream.serving.core.WriteChunks`,
:class:`~kvstream.serving.core.Flush` and :class:`~kvstream.serving.core.ReleaseChunks` into backend calls. What
differs between the drivers is only time: how a :class:`~kvstream.serving.core.StartStep` is waited for
(``start_step``: an event on the simulator's loop, or a deadline on the real clock) and how a finished load comes
back (``post``: an event on the loop, or a completion posted from a load thread).

Invariant (the core's contract, :mod:`kvstream.serving.core`): actions are carried out in the order given, and a
load's :class:`~kvstream.serving.core.LoadDone` is never handed to the core from inside :func:`dispatch` (the
backend posts it later: the core is never re-entered).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Sequence

from kvstream.serving.core import (
    Action,
    Event,
    Flush,
    LoadDone,
    ReleaseChunks,
    ServingCore,
    StartLoad,
    StartStep,
    WriteChunks,
)

__all__ = ["ServingBackend", "Record", "dispatch", "deliver", "window_wanted"]

# What a driver records for comparison across drivers: (time, event, the actions the core returned).
Record = list[tuple[float, Event, tuple[Action, ...]]]


class ServingBackend(ABC):
    """The store side of a serving run. ``lookup`` is the core's query; the rest carry out its actions."""

    @abstractmethod
    def lookup(self, chunk_ids: Sequence[Hashable]) -> tuple[int, int]:
        """``(present, in_host)``: the leading chunks stored anywhere, and how many of those are in host memory."""

    @abstractmethod
    def start_load(self, action: StartLoad, post: Callable[[LoadDone], None]) -> None:
        """Start the load and return; call ``post(LoadDone)`` once every chunk has landed (or was lost), never
        before returning."""

    @abstractmethod
    def write(self, action: WriteChunks) -> None:
        """``put``: the chunks enter host memory and wait for the next :meth:`flush`."""

    @abstractmethod
    def flush(self) -> None:
        """Hand the buffered chunks to the disk tiers."""

    @abstractmethod
    def release(self, chunk_ids: Sequence[Hashable]) -> None:
        """Unpin chunks a load pinned: the GPU has them now."""

    @property
    def wants_window(self) -> bool:
        """True if :meth:`set_window` matters (the host-memory eviction policy is queue-aware)."""
        return False

    def set_window(self, sessions: Sequence[Hashable]) -> None:
        """The sessions the waiting queue's look-ahead window will need (protected from eviction)."""

    def sample(self) -> dict[str, int]:
        """Cumulative bytes read and written per tier, ``{"NAME.read": n, "NAME.write": n}`` (the
        bytes-per-tier-over-time figure)."""
        return {}

    def close(self) -> None:
        """Stop the backend's threads, if any, and let go of what it holds."""


def dispatch(actions: Sequence[Action], backend: ServingBackend, *, post: Callable[[LoadDone], None],
             start_step: Callable[[StartStep], None]) -> None:
    """Carry out the core's actions in order: storage actions on ``backend`` (a load reports to ``post``), a
    forward step through ``start_step`` (the driver's clock)."""
    for a in actions:
        if isinstance(a, StartStep):
            start_step(a)
        elif isinstance(a, StartLoad):
            backend.start_load(a, post)
        elif isinstance(a, WriteChunks):
            backend.write(a)
        elif isinstance(a, Flush):
            backend.flush()
        elif isinstance(a, ReleaseChunks):
            backend.release(a.chunk_ids)
        else:  # pragma: no cover
            raise TypeError(f"unknown action {a!r}")


def deliver(core: ServingCore, backend: ServingBackend, ev: Event, now: float, *, post: Callable[[LoadDone], None],
            start_step: Callable[[StartStep], None], window: bool = False, record: Record | None = None) -> None:
    """Hand one event to the core at ``now`` and carry out what it decides (:func:`dispatch`); then, with
    ``window`` (a queue-aware host-memory policy and a core that has a look-ahead window), give the backend the
    sessions the waiting queue will need next. ``record``: each ``(now, event, actions)`` is appended."""
    actions = core.handle(ev, now)
    if record is not None:
        record.append((now, ev, tuple(actions)))
    dispatch(actions, backend, post=post, start_step=start_step)
    if window:
        backend.set_window(core.window_sessions())


def window_wanted(core: ServingCore, backend: ServingBackend) -> bool:
    """Whether :func:`deliver` should pass the core's look-ahead window on: the backend's host-memory policy is
    queue-aware and the core's scheduling has a window (``ServingConfig.eviction_window``)."""
    return backend.wants_window and core.cfg.eviction_window > 0
