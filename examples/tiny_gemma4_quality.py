"""Measure the quantized builds of the default model against its float32 build and against
transformers: the figures in docs/QUALITY.md.

    python examples/tiny_gemma4_quality.py [--text models/rv-gemma4-tiny/heldout.txt]

Builds MODEL_DIR for each target (CPU programs only), scores the text with `rvrun ppl`'s
windows (rvcompile.runtime.perplexity), and prints a markdown table: perplexity, its change
from xla-f32, top-1 agreement with xla-f32, and transformers float32 on the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.runtime.perplexity import score

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
TARGETS = ("xla-f32", "tpu-bf16", "tpu-int8", "xla-fp8")


def transformers_logits_fn():
    import torch
    from transformers import Gemma4ForCausalLM

    hf = Gemma4ForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32,
                                           attn_implementation="eager").eval()

    def logits(ids) -> np.ndarray:
        with torch.no_grad():
            out = hf(input_ids=torch.as_tensor(np.asarray(ids, np.int64))[None], use_cache=False)
        return out.logits[0].numpy()

    return logits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=MODEL_DIR / "heldout.txt")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    a = p.parse_args(argv)
    text = a.text.read_text()
    rows, f32 = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for target in TARGETS:
            out = Path(tmp) / f"{target}.rvp"
            opts = BuildOptions(target, max_context=a.window, prefill_buckets=(64,), max_seqs=1,
                                platforms=("cpu",))
            build_artifact(str(MODEL_DIR), out, opts, progress=False, log=lambda s: None)
            m = runtime.load(out)
            ids = m.encode(text, add_bos=False)
            t0 = time.perf_counter()
            s = score(m.logits, ids, bos_id=m.bos_id, window=a.window, stride=a.stride)
            f32 = f32 or s
            rows.append((target, s, time.perf_counter() - t0))
            print(f"{target}: {s.perplexity:.4f}", file=sys.stderr)
    t0 = time.perf_counter()
    hf = score(transformers_logits_fn(), ids, bos_id=m.bos_id, window=a.window, stride=a.stride)
    rows.append(("transformers float32", hf, time.perf_counter() - t0))
    print(f"{a.text.name}: {f32.tokens} tokens, {f32.windows} windows of {a.window} "
          f"(stride {a.stride})\n")
    print("| build | perplexity | vs xla-f32 | top-1 agreement with xla-f32 |")
    print("|---|---|---|---|")
    for name, s, _ in rows:
        agree = float((s.top1 == f32.top1).mean())
        print(f"| {name} | {s.perplexity:.4f} | {s.perplexity / f32.perplexity - 1:+.3%} | "
              f"{agree:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
