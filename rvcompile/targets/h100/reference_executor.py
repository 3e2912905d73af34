"""The H100 schedule on the CPU: a numpy arena and, per kernel, its numpy reference applied to
the launch's arguments exactly as the CUDA kernel reads them. CI checks the H100 plan (lowering,
weight layout, memory plan, KV paging, io) against the oracle with it, no GPU needed.

    ex = reference_executor(artifact)       # an executor for runtime.Model
    m = Model(artifact, ex)

The `_f32` entries (the float32 plan, h100-f32) read and write float32 where the others hold bf16
(or e4m3) values: `_lin_dtype` and `_pool_dtype` pick the view by entry name.

Attention references write the finished output as split 0 (m = 0, l = 1) and mark the other
splits empty, so the combine reference (the kernel's merge, exactly) reproduces it.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from rvcompile.artifacts import Artifact
from rvcompile.artifacts.kernel_schedule import KernelSchedule, Launch
from rvcompile.runtime.executors.scheduled import ScheduledExecutor
from rvcompile.targets.h100 import (
    attn_decode,
    attn_prefill,
    gelu_mul,
    gemv_f32,
    head,
    moe,
    norms,
    ple,
    qkv_post,
    rows,
    sample,
)

BF16 = ml_dtypes.bfloat16
F32 = np.float32
I32 = np.int32


class ReferenceDevice:
    def __init__(self, schedule: KernelSchedule, weights: memoryview, constants: bytes):
        self.schedule = schedule
        self.mem = np.zeros(schedule.arena_bytes, np.uint8)
        self.mem[:schedule.weights_bytes] = np.frombuffer(weights, np.uint8)
        c = schedule.constants_offset
        self.mem[c:c + len(constants)] = np.frombuffer(constants, np.uint8)

    def write(self, offset: int, data: bytes) -> None:
        self.mem[offset:offset + len(data)] = np.frombuffer(data, np.uint8)

    def read(self, offset: int, nbytes: int) -> bytes:
        return self.mem[offset:offset + nbytes].tobytes()

    def run(self, entry: str) -> None:
        for launch in self.schedule.entries[entry].launches:
            kernel = _kernel_ref(launch.kernel)
            kernel(self, launch, *[a.value for a in launch.args])

    def view(self, offset: int, dtype, shape) -> np.ndarray:
        count = int(np.prod(shape))
        nbytes = count * np.dtype(dtype).itemsize
        return self.mem[offset:offset + nbytes].view(dtype).reshape(shape)


def reference_executor(art: Artifact) -> ScheduledExecutor:
    schedule = KernelSchedule.from_json(art.manifest["h100"]["schedule"])
    device = ReferenceDevice(schedule, art.buffer("weights"), bytes(art.buffer("constants")))
    return ScheduledExecutor(schedule, device)


# ---------------------------------------------------------------- kernel references

def _embed_bf16(dev, launch: Launch, table, ids, mult, h, hdim):
    m = launch.grid[1]
    idx = dev.view(ids, I32, (m,))
    rows_ = np.stack([dev.view(table + int(i) * hdim * 2, BF16, (hdim,)) for i in idx])
    dev.view(h, F32, (m, hdim))[:] = head.embed_rows(rows_, np.arange(m), mult)


def _embed_fp8(dev, launch: Launch, table, row_scale, ids, mult, h, hdim):
    m = launch.grid[1]
    idx = dev.view(ids, I32, (m,))
    rows_ = np.stack([dev.view(table + int(i) * hdim, np.uint8, (hdim,)) for i in idx])
    scales = np.array([dev.view(row_scale + 4 * int(i), F32, (1,))[0] for i in idx], F32)
    dev.view(h, F32, (m, hdim))[:] = head.embed_rows(rows_, np.arange(m), mult, scales)


def _embed_f32(dev, launch: Launch, table, ids, mult, h, hdim):
    m = launch.grid[1]
    idx = dev.view(ids, I32, (m,))
    rows_ = np.stack([dev.view(table + int(i) * hdim * 4, F32, (hdim,)) for i in idx])
    dev.view(h, F32, (m, hdim))[:] = head.embed_rows(rows_, np.arange(m), mult)


def _lin_dtype(kernel: str):
    """The dtype of the values linears read (normed rows, q, gated products): float32 in the
    `_f32` entries, else bf16."""
    return F32 if kernel.endswith("_f32") else BF16


def _rmsnorm(dev, launch: Launch, x, w, y, hdim, eps):
    m = launch.grid[0]
    f32 = launch.kernel == norms.RMSNORM_F32_ENTRY
    ref = norms.rmsnorm_f32 if f32 else norms.rmsnorm_bf16
    dev.view(y, _lin_dtype(launch.kernel), (m, hdim))[:] = ref(dev.view(x, F32, (m, hdim)),
                                                               dev.view(w, F32, (hdim,)), eps)


def _residual(dev, launch: Launch, h, x, w_post, scalar, w_next, y, hdim, eps):
    m = launch.grid[0]
    f32 = launch.kernel == norms.RESIDUAL_F32_ENTRY
    hv = dev.view(h, F32, (m, hdim))
    new_h, out = (norms.residual_rmsnorm_f32 if f32 else norms.residual_rmsnorm)(
        hv, dev.view(x, F32, (m, hdim)), dev.view(w_post, F32, (hdim,)),
        dev.view(scalar, F32, (1,)), dev.view(w_next, F32, (hdim,)), eps)
    hv[:] = new_h
    dev.view(y, _lin_dtype(launch.kernel), (m, hdim))[:] = out


def _gemv_fp8(dev, launch: Launch, w, scale, x, y, m, n, k):
    wv = dev.view(w, np.uint8, (n, k)).view(ml_dtypes.float8_e4m3fn).astype(F32)
    xv = dev.view(x, BF16, (m, k)).astype(F32)
    dev.view(y, F32, (m, n))[:] = (xv @ wv.T) * dev.view(scale, F32, (n,))[None, :]


def _gemv_bf16(dev, launch: Launch, w, x, y, m, n, k):
    wv = dev.view(w, BF16, (n, k)).astype(F32)
    dev.view(y, F32, (m, n))[:] = dev.view(x, BF16, (m, k)).astype(F32) @ wv.T


def _gemv_f32(dev, launch: Launch, w, x, y, m, n, k):
    dev.view(y, F32, (m, n))[:] = gemv_f32.reference(dev.view(w, F32, (n, k)),
                                                     dev.view(x, F32, (m, k)))


def _pool(dev, ptr, kh, d, table, kernel: str) -> np.ndarray:
    """A KV pool as the kernel reads it: e4m3 for the `_fp8` entries (FP8-KV), float32 for the
    `_f32` ones, else bf16."""
    blocks = int(np.max(table)) + 1
    return dev.view(ptr, _pool_dtype(kernel), (blocks, attn_decode.BLOCK, kh, d))


def _pool_dtype(kernel: str):
    return ml_dtypes.float8_e4m3fn if kernel.endswith("_fp8") else _lin_dtype(kernel)


def _qkv_post(dev, launch: Launch, qkv, ld, nh, kh, d, k_eq_v, wq, wk, positions, inv_freq, eps,
              q_out, k_pool, v_pool, table, max_blocks, ring):
    m = launch.grid[1]
    tab = dev.view(table, I32, (m, max_blocks))
    pos = dev.view(positions, I32, (m,))
    dummy = np.zeros((1, attn_decode.BLOCK, max(kh, 1), d), _pool_dtype(launch.kernel))
    kp = _pool(dev, k_pool, kh, d, tab, launch.kernel) if kh else dummy
    vp = _pool(dev, v_pool, kh, d, tab, launch.kernel) if kh and v_pool else dummy
    q, k_new, v_new = qkv_post.reference(
        dev.view(qkv, F32, (m, ld)), nh, kh, d, bool(k_eq_v), dev.view(wq, F32, (d,)),
        dev.view(wk, F32, (d,)) if wk else None, pos, dev.view(inv_freq, F32, (d // 2,)), eps,
        kp, vp, tab, ring, store_once=bool(kh) and not v_pool)
    dev.view(q_out, _lin_dtype(launch.kernel), (m, nh, d))[:] = q
    if kh:
        kp[:] = k_new
        if v_pool:
            vp[:] = v_new


def _write_partials(dev, out, m, nh, splits, d, part_acc, part_ml):
    acc = dev.view(part_acc, F32, (m, nh, splits, d))
    ml = dev.view(part_ml, F32, (m, nh, splits, 2))
    acc[:] = 0
    acc[:, :, 0] = out
    ml[:, :, :, 0] = -np.inf
    ml[:, :, :, 1] = 0
    ml[:, :, 0] = (0.0, 1.0)


def _attn(dev, launch: Launch, q, kc, vc, table, max_blocks, ring, seq_len, window, kh, part_acc,
          part_ml):
    splits, _, m = launch.grid
    d, g = _dims(launch.kernel)
    nh = kh * g
    tab = dev.view(table, I32, (m, max_blocks))
    out = attn_decode.reference(dev.view(q, _lin_dtype(launch.kernel), (m, nh, d)),
                                _pool(dev, kc, kh, d, tab, launch.kernel),
                                _pool(dev, vc, kh, d, tab, launch.kernel), tab, ring,
                                dev.view(seq_len, I32, (m,)), window)
    _write_partials(dev, out, m, nh, splits, d, part_acc, part_ml)


def _attn_keqv(dev, launch: Launch, q, base, table, max_blocks, ring, seq_len, window, kh, wk,
               inv_freq, part_acc, part_ml):
    splits, _, m = launch.grid
    d, g = _dims(launch.kernel)
    nh = kh * g
    tab = dev.view(table, I32, (m, max_blocks))
    out = attn_decode.reference_keqv(dev.view(q, _lin_dtype(launch.kernel), (m, nh, d)),
                                     _pool(dev, base, kh, d, tab, launch.kernel),
                                     tab, ring, dev.view(seq_len, I32, (m,)), window,
                                     dev.view(wk, F32, (d,)), dev.view(inv_freq, F32, (d // 2,)))
    _write_partials(dev, out, m, nh, splits, d, part_acc, part_ml)


def _attn_prefill(dev, launch: Launch, q, kc, vc, table, ring, positions, window, kh, m, out,
                  out_bf16):
    d, g = _dims(launch.kernel)
    tab = dev.view(table, I32, (1, ring))
    res = attn_prefill.reference(dev.view(q, BF16, (m, kh * g, d)),
                                 _pool(dev, kc, kh, d, tab, launch.kernel),
                                 _pool(dev, vc, kh, d, tab, launch.kernel), tab, ring,
                                 dev.view(positions, I32, (m,)), window)
    _write_out(dev, res, out, out_bf16)


def _attn_prefill_keqv(dev, launch: Launch, q, base, table, ring, positions, window, kh, m, wk,
                       inv_freq, out, out_bf16):
    d, g = _dims(launch.kernel)
    tab = dev.view(table, I32, (1, ring))
    res = attn_prefill.reference_keqv(dev.view(q, BF16, (m, kh * g, d)),
                                      _pool(dev, base, kh, d, tab, launch.kernel), tab, ring,
                                      dev.view(positions, I32, (m,)), window,
                                      dev.view(wk, F32, (d,)), dev.view(inv_freq, F32, (d // 2,)))
    _write_out(dev, res, out, out_bf16)


def _write_out(dev, res: np.ndarray, out, out_bf16) -> None:
    dev.view(out, F32, res.shape)[:] = res
    if out_bf16:
        dev.view(out_bf16, BF16, res.shape)[:] = res.astype(BF16)


def _dims(kernel: str) -> tuple[int, int]:
    d, g = kernel.rsplit("_d", 1)[1].split("_g")
    return int(d), int(g.split("_")[0])


def _combine(dev, launch: Launch, part_acc, part_ml, splits, d, out, out_bf16):
    bh = launch.grid[0]
    acc = dev.view(part_acc, F32, (bh, splits, d))
    ml = dev.view(part_ml, F32, (bh, splits, 2))
    top = ml[:, :, 0].max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        wgt = np.where(ml[:, :, 0] == -np.inf, 0, np.exp(ml[:, :, 0] - top)).astype(F32)
    res = (acc * wgt[:, :, None]).sum(axis=1) / (ml[:, :, 1] * wgt).sum(axis=1)[:, None]
    dev.view(out, F32, (bh, d))[:] = res
    if out_bf16:
        dev.view(out_bf16, BF16, (bh, d))[:] = res.astype(BF16)


def _gelu_mul(dev, launch: Launch, gu, out, inter):
    m = launch.grid[1]
    ref = gelu_mul.reference_f32 if launch.kernel == gelu_mul.F32_ENTRY else gelu_mul.reference
    dev.view(out, _lin_dtype(launch.kernel), (m, inter))[:] = ref(dev.view(gu, F32,
                                                                           (m, 2 * inter)))


def _sample_prepare(dev, launch: Launch, logits, m, v, cap, ws):
    """The workspace is the kernels' scratch; here it carries softcap(logits) to the pick."""
    dev.view(ws, F32, (m, v))[:] = sample.softcap(dev.view(logits, F32, (m, v)), cap)


def _sample_filter(dev, launch: Launch, m, v, chunk, temperature, top_k, ws):
    pass  # candidate selection: part of the pick's reference


def _sample_pick(dev, launch: Launch, m, v, temperature, top_k, top_p, seed, step, ws, out):
    dev.view(out, I32, (m,))[:] = sample.reference(
        dev.view(ws, F32, (m, v)), 0.0, dev.view(temperature, F32, (m,)),
        dev.view(top_k, I32, (m,)), dev.view(top_p, F32, (m,)), dev.view(seed, I32, (m,)),
        dev.view(step, I32, (m,)))


def _select_row(dev, launch: Launch, src, row, dst, hdim):
    r = int(dev.view(row, I32, (1,))[0])
    dtype = _lin_dtype(launch.kernel)
    dev.view(dst, dtype, (hdim,))[:] = dev.view(src + r * hdim * np.dtype(dtype).itemsize, dtype,
                                                (hdim,))


def _softcap_rows(dev, launch: Launch, x, n, cap):
    v = dev.view(x, F32, (n,))
    v[:] = rows.softcap(v, cap)


def _to_bf16(dev, launch: Launch, x, y, n):
    dev.view(y, BF16, (n,))[:] = ple.to_bf16(dev.view(x, F32, (n,)))


def _ple_combine(dev, launch: Launch, ctx, table, ids, w, out, ctx_scale, tok_mult, out_scale,
                 eps, m, layers, p):
    width = layers * p
    dtype = F32 if launch.kernel == ple.COMBINE_F32_ENTRY else BF16
    size = np.dtype(dtype).itemsize
    tok = np.stack([dev.view(table + int(i) * width * size, dtype, (width,))
                    for i in dev.view(ids, I32, (m,))])
    dev.view(out, F32, (m, layers, p))[:] = ple.combine(
        dev.view(ctx, F32, (m, width)), tok, dev.view(w, F32, (p,)), ctx_scale, tok_mult,
        out_scale, eps, layers)


def _ple_project(dev, launch: Launch, gate, ple_in, layer, layers, w, scale, y, m, n, p):
    dev.view(y, F32, (m, n))[:] = ple.project(
        dev.view(gate, F32, (m, p)), dev.view(ple_in, F32, (m, layers, p))[:, layer],
        dev.view(w, np.uint8, (n, p)), dev.view(scale, F32, (n,)))


def _ple_project_f32(dev, launch: Launch, gate, ple_in, layer, layers, w, y, m, n, p):
    dev.view(y, F32, (m, n))[:] = ple.project_f32(
        dev.view(gate, F32, (m, p)), dev.view(ple_in, F32, (m, layers, p))[:, layer],
        dev.view(w, F32, (n, p)))


def _ple_gelu_mul(dev, launch: Launch, gate, ple_in, layer, layers, out, m, p):
    dev.view(out, BF16, (m, p))[:] = ple.gelu_mul(dev.view(gate, F32, (m, p)),
                                                  dev.view(ple_in, F32, (m, layers, p))[:, layer])


def _residual_copy(dev, launch: Launch, h, x, w_post, scalar, y, hdim, eps):
    m = launch.grid[0]
    hv = dev.view(h, F32, (m, hdim))
    new_h, copy = ple.residual_copy(hv, dev.view(x, F32, (m, hdim)),
                                    dev.view(w_post, F32, (hdim,)),
                                    dev.view(scalar, F32, (1,)), eps)
    hv[:] = new_h
    dev.view(y, BF16, (m, hdim))[:] = copy


def _moe_norms(dev, launch: Launch, r, router_scale, router_mul, w2, z, x2, hdim, eps):
    m = launch.grid[0]
    zv, xv = moe.norms_reference(dev.view(r, F32, (m, hdim)), dev.view(router_scale, F32, (hdim,)),
                                 router_mul, dev.view(w2, F32, (hdim,)), eps)
    dev.view(z, BF16, (m, hdim))[:] = zv
    dev.view(x2, BF16, (m, hdim))[:] = xv


def _moe_norms_f32(dev, launch: Launch, r, router_scale, router_mul, w2, z, x2, hdim, eps):
    m = launch.grid[0]
    zv, xv = moe.norms_f32_reference(dev.view(r, F32, (m, hdim)),
                                     dev.view(router_scale, F32, (hdim,)), router_mul,
                                     dev.view(w2, F32, (hdim,)), eps)
    dev.view(z, F32, (m, hdim))[:] = zv
    dev.view(x2, F32, (m, hdim))[:] = xv


def _moe_gate_up_f32(dev, launch: Launch, w, x, ids, hid, m, k, inter, hdim):
    idv = dev.view(ids, I32, (m, k))
    e = int(idv.max()) + 1
    dev.view(hid, F32, (m, k, inter))[:] = moe.gate_up_f32_reference(
        dev.view(w, F32, (e, 2 * inter, hdim)), dev.view(x, F32, (m, hdim)), idv)


def _moe_down_f32(dev, launch: Launch, d, hid, ids, weights, y, m, k, inter, hdim):
    idv = dev.view(ids, I32, (m, k))
    e = int(idv.max()) + 1
    dev.view(y, F32, (m, hdim))[:] = moe.down_f32_reference(
        dev.view(d, F32, (e, hdim, inter)), dev.view(hid, F32, (m, k, inter)), idv,
        dev.view(weights, F32, (m, k)))


def _moe_route(dev, launch: Launch, logits, per_expert_scale, ids, weights, experts, k):
    m = launch.grid[0]
    got_ids, got_w = moe.route_reference(dev.view(logits, F32, (m, experts)),
                                         dev.view(per_expert_scale, F32, (experts,)), k)
    dev.view(ids, I32, (m, k))[:] = got_ids
    dev.view(weights, F32, (m, k))[:] = got_w


def _moe_gate_up(dev, launch: Launch, w, scale, x, ids, hid, m, k, inter, hdim):
    idv = dev.view(ids, I32, (m, k))
    e = int(idv.max()) + 1  # the experts up to the highest chosen id
    dev.view(hid, BF16, (m, k, inter))[:] = moe.gate_up_reference(
        dev.view(w, np.uint8, (e, 2 * inter, hdim)), dev.view(scale, F32, (e, 2 * inter)),
        dev.view(x, BF16, (m, hdim)), idv)


def _moe_down(dev, launch: Launch, d, scale, hid, ids, weights, y, m, k, inter, hdim):
    idv = dev.view(ids, I32, (m, k))
    e = int(idv.max()) + 1
    dev.view(y, F32, (m, hdim))[:] = moe.down_reference(
        dev.view(d, np.uint8, (e, hdim, inter)), dev.view(scale, F32, (e, hdim)),
        dev.view(hid, BF16, (m, k, inter)), idv, dev.view(weights, F32, (m, k)))


def _moe_router_rows(dev, launch: Launch, z, w, logits, m, experts, hdim):
    dev.view(logits, F32, (m, experts))[:] = moe.router_rows_reference(
        dev.view(z, BF16, (m, hdim)), dev.view(w, BF16, (experts, hdim)))


def _moe_sort(dev, launch: Launch, ids, order, offsets, pairs, experts):
    got_order, got_offsets = moe.sort_reference(dev.view(ids, I32, (pairs,)), experts)
    dev.view(order, I32, (pairs,))[:] = got_order
    dev.view(offsets, I32, (experts + 1,))[:] = got_offsets


def _grouping(dev, launch: Launch, order, offsets):
    """(order, offsets) as the grouped kernels read them: E from the grid, P from offsets."""
    experts = launch.grid[1]
    off = dev.view(offsets, I32, (experts + 1,))
    return dev.view(order, I32, (int(off[-1]),)), off


def _moe_gate_up_grouped(dev, launch: Launch, w, scale, x, order, offsets, hid, k, inter,
                         hdim):
    order_, off = _grouping(dev, launch, order, offsets)
    e, pairs = len(off) - 1, len(order_)
    dev.view(hid, BF16, (pairs, inter))[:] = moe.gate_up_grouped_reference(
        dev.view(w, np.uint8, (e, 2 * inter, hdim)), dev.view(scale, F32, (e, 2 * inter)),
        dev.view(x, BF16, (pairs // k, hdim)), order_, off, k)


def _moe_down_grouped(dev, launch: Launch, d, scale, hid, order, offsets, weights, part, inter,
                      hdim):
    order_, off = _grouping(dev, launch, order, offsets)
    e, pairs = len(off) - 1, len(order_)
    dev.view(part, F32, (pairs, hdim))[:] = moe.down_grouped_reference(
        dev.view(d, np.uint8, (e, hdim, inter)), dev.view(scale, F32, (e, hdim)),
        dev.view(hid, BF16, (pairs, inter)), order_, off, dev.view(weights, F32, (pairs,)))


def _moe_sum_pairs(dev, launch: Launch, part, y, k, hdim):
    m = launch.grid[1]
    dev.view(y, F32, (m, hdim))[:] = moe.sum_pairs_reference(
        dev.view(part, F32, (m * k, hdim)), k)


def _moe_branch_sum(dev, launch: Launch, f, w1, y, w2, out, hdim, eps):
    m = launch.grid[0]
    dev.view(out, F32, (m, hdim))[:] = moe.branch_sum_reference(
        dev.view(f, F32, (m, hdim)), dev.view(w1, F32, (hdim,)), dev.view(y, F32, (m, hdim)),
        dev.view(w2, F32, (hdim,)), eps)


_REFS = {
    head.EMBED_BF16_ENTRY: _embed_bf16,
    head.EMBED_FP8_ENTRY: _embed_fp8,
    head.EMBED_F32_ENTRY: _embed_f32,
    norms.RMSNORM_ENTRY: _rmsnorm,
    norms.RMSNORM_F32_ENTRY: _rmsnorm,
    norms.RESIDUAL_ENTRY: _residual,
    norms.RESIDUAL_F32_ENTRY: _residual,
    "gemv_fp8_rowscale": _gemv_fp8,
    "gemv_bf16": _gemv_bf16,
    gemv_f32.ENTRY: _gemv_f32,
    qkv_post.ENTRY: _qkv_post,
    qkv_post.SMALL_ENTRY: _qkv_post,
    qkv_post.entry(256, "float8_e4m3fn"): _qkv_post,
    qkv_post.entry(32, "float8_e4m3fn"): _qkv_post,
    qkv_post.entry(256, "float32"): _qkv_post,
    qkv_post.entry(32, "float32"): _qkv_post,
    attn_decode.COMBINE_ENTRY: _combine,
    gelu_mul.ENTRY: _gelu_mul,
    gelu_mul.F32_ENTRY: _gelu_mul,
    rows.SELECT_ENTRY: _select_row,
    rows.SELECT_F32_ENTRY: _select_row,
    sample.PREPARE_ENTRY: _sample_prepare,
    sample.FILTER_ENTRY: _sample_filter,
    sample.PICK_ENTRY: _sample_pick,
    rows.SOFTCAP_ENTRY: _softcap_rows,
    ple.TO_BF16_ENTRY: _to_bf16,
    ple.COMBINE_ENTRY: _ple_combine,
    ple.COMBINE_F32_ENTRY: _ple_combine,
    ple.PROJECT_ENTRY: _ple_project,
    ple.PROJECT_F32_ENTRY: _ple_project_f32,
    ple.GELU_MUL_ENTRY: _ple_gelu_mul,
    ple.RESIDUAL_COPY_ENTRY: _residual_copy,
    moe.NORMS_ENTRY: _moe_norms,
    moe.ROUTE_ENTRY: _moe_route,
    moe.GATE_UP_ENTRY: _moe_gate_up,
    moe.DOWN_ENTRY: _moe_down,
    moe.BRANCH_SUM_ENTRY: _moe_branch_sum,
    moe.SORT_ENTRY: _moe_sort,
    moe.ROUTER_ROWS_ENTRY: _moe_router_rows,
    moe.GATE_UP_GROUPED_ENTRY: _moe_gate_up_grouped,
    moe.DOWN_GROUPED_ENTRY: _moe_down_grouped,
    moe.SUM_PAIRS_ENTRY: _moe_sum_pairs,
    moe.NORMS_F32_ENTRY: _moe_norms_f32,
    moe.GATE_UP_F32_ENTRY: _moe_gate_up_f32,
    moe.DOWN_F32_ENTRY: _moe_down_f32,
}


def _kernel_ref(kernel: str):
    if kernel in _REFS:
        return _REFS[kernel]
    if kernel.startswith("gemm_fp8w_"):  # the prefill GEMM: the GEMV's arguments and product
        return _gemv_fp8
    if kernel.startswith("attn_decode_keqv_"):
        return _attn_keqv
    if kernel.startswith("attn_decode_d"):
        return _attn
    if kernel.startswith("attn_prefill_keqv_"):
        return _attn_prefill_keqv
    if kernel.startswith("attn_prefill_d"):
        return _attn_prefill
    raise KeyError(f"no numpy reference for kernel {kernel!r}")

