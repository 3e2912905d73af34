#!/usr/bin/env bash
# Creates .venv with rvcompile and its test dependencies (idempotent): the `test` extra, which is
# every other extra (xla, h100, serve, build) and what the tests compare against. Used by the
# README and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
# torch==2.13.0 resolves to the CPU wheel on this project's machines (see pyproject's test extra).
.venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]' 2>&1 \
    | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import rvcompile, jax, transformers, torch, typer, fastapi, cuda.bindings"

# libtpu, at the version jax's tpu extra pins, lets `rvcompile build --topology` compile for a TPU
# slice on this machine. It goes to .venv/tpu-aot, outside the venv's site-packages: with libtpu
# importable every jax start on a machine without a TPU probes for one (stderr noise, ~0.5 s), so
# only the topology build test puts it on PYTHONPATH. Without it that test skips, saying so.
if [ ! -d .venv/tpu-aot ]; then
    libtpu=$(.venv/bin/python -c "import importlib.metadata as m; print(next(
        r.split(';')[0].replace(' ', '') for r in m.requires('jax')
        if 'libtpu' in r and 'extra == \"tpu\"' in r))")
    if ! .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps \
            --target .venv/tpu-aot "$libtpu"; then
        rm -rf .venv/tpu-aot
        echo "setup: $libtpu not installed; the TPU-topology build test will skip"
    fi
fi
