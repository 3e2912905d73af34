"""Prefill attention on the GPU at 31B shapes: attn_prefill (one launch per layer) against the
path prefill took before it (attn_decode's split kernel + combine with one row per token), for
a chunk of T = 256 and 1024 tokens after `start` earlier tokens. Median of 20, CUDA events;
TFLOP/s counts 4 * visible keys * D flops per query head (Q.K^T and P.V, as dense bf16).

    python benchmarks/h100_prefill_attn.py
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_h100_attn import make_prefill_case  # noqa: E402  (one case builder for test and bench)

from rvcompile.runtime.executors.cuda_driver import CudaContext  # noqa: E402
from rvcompile.targets.h100 import attn_decode as ad  # noqa: E402
from rvcompile.targets.h100 import attn_prefill as ap  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

# (layer, KV heads, group, head dim, window, K=V)
LAYERS = [("31B sliding", 16, 2, 256, 1024, False), ("31B full K=V", 4, 8, 512, 0, True)]
CHUNKS = [(256, 0), (1024, 0), (1024, 1024)]  # (T, start)


def median_us(ctx: CudaContext, launch, reps: int = 20) -> float:
    for _ in range(3):
        launch()
    times = []
    for _ in range(reps):
        a, b = ctx.event(), ctx.event()
        ctx.record(a)
        launch()
        ctx.record(b)
        times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times)) * 1e3


def main() -> None:
    ctx = CudaContext()
    pre_cubin, dec_cubin = compile_cubin(ap.SOURCE), compile_cubin(ad.SOURCE)
    combine = ctx.load_function(dec_cubin, ad.COMBINE_ENTRY)
    print(f"{'layer':14} {'T':>5} {'start':>5} {'prefill us':>10} {'TFLOP/s':>7} "
          f"{'per-row us':>10} {'speedup':>7}")
    for name, kh, g, d, window, keqv in LAYERS:
        for t, start in CHUNKS:
            rng = np.random.default_rng(0)
            q, _, _, kp, vp, table, ring, pos = make_prefill_case(rng, kh, g, d, start, t,
                                                                  window, 0, keqv)
            kp, vp = np.nan_to_num(kp), np.nan_to_num(vp)
            nh = kh * g
            wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
            inv_freq = (1e6 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
            seq_len = (pos + 1).astype(np.int32)
            bufs = {k: ctx.upload(v) for k, v in dict(q=q, k=kp, v=vp, table=table, pos=pos,
                                                       seq_len=seq_len, wk=wk,
                                                       inv_freq=inv_freq).items()}
            p = {k: ctypes.c_uint64(v.ptr) for k, v in bufs.items()}
            out, out_bf16 = ctx.alloc(t * nh * d * 4), ctx.alloc(t * nh * d * 2)
            po, pob = ctypes.c_uint64(out.ptr), ctypes.c_uint64(out_bf16.ptr)
            i32 = ctypes.c_int

            fn = ctx.load_function(pre_cubin, (ap.entry_keqv if keqv else ap.entry)(d, g))
            geo = ap.geometry(t, kh, d, g, keqv)
            if geo.smem > 48 << 10:
                ctx.set_max_dynamic_smem(fn, geo.smem)
            pools = [p["k"]] if keqv else [p["k"], p["v"]]
            args = [p["q"], *pools, p["table"], i32(ring), p["pos"], i32(window), i32(kh), i32(t)]
            args += ([p["wk"], p["inv_freq"]] if keqv else []) + [po, pob]

            def prefill(fn=fn, geo=geo, args=args):
                ctx.launch(fn, geo.grid, geo.block, geo.smem, args)

            keys = min(start + t, window or start + t)
            splits = ad.num_splits(t, kh, keys, ctx.sm_count)
            acc, ml = ctx.alloc(t * nh * splits * d * 4), ctx.alloc(t * nh * splits * 8)
            dfn = ctx.load_function(dec_cubin, (ad.entry_keqv if keqv else ad.entry)(d, g))
            dargs = [p["q"], *pools, p["table"], i32(ring), i32(ring), p["seq_len"], i32(window),
                     i32(kh)] + ([p["wk"], p["inv_freq"]] if keqv else [])
            dargs += [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), ctypes.c_uint64(0),
                      ctypes.c_uint64(0)]
            split, comb = ad.split_geometry(t, kh, splits), ad.combine_geometry(t, nh, d, splits)
            cargs = [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), i32(splits), i32(d), po,
                     pob]

            def per_row(dfn=dfn, dargs=dargs, split=split, comb=comb, cargs=cargs):
                ctx.launch(dfn, split.grid, split.block, split.smem, dargs)
                ctx.launch(combine, comb.grid, comb.block, comb.smem, cargs)

            t_pre, t_row = median_us(ctx, prefill), median_us(ctx, per_row)
            seen = sum(len(ad.visible_tokens(int(s), window)) for s in seq_len)
            tflops = 4 * seen * d * nh / t_pre / 1e6
            print(f"{name:14} {t:5d} {start:5d} {t_pre:10.1f} {tflops:7.1f} {t_row:10.1f} "
                  f"{t_row / t_pre:7.1f}", flush=True)
            for x in (*bufs.values(), out, out_bf16, acc, ml):
                ctx.free(x)


if __name__ == "__main__":
    main()
