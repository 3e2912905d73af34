"""Single-stream decode speed of an XLA-target artifact against its weight-bytes roofline.

Builds MODEL with random weights for TARGET (on this machine), loads it through the normal
runtime API and times greedy decode after a short and a long prompt. The roofline is the bytes
of all weights read once per decode step over the HBM read bandwidth measured in the same run
(a jitted sum over a 4 GiB array). Warm-up is excluded. Writes a JSON report.

    python benchmarks/xla_decode.py --model gemma-4-31B --target tpu-int8 --json out.json
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


def time_decode(m, prompt_len: int, new_tokens: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    prompt = [2, *rng.integers(4, m.vocab_size, size=prompt_len - 1).tolist()]
    m.generate(prompt, max_tokens=4, ignore_eos=True)  # warm-up at this length
    r = m.generate(prompt, max_tokens=new_tokens, ignore_eos=True)
    return {"prompt_tokens": prompt_len, "new_tokens": len(r.token_ids),
            "ttft_ms": r.ttft_s * 1e3, "decode_tok_s": r.decode_tok_s,
            "ms_per_token": 1e3 / r.decode_tok_s}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma-4-31B")
    p.add_argument("--target", default="tpu-int8")
    p.add_argument("--artifact", default="/tmp/bench.rvp")
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--long-prompt", type=int, default=1200)
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
    bw = measure_read_bandwidth()
    report["hbm_read_GBps"] = bw / 1e9
    print(f"HBM read bandwidth: {bw / 1e9:.0f} GB/s", flush=True)

    opts = BuildOptions(a.target, max_context=a.max_context, prefill_buckets=(16, 256), slots=1)
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
    report["runs"] = [time_decode(m, n, a.new_tokens, seed=n)
                      for n in (16, a.long_prompt)]
    for r in report["runs"]:
        r["fraction_of_roofline"] = roofline_ms / r["ms_per_token"]
        print(f"prompt {r['prompt_tokens']:5d}: {r['decode_tok_s']:.1f} tok/s "
              f"({r['ms_per_token']:.2f} ms/token, roofline {roofline_ms:.2f} ms = "
              f"{report['roofline_tok_s']:.1f} tok/s, {100 * r['fraction_of_roofline']:.0f}%)"
              f" TTFT {r['ttft_ms']:.0f} ms", flush=True)
    Path(a.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
