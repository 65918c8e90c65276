"""Checks shared by the line-oriented trace readers."""

from __future__ import annotations

import re

from kvstream.errors import InputFormatError

__all__ = ["check_utf8"]

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
