#!/usr/bin/env bash
# The README's first command: set up, build the embedded default model, generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p build
.venv/bin/rvcompile build gemma-4-tiny --target tpu-bf16 --random-weights --seed 0 \
    --max-context 512 --prefill-buckets 16,64 -o build/gemma-4-tiny.rvp
.venv/bin/rvcompile inspect build/gemma-4-tiny.rvp
.venv/bin/rvrun build/gemma-4-tiny.rvp --prompt "Hello" --max-tokens 32
