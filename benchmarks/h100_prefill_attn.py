"""Prefill attention on the GPU at 31B shapes: attn_prefill (one launch per layer) against the
path prefill took before it (attn_decode's split kernel + combine with one row per token), for
a chunk of T tokens after `start` earlier tokens. Median of 20, CUDA events; TFLOP/s counts
4 * visible keys * D flops per query head (Q.K^T and P.V, as dense bf16).

    python benchmarks/h100_prefill_attn.py [--kv bfloat16|fp8] [--chunks 256:0,1024:0,...]
                                           [--old-cubin OLD.cubin] [--json OUT]

--kv fp8 uses e4m3 pools (an FP8-KV build's); the full layers' rope is partial (a quarter of
the dims rotate, as the 31B's). --old-cubin times a build of attn_prefill.cu from before the q
tile (78e7c4b and earlier: 2 row groups at head dim 512, q in registers, no q tile in shared
memory) on the same inputs, with that build's launch geometry, and says whether its output
equals this checkout's bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from test_h100_attn import make_prefill_case  # noqa: E402  (one case builder for test and bench)

from rvcompile.runtime.executors.cuda_driver import CudaContext  # noqa: E402
from rvcompile.targets.h100 import attn_decode as ad  # noqa: E402
from rvcompile.targets.h100 import attn_prefill as ap  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

# (layer, KV heads, group, head dim, window, K=V)
LAYERS = [("31B sliding", 16, 2, 256, 1024, False), ("31B full K=V", 4, 8, 512, 0, True)]
CHUNKS = "256:0,1024:0,1024:1024"  # T:start
KV = {"bfloat16": ml_dtypes.bfloat16, "fp8": ml_dtypes.float8_e4m3fn}


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


def timed(ctx: CudaContext, cubin: bytes, kernel: str, launch, args, out, shape):
    """(median us, the f32 output) of `kernel` of `cubin` launched as `launch` (grid, block,
    shared memory bytes) with `args`, writing `out`."""
    grid, block, smem = launch
    fn = ctx.load_function(cubin, kernel)
    if smem > 48 << 10:
        ctx.set_max_dynamic_smem(fn, smem)
    us = median_us(ctx, lambda: ctx.launch(fn, grid, block, smem, args))
    return us, ctx.download(out, np.float32, shape)


def old_geometry(rows: int, kv_heads: int, head_dim: int, group: int, keqv: bool):
    """The launch of attn_prefill.cu before the q tile: 2 row groups at head dim 512, else 4,
    and two stages of tiles in shared memory."""
    wr, wc = (2 if head_dim == 512 else 4), max(1, head_dim // 128)
    return ((-(-rows // (16 * wr // group)), kv_heads, 1), (32 * wr * wc, 1, 1),
            ap.smem_bytes(head_dim, keqv, q_rows=0))


def parse_chunks(text: str) -> list[tuple[int, int]]:
    try:
        chunks = [tuple(int(x) for x in c.split(":")) for c in text.split(",")]
    except ValueError:
        raise SystemExit(f"--chunks: want T:start,... (got {text!r})") from None
    if any(len(c) != 2 or c[0] < 1 or c[1] < 0 for c in chunks):
        raise SystemExit(f"--chunks: want T >= 1 and start >= 0 (got {text!r})")
    return chunks


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--kv", choices=sorted(KV), default="bfloat16")
    cli.add_argument("--chunks", default=CHUNKS, help=f"T:start,... (default {CHUNKS})")
    cli.add_argument("--old-cubin", type=Path, help="attn_prefill.cu built before the q tile")
    cli.add_argument("--json", type=Path)
    a = cli.parse_args()
    chunks = parse_chunks(a.chunks)
    kv_dtype = "float8_e4m3fn" if a.kv == "fp8" else "bfloat16"
    ctx = CudaContext()
    pre_cubin, dec_cubin = compile_cubin(ap.SOURCE), compile_cubin(ad.SOURCE)
    old_cubin = a.old_cubin.read_bytes() if a.old_cubin else None
    combine = ctx.load_function(dec_cubin, ad.COMBINE_ENTRY)
    print(f"{'layer':14} {'T':>5} {'start':>5} {'prefill us':>10} {'TFLOP/s':>7} "
          f"{'per-row us':>10} {'speedup':>7}" + ("   old us  old/new  same bits" if old_cubin
                                                   else ""))
    rows = []
    for name, kh, g, d, window, keqv in LAYERS:
        for t, start in chunks:
            rng = np.random.default_rng(0)
            q, _, _, kp, vp, table, ring, pos = make_prefill_case(
                rng, kh, g, d, start, t, window, 0, keqv, kv_dtype=KV[a.kv])
            kp = np.nan_to_num(kp.astype(np.float32)).astype(KV[a.kv])
            vp = np.nan_to_num(vp.astype(np.float32)).astype(KV[a.kv])
            nh = kh * g
            wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
            inv_freq = (1e6 ** (-np.arange(0, d, 2) / d)).astype(np.float32)
            if keqv:
                inv_freq[d // 8:] = 0  # partial rotary: a quarter of the dims rotate
            seq_len = (pos + 1).astype(np.int32)
            bufs = {k: ctx.upload(v) for k, v in dict(q=q, k=kp, v=vp, table=table, pos=pos,
                                                       seq_len=seq_len, wk=wk,
                                                       inv_freq=inv_freq).items()}
            p = {k: ctypes.c_uint64(v.ptr) for k, v in bufs.items()}
            out, out_bf16 = ctx.alloc(t * nh * d * 4), ctx.alloc(t * nh * d * 2)
            po, pob = ctypes.c_uint64(out.ptr), ctypes.c_uint64(out_bf16.ptr)
            i32 = ctypes.c_int

            kernel = (ap.entry_keqv if keqv else ap.entry)(d, g, kv_dtype)
            pools = [p["k"]] if keqv else [p["k"], p["v"]]
            args = [p["q"], *pools, p["table"], i32(ring), p["pos"], i32(window), i32(kh), i32(t)]
            args += ([p["wk"], p["inv_freq"]] if keqv else []) + [po, pob]

            geo = ap.geometry(t, kh, d, g, keqv)
            t_pre, res = timed(ctx, pre_cubin, kernel, (geo.grid, geo.block, geo.smem), args,
                               out, (t, nh, d))

            keys = min(start + t, window or start + t)
            splits = ad.num_splits(t, kh, keys, ctx.sm_count)
            acc, ml = ctx.alloc(t * nh * splits * d * 4), ctx.alloc(t * nh * splits * 8)
            dfn = ctx.load_function(dec_cubin, (ad.entry_keqv if keqv else ad.entry)(d, g,
                                                                                     kv_dtype))
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

            t_row = median_us(ctx, per_row)
            seen = sum(len(ad.visible_tokens(int(s), window)) for s in seq_len)
            tflops = 4 * seen * d * nh / t_pre / 1e6
            row = dict(layer=name, kv=a.kv, T=t, start=start, prefill_us=round(t_pre, 1),
                       tflops=round(tflops, 1), per_row_us=round(t_row, 1))
            line = (f"{name:14} {t:5d} {start:5d} {t_pre:10.1f} {tflops:7.1f} {t_row:10.1f} "
                    f"{t_row / t_pre:7.1f}")
            if old_cubin:
                t_old, res_old = timed(ctx, old_cubin, kernel, old_geometry(t, kh, d, g, keqv),
                                       args, out, (t, nh, d))
                same = bool(np.array_equal(res.view(np.uint32), res_old.view(np.uint32)))
                row.update(old_us=round(t_old, 1), same_bits=same)
                line += f" {t_old:8.1f} {t_old / t_pre:8.2f}  {same}"
            rows.append(row)
            print(line, flush=True)
            for x in (*bufs.values(), out, out_bf16, acc, ml):
                ctx.free(x)
    if a.json:
        a.json.write_text(json.dumps({"device": ctx.device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
