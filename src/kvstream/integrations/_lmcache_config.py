"""The LMCache plugin's settings: ``extra_config`` keys under ``kvstream.`` -> :class:`PluginOptions`.

LMCache hands a plugin its whole ``extra_config`` dict (from YAML, or JSON in ``LMCACHE_EXTRA_CONFIG``), so
values arrive as strings, ints, floats or bools; every key is parsed here and every error is a
:class:`kvstream.errors.ConfigError` whose field is the ``kvstream.*`` key the user has to fix. That matters
more than usual: LMCache catches a plugin constructor's exception, logs ``Failed to create backend <name>:
<message>`` and runs on without the plugin, so the message is all the user gets -- unless
``kvstream.strict`` is set (:func:`strict_mode`, read before anything else): then the plugin makes that failure
stop LMCache's start instead.

The store's settings come from ``kvstream.config_file`` (a kvstream YAML file, the schema of
``kvstream.open_store``), ``kvstream.tiers`` (``"local=PATH,shared=PATH"``, with ``kvstream.capacity_bytes``),
or both (the keys win over the file). A nested form ``extra_config: {kvstream: {tiers: ...}}`` is accepted too.
No LMCache or torch import here.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstream.config import StoreConfig, parse_size, parse_tier_specs
from kvstream.errors import ConfigError

__all__ = ["PREFIX", "PLUGIN_KEYS", "PluginKey", "KEYS", "KEY_DEFAULTS", "STORE_KEYS", "MIN_PENDING_BYTES",
           "pending_write_default", "PluginOptions", "RecomputeOptions", "parse_extra_config", "attribute_error",
           "flatten", "strict_mode"]

PREFIX = "kvstream."

# The smallest default of kvstream.max_pending_write_bytes (a tiny LMCache CPU pool still gets a useful budget).
MIN_PENDING_BYTES = 64 << 20


def pending_write_default(max_local_cpu_size_gb: float) -> int:
    """The default of ``kvstream.max_pending_write_bytes``: a quarter of LMCache's CPU pool
    (``max_local_cpu_size``, GB), so pending writes never starve LMCache's own allocations, and at least
    :data:`MIN_PENDING_BYTES`."""
    return max(int(float(max_local_cpu_size_gb) * (1 << 30)) // 4, MIN_PENDING_BYTES)


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginKey:
    """One ``kvstream.*`` key of LMCache's ``extra_config``: the one source of its meaning and default.

    ``doc``: one line, for docs/config.md and for error messages. A key that sets the store field of the same
    name (``store=True``) takes its type and default from :class:`StoreConfig` / :class:`TierConfig`. Any other
    key has a ``type`` (for the docs) and either a ``default``, the value :func:`parse_extra_config` uses when the
    key is absent (it reads it from here), or ``absent``: what leaving the key out means when there is no value
    (a feature off, another key required, a default computed from LMCache's own settings)."""

    doc: str
    type: str = ""
    default: str | int | float | bool | None = None
    absent: str = ""
    store: bool = False
    # store keys only: the value the plugin gives the field when the tiers come from kvstream.tiers (create_dirs:
    # folders named inline are created), where the store's own default would refuse a missing folder
    tiers_default: bool | None = None
    # store keys only: the value the plugin always gives the field unless the key is set (the store's own default
    # suits a Python caller; under LMCache another is safer, e.g. an unmounted shared tier opened down)
    plugin_default: bool | None = None

    def default_text(self) -> str:
        """The default as docs/config.md shows it."""
        if self.store:
            raise ValueError("a store key's default is its StoreConfig/TierConfig field's")
        if self.absent:
            return self.absent
        v = self.default
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return f'`"{v}"`'
        if isinstance(v, float) and v.is_integer():
            return str(int(v))
        return str(v)


# key (without the prefix) -> its PluginKey, in the order docs/config.md lists them
PLUGIN_KEYS: dict[str, PluginKey] = {
    "config_file": PluginKey(doc="a kvstream YAML file (tiers, memory_bytes, router, replication, io_engine, ...)",
                             type="path", absent="—"),
    "tiers": PluginKey(doc="NAME=PATH,NAME=PATH: directory tiers, fastest (node-local) first",
                       type="`NAME=PATH,...`", absent="—"),
    "capacity_bytes": PluginKey(doc="size of chunk files kept per tier: one size ('2TiB') or NAME=SIZE,NAME=SIZE",
                                type="size or `NAME=SIZE,...`", absent="— (required with `kvstream.tiers`)"),
    "memory_bytes": PluginKey(doc="the store's own host-memory tier (buffered writes and clean chunks)", store=True),
    "router": PluginKey(doc="mitm | mitm:M | fixed:R | single:NAME", store=True),
    "replication": PluginKey(doc="full | single | partial:F | lazy | selective", store=True),
    "io_engine": PluginKey(doc="uring | threads | auto", store=True),
    "create_dirs": PluginKey(doc="create missing tier folders", store=True, tiers_default=True),
    "verify_reads": PluginKey(doc="check each chunk's checksum before LMCache sees it", store=True),
    "hedge_after_s": PluginKey(doc="re-read a slow chunk from another replica after this many seconds", store=True),
    "python_switch_interval_s": PluginKey(
        doc="lower Python's thread switch interval to this many seconds (process-wide, never raised): each chunk "
            "read hands the GIL between threads several times, and vLLM's own threads hold it", store=True),
    "namespace": PluginKey(doc="extra string mixed into every key (separates caches sharing folders)",
                           type="str", default=""),
    "flush_after_ms": PluginKey(doc="deferred writes: longest wait before buffered puts go to the write queues",
                                type="float", default=20.0),
    "max_pending_write_bytes": PluginKey(
        doc="LMCache buffers held for writes; puts beyond it are dropped and counted", type="size",
        absent=f"¼ of LMCache's `max_local_cpu_size`, at least {MIN_PENDING_BYTES >> 20} MiB"),
    "load_threads": PluginKey(doc="threads that run batch reads for the async prefetch path", type="int", default=4),
    "read_into": PluginKey(doc="read payloads straight into LMCache's objects; false: into the store's buffers, "
                               "then copy", type="bool", default=True),
    "prefetch_ttl_s": PluginKey(doc="free a started prefetch no one collected after this many seconds",
                                type="float", default=120.0),
    "close_timeout_s": PluginKey(doc="how long close() waits for pending writes", type="float", default=120.0),
    "shared_tiers": PluginKey(doc="NAME,NAME: tiers every node writes to (one folder for all nodes, e.g. on Lustre "
                                  "or CephFS); each node then owns and evicts only its own chunks there",
                              type="`NAME,...`", absent="— (no tier is shared)"),
    "skip_unmounted_tiers": PluginKey(
        doc="a tier whose folder is not on its mounted file system (the shared tiers; see require_mount) is opened "
            "down, logged as an error and shown by lmcache:kvstream_tier_down, while kvstream serves from its other "
            "tiers; false: kvstream does not start", store=True, plugin_default=True),
    "node_id": PluginKey(doc="this node's label on shared tiers; nodes are told apart by a persistent random id, so "
                             "a label two nodes share does no harm", store=True),
    "node_state_path": PluginKey(doc="file keeping this node's persistent id; never on the shared file system",
                                 store=True),
    "tenant_salt_file": PluginKey(doc="a file holding this deployment's secret tenant salt (16 bytes or more): keys "
                                      "of deployments with different salts never meet, even in one folder; never "
                                      "logged", type="path",
                                  absent="— (no salt: the namespace alone separates deployments)"),
    "tenant_salt_env": PluginKey(doc="the name of an environment variable holding the secret tenant salt (instead "
                                     "of a file)", type="str", absent="—"),
    "strict": PluginKey(doc="true: if the store cannot be opened (bad key, dead or unwritable tier), LMCache fails "
                            "to start instead of logging the error and serving without kvstream",
                        type="bool", default=False),
    "recompute_model": PluginKey(doc="the served model's name for the recompute cost model (e.g. llama-3-70b, "
                                     "qwen2.5-14b); with kvstream.recompute_gpu, lookups report a shorter hit when "
                                     "the GPU recomputes held chunks sooner than the tiers load them (a slow or "
                                     "stalled tier holding the tail)",
                                 type="str", absent="— (off: every held chunk is reported)"),
    "recompute_gpu": PluginKey(doc="the GPU for the recompute cost model: h100, a100 or a800 (with "
                                   "kvstream.recompute_model)",
                               type="str", absent="— (required with `kvstream.recompute_model`)"),
    "recompute_tp": PluginKey(doc="tensor-parallel GPUs sharing one prefill, for the recompute cost model",
                              type="int", default=1),
}

# key (without the prefix) -> one line for the docs and the error messages
KEYS: dict[str, str] = {name: key.doc for name, key in PLUGIN_KEYS.items()}

# For docs/config.md (kvstream.config.reference_markdown): the type and default text of each key that sets no
# store field of the same name, derived from PLUGIN_KEYS (tests/unit/test_config_reference.py checks them both ways).
KEY_DEFAULTS: dict[str, tuple[str, str]] = {name: (key.type, key.default_text())
                                            for name, key in PLUGIN_KEYS.items() if not key.store}


def _default(name: str) -> Any:
    """The value :func:`parse_extra_config` uses for an absent key: the key's :class:`PluginKey` default."""
    key = PLUGIN_KEYS[name]
    if key.store or key.absent:
        raise KeyError(f"kvstream.{name} has no value default")
    return key.default


# StoreConfig / TierConfig field -> the kvstream.<key> that sets it (the others: through kvstream.config_file)
STORE_KEYS: dict[str, str] = {
    "StoreConfig.tiers": "tiers",
    "TierConfig.name": "tiers",
    "TierConfig.path": "tiers",
    "TierConfig.capacity_bytes": "capacity_bytes",
    "TierConfig.shared": "shared_tiers",
    **{f"StoreConfig.{k}": k for k in ("memory_bytes", "router", "replication", "io_engine", "create_dirs",
                                       "verify_reads", "hedge_after_s", "node_id", "node_state_path",
                                       "skip_unmounted_tiers", "python_switch_interval_s")},
}

# store fields a kvstream.<field> key may override, and how to read a string form of them
_STORE_OVERRIDES = {
    "memory_bytes": "size",
    "router": "str",
    "replication": "str",
    "io_engine": "str",
    "create_dirs": "bool",
    "verify_reads": "bool",
    "hedge_after_s": "float?",
    "python_switch_interval_s": "float?",
    "node_id": "str",
    "node_state_path": "str",
    "skip_unmounted_tiers": "bool",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class RecomputeOptions:
    """``kvstream.recompute_*``: what prices recomputing a chunk (:class:`kvstream.serving.gpu.CostModel`)."""

    model: str  # a name get_model_shape knows (validated)
    gpu: str  # a name get_gpu knows (validated)
    tp: int = 1  # >= 1


@dataclass(frozen=True, slots=True, kw_only=True)
class PluginOptions:
    """Everything the plugin needs from ``extra_config``; built only by :func:`parse_extra_config`."""

    store: StoreConfig  # validated; tier folders are checked (and created) when the store opens
    store_source: str  # which keys the store config came from, for log lines and errors at open
    namespace: str  # mixed into every store key
    tenant_salt: bytes | None = field(default=None, repr=False)  # secret, mixed into every key; never printed
    flush_after_s: float  # a buffered put waits at most this long before Store.flush()
    max_pending_write_bytes: int  # bytes of LMCache objects held by pending writes
    load_threads: int  # >= 1
    read_into: bool  # zero-copy reads (Store.read_into) rather than read_chunks + a copy
    prefetch_ttl_s: float  # > 0
    close_timeout_s: float  # >= 0
    strict: bool = False  # a failure to open the store stops LMCache's start (see strict_mode)
    recompute: RecomputeOptions | None = None  # None: lookups report every held chunk


def flatten(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """Our keys, without the prefix, from the flat (``kvstream.tiers``) or nested (``kvstream: {tiers}``) form."""
    out: dict[str, Any] = {}
    if not extra:
        return out
    nested = extra.get("kvstream")
    if isinstance(nested, Mapping):
        for k, v in nested.items():
            out[str(k)] = v
    for k, v in extra.items():
        if isinstance(k, str) and k.startswith(PREFIX):
            out[k[len(PREFIX):]] = v
    return out


def _field(name: str) -> str:
    return PREFIX + name


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(_field(name), f"expected true or false, got {value!r}")


def _as_float(name: str, value: Any, *, minimum: float) -> float:
    f = _as_opt_float(name, value, minimum=minimum)
    if f is None:
        raise ConfigError(_field(name), "expected a number")
    return f


def _as_opt_float(name: str, value: Any, *, minimum: float, allow_none: bool = False) -> float | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none", "null", "off")):
        if allow_none:
            return None
        raise ConfigError(_field(name), "expected a number")
    try:
        f = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        raise ConfigError(_field(name), f"expected a number, got {value!r}") from None
    if not f >= minimum:  # also rejects NaN
        raise ConfigError(_field(name), f"must be at least {minimum}, got {value!r}")
    return f


def _as_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool):
        raise ConfigError(_field(name), f"expected an integer, got {value!r}")
    try:
        n = int(value, 10) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        raise ConfigError(_field(name), f"expected an integer, got {value!r}") from None
    if isinstance(value, float) and not value.is_integer():
        raise ConfigError(_field(name), f"expected an integer, got {value!r}")
    if n < minimum:
        raise ConfigError(_field(name), f"must be at least {minimum}, got {value!r}")
    return n


def _as_str(name: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(_field(name), f"expected a non-empty string, got {value!r}")
    return value.strip()


def _capacities(value: Any, names: list[str]) -> dict[str, int]:
    """``kvstream.capacity_bytes``: one size for every tier, or ``NAME=SIZE,...`` naming each tier."""
    key = _field("capacity_bytes")
    if isinstance(value, str) and "=" in value:
        caps: dict[str, int] = {}
        for part in (p.strip() for p in value.split(",")):
            if not part:
                continue
            name, _, size = part.partition("=")
            name = name.strip()
            if name not in names:
                raise ConfigError(key, f"names tier {name!r}, but kvstream.tiers has {', '.join(names)}")
            caps[name] = parse_size(size.strip(), key)
        missing = [n for n in names if n not in caps]
        if missing:
            raise ConfigError(key, f"no size for tier(s) {', '.join(missing)}")
        return caps
    one = parse_size(value, key)
    return {n: one for n in names}


def _mark_shared(data: dict[str, Any], value: Any) -> None:
    """``kvstream.shared_tiers``: set ``shared: true`` on the tiers it names (from kvstream.tiers or the file).
    A name that is no tier is an error: a tier believed shared but not marked would count and evict every
    node's chunks as its own."""
    key = _field("shared_tiers")
    names = [n.strip() for n in _as_str("shared_tiers", value).split(",") if n.strip()]
    tiers = data.get("tiers")
    known = [t.get("name") for t in tiers if isinstance(t, Mapping)] if isinstance(tiers, (list, tuple)) else []
    for n in names:
        if n not in known:
            raise ConfigError(key, f"names tier {n!r}, but the tiers are {', '.join(map(str, known)) or '(none)'}")
    data["tiers"] = [dict(t, shared=True) if isinstance(t, Mapping) and t.get("name") in names else t
                     for t in tiers]  # type: ignore[union-attr]


def _load_file(value: Any) -> tuple[dict[str, Any], Path]:
    key = _field("config_file")
    path = Path(os.path.expanduser(_as_str("config_file", value))).resolve()
    try:
        import yaml

        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(key, f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # yaml.YAMLError and friends: the file is the user's to fix
        raise ConfigError(key, f"{path} is not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(key, f"{path} must hold a mapping (tiers, memory_bytes, ...) at the top level")
    return dict(data), path.parent


def strict_mode(extra: Mapping[str, Any] | None) -> bool:
    """``kvstream.strict``, read on its own before the rest of the keys (which may be the ones that are wrong).
    Raises ConfigError for a value that is not a boolean: a value the operator wrote but we cannot read must
    not silently mean "serve without kvstream" (the plugin treats that error as strict)."""
    opts = flatten(extra)
    return _as_bool("strict", opts.get("strict", _default("strict")))


def parse_extra_config(extra: Mapping[str, Any] | None, *, default_pending_bytes: int = 1 << 30) -> PluginOptions:
    """Build :class:`PluginOptions` from LMCache's ``extra_config``; raise ConfigError naming the key. An absent
    key takes its :data:`PLUGIN_KEYS` default.

    ``default_pending_bytes`` is the default of ``kvstream.max_pending_write_bytes``: the plugin passes
    :func:`pending_write_default` of LMCache's ``max_local_cpu_size``.
    """
    opts = flatten(extra)
    for name in opts:
        if name not in KEYS:
            close = difflib.get_close_matches(name, list(KEYS), n=1)
            hint = f"; did you mean '{_field(close[0])}'?" if close else f"; known keys: {', '.join(_field(k) for k in KEYS)}"
            raise ConfigError(_field(name), "unknown key" + hint)
    if "config_file" not in opts and "tiers" not in opts:
        raise ConfigError(
            _field("tiers"),
            "required: set kvstream.tiers ('local=PATH,shared=PATH', with kvstream.capacity_bytes) "
            "or kvstream.config_file (a kvstream YAML file)",
        )

    data: dict[str, Any] = {}
    base_dir: Path | None = None
    sources: list[str] = []
    if "config_file" in opts:
        data, base_dir = _load_file(opts["config_file"])
        sources.append(_field("config_file"))
    if "tiers" in opts:
        specs = _as_str("tiers", opts["tiers"])
        tiers = parse_tier_specs([specs], capacity_bytes=1, field_name=_field("tiers"))
        names = [t["name"] for t in tiers]
        if "capacity_bytes" not in opts:
            raise ConfigError(_field("capacity_bytes"), "required with kvstream.tiers: one size ('500GiB') "
                                                        "or NAME=SIZE for each tier")
        caps = _capacities(opts["capacity_bytes"], names)
        for t in tiers:
            t["capacity_bytes"] = caps[t["name"]]
        data["tiers"] = tiers
        for name, key in PLUGIN_KEYS.items():  # create_dirs: folders named inline are created
            if key.tiers_default is not None:
                data.setdefault(name, key.tiers_default)
        sources.append(_field("tiers"))
    elif "capacity_bytes" in opts:
        raise ConfigError(_field("capacity_bytes"), "only used with kvstream.tiers (the config file gives "
                                                    "each tier's capacity_bytes)")
    if "shared_tiers" in opts:
        _mark_shared(data, opts["shared_tiers"])
    # Under LMCache a shared file system that is not mounted yet must not stop kvstream's local tier, nor LMCache
    # (which serves without a plugin that fails to start): the tier is opened down, loudly.
    for name, key in PLUGIN_KEYS.items():
        if key.plugin_default is not None:
            data.setdefault(name, key.plugin_default)
    for name, kind in _STORE_OVERRIDES.items():
        if name not in opts:
            continue
        v = opts[name]
        if kind == "bool":
            data[name] = _as_bool(name, v)
        elif kind == "float?":
            data[name] = _as_opt_float(name, v, minimum=0.0, allow_none=True)
        elif kind == "size":
            data[name] = parse_size(v, _field(name))
        else:
            data[name] = _as_str(name, v)

    try:
        store = StoreConfig.from_dict(data, base_dir=base_dir)
    except ConfigError as exc:
        raise attribute_error(exc, opts) from None

    def given(name: str) -> Any:  # the value of a key with a value default (PLUGIN_KEYS), given or not
        return opts.get(name, _default(name))

    return PluginOptions(
        store=store,
        store_source=" + ".join(sources),
        namespace=str(given("namespace")),
        tenant_salt=_tenant_salt(opts),
        flush_after_s=float(_as_float("flush_after_ms", given("flush_after_ms"), minimum=0.0)) / 1000.0,
        max_pending_write_bytes=parse_size(opts.get("max_pending_write_bytes", default_pending_bytes),
                                           _field("max_pending_write_bytes")),
        load_threads=_as_int("load_threads", given("load_threads"), minimum=1),
        read_into=_as_bool("read_into", given("read_into")),
        prefetch_ttl_s=float(_as_float("prefetch_ttl_s", given("prefetch_ttl_s"), minimum=0.001)),
        close_timeout_s=float(_as_float("close_timeout_s", given("close_timeout_s"), minimum=0.0)),
        strict=strict_mode(extra),
        recompute=_recompute(opts),
    )


def _recompute(opts: Mapping[str, Any]) -> RecomputeOptions | None:
    """``kvstream.recompute_model`` + ``kvstream.recompute_gpu`` (+ ``kvstream.recompute_tp``), checked against
    the cost model's known models and GPUs; None when none is set."""
    names = ("recompute_model", "recompute_gpu", "recompute_tp")
    given = [n for n in names if n in opts]
    if not given:
        return None
    for need in names[:2]:
        if need not in opts:
            raise ConfigError(_field(need), f"required with {', '.join(_field(n) for n in given)}: set both "
                                            f"{_field('recompute_model')} and {_field('recompute_gpu')}")
    from kvstream.serving.gpu import get_gpu, get_model_shape

    model = _as_str("recompute_model", opts["recompute_model"])
    gpu = _as_str("recompute_gpu", opts["recompute_gpu"])
    try:
        model = get_model_shape(model).name  # an alias ("70b") becomes the model's own name
    except KeyError as exc:
        raise ConfigError(_field("recompute_model"), str(exc.args[0])) from None
    try:
        get_gpu(gpu)
    except KeyError as exc:
        raise ConfigError(_field("recompute_gpu"), str(exc.args[0])) from None
    return RecomputeOptions(model=model, gpu=gpu.lower(),
                            tp=_as_int("recompute_tp", opts.get("recompute_tp", _default("recompute_tp")), minimum=1))


def _tenant_salt(opts: Mapping[str, Any]) -> bytes | None:
    """The secret salt from ``tenant_salt_file`` or ``tenant_salt_env`` (not both), at least 16 bytes. Errors name
    the key and the file or variable, never the value."""
    if "tenant_salt_file" in opts and "tenant_salt_env" in opts:
        raise ConfigError(_field("tenant_salt_env"), "give the salt by a file or by a variable, not both")
    if "tenant_salt_file" in opts:
        path = Path(os.path.expanduser(_as_str("tenant_salt_file", opts["tenant_salt_file"])))
        try:
            salt = path.read_bytes().strip()
        except OSError as exc:
            raise ConfigError(_field("tenant_salt_file"), f"cannot read {path}: {exc.strerror or exc}") from None
        where = str(path)
    elif "tenant_salt_env" in opts:
        var = _as_str("tenant_salt_env", opts["tenant_salt_env"])
        if var not in os.environ:
            raise ConfigError(_field("tenant_salt_env"), f"the environment variable {var} is not set")
        salt = os.environ[var].strip().encode()
        where = f"${var}"
    else:
        return None
    if len(salt) < 16:
        raise ConfigError(_field("tenant_salt_file" if "tenant_salt_file" in opts else "tenant_salt_env"),
                          f"{where} holds {len(salt)} bytes; a tenant salt needs at least 16 bytes of secret")
    return salt


def attribute_error(exc: ConfigError, opts: Mapping[str, Any]) -> ConfigError:
    """The same error under the ``kvstream.*`` key the user wrote the value with (``opts``: flattened keys).

    Used for schema errors here and for the checks the store runs at open (folder missing, not writable).
    """
    field = exc.field
    detail = str(exc).split(": ", 1)[-1]
    top = field.split("[", 1)[0].split(".", 1)[0]
    if top == "tiers" and "tiers" in opts:
        return ConfigError(_field("tiers"), f"{field}: {detail}")
    if top in _STORE_OVERRIDES and top in opts:
        return ConfigError(_field(top), detail)
    if "config_file" in opts:
        return ConfigError(_field("config_file"), f"{opts['config_file']}: {field}: {detail}")
    return ConfigError(_field(top), detail)
