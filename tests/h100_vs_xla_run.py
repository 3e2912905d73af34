"""One side of tests/test_h100_vs_xla.py, run in its own process: build TARGET from the 31B's
config cut to LAYERS layers with conditioned random weights (below), load it, and save its
teacher-forced logits and greedy tokens of the shared prompt to ROOT/NAME.npz (phase times to
ROOT/NAME.json), NAME the target and, for h100-fp8, its plan.

    python tests/h100_vs_xla_run.py ROOT TARGET LAYERS [--plan gemv|tc] [--keep-artifact]

h100-fp8 plans (prefill buckets): "gemv" (16 / 32: every linear of every entry the tensor-core
GEMV over bf16 activations, as xla-fp8 computes them) and "tc" (16 / 64: the 64-row entries'
linears per-token e4m3 activations and the tensor-core GEMM).

Its own process because JAX keeps the GPU memory it allocated until the process ends, and the
other target must then find the GPU free. `--keep-artifact` leaves ROOT/TARGET.rvp in place (for
a benchmark run on the same build); otherwise it is deleted, as two full-depth 31B artifacts do
not fit the GPU machine's disk together.

The random weights are conditioned by `random_weights.near_identity_init_range` (see the test's
docstring for why): q/k norm weights near 1/4, post-norm weights in [0.05, 0.15], layer scalars
in [0.95, 1]; every other tensor as `--random-weights` draws it.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

import rvcompile.sources.random_weights as rw
from rvcompile import runtime
from rvcompile.build import BuildOptions, build_artifact
from rvcompile.model.presets import gemma_4_31b
from rvcompile.sources.tokenizer_files import synthetic_tokenizer_json

# max_context and slots as benchmarks/h100_decode.py wants them (contexts 16 and 1200)
OPTS = {"max_context": 2048, "prefill_buckets": (16, 64), "max_seqs": 4}
PLANS = {"gemv": (16, 32), "tc": (16, 64)}  # h100-fp8: prefill buckets


def result_name(target: str, plan: str) -> str:
    return f"{target}-{plan}" if target == "h100-fp8" else target
PROMPT = np.random.default_rng(1).integers(4, 262144, 96).tolist()
GREEDY_PROMPT, GREEDY_TOKENS = 40, 16


def write_model_dir(model: Path, layers: int) -> None:
    """config.json (the 31B's, first `layers` layers) and a synthetic tokenizer, once."""
    if (model / "config.json").exists():
        return
    cfg = gemma_4_31b().to_hf_dict()
    cfg["num_hidden_layers"] = layers
    cfg["layer_types"] = cfg["layer_types"][:layers]
    model.mkdir(parents=True, exist_ok=True)
    (model / "tokenizer.json").write_text(synthetic_tokenizer_json(cfg["vocab_size"]))
    (model / "config.json").write_text(json.dumps(cfg))


def run_target(root: Path, target: str, layers: int, plan: str, keep_artifact: bool) -> None:
    write_model_dir(root / "model", layers)
    name = result_name(target, plan)
    out = root / f"{name}.rvp"
    opts = {**OPTS, "prefill_buckets": PLANS[plan]} if target == "h100-fp8" else OPTS
    times = {}
    t = time.perf_counter()
    build_artifact(str(root / "model"), out, BuildOptions(target, platforms=("cuda",), **opts),
                   random_weights=True, seed=0, random_ranges=rw.near_identity_init_range,
                   progress=False, log=lambda s: None)
    times["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    model = runtime.load(out)
    times["load_s"] = time.perf_counter() - t
    t = time.perf_counter()
    logits = model.logits(PROMPT)
    greedy = model.generate(PROMPT[:GREEDY_PROMPT], max_tokens=GREEDY_TOKENS,
                            ignore_eos=True).token_ids
    times["run_s"] = time.perf_counter() - t
    np.savez(root / f"{name}.npz", logits=logits, greedy=np.asarray(greedy))
    (root / f"{name}.json").write_text(json.dumps(times))
    print(f"{name} x {layers} layers: " + ", ".join(f"{k} {v:.1f}" for k, v in times.items()))
    if not keep_artifact:
        out.unlink()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("target")
    ap.add_argument("layers", type=int)
    ap.add_argument("--plan", choices=sorted(PLANS), default="gemv")
    ap.add_argument("--keep-artifact", action="store_true")
    args = ap.parse_args()
    run_target(args.root, args.target, args.layers, args.plan, args.keep_artifact)


if __name__ == "__main__":
    main()
