#!/usr/bin/env bash
# Lint: ruff over the repository, then mypy (strict) on the module list in pyproject.toml ([tool.mypy] files).
# Both are configured in pyproject.toml. Installs the pinned tools into .venv if they are missing (run
# scripts/setup.sh first, or let this create .venv with the core package: mypy reads kvstream's imports).
#   bash scripts/lint.sh          check; exit 1 on any finding
#   bash scripts/lint.sh --fix    let ruff fix what it safely can, then check
set -euo pipefail
cd "$(dirname "$0")/.."
RUFF_VERSION=0.17.5
MYPY_VERSION=2.4.1
TYPES_PYYAML_VERSION=6.0.12.20261122  # stubs for `import yaml` (kvstream.config is type-checked)
if [ ! -x .venv/bin/python ]; then
  bash scripts/setup.sh main
fi
installed() {  # the installed version of a distribution in .venv, or nothing
  .venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}
need=()
[ "$(installed ruff)" = "$RUFF_VERSION" ] || need+=("ruff==${RUFF_VERSION}")
[ "$(installed mypy)" = "$MYPY_VERSION" ] || need+=("mypy==${MYPY_VERSION}")
[ "$(installed types-PyYAML)" = "$TYPES_PYYAML_VERSION" ] || need+=("types-PyYAML==${TYPES_PYYAML_VERSION}")
if [ "${#need[@]}" -gt 0 ]; then
  echo "lint: installing ${need[*]} into .venv"
  .venv/bin/python -m pip install -q "${need[@]}"
fi
status=0
if [ "${1:-}" = "--fix" ]; then
  .venv/bin/ruff check --fix . || true
fi
echo "lint: ruff check ."
.venv/bin/ruff check . || status=1
echo "lint: mypy (strict; modules in pyproject.toml [tool.mypy] files)"
.venv/bin/mypy || status=1
if [ "$status" -ne 0 ]; then
  echo "lint: FAILED (fix the findings above; rules and module list: pyproject.toml [tool.ruff], [tool.mypy])" >&2
fi
exit "$status"
