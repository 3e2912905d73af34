"""The speculative ratio rule on the H100 (targets/h100/ratio.py, kernels/sample.cu's
sample_pick_dist and spec_ratio).

CPU, the references:
- pick_record's distribution (p(x) = W(x) / S on its kept set) is the sampler's filtered
  softmax (test_speculative_ratio.ref_filtered: temperature, top_k, top_p), and a greedy row's
  record marks its argmax;
- ratio_rule on those records gives, token for token, the textbook rule run in numpy with
  float64 p and q (test_speculative_ratio.ref_ratio_rule, the XLA targets' check) and the same
  uniforms;
- its tokens are distributed as the target's: the first two tokens of a sequence whose rows
  depend on the drafts before them (k = 2 drafts drawn from the drafter's records the way the
  drafter's sampler draws, with the sampler's uniform), chi-square against the exact joint
  p0(x1) p1(x2 | x1), as test_speculative_ratio does for XLA's rule; on the same drafts it keeps
  more than exact match;
- the kernels' constants are the module's; the source compiles with both entries.
GPU (marked gpu): sample_pick_dist's records over fresh random rows (V 1024 and 262144, top_k,
top_p, histogram paths) are the reference's (keys equal, masses within expf's rounding), and
spec_ratio's tokens over lanes of three drafts drawn by the kernels from noisy copies of the
target rows are the reference rule's on the kernels' own rows and records (all lanes but at
most one of the 32 per case: expf against np.exp may move a decision at a boundary); every
buffer starts NaN-poisoned.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from h100_helpers import h100_context
from test_h100_sample import lm_like_logits
from test_speculative_ratio import chi_square_fit, ref_filtered, ref_ratio_rule

from rvcompile.artifacts.kernel_schedule import RATIO_DIST_WORDS, RATIO_LANE_WORDS
from rvcompile.ir import ops
from rvcompile.targets.h100 import ratio, sample

SOURCE = Path(ratio.__file__).parent / "kernels" / ratio.SOURCE


def test_constants_match_the_source() -> None:
    text = SOURCE.read_text()
    assert re.search(r"ACCEPT = (\d+), RESIDUAL = (\d+);", text).groups() == (
        str(ratio.ACCEPT), str(ratio.RESIDUAL))
    assert f"RESIDUAL_ONE = {ratio.RESIDUAL_ONE:.1f};" in text
    assert ratio.DIST_WORDS * 2 == RATIO_DIST_WORDS and ratio.LANE_WORDS == RATIO_LANE_WORDS
    assert "dist[3 * row + 2]" in text and "lanes + 4 * blockIdx.x" in text


MODES = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 8, 0.9), (2.0, 63, 0.95)]


def test_pick_record_is_the_sampling_distribution() -> None:
    rng = np.random.default_rng(0)
    v = 64
    for t, k, p in MODES * 8:
        y = rng.normal(0, 2, v).astype(np.float32)
        rec = ratio.pick_record(y, t, k, p)
        got = ratio.probs(y, t, rec)
        np.testing.assert_allclose(got, ref_filtered(y, t, k, p), rtol=0, atol=1e-6)
        assert abs(got.sum() - 1) < 1e-9
    y = np.array([1, 3, 3, -2] * 32, np.float32)
    assert list(ratio.pick_record(y, 0.0, 0, 1.0)[1:]) == [0, 0]  # greedy: no mass
    assert ratio.pick_record(y, 0.0, 0, 1.0)[0] == ratio.composite(np.float32(3), 1)
    assert ratio.pick_record(y, 1.0, 0, 1.0)[0] == 0  # everything kept


def test_composite_orders_like_the_sampler() -> None:
    y = np.array([0.5, -0.0, 0.0, 2.0, 0.5, -np.inf], np.float32)
    keys = ratio.composite(y, np.arange(6))
    assert list(np.argsort(-keys.astype(np.float64), kind="stable")) == [3, 0, 4, 1, 2, 5]
    assert keys[1] > keys[2]  # -0 as +0: the lower index first


def test_ratio_rule_is_the_textbook_rule() -> None:
    """Random rows, drafts (half of them the rows' argmax, often accepted) and a drafter's rows
    (the target's plus noise), temperatures and cuts mixed, one to three drafts per lane."""
    rng = np.random.default_rng(1)
    b, r, v = 150, 4, 32
    logits = rng.normal(0, 2, (b, r, v)).astype(np.float32)
    g = (logits[:, :-1] + rng.normal(0, 1, (b, r - 1, v))).astype(np.float32)
    tokens = rng.integers(0, v, (b, r)).astype(np.int32)
    tokens[::2, 1:] = np.argmax(logits[::2, :-1], -1)
    n_new = rng.integers(2, r + 1, b).astype(np.int32)
    seed = rng.integers(0, 2**31, b).astype(np.int32)
    step = rng.integers(0, 1000, b).astype(np.int32)
    plain = rng.integers(0, v, (b, r)).astype(np.int32)
    modes = [MODES[i] for i in rng.integers(0, len(MODES), b)]
    p = np.array([[ref_filtered(logits[j, i], *modes[j]) for i in range(r)] for j in range(b)])
    q = np.array([[ref_filtered(g[j, i], *modes[j]) for i in range(r - 1)] for j in range(b)])
    want = ref_ratio_rule(p, plain, tokens, n_new, q, seed, step)
    kept = 0
    for j in range(b):
        n, (t, k, pp) = int(n_new[j]), modes[j]
        y, qg = logits[j, :n], g[j, :n - 1]
        got = ratio.ratio_rule(y, np.stack([ratio.pick_record(x, t, k, pp) for x in y]), qg,
                               np.stack([ratio.pick_record(x, t, k, pp) for x in qg]),
                               tokens[j, :n], int(plain[j, n - 1]), t,
                               np.full(n, seed[j]), step[j] + np.arange(n))
        np.testing.assert_array_equal(got, want[j, :n], err_msg=f"lane {j}")
        kept += int(np.cumprod(got[:n - 1] == tokens[j, 1:n]).sum())
    assert 0 < kept < int((n_new - 1).sum())  # some accepted, some rejected


V, N, T = 6, 8000, 1.0


@pytest.fixture(scope="module")
def chain():
    """A synthetic target and drafter over V tokens whose rows depend on the tokens before them
    (row 1 on d1, row 2 on d1 d2), the drafter's logits the target's plus noise, k = 2 drafts
    per lane drawn from the drafter's records as its sampler draws (the sampler's uniform at the
    lane's seed and step + i), N lanes through ratio_rule; the plain samples beside them."""
    rng = np.random.default_rng(2)
    l0 = rng.normal(0, 1.5, V).astype(np.float32)
    l1 = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    l2 = rng.normal(0, 1.5, (V, V, V)).astype(np.float32)
    g0 = (l0 + rng.normal(0, 0.6, V)).astype(np.float32)
    g1 = (l1 + rng.normal(0, 0.6, (V, V))).astype(np.float32)
    record = {}

    def rec(row: np.ndarray) -> np.ndarray:
        key = row.tobytes()
        if key not in record:
            record[key] = ratio.pick_record(row, T, 0, 1.0)
        return record[key]

    def draw(row: np.ndarray, seed: int, step: int) -> int:
        return ops.sample_sorted(row, T, 0, 1.0, ops.sampling_uniform(seed, step))

    out, tokens, plain = np.zeros((N, 3), np.int32), np.zeros((N, 3), np.int32), []
    for s in range(N):
        d1 = draw(g0, s, 5)
        d2 = draw(g1[d1], s, 6)
        y = np.stack([l0, l1[d1], l2[d1, d2]])
        q = np.stack([g0, g1[d1]])
        tokens[s] = (0, d1, d2)
        last = draw(y[2], s, 7)
        plain.append([draw(y[0], s, 5), draw(y[1], s, 6), last])
        out[s] = ratio.ratio_rule(y, np.stack([rec(x) for x in y]), q,
                                  np.stack([rec(x) for x in q]), tokens[s], last, T,
                                  np.full(3, s), 5 + np.arange(3))
    return l0, l1, tokens, np.array(plain), out


def accepted_per_round(drafts: np.ndarray, target: np.ndarray) -> np.ndarray:
    return np.cumprod(drafts == target[:, :drafts.shape[1]], axis=1).sum(axis=1)


def test_ratio_rule_keeps_the_target_distribution(chain):
    """x1 from this round; x2 from it when d1 was accepted, else from the next round (a plain
    sample of p1(. | x1), drawn here)."""
    l0, l1, tokens, _, out = chain
    m = accepted_per_round(tokens[:, 1:], out)
    rng = np.random.default_rng(3)
    p0 = ref_filtered(l0, T, 0, 1.0)
    p1 = np.stack([ref_filtered(l1[x], T, 0, 1.0) for x in range(V)])
    x1 = out[:, 0]
    next_round = np.minimum((np.cumsum(p1[x1], -1) < rng.random(N)[:, None]).sum(-1), V - 1)
    x2 = np.where(m >= 1, out[:, 1], next_round)
    pv = chi_square_fit(np.bincount(x1 * V + x2, minlength=V * V), (p0[:, None] * p1).ravel())
    print(f"\n[measured] h100 ratio rule, first two tokens over {V}x{V} cells, {N} lanes: "
          f"chi-square p = {pv:.3f}")
    assert pv > 1e-3


def test_ratio_rule_accepts_more_than_exact_match(chain):
    _, _, tokens, plain, out = chain
    ratio_kept = accepted_per_round(tokens[:, 1:], out).mean()
    exact = accepted_per_round(tokens[:, 1:], plain).mean()
    print(f"\n[measured] drafts accepted per round of 2: ratio rule {ratio_kept:.3f}, exact "
          f"match {exact:.3f}")
    assert ratio_kept > exact + 0.1


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_compiles(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(ratio.SOURCE, cache_dir=tmp_path)
    for entry in (ratio.PICK_DIST_ENTRY, ratio.RATIO_ENTRY, sample.PICK_ENTRY):
        assert entry.encode() + b"\x00" in cubin


# ---------------------------------------------------------------- GPU

LANES, DRAFTS = 4, 3
LANE_MODES = [(1.0, 0, 1.0), (0.7, 40, 0.95), (1.3, 0, 0.9), (1.0, 3000, 1.0)]
ROUNDS = 8  # fresh seeds per case


class DeviceRule:
    """sample_prepare, sample_filter and sample_pick_dist over [M, V] rows, then spec_ratio."""

    def __init__(self, ctx):
        from rvcompile.targets.h100.nvcc import compile_cubin

        cubin = compile_cubin(sample.SOURCE)
        self.ctx = ctx
        self.fn = {e: ctx.load_function(cubin, e) for e in (
            sample.PREPARE_ENTRY, sample.FILTER_ENTRY, ratio.PICK_DIST_ENTRY,
            ratio.RATIO_ENTRY)}
        ctx.set_max_dynamic_smem(self.fn[sample.FILTER_ENTRY], sample.FILTER_SMEM)
        ctx.set_max_dynamic_smem(self.fn[ratio.PICK_DIST_ENTRY], sample.PICK_SMEM)
        self.bufs: list = []

    def buf(self, host=None, nbytes: int = 0):
        b = self.ctx.upload(np.ascontiguousarray(host)) if host is not None \
            else self.ctx.alloc(nbytes)
        if host is None:
            self.ctx.memset(b, 0xFF)  # NaN-poisoned: nothing may read what was not written
        self.bufs.append(b)
        return b

    def sample(self, logits, temperature, top_k, top_p, seed, step):
        """(workspace, records, tokens) device buffers of the rows, sampled."""
        m, v = logits.shape
        plan = sample.plan(m, v, self.ctx.sm_count)
        ws, dist, out = (self.buf(nbytes=n) for n in (plan.workspace, ratio.dist_bytes(m),
                                                       4 * m))
        x = [self.buf(np.asarray(a, d)) for a, d in (
            (logits, np.float32), (temperature, np.float32), (top_k, np.int32),
            (top_p, np.float32), (seed, np.int32), (step, np.int32))]
        p = [ctypes.c_uint64(b.ptr) for b in x]
        c = ctypes.c_uint64
        mi, vi = ctypes.c_int(m), ctypes.c_int(v)
        self.ctx.launch(self.fn[sample.PREPARE_ENTRY], plan.prepare.grid, plan.prepare.block, 0,
                        [p[0], mi, vi, ctypes.c_float(0.0), c(ws.ptr)])
        self.ctx.launch(self.fn[sample.FILTER_ENTRY], plan.filter.grid, plan.filter.block,
                        plan.filter.smem, [mi, vi, ctypes.c_int(plan.chunk), p[1], p[2],
                                           c(ws.ptr)])
        self.ctx.launch(self.fn[ratio.PICK_DIST_ENTRY], plan.pick.grid, plan.pick.block,
                        plan.pick.smem, [mi, vi, *p[1:6], c(ws.ptr), c(out.ptr), c(dist.ptr)])
        return ws, dist, out, x

    def close(self) -> None:
        for b in self.bufs:
            self.ctx.free(b)


def _lane_inputs(rng, v: int):
    """Per draft row (step i of lane b at row i * LANES + b) and per target row (lane b's rows
    b * (DRAFTS + 1) + i): the drafter's rows are the target's plus noise."""
    m = LANES * (DRAFTS + 1)
    target = lm_like_logits(rng, m, v)
    q = np.zeros((DRAFTS * LANES, v), np.float32)
    for b in range(LANES):
        for i in range(DRAFTS):
            row = target[b * (DRAFTS + 1) + i]
            q[i * LANES + b] = row + rng.normal(0, 1.0, v).astype(np.float32)
    return target, q


@pytest.mark.gpu
@pytest.mark.parametrize("v", [1024, 262144])
def test_gpu_ratio_kernels(v: int) -> None:
    ctx = h100_context()
    rng = np.random.default_rng(zlib.crc32(f"ratio{v}".encode()))
    m = LANES * (DRAFTS + 1)
    t_lane = np.array([x[0] for x in LANE_MODES], np.float32)
    k_lane = np.array([x[1] for x in LANE_MODES], np.int32)
    p_lane = np.array([x[2] for x in LANE_MODES], np.float32)
    differ = checked = 0
    for rnd in range(ROUNDS):
        target, q = _lane_inputs(rng, v)
        seeds = rng.integers(0, 2**31, LANES).astype(np.int32)
        qb = np.arange(DRAFTS * LANES) % LANES  # a draft row's lane
        qi = np.arange(DRAFTS * LANES) // LANES  # and step
        dev = DeviceRule(ctx)
        try:
            q_ws, q_dist, q_out, _ = dev.sample(q, t_lane[qb], k_lane[qb], p_lane[qb],
                                                seeds[qb], 100 * rnd + 1 + qi)
            ctx.synchronize()
            drafts = ctx.download(q_out, np.int32, (DRAFTS, LANES))
            lb = np.repeat(np.arange(LANES), DRAFTS + 1)  # a target row's lane
            li = np.tile(np.arange(DRAFTS + 1), LANES)  # and row in it
            tokens = np.zeros(m, np.int32)
            for b in range(LANES):
                tokens[b * (DRAFTS + 1) + 1:(b + 1) * (DRAFTS + 1)] = drafts[:, b]
            steps = 100 * rnd + 1 + li
            ws, dist, out, x = dev.sample(target, t_lane[lb], k_lane[lb], p_lane[lb],
                                          seeds[lb], steps)
            ctx.synchronize()
            plain = ctx.download(out, np.int32, (m,))
            q_buf = dev.buf(q)
            tok_buf = dev.buf(tokens)
            lanes = np.array([[b * (DRAFTS + 1), DRAFTS, b, LANES] for b in range(LANES)],
                             np.int32)
            lanes_buf = dev.buf(lanes)
            c = ctypes.c_uint64
            g = ratio.ratio_geometry(LANES)
            args = [ctypes.c_int(m), ctypes.c_int(v), c(ws.ptr), c(dist.ptr), c(q_buf.ptr),
                    c(q_dist.ptr), c(tok_buf.ptr), c(x[1].ptr), c(x[4].ptr), c(x[5].ptr),
                    c(lanes_buf.ptr), c(out.ptr)]
            ctx.launch(dev.fn[ratio.RATIO_ENTRY], g.grid, g.block, g.smem, args)
            ctx.synchronize()
            got = ctx.download(out, np.int32, (m,))
            if rnd == 0:  # the rule rewrites what it rewrote: time it on the same inputs
                t0 = time.perf_counter()
                for _ in range(20):
                    ctx.launch(dev.fn[ratio.RATIO_ENTRY], g.grid, g.block, g.smem, args)
                ctx.synchronize()
                took = (time.perf_counter() - t0) / 20
                np.testing.assert_array_equal(ctx.download(out, np.int32, (m,)), got)
            y = ctx.download(ws, np.float32, (m * v,)).reshape(m, v)  # the workspace's y
            recs = ctx.download(dist, np.uint64, (m, ratio.DIST_WORDS))
            q_recs = ctx.download(q_dist, np.uint64, (DRAFTS * LANES, ratio.DIST_WORDS))
        finally:
            dev.close()
        np.testing.assert_array_equal(y, target)  # no softcap: the logits themselves
        for rows, have, tk in ((target, recs, lb), (q, q_recs, qb)) if rnd < 2 else ():
            for j in range(rows.shape[0]):  # (0.1 s a row at V = 262144: two rounds)
                want = ratio.pick_record(rows[j], float(t_lane[tk[j]]), int(k_lane[tk[j]]),
                                         float(p_lane[tk[j]]))
                assert have[j, 0] == want[0] and have[j, 2] == want[2], (rnd, j)
                assert abs(int(have[j, 1]) - int(want[1])) <= 1e-6 * int(want[1]), (rnd, j)
        for b in range(LANES):
            r = slice(b * (DRAFTS + 1), (b + 1) * (DRAFTS + 1))
            t = float(t_lane[b])
            want = ratio.ratio_rule(y[r], recs[r], q[b::LANES], q_recs[b::LANES], tokens[r],
                                    int(plain[r][-1]), t, np.full(DRAFTS + 1, seeds[b]),
                                    steps[r])
            n_acc = next((i for i, tok in enumerate(got[r]) if tok < 0), DRAFTS + 1) - 1
            assert list(got[r][:n_acc]) == list(drafts[:n_acc, b])
            assert 0 <= got[r][n_acc] < v and all(tok == -1 for tok in got[r][n_acc + 1:])
            checked += 1
            differ += int(not np.array_equal(got[r], want))
    print(f"\n[measured] spec_ratio V={v}: {checked - differ} of {checked} lanes equal the "
          f"reference's; {LANES} lanes of {DRAFTS} drafts: {took * 1e6:.0f} us a launch "
          "(host-timed, 20 back to back)")
    assert differ <= 1
