"""The plugin is also tested on the releases LMCache 0.5.6 pins (numpy<=2.2.6, prometheus_client<=0.24.1).

scripts/setup.sh installs LMCache with ``--no-deps``, so nothing applied its pins and CI ran only newer releases.
``scripts/lmcache_pins.py`` reads the pins from LMCache's installed metadata and names those the environment
breaks; scripts/setup.sh installs them into ``.venv-lmcache-pins`` (layered on ``.venv``) and scripts/test.sh
runs the plugin's tests there with ``KVSTREAM_LMCACHE_PINS=1``, where the last test here checks that the pins
really are in force (the layering put them first on the path).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]


def _pins_module():
    spec = importlib.util.spec_from_file_location("lmcache_pins", REPO / "scripts" / "lmcache_pins.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _lmcache_requires() -> list[str]:
    return metadata.requires("lmcache") or []


@pytest.mark.lmcache
def test_the_pins_are_read_from_lmcaches_metadata() -> None:
    """What LMCache 0.5.6 declares (read off its installed metadata), and what the helper makes of it for an
    environment with the newest releases: exactly the two pins the plugin shares with LMCache, nothing for
    distributions not installed (LMCache's CUDA-only needs) or extras."""
    reqs = {Requirement(r).name: Requirement(r) for r in _lmcache_requires()}
    assert metadata.version("lmcache") == "0.5.6"
    assert not reqs["numpy"].specifier.contains("2.4.6") and reqs["numpy"].specifier.contains("2.2.6")
    assert not reqs["prometheus_client"].specifier.contains("0.26.0")
    assert reqs["prometheus_client"].specifier.contains("0.24.1")
    newest = {"numpy": "2.4.6", "prometheus_client": "0.26.0", "torch": "2.13.0", "transformers": "5.4.0",
              "pyzmq": "26.0.0"}
    pins = _pins_module().broken_pins(_lmcache_requires(), newest.get)
    assert pins == ["numpy<=2.2.6", "prometheus_client<=0.24.1,>=0.18.0"]
    assert _pins_module().broken_pins(_lmcache_requires(), {"numpy": "2.2.6", "prometheus_client": "0.24.1"}.get) == []


def test_setup_installs_the_helpers_pins_and_test_runs_the_plugin_tests_on_them() -> None:
    """CI (.ci/run -> scripts/setup.sh test, scripts/test.sh) builds the pinned venv from the helper's output and
    runs the plugin's test files in it, this file first."""
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "scripts/lmcache_pins.py" in setup and "-r \"$PINS/pins.txt\"" in setup and "site.addsitedir" in setup
    test = (REPO / "scripts" / "test.sh").read_text()
    assert "KVSTREAM_LMCACHE_PINS=1 .venv-lmcache-pins/bin/python -m pytest" in test
    listed = test.split("PINNED_TESTS=(", 1)[1].split(")", 1)[0].split()
    assert listed[0] == "tests/integration/test_lmcache_pins.py"
    assert "tests/integration/test_lmcache_plugin.py" in listed
    assert all((REPO / t).is_file() for t in listed)
    ci = (REPO / ".ci" / "run").read_text()
    assert "scripts/setup.sh test" in ci and "scripts/test.sh" in ci


def test_the_helper_runs_as_a_script() -> None:
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "lmcache_pins.py"), "pytest"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert all(Requirement(line) for line in r.stdout.splitlines())  # pip requirements, one a line


@pytest.mark.lmcache
@pytest.mark.skipif(os.environ.get("KVSTREAM_LMCACHE_PINS") != "1",
                    reason="not the pinned run (scripts/test.sh runs it in .venv-lmcache-pins with KVSTREAM_LMCACHE_PINS=1)")
def test_this_run_is_on_lmcaches_pins() -> None:
    """In the pinned run, every installed distribution LMCache pins is within its pin, and the modules imported
    are those releases (not .venv's newer ones behind them on the path)."""
    import numpy
    import prometheus_client  # noqa: F401

    assert _pins_module().broken_pins(_lmcache_requires()) == []
    numpy_req = next(Requirement(r) for r in _lmcache_requires() if Requirement(r).name == "numpy")
    assert numpy_req.specifier.contains(numpy.__version__), numpy.__version__
    assert Path(numpy.__file__).resolve().is_relative_to(Path(sys.prefix).resolve()), numpy.__file__
    assert metadata.version("prometheus_client") == "0.24.1"
