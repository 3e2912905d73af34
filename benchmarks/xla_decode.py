"""Single-stream decode speed of an XLA-target artifact against its weight-bytes roofline.

Builds MODEL with random weights for TARGET (on this machine), loads it through the normal
runtime API and times greedy decode after a short and a long prompt. The roofline is the bytes
of all weights read once per decode step over the HBM read bandwidth measured in the same run
(a jitted sum over a 4 GiB array). Warm-up is excluded. Writes a JSON report.

Decode runs as the engine runs it for one request: device-side loop calls of --loop-steps tokens
(decode_many). `--compare-loop` also times the same generations with one decode call per token
(the executor's loop hidden from the engine) and reports both.

    python benchmarks/xla_decode.py --model gemma-4-31B --target tpu-int8 --json out.json
    python benchmarks/xla_decode.py --model gemma-4-tiny --target tpu-bf16 --compare-loop \
        --bandwidth-gib 1 --long-prompt 200 --max-context 512 --json tiny.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import numpy as np


def measure_read_bandwidth(gib: float = 4.0, reps: int = 20) -> float:
    import jax
    import jax.numpy as jnp

    n = int(gib * 2**30) // 4
    x = jax.random.uniform(jax.random.key(0), (n,), jnp.float32)
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    del x
    return n * 4 / float(np.median(times))


class PerStepOnly:
    """An executor with its decode loop hidden: the engine then calls decode once per token."""

    def __init__(self, executor):
        self._executor = executor

    def __getattr__(self, name):
        if name in ("decode_many", "decode_loop_steps", "decode_loop_stops"):
            raise AttributeError(name)
        return getattr(self._executor, name)


def time_decode(models: dict, prompt_len: int, new_tokens: int, seed: int,
                reps: int) -> list[dict]:
    """Per mode, the median of `reps` generations (after a warm-up one) of new_tokens after a
    random prompt. The modes take turns on each prompt, so load drifting on a shared machine
    hits them alike; every round has a fresh prompt, so no engine gets a prefix-cache hit (the
    modes' engines share the executor's pools)."""
    rng = np.random.default_rng(seed)
    vocab = next(iter(models.values())).vocab_size
    runs: dict[str, list] = {mode: [] for mode in models}
    for rep in range(reps + 1):
        prompt = [2, *rng.integers(4, vocab, size=prompt_len - 1).tolist()]
        for mode, m in models.items():
            r = m.generate(prompt, max_tokens=new_tokens, ignore_eos=True)
            if rep:  # the first round is the warm-up at this length
                runs[mode].append(r)
    out = []
    for mode, rs in runs.items():
        r = sorted(rs, key=lambda r: r.decode_tok_s)[len(rs) // 2]
        out.append({"mode": mode, "prompt_tokens": prompt_len, "new_tokens": len(r.token_ids),
                    "ttft_ms": r.ttft_s * 1e3, "decode_tok_s": r.decode_tok_s,
                    "ms_per_token": 1e3 / r.decode_tok_s,
                    "all_decode_tok_s": [x.decode_tok_s for x in rs]})
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma-4-31B")
    p.add_argument("--target", default="tpu-int8")
    p.add_argument("--artifact", default="/tmp/bench.rvp")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=1200)
    p.add_argument("--loop-steps", type=int, default=32,
                   help="decode steps per device-side loop call (0: one call per token)")
    p.add_argument("--compare-loop", action="store_true",
                   help="also time one decode call per token and report both")
    p.add_argument("--reps", type=int, default=3, help="timed generations per mode and prompt")
    p.add_argument("--bandwidth-gib", type=float, default=4.0,
                   help="size of the array the read bandwidth is measured on")
    p.add_argument("--json", required=True)
    a = p.parse_args()
    import jax

    from rvcompile import runtime
    from rvcompile.build import BuildOptions, build_artifact

    report: dict = {"model": a.model, "target": a.target, "device": str(jax.devices()[0]),
                    "jax": jax.__version__}
    try:
        report["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                          capture_output=True, text=True).stdout.strip()
    except OSError:
        report["commit"] = "unknown"
    bw = measure_read_bandwidth(a.bandwidth_gib)
    report["hbm_read_GBps"] = bw / 1e9
    print(f"HBM read bandwidth: {bw / 1e9:.0f} GB/s", flush=True)

    opts = BuildOptions(a.target, max_context=a.max_context, prefill_buckets=(16, 256), max_seqs=1,
                        decode_loop_steps=a.loop_steps)
    b = build_artifact(a.model, Path(a.artifact), opts, random_weights=True, seed=0,
                       progress=False)
    report["build_s"], report["weight_bytes"] = b.seconds, b.weight_bytes
    print(f"built {b.artifact_bytes / 1e9:.1f} GB in {b.seconds:.0f} s", flush=True)

    t0 = time.perf_counter()
    m = runtime.load(a.artifact, verify=False)
    ex = m.executor
    report["load_s"], report["xla_compile_s"] = time.perf_counter() - t0, ex.compile_s
    report["upload_s"] = ex.upload_s
    print(f"loaded in {report['load_s']:.1f} s (compile {ex.compile_s:.1f} s)", flush=True)

    roofline_ms = b.weight_bytes / bw * 1e3
    report["roofline_ms_per_token"] = roofline_ms
    report["roofline_tok_s"] = 1e3 / roofline_ms
    report["decode_loop_steps"] = ex.decode_loop_steps
    modes = {f"loop{ex.decode_loop_steps}" if ex.decode_loop_steps else "per-step": m}
    if a.compare_loop and ex.decode_loop_steps:
        modes["per-step"] = runtime.Model(m.art, PerStepOnly(ex))
    report["runs"] = []
    for n in (16, a.long_prompt):
        for r in time_decode(modes, n, a.new_tokens, seed=n, reps=a.reps):
            r["fraction_of_roofline"] = roofline_ms / r["ms_per_token"]
            r["achieved_GBps"] = b.weight_bytes / r["ms_per_token"] / 1e6
            report["runs"].append(r)
            print(f"{r['mode']:>9} prompt {r['prompt_tokens']:5d}: {r['decode_tok_s']:.1f} tok/s "
                  f"({r['ms_per_token']:.2f} ms/token, {r['achieved_GBps']:.1f} GB/s; roofline "
                  f"{roofline_ms:.2f} ms = {report['roofline_tok_s']:.1f} tok/s, "
                  f"{100 * r['fraction_of_roofline']:.0f}%) TTFT {r['ttft_ms']:.0f} ms",
                  flush=True)
    Path(a.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
