#!/usr/bin/env bash
# The README's test command: set up .venv with everything the tests need, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
# As root the multi-node suite runs on real GlusterFS and CephFS (tests/test_dfs_multinode.py): install them.
if [ "$(id -u)" -eq 0 ]; then bash scripts/setup.sh dfs; fi
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
