"""How far two builds' logits drift apart with depth, with and without the near-identity
conditioning of the random weights (random_weights.near_identity_init_range).

Builds two XLA targets (default xla-f32 and tpu-bf16, exported for the CPU) of the 31B's config
cut to hidden 256 / intermediate 512 / vocab 4096 and to each depth in --depths (its layer
pattern kept; the last layer made full attention, as Gemma4Config requires), from the same
`--random-weights` seed, with the weights in each of three conditionings:

    none            as `--random-weights` draws them
    qk-norms        q/k norm weights as near_identity_init_range draws them, the rest as none
    near-identity   near_identity_init_range (q/k norms, post-norms, layer scalars)

Each runs teacher-forced logits of one fixed random prompt; per (depth, conditioning) it reports
the top-1 agreement of the two targets, their mean and max abs logit difference and the first
target's logits std. This is the measurement behind the conditioning of tests/test_h100_vs_xla.py.

Every build runs in a process of its own (`--jobs` of them at once), passing its conditioning
to build_artifact as `random_ranges`.

    python benchmarks/depth_drift.py --json docs/results/depth-drift.json
    python benchmarks/depth_drift.py --depths 6,12 --targets xla-f32,xla-fp8 --jobs 2
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from rvcompile.targets import registry

CUT = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096}
CONDITIONINGS = ("none", "qk-norms", "near-identity")
QK_NORMS = ("q_norm.weight", "k_norm.weight")
MAX_CONTEXT = 256


@dataclass(frozen=True)
class Drift:
    depth: int
    conditioning: str  # one of CONDITIONINGS
    top1: float  # fraction of positions whose argmax the two targets share
    mean_abs: float  # mean |logit difference| over positions x vocab
    max_abs: float
    logits_std: float  # of the first target's logits, for scale
    build_run_s: tuple[float, float]  # per target: build + load + logits, in its own process


def write_model_dir(model: Path, depth: int) -> None:
    """config.json (the 31B's cut to CUT and `depth` layers) and a synthetic tokenizer."""
    from rvcompile.model.presets import gemma_4_31b
    from rvcompile.sources.tokenizer_files import synthetic_tokenizer_json

    cfg = gemma_4_31b().to_hf_dict()
    cfg.update(CUT, num_hidden_layers=depth)
    cfg["layer_types"] = [*cfg["layer_types"][:depth - 1], "full_attention"]
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "tokenizer.json").write_text(synthetic_tokenizer_json(cfg["vocab_size"]))


def target_logits(model: Path, target: str, conditioning: str, seed: int,
                  prompt: list[int]) -> tuple[np.ndarray, float]:
    """In a fresh process: build `target` from `model`, run the prompt; (logits, seconds)."""
    import rvcompile.sources.random_weights as rw
    from rvcompile import runtime
    from rvcompile.build import BuildOptions, build_artifact

    def qk_norms_only(name: str, shape: tuple[int, ...]) -> tuple[float, float]:
        rule = rw.near_identity_init_range if name.endswith(QK_NORMS) else rw.init_range
        return rule(name, shape)

    ranges = {"none": rw.init_range, "qk-norms": qk_norms_only,
              "near-identity": rw.near_identity_init_range}[conditioning]
    t = time.perf_counter()
    out = model.parent / f"{target}-{conditioning}.rvp"
    opts = BuildOptions(target, max_context=MAX_CONTEXT, prefill_buckets=(len(prompt),), max_seqs=1,
                        platforms=("cpu",))
    build_artifact(str(model), out, opts, random_weights=True, seed=seed, random_ranges=ranges,
                   progress=False, log=lambda s: None)
    logits = runtime.load(out).logits(prompt)
    out.unlink()
    return logits, time.perf_counter() - t


def measure(work: Path, depths: list[int], targets: tuple[str, str], seed: int, prompt: list[int],
            jobs: int) -> list[Drift]:
    for depth in depths:
        write_model_dir(work / f"d{depth}" / "model", depth)
    cases = [(d, c, t) for d in depths for c in CONDITIONINGS for t in targets]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(jobs, mp_context=spawn, max_tasks_per_child=1) as pool:
        runs = {case: pool.submit(target_logits, work / f"d{case[0]}" / "model", case[2], case[1],
                                  seed, prompt)
                for case in cases}
        drifts = []
        for depth in depths:
            for cond in CONDITIONINGS:
                (a, sa), (b, sb) = (runs[depth, cond, t].result() for t in targets)
                err = np.abs(a - b)
                drift = Drift(depth, cond, float((a.argmax(-1) == b.argmax(-1)).mean()),
                              float(err.mean()), float(err.max()), float(a.std()), (sa, sb))
                print(f"{depth:3d} layers  {cond:13s}  top-1 {drift.top1:.3f}  mean abs "
                      f"{drift.mean_abs:.4f}  max abs {drift.max_abs:.3f}  logits std "
                      f"{drift.logits_std:.3f}  ({sa:.0f} s + {sb:.0f} s)", flush=True)
                drifts.append(drift)
    return drifts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--depths", default="6,30,60", help="comma-separated layer counts")
    ap.add_argument("--targets", default="xla-f32,tpu-bf16",
                    help="two XLA targets, comma-separated")
    ap.add_argument("--seed", type=int, default=0, help="the --random-weights seed")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--jobs", type=int, default=1, help="builds at once, each its own process")
    ap.add_argument("--json", type=Path, help="write the report here")
    args = ap.parse_args()
    try:
        depths = [int(d) for d in args.depths.split(",")]
    except ValueError:
        ap.error(f"--depths: comma-separated integers (got {args.depths!r})")
    targets = tuple(args.targets.split(","))
    if len(targets) != 2:
        ap.error(f"--targets: two targets, comma-separated (got {args.targets!r})")
    xla_targets = [name for name, spec in registry().items() if spec.runtime == "xla"]
    if unknown := [t for t in targets if t not in xla_targets]:
        ap.error(f"--targets: {', '.join(unknown)} not an XLA target (known: "
                 f"{', '.join(xla_targets)})")
    if min(depths) < 1:
        ap.error(f"--depths: every depth must be >= 1 (got {args.depths!r})")
    if not 0 < args.prompt_tokens <= MAX_CONTEXT:
        ap.error(f"--prompt-tokens must be in [1, {MAX_CONTEXT}]")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # inherited by the build processes
    prompt = np.random.default_rng(1).integers(4, CUT["vocab_size"], args.prompt_tokens).tolist()
    print(f"{targets[0]} vs {targets[1]}, 31B layer pattern cut to {CUT}, seed {args.seed}, "
          f"{args.prompt_tokens}-token prompt", flush=True)
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="depth-drift-") as work:
        drifts = measure(Path(work), depths, targets, args.seed, prompt, args.jobs)
    print(f"total {time.perf_counter() - t:.0f} s", flush=True)
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        report = {"targets": targets, "cut": CUT, "seed": args.seed, "prompt": prompt,
                  "commit": commit, "drift": [asdict(d) for d in drifts]}
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
