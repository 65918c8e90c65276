#!/usr/bin/env bash
# The README's main job: set up .venv and run `kvstream replay` on its built-in default workload.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh main
exec .venv/bin/kvstream replay "$@"
