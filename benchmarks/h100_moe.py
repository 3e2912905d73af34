"""MoE expert kernels (kernels/moe.cu) on the GPU at the 26B-A4B decode shape: H 2816, 128
experts, top-8, expert width 704. Per M (token rows): moe_gate_up, moe_down and moe_route
alone and gate_up+down, median of 50 timed steps after warm-up, each with fresh random expert ids
(distinct per row) and alternating between two copies of the expert stacks, so the 50 MB L2
holds neither the previous launch's experts nor the stacks. GB/s counts the bytes of the
experts the rows chose (each distinct expert once, scales included): the HBM traffic the decode
step cannot avoid. Compare with shared/H100-NOTES.md (HBM read ceiling 2.99-3.10 TB/s).

Then the prefill path (rows grouped by expert) for chunks of --prefill rows.

    python benchmarks/h100_moe.py [--rows 1,2,4] [--prefill 64,256]
"""

from __future__ import annotations

import argparse
import ctypes
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from rvcompile.runtime.executors.cuda_driver import CudaContext
from rvcompile.targets.h100 import moe
from rvcompile.targets.h100.nvcc import compile_cubin

HIDDEN, EXPERTS, TOP_K, INTER = 2816, 128, 8, 704
COPIES = 2
TIMED, WARMUP = 50, 10


def random_fp8(rng, shape) -> np.ndarray:
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 1  # no NaN codes
    return b


def median_us(ctx: CudaContext, launches) -> float:
    """Median microseconds of one step of `launches` [((function, geometry), args per step)],
    after WARMUP untimed steps."""
    def step(s: int) -> None:
        for (f, g), args in launches:
            ctx.launch(f, g.grid, g.block, g.smem, args[s])

    for s in range(WARMUP):
        step(s)
    times = []
    for s in range(WARMUP, WARMUP + TIMED):
        a, b = ctx.event(), ctx.event()
        ctx.record(a)
        step(s)
        ctx.record(b)
        times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times)) * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,2,4", help="decode: token rows per launch (<= 4)")
    p.add_argument("--prefill", default="64,256", help="prefill: rows per chunk")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    chunks = [int(r) for r in a.prefill.split(",") if r]
    ctx = CudaContext()
    cubin = compile_cubin(moe.SOURCE)
    fn = {e: ctx.load_function(cubin, e) for e in (
        moe.GATE_UP_ENTRY, moe.DOWN_ENTRY, moe.ROUTE_ENTRY, moe.SORT_ENTRY,
        moe.GATE_UP_GROUPED_ENTRY, moe.DOWN_GROUPED_ENTRY, moe.SUM_PAIRS_ENTRY,
        moe.ROUTER_ROWS_ENTRY)}
    rng = np.random.default_rng(0)
    h, e, k, i = HIDDEN, EXPERTS, TOP_K, INTER
    gate_up = [ctx.upload(random_fp8(rng, (e, 2 * i, h))) for _ in range(COPIES)]
    down = [ctx.upload(random_fp8(rng, (e, h, i))) for _ in range(COPIES)]
    sg = ctx.upload(rng.uniform(1e-4, 1e-3, (e, 2 * i)).astype(np.float32))
    sd = ctx.upload(rng.uniform(1e-4, 1e-3, (e, h)).astype(np.float32))
    pes = ctx.upload(rng.uniform(0.5, 1.5, e).astype(np.float32))
    gu_bytes, down_bytes = moe.chosen_expert_bytes(1, i, h)  # one expert
    print(f"26B-A4B experts: {e} x ({gu_bytes / 1e6:.2f} MB gate||up + {down_bytes / 1e6:.2f} MB "
          f"down), top-{k}")
    print(f"{'M':>2} {'kernel':12} {'experts':>7} {'MB':>7} {'us':>8} {'GB/s':>7}")
    stacks = Stacks(gate_up, down, sg, sd, pes)
    for m in rows:
        bench_rows(ctx, fn, stacks, m, rng)
    if chunks:
        print(f"{'rows':>4} {'prefill':12} {'us':>8}")
    for m in chunks:
        bench_prefill(ctx, fn, stacks, m, rng)
    for buf in (*gate_up, *down, sg, sd, pes):
        ctx.free(buf)


@dataclass(frozen=True)
class Stacks:
    gate_up: list  # COPIES device copies of [E, 2I, H] e4m3
    down: list  # COPIES device copies of [E, H, I] e4m3
    gate_up_scale: object
    down_scale: object
    per_expert_scale: object


def bench_rows(ctx: CudaContext, fn: dict, w: Stacks, m: int, rng) -> None:
    h, e, k, i = HIDDEN, EXPERTS, TOP_K, INTER
    n = WARMUP + TIMED
    ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(m)])
                    for _ in range(n)]).astype(np.int32)  # [n, M, K]: fresh experts per launch
    distinct = float(np.mean([len(np.unique(x)) for x in ids]))
    d_ids = ctx.upload(ids)
    d_x = ctx.upload(rng.normal(size=(m, h)).astype(ml_dtypes.bfloat16))
    d_w = ctx.upload(rng.uniform(0.1, 1.0, (m, k)).astype(np.float32))
    d_logits = ctx.upload(rng.normal(0, 1.5, (m, e)).astype(np.float32))
    d_hid, d_y = ctx.alloc(m * k * i * 2), ctx.alloc(m * h * 4)
    d_ids_out, d_wts_out = ctx.alloc(m * k * 4), ctx.alloc(m * k * 4)
    dims = [ctypes.c_int(v) for v in (m, k, i, h)]
    g_up = moe.gate_up_geometry(m, k, i, h, ctx.sm_count)
    g_down = moe.down_geometry(m, k, i, h, ctx.sm_count)
    g_route = moe.route_geometry(m, e, k)
    for name, g in ((moe.GATE_UP_ENTRY, g_up), (moe.DOWN_ENTRY, g_down)):
        if g.smem > 48 * 1024:
            ctx.set_max_dynamic_smem(fn[name], g.smem)
    ptr = ctypes.c_uint64
    up_args, down_args = [], []
    for step in range(n):
        ids_step = ptr(d_ids.ptr + step * m * k * 4)
        up_args.append([ptr(w.gate_up[step % COPIES].ptr), ptr(w.gate_up_scale.ptr),
                        ptr(d_x.ptr), ids_step, ptr(d_hid.ptr), *dims])
        down_args.append([ptr(w.down[step % COPIES].ptr), ptr(w.down_scale.ptr),
                          ptr(d_hid.ptr), ids_step, ptr(d_w.ptr), ptr(d_y.ptr), *dims])
    route_args = [ptr(d_logits.ptr), ptr(w.per_expert_scale.ptr), ptr(d_ids_out.ptr),
                  ptr(d_wts_out.ptr), ctypes.c_int(e), ctypes.c_int(k)]
    up = (fn[moe.GATE_UP_ENTRY], g_up)
    down = (fn[moe.DOWN_ENTRY], g_down)
    route = (fn[moe.ROUTE_ENTRY], g_route)
    gu_bytes, down_bytes = moe.chosen_expert_bytes(1, i, h)
    cases = (("gate_up", [(up, up_args)], gu_bytes * distinct),
             ("down", [(down, down_args)], down_bytes * distinct),
             ("gate_up+down", [(up, up_args), (down, down_args)],
              (gu_bytes + down_bytes) * distinct),
             ("route", [(route, [route_args] * n)], 0.0))
    for label, launches, nbytes in cases:
        t = median_us(ctx, launches)
        rate = f"{nbytes / t / 1e3:7.0f}" if nbytes else f"{'-':>7}"
        print(f"{m:>2} {label:12} {distinct:7.1f} {nbytes / 1e6:7.1f} {t:8.1f} {rate}",
              flush=True)
    ctx.synchronize()
    for buf in (d_ids, d_x, d_w, d_logits, d_hid, d_y, d_ids_out, d_wts_out):
        ctx.free(buf)


def bench_prefill(ctx: CudaContext, fn: dict, w: Stacks, m: int, rng) -> None:
    """The prefill path for a chunk of m rows: moe_sort, the grouped gate_up and down, the
    ordered sum; GB/s of the distinct chosen experts, TFLOP/s of the expert products."""
    h, e, k, i = HIDDEN, EXPERTS, TOP_K, INTER
    n, pairs = WARMUP + TIMED, m * k
    ids = np.stack([np.stack([rng.choice(e, k, replace=False) for _ in range(m)])
                    for _ in range(n)]).astype(np.int32)
    distinct = float(np.mean([len(np.unique(x)) for x in ids]))
    d_ids = ctx.upload(ids)
    d_x = ctx.upload(rng.normal(size=(m, h)).astype(ml_dtypes.bfloat16))
    d_w = ctx.upload(rng.uniform(0.1, 1.0, pairs).astype(np.float32))
    d_order, d_offsets = ctx.alloc(pairs * 4), ctx.alloc((e + 1) * 4)
    d_hid, d_part, d_y = ctx.alloc(pairs * i * 2), ctx.alloc(pairs * h * 4), ctx.alloc(m * h * 4)
    ptr, c_int = ctypes.c_uint64, ctypes.c_int
    g_sort = moe.sort_geometry(pairs, e)
    g_up = moe.gate_up_grouped_geometry(e, i, h)
    g_down = moe.down_grouped_geometry(e, i, h)
    g_sum = moe.sum_pairs_geometry(m, h)
    sort_args, up_args, down_args = [], [], []
    for step in range(n):
        sort_args.append([ptr(d_ids.ptr + step * pairs * 4), ptr(d_order.ptr),
                          ptr(d_offsets.ptr), c_int(pairs), c_int(e)])
        up_args.append([ptr(w.gate_up[step % COPIES].ptr), ptr(w.gate_up_scale.ptr),
                        ptr(d_x.ptr), ptr(d_order.ptr), ptr(d_offsets.ptr), ptr(d_hid.ptr),
                        c_int(k), c_int(i), c_int(h)])
        down_args.append([ptr(w.down[step % COPIES].ptr), ptr(w.down_scale.ptr),
                          ptr(d_hid.ptr), ptr(d_order.ptr), ptr(d_offsets.ptr), ptr(d_w.ptr),
                          ptr(d_part.ptr), c_int(i), c_int(h)])
    sum_args = [ptr(d_part.ptr), ptr(d_y.ptr), c_int(k), c_int(h)]
    sort = ((fn[moe.SORT_ENTRY], g_sort), sort_args)
    pipeline = [sort, ((fn[moe.GATE_UP_GROUPED_ENTRY], g_up), up_args),
                ((fn[moe.DOWN_GROUPED_ENTRY], g_down), down_args),
                ((fn[moe.SUM_PAIRS_ENTRY], g_sum), [sum_args] * n)]
    gu_bytes, down_bytes = moe.chosen_expert_bytes(1, i, h)
    nbytes = (gu_bytes + down_bytes) * distinct
    flops = 2 * pairs * 3 * i * h
    d_z = ctx.upload(rng.normal(size=(m, h)).astype(ml_dtypes.bfloat16))
    d_wr = ctx.upload(rng.normal(size=(e, h)).astype(ml_dtypes.bfloat16))
    d_logits = ctx.alloc(m * e * 4)
    router = ((fn[moe.ROUTER_ROWS_ENTRY], moe.router_rows_geometry(m, e, h)),
              [[ptr(d_z.ptr), ptr(d_wr.ptr), ptr(d_logits.ptr), c_int(m), c_int(e), c_int(h)]]
              * n)
    t_router = median_us(ctx, [router])
    t_sort = median_us(ctx, [sort])
    t = median_us(ctx, pipeline)
    print(f"{m:>4} {'router_rows':12} {t_router:8.1f}")
    print(f"{m:>4} {'sort':12} {t_sort:8.1f}")
    print(f"{m:>4} {'all four':12} {t:8.1f}  {distinct:5.1f} experts {nbytes / t / 1e3:6.0f} GB/s "
          f"{flops / t / 1e6:6.1f} TFLOP/s", flush=True)
    ctx.synchronize()
    for buf in (d_ids, d_x, d_w, d_order, d_offsets, d_hid, d_part, d_y, d_z, d_wr, d_logits):
        ctx.free(buf)


if __name__ == "__main__":
    main()
