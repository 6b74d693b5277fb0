#!/usr/bin/env bash
# The test command README.md gives: set up .venv (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/dev-env.sh
VENV="${AMP_REWRITE_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@"
