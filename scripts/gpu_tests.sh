#!/usr/bin/env bash
# Every GPU test, on an H100 (they skip cleanly elsewhere). Run from the repository root on the
# GPU machine; extra arguments go to pytest (e.g. a subset of files).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
files=("$@")
if [ ${#files[@]} -eq 0 ]; then
    files=(tests/test_h100_*.py tests/test_gpu_xla.py)
fi
python -m pytest "${files[@]}" -q -rs -p no:cacheprovider
