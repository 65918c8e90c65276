"""io_uring engine: placeholder until the ctypes ring lands (see issue #2)."""

from __future__ import annotations


def unavailable_reason() -> str | None:
    return "the io_uring engine is not built yet"


class UringEngine:  # pragma: no cover - replaced by the real engine
    name = "uring"
