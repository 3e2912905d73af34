"""The speculative ratio rule on the H100 (issue 15; kernels/sample.cu, after the sampler): numpy
references, records and launch geometry.

The rule (runtime/executor_api.py, "Speculative decoding"; targets/xla/rejection.py is the XLA
targets'): a lane's token and drafts d1..dn are rows 0..n of a verify call; d(i+1) is accepted
with probability min(1, p_i(d) / q_i(d)), p_i the target's sampling distribution at row i and
q_i the drafter's when it drew d(i+1); at the first rejection (row m) the next token is drawn
from max(0, p_m - q_m) renormalised; all accepted: the sampler's own token after row n. The
lane's rows then hold the accepted drafts, the new token, then -1. Uniforms: streams ACCEPT and
RESIDUAL of ops.sampling_uniform at (seed, step) of the row (stream 0 is the sampler's), as the
XLA targets draw them.

Two kernels:
    sample_pick_dist(M, V, temperature, top_k, top_p, seed, step, workspace, out, dist)
sample_pick (sample.py), also writing each row's record `dist` [M, 3] uint64 {cut, S, s0}: the
kept tokens are those whose composite key (value descending, index ascending: `composite`) is
>= cut (0: every token), S their mass in the sampler's fixed point (`fixed_weights`: W(x) =
floor(2^42 exp(y / T - s0)) from float32 steps) and s0 = y_max / T (a float32's bits), so
p(x) = W(x) / S on the kept set (`pick_record`). A greedy row's record is {the argmax's key,
0, 0}. The draft entries keep their rows' records and logits in the schedule's ratio region
(kernel_schedule.RatioIo); decode and verify entries keep theirs beside the sampler's
workspace.
    spec_ratio(M, V, workspace, dist, q_logits, q_dist, tokens, temperature, seed, step,
               lanes, out)
grid (lanes): lane l's {row0, n, q_at, q_stride} = lanes[l]; its rows row0..row0 + n of the
sampler's workspace (y: the softcapped logits) with records dist, q_i the record and logits
row q_at + i * q_stride (the draft entry's step i of its lane; -0 read as +0); out[row0..]
rewritten as `ratio_rule` says. Lanes with n = 0, greedy rows and greedy records keep the
pick's tokens (exact match).

Arithmetic (the kernel's, step for step): p(x) = double(W(x)) * (1 / double(S)) on the kept
set, 0 elsewhere; accept d where double(u) * q(d) < p(d); the residual's weights r(x) =
floor(2^52 max(0, p(x) - q(x))) as uint64, summed exactly; no residual mass accepts d (p <= q
everywhere: p = q up to rounding); else the token is the first x whose running sum of r
exceeds floor(double(w) * double(R)). Every double step is rounded on its own in the kernel (no
FMA contraction), so the kernel and this reference differ only through expf against np.exp in
the float32 weights (an ulp or two), which moves a decision only within that much of a
boundary.
"""

from __future__ import annotations

import math

import numpy as np

from rvcompile.ir.ops import sampling_uniform
from rvcompile.targets.h100 import sample
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = sample.SOURCE
PICK_DIST_ENTRY = "sample_pick_dist"
RATIO_ENTRY = "spec_ratio"
ACCEPT, RESIDUAL = 1, 2  # sampling_uniform streams (as targets/xla/rejection.py's)
DIST_WORDS = 3  # uint64 per record: cut, S, s0
LANE_WORDS = 4  # int32 per lane of `lanes`: row0, n, q_at, q_stride
WEIGHT_ONE = np.float32(2.0**42)  # the sampler's fixed point
RESIDUAL_ONE = 2.0**52


def composite(y: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """uint64 keys that sort as the sampler does (value descending, then index ascending, as
    descending keys): the float's order-preserving bits above ~index."""
    b = (np.asarray(y, np.float32) + np.float32(0)).view(np.uint32)  # -0 as +0
    key = np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000))
    low = ~np.asarray(idx, np.int64).astype(np.uint32)
    return (key.astype(np.uint64) << np.uint64(32)) | low.astype(np.uint64)


def fixed_weights(y: np.ndarray, temperature: float, s0: np.float32) -> np.ndarray:
    """uint64 W = floor(2^42 exp(y / T - s0)), each step in float32 as the kernel's."""
    t = np.float32(temperature)
    w = np.exp((np.asarray(y, np.float32) / t).astype(np.float32) - np.float32(s0))
    return (w.astype(np.float32) * WEIGHT_ONE).astype(np.uint64)


def pick_record(y: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """uint64 [3]: sample_pick_dist's record of row y (softcapped logits [V])."""
    y = np.asarray(y, np.float32) + np.float32(0)
    v = y.shape[0]
    idx = np.arange(v)
    if temperature <= 0:
        i = int(np.argmax(y))
        return np.array([composite(y[i], i), 0, 0], np.uint64)
    s0 = np.float32(y.max()) / np.float32(temperature)
    w = fixed_weights(y, temperature, s0)
    order = np.lexsort((idx, -y))
    cum = np.cumsum(w[order], dtype=np.uint64)
    keff = top_k if 0 < top_k < v else v
    last = None
    z = int(cum[keff - 1])
    if keff < v:
        last = int(order[keff - 1])
    s = z
    if np.float32(top_p) < 1:
        want = math.ceil(float(np.float32(top_p)) * float(z))
        cut = 0 if want <= 0 else min(int(want), z)
        j = int(np.argmax(cum >= np.uint64(cut)))
        s, last = int(cum[j]), int(order[j])
    key = 0 if last is None else int(composite(y[last], last))
    return np.array([key, s, int(np.float32(s0).view(np.uint32))], np.uint64)


def probs(y: np.ndarray, temperature: float, record: np.ndarray) -> np.ndarray:
    """float64 [V]: p(x) of row y (softcapped logits) under its record, the kernel's steps."""
    y = np.asarray(y, np.float32)
    cut, mass, bits = (int(x) for x in record)
    s0 = np.uint32(bits).view(np.float32)
    keep = composite(y, np.arange(y.shape[0])) >= np.uint64(cut)
    inv = np.float64(1.0) / np.float64(mass)
    w = fixed_weights(y, temperature, s0).astype(np.float64) * inv
    return np.where(keep, w, 0.0)


def residual_weights(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """uint64 floor(2^52 max(0, p - q))."""
    r = p - q
    return np.where(r > 0, np.where(r > 0, r, 0.0) * RESIDUAL_ONE, 0.0).astype(np.uint64)


def ratio_rule(y: np.ndarray, records: np.ndarray, q: np.ndarray, q_records: np.ndarray,
               tokens: np.ndarray, plain: int, temperature: float, seed: np.ndarray,
               step: np.ndarray) -> np.ndarray:
    """int32 [n + 1]: one lane's tokens by the rule. y [n + 1, V]: the target's rows (softcapped)
    with records [n + 1, 3]; q [n, V] the drafter's logits with q_records [n, 3]; tokens
    [n + 1]: the lane's token and drafts; plain: the sampler's token after row n; seed and step
    per row."""
    n = len(tokens) - 1
    q = np.asarray(q, np.float32) + np.float32(0)
    v = y.shape[1]
    out = np.full(n + 1, -1, np.int32)
    for i in range(n):
        d = int(tokens[i + 1])
        p_i = probs(y[i], temperature, records[i])
        q_i = probs(q[i], temperature, q_records[i])
        pd, qd = (float(p_i[d]), float(q_i[d])) if 0 <= d < v else (0.0, 0.0)
        u = np.float64(sampling_uniform(seed[i], step[i], ACCEPT))
        if u * np.float64(qd) < np.float64(pd):
            out[i] = d
            continue
        r = residual_weights(p_i, q_i)
        cum = np.cumsum(r, dtype=np.uint64)
        total = int(cum[-1])
        if total == 0:  # no residual mass: p <= q everywhere, d accepted
            out[i] = d
            continue
        w = np.float64(sampling_uniform(seed[i], step[i], RESIDUAL))
        target = int(w * np.float64(total))
        out[i] = int(np.argmax(cum > np.uint64(target)))
        return out
    out[n] = plain
    return out


# ---------------------------------------------------------------- entries

def _pick_dist_call(c: Call) -> None:
    sample.pick_call(c)
    m = c["M"]
    y = sample.workspace_logits(c)
    t, k, p = (c.array(name, (m,)) for name in ("temperature", "top_k", "top_p"))
    dist = c.array("dist", (m * DIST_WORDS * 8,)).view(np.uint64).reshape(m, DIST_WORDS)
    for row in range(m):
        dist[row] = pick_record(y[row], float(t[row]), int(k[row]), float(p[row]))


def _ratio_call(c: Call) -> None:
    m, v, lanes_n = c["M"], c["V"], c.grid[0]
    lanes = c.array("lanes", (lanes_n, LANE_WORDS))
    work = [tuple(int(x) for x in lane) for lane in lanes]
    work = [(r0, n, qa, qs) for r0, n, qa, qs in work if n > 0 and r0 >= 0 and r0 + n < m]
    if not work:
        return
    y = c.array("workspace", (m * v * 4,)).view(np.float32).reshape(m, v)
    dist = c.array("dist", (m * DIST_WORDS * 8,)).view(np.uint64).reshape(m, DIST_WORDS)
    q_rows = max(qa + (n - 1) * qs for _, n, qa, qs in work) + 1
    q = c.array("q_logits", (q_rows, v))
    q_dist = c.array("q_dist", (q_rows * DIST_WORDS * 8,)).view(np.uint64).reshape(
        q_rows, DIST_WORDS)
    tokens, temperature = c.array("tokens", (m,)), c.array("temperature", (m,))
    seed, step, out = c.array("seed", (m,)), c.array("step", (m,)), c.array("out", (m,))
    for r0, n, qa, qs in work:
        rows = slice(r0, r0 + n + 1)
        qi = [qa + i * qs for i in range(n)]
        if temperature[r0] <= 0 or not (dist[r0:r0 + n, 1].all() and q_dist[qi, 1].all()):
            continue  # greedy: exact match
        out[rows] = ratio_rule(y[rows], dist[rows], q[qi], q_dist[qi], tokens[rows],
                               int(out[r0 + n]), float(temperature[r0]), seed[rows],
                               step[rows])


ENTRIES = (
    Entry(PICK_DIST_ENTRY, SOURCE, (i32("M"), i32("V"), ptr("temperature", "float32"),
                                    ptr("top_k", "int32"), ptr("top_p", "float32"),
                                    ptr("seed", "int32"), ptr("step", "int32"),
                                    ptr("workspace", "bytes", "inout"),
                                    ptr("out", "int32", "out"), ptr("dist", "bytes", "out")),
          _pick_dist_call),
    Entry(RATIO_ENTRY, SOURCE, (i32("M"), i32("V"), ptr("workspace", "bytes"),
                                ptr("dist", "bytes"), ptr("q_logits", "float32"),
                                ptr("q_dist", "bytes"), ptr("tokens", "int32"),
                                ptr("temperature", "float32"), ptr("seed", "int32"),
                                ptr("step", "int32"), ptr("lanes", "int32"),
                                ptr("out", "int32", "inout")), _ratio_call),
)


def dist_bytes(rows: int) -> int:
    """Bytes of `rows` records."""
    return rows * DIST_WORDS * 8


def ratio_geometry(lanes: int) -> Launch:
    """A CTA of sample.THREADS threads per lane."""
    return Launch((lanes, 1, 1), (sample.THREADS, 1, 1), 0)
