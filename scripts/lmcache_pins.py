"""Print the pins of LMCache's metadata that the installed environment breaks, one pip requirement a line
(``numpy<=2.2.6``), read from the installed ``lmcache`` distribution: ``python scripts/lmcache_pins.py``.

Why: scripts/setup.sh installs LMCache 0.5.6 with ``--no-deps`` (its metadata pulls CUDA-only wheels), so pip
never applies LMCache's pins and the test venv gets the newest numpy and prometheus_client, releases LMCache 0.5.6
excludes (``numpy<=2.2.6``, ``prometheus_client<=0.24.1``). scripts/setup.sh installs what this prints into
``.venv-lmcache-pins``, a venv layered on ``.venv``, and scripts/test.sh runs the plugin's tests there as well, so
the plugin is tested on the releases LMCache declares too. The pins come from LMCache's own metadata, so they
cannot drift from it. Only distributions that are installed are considered (LMCache's CUDA-only needs are not).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from importlib import metadata

from packaging.requirements import Requirement

__all__ = ["broken_pins", "installed_version"]


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def broken_pins(requires: Iterable[str], installed: Callable[[str], str | None] = installed_version) -> list[str]:
    """``NAME<SPEC>`` for each requirement in ``requires`` (``Requires-Dist`` lines) that applies here (its marker
    holds, no extra), has a version specifier, and whose installed version (``installed(name)``) breaks it."""
    out = []
    for line in requires:
        req = Requirement(line)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if not req.specifier:
            continue
        version = installed(req.name)
        if version is not None and not req.specifier.contains(version, prereleases=True):
            out.append(f"{req.name}{req.specifier}")
    return out


if __name__ == "__main__":
    dist = sys.argv[1] if len(sys.argv) > 1 else "lmcache"
    for pin in broken_pins(metadata.requires(dist) or []):
        print(pin)
