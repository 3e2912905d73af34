#!/usr/bin/env bash
# The README's second command: set up (if needed), lint, run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
.venv/bin/ruff check rvcompile tests benchmarks
.venv/bin/python -m pytest tests -q -n 2 --durations=10 "$@"
