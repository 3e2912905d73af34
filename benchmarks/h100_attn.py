"""Paged decode attention on the GPU at 31B shapes, batch 1 and 8, 1200-token context: time of
the split kernel + combine (median of 50, CUDA events), and GB/s of K and V bytes read.

    python benchmarks/h100_attn.py
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_h100_attn import make_case  # noqa: E402  (one case builder for test and benchmark)

from rvcompile.runtime.executors.cuda_driver import CudaContext  # noqa: E402
from rvcompile.targets.h100 import attn_decode as ad  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

CASES = [("31B sliding", 16, 2, 256, 1024), ("31B full", 4, 8, 512, 0)]


def median_us(ctx: CudaContext, launch) -> float:
    for _ in range(10):
        launch()
    times = []
    for _ in range(50):
        a, b = ctx.event(), ctx.event()
        ctx.record(a)
        launch()
        ctx.record(b)
        times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times)) * 1e3


def main() -> None:
    ctx = CudaContext()
    cubin = compile_cubin(ad.SOURCE)
    combine = ctx.load_function(cubin, "attn_decode_combine")
    print(f"{'layer':12} {'B':>3} {'ctx':>5} {'splits':>6} {'us':>7} {'split':>7} "
          f"{'combine':>7} {'KV MB':>6} {'GB/s':>6}")
    for name, kh, g, d, window in CASES:
        for batch in (1, 8):
            rng = np.random.default_rng(0)
            q, k, v, table, ring, lens = make_case(rng, batch, kh, g, d, [1200] * batch, window)
            fn = ctx.load_function(cubin, ad.entry(d, g))
            keys = len(ad.visible_tokens(1200, window))
            splits = ad.num_splits(batch, kh, keys, ctx.sm_count)
            bufs = [ctx.upload(x) for x in (q, k, v, table, lens)]
            acc = ctx.alloc(batch * kh * g * splits * d * 4)
            ml = ctx.alloc(batch * kh * g * splits * 8)
            out = ctx.alloc(batch * kh * g * d * 4)
            p = [ctypes.c_uint64(x.ptr) for x in bufs]
            args = p[:4] + [ctypes.c_int(table.shape[1]), ctypes.c_int(ring), p[4],
                            ctypes.c_int(window), ctypes.c_int(kh), ctypes.c_uint64(acc.ptr),
                            ctypes.c_uint64(ml.ptr)]
            cargs = [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), ctypes.c_int(splits),
                     ctypes.c_int(d), ctypes.c_uint64(out.ptr), ctypes.c_uint64(0)]

            def split_kernel(fn=fn, args=args, splits=splits, kh=kh, batch=batch):
                ctx.launch(fn, (splits, kh, batch), (128, 1, 1), 0, args)

            def combine_kernel(cargs=cargs, splits=splits, kh=kh, batch=batch, g=g, d=d):
                ctx.launch(combine, (batch * kh * g, 1, 1), (d, 1, 1), splits * 4, cargs)

            def both(a=split_kernel, b=combine_kernel):
                a()
                b()

            t_split, t_comb, t = (median_us(ctx, f) for f in (split_kernel, combine_kernel,
                                                              both))
            kv_bytes = batch * keys * kh * d * 2 * 2
            print(f"{name:12} {batch:3d} {1200:5d} {splits:6d} {t:7.1f} {t_split:7.1f} "
                  f"{t_comb:7.1f} {kv_bytes / 1e6:6.1f} {kv_bytes / t / 1e3:6.0f}", flush=True)
            for x in (*bufs, acc, ml, out):
                ctx.free(x)


if __name__ == "__main__":
    main()
