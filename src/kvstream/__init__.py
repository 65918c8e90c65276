"""kvstream: a multi-tier KV-cache storage engine for LLM serving.

Open a store with :func:`open_store`; see the README for the configuration schema.
"""

from kvstream.config import StoreConfig, TierConfig
from kvstream.errors import (
    ConfigError,
    CorruptChunkError,
    InputFormatError,
    KVStreamError,
    StoreClosedError,
    TierError,
    UsageError,
)
from kvstream.format import ChunkMeta
from kvstream.keys import ChunkKeyer, KeyNamespace
from kvstream.stats import MemoryStats, StoreStats, TierStats
from kvstream.store import Chunk, CloseReport, Store, open_store

__version__ = "0.1.0"

__all__ = [
    "open_store",
    "Store",
    "Chunk",
    "CloseReport",
    "StoreStats",
    "TierStats",
    "MemoryStats",
    "StoreConfig",
    "TierConfig",
    "ChunkMeta",
    "ChunkKeyer",
    "KeyNamespace",
    "KVStreamError",
    "ConfigError",
    "UsageError",
    "StoreClosedError",
    "TierError",
    "CorruptChunkError",
    "InputFormatError",
]
