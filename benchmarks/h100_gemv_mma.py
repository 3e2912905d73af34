"""Small-batch FP8 decode GEMV (gemv_mma_fp8) on the GPU at a model's layer shapes (default the
31B's) for M = 1, 2, 4, 8, 16 and 32 token rows, both row kinds (bf16 rows: "gemv_mma"; bf16 rows
run in f16 with a _q twin's q_scale: "f16"), against the older kernels for the same product:
gemv_fp8 (M <= 4) and gemm_fp8w. Time per call and GB/s of weight bytes (W read once per call):
each figure is the median over 5 batches of 20 back-to-back launches (CUDA events around each
batch, after warm-up, programmatic dependent launch on as in the runtime's graphs), rotating among
enough weight copies that the 50 MB L2 cannot hold them. Random weights (no zeros). Then the sum
over one decode step's FP8 linears (the shapes and how often a step runs each, read from the
model's h100-fp8 schedule; the 31B: 50 sliding layers qkv, o, gate||up, down, 10 full layers qk, o,
gate||up, down) per kernel and M, and its ratio to the best M = 1 step.

    python benchmarks/h100_gemv_mma.py [--model gemma-4-31B] [--rows 1,2,4,8,16,32] [--sweep]
                                       [--cubin LABEL=PATH ...] [--json OUT]

--sweep also times every (warps, split) entry of each row kind (* marks the default); --cubin
times another build of gemv_mma_fp8.cu's bf16-row entries the same way (an A/B of variants).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_fp8w, gemm_tc, gemv_fp8
from rvcompile.targets.h100 import gemv_mma_fp8 as gm
from rvcompile.targets.h100.nvcc import compile_cubin

ROWS = (1, 2, 4, 8, 16, 32)
BATCHES, PER_BATCH = 5, 20
SOURCE_BYTES = 256 << 20


def model_shapes(preset: str) -> dict[str, tuple[int, int, int]]:
    """{"NxK": (N, K, uses)}: the FP8 linears of one decode step of `preset`, as its h100-fp8
    schedule runs them (lowered shape-only, one slot), with how often a step runs each."""
    from rvcompile.build import BuildOptions, lower_model
    from rvcompile.model.presets import get_preset
    from rvcompile.sources.model_source import ModelSource
    from rvcompile.targets.h100.lower import lower_to_h100

    source = ModelSource(get_preset(preset), (), "", {}, None, preset)  # no tensors are read
    opts = BuildOptions("h100-fp8", max_context=256, prefill_buckets=(16,), max_seqs=1)
    ir = lower_model(source, opts, log=lambda s: None)
    step = lower_to_h100(ir, max_seqs=1, prefill_buckets=(16,)).schedule.entries["decode_1"]
    shapes: dict[str, tuple[int, int, int]] = {}
    for x in step.launches:
        # decode_1 runs its one-row linears on gemv_fp8 (7c61c05), wider steps on gemv_mma_fp8
        if x.kernel.startswith(("gemv_mma_fp8", "gemv_fp8")):
            args = {a.name: a.value for a in x.args}
            n, k = int(args["N"]), int(args["K"])
            uses = shapes.get(f"{n}x{k}", (n, k, 0))[2]
            shapes[f"{n}x{k}"] = (n, k, uses + 1)
    return shapes


class Kernels:
    """Functions by (label, entry), loaded once, their shared-memory limit raised."""

    def __init__(self, ctx: CudaContext, cubins: dict[str, bytes]):
        self.ctx, self.cubins, self.fns = ctx, cubins, {}

    def get(self, label: str, entry: str, smem: int):
        key = (label, entry)
        if key not in self.fns:
            self.fns[key] = self.ctx.load_function(self.cubins[label], entry)
            self.ctx.set_max_dynamic_smem(self.fns[key], 227 * 1024)
        return self.fns[key]


def median_seconds(ctx: CudaContext, fn, launch, args: list) -> float:
    """Per-launch time: median over batches of back-to-back launches."""
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


def candidates(m: int, n: int, k: int, sm_count: int, sweep: bool, builds: list[str]):
    """(kernel label, launch, is the default) to time for one shape and M: each build of
    gemv_mma_fp8 and its f16-row entries (the default launch, and with sweep every other entry
    that leaves each CTA a whole x window), gemv_fp8 where M fits, gemm_fp8w."""
    out = []
    for label in (*builds, "f16"):
        kind = "f16" if label == "f16" else "bf16"
        default = gm.launch_geometry(m, n, k, sm_count, kind=kind)
        out.append((label, default, True))
        if sweep:
            out += [(label, launch, False)
                    for w in gm.WARPS for s in gm.SPLITS
                    if (launch := gm.launch_geometry(m, n, k, sm_count, warps=w, split=s,
                                                     kind=kind))
                    != default and (s == 1 or -(-k // gm.BLOCK_K) >= s * gm.WINDOW_BLOCKS)]
    if m <= gemv_fp8.MAX_ROWS:
        g = gemv_fp8.launch_geometry(m, n, k, sm_count)
        out.append(("gemv_fp8", gm.Launch(gemv_fp8.ENTRY, g.grid, g.block, g.smem), True))
    out.append(("gemm_fp8w", gemm_fp8w.launch_geometry(m, n, k, sm_count), True))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gemma-4-31B", help="a preset whose shapes to time")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="token rows M to time")
    p.add_argument("--sweep", action="store_true", help="time every gemv_mma_fp8 entry")
    p.add_argument("--cubin", action="append", default=[], metavar="LABEL=PATH",
                   help="also time this build of gemv_mma_fp8.cu (repeatable)")
    p.add_argument("--json", type=Path, help="write every timing here")
    a = p.parse_args()
    shapes = model_shapes(a.model)
    row_counts = [int(m) for m in a.rows.split(",")]
    ctx = CudaContext()
    variants = dict(c.split("=", 1) for c in a.cubin)
    cubins = {"gemv_mma": compile_cubin(gm.SOURCE), "gemv_fp8": compile_cubin(gemv_fp8.SOURCE),
              "f16": compile_cubin(gm.SOURCE),
              "gemm_fp8w": compile_cubin(gemm_fp8w.SOURCE),
              **{label: Path(path).read_bytes() for label, path in variants.items()}}
    kernels = Kernels(ctx, cubins)
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, size=SOURCE_BYTES, dtype=np.uint8)
    src[(src & 0x7F) == 0x7F] ^= 1  # no e4m3 NaN codes
    source = ctx.upload(src)
    rows: list[dict] = []
    print(f"{'matrix':12} {'N x K':>12} {'M':>3} {'kernel':>10} {'entry':>26} {'grid':>14} "
          f"{'us':>8} {'GB/s':>6}")
    for name, (n, k, _) in shapes.items():
        copies = max(2, -(-200 * 2**20 // (n * k)))
        bufs = []
        for _ in range(copies):
            buf = ctx.alloc(n * k)
            for off in range(0, n * k, SOURCE_BYTES):
                ctx.copy_device(buf.ptr + off, source.ptr, min(SOURCE_BYTES, n * k - off))
            bufs.append(buf)
        ds = ctx.upload(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        for m in row_counts:
            x = rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
            dx, dqs = ctx.upload(x), ctx.upload(gemm_tc.quantize_rows_reference(x)[1])
            dy = ctx.alloc(m * n * 4)
            tail = [ctypes.c_uint64(dy.ptr), ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
            args = [[ctypes.c_uint64(b.ptr), ctypes.c_uint64(ds.ptr), ctypes.c_uint64(dx.ptr),
                     *tail] for b in bufs]
            args_f16 = [[ctypes.c_uint64(b.ptr), ctypes.c_uint64(ds.ptr),
                         ctypes.c_uint64(dx.ptr), ctypes.c_uint64(dqs.ptr), *tail] for b in bufs]
            by_label = {"f16": args_f16}
            for label, launch, default in candidates(m, n, k, ctx.sm_count, a.sweep,
                                                     ["gemv_mma", *variants]):
                fn = kernels.get(label, launch.entry, launch.smem)
                t = median_seconds(ctx, fn, launch, by_label.get(label, args))
                rows.append({"matrix": name, "n": n, "k": k, "m": m, "kernel": label,
                             "entry": launch.entry, "grid": list(launch.grid),
                             "default": default, "us": t * 1e6, "gbs": n * k / t / 1e9})
                mark = "*" if default and label not in ("gemv_fp8", "gemm_fp8w") else " "
                print(f"{name:12} {n:>5}x{k:<6} {m:>3} {label:>10} {launch.entry:>25}{mark}"
                      f"{str(launch.grid):>14} {t * 1e6:8.1f} {n * k / t / 1e9:6.0f}",
                      flush=True)
            for buf in (dx, dqs, dy):
                ctx.free(buf)
        for buf in (*bufs, ds):
            ctx.free(buf)
    summary = step_summary(rows, shapes, row_counts, a.model)
    if a.json:
        a.json.write_text(json.dumps({"device": ctx.device_name(), "model": a.model,
                                      "rows": rows, "step": summary}, indent=1))


def step_summary(rows: list[dict], shapes: dict[str, tuple[int, int, int]],
                 row_counts: list[int], model: str) -> dict[str, dict[str, float]]:
    """Milliseconds of one decode step's FP8 linears per kernel and M, default launches;
    'today' is gemv_fp8 up to its 4 rows and gemm_fp8w above; LABEL_best takes the fastest
    measured launch of each shape of a gemv_mma_fp8 build (the sweep's pick)."""
    uses = {name: u for name, (_, _, u) in shapes.items()}
    best: dict[tuple[str, str, int], float] = {}
    for r in rows:
        labels = [r["kernel"]] if r["default"] else []
        if r["kernel"] not in ("gemv_fp8", "gemm_fp8w"):
            labels.append(r["kernel"] + "_best")
        for label in labels:
            key = (label, r["matrix"], r["m"])
            best[key] = min(best.get(key, float("inf")), r["us"])
    for (label, matrix, m), us in list(best.items()):
        if label == ("gemv_fp8" if m <= gemv_fp8.MAX_ROWS else "gemm_fp8w"):
            best["today", matrix, m] = us
    step: dict[str, dict[int, float]] = {}
    for label in dict.fromkeys(label for label, _, _ in best):
        for m in row_counts:
            if all((label, matrix, m) in best for matrix in uses):
                step.setdefault(label, {})[m] = sum(
                    uses[matrix] * best[label, matrix, m] for matrix in uses) / 1e3
    base = min((per_m[1] for per_m in step.values() if 1 in per_m), default=1.0)
    print(f"\none {model} decode step's FP8 linears, ms (and the ratio to the fastest M = 1 "
          f"step, {base:.2f} ms)")
    print(f"{'kernel':>14} " + " ".join(f"{'M=' + str(m):>14}" for m in row_counts))
    for label, per_m in step.items():
        print(f"{label:>14} " + " ".join(
            f"{per_m[m]:7.2f} {per_m[m] / base:5.2f}x" if m in per_m else f"{'-':>14}"
            for m in row_counts))
    return {label: {str(m): ms for m, ms in per_m.items()} for label, per_m in step.items()}


if __name__ == "__main__":
    main()
