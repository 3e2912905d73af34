"""FP8 tensor-core GEMM (gemm_tc's FP8 entries: CUTLASS SM90, e4m3 x e4m3 -> float32 with per-token
and per-channel scales) on the GPU at a model's linear shapes for M token rows, against the
mma.sync FP8-weight GEMM (gemm_fp8w: bf16 x, f32 out) and torch._scaled_mm (cuBLASLt FP8, row-wise
scales, bf16 out: torch takes no other output with row-wise scales; fast accumulation on and off),
plus the per-token quantization kernel that feeds it. Each figure is the median over 5 replays of a
CUDA graph of 20 launches (CUDA events around each replay, after warm-up; the graph keeps host
launch overhead out, as the runtime's graphs do), rotating among enough weight copies that the 50
MB L2 cannot hold them; inputs are random (never zeros).

    python benchmarks/h100_gemm_tc.py [--model 31b|e4b|26b] [--rows 16,256,2048] [--sweep]
                                      [--no-baselines] [--json FILE] [--accuracy]

--sweep times every tile configuration of gemm_tc (* marks the default for the shape) and,
for the large tiles, other tile orders of the persistent scheduler. --accuracy instead measures
the error of every entry and of torch._scaled_mm against the exact product (float64) on
model-like data (normal values quantized per row) and on random e4m3 bit patterns (the full
exponent range): the largest |d - exact| beyond d's own rounding (float32, or bf16 for torch) as
a fraction of sum_k |a b|, and
the median and largest row-wise ||d - exact|| / ||exact||.
"""

from __future__ import annotations

import argparse
import ctypes
import json

import ml_dtypes
import numpy as np

from rvcompile.runtime.executors import tma
from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_fp8w, gemm_tc
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
FP8_ENTRIES = [e for e, c in gemm_tc.CONFIGS.items() if c.element == "e4m3"]
BATCHES, PER_BATCH = 5, 20


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(MODELS), default="31b")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    p.add_argument("--sweep", action="store_true", help="time every tile configuration")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip gemm_fp8w and torch._scaled_mm")
    p.add_argument("--json", help="write every measurement here")
    p.add_argument("--accuracy", action="store_true", help="measure errors instead of time")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    ctx = CudaContext()
    tc = ctx.load_module(compile_cubin(gemm_tc.SOURCE))
    quant = ctx.load_module(compile_cubin(gemm_tc.QUANT_SOURCE))
    fp8w = ctx.load_module(compile_cubin(gemm_fp8w.SOURCE))
    torch = None if a.no_baselines else _torch()
    rng = np.random.default_rng(0)
    if a.accuracy:
        results = accuracy(ctx, tc, torch, rng)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"device": ctx.device_name(), "results": results}, f, indent=1)
        return
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
            where = {"matrix": name, "n": n, "k": k, "m": m}

            def record(kernel: str, seconds: float, default: bool = False, where=where):
                results.append(report(where, kernel, seconds, default))

            bufs = {"a": ctx.upload(random_fp8(rng, (m, k))),
                    "a_scale": ctx.upload(rng.uniform(0.5, 2, m).astype(np.float32)),
                    "d": ctx.alloc(m * n * 4), "b_scale": w_scale}
            default = gemm_tc.default_entry(m, n, ctx.sm_count)
            for entry, raster, swizzle in (sweep(m) if a.sweep else [(default, "heuristic", 1)]):
                t = gemm_tc.params_template(entry, m, n, k, ctx.sm_count, raster, swizzle)
                fn = ctx.get_function(tc, entry)
                ctx.set_max_dynamic_smem(fn, t.smem)
                params = [tma.KernelParams(tma.fill(ctx.cu, t, {
                    **{r: b.ptr for r, b in bufs.items()}, "b": wb.ptr})) for wb in w_bufs]
                order = "" if (raster, swizzle) == ("heuristic", 1) else f" {raster} s{swizzle}"
                record(entry + order, median_seconds(ctx, fn, t.grid, t.block, t.smem,
                                                     [[p.arg] for p in params]),
                       entry == default and not order)
            x = ctx.upload(rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16))
            q = gemm_tc.quant_launch(m, k, "bfloat16")
            ctx.set_max_dynamic_smem(ctx.get_function(quant, q.entry), q.smem)
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


def report(where: dict, kernel: str, seconds: float, default: bool) -> dict:
    """One timing as a JSON record, printed as a table row (* marks the default entry)."""
    flops = 2 * where["m"] * where["n"] * where["k"]
    print(f"{where['matrix']:12} {where['n']:>6}x{where['k']:<5} {where['m']:>5} {kernel:>33}"
          f"{'*' if default else ' '} {seconds * 1e6:9.1f} {flops / seconds / 1e12:8.1f}",
          flush=True)
    return {**where, "kernel": kernel, "us": seconds * 1e6, "tflops": flops / seconds / 1e12}


def sweep(m: int) -> list[tuple[str, str, int]]:
    """(entry, raster, swizzle): every entry in the scheduler's default order; from 512 rows
    also the 128 x 256 tile in each raster order with swizzles 1, 2, 4 and 8."""
    out = [(entry, "heuristic", 1) for entry in FP8_ENTRIES]
    if m >= 512:
        out += [("gemm_fp8_tc_128x256", r, s) for r in ("along_m", "along_n") for s in (1, 2, 4, 8)]
    return out


def accuracy(ctx: CudaContext, tc, torch, rng) -> list[dict]:
    m, n = 256, 2048
    out = []
    print(f"{'data':10} {'K':>6} {'kernel':>34} {'max err / sum|ab|':>18} {'row rel med':>12} "
          f"{'row rel max':>12}", flush=True)
    for data in ("normal", "full_range"):
        for k in (2112, 5376, 21504):
            if data == "normal":
                a, sa = gemm_tc.quantize_rows_reference(rng.normal(size=(m, k)))
                b, sb = gemm_tc.quantize_rows_reference(rng.normal(size=(n, k)))
            else:
                a, b = random_fp8(rng, (m, k)), random_fp8(rng, (n, k))
                sa = rng.uniform(0.5, 2, m).astype(np.float32)
                sb = rng.uniform(1e-4, 1e-3, n).astype(np.float32)
            af = gemm_tc.e4m3_to_f32(a).astype(np.float64)
            bf = gemm_tc.e4m3_to_f32(b).astype(np.float64)
            scales = sb.astype(np.float64)[None, :] * sa.astype(np.float64)[:, None]
            exact = (af @ bf.T) * scales
            magnitude = (np.abs(af) @ np.abs(bf).T) * scales
            kernels = {e: run_tc(ctx, tc, e, a, sa, b, sb) for e in FP8_ENTRIES}
            if torch is not None:
                for fast in (True, False):
                    kernels[f"torch._scaled_mm fast_accum={int(fast)}"] = torch._scaled_mm(
                        torch.from_numpy(a).cuda().view(torch.float8_e4m3fn),
                        torch.from_numpy(b).cuda().view(torch.float8_e4m3fn).t(),
                        scale_a=torch.from_numpy(sa).cuda()[:, None],
                        scale_b=torch.from_numpy(sb).cuda()[None, :],
                        out_dtype=torch.bfloat16, use_fast_accum=fast).float().cpu().numpy()
            for name, d in kernels.items():
                d = np.asarray(d, np.float64)
                rounding = 2.0 ** -8 if name.startswith("torch") else 2.0 ** -22
                excess = (np.abs(d - exact) - rounding * np.abs(exact)) / magnitude
                rel = np.linalg.norm(d - exact, axis=1) / np.linalg.norm(exact, axis=1)
                out.append({"data": data, "m": m, "n": n, "k": k, "kernel": name,
                            "max_excess": float(excess.max()),
                            "row_rel_median": float(np.median(rel)),
                            "row_rel_max": float(rel.max())})
                print(f"{data:10} {k:>6} {name:>34} {excess.max():18.3g} {np.median(rel):12.3g} "
                      f"{rel.max():12.3g}", flush=True)
    return out


def run_tc(ctx: CudaContext, module, entry: str, a, sa, b, sb) -> np.ndarray:
    """d of one gemm_tc entry, as float32."""
    (m, k), n = a.shape, b.shape[0]
    t = gemm_tc.params_template(entry, m, n, k, ctx.sm_count)
    fn = ctx.get_function(module, entry)
    ctx.set_max_dynamic_smem(fn, t.smem)
    bufs = {"a": ctx.upload(a), "a_scale": ctx.upload(sa), "b": ctx.upload(b),
            "b_scale": ctx.upload(sb), "d": ctx.alloc(m * n * 4)}
    params = tma.KernelParams(tma.fill(ctx.cu, t, {r: x.ptr for r, x in bufs.items()}))
    ctx.launch(fn, t.grid, t.block, t.smem, [params.arg])
    ctx.synchronize()
    d = ctx.download(bufs["d"], np.float32, (m, n))
    for buf in bufs.values():
        ctx.free(buf)
    return d


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
    """Per-launch time: median over batches, each one replay of a CUDA graph of PER_BATCH
    launches (rotating through `args`), so that host launch overhead stays out as it does in the
    runtime's graphs."""
    stream = ctx.stream()

    def record() -> None:
        for i in range(PER_BATCH):
            ctx.launch(fn, grid, block, smem, args[i % len(args)], stream)

    graph = ctx.capture(stream, record)
    for _ in range(2):
        ctx.graph_launch(graph, stream)
    times = []
    for _ in range(BATCHES):
        start, end = ctx.event(), ctx.event()
        ctx.record(start, stream)
        ctx.graph_launch(graph, stream)
        ctx.record(end, stream)
        times.append(ctx.elapsed_ms(start, end) * 1e-3 / PER_BATCH)
    return float(np.median(times))


def scaled_mm_seconds(torch, rng, m, n, k, w_copies, fast: bool) -> float:
    """torch._scaled_mm with a row-wise activation scale [M, 1] and a per-channel weight scale
    [1, N] (the same arithmetic as gemm_tc), bf16 out."""
    a = torch.from_numpy(random_fp8(rng, (m, k))).cuda().view(torch.float8_e4m3fn)
    sa = torch.rand(m, 1, device="cuda") + 0.5
    sb = torch.rand(1, n, device="cuda") * 1e-3

    def run(i):
        return torch._scaled_mm(a, w_copies[i % len(w_copies)].t(), scale_a=sa, scale_b=sb,
                                out_dtype=torch.bfloat16, use_fast_accum=fast)

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # warm-up (cuBLASLt's heuristics) before capture
        for i in range(5):
            run(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(PER_BATCH):
            run(i)
    graph.replay()
    times = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3 / PER_BATCH)
    return float(np.median(times))


if __name__ == "__main__":
    main()
