"""The test suite's layout (tests/README.md): every test file is in one of four folders, test files never import
each other or conftest.py (shared helpers live in :mod:`kvstream.testing`), and the folders keep their promises
as far as the source shows them (a unit test opens no store; a root test is marked root)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
FOLDERS = ("contract", "unit", "integration", "root")


def _python_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def _test_files() -> list[Path]:
    return [p for p in _python_files() if p.name.startswith("test_")]


def _imported(path: Path) -> set[str]:
    """Every module name an import in ``path`` names (at any depth: imports inside functions too); a relative
    import counts as ``.name``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("." * node.level + (node.module or ""))
            else:
                assert node.module is not None
                names.add(node.module)
    return names


def test_every_test_file_is_in_one_of_the_four_folders() -> None:
    misplaced = [p.relative_to(TESTS).as_posix() for p in _test_files()
                 if len(p.relative_to(TESTS).parts) != 2 or p.parent.name not in FOLDERS]
    assert not misplaced, f"put these in tests/{{{','.join(FOLDERS)}}}/ (tests/README.md says which): {misplaced}"
    assert all((TESTS / f).is_dir() and any((TESTS / f).glob("test_*.py")) for f in FOLDERS)


def test_the_only_python_file_besides_tests_is_the_top_conftest() -> None:
    """Helpers shared by test files go in kvstream.testing, fixtures in tests/conftest.py: a helper module under
    tests/ is what test files would import from each other."""
    others = [p.relative_to(TESTS).as_posix() for p in _python_files() if not p.name.startswith("test_")]
    assert others == ["conftest.py"], others


def test_test_file_names_are_unique_across_the_folders() -> None:
    """pytest imports each test file by its bare name (no __init__.py here): two files of one name would clash."""
    names = [p.name for p in _test_files()]
    assert len(names) == len(set(names)), sorted(n for n in set(names) if names.count(n) > 1)


def test_no_test_file_imports_another_test_file_or_conftest() -> None:
    local = {p.stem for p in _python_files()} | {"tests"}
    bad = {}
    for p in _test_files():
        hits = sorted(m for m in _imported(p) if m.startswith(".") or m.split(".")[0] in local)
        if hits:
            bad[p.relative_to(TESTS).as_posix()] = hits
    assert not bad, f"import these from kvstream.testing instead: {bad}"


def test_the_checker_catches_an_import_of_a_test_file(tmp_path: Path) -> None:
    f = tmp_path / "test_x.py"
    f.write_text("import os\nfrom test_store import x\n\ndef t():\n    from conftest import engines\n"
                 "    from . import helpers\n")
    assert _imported(f) == {"os", "test_store", "conftest", "."}


def test_unit_tests_open_no_store_and_no_io_engine() -> None:
    """A unit test is one module's logic in process: a test that needs a store, a tier on disk or an I/O engine
    goes in tests/integration/."""
    needles = ("open_store(", "disk_tmp", "make_engine(")
    bad = {p.name: [n for n in needles if n in p.read_text()] for p in (TESTS / "unit").glob("test_*.py")
           if p.name != Path(__file__).name}
    assert not {k: v for k, v in bad.items() if v}


def test_every_root_test_file_is_marked_root() -> None:
    unmarked = [p.name for p in (TESTS / "root").glob("test_*.py")
                if not any("pytestmark" in line and "pytest.mark.root" in line for line in p.read_text().splitlines())]
    assert not unmarked, unmarked
