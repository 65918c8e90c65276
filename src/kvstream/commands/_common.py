"""What the sub-commands share: argument types that name the bad value and the valid choices, the optional
extras (which ``pip install 'kvstream[EXTRA]'`` enables what), and a rich console that does not truncate tables
when stdout is not a terminal.

Not a command (the leading underscore keeps ``kvstream.cli`` from registering it).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from collections.abc import Callable
from typing import Any

from kvstream.errors import UsageError
from kvstream.io.switch_interval import MAX_SWITCH_INTERVAL_S, MIN_SWITCH_INTERVAL_S, check_switch_interval

__all__ = [
    "EXTRAS",
    "MissingExtraError",
    "require",
    "have",
    "missing_extra_message",
    "plain",
    "console",
    "size_text",
    "size_bytes",
    "NEGATIVE_VALUE",
    "positive_int",
    "nonnegative_int",
    "positive_float",
    "nonnegative_float",
    "model_name",
    "model_names",
    "gpu_name",
    "gpu_names",
    "preset_name",
    "preset_names",
    "run_meta",
]

# Top-level module -> the extra that installs it. Each extra is named for what it enables.
EXTRAS: dict[str, str] = {
    "matplotlib": "plot",  # figures of replay and simulate
    "scipy": "study",  # study reuse (Spearman correlation)
    "torch": "torch",  # compact-tensor rebuild
    "lmcache": "lmcache",  # the LMCache storage plugin
}


class MissingExtraError(UsageError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def _extra_hint(module: str) -> str:
    """``scipy, which is not installed: pip install 'kvstream[study]'``."""
    root = module.split(".")[0]
    extra = EXTRAS.get(root)
    if extra is None:
        return f"the Python package {root}, which is not installed"
    return f"{root}, which is not installed: pip install 'kvstream[{extra}]'"


def have(module: str) -> bool:
    """Whether ``module`` can be imported (without importing it)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, purpose: str) -> None:
    """Raise :class:`MissingExtraError` (one line, exit 2) if ``module`` is missing; ``purpose`` says what needs it."""
    if not have(module):
        raise MissingExtraError(f"{purpose} needs {_extra_hint(module)}")


def missing_extra_message(exc: ModuleNotFoundError) -> str | None:
    """One line for a failed import of an optional dependency, or None if ``exc`` is not about one."""
    name = (exc.name or "").split(".")[0]
    if name not in EXTRAS:
        return None
    return f"this needs {_extra_hint(name)}"


# -- help text --------------------------------------------------------------------------------------------------
_ROLE = re.compile(r":[a-z]+(?::[a-z]+)?:`~?([^`<]+?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``(.+?)``")


def plain(text: str) -> str:
    """Docstring text without reStructuredText markup: ``x`` -> x, :mod:`a.b` -> a.b, :func:`~a.b` -> b."""

    def role(m: re.Match[str]) -> str:
        whole = m.group(0)
        target = m.group(1).strip()
        return target.rsplit(".", 1)[-1] if "`~" in whole else target

    return _LITERAL.sub(r"\1", _ROLE.sub(role, text))


# -- output -----------------------------------------------------------------------------------------------------
def console(*, stderr: bool = False, min_width: int | None = None) -> Any:
    """A rich Console: the terminal's width on a terminal (at least ``min_width``), and wide enough that tables
    are never cut or wrapped when the output is piped or redirected (rich would assume 80 columns)."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    if not tty:
        return Console(stderr=stderr, width=400, soft_wrap=False)
    con = Console(stderr=stderr)
    if min_width and con.width < min_width:
        con = Console(stderr=stderr, width=min_width)
    return con


# -- argument types -----------------------------------------------------------------------------------------------
def _number(kind: Callable[[str], Any], what: str, ok: Callable[[Any], bool], rule: str) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text!r}")
        return value

    parse.__name__ = what.replace(" ", "_")
    return parse


positive_int = _number(int, "an integer", lambda v: v >= 1, "at least 1")
nonnegative_int = _number(int, "an integer", lambda v: v >= 0, "0 or more")
positive_float = _number(float, "a number", lambda v: v > 0 and v == v and v != float("inf"), "a positive number")
nonnegative_float = _number(float, "a number", lambda v: v >= 0 and v == v and v != float("inf"), "0 or more")
# --switch-interval-ms: 0 (leave the interpreter's), or a value kvstream.io.switch_interval takes, in milliseconds
switch_interval_ms = _number(float, "a number of milliseconds",
                             lambda v: v == 0 or check_switch_interval(v / 1e3) is None,
                             f"0 (leave it) or {MIN_SWITCH_INTERVAL_S * 1e3:g}-{MAX_SWITCH_INTERVAL_S * 1e3:g}")


# A command-line word that is a value even though it starts with a dash: a dash, then a digit or a dot and a digit
# (``-1GiB``, ``-5``, ``-.5``). kvstream.cli's parser takes these as values, so an option's own type names what is
# wrong with them (argparse alone would say "expected one argument" for ``--memory -1GiB``).
NEGATIVE_VALUE = re.compile(r"^-\.?\d")

_SIZE_EXAMPLES = "examples: 4096, 4M, 48MiB, 256K, 2GB"


def size_bytes(text: str) -> int:
    """A positive size such as ``256MiB`` or ``4G``, in bytes; else an error saying the value is not a size."""
    from kvstream.config import size_arg

    if text.strip().startswith("-"):
        raise argparse.ArgumentTypeError(f"value {text!r} is not a size: a size is a positive number of bytes "
                                         f"({_SIZE_EXAMPLES})")
    return size_arg(text)  # its errors name the value too ("not a size: '12XB' (examples: ...)")


def size_text(text: str) -> str:
    """A size such as ``256MiB`` or ``4G``, checked (:func:`size_bytes`), kept as written (for messages and
    results)."""
    size_bytes(text)  # raises argparse.ArgumentTypeError naming the value
    return text


def model_names() -> list[str]:
    """Every model name the cost model knows, each once."""
    from kvstream import models
    from kvstream.serving import gpu

    return sorted(set(models.known_models()) | set(getattr(gpu, "_EXTRA", {})))


def model_aliases() -> dict[str, str]:
    from kvstream.serving.gpu import MODEL_ALIASES

    return dict(MODEL_ALIASES)


def model_name(text: str) -> str:
    """``--model``: a model name or alias -> its canonical name; else an error listing them (each once)."""
    from kvstream.serving.gpu import get_model_shape

    try:
        return get_model_shape(text).name
    except KeyError:
        aliases = ", ".join(f"{a}={n}" for a, n in model_aliases().items())
        raise argparse.ArgumentTypeError(
            f"unknown model {text!r}; choose from {', '.join(model_names())} (aliases {aliases})") from None


def gpu_names() -> list[str]:
    from kvstream.serving.gpu import GPU_PROFILES

    return sorted(GPU_PROFILES)


def gpu_name(text: str) -> str:
    """``--gpu``: a GPU profile name (case-insensitive)."""
    key = text.strip().lower()
    if key not in gpu_names():
        raise argparse.ArgumentTypeError(f"unknown GPU {text!r}; choose from {', '.join(gpu_names())}")
    return key


def preset_names() -> list[str]:
    from kvstream.workload import PRESETS

    return sorted(PRESETS)


def preset_name(text: str) -> str:
    """``--preset``: a synthetic workload preset."""
    if text not in preset_names():
        raise argparse.ArgumentTypeError(f"unknown workload preset {text!r}; choose from {', '.join(preset_names())}")
    return text


def run_meta(quick: bool | None = None) -> dict[str, Any]:
    """What a results JSON records about the run that wrote it: the kvstream version, the command line and,
    where the command has that flag, ``--quick`` (a shrunk workload whose verdicts may differ)."""
    from kvstream import __version__

    meta: dict[str, Any] = {"version": __version__, "command_line": list(sys.argv)}
    if quick is not None:
        meta["quick"] = bool(quick)
    return meta
