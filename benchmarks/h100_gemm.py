"""FP8-weight prefill GEMM on the GPU at the 31B's matrix shapes, M = 16, 64 and 256 token rows:
time per call, TFLOP/s, and GB/s of weight bytes (W read once per call). Each figure is the
median over 5 batches of 20 back-to-back launches (CUDA events around each batch, after warm-up),
rotating among enough weight copies that the 50 MB L2 cannot hold them. Compare with
shared/H100-NOTES.md (HBM read ceiling ~3 TB/s; bf16 tensor-core rate ~800 TFLOP/s).

    python benchmarks/h100_gemm.py [--sweep | --split S]

--sweep also times other rows-per-CTA and split-K choices (* marks the default); --split forces
one split-K size everywhere.
"""

from __future__ import annotations

import argparse
import ctypes

import ml_dtypes
import numpy as np

from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_fp8w
from rvcompile.targets.h100.nvcc import compile_cubin

SHAPES = {"qkv_sliding": (16384, 5376), "qk_full": (18432, 5376), "o_sliding": (5376, 8192),
          "o_full": (5376, 16384), "gate_up": (43008, 5376), "down": (5376, 21504)}
ROWS = (16, 64, 256)
BATCHES, PER_BATCH = 5, 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true",
                   help="also time other rows-per-CTA and split-K choices")
    p.add_argument("--split", type=int, choices=gemm_fp8w.SPLITS, help="force this split-K size")
    a = p.parse_args()
    ctx = CudaContext()
    cubin = compile_cubin(gemm_fp8w.SOURCE)
    fns: dict[str, object] = {}
    rng = np.random.default_rng(0)
    print(f"{'matrix':12} {'N x K':>13} {'M':>4} {'entry':>18} {'grid':>13} {'us':>8} "
          f"{'TFLOP/s':>8} {'GB/s':>6}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-200 * 2**20 // (n * k)))
        w = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] ^= 1
        bufs = [ctx.upload(w) for _ in range(copies)]
        ds = ctx.upload(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        for m in ROWS:
            dx = ctx.upload(rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16))
            dy = ctx.alloc(m * n * 4)
            default = gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count, split=a.split)
            launches = sweep(m, n, k, ctx.sm_count) if a.sweep else [default]
            for launch in launches:
                if launch.entry not in fns:
                    fns[launch.entry] = ctx.load_function(cubin, launch.entry)
                    ctx.set_max_dynamic_smem(fns[launch.entry], launch.smem)
                args = [[ctypes.c_uint64(buf.ptr), ctypes.c_uint64(ds.ptr),
                         ctypes.c_uint64(dx.ptr), ctypes.c_uint64(dy.ptr), ctypes.c_int(m),
                         ctypes.c_int(n), ctypes.c_int(k)] for buf in bufs]
                t = median_seconds(ctx, fns[launch.entry], launch, args)
                mark = "*" if launch == default else " "
                print(f"{name:12} {n:>6}x{k:<6} {m:>4} {launch.entry:>18}{mark}"
                      f"{str(launch.grid):>13} {t * 1e6:8.1f} {2 * m * n * k / t / 1e12:8.1f} "
                      f"{n * k / t / 1e9:6.0f}", flush=True)
            ctx.free(dx)
            ctx.free(dy)
        for buf in (*bufs, ds):
            ctx.free(buf)


def sweep(m: int, n: int, k: int, sm_count: int) -> list[gemm_fp8w.Launch]:
    """Every split at the default rows per CTA, half of it and twice it."""
    block_m = gemm_fp8w.default_block_m(m)
    return [gemm_fp8w.launch_geometry(m, n, k, sm_count, block_m=b, split=s)
            for b in (block_m // 2, block_m, block_m * 2) if b in gemm_fp8w.BLOCK_MS
            for s in gemm_fp8w.SPLITS]


def median_seconds(ctx: CudaContext, fn, launch, args: list) -> float:
    """Per-launch time: median over batches of back-to-back launches (the queue stays full, so
    host launch overhead is hidden as it is in a CUDA graph)."""
    for i in range(5):
        ctx.launch(fn, launch.grid, launch.block, launch.smem, args[i % len(args)])
    times = []
    for _ in range(BATCHES):
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for i in range(PER_BATCH):
            ctx.launch(fn, launch.grid, launch.block, launch.smem, args[i % len(args)])
        ctx.record(end)
        times.append(ctx.elapsed_ms(start, end) * 1e-3 / PER_BATCH)
    return float(np.median(times))


if __name__ == "__main__":
    main()
