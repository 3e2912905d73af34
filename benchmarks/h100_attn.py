"""Paged decode attention on the GPU at 31B and E4B shapes: the 31B's sliding layers (head dim
256, group 2, window 1024) and full K=V layers (head dim 512, group 8), the E4B's sliding (256,
group 4, window 512) and full layers (512, group 4), bf16 or FP8 pools, over batches and
contexts; time of the split kernel + combine, or with one split the kernel alone writing the
output (as the lowering launches both; median of 50, CUDA events), and GB/s of the K/V
bytes the step must read (a K=V layer's one pool counted once). Every split kernel is timed:
attn_decode.cu's ("split": what bf16/e4m3 plans launch for layers without K=V), attn_prefill.cu's
tensor-core decode entries ("tc": what they launch for other K=V layers) and attn_decode.cu's K=V
tensor-core entries ("mma": what they launch for the full K=V layers at head dim 512; "-" for the
layers they do not take).

    python benchmarks/h100_attn.py [--batch 1,8,64,256] [--context 129,1200] [--kv fp8]
                                   [--layers "31B full K=V,E4B full"]
                                   [--cubin OTHER.cubin ...] [--tc-cubin OTHER.cubin ...]
                                   [--mma-cubin OTHER.cubin ...]
                                   [--json OUT]

--cubin / --tc-cubin / --mma-cubin time the same launches from other builds of attn_decode.cu
(its split entries) / attn_prefill.cu / attn_decode.cu (its K=V tensor-core entries): an A/B of
a change, the checkout's cubins and the others, in one run, on the same inputs.
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
from test_h100_attn import to_e4m3  # noqa: E402  (the tests' e4m3 rounding)

from rvcompile.model.config import RopeSpec  # noqa: E402
from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError  # noqa: E402
from rvcompile.targets.h100 import attn_decode as ad  # noqa: E402
from rvcompile.targets.h100 import attn_prefill as ap  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

# (name, KV heads, group, head dim, window, K=V)
LAYERS = [("31B sliding", 16, 2, 256, 1024, False), ("31B full K=V", 4, 8, 512, 0, True),
          ("E4B sliding", 2, 4, 256, 512, False), ("E4B full", 2, 4, 512, 0, False)]


def median_us(ctx: CudaContext, launch) -> float:
    for _ in range(10):
        launch()
    times = []
    for _ in range(50):
        a, b = ctx.event(), ctx.event()
        ctx.record(a)
        launch()
        ctx.record(b)
        times.append(ctx.elapsed_ms(a, b))
    return float(np.median(times)) * 1e3


def make_pools(batch: int, kh: int, g: int, d: int, context: int, window: int, fp8: bool):
    """q, K and V pools holding only the blocks the sequences' `context` positions use (their
    tables' other entries point at block 0, never read; a sliding ring, wrapped or not, gets
    its own blocks), filled by
    tiling 1024 random blocks (timing does not depend on the values; sizes to several GB would
    take minutes to draw). Returns (q, k, v, table, ring, seq_len)."""
    rng = np.random.default_rng(0)
    ring = window // ad.BLOCK + 1 if window else -(-context // ad.BLOCK)
    need = min(-(-context // ad.BLOCK), ring)
    pool = batch * need + 1
    table = np.zeros((batch, ring), np.int32)
    table[:, :need] = 1 + np.arange(batch * need, dtype=np.int32).reshape(batch, need)
    shape = (pool, ad.BLOCK, kh, d)
    seed = rng.normal(0, 1.0, (min(pool, 1024), *shape[1:])).astype(np.float32)
    seed = to_e4m3(seed) if fp8 else seed.astype(ml_dtypes.bfloat16)
    k = np.resize(seed, shape)
    v = np.resize(seed[::-1], shape)
    q = rng.normal(0, 0.15, (batch, kh * g, d)).astype(ml_dtypes.bfloat16)
    return q, k, v, table, ring, np.full(batch, context, np.int32)


def time_layer(ctx, kernel: str, cubin: bytes, combine_cubin: bytes, layer, batch: int,
               context: int, fp8: bool) -> dict | None:
    name, kh, g, d, window, keqv = layer
    q, k, v, table, ring, lens = make_pools(batch, kh, g, d, context, window, fp8)
    kv = "float8_e4m3fn" if fp8 else "bfloat16"
    keys = len(ad.visible_tokens(context, window))
    splits = ad.num_splits(batch, kh, min(ad_max_keys(window), 2048), ctx.sm_count)
    if kernel == "mma":
        inv_freq = RopeSpec(1e6, 0.25).inv_freq(d)
        if not (keqv and ad.keqv_mma_fits(d, g, kv, inv_freq)):
            return None
        fn = ctx.load_function(cubin, ad.entry_keqv_mma(d, g, kv))
        split = ad.split_geometry(batch, kh, splits)
    elif kernel == "tc":
        name_of = ap.decode_entry_keqv if keqv else ap.decode_entry
        fn = ctx.load_function(cubin, name_of(d, g, kv))
        split = ap.decode_geometry(batch, kh, splits, d, keqv)
        if split.smem > 48 << 10:
            ctx.set_max_dynamic_smem(fn, split.smem)
    else:
        fn = ctx.load_function(cubin, (ad.entry_keqv if keqv else ad.entry)(d, g, kv))
        split = ad.split_geometry(batch, kh, splits)
    combine = ctx.load_function(combine_cubin, ad.COMBINE_ENTRY)
    nh = kh * g
    extra = [np.random.default_rng(1).uniform(0.5, 1.5, d).astype(np.float32),
             np.asarray(RopeSpec(1e6, 0.25).inv_freq(d), np.float32)] if keqv else []
    pools = (k,) if keqv else (k, v)
    bufs = [ctx.upload(x) for x in (q, *pools, table, lens, *extra)]
    acc = ctx.alloc(batch * nh * splits * d * 4)
    ml = ctx.alloc(batch * nh * splits * 8)
    out = ctx.alloc(batch * nh * d * 4)
    p = [ctypes.c_uint64(x.ptr) for x in bufs]
    n = len(pools)
    table_args = [p[1 + n], ctypes.c_int(table.shape[1]), ctypes.c_int(ring), p[2 + n],
                  ctypes.c_int(window), ctypes.c_int(kh)]
    null = ctypes.c_uint64(0)
    # one split: the kernel writes out itself and no combine runs, as the lowering launches it
    outs = [null, null, ctypes.c_uint64(out.ptr), null] if splits == 1 else [
        ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), null, null]
    args = [p[0], *p[1:1 + n], *table_args, *p[3 + n:], *outs]
    comb = ad.combine_geometry(batch, nh, d, splits)
    cargs = [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), ctypes.c_int(splits),
             ctypes.c_int(d), ctypes.c_uint64(out.ptr), null]

    def step():
        ctx.launch(fn, split.grid, split.block, split.smem, args)
        if splits > 1:
            ctx.launch(combine, comb.grid, comb.block, comb.smem, cargs)

    us = median_us(ctx, step)
    kv_bytes = batch * keys * kh * d * (1 if fp8 else 2) * (1 if keqv else 2)
    for x in (*bufs, acc, ml, out):
        ctx.free(x)
    return {"layer": name, "batch": batch, "context": context, "kv": kv, "splits": splits,
            "us": us, "kv_mb": kv_bytes / 1e6, "gb_s": kv_bytes / us / 1e3}


def ad_max_keys(window: int) -> int:
    """The keys a launch is planned for (lower.py: the window, or the built context)."""
    return window or 2048


def positive_ints(text: str) -> list[int]:
    """A comma-separated list of positive integers (argparse type)."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return values


def layer_names(text: str) -> list[str]:
    """A comma-separated list of LAYERS' names (argparse type)."""
    names = [x.strip() for x in text.split(",")]
    known = [layer[0] for layer in LAYERS]
    unknown = [x for x in names if x not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown layer {unknown[0]!r} "
                                         f"(known: {', '.join(known)})")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=positive_ints, default="1,8,64,256")
    parser.add_argument("--context", type=positive_ints, default="129,1200")
    parser.add_argument("--kv", choices=("bf16", "fp8"), default="fp8")
    parser.add_argument("--cubin", action="append", default=[],
                        help="another build of attn_decode.cu to time beside it (repeatable)")
    parser.add_argument("--tc-cubin", action="append", default=[],
                        help="another build of attn_prefill.cu to time beside it (repeatable)")
    parser.add_argument("--mma-cubin", action="append", default=[],
                        help="another build of attn_decode.cu whose K=V tensor-core entries to "
                             "time beside it (repeatable)")
    parser.add_argument("--layers", type=layer_names, default=[layer[0] for layer in LAYERS],
                        help="the layers to time, comma-separated (default: all)")
    parser.add_argument("--json")
    a = parser.parse_args()
    others = {}
    flags = {"split": "--cubin", "tc": "--tc-cubin", "mma": "--mma-cubin"}
    for kind, paths in (("split", a.cubin), ("tc", a.tc_cubin), ("mma", a.mma_cubin)):
        for path in paths:
            try:
                others[Path(path).stem] = (kind, Path(path).read_bytes())
            except OSError as e:
                parser.error(f"{flags[kind]} {path}: {e.strerror or e}")
    try:
        ctx = CudaContext()
    except CudaError as e:  # no GPU here
        parser.exit(2, f"h100_attn.py: error: {e}\n")
    split_cubin = compile_cubin(ad.SOURCE)
    cubins = {"split": ("split", split_cubin), "tc": ("tc", compile_cubin(ap.SOURCE)),
              "mma": ("mma", split_cubin), **others}
    rows = []
    print(f"{'layer':13} {'B':>4} {'ctx':>5} {'splits':>6} "
          + " ".join(f"{k[:12] + ' us':>15} {'GB/s':>6}" for k in cubins), flush=True)
    for layer in (layer for layer in LAYERS if layer[0] in a.layers):
        for batch in a.batch:
            for context in a.context:
                got = {k: time_layer(ctx, kind, c, split_cubin, layer, batch, context,
                                     a.kv == "fp8")
                       for k, (kind, c) in cubins.items()}
                first = next(iter(got.values()))
                print(f"{layer[0]:13} {batch:4d} {context:5d} {first['splits']:6d} "
                      + " ".join(f"{'-':>15} {'-':>6}" if r is None else
                                 f"{r['us']:15.1f} {r['gb_s']:6.0f}" for r in got.values()),
                      flush=True)
                rows.append({"cubin": {k: r and r["us"] for k, r in got.items()}, **first})
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
