"""Perplexity of the default model with int8 activations (issue 19, item 2): a measurement of
what per-token int8 activations would cost in accuracy, not a build option.

    python benchmarks/int8_activations_ppl.py [--text models/rv-gemma4-tiny/heldout.txt]

Builds models/rv-gemma4-tiny (CPU programs only, as examples/tiny_gemma4_quality.py does) for
xla-f32, tpu-int8, and tpu-int8 "a8": the same IR and weights, exported with every LINEAR of an
int8 weight (q/k/v/o, the MLP, the per-layer-input projections, the tied head) quantizing its
activation rows to int8 first, one symmetric scale per row (max |x| / 127), and multiplying int8
by int8 into int32 (exact), then scaling by the row's and the weight row's scales: what a TPU
MXU's int8 path would compute. The a8 lowering exists only in this process (it replaces
lower.linear while the artifact is exported). Scores the text with `rvrun ppl`'s windows
(rvcompile.runtime.perplexity) and prints a markdown table: perplexity, its change from xla-f32,
top-1 agreement with xla-f32.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import jax.numpy as jnp

from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.ir.ops import Op
from rvcompile.runtime.perplexity import score
from rvcompile.targets.xla import lower

MODEL_DIR = Path(__file__).resolve().parents[1] / "models" / "rv-gemma4-tiny"
INT8_MAX = 127


def linear_a8(a, x, w, scale=None):
    """lower.linear with the activation rows of an int8 weight quantized to int8 per row."""
    if w.dtype != jnp.int8:
        return PLAIN_LINEAR(a, x, w, scale)
    x = lower.f32(x)
    row = jnp.max(jnp.abs(x), axis=-1, keepdims=True) * jnp.float32(1 / INT8_MAX)
    q = jnp.clip(jnp.round(x / jnp.where(row > 0, row, 1)), -INT8_MAX, INT8_MAX)
    y = jnp.einsum("...k,nk->...n", q.astype(jnp.int8), w,
                   preferred_element_type=jnp.int32).astype(jnp.float32) * row
    return y * scale if scale is not None else y


PLAIN_LINEAR = lower.linear


def build(target: str, out: Path, window: int, a8: bool) -> runtime.Model:
    opts = BuildOptions(target, max_context=window, prefill_buckets=(64,), max_seqs=1,
                        platforms=("cpu",))
    tables = (lower.LOWERINGS, lower.BLOCKWISE_LOWERINGS)
    if a8:  # gated_linear and multi_linear call the module's linear
        lower.linear = linear_a8
        for t in tables:
            t[Op.LINEAR] = linear_a8
    try:
        build_artifact(str(MODEL_DIR), out, opts, progress=False, log=lambda s: None)
    finally:
        lower.linear = PLAIN_LINEAR
        for t in tables:
            t[Op.LINEAR] = PLAIN_LINEAR
    return runtime.load(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", type=Path, default=MODEL_DIR / "heldout.txt")
    p.add_argument("--window", type=int, default=256)
    p.add_argument("--stride", type=int, default=128)
    a = p.parse_args(argv)
    text = a.text.read_text()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, target, a8 in (("xla-f32", "xla-f32", False), ("tpu-int8", "tpu-int8", False),
                                 ("tpu-int8, int8 activations", "tpu-int8", True)):
            m = build(target, Path(tmp) / f"{name.split(',')[0]}-{int(a8)}.rvp", a.window, a8)
            ids = m.encode(text, add_bos=False)
            s = score(m.logits, ids, bos_id=m.bos_id, window=a.window, stride=a.stride)
            rows.append((name, s))
            print(f"{name}: {s.perplexity:.4f}", file=sys.stderr)
    f32 = rows[0][1]
    print(f"{a.text.name}: {f32.tokens} tokens, {f32.windows} windows of {a.window} "
          f"(stride {a.stride})\n")
    print("| build | perplexity | vs xla-f32 | top-1 agreement with xla-f32 |")
    print("|---|---|---|---|")
    for name, s in rows:
        print(f"| {name} | {s.perplexity:.4f} | {s.perplexity / f32.perplexity - 1:+.3%} | "
              f"{float((s.top1 == f32.top1).mean()):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
