"""The sampler's extras on the GPU at Gemma 4's vocabulary (V = 262144): the sampled entries' tail
(prepare, logprob stats, penalize, mask, filter, pick, logprobs) against the plain one
(prepare, filter, pick), for M rows. Cases: neutral extras (what a free lane in a constrained
batch costs), log-probabilities (top 20), penalties (300 ids per row), a grammar's mask allowing
2% of the tokens, and all of them; greedy and temperature 1.0 (top_k 0, the slower path when a
mask leaves most tokens at -inf). Each case's launches are one CUDA graph, as in a decode
entry; each figure is the median of 50 CUDA-event-timed replays after 10 warm-up ones, a new
step each replay.

    python benchmarks/h100_sampler_extras.py [--rows 1,8,32]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from h100_sample import median_us  # noqa: E402  (benchmarks/h100_sample.py)
from test_h100_sample import lm_like_logits  # noqa: E402  (shared with the test)

from rvcompile.runtime.executors.cuda_driver import CudaContext  # noqa: E402
from rvcompile.targets.h100 import sample  # noqa: E402
from rvcompile.targets.h100.nvcc import compile_cubin  # noqa: E402

V = 262144
CASES = ("plain", "neutral", "logprobs", "penalties", "mask", "all")


class Tail:
    """Every sample.cu entry over one [M, V] logits buffer and one case's extras."""

    def __init__(self, ctx: CudaContext, logits: np.ndarray, temperature: float):
        cubin = compile_cubin(sample.SOURCE)
        self.ctx, (self.m, v) = ctx, logits.shape
        self.fn = {e: ctx.load_function(cubin, e) for e in (
            sample.PREPARE_ENTRY, sample.PENALIZE_ENTRY, sample.MASK_ENTRY, sample.FILTER_ENTRY,
            sample.PICK_ENTRY, sample.LOGPROB_STATS_ENTRY, sample.LOGPROBS_ENTRY)}
        self.plan, self.ext = sample.plan(self.m, v, ctx.sm_count), sample.extras_plan(self.m, v)
        ctx.set_max_dynamic_smem(self.fn[sample.FILTER_ENTRY], self.plan.filter.smem)
        ctx.set_max_dynamic_smem(self.fn[sample.PICK_ENTRY], self.plan.pick.smem)
        m, k = self.m, sample.TOP_LOGPROBS
        self.ws, self.out = ctx.alloc(self.plan.workspace), ctx.alloc(4 * m * (2 + 2 * k))
        self.scratch = ctx.alloc(self.ext.scratch)
        self.fixed = [ctx.upload(np.ascontiguousarray(a)) for a in (
            logits, np.full(m, temperature, np.float32), np.zeros(m, np.int32),
            np.ones(m, np.float32), np.arange(m, dtype=np.int32))]
        self.step = ctx.upload(np.zeros(m, np.int32))
        self.stream = ctx.stream()
        self.extras: list = []

    def set_case(self, case: str, rng) -> None:
        m, words = self.m, V // 32
        for b in self.extras:
            self.ctx.free(b)
        pen = case in ("penalties", "all")
        masked = case in ("mask", "all")
        parts, mask_at, pen_at, pen_n, used = [], [], [], [], 0
        for _ in range(m):
            if masked:  # 2% of the tokens allowed
                mask = np.packbits(rng.random(V) < 0.02, bitorder="little").view(np.int32)
                parts.append(mask)
                mask_at.append(used)
                used += words
            else:
                mask_at.append(-1)
            n = 300 if pen else 0
            ids = rng.permutation(V)[:n].astype(np.int32)
            parts.append(np.stack([ids, rng.integers(0, 4, n).astype(np.int32)], 1).ravel())
            pen_at.append(used)
            pen_n.append(n)
            used += 2 * n
        pool = np.concatenate(parts + [np.zeros(1, np.int32)]).astype(np.int32)
        n_top = sample.TOP_LOGPROBS if case in ("logprobs", "all") else -1
        self.extras = [self.ctx.upload(np.ascontiguousarray(a)) for a in (
            pool, np.array(mask_at, np.int32), np.array(pen_at, np.int32),
            np.array(pen_n, np.int32), np.full(m, 0.5, np.float32), np.full(m, 0.5, np.float32),
            np.full(m, 1.2, np.float32), np.full(m, n_top, np.int32))]
        self.case = case

    def launch(self) -> None:
        p = [ctypes.c_uint64(b.ptr) for b in self.fixed]
        x = [ctypes.c_uint64(b.ptr) for b in self.extras]
        ws, out, step = (ctypes.c_uint64(b.ptr) for b in (self.ws, self.out, self.step))
        m, v = ctypes.c_int(self.m), ctypes.c_int(V)
        plan, ext, fn = self.plan, self.ext, self.fn

        def go(f, grid, block, smem, a):
            self.ctx.launch(f, grid, block, smem, a, self.stream)

        go(fn[sample.PREPARE_ENTRY], *_g(plan.prepare), [p[0], m, v, ctypes.c_float(30.0), ws])
        scratch = ctypes.c_uint64(self.scratch.ptr)
        if self.case != "plain":
            go(fn[sample.LOGPROB_STATS_ENTRY], *_g(ext.stats),
               [p[0], m, v, ctypes.c_float(30.0), x[7], scratch])
            go(fn[sample.PENALIZE_ENTRY], *_g(ext.penalize),
               [m, v, x[0], x[2], x[3], x[4], x[5], x[6], ws])
            go(fn[sample.MASK_ENTRY], *_g(ext.mask), [m, v, x[0], x[1], x[3], ws])
        go(fn[sample.FILTER_ENTRY], *_g(plan.filter),
           [m, v, ctypes.c_int(plan.chunk), p[1], p[2], ws])
        go(fn[sample.PICK_ENTRY], *_g(plan.pick), [m, v, p[1], p[2], p[3], p[4], step, ws, out])
        if self.case != "plain":
            k = sample.TOP_LOGPROBS
            go(fn[sample.LOGPROBS_ENTRY], *_g(ext.logprobs),
               [p[0], m, v, ctypes.c_float(30.0), out, x[7], ctypes.c_int(k), scratch,
                ctypes.c_uint64(self.out.ptr + 4 * self.m),
                ctypes.c_uint64(self.out.ptr + 8 * self.m),
                ctypes.c_uint64(self.out.ptr + 8 * self.m + 4 * self.m * k)])

    def set_step(self, i: int) -> None:
        from rvcompile.runtime.executors.cuda_driver import check

        s = np.full(self.m, i, np.int32)
        check(self.ctx.cu.cuMemcpyHtoD(self.step.ptr, s.ctypes.data, s.nbytes), "cuMemcpyHtoD")


def _g(launch):
    return launch.grid, launch.block, launch.smem


def main() -> None:
    a = argparse.ArgumentParser()
    a.add_argument("--rows", default="1,8,32")
    args = a.parse_args()
    ctx = CudaContext()
    rng = np.random.default_rng(0)
    print(f"{'M':>3} {'T':>4} " + " ".join(f"{c:>10}" for c in CASES) + "   (us per call)")
    for m in (int(r) for r in args.rows.split(",")):
        logits = lm_like_logits(rng, m, V)
        for t in (0.0, 1.0):
            tail = Tail(ctx, logits, t)
            us = []
            for case in CASES:
                tail.set_case(case, rng)
                graph = ctx.capture(tail.stream, tail.launch)
                us.append(median_us(ctx, tail.set_step,
                                    lambda g=graph, s=tail.stream: ctx.graph_launch(g, s)))
            print(f"{m:>3} {t:>4} " + " ".join(f"{x:>10.1f}" for x in us), flush=True)


if __name__ == "__main__":
    main()
