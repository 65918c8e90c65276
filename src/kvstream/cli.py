"""The ``kvstream`` command line.

Each sub-command lives in its own module under :mod:`kvstream.commands` and exposes
``register(subparsers) -> None``; this file only collects them, so adding a command never edits another's code.
A command's handler returns the process exit code. Errors that are the caller's (a bad option value, a bad
config, a bad input file, a missing path, an optional dependency not installed) print one line and exit 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from kvstream.commands._common import NEGATIVE_VALUE, missing_extra_message, plain
from kvstream.errors import ConfigError, InputFormatError, UsageError

__all__ = ["main", "build_parser"]

# OS errors about a path the user named: one line, exit 2 (other OS errors keep their traceback).
_PATH_ERRORS = (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError, FileExistsError)


class _HelpFormatter(argparse.HelpFormatter):
    """Help without reStructuredText markup, and with each option's default where its help does not give one."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(plain(text))

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help
        if not text or text is argparse.SUPPRESS:
            return text
        text = plain(text)
        default = action.default
        if (action.option_strings and "default" not in text.lower() and "%(default)" not in text
                and not any(default is v for v in (None, False, True, argparse.SUPPRESS)) and default != []):
            text += " (default: %(default)s)"
        return text


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit 2) and the help formatter above, for sub-parsers too.

    A word that starts with a dash and a digit (``-1GiB``, ``-0.5x``) is a value, never an option: argparse takes
    only plain negative numbers for values, so ``--memory -1GiB`` got "expected one argument" instead of the
    option's own check saying the value is not a size. No option of ours looks like a number."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = NEGATIVE_VALUE

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _version() -> str:
    from kvstream import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvstream",
        description="A multi-tier KV-cache storage engine for LLM serving (KVStream + Bidaw).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    import kvstream.commands as commands_pkg

    for info in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"kvstream.commands.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def _command_name(args: argparse.Namespace) -> str:
    """``replay``, ``bench read``, ``study reuse``: the words that named the handler."""
    words = [args.command]
    for attr in ("bench_command", "study_command"):
        if getattr(args, attr, None):
            words.append(getattr(args, attr))
    return " ".join(words)


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        text = f"{exc.filename}: {exc.strerror}"
    else:
        text = str(exc) or type(exc).__name__
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a bad option (already reported on one line)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    name = _command_name(args)
    try:
        return int(args.handler(args) or 0)
    except (ConfigError, InputFormatError, UsageError, *_PATH_ERRORS) as exc:
        print(f"kvstream {name}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        hint = missing_extra_message(exc)
        if hint is None:
            raise
        print(f"kvstream {name}: error: {hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
