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

__all__ = [
    "KVStreamError",
    "ConfigError",
    "UsageError",
    "NothingMeasuredError",
    "StoreClosedError",
    "TierError",
    "CorruptChunkError",
    "InputFormatError",
]


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
