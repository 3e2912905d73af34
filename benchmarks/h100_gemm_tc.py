"""FP8 tensor-core GEMM (gemm_fp8_tc: CUTLASS SM90, e4m3 x e4m3 -> bf16 with per-token and
per-channel scales) on the GPU at a model's linear shapes for M token rows, against the mma.sync
FP8-weight GEMM (gemm_fp8w: bf16 x, f32 out) and torch._scaled_mm (cuBLASLt FP8, row-wise
scales, bf16 out; fast accumulation on and off), plus the per-token quantization kernel that
feeds it. Each figure is the median over 5 batches of 20 back-to-back launches (CUDA events
around each batch, after warm-up), rotating among enough weight copies that the 50 MB L2 cannot
hold them; inputs are random (never zeros).

    python benchmarks/h100_gemm_tc.py [--model 31b|e4b|26b] [--rows 16,256,2048] [--sweep]
                                      [--no-baselines] [--json FILE]

--sweep times every tile configuration of gemm_fp8_tc (* marks the M bucket's default).
"""

from __future__ import annotations

import argparse
import ctypes
import json

import ml_dtypes
import numpy as np

from rvcompile.runtime import tma
from rvcompile.runtime.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_fp8_tc, gemm_fp8w
from rvcompile.targets.h100.nvcc import compile_cubin

MODELS = {  # name: {matrix: (N, K)}
    "31b": {"qkv_sliding": (16384, 5376), "qk_full": (18432, 5376), "o_sliding": (5376, 8192),
            "o_full": (5376, 16384), "gate_up": (43008, 5376), "down": (5376, 21504)},
    "e4b": {"qkv_sliding": (3072, 2560), "qk_full": (6144, 2560), "o_sliding": (2560, 2048),
            "gate_up": (20480, 2560), "down": (2560, 10240)},
    "26b": {"qkv_sliding": (8192, 2816), "qk_full": (9216, 2816), "o_sliding": (2816, 4096),
            "gate_up": (4224, 2816), "down": (2816, 2112)},
}
ROWS = (16, 64, 128, 256, 512, 1024, 2048)
BATCHES, PER_BATCH = 5, 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="31b")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--sweep", action="store_true", help="time every tile configuration")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip gemm_fp8w and torch._scaled_mm")
    p.add_argument("--json", help="write every measurement here")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    ctx = CudaContext()
    tc = ctx.load_module(compile_cubin(gemm_fp8_tc.SOURCE))
    quant = ctx.load_module(compile_cubin(gemm_fp8_tc.QUANT_SOURCE))
    fp8w = ctx.load_module(compile_cubin(gemm_fp8w.SOURCE))
    torch = None if a.no_baselines else _torch()
    rng = np.random.default_rng(0)
    results = []
    print(f"{'matrix':12} {'N x K':>12} {'M':>5} {'kernel':>34} {'us':>9} {'TFLOP/s':>8}",
          flush=True)
    for name, (n, k) in MODELS[a.model].items():
        copies = max(2, -(-200 * 2**20 // (n * k)))
        w = random_fp8(rng, (n, k))
        w_bufs = [ctx.upload(w) for _ in range(copies)]
        w_scale = ctx.upload(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        w_torch = (None if torch is None else
                   [torch.from_numpy(w).cuda().view(torch.float8_e4m3fn) for _ in range(copies)])
        for m in rows:
            flops = 2 * m * n * k

            def record(kernel: str, seconds: float, default: bool = False, m=m, flops=flops):
                results.append({"matrix": name, "n": n, "k": k, "m": m, "kernel": kernel,
                                "us": seconds * 1e6, "tflops": flops / seconds / 1e12})
                mark = "*" if default else " "
                print(f"{name:12} {n:>6}x{k:<5} {m:>5} {kernel:>33}{mark} {seconds * 1e6:9.1f} "
                      f"{flops / seconds / 1e12:8.1f}", flush=True)

            bufs = {"a": ctx.upload(random_fp8(rng, (m, k))),
                    "a_scale": ctx.upload(rng.uniform(0.5, 2, m).astype(np.float32)),
                    "d": ctx.alloc(m * n * 2), "b_scale": w_scale}
            default = gemm_fp8_tc.default_entry(m)
            for entry in (gemm_fp8_tc.CONFIGS if a.sweep else [default]):
                t = gemm_fp8_tc.params_template(entry, m, n, k, ctx.sm_count)
                fn = ctx.get_function(tc, entry)
                ctx.set_max_dynamic_smem(fn, t.smem)
                params = [tma.KernelParams(tma.fill(ctx.cu, t, {
                    **{r: b.ptr for r, b in bufs.items()}, "b": wb.ptr})) for wb in w_bufs]
                record(entry, median_seconds(ctx, fn, t.grid, t.block, t.smem,
                                             [[p.arg] for p in params]), entry == default)
            x = ctx.upload(rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16))
            q = gemm_fp8_tc.quant_launch(m, k, "bfloat16")
            qs = median_seconds(ctx, ctx.get_function(quant, q.entry), q.grid, q.block, q.smem,
                                [[ctypes.c_uint64(x.ptr), ctypes.c_uint64(bufs["a"].ptr),
                                  ctypes.c_uint64(bufs["a_scale"].ptr), ctypes.c_int(m),
                                  ctypes.c_int(k)]])
            results.append({"matrix": name, "n": n, "k": k, "m": m, "kernel": q.entry,
                            "us": qs * 1e6, "gbps": m * k * 3 / qs / 1e9})
            print(f"{name:12} {n:>6}x{k:<5} {m:>5} {q.entry:>33}  {qs * 1e6:9.1f} "
                  f"{m * k * 3 / qs / 1e9:7.0f} GB/s", flush=True)
            if not a.no_baselines:
                launch = gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count)
                fn = ctx.get_function(fp8w, launch.entry)
                ctx.set_max_dynamic_smem(fn, launch.smem)
                y = ctx.alloc(m * n * 4)
                record(f"gemm_fp8w ({launch.entry})", median_seconds(
                    ctx, fn, launch.grid, launch.block, launch.smem,
                    [[ctypes.c_uint64(wb.ptr), ctypes.c_uint64(w_scale.ptr),
                      ctypes.c_uint64(x.ptr), ctypes.c_uint64(y.ptr), ctypes.c_int(m),
                      ctypes.c_int(n), ctypes.c_int(k)] for wb in w_bufs]))
                ctx.free(y)
            ctx.free(x)
            if torch is not None:
                for fast in (True, False):
                    record(f"torch._scaled_mm fast_accum={int(fast)}",
                           scaled_mm_seconds(torch, rng, m, n, k, w_torch, fast))
            for r in ("a", "a_scale", "d"):
                ctx.free(bufs[r])
        for buf in (*w_bufs, w_scale):
            ctx.free(buf)
        del w_torch
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": ctx.device_name(), "model": a.model, "results": results}, f,
                      indent=1)


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def random_fp8(rng, shape) -> np.ndarray:
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1
    return b


def median_seconds(ctx: CudaContext, fn, grid, block, smem, args: list) -> float:
    """Per-launch time: median over batches of back-to-back launches (the queue stays full, so
    host launch overhead is hidden as in a CUDA graph), rotating through `args`."""
    for i in range(5):
        ctx.launch(fn, grid, block, smem, args[i % len(args)])
    times = []
    for _ in range(BATCHES):
        start, end = ctx.event(), ctx.event()
        ctx.record(start)
        for i in range(PER_BATCH):
            ctx.launch(fn, grid, block, smem, args[i % len(args)])
        ctx.record(end)
        times.append(ctx.elapsed_ms(start, end) * 1e-3 / PER_BATCH)
    return float(np.median(times))


def scaled_mm_seconds(torch, rng, m, n, k, w_copies, fast: bool) -> float:
    """torch._scaled_mm with a row-wise activation scale [M, 1] and a per-channel weight scale
    [1, N] (the same arithmetic as gemm_fp8_tc), bf16 out."""
    a = torch.from_numpy(random_fp8(rng, (m, k))).cuda().view(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") * 1e-3

    def run(i):
        return torch._scaled_mm(a, w_copies[i % len(w_copies)].t(), scale_a=sa, scale_b=sb,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    for i in range(5):
        run(i)
    times = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(PER_BATCH):
            run(i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / PER_BATCH)
    return float(np.median(times))


if __name__ == "__main__":
    main()
