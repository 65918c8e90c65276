"""Checks shared by the line-oriented trace readers."""

from __future__ import annotations

import re

from kvstream.errors import InputFormatError

__all__ = ["check_utf8", "check_physical", "MAX_TRACE_SECONDS", "MAX_TOKENS", "MAX_ROUNDS"]

# Bounds of physical sense for a serving trace. Past them a value is a typo or garbage, and taking it would
# make a replay wait for centuries of trace time or a study overflow int64 when it sums contexts.
MAX_TRACE_SECONDS = 366 * 86400  # a trace spans at most a year
MAX_TOKENS = 1 << 24  # 16.7M tokens in one request's input or answer (the longest context windows are ~10M)
MAX_ROUNDS = 1 << 20  # turns of one conversation

# Trace files are read with errors="surrogateescape", which maps each byte that is not UTF-8 to U+DC80..U+DCFF;
# strict UTF-8 never decodes to those code points, so finding one means the line held such a byte.
_UNDECODABLE = re.compile("[\udc80-\udcff]")


def check_utf8(path: str, line: int, text: str) -> None:
    """Raise :class:`InputFormatError` if ``text`` (decoded with ``errors="surrogateescape"``) held bytes that
    are not UTF-8; the column counts characters, as the JSON decoder's does."""
    if text.isascii():  # the common case, checked in C without a regex scan
        return
    m = _UNDECODABLE.search(text)
    if m is not None:
        byte = ord(m.group()) - 0xDC00
        raise InputFormatError(path, line, f"not valid UTF-8: byte 0x{byte:02x} at column {m.start() + 1}")


def check_physical(path: str, line: int, name: str, value: int, limit: int, unit: str) -> None:
    """Raise :class:`InputFormatError` naming the field if ``value`` is beyond ``limit`` (see the bounds above)."""
    if value > limit:
        raise InputFormatError(path, line, f"field {name!r} is {value} {unit}, beyond physical sense (at most {limit})")
