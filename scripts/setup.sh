#!/usr/bin/env bash
# Create .venv (if needed) and install kvstream with the extras a task needs.
#   scripts/setup.sh main   core + plots + study (what `kvstream replay` and the studies need) (what `kvstream replay` needs)
#   scripts/setup.sh test   everything the test suite needs: + pytest/hypothesis, torch 2.13.0 (CPU), LMCache 0.5.6
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-main}"
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
pip() { .venv/bin/python -m pip "$@"; }
case "$what" in
  main)
    pip install -q -e '.[study,plot]'
    ;;
  test)
    # torch first, pinned: LMCache's native modules are built against exactly this release, and this
    # release's CPU wheel is available locally on these machines (any other pulls gigabytes of CUDA wheels).
    pip install -q 'torch==2.13.0'
    pip install -q -e '.[study,plot,test,lmcache]'
    # LMCache's own metadata pulls CUDA-only wheels and may replace torch: install it without dependencies
    # (its import-time needs are the [lmcache] extra above).
    pip install -q --no-deps 'lmcache==0.5.6'
    ;;
  *)
    echo "usage: scripts/setup.sh [main|test]" >&2
    exit 2
    ;;
esac
