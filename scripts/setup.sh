#!/usr/bin/env bash
# Creates .venv with rvcompile and its test dependencies (idempotent). Used by the README and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.13.0 resolves to the CPU wheel on this project's machines (see pyproject's test extra).
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import rvcompile, jax, transformers, torch" 
