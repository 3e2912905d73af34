"""The tied head on the GPU: logits f32 [M, V] = x bf16 [M, K] @ table bf16 [V, K]^T at a model's
head shape, as the lowering runs it: the bf16 GEMV (gemv_bf16, one launch per 4 rows, each
reading the whole table) against the bf16 tensor-core GEMM (gemm_tc's gemm_bf16_tc_* default
entry, reading it once), for M rows. Each figure is the median per launch sequence over 5 replays
of a CUDA graph (h100_gemm_tc.median_seconds), rotating between two table copies so the 50 MB L2
holds neither; the roofline is reading the table once at the device's measured copy rate.

    python benchmarks/h100_head.py [--model 31b|e4b] [--rows 1,4,8,16,32,64] [--json FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import json

import ml_dtypes
import numpy as np
from h100_gemm_tc import median_seconds

from rvcompile.runtime.executors import tma
from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_tc, gemv_bf16
from rvcompile.targets.h100.nvcc import compile_cubin

HEADS = {"31b": (262144, 5376), "e4b": (262144, 2560)}  # (V, K)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(HEADS), default="31b")
    p.add_argument("--rows", default="1,4,8,16,32,64")
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args()
    n, k = HEADS[a.model]
    ctx = CudaContext()
    tc = ctx.load_module(compile_cubin(gemm_tc.SOURCE))
    gemv = ctx.get_function(ctx.load_module(compile_cubin(gemv_bf16.SOURCE)), gemv_bf16.ENTRY)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal((4096, k), np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    table = np.tile(block, (n // 4096, 1))
    tables = [ctx.upload(table) for _ in range(2)]
    ones = ctx.upload(np.ones(n, np.float32))
    table_bytes = n * k * 2
    results = []
    print(f"{'model':5} {'M':>4} {'kernel':>24} {'us':>9} {'table GB/s':>11}", flush=True)
    for m in (int(r) for r in a.rows.split(",")):
        x = ctx.upload(rng.standard_normal((m, k), np.float32).astype(ml_dtypes.bfloat16))
        y = ctx.alloc(m * n * 4)
        launches = []
        for r0 in range(0, m, gemv_bf16.MAX_ROWS):
            r = min(gemv_bf16.MAX_ROWS, m - r0)
            g = gemv_bf16.launch_geometry(r, n, k, ctx.sm_count)
            launches.append((g, r0, r))
        gemv_s = sum(median_seconds(ctx, gemv, g.grid, g.block, g.smem, [[
            ctypes.c_uint64(t.ptr), ctypes.c_uint64(x.ptr + r0 * k * 2),
            ctypes.c_uint64(y.ptr + r0 * n * 4), ctypes.c_int(r), ctypes.c_int(n),
            ctypes.c_int(k)] for t in tables]) for g, r0, r in launches)
        rows = [("gemv_bf16" + (f" x{len(launches)}" if len(launches) > 1 else ""), gemv_s)]
        entry = gemm_tc.default_entry(m, n, ctx.sm_count, "bfloat16")
        t = gemm_tc.params_template(entry, m, n, k, ctx.sm_count)
        fn = ctx.get_function(tc, entry)
        ctx.set_max_dynamic_smem(fn, t.smem)
        params = [tma.KernelParams(tma.fill(ctx.cu, t, {
            "a": x.ptr, "b": tb.ptr, "d": y.ptr, "a_scale": ones.ptr, "b_scale": ones.ptr}))
            for tb in tables]
        rows.append((entry, median_seconds(ctx, fn, t.grid, t.block, t.smem,
                                           [[q.arg] for q in params])))
        for kernel, seconds in rows:
            print(f"{a.model:5} {m:>4} {kernel:>24} {seconds * 1e6:9.1f} "
                  f"{table_bytes / seconds / 1e9:11.0f}", flush=True)
            results.append({"model": a.model, "m": m, "n": n, "k": k, "kernel": kernel,
                            "us": seconds * 1e6, "table_gbps": table_bytes / seconds / 1e9})
        ctx.free(x)
        ctx.free(y)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": ctx.device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
