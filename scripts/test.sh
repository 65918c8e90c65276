#!/usr/bin/env bash
# The README's test command: set up .venv with everything the tests need, then run the whole suite, then the
# LMCache plugin's tests again in .venv-lmcache-pins (the same packages, but numpy, prometheus_client, ... at the
# releases LMCache 0.5.6 pins: scripts/setup.sh). Exit status: non-zero if either run failed.
#   bash scripts/test.sh                      the suite, then the plugin's tests on LMCache's pins
#   bash scripts/test.sh --quick [ARGS]       the tests not marked slow, in .venv, once (no pinned run)
#   bash scripts/test.sh tests/unit ...       only these (pytest arguments), in .venv
#   bash scripts/test.sh --lmcache-pins [ARGS] only the pinned run (default: the plugin's tests)
# Where a test goes and what the folders mean: tests/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "${1:-}" = "--quick" ]; then
  shift
  exec .venv/bin/python -m pytest -q -p no:cacheprovider -m "not slow" "$@"
fi
# As root the multi-node suite runs on real GlusterFS and CephFS (tests/root/test_dfs_multinode.py): install them.
if [ "$(id -u)" -eq 0 ]; then bash scripts/setup.sh dfs; fi
# The tests whose code runs with LMCache's numpy and prometheus_client: the plugin through LMCache, its metrics
# and dashboard, the library's collector, and the check that the pins are in force
# (tests/integration/test_lmcache_pins.py).
PINNED_TESTS=(tests/integration/test_lmcache_pins.py tests/integration/test_lmcache_plugin.py
              tests/integration/test_lmcache_salt.py tests/integration/test_lmcache_recompute.py
              tests/integration/test_dashboard.py tests/integration/test_metrics.py)
pinned() {
  echo "test.sh: on LMCache 0.5.6's pins ($(tr '\n' ' ' < .venv-lmcache-pins/pins.txt)): $*"
  KVSTREAM_LMCACHE_PINS=1 .venv-lmcache-pins/bin/python -m pytest -q -p no:cacheprovider "$@"
}
if [ "${1:-}" = "--lmcache-pins" ]; then
  shift
  if [ $# -gt 0 ]; then pinned "$@"; else pinned "${PINNED_TESTS[@]}"; fi
  exit
fi
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider || status=$?
pinned "${PINNED_TESTS[@]}" || status=$?
exit "$status"
