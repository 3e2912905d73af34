#!/usr/bin/env bash
# Every GPU test, on an H100 (they skip cleanly elsewhere). Run from the repository root on the
# GPU machine. Arguments, if any, replace the default `tests -m gpu` (e.g. a few files).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -eq 0 ]; then
    set -- tests -m gpu
fi
python -m pytest "$@" -q -rs -p no:cacheprovider
