"""Store configuration: one schema for the Python API, YAML files and the command line.

``StoreConfig.from_any(x)`` takes a :class:`StoreConfig`, a dict, or a path to a YAML file. Every problem is a
:class:`kvstream.errors.ConfigError` naming the field by its dotted path (``tiers[1].capacity_bytes``), with a
suggestion for a misspelt key. Sizes may be ints or strings with a unit (``"4GiB"``, ``"512M"``, ``"256k"``).
Paths must be absolute; in a YAML file a relative path is taken relative to the file's own folder.
Checks that need the file system (folder exists, is writable) run at open, in the tier, and name the field too.

Example (YAML)::

    tiers:
      - {name: local,  path: /nvme/kvstream,   capacity_bytes: 2TiB}
      - {name: shared, path: /lustre/kvstream, capacity_bytes: 20TiB}
    memory_bytes: 64GiB
    router: mitm            # mitm | mitm:M | fixed:R | single:NAME
    replication: full       # full | single | partial:F | lazy | selective
    io_engine: auto         # uring | threads | auto
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any

from kvstream.errors import ConfigError

__all__ = ["TierConfig", "StoreConfig", "FIELD_DOCS", "write_backlog_limit", "parse_size", "parse_tier_specs", "reference_markdown",
           "size_arg"]

# As in fio and dd, a bare letter is binary (4M = 4 MiB); "MB"/"GB" are decimal; "MiB"/"GiB" binary.
_UNITS = {
    "": 1, "b": 1,
    "k": 1024, "kb": 1000, "kib": 1024,
    "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1024**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1024**4, "tb": 1000**4, "tib": 1024**4,
}
_MAX_SIZE = (1 << 63) - 1  # off_t: no file, offset or capacity can be larger
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any, field_name: str) -> int:
    """An int, or a number with a unit: ``K/M/G/T`` and ``KiB/MiB/GiB/TiB`` are powers of 1024, ``KB/MB/GB/TB``
    of 1000 (as in fio). Whole bytes only."""
    if isinstance(value, bool):
        raise ConfigError(field_name, f"expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and (m := _SIZE_RE.match(value)) and m.group(2).lower() in _UNITS:
        exact = Fraction(m.group(1)) * _UNITS[m.group(2).lower()]  # exact: a 400-digit size must not overflow
        if exact > _MAX_SIZE:
            raise ConfigError(field_name, f"{value!r} is beyond what this platform can address (at most {_MAX_SIZE} B)")
        n = int(exact)
        if exact != n:
            raise ConfigError(field_name, f"must be a whole number of bytes, got {value!r}")
    else:
        raise ConfigError(field_name, f"expected a size such as 4096, '512MiB' or '2GB', got {value!r}")
    if n < 0:
        raise ConfigError(field_name, f"must not be negative, got {value!r}")
    if n > _MAX_SIZE:
        raise ConfigError(field_name, f"{value!r} is beyond what this platform can address (at most {_MAX_SIZE} B)")
    return n


def size_arg(text: str) -> int:
    """:func:`parse_size` for argparse (``type=size_arg``): ``4M``, ``48MiB``, ``256K``, ``2GB``."""
    import argparse

    try:
        n = parse_size(text, "size")
    except ConfigError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 4M, 48MiB, 256K, 2GB)") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return n


def _did_you_mean(value: str, known: list[str]) -> str:
    close = difflib.get_close_matches(value, known, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _suggest(key: str, known: list[str]) -> str:
    close = difflib.get_close_matches(key, known, n=1)
    return f"; did you mean '{close[0]}'?" if close else f"; known keys: {', '.join(sorted(known))}"


_NODE_ID_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """One directory tier (node-local NVMe or a shared file system)."""

    name: str
    path: str  # absolute folder; the tier keeps its files and index under it
    capacity_bytes: int  # bytes of chunk files this node may keep there; enforced by eviction
    read_depth: int = 32  # io_uring/threads read ring depth (ops)
    read_inflight_bytes: int = 32 << 20  # bytes of reads in flight at once; the router's claim window
    write_depth: int = 8
    write_inflight_bytes: int = 64 << 20
    # Bytes of this tier's writes submitted and not yet finished beyond which a *second* copy of a chunk is
    # skipped (counted as write_skipped_backlog) rather than queued: a slow shared tier must not fill host
    # memory with chunks waiting for it and stall the serving loop's puts. The first copy is always written.
    # None: half of the store's host memory.
    write_backlog_bytes: int | None = None
    eviction: str = "lru"
    direct_io: str = "auto"  # "on" (fail if the FS refuses O_DIRECT), "off", or "auto" (on where possible)
    fsync: bool = False  # fsync each chunk before publishing it (checksums already stop torn data being used)
    shared: bool = False  # other nodes write here too: refresh the index from their logs
    # The folder must be on a mounted file system, not the root one (null: true for shared tiers), checked at
    # open before anything is created (kvstream.tiers.mounts); mount_point: on the one mounted exactly there.
    require_mount: bool | None = None
    mount_point: str | None = None


@dataclass(frozen=True, kw_only=True)
class StoreConfig:
    tiers: tuple[TierConfig, ...]
    memory_bytes: int = 1 << 30  # host-memory tier: clean cached chunks plus buffered writes
    # Buffers kept for reads that land while host memory is full (None: memory_bytes; 0: map each afresh).
    read_overflow_bytes: int | None = None
    router: str = "mitm"
    replication: str = "full"
    io_engine: str = "auto"
    memory_eviction: str = "lru"
    verify_reads: bool = True  # check each payload's checksum before returning it
    create_dirs: bool = False  # create missing tier folders instead of failing
    chunk_bytes: int | None = None  # expected payload size; when given, capacities are checked against it
    hedge_after_s: float | None = None  # re-issue a read on another replica after this long (None: off)
    # "balanced": size each tier's read window by its measured speed so all drain together (read_windows.py);
    # "fixed": every tier keeps its read_inflight_bytes.
    read_windows: str = "balanced"
    node_id: str = field(default_factory=lambda: os.uname().nodename)  # a label; identity is node_state_path's id
    # File holding this node's persistent random id on shared tiers (None: the first node-local tier's folder,
    # else ~/.local/state/kvstream/node-id-<host>). Must not be on a shared file system: each node needs its own.
    node_state_path: str | None = None
    # close() waits this long for writes still in flight; past it, a stalled tier is closed in the background
    # and close() reports it (None: wait for ever).
    close_timeout_s: float | None = 60.0
    # A tier that fails its mount check (require_mount / mount_point) is a ConfigError (false) or opened down,
    # loudly, while the other tiers serve (true; the LMCache plugin's default).
    skip_unmounted_tiers: bool = False
    # Lower the interpreter's thread switch interval to this at open (process-wide, never raised; None: leave it).
    # Each chunk read passes the GIL between threads several times: kvstream.io.switch_interval.
    python_switch_interval_s: float | None = None

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_any(cls, config: "StoreConfig | Mapping[str, Any] | str | os.PathLike[str]") -> "StoreConfig":
        if isinstance(config, StoreConfig):
            config.validate()
            return config
        if isinstance(config, Mapping):
            return cls.from_dict(config)
        if isinstance(config, (str, os.PathLike)):
            return cls.from_yaml(config)
        raise ConfigError("<config>", f"expected a StoreConfig, a dict or a YAML path, got {type(config).__name__}")

    @classmethod
    def from_yaml(cls, path: "str | os.PathLike[str]") -> "StoreConfig":
        import yaml

        p = Path(path)
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError("<config file>", f"cannot read {p}: {exc.strerror or exc}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError("<config file>", f"{p} is not valid YAML: {exc}") from None
        if not isinstance(data, Mapping):
            raise ConfigError("<config file>", f"{p} must hold a mapping at the top level")
        return cls.from_dict(data, base_dir=p.resolve().parent)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, base_dir: Path | None = None) -> "StoreConfig":
        known = [f.name for f in dataclasses.fields(cls)]
        for key in data:
            if key not in known:
                raise ConfigError(str(key), "unknown key" + _suggest(str(key), known))
        if "tiers" not in data:
            raise ConfigError("tiers", "required: a list of {name, path, capacity_bytes}")
        raw_tiers = data["tiers"]
        if not isinstance(raw_tiers, (list, tuple)) or not raw_tiers:
            raise ConfigError("tiers", "must be a non-empty list of {name, path, capacity_bytes}")
        tiers = tuple(_tier_from_dict(t, f"tiers[{i}]", base_dir) for i, t in enumerate(raw_tiers))
        kw: dict[str, Any] = {"tiers": tiers}
        for key, value in data.items():
            if key == "tiers":
                continue
            kw[key] = _coerce(cls, key, value, key)
        cfg = cls(**kw)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Checks that need no file system access."""
        names = [t.name for t in self.tiers]
        for i, t in enumerate(self.tiers):
            if names.count(t.name) > 1:
                raise ConfigError(f"tiers[{i}].name", f"duplicate tier name {t.name!r}")
        if self.memory_bytes < 1 << 20:
            raise ConfigError("memory_bytes", f"must be at least 1 MiB, got {self.memory_bytes}")
        if self.read_overflow_bytes is not None and self.read_overflow_bytes < 0:
            raise ConfigError("read_overflow_bytes", f"must be a size >= 0 (or null: memory_bytes), "
                                                     f"got {self.read_overflow_bytes}")
        if self.chunk_bytes is not None:
            from kvstream.format import file_size

            need = file_size(self.chunk_bytes)
            for i, t in enumerate(self.tiers):
                if t.capacity_bytes < need:
                    raise ConfigError(f"tiers[{i}].capacity_bytes",
                                      f"{t.capacity_bytes} B is below one chunk ({need} B on storage)")
            if self.memory_bytes < need:
                raise ConfigError("memory_bytes", f"{self.memory_bytes} B is below one chunk ({need} B)")
        if self.close_timeout_s is not None and not (0 <= self.close_timeout_s < math.inf):
            raise ConfigError("close_timeout_s", f"must be a number of seconds >= 0 (or null to wait for ever), "
                                                 f"got {self.close_timeout_s}")
        if self.hedge_after_s is not None and not (0 < self.hedge_after_s < math.inf):
            raise ConfigError("hedge_after_s", f"must be a positive number of seconds (or null to turn hedging off), "
                                               f"got {self.hedge_after_s}")
        if self.python_switch_interval_s is not None:
            from kvstream.io.switch_interval import check_switch_interval

            why = check_switch_interval(self.python_switch_interval_s)
            if why is not None:
                raise ConfigError("python_switch_interval_s", why + " (or null to leave the interpreter's)")
        if not _NODE_ID_RE.fullmatch(self.node_id) or self.node_id in (".", ".."):
            raise ConfigError("node_id", f"must be 1-64 letters, digits or _.- (it names files on shared tiers), "
                                         f"got {self.node_id[:80]!r}")
        for i, t in enumerate(self.tiers):
            for fname in ("read_inflight_bytes", "write_inflight_bytes"):
                if getattr(t, fname) < 4096:
                    raise ConfigError(f"tiers[{i}].{fname}", f"must be at least 4096 B (one read or write must fit), "
                                                             f"got {getattr(t, fname)}")
            for j in range(i):
                a, b = Path(self.tiers[j].path), Path(t.path)
                if a == b or a in b.parents or b in a.parents:
                    raise ConfigError(f"tiers[{i}].path", f"{t.path} is {'the same folder as' if a == b else 'nested with'} "
                                                          f"tiers[{j}].path {self.tiers[j].path}: each tier needs its own "
                                                          "folder, or 'full' replication keeps one file for two copies")
        # Parse the policy specs now so a typo fails at open, naming the field.
        from kvstream.io.engine import make_engine  # noqa: F401  (import check only)
        from kvstream.replication import parse_replication
        from kvstream.routing import parse_router

        parse_router(self.router, names)
        parse_replication(self.replication)
        if self.io_engine not in ("uring", "threads", "auto"):
            raise ConfigError("io_engine", f"unknown engine {self.io_engine!r}; expected uring, threads or auto")
        from kvstream.eviction import eviction_policy_names

        usable = [n for n in eviction_policy_names() if n != "belady"]
        for fname, pol in [("memory_eviction", self.memory_eviction)] + [
            (f"tiers[{i}].eviction", t.eviction) for i, t in enumerate(self.tiers)
        ]:
            if pol == "belady":  # needs every future access: an offline bound for the simulator and studies
                raise ConfigError(fname, "'belady' needs future knowledge; it exists in the simulator only. "
                                         f"Known here: {', '.join(usable)}")
            if pol not in usable:
                raise ConfigError(fname, f"unknown eviction policy {pol!r}{_did_you_mean(pol, usable)}; "
                                         f"known: {', '.join(usable)}")
        from kvstream.read_windows import READ_WINDOW_POLICIES

        if self.read_windows not in READ_WINDOW_POLICIES:
            raise ConfigError("read_windows", f"unknown policy {self.read_windows!r}{_did_you_mean(self.read_windows, list(READ_WINDOW_POLICIES))}; "
                                              f"known: {', '.join(READ_WINDOW_POLICIES)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def write_backlog_limit(self, tier: TierConfig) -> int:
        """The write backlog valve's limit of ``tier`` in bytes: its ``write_backlog_bytes``, or half of host memory
        when that is not set (replay's staging budget and the simulator's model of a store take it from here)."""
        return write_backlog_limit(tier.write_backlog_bytes, self.memory_bytes)


def write_backlog_limit(write_backlog_bytes: int | None, memory_bytes: int) -> int:
    """The one rule for a tier's write backlog valve limit (bytes): its ``write_backlog_bytes`` if set, else half
    of host memory (``memory_bytes``). The store's writer, replay's staging budget and the simulator's model of a
    store all take it from here."""
    return write_backlog_bytes if write_backlog_bytes is not None else memory_bytes // 2


# One line per field: what docs/config.md says it means (``reference_markdown``). A test fails when a field of
# TierConfig or StoreConfig has no entry here, or when docs/config.md is not what reference_markdown() returns.
FIELD_DOCS: dict[str, str] = {
    "TierConfig.name": "the tier's name (1-32 letters, digits or `_.-`), used by routers, stats and metrics",
    "TierConfig.path": "absolute folder; the tier keeps its chunk files and index under it "
                       "(in a YAML file a relative path is relative to the file)",
    "TierConfig.capacity_bytes": "bytes of chunk files this node may keep there; enforced by eviction",
    "TierConfig.read_depth": "io_uring / threads read ring depth (operations)",
    "TierConfig.read_inflight_bytes": "bytes of reads in flight at once: the router's claim window",
    "TierConfig.write_depth": "write ring depth (operations)",
    "TierConfig.write_inflight_bytes": "bytes of writes in flight at once",
    "TierConfig.write_backlog_bytes": "while this tier's submitted, unfinished writes exceed it, a *second* copy "
                                      "of a chunk is skipped (counted as `write_skipped_backlog`) instead of "
                                      "queued, so a slow shared tier cannot fill host memory or stall puts; the "
                                      "first copy is always written. Default (null): half of `memory_bytes`",
    "TierConfig.eviction": "eviction policy of the tier (`lru`, ...; `belady` is simulator-only)",
    "TierConfig.direct_io": "`on` (fail if the file system refuses O_DIRECT), `off`, or `auto` (on where possible)",
    "TierConfig.fsync": "fsync each chunk before publishing it (checksums already stop torn data being used)",
    "TierConfig.shared": "every node writes this one folder: each counts and evicts only its own chunks "
                         "(capacity is a per-node quota) and follows the others' index logs (docs/shared-tier.md)",
    "TierConfig.require_mount": "the folder must be on a mounted file system, not the root one (`/`); checked at "
                                "open before anything is created, so a store started before its shared file "
                                "system is mounted never writes under the empty mount point. Default (null): true "
                                "for `shared` tiers, false otherwise",
    "TierConfig.mount_point": "the folder must be on the file system mounted exactly at this path (stricter than "
                              "`require_mount`; the path must be a mount point and hold the folder)",
    "StoreConfig.tiers": "the directory tiers, fastest (node-local) first; each takes the per-tier keys below",
    "StoreConfig.memory_bytes": "the store's host-memory tier: clean cached chunks plus buffered writes "
                                "(at least 1 MiB)",
    "StoreConfig.read_overflow_bytes": "a read that lands while host memory is full (chunks pinned by callers or "
                                       "not yet written) gets a buffer outside `memory_bytes`; up to this many "
                                       "bytes of such buffers are kept and reused once their readers let go, "
                                       "instead of mapping (and first touching) fresh memory for every such read. "
                                       "Default (null): equal to `memory_bytes`; 0: keep none",
    "StoreConfig.router": "how a step's reads are split over tiers: `mitm` | `mitm:M` | `fixed:R` | `single:NAME`",
    "StoreConfig.replication": "which tiers get a copy of each chunk: `full` | `single` | `partial:F` | `lazy` | "
                               "`selective`. With `full` and a `shared` tier after the first, a chunk read without "
                               "a copy on the first tier (another node's) gets one there (read-through)",
    "StoreConfig.io_engine": "`uring` | `threads` | `auto`",
    "StoreConfig.memory_eviction": "eviction policy of the host-memory tier (`lru`, `hit-potential`, ...)",
    "StoreConfig.verify_reads": "check each payload's checksum before returning it",
    "StoreConfig.create_dirs": "create missing tier folders instead of failing",
    "StoreConfig.chunk_bytes": "expected payload size; when given, capacities are checked against it at open",
    "StoreConfig.hedge_after_s": "re-issue a read on another replica after this many seconds (null: off)",
    "StoreConfig.read_windows": "`balanced`: size each tier's read window by its measured speed so all drain "
                                "together; `fixed`: every tier keeps its `read_inflight_bytes`",
    "StoreConfig.node_id": "this node's name for people (in its lease files on shared tiers); identity is the "
                           "persistent id in `node_state_path`",
    "StoreConfig.node_state_path": "file keeping this node's persistent random id for shared tiers (null: "
                                   "`node-id` in the first node-local tier's folder, else "
                                   "`~/.local/state/kvstream/node-id-<host name>`); never on a shared file system",
    "StoreConfig.skip_unmounted_tiers": "a tier failing its mount check (`require_mount`, `mount_point`) is "
                                        "opened down (never read or written; logged, `kvstream_tier_down`) while "
                                        "the other tiers serve, instead of refusing to open (under LMCache the "
                                        "default is true). Tiers whose file system fails at open (full, read-only, "
                                        "dead) are always opened down when another tier opens",
    "StoreConfig.python_switch_interval_s": "lower Python's thread switch interval (`sys.setswitchinterval`) to "
                                            "this many seconds at open, process-wide and never raised (null: "
                                            "leave it). Each chunk read hands the GIL between threads several "
                                            "times; at the default 5 ms a busy Python thread halved reads "
                                            "(0.001 is what the benchmarks use; BENCHMARKS.md)",
    "StoreConfig.close_timeout_s": "how long close() waits for writes in flight; a stalled tier past it is closed "
                                   "in the background and named in close()'s report (null: wait for ever)",
}


def reference_markdown() -> str:
    """docs/config.md: every key of :class:`StoreConfig`, :class:`TierConfig` and the LMCache plugin, with its
    type, default and meaning, and the ``kvstream.*`` key that sets it under LMCache. Regenerate with
    ``python scripts/config_reference.py``."""
    from kvstream.integrations._lmcache_config import KEY_DEFAULTS, KEYS, PLUGIN_KEYS, PREFIX, STORE_KEYS

    def typ(f: "dataclasses.Field[Any]") -> str:
        t = str(f.type)
        if f.name in _SIZE_FIELDS:
            t = t.replace("int", "size")
        return t.replace("tuple[TierConfig, ...]", "list of tiers").replace(" | None", " or null")

    def dflt(f: "dataclasses.Field[Any]") -> str:
        if f.default is not dataclasses.MISSING:
            v = f.default
            if v is None:
                return "null"
            if isinstance(v, bool):
                return str(v).lower()
            if f.name in _SIZE_FIELDS and isinstance(v, int):
                return _size_text(v)
            return f"`{v}`"
        if f.default_factory is not dataclasses.MISSING:
            return "the host's name" if f.name == "node_id" else "(computed)"
        return "required"

    def row(*cells: str) -> str:  # a "|" inside a cell (mitm | fixed:R) must not end it
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    def lm(cls_name: str, name: str) -> str:
        key = STORE_KEYS.get(f"{cls_name}.{name}")
        if not key:
            return "via `kvstream.config_file`"
        plugin = PLUGIN_KEYS[key]
        if plugin.plugin_default is not None:
            return f"`{PREFIX}{key}` (default {str(plugin.plugin_default).lower()} under LMCache)"
        if plugin.tiers_default is None:
            return f"`{PREFIX}{key}`"
        return f"`{PREFIX}{key}` (default {str(plugin.tiers_default).lower()} with `{PREFIX}tiers`)"

    lines = [
        "<!-- Generated by `python scripts/config_reference.py`; edit FIELD_DOCS in src/kvstream/config.py",
        "     or PLUGIN_KEYS in src/kvstream/integrations/_lmcache_config.py, not this file. -->",
        "# Configuration reference",
        "",
        "One schema for the Python API (`kvstream.open_store(dict | StoreConfig | YAML path)`), YAML files and the",
        "LMCache plugin. Unknown keys and bad values fail at open with an error naming the field. Sizes are ints or",
        "strings with a unit: `K/M/G/T` and `KiB/MiB/GiB/TiB` are powers of 1024, `KB/MB/GB/TB` of 1000.",
        "",
        "Under LMCache the keys go into `extra_config` (YAML) or, as JSON, into the environment variable",
        "`LMCACHE_EXTRA_CONFIG` (see [lmcache.md](lmcache.md)); there are no other environment variables.",
        "Store keys without a `kvstream.*` key of their own are set through a kvstream YAML file named by",
        "`kvstream.config_file`; `kvstream.*` keys override that file.",
        "",
    ]
    for cls, title in ((StoreConfig, "## Store (`StoreConfig`)"), (TierConfig, "## Each tier (`TierConfig`, under `tiers:`)")):
        lines += [title, "", "| key | type | default | meaning | LMCache key |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            doc = FIELD_DOCS[f"{cls.__name__}.{f.name}"]
            lines.append(row(f"`{f.name}`", typ(f), dflt(f), doc, lm(cls.__name__, f.name)))
        lines.append("")
    lines += ["## LMCache plugin only (`extra_config`, or JSON in `LMCACHE_EXTRA_CONFIG`)", "",
              "All optional except one of `kvstream.tiers` / `kvstream.config_file`.", "",
              "| key | type | default | meaning |", "|---|---|---|---|"]
    for key, meaning in KEYS.items():
        if key in KEY_DEFAULTS:
            t, d = KEY_DEFAULTS[key]
            lines.append(row(f"`{PREFIX}{key}`", t, d, meaning))
    lines.append("")
    return "\n".join(lines)


def _size_text(n: int) -> str:
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k and n % (1 << k) == 0:
            return f"{n >> k} {unit}"
    return f"{n} B"


_SIZE_FIELDS = {"capacity_bytes", "memory_bytes", "read_overflow_bytes", "chunk_bytes", "read_inflight_bytes",
                "write_inflight_bytes", "write_backlog_bytes"}


def _coerce(cls: type, key: str, value: Any, field_name: str) -> Any:
    """Convert a raw config value to the dataclass field's type, or raise naming the field."""
    ftype = {f.name: f.type for f in dataclasses.fields(cls)}[key]
    if value is None and "None" in str(ftype):
        return None
    if key in _SIZE_FIELDS:
        if value is None and "None" in str(ftype):
            return None
        return parse_size(value, field_name)
    if ftype in ("int", int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(field_name, f"expected an integer, got {value!r}")
        if value < 1:
            raise ConfigError(field_name, f"must be at least 1, got {value}")
        if value > 32768:  # ring depths: the kernel caps io_uring entries at 32768
            raise ConfigError(field_name, f"must be at most 32768, got {value}")
        return value
    if ftype in ("bool", bool, "bool | None"):
        if not isinstance(value, bool):
            raise ConfigError(field_name, f"expected true or false, got {value!r}")
        return value
    if "float" in str(ftype):
        if value is None and "None" in str(ftype):
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(field_name, f"expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an int with hundreds of digits
            raise ConfigError(field_name, f"must be a finite number, got {value!r}") from None
        if not math.isfinite(number):
            raise ConfigError(field_name, f"must be a finite number, got {value!r}")
        return number
    if not isinstance(value, str):
        raise ConfigError(field_name, f"expected a string, got {value!r}")
    return value


def _tier_from_dict(raw: Any, prefix: str, base_dir: Path | None) -> TierConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, "must be a mapping with name, path and capacity_bytes")
    known = [f.name for f in dataclasses.fields(TierConfig)]
    for key in raw:
        if key not in known:
            raise ConfigError(f"{prefix}.{key}", "unknown key" + _suggest(str(key), known))
    for req in ("name", "path", "capacity_bytes"):
        if req not in raw:
            raise ConfigError(f"{prefix}.{req}", "required")
    kw = {k: _coerce(TierConfig, k, v, f"{prefix}.{k}") for k, v in raw.items()}
    if not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}", kw["name"]):
        raise ConfigError(f"{prefix}.name", f"must be 1-32 letters, digits or _.-, got {kw['name']!r}")
    path = kw["path"]
    if not path:
        raise ConfigError(f"{prefix}.path", "must not be empty")
    if "\0" in path:
        raise ConfigError(f"{prefix}.path", f"contains a NUL character: {path!r}")
    if not os.path.isabs(path):
        if base_dir is None:
            raise ConfigError(f"{prefix}.path", f"must be an absolute path, got {path!r} "
                                                f"(did you mean {os.path.abspath(path)!r}?)")
        path = str((base_dir / path).resolve())
    kw["path"] = os.path.normpath(path)
    if kw["capacity_bytes"] <= 0:
        raise ConfigError(f"{prefix}.capacity_bytes", "must be positive")
    mp = kw.get("mount_point")
    if mp is not None:
        if not mp or "\0" in mp:
            raise ConfigError(f"{prefix}.mount_point", f"must be a folder path, got {mp!r}")
        if not os.path.isabs(mp):
            if base_dir is None:
                raise ConfigError(f"{prefix}.mount_point", f"must be an absolute path, got {mp!r}")
            mp = str((base_dir / mp).resolve())
        mp = kw["mount_point"] = os.path.normpath(mp)
        if not (Path(kw["path"]) == Path(mp) or Path(mp) in Path(kw["path"]).parents):
            raise ConfigError(f"{prefix}.mount_point", f"{mp} does not hold the tier's path {kw['path']}")
    if kw.get("direct_io", "auto") not in ("auto", "on", "off"):
        raise ConfigError(f"{prefix}.direct_io", f"expected auto, on or off, got {kw['direct_io']!r}")
    return TierConfig(**kw)


def parse_tier_specs(specs: list[str], *, capacity_bytes: int, field_name: str = "--tier") -> list[dict[str, Any]]:
    """``["local=/nvme/kv", "shared=/lustre/kv"]`` (or one comma-separated string) -> tier dicts.

    Used by the CLI's ``--tier NAME=PATH`` and LMCache's ``kvstream.tiers``; relative paths become absolute.
    """
    out = []
    for spec in (s.strip() for item in specs for s in item.split(",")):
        if not spec:
            continue
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ConfigError(field_name, f"expected NAME=PATH, got {spec!r}")
        out.append({"name": name, "path": os.path.abspath(path), "capacity_bytes": capacity_bytes})
    if not out:
        raise ConfigError(field_name, "no tiers given")
    return out
