"""What :meth:`kvstream.store.Store.stats` returns: one frozen snapshot of the store's counters.

:class:`StoreStats` holds the store-wide counters, a :class:`MemoryStats` for the host-memory tier and one
:class:`TierStats` per directory tier (``stats.tiers["local"]``). Every field is typed and commented with its
unit; callers read attributes (``st.tiers["local"].write_chunks``), so a renamed or removed figure is a type
error, not a ``KeyError`` at run time. :meth:`StoreStats.as_dict` gives the JSON form (``--json`` output,
replay records, bench results) with the same keys the store's old dict had, plus the figures added since.

Counters only grow over a store's life; gauges (``chunks``, ``used_bytes``, ``write_backlog_bytes``, ...) are
the state at the call; latency percentiles are over recent operations (the last few thousand per tier) and
``None`` before the first. No I/O, no locks: the store builds a snapshot, readers only read it.

The live counters behind the snapshot are typed too, one small dataclass per part that counts: the store's own
calls (:class:`StoreCounters`), the reader (:class:`ReaderCounters`), the writer (:class:`WriterCounters`) and the
catch-up of owed replicas (:class:`CatchUpCounters`). Each part owns and writes its own (no part writes
another's); :meth:`kvstream.store.Store.stats` copies them into a :class:`StoreStats` under the same names.
Increments are plain ``+=`` as before (several threads count; a figure may lag by an increment, never more).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields, replace
from types import MappingProxyType
from typing import Any

__all__ = ["CatchUpCounters", "MemoryStats", "ReaderCounters", "StoreCounters", "StoreStats", "TierStats",
           "WriterCounters", "percentiles"]


def percentiles(values: Iterable[float]) -> tuple[float | None, float | None]:
    """(p50, p99) of ``values`` (nearest rank, as the store has always reported them); (None, None) if empty."""
    lat = sorted(values)
    if not lat:
        return None, None
    return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def _plain(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in fields(obj)}


@dataclass(slots=True)
class StoreCounters:
    """What :class:`kvstream.store.Store`'s own calls count (puts, and read calls' planning and results).
    Field names are :class:`StoreStats`'s."""

    puts: int = 0
    put_bytes: int = 0
    put_file_bytes: int = 0
    puts_duplicate: int = 0
    puts_dropped_no_memory: int = 0
    puts_dropped_unstored: int = 0
    get_chunks: int = 0
    memory_hits: int = 0
    misses: int = 0
    lost_chunks: int = 0
    read_steps: int = 0
    read_seconds: float = 0.0
    copies_ordered: int = 0

    def snapshot(self) -> "StoreCounters":
        return replace(self)


@dataclass(slots=True)
class ReaderCounters:
    """What :class:`kvstream.reader.Reader` counts. Field names are :class:`StoreStats`'s."""

    disk_hits: int = 0
    verify_seconds: float = 0.0
    hedged_reads: int = 0
    stalled_reads: int = 0
    read_into_direct: int = 0
    read_into_copied: int = 0
    read_into_abandoned: int = 0

    def snapshot(self) -> "ReaderCounters":
        return replace(self)


@dataclass(slots=True)
class WriterCounters:
    """What :class:`kvstream.writer.Writer` counts (per-tier write figures are the tiers' own counters)."""

    flushes: int = 0

    def snapshot(self) -> "WriterCounters":
        return replace(self)


@dataclass(slots=True)
class CatchUpCounters:
    """What :class:`kvstream.replica_debt.CatchUp` counts (its policy's own figures are the policy's:
    :class:`kvstream.replica_debt.CatchUpPolicy`). In :class:`StoreStats` as ``catch_up_copies`` and
    ``catch_up_reads``."""

    copies_started: int = 0  # owed replicas handed to the writer
    reads: int = 0  # owed replicas read back from another tier first

    def snapshot(self) -> "CatchUpCounters":
        return replace(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class TierStats:
    """One directory tier's figures (cumulative since the store opened, except where marked gauge)."""

    path: str  # the tier's folder
    direct_io: bool  # reads bypass the page cache (O_DIRECT)
    chunks: int  # gauge: chunks the tier's index holds
    used_bytes: int  # gauge: bytes of chunk files this node owns there
    capacity_bytes: int  # gauge: configured capacity (a per-node quota on a shared tier)
    read_bytes: int  # bytes read and verified (duplicates included)
    read_chunks: int  # chunks read
    read_busy_s: float  # seconds with at least one read of this tier in flight
    read_window_bytes: int  # gauge: bytes of reads the tier may have in flight in a step (read_windows)
    read_gbps_estimate: float | None  # gauge: the read-window policy's bandwidth estimate, GB/s (None: none kept)
    read_gbps: float  # read_bytes / read_busy_s, GB/s (0.0 before the first read)
    duplicate_chunks: int  # chunks read after another tier had delivered them
    read_errors: int  # reads that failed with an I/O error
    corrupt_chunks: int  # chunks that failed verification and were quarantined
    missing_files: int  # indexed chunks whose file was gone
    write_bytes: int  # bytes of chunk files published
    write_busy_s: float  # seconds with at least one copy handed to the tier's writer and not finished
    write_gbps: float  # write_bytes / write_busy_s, GB/s (0.0 before the first write finished)
    write_chunks: int  # chunk files published
    write_errors: int  # copies that failed to write
    write_skipped_full: int  # copies not written: the tier was full even after eviction
    write_skipped_unhealthy: int  # copies not written: the tier's circuit breaker was open
    write_skipped_backlog: int  # second copies not written: the tier's write backlog was full
    write_backlog_bytes: int  # gauge: bytes of copies handed to the tier's writer and not finished
    already_present: int  # publishes that found the key published first
    write_retried_nospace: int  # copies retried after ENOSPC/EDQUOT once eviction made room
    write_retried_stale: int  # copies retried once after ESTALE
    evicted_chunks: int  # chunks evicted to stay within capacity
    evicted_bytes: int  # their bytes
    read_latency_p50_s: float | None  # median per-chunk read latency, recent reads (None: no read yet)
    read_latency_p99_s: float | None  # p99 of the same
    write_latency_p50_s: float | None  # median per-chunk write latency, submit to publish, recent writes
    write_latency_p99_s: float | None  # p99 of the same
    circuit: str  # the circuit breaker's state: closed | open | half-open | down (could not be opened)
    circuit_opened: int  # times the circuit breaker opened
    index_load_s: float  # seconds the index took to load at open
    removed_temporaries: int  # leftover temporaries removed at open
    replicas_owed: int  # gauge: copies owed to the tier (kvstream.replica_debt), written once it can take them
    read_retried: int = 0  # reads that failed verification and were read again before any verdict
    read_transient: int = 0  # ... whose re-read verified: a fault on the way, the file kept (not quarantined)
    write_refused_pinned: int = 0  # copies refused: only evicting pinned chunks would have made room (retryable)
    pinned_chunks: int = 0  # gauge: chunks pinned on the tier (never eviction victims while pinned)
    index_damaged_records: int = 0  # index log records that failed their checksum mid-log (skipped, resynced)
    down: str = ""  # why the tier could not be opened ("" while up): the store runs without it
    publish_conflicts: int = 0  # links that won although another writer's file held the name (resolved)
    orphans_listed: int = 0  # published files a killed writer never logged, listed (and owned) at open

    def as_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryStats:
    """The store's host-memory tier."""

    capacity_bytes: int  # configured size
    used_bytes: int  # gauge: bytes held (clean and dirty chunks)
    chunks: int  # gauge: chunks held
    hits: int  # chunks served from it
    evictions: int  # chunks evicted from it
    overflow_buffers: int  # unpooled buffers handed out when the pool had no room (never cached)
    overflow_kept_bytes: int  # gauge: bytes of spare overflow buffers kept mapped (at most read_overflow_bytes)
    overflow_reuses: int  # overflow buffers reused from those spares instead of mapped afresh
    buffer_allocations: int  # aligned buffers allocated
    buffer_reuses: int  # buffers reused from the pool

    def as_dict(self) -> dict[str, Any]:
        return _plain(self)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreStats:
    """The whole store (see the module docstring). ``tiers``: tier name -> its figures, in tier order."""

    io_engine: str  # uring | threads
    router: str  # the read router's spec, as configured
    replication: str  # the replication policy's spec, as configured
    puts: int  # chunks accepted by put
    put_bytes: int  # their payload bytes
    put_file_bytes: int  # their chunk-file bytes (header and alignment included)
    puts_duplicate: int  # puts refused: already stored
    puts_dropped_no_memory: int  # puts dropped: host memory was all unwritten chunks
    puts_dropped_unstored: int  # puts refused: half of host memory held puts no tier could take (unstored)
    unstored_chunks: int  # gauge: acknowledged puts with no copy on any tier, kept in host memory until one lands
    unstored_bytes: int  # gauge: their chunk-file bytes
    get_chunks: int  # chunks asked for by reads
    memory_hits: int  # chunks served from host memory
    disk_hits: int  # chunks served from a disk tier
    misses: int  # chunks asked for and not returned (absent, or lost to errors)
    lost_chunks: int  # chunks every holder failed to deliver
    read_steps: int  # multi-tier read steps
    read_seconds: float  # seconds spent in read calls
    verify_seconds: float  # seconds spent verifying payload checksums
    hedged_reads: int  # reads re-issued on another tier after the hedge deadline
    copies_ordered: int  # replicas ordered by the replication policy after reads
    flushes: int  # flush calls (step boundaries)
    stalled_reads: int  # reads still in flight past the hedge deadline when the next step began
    read_into_direct: int  # read_into chunks read with O_DIRECT straight into the caller's buffer
    read_into_copied: int  # read_into chunks read into a pooled buffer and copied
    read_into_abandoned: int  # read_into targets reported busy (a stalled read still owned them)
    write_amplification: float  # bytes written to all tiers / put_file_bytes (0.0 before the first put)
    catch_up_copies: int  # owed replicas the catch-up has started writing
    catch_up_reads: int  # owed replicas it had to read back from another tier first
    catch_up_reads_deferred: int  # read-backs put off because a serving read step was in flight
    catch_up_reads_waited: int  # read-backs put off: host memory had no room to keep them, or backing off
    catch_up_reads_wasted: int  # read-backs host memory did not keep (so no copy followed)
    catch_up_gave_up: int  # debts no longer read back in this process (max_read_backs without being kept)
    owed_journal_compactions: int  # rewrites of the owed-replicas journal while open
    memory: MemoryStats
    tiers: Mapping[str, TierStats]  # read-only

    def __post_init__(self) -> None:
        if not isinstance(self.tiers, MappingProxyType):
            object.__setattr__(self, "tiers", MappingProxyType(dict(self.tiers)))

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: plain dicts, the keys of the fields (``memory`` and ``tiers`` nested)."""
        out = _plain(self)
        out["memory"] = self.memory.as_dict()
        out["tiers"] = {name: t.as_dict() for name, t in self.tiers.items()}
        return out
