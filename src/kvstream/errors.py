"""Errors, typed by who is at fault.

- :class:`ConfigError` and :class:`UsageError`: the caller got something wrong (a bad config field, a call on
  a closed store). They name the field or the object and the rule that was broken.
  :class:`NothingMeasuredError` (a UsageError): a benchmark's run measured nothing of what it reports.
- :class:`TierError`: a storage tier failed (EIO, ENOSPC, a vanished mount). The engine handles these itself
  on the serving path (another replica, a miss, a skipped copy); they escape only from administrative calls.
- :class:`CorruptChunkError`: bytes on storage are not a valid chunk (bad magic, truncated, checksum mismatch).
  Never returned as data; the read path turns it into a miss or a read of the other replica.
- :class:`InputFormatError`: a trace or other input file has a bad line; names the file and line number.

Expected shortages ("no free buffer", "tier full") are return values, not exceptions.
"""

from __future__ import annotations

import errno as _errno

__all__ = [
    "GONE",
    "NO_SPACE",
    "WRITE_RETRY",
    "SHORTAGE",
    "CONFIG_ERRNOS",
    "TierUnavailable",
    "KVStreamError",
    "ConfigError",
    "UsageError",
    "NothingMeasuredError",
    "StoreClosedError",
    "TierError",
    "CorruptChunkError",
    "InputFormatError",
]

# ── errno rules: what an OSError from a tier's file system means, in one place ──────────────────────────────
# Every errno not named here is a fault of the tier: counted, a circuit-breaker failure, the copy owed (writes)
# or the other replica read (reads). FUSE file systems (GlusterFS, ceph-fuse) return more than local ones do.

#: The name, or the file under a handle, is not there: a peer deleted it, or a network file system's client has
#: not caught up. A read that meets it is a miss (never a tier failure). ENODATA: GlusterFS's FUSE client answers
#: it for a file whose metadata (its gfid xattr) is gone or not there yet, as when a peer deletes or re-creates it.
GONE = frozenset({_errno.ENOENT, _errno.ESTALE, _errno.ENODATA})
#: Out of room (blocks or inodes; quota): make room by eviction and retry the write once.
NO_SPACE = frozenset({_errno.ENOSPC, _errno.EDQUOT})
#: A write that met a stale or half-made name on a shared tier (a peer's delete, a folder re-created, GlusterFS's
#: ENODATA while a file's metadata settles): a new temporary usually works; retried once, counted
#: (``write_retried_stale``); a second failure is a write error.
WRITE_RETRY = frozenset({_errno.ESTALE, _errno.ENODATA})
#: This process is short of something (descriptors, memory): a miss or a skipped copy, no tier blamed.
SHORTAGE = frozenset({_errno.EMFILE, _errno.ENFILE, _errno.ENOMEM})
#: At open, errors that mean the configuration is wrong (refused with a ConfigError naming the field); any other
#: errno while opening a tier means the tier is failing (full, read-only, dead, disconnected): the store opens
#: without it (``TierUnavailable``), and the healthy tiers serve.
CONFIG_ERRNOS = frozenset({_errno.EACCES, _errno.EPERM, _errno.ENOTDIR, _errno.ELOOP, _errno.ENAMETOOLONG,
                           _errno.EINVAL, _errno.EEXIST})


class KVStreamError(Exception):
    """Base of every error kvstream raises on purpose."""


class ConfigError(KVStreamError, ValueError):
    """A configuration value is wrong. ``field`` is its dotted path, e.g. ``tiers[1].capacity_bytes``."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(f"config field '{field}': {message}")


class UsageError(KVStreamError, ValueError):
    """The API was called in a way its contract forbids (wrong type, out-of-range argument)."""


class NothingMeasuredError(UsageError):
    """A measuring command (``replay``, ``simulate``, ``bench``) could not measure what its output claims: an empty
    workload, a tier below one chunk, a system that served no request, wrote nothing or read nothing from disk.
    The message names the cause and the option to change; the command exits non-zero (2) instead of printing a
    table that looks like a result."""


class StoreClosedError(UsageError):
    """A call reached a store (or tier, or ring) after ``close()``."""


class TierError(KVStreamError, OSError):
    """A storage tier failed an operation. ``tier`` names it; ``errno`` is the OS error number if any."""

    def __init__(self, tier: str, op: str, err: int | None, message: str) -> None:
        self.tier = tier
        self.op = op
        super().__init__(err or 0, f"tier '{tier}': {op} failed: {message}")


class TierUnavailable(ConfigError):
    """A tier could not be opened because its file system is failing or absent, not because the configuration is
    wrong: full (ENOSPC, EDQUOT, out of inodes), read-only, dead (EIO), disconnected, or (``unmounted``) the
    folder is not on the file system it must be on. The store opens without it (marked down) when another tier
    opens; ``unmounted`` ones only with ``skip_unmounted_tiers``. ``errno`` as for any ``OSError`` cause."""

    def __init__(self, field: str, message: str, *, err: int | None = None, unmounted: bool = False) -> None:
        super().__init__(field, message)
        self.errno = err
        self.unmounted = unmounted


class CorruptChunkError(KVStreamError):
    """Bytes that should hold a chunk do not: ``where`` names the file (or buffer), ``reason`` the check that failed."""

    def __init__(self, where: str, reason: str) -> None:
        self.where = where
        self.reason = reason
        super().__init__(f"corrupt chunk {where}: {reason}")


class InputFormatError(KVStreamError, ValueError):
    """A line of an input file (trace, key list) cannot be parsed."""

    def __init__(self, path: str, line: int, message: str) -> None:
        self.path = path
        self.line = line
        super().__init__(f"{path}:{line}: {message}")
