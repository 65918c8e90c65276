"""File I/O for the tiers: aligned host buffers and submission rings (io_uring or a thread pool).

Layering: a tier owns its rings (one for reads, one for writes, so a burst of deferred writes never sits in
front of a step's reads); a ring owns nothing but its in-flight operations; buffers belong to the pool and are
lent to an operation for its duration.
"""

from kvstream.io.buffers import AlignedBuffer, BufferPool, ALIGN
from kvstream.io.engine import IOOp, OpKind, Ring, IOEngine, make_engine, available_engines

__all__ = [
    "ALIGN",
    "AlignedBuffer",
    "BufferPool",
    "IOOp",
    "OpKind",
    "Ring",
    "IOEngine",
    "make_engine",
    "available_engines",
]
