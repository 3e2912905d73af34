"""Where an h100-fp8 artifact's entry points spend their time on the GPU: per entry, the CUDA
graph's replay time (decode) or the eager launch sequence's, and each kernel family's share, from
CUDA events around every launch of one eager pass (the events cost the programmatic overlap
between kernels, so the families sum to a bit more than the graph).

    python benchmarks/h100_step_profile.py ART [--entries decode_1,decode_8,decode_32,prefill_256]
                                           [--one-row-swap] [--json OUT]

The inputs are a real call's: each entry runs once through the executor first (decode lanes
after a 128-token prompt each, a full prefill chunk). --one-row-swap also times decode_1 with
its one-row FP8 linears on the other GEMV, each gemv_fp8 launch swapped for gemv_mma_fp8's and
each gemv_mma_fp8 launch for gemv_fp8's (the same arguments, the other kernel's default launch,
its cubin from the nvcc cache): an A/B of the one-row GEMV inside the step's graph, on the same
arena.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

from rvcompile import runtime
from rvcompile.runtime.executor_api import SeqChunk

FAMILIES = ("gemv_mma_fp8", "gemv_fp8", "gemv_bf16", "gemm_fp8_tc", "gemm_bf16_tc", "gemm_fp8w",
            "quant_fp8_rows",
            "attn_decode_combine", "attn_decode", "attn_prefill", "qkv_post", "gelu_mul",
            "residual_rmsnorm", "rmsnorm", "embed", "sample", "select_row", "softcap")
REPLAYS = 20


def family(kernel: str) -> str:
    return next((f for f in FAMILIES if kernel.startswith(f)), kernel)


def own_tables(ex, i: int, tokens: int) -> dict[str, list[int]]:
    """Sequence i's block tables: its own blocks for its first `tokens` positions (the rest of
    the table points at block 0, never read or written), so 256 sequences fit the pools."""
    need = -(-tokens // ex.block_size)
    return {k.name: [i * need + j if j < need else 0 for j in range(k.table_width)]
            for k in ex.kinds.values()}


def prepare(ex, entry: str, rng, vocab: int) -> None:
    """One real call of `entry`, which leaves its io in the arena."""
    rows = int(entry.split("_")[1])
    if entry.startswith("decode_"):
        lanes = []
        for i in range(rows):
            tables = own_tables(ex, i, 128 + 1)
            tok = ex.prefill(SeqChunk(rng.integers(4, vocab, 128).tolist(), 0, tables))
            lanes.append(SeqChunk([tok], 128, tables))
        ex.decode(lanes)
    else:
        ex.prefill(SeqChunk(rng.integers(4, vocab, rows).tolist(), 0, own_tables(ex, 0, rows),
                            rows=rows))


def timed(ctx, stream, run) -> float:
    """Milliseconds per call of run(), median of 5 batches of REPLAYS."""
    run()
    times = []
    for _ in range(5):
        a, b = ctx.event(), ctx.event()
        ctx.record(a, stream)
        for _ in range(REPLAYS):
            run()
        ctx.record(b, stream)
        ctx.synchronize()
        times.append(ctx.elapsed_ms(a, b) / REPLAYS)
    return float(np.median(times))


def breakdown(ctx, stream, prepared, kernels) -> dict[str, float]:
    """Milliseconds per kernel family over one eager pass, events around every launch."""
    events = [ctx.event() for _ in range(len(prepared) + 1)]
    ctx.record(events[0], stream)
    for i, (fn, config, packed) in enumerate(prepared):
        ctx.launch_configured(fn, config, packed)
        ctx.record(events[i + 1], stream)
    ctx.synchronize()
    out: dict[str, float] = {}
    for i, kernel in enumerate(kernels):
        out[family(kernel)] = out.get(family(kernel), 0.0) + ctx.elapsed_ms(events[i],
                                                                             events[i + 1])
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def swapped_one_row(dev, entry: str) -> list:
    """`entry`'s prepared launches with gemv_fp8 and gemv_mma_fp8 swapped (same arguments)."""
    from rvcompile.targets.h100 import gemv_fp8
    from rvcompile.targets.h100 import gemv_mma_fp8 as gm
    from rvcompile.targets.h100.launches import SM_COUNT
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = dev.ctx
    cubins = {gemv_fp8.SOURCE: compile_cubin(gemv_fp8.SOURCE), gm.SOURCE: compile_cubin(gm.SOURCE)}
    fns: dict[str, object] = {}

    def function(source: str, name: str):
        if name not in fns:
            fns[name] = ctx.load_function(cubins[source], name)
            ctx.set_max_dynamic_smem(fns[name], 227 * 1024)
        return fns[name]

    out = []
    for launch, prepared in zip(dev.schedule.entries[entry].launches, dev.entries[entry],
                                strict=True):
        args = {a.name: a.value for a in launch.args}
        if launch.kernel.startswith("gemv_mma_fp8"):
            g = gemv_fp8.launch_geometry(1, args["N"], args["K"], SM_COUNT)
            fn = function(gemv_fp8.SOURCE, gemv_fp8.ENTRY)
        elif launch.kernel == gemv_fp8.ENTRY:
            g = gm.launch_geometry(1, args["N"], args["K"], SM_COUNT)
            fn = function(gm.SOURCE, g.entry)
        else:
            out.append(prepared)
            continue
        out.append((fn, ctx.launch_config(g.grid, g.block, g.smem, dev.stream), prepared[2]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact")
    ap.add_argument("--entries", default="decode_1,decode_8,decode_32,prefill_256")
    ap.add_argument("--one-row-swap", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    m = runtime.load(args.artifact, verify=False)
    ex = m.executor
    dev, ctx = ex.device, ex.device.ctx
    vocab = m.manifest["model"]["config"]["vocab_size"]
    rng = np.random.default_rng(0)
    result = {}
    for entry in args.entries.split(","):
        prepare(ex, entry, rng, vocab)
        kernels = [x.kernel for x in dev.schedule.entries[entry].launches]
        ms = timed(ctx, dev.stream, lambda e=entry: dev.run(e))
        parts = breakdown(ctx, dev.stream, dev.entries[entry], kernels)
        result[entry] = {"ms": ms, "graph": entry in dev.graphs, "launches": len(kernels),
                         "families_ms": parts}
        print(f"{entry}: {ms:.2f} ms ({'graph' if entry in dev.graphs else 'eager'}, "
              f"{len(kernels)} launches); eager by family: "
              + ", ".join(f"{k} {v:.2f}" for k, v in parts.items() if v >= 0.05), flush=True)
    if args.one_row_swap:
        prepare(ex, "decode_1", rng, vocab)
        swapped = swapped_one_row(dev, "decode_1")

        def launch_all():
            for fn, config, packed in swapped:
                ctx.launch_configured(fn, config, packed)

        graph = ctx.capture(dev.stream, launch_all)
        a = timed(ctx, dev.stream, lambda: dev.run("decode_1"))
        b = timed(ctx, dev.stream, lambda: ctx.graph_launch(graph, dev.stream))
        result["decode_1_ab"] = {"as_built_ms": a, "swapped_ms": b}
        print(f"decode_1 graph: as built {a:.3f} ms, one-row linears on the other GEMV "
              f"{b:.3f} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
