"""FP8 decode GEMV bandwidth on the GPU at the 31B's matrix shapes (M=1), in GB/s of weight
bytes: median of 50 timed launches after warm-up, rotating among enough weight copies that the
50 MB L2 cannot hold them. Compare with shared/H100-NOTES.md (Triton W8A16 1.1-2.8 TB/s, HBM
read ceiling 2.99-3.10 TB/s).

    python benchmarks/h100_gemv.py [--cubin A.cubin --cubin B.cubin --repeat 2]
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import ml_dtypes
import numpy as np

from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemv_fp8
from rvcompile.targets.h100.nvcc import compile_cubin

SHAPES = {"qkv_sliding": (16384, 5376), "qk_full": (18432, 5376), "o_sliding": (5376, 8192),
          "o_full": (5376, 16384), "gate_up": (43008, 5376), "down": (5376, 21504),
          "head": (262144, 5376)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cubin", action="append", default=[],
                   help="benchmark this cubin instead of the built one (repeatable)")
    p.add_argument("--repeat", type=int, default=1)
    a = p.parse_args()
    ctx = CudaContext()
    cubins = {c: Path(c).read_bytes() for c in a.cubin} or {"built": compile_cubin(gemv_fp8.SOURCE)}
    for r in range(a.repeat):
        for label, cubin in cubins.items():
            print(f"== {label} (pass {r + 1})")
            bench(ctx, ctx.load_function(cubin, gemv_fp8.ENTRY))


def bench(ctx: CudaContext, fn) -> None:
    rng = np.random.default_rng(0)
    print(f"{'matrix':12} {'N x K':>14} {'MB':>6} {'us':>8} {'GB/s':>7}")
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-200 * 2**20 // (n * k)))
        w = rng.integers(0, 256, size=(n, k), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] ^= 1
        bufs = [ctx.upload(w) for _ in range(copies)]
        ds = ctx.upload(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        dx = ctx.upload(rng.normal(size=(1, k)).astype(ml_dtypes.bfloat16))
        dy = ctx.alloc(n * 4)
        launch = gemv_fp8.launch_geometry(1, n, k, ctx.sm_count)
        ctx.set_max_dynamic_smem(fn, launch.smem)

        args = [[ctypes.c_uint64(buf.ptr), ctypes.c_uint64(ds.ptr), ctypes.c_uint64(dx.ptr),
                 ctypes.c_uint64(dy.ptr), ctypes.c_int(1), ctypes.c_int(n), ctypes.c_int(k)]
                for buf in bufs]
        for i in range(10):
            ctx.launch(fn, launch.grid, launch.block, launch.smem, args[i % copies])
        times = []
        for i in range(50):
            a, b = ctx.event(), ctx.event()
            ctx.record(a)
            ctx.launch(fn, launch.grid, launch.block, launch.smem, args[i % copies])
            ctx.record(b)
            times.append(ctx.elapsed_ms(a, b))
        t = float(np.median(times)) * 1e-3
        print(f"{name:12} {n:>7}x{k:<6} {n * k / 1e6:6.0f} {t * 1e6:8.1f} {n * k / t / 1e9:7.0f}",
              flush=True)
        for buf in (*bufs, ds, dx, dy):
            ctx.free(buf)


if __name__ == "__main__":
    main()
