#!/usr/bin/env bash
# The README's first command: set up, build the embedded default model (models/rv-gemma4-tiny, a
# 10M-parameter Gemma 4 trained on public-domain English), generate from it, score held-out text.
# xla-f32: on a CPU its programs compile faster than tpu-bf16's, which outweighs bf16's faster
# decode for a short demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p build
.venv/bin/rvcompile build models/rv-gemma4-tiny --target xla-f32 \
    --max-context 512 --prefill-buckets 16,64 -o build/rv-gemma4-tiny.rvp
.venv/bin/rvcompile inspect build/rv-gemma4-tiny.rvp
.venv/bin/rvrun build/rv-gemma4-tiny.rvp --prompt "In the beginning" --max-tokens 30
echo "Who made the heavens and the earth?" | .venv/bin/rvrun chat build/rv-gemma4-tiny.rvp \
    --max-tokens 30
.venv/bin/rvrun ppl build/rv-gemma4-tiny.rvp --text models/rv-gemma4-tiny/heldout_sample.txt \
    --window 256 --stride 128
