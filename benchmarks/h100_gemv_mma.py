"""Small-batch FP8 decode GEMV (gemv_mma_fp8) on the GPU at the 31B's layer shapes for M = 1, 2,
4, 8, 16 and 32 token rows, against today's kernels for the same product: gemv_fp8 (M <= 4) and
gemm_fp8w. Time per call and GB/s of weight bytes (W read once per call): each figure is the
median over 5 batches of 20 back-to-back launches (CUDA events around each batch, after warm-up,
programmatic dependent launch on as in the runtime's graphs), rotating among enough weight copies
that the 50 MB L2 cannot hold them. Random weights (no zeros). Then the sum over one 31B decode
step's linears (50 sliding layers: qkv, o, gate||up, down; 10 full layers: qk, o, gate||up, down)
per kernel and M, and its ratio to the best M = 1 step.

    python benchmarks/h100_gemv_mma.py [--sweep] [--cubin LABEL=PATH ...] [--json OUT]

--sweep also times every (warps, split) entry of gemv_mma_fp8 (* marks the default); --cubin
times another build of gemv_mma_fp8.cu the same way (an A/B of kernel variants).
"""

from __future__ import annotations

import argparse
import ctypes
import json
from pathlib import Path

import ml_dtypes
import numpy as np

from rvcompile.model.presets import gemma_4_31b
from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import gemm_fp8w, gemv_fp8
from rvcompile.targets.h100 import gemv_mma_fp8 as gm
from rvcompile.targets.h100.nvcc import compile_cubin

SHAPES = {"qkv_sliding": (16384, 5376), "qk_full": (18432, 5376), "o_sliding": (5376, 8192),
          "o_full": (5376, 16384), "gate_up": (43008, 5376), "down": (5376, 21504)}
ROWS = (1, 2, 4, 8, 16, 32)
BATCHES, PER_BATCH = 5, 20
SOURCE_BYTES = 256 << 20


def step_layers() -> dict[str, int]:
    """How many times one 31B decode step uses each shape (from the preset's layer pattern)."""
    cfg = gemma_4_31b()
    full = sum(1 for spec in cfg.layers if not spec.window)
    sliding = len(cfg.layers) - full
    return {"qkv_sliding": sliding, "o_sliding": sliding, "qk_full": full, "o_full": full,
            "gate_up": len(cfg.layers), "down": len(cfg.layers)}


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
    gemv_mma_fp8 (its default launch, and with sweep every other entry that leaves each CTA a
    whole x window), gemv_fp8 where M fits, gemm_fp8w."""
    out = []
    for label in builds:
        default = gm.launch_geometry(m, n, k, sm_count)
        out.append((label, default, True))
        if sweep:
            out += [(label, launch, False)
                    for w in gm.WARPS for s in gm.SPLITS
                    if (launch := gm.launch_geometry(m, n, k, sm_count, warps=w, split=s))
                    != default and (s == 1 or -(-k // gm.BLOCK_K) >= s * gm.WINDOW_BLOCKS)]
    if m <= gemv_fp8.MAX_ROWS:
        g = gemv_fp8.launch_geometry(m, n, k, sm_count)
        out.append(("gemv_fp8", gm.Launch(gemv_fp8.ENTRY, g.grid, g.block, g.smem), True))
    out.append(("gemm_fp8w", gemm_fp8w.launch_geometry(m, n, k, sm_count), True))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sweep", action="store_true", help="time every gemv_mma_fp8 entry")
    p.add_argument("--cubin", action="append", default=[], metavar="LABEL=PATH",
                   help="also time this build of gemv_mma_fp8.cu (repeatable)")
    p.add_argument("--json", type=Path, help="write every timing here")
    a = p.parse_args()
    ctx = CudaContext()
    variants = dict(c.split("=", 1) for c in a.cubin)
    cubins = {"gemv_mma": compile_cubin(gm.SOURCE), "gemv_fp8": compile_cubin(gemv_fp8.SOURCE),
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
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-200 * 2**20 // (n * k)))
        bufs = []
        for _ in range(copies):
            buf = ctx.alloc(n * k)
            for off in range(0, n * k, SOURCE_BYTES):
                ctx.copy_device(buf.ptr + off, source.ptr, min(SOURCE_BYTES, n * k - off))
            bufs.append(buf)
        ds = ctx.upload(rng.uniform(1e-4, 1e-3, n).astype(np.float32))
        for m in ROWS:
            dx = ctx.upload(rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16))
            dy = ctx.alloc(m * n * 4)
            args = [[ctypes.c_uint64(b.ptr), ctypes.c_uint64(ds.ptr), ctypes.c_uint64(dx.ptr),
                     ctypes.c_uint64(dy.ptr), ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(k)]
                    for b in bufs]
            for label, launch, default in candidates(m, n, k, ctx.sm_count, a.sweep,
                                                     ["gemv_mma", *variants]):
                fn = kernels.get(label, launch.entry, launch.smem)
                t = median_seconds(ctx, fn, launch, args)
                rows.append({"matrix": name, "n": n, "k": k, "m": m, "kernel": label,
                             "entry": launch.entry, "grid": list(launch.grid),
                             "default": default, "us": t * 1e6, "gbs": n * k / t / 1e9})
                mark = "*" if default and label not in ("gemv_fp8", "gemm_fp8w") else " "
                print(f"{name:12} {n:>5}x{k:<6} {m:>3} {label:>10} {launch.entry:>25}{mark}"
                      f"{str(launch.grid):>14} {t * 1e6:8.1f} {n * k / t / 1e9:6.0f}",
                      flush=True)
            ctx.free(dx)
            ctx.free(dy)
        for buf in (*bufs, ds):
            ctx.free(buf)
    summary = step_summary(rows)
    if a.json:
        a.json.write_text(json.dumps({"device": ctx.device_name(), "rows": rows,
                                      "step": summary}, indent=1))


def step_summary(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Milliseconds of one 31B decode step's linears per kernel and M, default launches;
    'today' is gemv_fp8 up to its 4 rows and gemm_fp8w above; LABEL_best takes the fastest
    measured launch of each shape of a gemv_mma_fp8 build (the sweep's pick)."""
    uses = step_layers()
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
        for m in ROWS:
            if all((label, matrix, m) in best for matrix in SHAPES):
                step.setdefault(label, {})[m] = sum(
                    uses[matrix] * best[label, matrix, m] for matrix in SHAPES) / 1e3
    base = min(per_m[1] for per_m in step.values() if 1 in per_m)
    print(f"\none 31B decode step's linears, ms (and the ratio to the fastest M = 1 step, "
          f"{base:.2f} ms)")
    print(f"{'kernel':>14} " + " ".join(f"{'M=' + str(m):>14}" for m in ROWS))
    for label, per_m in step.items():
        print(f"{label:>14} " + " ".join(
            f"{per_m[m]:7.2f} {per_m[m] / base:5.2f}x" if m in per_m else f"{'-':>14}"
            for m in ROWS))
    return {label: {str(m): ms for m, ms in per_m.items()} for label, per_m in step.items()}


if __name__ == "__main__":
    main()
