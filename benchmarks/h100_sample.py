"""Device-side sampling on the GPU at Gemma 4's vocabulary (V = 262144), M = 1 and 4: time of the
three sample kernels per call (median of 50 CUDA-event-timed calls after 10 warm-up calls, a new
step each call), with the single-CTA softcap_argmax of head.cu as the greedy baseline. LM-like rows
keep most of their mass in a few dozen tokens; flat rows (N(0, 1) logits) spread it over the whole
vocabulary, so top_k = 0 draws there go past the candidates (sample.py: the slower path).

    python benchmarks/h100_sample.py
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_h100_sample import DeviceSampler, lm_like_logits  # noqa: E402  (shared with the test)

from rvcompile.runtime.executors.cuda_driver import CudaContext  # noqa: E402
from rvcompile.targets.h100 import head  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

V = 262144
CASES = [  # (name, rows, temperature, top_k, top_p)
    ("greedy", "lm", 0.0, 0, 1.0),
    ("top_k 64 top_p 0.95", "lm", 1.0, 64, 0.95),
    ("top_k 1024", "lm", 1.0, 1024, 1.0),
    ("temperature only", "lm", 1.0, 0, 1.0),
    ("top_p 0.9", "lm", 1.0, 0, 0.9),
    ("flat, temperature only", "flat", 1.0, 0, 1.0),
    ("flat, top_p 0.9", "flat", 1.0, 0, 0.9),
    ("flat, top_k 5000", "flat", 1.0, 5000, 1.0),
]


def median_us(ctx: CudaContext, before_each, launch) -> float:
    times = []
    for i in range(60):
        before_each(i)
        a, b = ctx.event(), ctx.event()
        ctx.record(a)
        launch()
        ctx.record(b)
        if i >= 10:
            times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times)) * 1e3


def main() -> None:
    ctx = CudaContext()
    rng = np.random.default_rng(0)
    argmax = ctx.load_function(compile_cubin(head.SOURCE), head.ARGMAX_ENTRY)
    print(f"{'case':26} {'M':>2} {'us':>8} {'logits GB/s':>12}")
    for m in (1, 4):
        rows = {"lm": lm_like_logits(rng, m, V),
                "flat": rng.normal(0, 1, (m, V)).astype(np.float32)}
        ds = DeviceSampler(ctx, m, V)
        for name, kind, t, k, p in CASES:
            seed = rng.integers(-2**31, 2**31, m).astype(np.int32)
            ds.set_inputs(rows[kind], 30.0, np.full(m, t), np.full(m, k), np.full(m, p), seed,
                          np.zeros(m, np.int32))
            report(name, m, sampler_us(ctx, ds))
        report("softcap_argmax (head.cu)", m, argmax_us(ctx, argmax, ds))
        ds.close()


def sampler_us(ctx: CudaContext, ds: DeviceSampler) -> float:
    return median_us(ctx, lambda i: ds.set_step(np.full(ds.m, i, np.int32)), ds.launch)


def argmax_us(ctx: CudaContext, fn, ds: DeviceSampler) -> float:
    """The greedy baseline on the sampler's logits buffer."""
    launch = head.argmax_geometry(ds.m, V)
    args = [ctypes.c_uint64(ds.bufs[0].ptr), ctypes.c_int(V), ctypes.c_float(30.0),
            ctypes.c_uint64(ds.out.ptr)]
    return median_us(ctx, lambda i: None,
                     lambda: ctx.launch(fn, launch.grid, launch.block, launch.smem, args))


def report(name: str, m: int, us: float) -> None:
    print(f"{name:26} {m:>2} {us:8.1f} {m * V * 4 / us / 1e3:12.0f}", flush=True)


if __name__ == "__main__":
    main()
