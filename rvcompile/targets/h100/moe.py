"""The mixture-of-experts kernels (kernels/moe.cu): numpy references and launch geometry.

One MoE layer's expert branch, the IR's router chain + MOE + branch sum, is five launches:
    moe_norms(r f32 [M, H], router_scale f32 [H], router_mul f32, w2 f32 [H],
              z bf16 [M, H], x2 bf16 [M, H], H, eps)
        z = bf16(rmsnorm(r) * router_scale * router_mul), x2 = bf16(rmsnorm(r) * w2)
    (the router GEMV: gemv_bf16 over z, logits f32 [M, E])
    moe_route(logits f32 [M, E], per_expert_scale f32 [E], ids i32 [M, K], wts f32 [M, K], E, K)
        softmax, top-K (ties to the lower id), renormalised, times per_expert_scale
    moe_gate_up(W e4m3 [E, 2I, H], sg f32 [E, 2I], x2 bf16 [M, H], ids, hid bf16 [M, K, I],
                M, K, I, H)
        hid[m, j] = bf16(gelu_tanh(gate) * up) of expert ids[m, j]
    moe_down(D e4m3 [E, H, I], sd f32 [E, H], hid, ids, wts, y f32 [M, H], M, K, I, H)
        y[m] = sum_j wts[m, j] * expert ids[m, j]'s down projection (deterministic)
    moe_branch_sum(f f32 [M, H], w1 f32 [H], y f32 [M, H], w2 f32 [H], out f32 [M, H], H, eps)
        out = rmsnorm(f) * w1 + rmsnorm(y) * w2
The expert kernels read the expert ids from device memory and only the chosen experts' weight
rows. They take M <= MAX_ROWS rows (x or hid staged in shared memory): decode. Prefill chunks of
more rows group the P = M * K (row, slot) pairs by expert instead, so each chosen expert is
streamed once per chunk (CUDA cores, PAIRS pairs per pass over the weight rows; from L2 after
the first pass):
    moe_sort(ids [P], order i32 [P], offsets i32 [E + 1], P, E)
        order: pair indices sorted by expert (stable); expert e owns order[offsets[e]:][:count]
    moe_gate_up_grouped(W, sg, x2 [M, H], order, offsets, hid bf16 [P, I], K, I, H)
    moe_down_grouped(D, sd, hid [P, I], order, offsets, wts [P], part f32 [P, H], I, H)
        part[p] = wts[p] * the down projection of pair p's expert
    moe_sum_pairs(part, y [M, H], K, H)
        y[m] = part[m * K] + part[m * K + 1] + ... in order (deterministic)
and its router linear is one launch (decode uses gemv_bf16):
    moe_router_rows(z bf16 [M, H], Wr bf16 [E, H], logits f32 [M, E], M, E, H)
Limits: H % 16 == 0, I % 16 == 0, H <= 8192 (the norms), E <= 256, 1 <= K <= min(E, 32).
The float32 plan (h100-f32: float32 weights, no scales) takes moe_norms_f32 (z, x2 float32),
the float32 router GEMV (gemv_f32, 4 rows a launch), moe_route, then for any M (decode and
prefill alike: nothing is staged) moe_gate_up_f32(W f32 [E, 2I, H], x2, ids, hid f32 [M, K, I],
M, K, I, H) and moe_down_f32(D f32 [E, H, I], hid, ids, wts, y, M, K, I, H), nothing rounded;
H % 4 == 0, I % 4 == 0.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import MAX_SMEM, Launch, e4m3_to_f32

SOURCE = "moe.cu"
NORMS_ENTRY = "moe_norms"
ROUTE_ENTRY = "moe_route"
GATE_UP_ENTRY = "moe_gate_up"
DOWN_ENTRY = "moe_down"
BRANCH_SUM_ENTRY = "moe_branch_sum"
SORT_ENTRY = "moe_sort"
GATE_UP_GROUPED_ENTRY = "moe_gate_up_grouped"
DOWN_GROUPED_ENTRY = "moe_down_grouped"
SUM_PAIRS_ENTRY = "moe_sum_pairs"
ROUTER_ROWS_ENTRY = "moe_router_rows"
NORMS_F32_ENTRY = "moe_norms_f32"
GATE_UP_F32_ENTRY = "moe_gate_up_f32"
DOWN_F32_ENTRY = "moe_down_f32"
NORM_THREADS = 512  # these must match the kernel
WARPS = 8
SORT_THREADS = 1024
PAIRS = 8
GROUP_I = 4 * WARPS
GROUP_N = 4 * WARPS
SUM_THREADS = 256
MAX_EXPERTS = 256
MAX_ROWS = 4
MAX_H = NORM_THREADS * 4 * 4
BLOCKS_PER_SM = 4

BF16 = ml_dtypes.bfloat16


def _fp8(w: np.ndarray) -> np.ndarray:
    return e4m3_to_f32(w)


def norms_reference(r: np.ndarray, router_scale: np.ndarray, router_mul: float, w2: np.ndarray,
                    eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(z, x2), both bf16 [M, H]: the IR's SCALE(MUL(RMSNORM(r), router_scale)) and
    RMSNORM(r, w2), rounded as the router GEMV and the experts read them."""
    z, x2 = norms_f32_reference(r, router_scale, router_mul, w2, eps)
    return z.astype(BF16), x2.astype(BF16)


def norms_f32_reference(r: np.ndarray, router_scale: np.ndarray, router_mul: float,
                        w2: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(z, x2) float32 [M, H] (moe_norms_f32), unrounded."""
    a = ops.RMSNormAttrs(eps)
    z = ops.ref_mul(None, ops.ref_rmsnorm(a, r), router_scale) * np.float32(router_mul)
    return z, ops.ref_rmsnorm(a, r, w2)


def gate_up_f32_reference(w: np.ndarray, x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """hid f32 [M, K, I] from W f32 [E, 2I, H], x f32 [M, H] (moe_gate_up_f32)."""
    m, k = ids.shape
    inter = w.shape[1] // 2
    out = np.zeros((m, k, inter), np.float32)
    for r in range(m):
        for j in range(k):
            gu = np.asarray(w[int(ids[r, j])], np.float32) @ np.asarray(x[r], np.float32)
            out[r, j] = ops.gelu_tanh(gu[:inter]) * gu[inter:]
    return out


def down_f32_reference(d: np.ndarray, hid: np.ndarray, ids: np.ndarray,
                       weights: np.ndarray) -> np.ndarray:
    """y f32 [M, H] from D f32 [E, H, I], hid f32 [M, K, I] (moe_down_f32)."""
    m, k = ids.shape
    y = np.zeros((m, d.shape[1]), np.float32)
    for r in range(m):
        for j in range(k):
            y[r] += weights[r, j] * (np.asarray(d[int(ids[r, j])], np.float32) @ hid[r, j])
    return y


def route_reference(logits: np.ndarray, per_expert_scale: np.ndarray,
                    k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [M, K], weights f32 [M, K]): ops.ref_moe's routing, pick order by
    descending probability."""
    logits = np.asarray(logits, np.float32)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, idx, -1)
    w = w / w.sum(-1, keepdims=True) * np.asarray(per_expert_scale, np.float32)[idx]
    return idx.astype(np.int32), w.astype(np.float32)


def gate_up_reference(w: np.ndarray, scale: np.ndarray, x: np.ndarray,
                      ids: np.ndarray) -> np.ndarray:
    """hid bf16 [M, K, I] from W e4m3 codes [E, 2I, H], scales [E, 2I], x bf16 [M, H]."""
    m, k = ids.shape
    inter = w.shape[1] // 2
    xf = np.asarray(x).astype(np.float32)
    out = np.zeros((m, k, inter), np.float32)
    for r in range(m):
        for j in range(k):
            e = int(ids[r, j])
            gu = (_fp8(w[e]) @ xf[r]) * np.asarray(scale[e], np.float32)
            out[r, j] = ops.gelu_tanh(gu[:inter]) * gu[inter:]
    return out.astype(BF16)


def down_reference(d: np.ndarray, scale: np.ndarray, hid: np.ndarray, ids: np.ndarray,
                   weights: np.ndarray) -> np.ndarray:
    """y f32 [M, H] from D e4m3 codes [E, H, I], scales [E, H], hid bf16 [M, K, I]."""
    m, k = ids.shape
    hf = np.asarray(hid).astype(np.float32)
    y = np.zeros((m, d.shape[1]), np.float32)
    for r in range(m):
        for j in range(k):
            e = int(ids[r, j])
            y[r] += weights[r, j] * ((_fp8(d[e]) @ hf[r, j]) * np.asarray(scale[e], np.float32))
    return y


def router_rows_reference(z: np.ndarray, w: np.ndarray) -> np.ndarray:
    """logits f32 [M, E] = z bf16 [M, H] @ Wr bf16 [E, H]^T (the router LINEAR; gemv_bf16's)."""
    return np.asarray(z).astype(np.float32) @ np.asarray(w).astype(np.float32).T


def sort_reference(ids: np.ndarray, experts: int) -> tuple[np.ndarray, np.ndarray]:
    """(order int32 [P], offsets int32 [E + 1]) of ids [M, K] flattened to pairs."""
    flat = np.asarray(ids).reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    counts = np.bincount(flat, minlength=experts)
    return order, np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


def gate_up_grouped_reference(w: np.ndarray, scale: np.ndarray, x: np.ndarray,
                              order: np.ndarray, offsets: np.ndarray, k: int) -> np.ndarray:
    """hid bf16 [P, I]: gate_up_reference of each pair, its expert read from the grouping."""
    inter = w.shape[1] // 2
    xf = np.asarray(x).astype(np.float32)
    out = np.zeros((len(order), inter), np.float32)
    for e in range(len(offsets) - 1):
        pairs = order[offsets[e]:offsets[e + 1]]
        if len(pairs):
            gu = (xf[pairs // k] @ _fp8(w[e]).T) * np.asarray(scale[e], np.float32)
            out[pairs] = ops.gelu_tanh(gu[:, :inter]) * gu[:, inter:]
    return out.astype(BF16)


def down_grouped_reference(d: np.ndarray, scale: np.ndarray, hid: np.ndarray,
                           order: np.ndarray, offsets: np.ndarray,
                           weights: np.ndarray) -> np.ndarray:
    """part f32 [P, H]: each pair's weighted down projection of its expert."""
    hf = np.asarray(hid).astype(np.float32)
    part = np.zeros((len(order), d.shape[1]), np.float32)
    for e in range(len(offsets) - 1):
        pairs = order[offsets[e]:offsets[e + 1]]
        if len(pairs):
            y = (hf[pairs] @ _fp8(d[e]).T) * np.asarray(scale[e], np.float32)
            part[pairs] = y * np.asarray(weights, np.float32).reshape(-1)[pairs, None]
    return part


def sum_pairs_reference(part: np.ndarray, k: int) -> np.ndarray:
    """y f32 [M, H]: the K parts of each row added in slot order."""
    p = np.asarray(part, np.float32).reshape(-1, k, part.shape[-1])
    y = np.zeros((p.shape[0], p.shape[2]), np.float32)
    for j in range(k):
        y += p[:, j]
    return y


def branch_sum_reference(f: np.ndarray, w1: np.ndarray, y: np.ndarray, w2: np.ndarray,
                         eps: float) -> np.ndarray:
    """The fused IR's RESIDUAL_RMSNORM(RMSNORM(f, w1), y, w2)."""
    a = ops.RMSNormAttrs(eps)
    return ops.ref_residual_rmsnorm(a, ops.ref_rmsnorm(a, f, w1), y, w2)


def norm_geometry(m: int, h: int) -> Launch:
    """moe_norms and moe_branch_sum: one CTA per row."""
    if m < 1 or h % 4 or h > MAX_H:
        raise ValueError(f"moe norms need M >= 1, H % 4 == 0 and H <= {MAX_H} (M={m}, H={h})")
    return Launch((m, 1, 1), (NORM_THREADS, 1, 1), 0)


def route_geometry(m: int, e: int, k: int) -> Launch:
    """One warp per row."""
    if m < 1 or not 1 <= e <= MAX_EXPERTS or not 1 <= k <= min(e, 32):
        raise ValueError(f"moe_route needs M >= 1, E <= {MAX_EXPERTS} and 1 <= K <= min(E, 32) "
                         f"(M={m}, E={e}, K={k})")
    return Launch((m, 1, 1), (32, 1, 1), 0)


def _check_expert_dims(m: int, k: int, inter: int, h: int, smem: int) -> None:
    if not 1 <= m <= MAX_ROWS or h % 16 or inter % 16 or k < 1 or smem > MAX_SMEM:
        raise ValueError(f"moe expert kernels need 1 <= M <= {MAX_ROWS}, H % 16 == 0, "
                         f"I % 16 == 0 and {smem} <= {MAX_SMEM} bytes staged "
                         f"(M={m}, K={k}, I={inter}, H={h})")


def _blocks(tasks: int, sm_count: int) -> int:
    return max(1, min(-(-tasks // WARPS), sm_count * BLOCKS_PER_SM))


def gate_up_geometry(m: int, k: int, inter: int, h: int, sm_count: int) -> Launch:
    """A warp per (row, slot, output i): M * K * I tasks; x staged per block."""
    smem = m * h * 2
    _check_expert_dims(m, k, inter, h, smem)
    return Launch((_blocks(m * k * inter, sm_count), 1, 1), (WARPS * 32, 1, 1), smem)


def down_geometry(m: int, k: int, inter: int, h: int, sm_count: int) -> Launch:
    """A warp per (row, output n): M * H tasks; hid staged per block."""
    smem = m * k * inter * 2
    _check_expert_dims(m, k, inter, h, smem)
    return Launch((_blocks(m * h, sm_count), 1, 1), (WARPS * 32, 1, 1), smem)


def expert_f32_geometry(m: int, k: int, inter: int, h: int, sm_count: int,
                        gate_up: bool) -> Launch:
    """moe_gate_up_f32 (a warp per (row, slot, i)) or moe_down_f32 (a warp per (row, n))."""
    if m < 1 or k < 1 or h % 4 or inter % 4:
        raise ValueError(f"moe f32 expert kernels need M, K >= 1, H % 4 == 0 and I % 4 == 0 "
                         f"(M={m}, K={k}, I={inter}, H={h})")
    tasks = m * k * inter if gate_up else m * h
    return Launch((_blocks(tasks, sm_count), 1, 1), (WARPS * 32, 1, 1), 0)


def sort_geometry(pairs: int, experts: int) -> Launch:
    """One CTA."""
    if pairs < 1 or not 1 <= experts <= MAX_EXPERTS:
        raise ValueError(f"moe_sort needs P >= 1 and E <= {MAX_EXPERTS} (P={pairs}, E={experts})")
    return Launch((1, 1, 1), (SORT_THREADS, 1, 1), 0)


def _check_grouped_dims(inter: int, h: int) -> None:
    if h % 16 or inter % 16:
        raise ValueError(f"moe grouped kernels need H % 16 == 0 and I % 16 == 0 (I={inter}, "
                         f"H={h})")


def gate_up_grouped_geometry(experts: int, inter: int, h: int) -> Launch:
    """A CTA per (GROUP_I outputs, expert); experts no pair chose exit at once."""
    _check_grouped_dims(inter, h)
    return Launch((-(-inter // GROUP_I), experts, 1), (WARPS * 32, 1, 1), PAIRS * h * 2)


def down_grouped_geometry(experts: int, inter: int, h: int) -> Launch:
    """A CTA per (GROUP_N outputs, expert)."""
    _check_grouped_dims(inter, h)
    return Launch((-(-h // GROUP_N), experts, 1), (WARPS * 32, 1, 1), PAIRS * inter * 2)


def router_rows_geometry(m: int, experts: int, h: int) -> Launch:
    """A CTA per PAIRS rows, their z staged."""
    if m < 1 or experts < 1 or h % 8:
        raise ValueError(f"moe_router_rows needs M >= 1, E >= 1 and H % 8 == 0 (M={m}, "
                         f"E={experts}, H={h})")
    return Launch((-(-m // PAIRS), 1, 1), (WARPS * 32, 1, 1), PAIRS * h * 2)


def sum_pairs_geometry(m: int, h: int) -> Launch:
    if m < 1 or h % 4:
        raise ValueError(f"moe_sum_pairs needs M >= 1 and H % 4 == 0 (M={m}, H={h})")
    return Launch((-(-(h // 4) // SUM_THREADS), m, 1), (SUM_THREADS, 1, 1), 0)


def chosen_expert_bytes(k: int, inter: int, h: int) -> tuple[int, int]:
    """(gate_up, down) FP8 weight bytes one row's K experts stream, scales included."""
    return k * (2 * inter * h + 2 * inter * 4), k * (h * inter + h * 4)


# ---------------------------------------------------------------- entries

def _norms_call(ref, c: Call) -> None:
    m, h = c.grid[0], c["H"]
    z, x2 = ref(c.array("r", (m, h)), c.array("router_scale", (h,)), c["router_mul"],
                c.array("w2", (h,)), c["eps"])
    c.array("z", (m, h))[:] = z
    c.array("x2", (m, h))[:] = x2


def _route_call(c: Call) -> None:
    m, e, k = c.grid[0], c["E"], c["K"]
    ids, wts = route_reference(c.array("logits", (m, e)), c.array("per_expert_scale", (e,)), k)
    c.array("ids", (m, k))[:] = ids
    c.array("wts", (m, k))[:] = wts


def _experts(ids: np.ndarray) -> int:
    """The experts up to the highest chosen id (the expert count is no argument)."""
    return int(np.max(ids)) + 1


def _gate_up_call(c: Call) -> None:
    m, k, inter, h = c["M"], c["K"], c["I"], c["H"]
    ids = c.array("ids", (m, k))
    e = _experts(ids)
    w, x = c.array("W", (e, 2 * inter, h)), c.array("x", (m, h))
    hid = c.array("hid", (m, k, inter))
    if "scale" in c:
        hid[:] = gate_up_reference(w, c.array("scale", (e, 2 * inter)), x, ids)
    else:
        hid[:] = gate_up_f32_reference(w, x, ids)


def _down_call(c: Call) -> None:
    m, k, inter, h = c["M"], c["K"], c["I"], c["H"]
    ids = c.array("ids", (m, k))
    e = _experts(ids)
    d, hid = c.array("D", (e, h, inter)), c.array("hid", (m, k, inter))
    wts, y = c.array("wts", (m, k)), c.array("y", (m, h))
    if "scale" in c:
        y[:] = down_reference(d, c.array("scale", (e, h)), hid, ids, wts)
    else:
        y[:] = down_f32_reference(d, hid, ids, wts)


def _branch_sum_call(c: Call) -> None:
    m, h = c.grid[0], c["H"]
    c.array("out", (m, h))[:] = branch_sum_reference(
        c.array("f", (m, h)), c.array("w1", (h,)), c.array("y", (m, h)), c.array("w2", (h,)),
        c["eps"])


def _sort_call(c: Call) -> None:
    pairs, e = c["P"], c["E"]
    order, offsets = sort_reference(c.array("ids", (pairs,)), e)
    c.array("order", (pairs,))[:] = order
    c.array("offsets", (e + 1,))[:] = offsets


def _grouping(c: Call) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets) as the grouped kernels read them: E from the grid, P from offsets."""
    offsets = c.array("offsets", (c.grid[1] + 1,))
    return c.array("order", (int(offsets[-1]),)), offsets


def _gate_up_grouped_call(c: Call) -> None:
    k, inter, h = c["K"], c["I"], c["H"]
    order, offsets = _grouping(c)
    e, pairs = len(offsets) - 1, len(order)
    c.array("hid", (pairs, inter))[:] = gate_up_grouped_reference(
        c.array("W", (e, 2 * inter, h)), c.array("scale", (e, 2 * inter)),
        c.array("x", (pairs // k, h)), order, offsets, k)


def _down_grouped_call(c: Call) -> None:
    inter, h = c["I"], c["H"]
    order, offsets = _grouping(c)
    e, pairs = len(offsets) - 1, len(order)
    c.array("part", (pairs, h))[:] = down_grouped_reference(
        c.array("D", (e, h, inter)), c.array("scale", (e, h)), c.array("hid", (pairs, inter)),
        order, offsets, c.array("wts", (pairs,)))


def _sum_pairs_call(c: Call) -> None:
    m, k, h = c.grid[1], c["K"], c["H"]
    c.array("y", (m, h))[:] = sum_pairs_reference(c.array("part", (m * k, h)), k)


def _router_rows_call(c: Call) -> None:
    m, e, h = c["M"], c["E"], c["H"]
    c.array("logits", (m, e))[:] = router_rows_reference(c.array("z", (m, h)),
                                                         c.array("Wr", (e, h)))


def _entries():
    dims = (i32("M"), i32("K"), i32("I"), i32("H"))
    for name, dtype, ref in ((NORMS_ENTRY, "bfloat16", norms_reference),
                             (NORMS_F32_ENTRY, "float32", norms_f32_reference)):
        yield Entry(name, SOURCE, (ptr("r", "float32"), ptr("router_scale", "float32"),
                                   f32("router_mul"), ptr("w2", "float32"),
                                   ptr("z", dtype, "out"), ptr("x2", dtype, "out"), i32("H"),
                                   f32("eps")), partial(_norms_call, ref))
    yield Entry(ROUTE_ENTRY, SOURCE, (ptr("logits", "float32"), ptr("per_expert_scale", "float32"),
                                      ptr("ids", "int32", "out"), ptr("wts", "float32", "out"),
                                      i32("E"), i32("K")), _route_call)
    yield Entry(GATE_UP_ENTRY, SOURCE, (ptr("W", "float8_e4m3fn"), ptr("scale", "float32"),
                                        ptr("x", "bfloat16"), ptr("ids", "int32"),
                                        ptr("hid", "bfloat16", "out"), *dims), _gate_up_call)
    yield Entry(DOWN_ENTRY, SOURCE, (ptr("D", "float8_e4m3fn"), ptr("scale", "float32"),
                                     ptr("hid", "bfloat16"), ptr("ids", "int32"),
                                     ptr("wts", "float32"), ptr("y", "float32", "out"), *dims),
                _down_call)
    yield Entry(BRANCH_SUM_ENTRY, SOURCE, (ptr("f", "float32"), ptr("w1", "float32"),
                                           ptr("y", "float32"), ptr("w2", "float32"),
                                           ptr("out", "float32", "out"), i32("H"), f32("eps")),
                _branch_sum_call)
    yield Entry(SORT_ENTRY, SOURCE, (ptr("ids", "int32"), ptr("order", "int32", "out"),
                                     ptr("offsets", "int32", "out"), i32("P"), i32("E")),
                _sort_call)
    grouping = (ptr("order", "int32"), ptr("offsets", "int32"))
    yield Entry(GATE_UP_GROUPED_ENTRY, SOURCE,
                (ptr("W", "float8_e4m3fn"), ptr("scale", "float32"), ptr("x", "bfloat16"),
                 *grouping, ptr("hid", "bfloat16", "out"), i32("K"), i32("I"), i32("H")),
                _gate_up_grouped_call)
    yield Entry(DOWN_GROUPED_ENTRY, SOURCE,
                (ptr("D", "float8_e4m3fn"), ptr("scale", "float32"), ptr("hid", "bfloat16"),
                 *grouping, ptr("wts", "float32"), ptr("part", "float32", "out"), i32("I"),
                 i32("H")), _down_grouped_call)
    yield Entry(SUM_PAIRS_ENTRY, SOURCE, (ptr("part", "float32"), ptr("y", "float32", "out"),
                                          i32("K"), i32("H")), _sum_pairs_call)
    yield Entry(ROUTER_ROWS_ENTRY, SOURCE, (ptr("z", "bfloat16"), ptr("Wr", "bfloat16"),
                                            ptr("logits", "float32", "out"), i32("M"), i32("E"),
                                            i32("H")), _router_rows_call)
    yield Entry(GATE_UP_F32_ENTRY, SOURCE, (ptr("W", "float32"), ptr("x", "float32"),
                                            ptr("ids", "int32"), ptr("hid", "float32", "out"),
                                            *dims), _gate_up_call)
    yield Entry(DOWN_F32_ENTRY, SOURCE, (ptr("D", "float32"), ptr("hid", "float32"),
                                         ptr("ids", "int32"), ptr("wts", "float32"),
                                         ptr("y", "float32", "out"), *dims), _down_call)


ENTRIES = tuple(_entries())
