"""The tier contract: what the engine needs of a disk tier, and what a tier promises in return.

Two kinds of tier exist today, and the contract is the part they share plus what each kind adds:

- :class:`Tier` (every kind): membership (``contains``/``file_size``), capacity (``capacity_bytes``,
  ``used_bytes``) and :class:`TierCapabilities`. Keys are opaque and hashable (the store's are ``bytes``).
- :class:`FileTier` (``modelled=False``: it holds real bytes; :class:`kvstream.tiers.files.DirectoryTier`):
  the store's reader, writer and catch-up drive it. Bytes move through the tier's own rings
  (``read_ring``/``write_ring``) on descriptors the tier hands out, so an I/O engine wrapper (a throttle, a
  fault injector: :mod:`kvstream.io.throttle`, :mod:`kvstream.io.faults`) wraps every tier built on it.
- :class:`ModelledTier` (``modelled=True``: no bytes; :class:`kvstream.sim.storage.SimTier`): the simulator
  drives it in simulated time (``now`` passed in, sans-I/O).

Invariants every tier keeps (checked by :class:`kvstream.testing.tier.TierConformance`):

1. First wins. ``publish`` of a key the tier already holds returns False and changes nothing: the bytes, the
   size and the eviction order stay the first publisher's (same key, same bytes: that copy is as good). Two
   racing publishers of one key: exactly one returns True.
2. All or nothing. A key is visible (``contains``) only once its whole chunk is published; a writer killed
   before ``publish`` leaves nothing visible, and never a part of a chunk.
3. Never other bytes. A descriptor from ``open_for_read`` reads the chunk that was published under the key when
   it was opened, or fails (a negative result, a short read), even if the key is dropped or published again
   meanwhile. Bytes are still checked by the reader (header key, checksums): a tier does not vouch for them.
4. Bounded sizes. A size the tier reports (``open_for_read``'s read length) is never larger than its
   capacity, whatever a file on disk or an index says: nothing read from storage is trusted to size a buffer.
5. Capacity. ``used_bytes`` is the sum of the sizes of the chunks this node owns on the tier; a file tier keeps
   it, plus reservations, within ``capacity_bytes`` by evicting (``reserve``) before a write, and never
   evicts a pinned chunk; a modelled tier evicts down to capacity after a write lands (``fit``).
6. Durable (``durable=True``): what was published survives the process: a reopen after a crash (no ``close``)
   lists it with the same bytes; temporaries of a killed writer are never listed.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from kvstream.io.engine import Ring
from kvstream.tiers.pins import Pins

__all__ = ["TierCapabilities", "Tier", "FileTier", "ModelledTier"]

K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierCapabilities:
    """What a tier can do: the conformance suite applies a test only where the flags say it can hold."""

    modelled: bool  # no bytes behind it (the simulator's): byte-level operations do not exist
    direct_io: bool = False  # its descriptors are opened with O_DIRECT (reads and writes 4 KiB aligned)
    shared: bool = False  # other nodes publish to the same tier: their chunks become visible here
    durable: bool = False  # published chunks survive the process (a restart, a kill)
    pins: bool = False  # a pinned chunk is never evicted (``hold``/``release``)


@runtime_checkable
class Tier(Protocol[K_contra]):
    """Every tier: membership, capacity, capabilities. Thread-safe on a file tier."""

    name: str

    @property
    def capabilities(self) -> TierCapabilities: ...

    def contains(self, key: K_contra) -> bool:
        """True once the key's chunk is published here (and until it is dropped or evicted)."""
        ...

    def file_size(self, key: K_contra) -> int | None:
        """Bytes the key's chunk takes here (as published), or None if the tier does not hold it."""
        ...

    @property
    def capacity_bytes(self) -> int | None:
        """Bytes this node may keep on the tier (None: unbounded)."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes of this node's chunks on the tier (pinned ones included)."""
        ...


@runtime_checkable
class FileTier(Tier[bytes], Protocol):
    """A tier of real files: what the store's reader, writer and catch-up call (besides its counters, its
    name and position, and the reader's hooks ``on_hit``/``on_missing``/``quarantine``, which are bookkeeping).

    Write: ``reserve(n)`` (evicts to make room; False: it can never fit, or only evicting pinned chunks would
    make room) → ``create_temp(key)`` → write the whole chunk on ``write_ring`` → ``publish(key, tmp, n)``
    (True: ours is the chunk now; False: the key was published first, ours is discarded; either way the
    reservation is spent and the temporary is gone). On a failed write the caller unlinks the temporary and
    calls ``unreserve(n)``; on ENOSPC from the file system (other users) ``make_room(n)`` evicts regardless of
    capacity. Read: ``open_for_read(key)`` → (descriptor, read length) read on ``read_ring``, then closed by
    the caller; None is a miss; :class:`kvstream.errors.TierError` is a tier failure (the file may be fine).
    """

    read_ring: Ring
    write_ring: Ring
    pins: Pins  # the store's pin counts (one per store, shared by its tiers): ``hold`` reads them

    def open_for_read(self, key: bytes) -> tuple[int, int] | None:
        """(descriptor, bytes to read: the whole chunk, 4 KiB aligned, never above ``capacity_bytes`` rounded
        up), or None if the tier does not have it. The caller closes the descriptor."""
        ...

    def path_for(self, key: bytes) -> Path:
        """Where the key's chunk file lives (re-reads and ``kvstream verify`` open it themselves)."""
        ...

    def reserve(self, nbytes: int) -> bool: ...

    def unreserve(self, nbytes: int) -> None: ...

    def make_room(self, nbytes: int) -> int:
        """Evict this node's chunks until ``nbytes`` are freed, whatever the capacity says; bytes freed."""
        ...

    def create_temp(self, key: bytes) -> tuple[int, str]:
        """(descriptor, path) of a new temporary for ``key``: never visible as a chunk until published."""
        ...

    def publish(self, key: bytes, tmp_path: str, file_size: int) -> bool:
        """Make a fully written temporary the key's chunk, first wins (see the class docstring)."""
        ...

    def drop(self, key: bytes) -> None:
        """Remove the key's chunk (a no-op if the tier does not hold it). Open descriptors keep reading it."""
        ...

    def hold(self, key: bytes) -> bool:
        """The key was pinned (in the store's pin counts): keep it out of eviction. True if the tier holds it."""
        ...

    def release(self, key: bytes) -> None:
        """The key's last pin went: it may be evicted again."""
        ...

    def maybe_refresh(self, min_interval_s: float = 1.0) -> None:
        """A shared tier: pick up other nodes' publishes and drops (at most once per interval); else nothing."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ModelledTier(Tier[K_contra], Protocol):
    """A tier with no bytes, in simulated time (the simulator's): chunks are published when their modelled
    write lands, and the tier evicts down to its capacity afterwards."""

    def publish(self, key: K_contra, nbytes: int, *, now: float) -> bool:
        """The key's modelled write landed: True if it is new here; False if it was published first (nothing
        changes: its size and eviction order stay the first's). Does not evict (see :meth:`fit`)."""
        ...

    def fit(self, *, now: float) -> int:
        """Evict (the tier's eviction policy at ``now``) until the tier is within capacity; chunks evicted."""
        ...


if TYPE_CHECKING:  # mypy (strict, lint) checks that the package's tiers implement the contract; nothing at run time
    from kvstream.sim.storage import SimTier
    from kvstream.tiers.files import DirectoryTier

    def _implemented(files: DirectoryTier, sim: SimTier) -> tuple[FileTier, ModelledTier[Hashable]]:
        return files, sim
