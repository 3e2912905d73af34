"""The small fused kernels of a Gemma 4 decode step (targets/h100: norms, qkv_post, gelu_mul,
head). On the CPU: each numpy reference equals the IR reference composition it stands for, and
every source compiles. On a GPU: each kernel against its reference on fresh random inputs at
real 31B and E4B shapes and at the tiny test models' shapes (head dims 32/64, hidden 64/128,
per-layer-input dim 16, vocab 1024), M in {1, 3}, outputs NaN-poisoned.

Bounds: f32 outputs relative L2 < 1e-5. bf16 outputs: every element within one bf16 ulp of the
reference's bf16 value (ulp of the reference's binade, 2^(floor(log2|want|) - 7)) plus an
absolute slack of 1e-5 * rms(want) for values near zero (RoPE cancellation), and under 1% of
elements differing at all: kernel and reference agree to f32 rounding (different sum order,
sqrt/sincos/tanh a few f32 ulps apart), so a rounding tie can flip one bf16 ulp, never more.
Argmax and untouched cache slots: exact.
"""

from __future__ import annotations

import ctypes
import shutil
import zlib

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.ir import ops
from rvcompile.targets.h100 import gelu_mul, head, norms, qkv_post

BF16 = ml_dtypes.bfloat16
SOURCES = {
    norms.SOURCE: (norms.RMSNORM_ENTRY, norms.RESIDUAL_ENTRY, norms.RMSNORM_Q_ENTRY,
                   norms.RESIDUAL_Q_ENTRY),
    qkv_post.SOURCE: (qkv_post.ENTRY, qkv_post.SMALL_ENTRY),
    gelu_mul.SOURCE: (gelu_mul.ENTRY, gelu_mul.Q_ENTRY),
    head.SOURCE: (head.ARGMAX_ENTRY, head.EMBED_BF16_ENTRY, head.EMBED_FP8_ENTRY),
}


def sliding_inv_freq(d: int = 256) -> np.ndarray:
    return (1e4 ** (-2.0 * np.arange(d // 2) / d)).astype(np.float32)


def full_inv_freq(d: int = 512, rotated: int | None = None) -> np.ndarray:
    """Proportional RoPE: the first d/8 frequencies (Gemma 4's fraction 0.25) unless given."""
    rotated = d // 8 if rotated is None else rotated
    f = np.zeros(d // 2, np.float32)
    f[:rotated] = 1e6 ** (-2.0 * np.arange(rotated) / d)
    return f


def assert_bf16_close(got, want) -> None:
    g = np.asarray(got).astype(np.float32)
    w = np.asarray(want).astype(np.float32)
    assert g.shape == w.shape
    assert np.isfinite(g).all(), f"{(~np.isfinite(g)).sum()} non-finite (unwritten?) elements"
    ulp = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 1e-30))) - 7)
    slack = 1e-5 * np.sqrt(np.mean(w.astype(np.float64) ** 2))
    err = np.abs(g - w)
    bad = err > ulp + slack
    assert not bad.any(), (f"{bad.sum()} elements beyond one bf16 ulp, first at "
                           f"{np.argwhere(bad)[0]}: got {g[bad][0]}, want {w[bad][0]}")
    # Rounding flips: at most 1% (and at least one may) of the elements whose magnitude is at
    # least 1% of the rms.
    # Smaller ones are excluded: there the float32 noise of the formula (e.g. the cancellation
    # in 1 + tanh(.) of GELU at negative inputs, seen flipping 4 of 256 tiny-model outputs)
    # spans whole bf16 ulps of the value; the bound above still holds them to the slack.
    sizable = np.abs(w) >= 0.01 * np.sqrt(np.mean(w.astype(np.float64) ** 2))
    flips = int((g != w)[sizable].sum())
    assert flips <= max(1, 0.01 * sizable.sum()), flips


def rel_l2(got, want) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


# ---------------------------------------------------------------- CPU: references vs the IR

def test_norm_references_are_the_ir_ops() -> None:
    rng = np.random.default_rng(0)
    a = ops.RMSNormAttrs(1e-6)
    x, h = rng.normal(0, 3, (2, 2, 640)).astype(np.float32)
    w_post, w_next = rng.normal(1, 0.3, (2, 640)).astype(np.float32)
    s = np.array([0.7], np.float32)
    y = norms.rmsnorm_bf16(x, w_post, 1e-6)
    assert y.dtype == BF16
    assert np.array_equal(y.astype(np.float32), ops.to_bf16(ops.ref_rmsnorm(a, x, w_post)))
    x64 = x.astype(np.float64)
    by_hand = x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6) * w_post
    assert np.abs(ops.ref_rmsnorm(a, x, w_post) - by_hand).max() < 1e-5
    h_new, y2 = norms.residual_rmsnorm(h, x, w_post, s, w_next, 1e-6)
    step = ops.ref_mul(None, ops.ref_add(None, h, ops.ref_rmsnorm(a, x, w_post)), s)
    assert np.array_equal(h_new, step)
    assert np.array_equal(y2.astype(np.float32), ops.to_bf16(ops.ref_rmsnorm(a, step, w_next)))


def paged_view(pool, table, ring):
    """[M, ring * 16, kh, d]: each row's ring of blocks as one contiguous cache (IR layout)."""
    return np.stack([pool[table[b, :ring]].reshape(ring * qkv_post.BLOCK, *pool.shape[2:])
                     for b in range(table.shape[0])])


@pytest.mark.parametrize("d", [256, 32])
@pytest.mark.parametrize("k_eq_v", [False, True])
def test_qkv_post_reference_is_norm_rope_kv_write(k_eq_v: bool, d: int) -> None:
    rng = np.random.default_rng(1 + k_eq_v + d)
    m, nh, kh, ring = 3, 4, 2, 5
    inv = full_inv_freq(d, d // 8) if k_eq_v else sliding_inv_freq(d)
    qkv = rng.normal(0, 2, (m, qkv_post.row_width(nh, kh, d, k_eq_v))).astype(np.float32)
    wq, wk = rng.normal(1, 0.3, (2, d)).astype(np.float32)
    pos = np.array([3, 200, 77], np.int32)  # 200 wraps the 5-block ring
    table = rng.permutation(m * ring + 2)[: m * ring].reshape(m, ring).astype(np.int32)
    pools = rng.normal(size=(2, m * ring + 2, 16, kh, d)).astype(BF16)
    q, k_pool, v_pool = qkv_post.reference(qkv, nh, kh, d, k_eq_v, wq, wk, pos, inv, 1e-6,
                                           pools[0], pools[1], table, ring)
    a, rope = ops.RMSNormAttrs(1e-6), ops.RopeAttrs(tuple(inv.tolist()))
    x = qkv.reshape(m, 1, -1, d)
    want_q = ops.ref_rope(rope, ops.ref_rmsnorm(a, x[:, :, :nh], wq), pos[:, None])
    assert np.array_equal(q.astype(np.float32), ops.to_bf16(want_q[:, 0]))
    k_raw = x[:, :, nh:nh + kh]
    v_raw = k_raw if k_eq_v else x[:, :, nh + kh:]
    new_k = ops.ref_rope(rope, ops.ref_rmsnorm(a, k_raw, wk), pos[:, None]).astype(BF16)
    new_v = ops.ref_rmsnorm(a, v_raw).astype(BF16)
    kw = ops.KVWriteAttrs(ring=True)
    for got, before, new in ((k_pool, pools[0], new_k), (v_pool, pools[1], new_v)):
        want = ops.ref_kv_write(kw, paged_view(before, table, ring), new, pos[:, None])
        assert np.array_equal(paged_view(got, table, ring).view(np.uint16), want.view(np.uint16))
        spare = np.setdiff1d(np.arange(m * ring + 2), table)  # blocks no row owns: untouched
        assert np.array_equal(got[spare].view(np.uint16), before[spare].view(np.uint16))
    # RoPE pairs dim i with i + d/2 (half-split), by hand for one head
    xh = ops.ref_rmsnorm(a, qkv[1, :d], wq).astype(np.float64)
    ang = pos[1] * inv.astype(np.float64)
    lo = xh[: d // 2] * np.cos(ang) - xh[d // 2:] * np.sin(ang)
    hi = xh[d // 2:] * np.cos(ang) + xh[: d // 2] * np.sin(ang)
    assert np.abs(q[1, 0].astype(np.float64) - np.concatenate([lo, hi])).max() < 0.05


def test_qkv_post_geometry_per_head_dim() -> None:
    """Small heads get the one-warp entry (the block sum needs a full warp), big ones d/8."""
    small = qkv_post.launch_geometry(3, 4, 2, 32)
    assert qkv_post.entry(32) == qkv_post.SMALL_ENTRY and small.block == (32, 1, 1)
    assert small.grid == (6, 3, 1)
    big = qkv_post.launch_geometry(1, 32, 0, 512)
    assert qkv_post.entry(512) == qkv_post.ENTRY and big.block == (64, 1, 1)
    assert big.grid == (32, 1, 1)
    for d in (48, 384, 1024):
        with pytest.raises(ValueError, match=f"head dim {d}"):
            qkv_post.launch_geometry(1, 4, 2, d)


def test_qkv_post_negative_position_writes_no_cache() -> None:
    rng = np.random.default_rng(3)
    qkv = rng.normal(size=(1, qkv_post.row_width(2, 1, 256, False))).astype(np.float32)
    pools = rng.normal(size=(2, 4, 16, 1, 256)).astype(BF16)
    _, k_pool, v_pool = qkv_post.reference(
        qkv, 2, 1, 256, False, np.ones(256, np.float32), np.ones(256, np.float32),
        np.array([-1], np.int32), sliding_inv_freq(), 1e-6, pools[0], pools[1],
        np.array([[0, 1, 2, 3]], np.int32), 4)
    assert np.array_equal(k_pool.view(np.uint16), pools[0].view(np.uint16))
    assert np.array_equal(v_pool.view(np.uint16), pools[1].view(np.uint16))


def test_gelu_mul_reference_is_gated_linear() -> None:
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 64)).astype(np.float32)
    wg, wu = rng.normal(0, 0.3, (2, 96, 64)).astype(np.float32)
    gu = ops.ref_multi_linear(ops.MultiLinearAttrs(2), x, wg, wu)
    got = gelu_mul.reference(gu)
    assert got.dtype == BF16 and got.shape == (3, 96)
    want = ops.to_bf16(ops.ref_gated_linear(None, x, wg, wu))
    assert np.array_equal(got.astype(np.float32), want)


def test_softcap_argmax_reference() -> None:
    rng = np.random.default_rng(5)
    logits = rng.normal(0, 8, (3, 4096)).astype(np.float32)
    capped = ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(30.0), logits)
    assert np.array_equal(head.softcap_argmax(logits, 30.0), np.argmax(capped, -1))
    logits[0, 3000], logits[0, 100] = 400.0, 300.0  # both saturate to exactly 30.0: lowest wins
    logits[1, 4000] = logits[1, 9] = 60.0  # exact tie
    got = head.softcap_argmax(logits, 30.0)
    assert got[0] == 100 and np.argmax(logits[0]) == 3000
    assert got[1] == 9 and got.dtype == np.int32


def test_embed_references() -> None:
    rng = np.random.default_rng(6)
    ids = np.array([5, 0, 5], np.int32)
    table = rng.normal(size=(8, 32)).astype(BF16)
    got = head.embed_rows(table, ids, 73.5)
    assert np.array_equal(got, table[ids].astype(np.float32) * np.float32(73.5))
    codes = rng.integers(0, 0x7E, (8, 32), dtype=np.uint8)
    scale = rng.uniform(1e-3, 1e-2, 8).astype(np.float32)
    got = head.embed_rows(codes, ids, 73.5, scale)
    deq = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)[ids] * scale[ids, None] * 73.5
    assert np.abs(got - deq).max() < 1e-5 * np.abs(deq).max()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_kernel_compiles(source: str, tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(source, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    for entry in SOURCES[source]:
        assert entry.encode() + b"\x00" in cubin


# ---------------------------------------------------------------- GPU


def _function(ctx, source: str, entry: str):
    from rvcompile.targets.h100.nvcc import compile_cubin

    return ctx.load_function(compile_cubin(source), entry)


def _p(buf) -> ctypes.c_uint64:
    return ctypes.c_uint64(buf.ptr)


def _poisoned(ctx, nbytes: int):
    buf = ctx.alloc(nbytes)
    ctx.memset(buf, 0xFF)  # NaN in f32, bf16 and e4m3; -1 in int32
    return buf


def quantized_outputs(ctx, m: int, h: int, quantize: bool) -> tuple:
    """A _q entry's q and q_scale buffers, NaN-poisoned, as launch arguments ([] without)."""
    if not quantize:
        return (), []
    bufs = (_poisoned(ctx, m * h), _poisoned(ctx, m * 4))
    return bufs, [_p(b) for b in bufs]


def assert_quantized(ctx, bufs, y) -> None:
    """A _q entry's q and q_scale: exactly quant_fp8_rows' quantization of the bf16 rows y the
    same launch wrote (gemm_tc.quantize_rows_reference)."""
    from rvcompile.targets.h100.gemm_tc import quantize_rows_reference

    m, h = y.shape
    q = ctx.download(bufs[0], np.uint8, (m, h))
    scale = ctx.download(bufs[1], np.float32, (m,))
    for b in bufs:
        ctx.free(b)
    want_q, want_scale = quantize_rows_reference(y)
    assert np.array_equal(scale.view(np.uint32), want_scale.view(np.uint32))
    assert np.array_equal(q, want_q)


HIDDEN = {"31B": 5376, "E4B": 2560, "tiny": 128, "oracle": 64}
# norm widths: the hidden sizes and the per-layer-input dim of E4B (256) and the tiny models (16)
NORM_WIDTH = {**HIDDEN, "E4B per-layer input": 256, "tiny per-layer input": 16}


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model", sorted(NORM_WIDTH))
def test_rmsnorm_bf16_kernel(model: str, m: int, quantize: bool) -> None:
    """rmsnorm_bf16, and rmsnorm_bf16_q with its rows' FP8 quantization (with 3 rows, the
    middle one all zeros: q = 0, scale = 0)."""
    ctx = h100_context()
    fn = _function(ctx, norms.SOURCE, norms.RMSNORM_Q_ENTRY if quantize else norms.RMSNORM_ENTRY)
    h = NORM_WIDTH[model]
    rng = np.random.default_rng(zlib.crc32(f"rms{model}{m}".encode()))
    x = rng.normal(0, 3, (m, h)).astype(np.float32)
    if quantize and m == 3:
        x[1] = 0
    w = rng.normal(1, 0.5, h).astype(np.float32)
    eps = 1e-6
    dx, dw, dy = ctx.upload(x), ctx.upload(w), _poisoned(ctx, m * h * 2)
    qbufs, qargs = quantized_outputs(ctx, m, h, quantize)
    launch = norms.launch_geometry(m, h)
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [_p(dx), _p(dw), _p(dy), *qargs, ctypes.c_int(h), ctypes.c_float(eps)])
    ctx.synchronize()
    got = ctx.download(dy, BF16, (m, h))
    for b in (dx, dw, dy):
        ctx.free(b)
    assert_bf16_close(got, norms.rmsnorm_bf16(x, w, eps))
    if quantize:
        assert_quantized(ctx, qbufs, got)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model", sorted(HIDDEN))
def test_residual_rmsnorm_kernel(model: str, m: int, quantize: bool) -> None:
    """residual_rmsnorm, and residual_rmsnorm_q with y's FP8 quantization."""
    ctx = h100_context()
    fn = _function(ctx, norms.SOURCE, norms.RESIDUAL_Q_ENTRY if quantize else norms.RESIDUAL_ENTRY)
    hd = HIDDEN[model]
    rng = np.random.default_rng(zlib.crc32(f"res{model}{m}".encode()))
    h = rng.normal(0, 4, (m, hd)).astype(np.float32)
    x = rng.normal(0, 0.5, (m, hd)).astype(np.float32)
    w_post, w_next = rng.normal(1, 0.5, (2, hd)).astype(np.float32)
    scalar = np.array([1.0 if m == 1 else rng.uniform(0.3, 1.5)], np.float32)
    eps = 1e-6
    dh, dx, dwp, ds, dwn = (ctx.upload(a) for a in (h, x, w_post, scalar, w_next))
    dy = _poisoned(ctx, m * hd * 2)
    qbufs, qargs = quantized_outputs(ctx, m, hd, quantize)
    launch = norms.launch_geometry(m, hd)
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [_p(dh), _p(dx), _p(dwp), _p(ds), _p(dwn), _p(dy), *qargs, ctypes.c_int(hd),
                ctypes.c_float(eps)])
    ctx.synchronize()
    got_h = ctx.download(dh, np.float32, (m, hd))
    got_y = ctx.download(dy, BF16, (m, hd))
    for b in (dh, dx, dwp, ds, dwn, dy):
        ctx.free(b)
    want_h, want_y = norms.residual_rmsnorm(h, x, w_post, scalar, w_next, eps)
    assert np.isfinite(got_h).all()
    assert rel_l2(got_h, want_h) < 1e-5
    assert_bf16_close(got_y, want_y)
    if quantize:
        assert_quantized(ctx, qbufs, got_y)


QKV_CASES = [  # (name, nh, kh, d, k_eq_v, window: 0 = full layer, kv_shared)
    ("31B sliding", 32, 16, 256, False, 1024, False),
    ("31B full K=V", 32, 4, 512, True, 0, False),
    ("E4B sliding", 8, 2, 256, False, 512, False),
    ("E4B full", 8, 2, 512, False, 0, False),
    ("E4B KV-shared sliding", 8, 2, 256, False, 512, True),
    ("tiny sliding", 4, 2, 32, False, 16, False),
    ("tiny full K=V", 4, 1, 64, True, 0, False),
    ("tiny KV-shared full K=V", 4, 1, 64, True, 0, True),
    ("oracle sliding, window 8", 4, 2, 32, False, 8, False),
    ("oracle full", 4, 2, 64, False, 0, False),
    ("d128 sliding, MQA", 8, 1, 128, False, 512, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("name,nh,kh,d,k_eq_v,window,shared", QKV_CASES,
                         ids=[c[0] for c in QKV_CASES])
def test_qkv_post_kernel(name, nh, kh, d, k_eq_v, window, shared, m) -> None:
    ctx = h100_context()
    fn = _function(ctx, qkv_post.SOURCE, qkv_post.entry(d))
    rng = np.random.default_rng(zlib.crc32(f"{name}{m}".encode()))
    blk = qkv_post.BLOCK
    if window:  # a ring of window/16 + 1 blocks; positions wrap it several times
        ring = max_blocks = window // blk + 1
        pos = rng.integers(0, 20000, m).astype(np.int32)
    else:
        ring = max_blocks = 200
        pos = rng.integers(0, ring * blk, m).astype(np.int32)
    if m == 3 and not window:
        pos[1] = -1  # an idle row: q is still written, the caches are not
    pool_blocks = m * max_blocks + 3
    table = rng.permutation(pool_blocks)[: m * max_blocks].reshape(m, max_blocks)
    table = table.astype(np.int32)
    ld = nh * d if shared else qkv_post.row_width(nh, kh, d, k_eq_v)
    qkv = rng.normal(0, 2, (m, ld)).astype(np.float32)
    wq, wk = rng.normal(1, 0.3, (2, d)).astype(np.float32)
    inv = full_inv_freq(d) if not window else sliding_inv_freq(d)
    eps = 1e-6
    pool_shape = (pool_blocks, blk, kh, d)
    poison = np.full(pool_shape, 0xFFFF, np.uint16).view(BF16)
    ins = [ctx.upload(a) for a in (qkv, wq, wk, pos, inv, table)]
    dq = _poisoned(ctx, m * nh * d * 2)
    dk, dv = (_poisoned(ctx, poison.nbytes) for _ in range(2))
    launch = qkv_post.launch_geometry(m, nh, 0 if shared else kh, d)
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [_p(ins[0]), ctypes.c_int(ld), ctypes.c_int(nh), ctypes.c_int(kh),
                ctypes.c_int(d), ctypes.c_int(int(k_eq_v)), _p(ins[1]), _p(ins[2]), _p(ins[3]),
                _p(ins[4]), ctypes.c_float(eps), _p(dq), _p(dk), _p(dv), _p(ins[5]),
                ctypes.c_int(max_blocks), ctypes.c_int(ring)])
    ctx.synchronize()
    got_q = ctx.download(dq, BF16, (m, nh, d))
    got_k = ctx.download(dk, BF16, pool_shape)
    got_v = ctx.download(dv, BF16, pool_shape)
    for b in (*ins, dq, dk, dv):
        ctx.free(b)
    want_q, want_k, want_v = qkv_post.reference(qkv, nh, 0 if shared else kh, d, k_eq_v, wq, wk,
                                                pos, inv, eps, poison, poison, table, ring)
    assert_bf16_close(got_q, want_q)
    written = np.zeros((pool_blocks, blk), bool)
    if not shared:
        for b in range(m):
            if pos[b] >= 0:
                written[table[b, (pos[b] // blk) % ring], pos[b] % blk] = True
    for got, want in ((got_k, want_k), (got_v, want_v)):
        assert np.array_equal(got[~written].view(np.uint16), want[~written].view(np.uint16))
        if written.any():
            assert_bf16_close(got[written], want[written])


@pytest.mark.gpu
@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model,inter", [("31B", 21504), ("E4B", 10240), ("tiny", 256),
                                         ("tiny double-wide", 512), ("oracle MoE expert", 32)])
def test_gelu_mul_kernel(model: str, inter: int, m: int, quantize: bool) -> None:
    """gelu_mul, and gelu_mul_q (a CTA a row) with its rows' FP8 quantization (with 3 rows, the
    middle one all zeros)."""
    ctx = h100_context()
    fn = _function(ctx, gelu_mul.SOURCE, gelu_mul.Q_ENTRY if quantize else gelu_mul.ENTRY)
    rng = np.random.default_rng(zlib.crc32(f"gelu{model}{m}".encode()))
    gu = rng.normal(0, 2, (m, 2 * inter)).astype(np.float32)
    if quantize and m == 3:
        gu[1] = 0
    dgu, dout = ctx.upload(gu), _poisoned(ctx, m * inter * 2)
    qbufs, qargs = quantized_outputs(ctx, m, inter, quantize)
    launch = (gelu_mul.q_geometry if quantize else gelu_mul.launch_geometry)(m, inter)
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [_p(dgu), _p(dout), *qargs, ctypes.c_int(inter)])
    ctx.synchronize()
    got = ctx.download(dout, BF16, (m, inter))
    for b in (dgu, dout):
        ctx.free(b)
    assert_bf16_close(got, gelu_mul.reference(gu))
    if quantize:
        assert_quantized(ctx, qbufs, got)


# per vocab: (the two saturating logits of row 0, low index last; three exact ties in row 1)
PLANTS = {262144: ((250001, 4099), (262143, 131072, 77777)), 1024: ((1001, 99), (1023, 512, 301))}


@pytest.mark.gpu
@pytest.mark.parametrize("plant", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("v", sorted(PLANTS))
def test_softcap_argmax_kernel(v: int, m: int, plant: bool) -> None:
    ctx = h100_context()
    fn = _function(ctx, head.SOURCE, head.ARGMAX_ENTRY)
    cap = 30.0
    rng = np.random.default_rng(zlib.crc32(f"argmax{v}{m}{plant}".encode()))
    logits = rng.normal(0, 8, (m, v)).astype(np.float32)
    (hi, lo), ties = PLANTS[v]
    if plant:  # ties only the softcap makes (both saturate to 30.0), and exact ties
        logits[0, hi], logits[0, lo] = 400.0, 300.0
        if m > 1:
            logits[1, list(ties)] = 90.0
    dl, dout = ctx.upload(logits), _poisoned(ctx, m * 4)
    launch = head.argmax_geometry(m, v)
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [_p(dl), ctypes.c_int(v), ctypes.c_float(cap), _p(dout)])
    ctx.synchronize()
    got = ctx.download(dout, np.int32, (m,))
    for b in (dl, dout):
        ctx.free(b)
    want = head.softcap_argmax(logits, cap)
    assert np.array_equal(got, want), (got, want)
    if plant:
        assert got[0] == lo and (m == 1 or got[1] == min(ties))


EMBED_TABLES = {  # (vocab, row width): token tables and the tiny models' per-layer tables (L * 16)
    "31B": (262144, 5376), "E4B": (262144, 2560), "tiny": (1024, 128), "oracle": (1024, 64),
    "tiny per-layer": (1024, 8 * 16), "oracle per-layer": (1024, 6 * 16),
}


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model", sorted(EMBED_TABLES))
def test_embed_rows_kernel(model: str, m: int, fp8: bool) -> None:
    """A full-size device table (V = 262144: 64-bit offsets; 1024 for the tiny models) poisoned,
    with the looked-up rows copied in at their offsets."""
    from rvcompile.runtime.executors.cuda_driver import check

    ctx = h100_context()
    entry = head.EMBED_FP8_ENTRY if fp8 else head.EMBED_BF16_ENTRY
    fn = _function(ctx, head.SOURCE, entry)
    vocab, h = EMBED_TABLES[model]
    rng = np.random.default_rng(zlib.crc32(f"embed{model}{m}{fp8}".encode()))
    ids = np.array([vocab - 1, int(rng.integers(1, vocab - 1)), vocab - 1][:m], np.int32)
    if fp8:
        rows = rng.integers(0, 256, (m, h), dtype=np.uint8)
        rows[(rows & 0x7F) == 0x7F] ^= 0x01  # no NaN codes
    else:
        rows = rng.normal(0, 0.05, (m, h)).astype(BF16)
    rows[2:] = rows[:1][: max(0, m - 2)]  # row 2 repeats id vocab - 1
    row_scale = rng.uniform(1e-4, 1e-3, vocab).astype(np.float32)
    mult = float(BF16(np.sqrt(h)))
    width = rows.dtype.itemsize * h
    dt = _poisoned(ctx, vocab * width)
    for i, r in zip(ids, rows, strict=True):
        r = np.ascontiguousarray(r)
        check(ctx.cu.cuMemcpyHtoD(dt.ptr + int(i) * width, r.ctypes.data, width), "cuMemcpyHtoD")
    dids, dout = ctx.upload(ids), _poisoned(ctx, m * h * 4)
    ds = ctx.upload(row_scale)
    launch = head.embed_geometry(m, h, fp8)
    args = [_p(dt)] + ([_p(ds)] if fp8 else []) + [_p(dids), ctypes.c_float(mult), _p(dout),
                                                   ctypes.c_int(h)]
    ctx.launch(fn, launch.grid, launch.block, launch.smem, args)
    ctx.synchronize()
    got = ctx.download(dout, np.float32, (m, h))
    for b in (dt, dids, dout, ds):
        ctx.free(b)
    want = head.embed_rows(rows, np.arange(m), mult, row_scale[ids] if fp8 else None)
    assert np.isfinite(got).all()
    assert rel_l2(got, want) < 1e-5
