"""What a release ships: the sdist carries its own test suite and the files the tests read, and those tests run
from the unpacked sdist; the metadata names the project's URLs; the extras the docs name exist; CHANGELOG's top
release is the package's version, dated.

The sdist is built here without network (``setuptools.build_meta`` from the ``test`` extra, as the build backend
of pyproject.toml), from this tree.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest

import kvstream

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# A fast subset of the suite, run from the unpacked sdist: tests that read the docs, deploy/ and the CHANGELOG
# the sdist must carry, the CLI's, and ones that use tests/conftest.py's fixtures and kvstream.testing's helpers.
SUBSET = ["tests/unit/test_config_reference.py", "tests/integration/test_cli_errors.py",
          "tests/integration/test_dashboard.py", "tests/unit/test_serving_core.py", "tests/unit/test_format.py",
          "tests/unit/test_layout.py",
          "tests/integration/test_packaging.py::test_changelog_top_release_is_the_package_version"]


def _source_files() -> list[str]:
    """The tree's files as a fresh clone has them: git's tracked and not-ignored files in a checkout; elsewhere
    (an unpacked sdist) every file but build leftovers."""
    if (REPO / ".git").exists():
        r = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, timeout=60, check=True)
        return [f for f in r.stdout.decode().split("\0") if f and (REPO / f).is_file()]
    skip = {"__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
    return [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts)
            and not any(part.endswith(".egg-info") or part.startswith(".venv") for part in p.relative_to(REPO).parts)]


def _build_sdist(tmp: Path) -> Path:
    """Build the sdist from a copy of the tree as a clone has it: setuptools also ships whatever an old
    ``*.egg-info/SOURCES.txt`` lists, so building in a developer's tree would hide a file MANIFEST.in misses."""
    tree, out = tmp / "tree", tmp / "dist"
    for f in _source_files():
        (tree / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, tree / f)
    r = subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                                              "print(b.build_sdist(sys.argv[1]))", str(out)],
                       cwd=tree, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_sdist_carries_its_tests_and_they_run_from_it(tmp_path: Path) -> None:
    sdist = _build_sdist(tmp_path)
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    root = next((tmp_path / "unpacked").iterdir())
    shipped = {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}
    # every test module and helper, and every file the tests read from the tree
    need = {p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("*.py")}
    need |= {"tests/README.md"}
    need |= {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")}
    need |= {"tests/conftest.py", "src/kvstream/testing/serving.py", "README.md", "CHANGELOG.md", "pyproject.toml",
             "deploy/grafana/kvstream.json", "deploy/prometheus/kvstream-alerts.yml", "bench/dfs/testbed.py",
             "bench/faults/kernel.py", "scripts/setup.sh", "scripts/test.sh", "scripts/config_reference.py"}
    missing = sorted(need - shipped)
    assert not missing, f"the sdist lacks {missing} (MANIFEST.in)"
    assert not [p for p in shipped if "__pycache__" in p or p.startswith("docs/bench/data/")]
    # the unpacked tree's own package, tests and files: PYTHONPATH puts its src first
    env = {**os.environ, "PYTHONPATH": str(root / "src"), "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
    where = subprocess.run([sys.executable, "-c", "import kvstream; print(kvstream.__file__)"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=60)
    assert where.stdout.strip().startswith(str(root / "src")), where
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-m", "not lmcache",
                        *SUBSET], cwd=root, env=env, capture_output=True, text=True, timeout=500)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert re.search(r"\d+ passed", tail) and " error" not in tail, tail


def test_the_project_urls_share_one_base_and_name_files_that_exist() -> None:
    urls = PYPROJECT["project"]["urls"]
    assert {"Homepage", "Source", "Changelog", "Documentation", "Issues"} <= set(urls)
    base = urls["Source"].rstrip("/")
    for name, url in urls.items():
        assert url.startswith("https://") and url.startswith(base), (name, url)
        m = re.search(r"/blob/[^/]+/(.+)$", url)
        if m:
            assert (REPO / m.group(1)).is_file(), (name, url)
    assert urls["Changelog"].endswith("/CHANGELOG.md")


def test_the_extras_the_docs_name_are_the_extras_that_exist() -> None:
    """docs/install.md's table lists exactly pyproject's extras (it documented a `sim` extra that did not
    exist), and every ``kvstream[X]`` / ``.[X,Y]`` an install line or message names exists."""
    from kvstream.commands._common import EXTRAS

    extras = set(PYPROJECT["project"]["optional-dependencies"])
    table = set(re.findall(r"^\|\s*`(\w+)`\s*\|", (REPO / "docs" / "install.md").read_text(), re.M))
    assert table == extras, (table, extras)
    assert set(EXTRAS.values()) <= extras
    named = set()
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "scripts").glob("*.sh"))]:
        text = doc.read_text()
        for m in re.finditer(r"(?:kvstream|\.)\[([\w,]+)\]", text):
            named.update(m.group(1).split(","))
        # prose about an extra: "`X` extra", "the `X` extra", "`X` is an alias of ..."
        named.update(re.findall(r"`(\w+)`\s+(?:extra\b|is an? (?:deprecated )?alias)", text))
    assert named and named <= extras, named - extras


def test_changelog_top_release_is_the_package_version() -> None:
    """The newest CHANGELOG heading is ``## <kvstream.__version__> — <date>``: a release, not "unreleased"."""
    heads = re.findall(r"^## (\S+) — (.+)$", (REPO / "CHANGELOG.md").read_text(), re.M)
    assert heads, "CHANGELOG.md has no release heading"
    version, date = heads[0]
    assert version == kvstream.__version__, f"CHANGELOG's top release is {version}, the package is {kvstream.__version__}"
    datetime.date.fromisoformat(date.strip())  # a date, not "unreleased"
    assert PYPROJECT["project"]["dynamic"] == ["version"]  # the version has one source: kvstream.__version__
