#!/usr/bin/env bash
# Every GPU test, on an H100 (they skip cleanly elsewhere). Run from the repository root on the
# GPU machine. Arguments, if any, replace the default `tests -m gpu` (e.g. a few files).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX otherwise takes 75% of the GPU's memory per process at first use, and the tests that load
# an H100 artifact next to it (or in other pytest-xdist workers) find none left.
export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
if [ $# -eq 0 ]; then
    set -- tests -m gpu
fi
python -m pytest "$@" -q -rs -p no:cacheprovider
