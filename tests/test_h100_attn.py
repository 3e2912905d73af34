"""Paged attention kernels (targets/h100): split-KV decode (attn_decode) and flash-style prefill
(attn_prefill), bf16 and e4m3 (FP8-KV) pools. On the CPU: reference semantics (prefill against
direct float64 softmax attention and against the decode path) and the sources' entry lists; on a
GPU each kernel against its reference on fresh random inputs at real shapes, sliding windows
wrapped, and at every small head dim (32, 64, 128: the tiny test models) x group, plus
qkv_post's e4m3 cache write.
"""

from __future__ import annotations

import ctypes
import re
import zlib

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.targets.h100 import attn_decode as ad


def make_case(rng, batch, kv_heads, group, d, seq_lens, window, pool_blocks=None):
    """Random q/K/V; each sequence's blocks scattered over the pool; sliding layers use a ring
    of window/BLOCK + 1 blocks, so a window wraps around it."""
    ring_blocks = window // ad.BLOCK + 1 if window else max(-(-s // ad.BLOCK) for s in seq_lens)
    pool = pool_blocks or batch * ring_blocks + 3
    ids = rng.permutation(pool)[: batch * ring_blocks].reshape(batch, ring_blocks)
    bf16 = ml_dtypes.bfloat16
    q = rng.normal(0, 0.15, (batch, kv_heads * group, d)).astype(bf16)
    k = rng.normal(0, 1.0, (pool, ad.BLOCK, kv_heads, d)).astype(bf16)
    v = rng.normal(0, 1.0, (pool, ad.BLOCK, kv_heads, d)).astype(bf16)
    return q, k, v, ids.astype(np.int32), ring_blocks, np.asarray(seq_lens, np.int32)


@pytest.mark.parametrize("d,window", [(256, 16), (32, 8)])
def test_reference_is_masked_softmax(d: int, window: int) -> None:
    """window 8 (the oracle models') is shorter than a block: a one-block ring."""
    rng = np.random.default_rng(0)
    q, k, v, table, ring, lens = make_case(rng, 2, 2, 2, d, [5, 40], window=window)
    out = ad.reference(q, k, v, table, ring, lens, window=window)
    # sequence 1, head 3 (KV head 1), by hand over its visible tokens 40 - window .. 39
    ts = np.arange(40 - window, 40)
    kk = k[table[1, (ts // 16) % ring], ts % 16, 1].astype(np.float64)
    vv = v[table[1, (ts // 16) % ring], ts % 16, 1].astype(np.float64)
    s = kk @ q[1, 3].astype(np.float64)
    p = np.exp(s - s.max())
    assert np.allclose(out[1, 3], (p / p.sum()) @ vv, atol=1e-5)


def test_source_instantiates_every_entry() -> None:
    """entry() promises HEAD_DIMS x GROUPS; the .cu must instantiate exactly those (the GPU tests
    load only the entries their cases use)."""
    from rvcompile.targets.h100.nvcc import KERNEL_DIR

    src = (KERNEL_DIR / ad.SOURCE).read_text()
    made = {(int(d), int(g)) for d, g in re.findall(r"^ATTN_ENTRY\((\d+), (\d+)\)$", src, re.M)}
    assert made == {(d, g) for d in ad.HEAD_DIMS for g in ad.GROUPS}
    assert ad.entry_keqv(32, 4) == "attn_decode_keqv_d32_g4"
    with pytest.raises(ValueError, match="head_dim 48"):
        ad.entry(48, 2)


def split_kernel(ctx, kernel: str, d: int, group: int, kv_dtype: str, keqv: bool, batch: int,
                 kv_heads: int, splits: int):
    """(function, geometry) of a split launch: attn_decode.cu's kernel ("split") or
    attn_prefill.cu's tensor-core decode entry ("tc"), which share parameters, reference and
    combine."""
    from rvcompile.targets.h100 import attn_prefill as ap
    from rvcompile.targets.h100.nvcc import compile_cubin

    if kernel == "split":
        name = (ad.entry_keqv if keqv else ad.entry)(d, group, kv_dtype)
        return (ctx.load_function(compile_cubin(ad.SOURCE), name),
                ad.split_geometry(batch, kv_heads, splits))
    if kernel == "mma":  # attn_decode.cu's K=V tensor-core entries
        assert keqv
        return (ctx.load_function(compile_cubin(ad.SOURCE), ad.entry_keqv_mma(d, group, kv_dtype)),
                ad.split_geometry(batch, kv_heads, splits))
    name = (ap.decode_entry_keqv if keqv else ap.decode_entry)(d, group, kv_dtype)
    fn = ctx.load_function(compile_cubin(ap.SOURCE), name)
    geo = ap.decode_geometry(batch, kv_heads, splits, d, keqv)
    if geo.smem > 48 << 10:
        ctx.set_max_dynamic_smem(fn, geo.smem)
    return fn, geo


# the relative error each split kernel is held to: float32 throughout for attn_decode.cu's (its
# __expf and split order differ from the reference); the tensor-core entries' bf16 mma with P
# (and K=V's K) split hi + lo, attn_prefill's bound (set before any GPU run of either)
# attn_decode.cu's K=V tensor-core entries ("mma") split q * wk, derived K and P hi + lo: the
# tc entries' bound (set before any GPU run)
SPLIT_BOUND = {"split": 1e-5, "tc": 5e-5, "mma": 5e-5}


def run_kernel(ctx, q, k, v, table, ring, lens, window, kernel="split", splits=None,
               direct=False):
    """The split kernel then the combine; `direct` (one split): the split kernel writing out and
    its bf16 copy itself, no combine."""
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(ad.SOURCE)
    b, nh, d = q.shape
    kh = k.shape[2]
    combine = ctx.load_function(cubin, ad.COMBINE_ENTRY)
    keys = max(len(ad.visible_tokens(int(s), window)) for s in lens)
    splits = splits or ad.num_splits(b, kh, keys, ctx.sm_count)
    assert splits == 1 or not direct
    fn, split = split_kernel(ctx, kernel, d, nh // kh, str(k.dtype), False, b, kh, splits)
    bufs = [ctx.upload(x) for x in (q, k, v, table, lens)]
    acc, ml = ctx.alloc(b * nh * splits * d * 4), ctx.alloc(b * nh * splits * 2 * 4)
    out, out_bf16 = ctx.alloc(b * nh * d * 4), ctx.alloc(b * nh * d * 2)
    ctx.memset(out, 0xFF)  # NaN poison
    ctx.memset(out_bf16, 0xFF)
    ptr = [ctypes.c_uint64(x.ptr) for x in bufs]
    comb = ad.combine_geometry(b, nh, d, splits)
    outs = [ctypes.c_uint64(out.ptr), ctypes.c_uint64(out_bf16.ptr)]
    null = ctypes.c_uint64(0)
    ctx.launch(fn, split.grid, split.block, split.smem,
               ptr[:4] + [ctypes.c_int(table.shape[1]), ctypes.c_int(ring), ptr[4],
                          ctypes.c_int(window), ctypes.c_int(kh),
                          *([null, null, *outs] if direct else
                            [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), null, null])])
    if not direct:
        ctx.launch(combine, comb.grid, comb.block, comb.smem,
                   [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), ctypes.c_int(splits),
                    ctypes.c_int(d), *outs])
    ctx.synchronize()
    got = ctx.download(out, np.float32, (b, nh, d))
    got_bf16 = ctx.download(out_bf16, ml_dtypes.bfloat16, (b, nh, d))
    for x in (*bufs, acc, ml, out, out_bf16):
        ctx.free(x)
    # the bf16 copy (the o projection's input) is exactly the f32 result, rounded
    assert np.array_equal(got_bf16.view(np.uint16), got.astype(ml_dtypes.bfloat16).view(np.uint16))
    return got


CASES = [  # (name, batch, kv_heads, group, head_dim, seq_lens, window)
    ("31B sliding, window wrapped", 1, 16, 2, 256, [1200], 1024),
    ("31B full", 1, 4, 8, 512, [1200], 0),
    ("31B sliding, 3 sequences", 3, 16, 2, 256, [1, 700, 2049], 1024),
    ("E4B sliding", 2, 2, 4, 256, [513, 40], 512),
    ("E4B full", 2, 2, 4, 512, [3000, 17], 0),
    ("12B full, group 16", 1, 1, 16, 512, [1500], 0),
    ("E2B full, group 8", 2, 1, 8, 512, [64, 900], 0),
    ("tiny sliding, window 16", 3, 2, 2, 32, [1, 17, 300], 16),
    ("tiny full", 2, 2, 2, 64, [33, 250], 0),
    ("oracle sliding, window 8 < block", 2, 2, 2, 32, [5, 40], 8),
    ("oracle MQA full", 2, 1, 4, 64, [9, 64], 0),
    ("d256 group 1 sliding, 5 lanes", 5, 2, 1, 256, [1, 16, 17, 300, 1100], 1024),
]
# every small head dim with every group: full layers and a sliding window that wraps its ring
CASES += [(f"d{d} group {g}{' sliding' if window else ''}", 2, 2, g, d, [40, 700], window)
          for d in (32, 64, 128) for g in ad.GROUPS for window in (0, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "tc"])
@pytest.mark.parametrize("name,batch,kv_heads,group,d,lens,window", CASES,
                         ids=[c[0] for c in CASES])
def test_attn_decode_matches_reference(name, batch, kv_heads, group, d, lens, window,
                                       kernel) -> None:
    ctx = h100_context()
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    q, k, v, table, ring, lens_arr = make_case(rng, batch, kv_heads, group, d, lens, window)
    got = run_kernel(ctx, q, k, v, table, ring, lens_arr, window, kernel)
    want = ad.reference(q, k, v, table, ring, lens_arr, window)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


KEQV_CASES = [  # (name, batch, kv_heads, group, head_dim, seq_lens): full layers
    ("31B full K=V", 1, 4, 8, 512, [1200]),
    ("26B-A4B full K=V, 2 sequences", 2, 2, 8, 512, [700, 33]),
    ("12B full K=V, group 16", 1, 1, 16, 512, [1500]),
    ("tiny full K=V", 2, 1, 4, 64, [300, 17]),
    ("d32 K=V, group 2", 1, 2, 2, 32, [500]),
    ("d128 K=V, group 16", 2, 1, 16, 128, [64, 900]),
    ("d256 K=V, group 1", 1, 3, 1, 256, [400]),
]




def keqv_params(cases):
    """(case, kernel) pairs: every K=V case on both split kernels, and on attn_decode.cu's
    tensor-core entries where they exist (head dim 512, groups 8 and 16)."""
    return [(c, k) for c in cases for k in ("split", "tc", "mma")
            if k != "mma" or (c[4] == 512 and c[3] in ad.KEQV_MMA_GROUPS)]


KEQV_PARAMS = keqv_params(KEQV_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("case,kernel", KEQV_PARAMS, ids=[f"{c[0]}-{k}" for c, k in KEQV_PARAMS])
def test_attn_decode_keqv_matches_reference(case, kernel) -> None:
    """One pool of normalised bases; K = rope(base * wk) at each key's position, V = base."""
    name, batch, kv_heads, group, d, lens = case
    got, want = _run_keqv_decode(np.random.default_rng(zlib.crc32(name.encode())), batch,
                                 kv_heads, group, d, lens, fp8=False, kernel=kernel)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


def _run_keqv_decode(rng, batch, kv_heads, group, d, lens, fp8: bool, kernel="split",
                     splits=None, direct=False, poison=False):
    """(GPU output, reference) of a K=V split-KV decode kernel and its combine on one random
    case; `fp8`: the base pool in e4m3 (the `_fp8` entry); `direct` (one split): the split kernel
    writing out itself, no combine; `poison`: every pool row no query sees NaN."""
    from rvcompile.model.config import RopeSpec
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    q, base, _, table, ring, lens_arr = make_case(rng, batch, kv_heads, group, d, lens, 0)
    if fp8:
        base = to_e4m3(base)
    if poison:
        base = poison_unseen(base, base, table, ring, lens_arr, 0)[0]
    wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
    inv_freq = np.asarray(RopeSpec(1e6, 0.25).inv_freq(d), np.float32)
    cubin = compile_cubin(ad.SOURCE)
    combine = ctx.load_function(cubin, ad.COMBINE_ENTRY)
    splits = splits or ad.num_splits(batch, kv_heads, max(lens), ctx.sm_count)
    assert splits == 1 or not direct
    fn, split = split_kernel(ctx, kernel, d, group, "float8_e4m3fn" if fp8 else "bfloat16", True,
                             batch, kv_heads, splits)
    nh = kv_heads * group
    bufs = [ctx.upload(x) for x in (q, base, table, lens_arr, wk, inv_freq)]
    acc, ml = ctx.alloc(batch * nh * splits * d * 4), ctx.alloc(batch * nh * splits * 8)
    out = ctx.alloc(batch * nh * d * 4)
    ctx.memset(out, 0xFF)
    p = [ctypes.c_uint64(x.ptr) for x in bufs]
    comb = ad.combine_geometry(batch, nh, d, splits)
    null = ctypes.c_uint64(0)
    ctx.launch(fn, split.grid, split.block, split.smem,
               [p[0], p[1], p[2], ctypes.c_int(table.shape[1]), ctypes.c_int(ring), p[3],
                ctypes.c_int(0), ctypes.c_int(kv_heads), p[4], p[5],
                *([null, null, ctypes.c_uint64(out.ptr), null] if direct else
                  [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), null, null])])
    if not direct:
        ctx.launch(combine, comb.grid, comb.block, comb.smem,
                   [ctypes.c_uint64(acc.ptr), ctypes.c_uint64(ml.ptr), ctypes.c_int(splits),
                    ctypes.c_int(d), ctypes.c_uint64(out.ptr), null])
    ctx.synchronize()
    got = ctx.download(out, np.float32, (batch, nh, d))
    for x in (*bufs, acc, ml, out):
        ctx.free(x)
    return got, ad.reference_keqv(q, base, table, ring, lens_arr, 0, wk, inv_freq)


ONE_SPLIT_CASES = [c for c in CASES if c[0] in (
    "31B sliding, 3 sequences", "E4B full", "tiny sliding, window 16", "d128 group 16")]
# the entries that score on tensor cores (head dim 256, groups 1, 2, 4) and their neighbours
TC_SCORE_CASES = [c for c in CASES if c[0] in (
    "31B sliding, window wrapped", "31B sliding, 3 sequences", "E4B sliding", "E4B full",
    "d256 group 1 sliding, 5 lanes")]
# (case, e4m3 pools, kernel): bf16 pools on both split kernels; e4m3 pools of the
# tensor-core-scored entries on attn_decode.cu's
ONE_SPLIT_PARAMS = ([(c, False, kernel) for c in ONE_SPLIT_CASES for kernel in ("split", "tc")]
                    + [(c, True, "split") for c in TC_SCORE_CASES])


@pytest.mark.gpu
@pytest.mark.parametrize("case,fp8,kernel", ONE_SPLIT_PARAMS,
                         ids=[f"{c[0]}-{'fp8' if f else 'bf16'}-{k}"
                              for c, f, k in ONE_SPLIT_PARAMS])
def test_one_split_writes_the_combines_result(case, fp8, kernel) -> None:
    """With one split the lowering hands out to the split kernel and launches no combine: the
    same bits as the split kernel's partials through the combine, bf16 copy included."""
    name, batch, kv_heads, group, d, lens, window = case
    ctx = h100_context()
    rng = np.random.default_rng(zlib.crc32(f"one split {'fp8 ' if fp8 else ''}{name}".encode()))
    q, k, v, table, ring, lens_arr = make_case(rng, batch, kv_heads, group, d, lens, window)
    if fp8:
        k, v = to_e4m3(k), to_e4m3(v)
    combined = run_kernel(ctx, q, k, v, table, ring, lens_arr, window, kernel, splits=1)
    direct = run_kernel(ctx, q, k, v, table, ring, lens_arr, window, kernel, splits=1,
                        direct=True)
    assert np.isfinite(direct).all()
    assert np.array_equal(direct.view(np.uint32), combined.view(np.uint32))


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "tc", "mma"])
@pytest.mark.parametrize("fp8", [False, True])
def test_one_split_keqv_writes_the_combines_result(kernel, fp8) -> None:
    name, batch, kv_heads, group, d, lens = KEQV_CASES[1]  # 26B-A4B, 2 sequences
    got = [_run_keqv_decode(np.random.default_rng(7), batch, kv_heads, group, d, lens, fp8,
                            kernel, splits=1, direct=direct)[0] for direct in (False, True)]
    assert np.isfinite(got[1]).all()
    assert np.array_equal(got[1].view(np.uint32), got[0].view(np.uint32))


# ---------------------------------------------------------------- prefill attention (attn_prefill)

def make_prefill_case(rng, kv_heads, group, d, start, chunk, window, pad, keqv=False,
                      kv_dtype=ml_dtypes.bfloat16):
    """A chunk of `chunk` query rows at positions start.. (then `pad` padding rows) over a
    sequence of start + chunk tokens written into paged pools through one block table; sliding
    layers use the lowering's ring (window + chunk - 1 tokens, rounded up, plus a block), so
    longer sequences wrap it. Slots no token was written to hold NaN: never read, or zeroed.
    Returns (q, logical K [L, KH, D], logical V, K pool, V pool, table [M, ring], ring,
    positions [M])."""
    length = start + chunk
    ring = (-(-(window + chunk - 1) // ad.BLOCK) + 1) if window else -(-length // ad.BLOCK)
    pool = ring + 3
    ids = rng.permutation(pool)[:ring].astype(np.int32)
    k_log = rng.normal(0, 1.0, (length, kv_heads, d)).astype(kv_dtype)
    v_log = k_log if keqv else rng.normal(0, 1.0, (length, kv_heads, d)).astype(kv_dtype)
    k_pool = np.full((pool, ad.BLOCK, kv_heads, d), np.nan, np.float32).astype(kv_dtype)
    v_pool = k_pool.copy()
    for t in range(length):
        blk = ids[(t // ad.BLOCK) % ring]
        k_pool[blk, t % ad.BLOCK], v_pool[blk, t % ad.BLOCK] = k_log[t], v_log[t]
    m = chunk + pad
    q = rng.normal(0, 0.15, (m, kv_heads * group, d)).astype(ml_dtypes.bfloat16)
    positions = np.concatenate([np.arange(start, length), np.full(pad, -1)]).astype(np.int32)
    table = np.tile(ids, (m, 1))
    return q, k_log, v_log, k_pool, v_pool, table, ring, positions


def direct_attention(q, k_log, v_log, positions, window) -> np.ndarray:
    """Softmax attention over the logical K/V sequence in float64; padding rows zero."""
    m, nh, d = q.shape
    g = nh // k_log.shape[1]
    out = np.zeros((m, nh, d))
    for r, p in enumerate(positions):
        if p < 0:
            continue
        ts = np.arange(max(0, p - window + 1) if window else 0, p + 1)
        for h in range(nh):
            s = k_log[ts, h // g].astype(np.float64) @ q[r, h].astype(np.float64)
            w = np.exp(s - s.max())
            out[r, h] = (w / w.sum()) @ v_log[ts, h // g].astype(np.float64)
    return out


def rope_keys(base_log, wk, inv_freq) -> np.ndarray:
    """K = rope(base * wk, t): the angle t * inv_freq in float32 (as the IR defines it), the
    rest in float64."""
    x = base_log.astype(np.float64) * wk
    ang = (np.arange(len(x), dtype=np.float32)[:, None] * inv_freq[None]).astype(np.float64)
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    h = x.shape[-1] // 2
    return np.concatenate([x[..., :h] * cos - x[..., h:] * sin,
                           x[..., h:] * cos + x[..., :h] * sin], -1)


PREFILL_REF_CASES = [  # (name, kv_heads, group, d, start, chunk, window, pad, keqv)
    ("causal, GQA 4, padded", 2, 4, 64, 0, 37, 0, 3, False),
    ("full after earlier chunks", 1, 2, 32, 50, 20, 0, 0, False),
    ("sliding, ring wrapped", 2, 2, 32, 300, 40, 64, 4, False),
    ("window 8 < block", 2, 2, 32, 30, 12, 8, 4, False),
    ("d256 sliding", 2, 2, 256, 40, 24, 16, 0, False),
    ("K=V full, padded", 1, 4, 64, 20, 30, 0, 2, True),
    ("K=V sliding, ring wrapped", 2, 2, 32, 200, 33, 32, 0, True),
]


def _prefill_reference(case, rng, kv_dtype=ml_dtypes.bfloat16):
    from rvcompile.model.config import RopeSpec
    from rvcompile.targets.h100 import attn_prefill as ap

    _, kh, g, d, start, chunk, window, pad, keqv = case
    q, k_log, v_log, kp, vp, table, ring, pos = make_prefill_case(
        rng, kh, g, d, start, chunk, window, pad, keqv, kv_dtype)
    if not keqv:
        got = ap.reference(q, kp, vp, table, ring, pos, window)
        return got, direct_attention(q, k_log, v_log, pos, window), (q, kp, vp, table, ring, pos)
    wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
    inv_freq = np.asarray(RopeSpec(1e4, 1.0).inv_freq(d), np.float32)
    got = ap.reference_keqv(q, kp, table, ring, pos, window, wk, inv_freq)
    want = direct_attention(q, rope_keys(k_log, wk, inv_freq), v_log, pos, window)
    return got, want, (q, kp, wk, inv_freq, table, ring, pos)


@pytest.mark.parametrize("case", PREFILL_REF_CASES, ids=[c[0] for c in PREFILL_REF_CASES])
def test_prefill_reference_is_masked_softmax(case) -> None:
    """attn_prefill's reference against direct float64 softmax attention over the logical
    sequence: causal, windowed, wrapped ring, K=V, GQA; padding rows are zero."""
    got, want, _ = _prefill_reference(case, np.random.default_rng(zlib.crc32(case[0].encode())))
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() < 2e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("case", PREFILL_REF_CASES, ids=[c[0] for c in PREFILL_REF_CASES])
def test_prefill_reference_equals_decode_path(case) -> None:
    """The chunk through attn_prefill's reference = each row through attn_decode's (the path
    prefill took before), within float32 rounding; padding rows, which the decode path lets see
    key 0, are zero in the prefill kernel."""
    window, keqv = case[6], case[8]
    got, _, args = _prefill_reference(case, np.random.default_rng(zlib.crc32(case[0].encode())))
    pos = args[-1]
    seq_len = np.where(pos >= 0, pos + 1, 1)
    if keqv:
        q, base, wk, inv_freq, table, ring, _ = args
        old = ad.reference_keqv(q, base, table, ring, seq_len, window, wk, inv_freq)
    else:
        q, kp, vp, table, ring, _ = args
        old = ad.reference(q, kp, vp, table, ring, seq_len, window)
    real = pos >= 0
    np.testing.assert_allclose(got[real], old[real], rtol=1e-5, atol=1e-6)
    assert not got[~real].any()


def test_the_attention_benchmark_refuses_bad_arguments_in_one_line(tmp_path) -> None:
    """benchmarks/h100_attn.py: bad flags, an unreadable cubin and (here) no GPU exit 2 with one
    error line after argparse's usage, never a traceback."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parent.parent / "benchmarks" / "h100_attn.py"
    cases = [(["--batch", "x"], "--batch"), (["--batch", "0,8"], "--batch"),
             (["--context", "nan"], "--context"), (["--context", "-5"], "--context"),
             (["--tc-cubin", str(tmp_path / "none.cubin")], "--tc-cubin"),
             (["--cubin", str(tmp_path)], "--cubin"), (["--layers", "31B full"], "--layers"),
             (["--mma-cubin", str(tmp_path)], "--mma-cubin")]
    from rvcompile.runtime.executors.cuda_driver import CudaContext, CudaError

    try:
        CudaContext()
    except CudaError:  # no GPU here: the benchmark says so in one line
        cases.append(([], "error"))
    for args, says in cases:
        r = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 2, (args, r.stderr)
        last = r.stderr.strip().splitlines()[-1]
        assert says in last and "Traceback" not in r.stderr, (args, r.stderr)


def test_prefill_source_instantiates_every_entry() -> None:
    from rvcompile.targets.h100 import attn_prefill as ap
    from rvcompile.targets.h100.nvcc import KERNEL_DIR

    src = (KERNEL_DIR / ap.SOURCE).read_text()
    made = {(int(d), int(g)) for d, g in re.findall(r"^PREFILL_ENTRY\((\d+), (\d+)\)$", src, re.M)}
    assert made == {(d, g) for d in ad.HEAD_DIMS for g in ad.GROUPS}
    assert ap.entry_keqv(512, 8, "float8_e4m3fn") == "attn_prefill_keqv_d512_g8_fp8"
    assert ap.geometry(100, 16, 256, 2, False).grid == (4, 16, 1)  # 32 tokens a CTA
    with pytest.raises(ValueError, match="head_dim 48"):
        ap.entry(48, 2)
    # the tensor-core decode entries: attn_decode's split contract, a CTA per (split, KV head,
    # sequence) of D / 128 dim-slice warps, no float32 entry
    assert ap.decode_entry_keqv(512, 8, "float8_e4m3fn") == "attn_decode_tc_keqv_d512_g8_fp8"
    geo = ap.decode_geometry(256, 4, 3, 512, True)
    assert (geo.grid, geo.block, geo.smem) == ((3, 4, 256), (128, 1, 1),
                                               ap.smem_bytes(512, True, q_rows=0))
    # prefill CTAs: 4 row groups (8 tokens of group 8) and the q tile after the stages
    geo = ap.geometry(1024, 4, 512, 8, True)
    assert (geo.grid, geo.block, geo.smem) == ((128, 4, 1), (512, 1, 1),
                                               (2 * 3 * 16 + 64) * 520 * 2)
    with pytest.raises(ValueError, match="float32"):
        ap.decode_entry(256, 2, "float32")


def run_prefill_kernel(ctx, q, k_pool, v_pool, table, ring, positions, window, keqv_args=None):
    """attn_prefill on the GPU (v_pool unused when keqv_args = (wk, inv_freq)); out f32, after
    checking its bf16 copy is exactly its rounding."""
    from rvcompile.targets.h100 import attn_prefill as ap
    from rvcompile.targets.h100.nvcc import compile_cubin

    m, nh, d = q.shape
    kh = k_pool.shape[2]
    kv_dtype = str(k_pool.dtype)
    keqv = keqv_args is not None
    name = (ap.entry_keqv if keqv else ap.entry)(d, nh // kh, kv_dtype)
    fn = ctx.load_function(compile_cubin(ap.SOURCE), name)
    geo = ap.geometry(m, kh, d, nh // kh, keqv)
    if geo.smem > 48 << 10:
        ctx.set_max_dynamic_smem(fn, geo.smem)
    inputs = [q, k_pool] + ([] if keqv else [v_pool]) + [table, positions]
    bufs = [ctx.upload(x) for x in inputs]
    extra = [ctx.upload(x) for x in keqv_args] if keqv else []
    out, out_bf16 = ctx.alloc(m * nh * d * 4), ctx.alloc(m * nh * d * 2)
    ctx.memset(out, 0xFF)  # NaN poison
    ctx.memset(out_bf16, 0xFF)
    p = [ctypes.c_uint64(x.ptr) for x in bufs]
    n_pools = 1 if keqv else 2
    args = p[:1 + n_pools] + [p[1 + n_pools], ctypes.c_int(ring), p[2 + n_pools],
                              ctypes.c_int(window), ctypes.c_int(kh), ctypes.c_int(m)]
    args += [ctypes.c_uint64(x.ptr) for x in extra]
    args += [ctypes.c_uint64(out.ptr), ctypes.c_uint64(out_bf16.ptr)]
    ctx.launch(fn, geo.grid, geo.block, geo.smem, args)
    ctx.synchronize()
    got = ctx.download(out, np.float32, (m, nh, d))
    got_bf16 = ctx.download(out_bf16, ml_dtypes.bfloat16, (m, nh, d))
    for x in (*bufs, *extra, out, out_bf16):
        ctx.free(x)
    assert np.array_equal(got_bf16.view(np.uint16), got.astype(ml_dtypes.bfloat16).view(np.uint16))
    return got


PREFILL_CASES = [  # (name, kv_heads, group, d, start, chunk, window, pad, keqv)
    ("31B sliding, window 1024 wrapped", 16, 2, 256, 1500, 256, 1024, 0, False),
    ("31B full", 4, 8, 512, 700, 256, 0, 0, False),
    ("31B full K=V", 4, 8, 512, 300, 256, 0, 5, True),
    ("31B sliding, first chunk, padded", 16, 2, 256, 0, 200, 1024, 56, False),
    ("E4B sliding", 2, 4, 256, 600, 64, 512, 0, False),
    ("E4B full", 2, 4, 512, 100, 64, 0, 0, False),
    ("12B full K=V, group 16", 1, 16, 512, 64, 48, 0, 16, True),
    ("oracle sliding, window 8 < block", 2, 2, 32, 30, 32, 8, 0, False),
]
# every small head dim with every group: full and a wrapped sliding window, K=V full
PREFILL_CASES += [(f"d{d} group {g}{' sliding' if w else ''}{' K=V' if kv else ''}",
                   2, g, d, 90, 37, w, 3, kv)
                  for d in (32, 64, 128) for g in ad.GROUPS
                  for w, kv in ((0, False), (48, False), (0, True))]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PREFILL_CASES, ids=[c[0] for c in PREFILL_CASES])
def test_attn_prefill_matches_reference(case) -> None:
    ctx = h100_context()
    _, _, _, _, _, _, window, _, keqv = case
    got_ref, _, args = _prefill_reference(case, np.random.default_rng(zlib.crc32(case[0].encode())))
    if keqv:
        q, base, wk, inv_freq, table, ring, pos = args
        got = run_prefill_kernel(ctx, q, base, None, table, ring, pos, window, (wk, inv_freq))
    else:
        q, kp, vp, table, ring, pos = args
        got = run_prefill_kernel(ctx, q, kp, vp, table, ring, pos, window)
    assert np.isfinite(got).all()  # NaN-filled unwritten slots never reach the result
    assert not got[pos < 0].any()
    rel = np.linalg.norm(got - got_ref) / np.linalg.norm(got_ref)
    # bf16 mma with P (and K=V's K) split hi + lo, __expf: a bound set before any GPU run
    assert rel < 5e-5, rel



# packed prefill (kernel_schedule.PrefillPacking): two sequences' chunks in one launch, each from a
# multiple of the kernel's tile, every row its own sequence's table row
PACKED_CASES = [  # (name, kv_heads, group, d, keqv, window, (start, chunk) per sequence)
    ("31B sliding", 16, 2, 256, False, 1024, ((1100, 40), (0, 40))),
    ("31B full K=V", 4, 8, 512, True, 0, ((300, 45), (20, 33))),
    ("small full", 2, 2, 32, False, 0, ((0, 19), (40, 30))),
]


def make_packed_case(rng, kv_heads, group, d, keqv, window, seqs):
    """The sequences of make_prefill_case side by side in one call: pools concatenated (the second's
    block ids shifted past the first's), each chunk from a multiple of tile_tokens, alignment rows
    padding, full tables widened to the widest (a ring's width is the kind's). Returns (q, K pool, V
    pool, table [M, ring], ring, positions, the row ranges, each sequence's own (q, pools, table,
    ring, positions))."""
    from rvcompile.targets.h100 import attn_prefill as ap

    tile = ap.tile_tokens(d, group)
    own = [make_prefill_case(rng, kv_heads, group, d, start, chunk, window, 0, keqv)
           for start, chunk in seqs]
    ring = max(c[6] for c in own)
    qs, kps, vps, tables, poss, spans, blocks, row = [], [], [], [], [], [], 0, 0
    for q, _, _, kp, vp, table, r, pos in own:
        pad = -(-row // tile) * tile - row
        if pad:  # alignment rows: padding, the previous sequence's table row
            qs.append(np.zeros((pad, *q.shape[1:]), q.dtype))
            tables.append(np.tile(tables[-1][-1], (pad, 1)))
            poss.append(np.full(pad, -1, np.int32))
        row += pad
        spans.append((row, row + len(q)))
        qs.append(q)
        wide = np.zeros((len(q), ring), np.int32)
        wide[:, :r] = table + blocks
        tables.append(wide)
        poss.append(pos)
        kps.append(kp)
        vps.append(vp)
        blocks += len(kp)
        row += len(q)
    if window and any(c[6] != ring for c in own):  # a full table is as wide as its blocks
        raise ValueError("sliding sequences' rings must match (chunks of one length)")
    return (np.concatenate(qs), np.concatenate(kps), np.concatenate(vps), np.concatenate(tables),
            ring, np.concatenate(poss), spans, own)


def _packed_reference(case, rng):
    from rvcompile.model.config import RopeSpec
    from rvcompile.targets.h100 import attn_prefill as ap

    _, kh, g, d, keqv, window, seqs = case
    q, kp, vp, table, ring, pos, spans, own = make_packed_case(rng, kh, g, d, keqv, window, seqs)
    if keqv:
        wk = rng.uniform(0.5, 1.5, d).astype(np.float32)
        inv_freq = np.asarray(RopeSpec(1e4, 1.0).inv_freq(d), np.float32)
        got = ap.reference_keqv(q, kp, table, ring, pos, window, wk, inv_freq)
        alone = [ap.reference_keqv(o[0], o[3], o[5], o[6], o[7], window, wk, inv_freq)
                 for o in own]
        return got, alone, spans, (q, kp, None, table, ring, pos, (wk, inv_freq))
    got = ap.reference(q, kp, vp, table, ring, pos, window)
    alone = [ap.reference(o[0], o[3], o[4], o[5], o[6], o[7], window) for o in own]
    return got, alone, spans, (q, kp, vp, table, ring, pos, None)


@pytest.mark.parametrize("case", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_packed_prefill_reference_is_each_sequence_alone(case) -> None:
    """The reference over a packed call = each sequence's chunk alone, bit for bit; alignment
    rows zero."""
    got, alone, spans, args = _packed_reference(case, np.random.default_rng(7))
    for (a, b), want in zip(spans, alone, strict=True):
        assert np.array_equal(got[a:b], want)
    assert not got[args[5] < 0].any()


@pytest.mark.gpu
@pytest.mark.parametrize("case", PACKED_CASES, ids=[c[0] for c in PACKED_CASES])
def test_attn_prefill_packed_matches_reference(case) -> None:
    ctx = h100_context()
    got_ref, _, _, (q, kp, vp, table, ring, pos, keqv) = _packed_reference(
        case, np.random.default_rng(7))
    got = run_prefill_kernel(ctx, q, kp, vp, table, ring, pos, case[5], keqv)
    assert np.isfinite(got).all() and not got[pos < 0].any()
    rel = np.linalg.norm(got - got_ref) / np.linalg.norm(got_ref)
    assert rel < 5e-5, rel  # as the one-sequence cases


# ---------------------------------------------------------------- FP8 KV cache (e4m3 pools)

FP8 = ml_dtypes.float8_e4m3fn


def to_e4m3(x) -> np.ndarray:
    from rvcompile.targets.h100 import qkv_post

    return qkv_post.to_pool(np.asarray(x).astype(np.float32), FP8)


FP8_DECODE_CASES = [c for c in CASES if c[0] in (
    "31B sliding, window wrapped", "31B full", "31B sliding, 3 sequences", "E4B sliding",
    "tiny sliding, window 16", "oracle MQA full", "d64 group 4 sliding",
    "d256 group 1 sliding, 5 lanes")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "tc"])
@pytest.mark.parametrize("name,batch,kv_heads,group,d,lens,window", FP8_DECODE_CASES,
                         ids=[c[0] for c in FP8_DECODE_CASES])
def test_attn_decode_fp8_matches_reference(name, batch, kv_heads, group, d, lens, window,
                                           kernel) -> None:
    """The _fp8 entries on e4m3 pools: the same math after an exact widening."""
    ctx = h100_context()
    rng = np.random.default_rng(zlib.crc32(f"fp8 {name}".encode()))
    q, k, v, table, ring, lens_arr = make_case(rng, batch, kv_heads, group, d, lens, window)
    k, v = to_e4m3(k), to_e4m3(v)
    got = run_kernel(ctx, q, k, v, table, ring, lens_arr, window, kernel)
    want = ad.reference(q, k, v, table, ring, lens_arr, window)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


FP8_KEQV_PARAMS = keqv_params(KEQV_CASES[:4])


@pytest.mark.gpu
@pytest.mark.parametrize("case,kernel", FP8_KEQV_PARAMS,
                         ids=[f"{c[0]}-{k}" for c, k in FP8_KEQV_PARAMS])
def test_attn_decode_keqv_fp8_matches_reference(case, kernel) -> None:
    name, batch, kv_heads, group, d, lens = case
    got, want = _run_keqv_decode(np.random.default_rng(zlib.crc32(f"fp8 {name}".encode())),
                                 batch, kv_heads, group, d, lens, fp8=True, kernel=kernel)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


FP8_PREFILL_CASES = [c for c in PREFILL_CASES if c[0] in (
    "31B sliding, window 1024 wrapped", "31B full", "31B full K=V", "E4B sliding",
    "oracle sliding, window 8 < block", "d32 group 2 sliding", "d64 group 4 K=V")]


@pytest.mark.gpu
@pytest.mark.parametrize("case", FP8_PREFILL_CASES, ids=[c[0] for c in FP8_PREFILL_CASES])
def test_attn_prefill_fp8_matches_reference(case) -> None:
    ctx = h100_context()
    window, keqv = case[6], case[8]
    got_ref, _, args = _prefill_reference(case, np.random.default_rng(zlib.crc32(case[0].encode())),
                                          kv_dtype=FP8)
    if keqv:
        q, base, wk, inv_freq, table, ring, pos = args
        got = run_prefill_kernel(ctx, q, base, None, table, ring, pos, window, (wk, inv_freq))
    else:
        q, kp, vp, table, ring, pos = args
        got = run_prefill_kernel(ctx, q, kp, vp, table, ring, pos, window)
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - got_ref) / np.linalg.norm(got_ref)
    assert rel < 5e-5, rel  # as the bf16 entries: e4m3 widens to bf16 exactly


FP8_QKV_CASES = [  # (name, nh, kh, d, k_eq_v, window)
    ("31B sliding", 32, 16, 256, False, 1024),
    ("31B full K=V", 32, 4, 512, True, 0),
    ("tiny sliding", 4, 2, 32, False, 16),
    ("tiny full K=V", 4, 1, 64, True, 0),
    ("d128 sliding, MQA", 8, 1, 128, False, 512),
]


@pytest.mark.gpu
@pytest.mark.parametrize("name,nh,kh,d,k_eq_v,window", FP8_QKV_CASES,
                         ids=[c[0] for c in FP8_QKV_CASES])
def test_qkv_post_fp8_writes_the_reference_bytes(name, nh, kh, d, k_eq_v, window) -> None:
    """qkv_post's _fp8 entry: q as the bf16 entry, K/V rounded once to e4m3 (saturating). The
    f32 values before rounding may differ from the reference's in the last bits (sincosf), so
    a value lying on a rounding boundary may land one e4m3 step away: at most 0.1% of them."""
    from rvcompile.targets.h100 import qkv_post
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    fn = ctx.load_function(compile_cubin(qkv_post.SOURCE), qkv_post.entry(d, "float8_e4m3fn"))
    rng = np.random.default_rng(zlib.crc32(f"fp8 qkv {name}".encode()))
    m, blk = 3, qkv_post.BLOCK
    ring = window // blk + 1 if window else 200
    pos = np.array([5, 3000 if window else 1500, 77], np.int32)
    pool_blocks = m * ring + 3
    table = rng.permutation(pool_blocks)[: m * ring].reshape(m, ring).astype(np.int32)
    ld = qkv_post.row_width(nh, kh, d, k_eq_v)
    qkv = rng.normal(0, 2, (m, ld)).astype(np.float32)
    qkv[0, nh * d] = 5e4  # one huge raw k: its normalised value saturates only if w is large
    wq, wk = rng.normal(1, 0.3, (2, d)).astype(np.float32)
    wk[0] = 100.0  # so K's dim 0 exceeds 448 for row 0: the kernel saturates, never NaN
    inv = (1e4 ** (-2.0 * np.arange(d // 2) / d)).astype(np.float32)
    pool = np.full((pool_blocks, blk, kh, d), 0x7F, np.uint8).view(FP8)  # NaN poison
    bufs = [ctx.upload(a) for a in (qkv, wq, wk, pos, inv, table, pool, pool)]
    dq = ctx.alloc(m * nh * d * 2)
    p = [ctypes.c_uint64(b.ptr) for b in bufs]
    geo = qkv_post.launch_geometry(m, nh, kh, d)
    ctx.launch(fn, geo.grid, geo.block, geo.smem,
               [p[0], ctypes.c_int(ld), ctypes.c_int(nh), ctypes.c_int(kh), ctypes.c_int(d),
                ctypes.c_int(int(k_eq_v)), p[1], p[2], p[3], p[4], ctypes.c_float(1e-6),
                ctypes.c_uint64(dq.ptr), p[6], ctypes.c_uint64(0) if k_eq_v else p[7], p[5],
                ctypes.c_int(ring), ctypes.c_int(ring)])
    ctx.synchronize()
    got_k = ctx.download(bufs[6], FP8, pool.shape)
    got_v = ctx.download(bufs[7], FP8, pool.shape)
    for b in (*bufs, dq):
        ctx.free(b)
    _, want_k, want_v = qkv_post.reference(qkv, nh, kh, d, k_eq_v, wq, wk, pos, inv, 1e-6,
                                           pool, pool, table, ring, store_once=k_eq_v)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        differ = got.view(np.uint8) != want.view(np.uint8)
        g, w = got[differ].astype(np.float32), want[differ].astype(np.float32)
        step = 2.0 ** (np.floor(np.log2(np.maximum(np.abs(w), 2.0 ** -6))) - 3)
        assert np.isfinite(g).all() and (np.abs(g - w) <= step).all()
        assert differ.sum() <= max(1, 1e-3 * m * (kh * d)), differ.sum()
    assert np.nanmax(np.abs(want_k.astype(np.float32))) == 448.0 or k_eq_v  # NaN: unwritten



def poison_unseen(k, v, table, ring, lens, window):
    """K and V pools with every row no query sees set to NaN (e4m3 0x7f, a bf16 NaN): stale or
    uninitialised cache bytes must never reach a score or a weight."""
    seen = np.zeros(k.shape[:2], bool)
    for b, n in enumerate(lens):
        ts = ad.visible_tokens(int(n), window)
        seen[table[b, (ts // ad.BLOCK) % ring], ts % ad.BLOCK] = True
    k, v = k.copy(), v.copy()
    k[~seen] = np.nan
    v[~seen] = np.nan
    return k, v


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["split", "tc"])
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("name,batch,kv_heads,group,d,lens,window", TC_SCORE_CASES,
                         ids=[c[0] for c in TC_SCORE_CASES])
def test_attn_decode_reads_only_visible_keys(name, batch, kv_heads, group, d, lens, window,
                                             fp8, splits, kernel) -> None:
    """NaN in every pool row outside the visible keys (the rest of a partly filled block, a
    wrapped ring's stale tokens, blocks of other sequences), e4m3 and bf16 pools: the result is
    the reference's, with the planned split count and with one split (the lone split writing
    out itself)."""
    ctx = h100_context()
    rng = np.random.default_rng(zlib.crc32(f"poison {name}".encode()))
    q, k, v, table, ring, lens_arr = make_case(rng, batch, kv_heads, group, d, lens, window)
    if fp8:
        k, v = to_e4m3(k), to_e4m3(v)
    k, v = poison_unseen(k, v, table, ring, lens_arr, window)
    got = run_kernel(ctx, q, k, v, table, ring, lens_arr, window, kernel, splits=splits,
                     direct=splits == 1)
    want = ad.reference(q, k, v, table, ring, lens_arr, window)
    assert np.isfinite(want).all()
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


# the K=V tensor-core entries' shapes (head dim 512: the 31B's, the 26B-A4B's two sequences, the
# 12B's group 16) on the kernels that run them
KEQV_POISON_PARAMS = [p for p in keqv_params(KEQV_CASES[:3]) if p[1] != "split"]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 1])
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("case,kernel", KEQV_POISON_PARAMS,
                         ids=[f"{c[0]}-{k}" for c, k in KEQV_POISON_PARAMS])
def test_attn_decode_keqv_reads_only_visible_keys(case, kernel, fp8, splits) -> None:
    """NaN in every base row no query sees (a full layer's partly filled last block, other
    sequences' blocks): the reference's result, with the planned splits and with one split."""
    name, batch, kv_heads, group, d, lens = case
    got, want = _run_keqv_decode(np.random.default_rng(zlib.crc32(f"poison {name}".encode())),
                                 batch, kv_heads, group, d, lens, fp8, kernel, splits=splits,
                                 direct=splits == 1, poison=True)
    assert np.isfinite(want).all()
    assert np.isfinite(got).all()
    rel = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert rel < SPLIT_BOUND[kernel], rel


def test_keqv_mma_entries_take_only_quarter_rotary_rope() -> None:
    """The K=V tensor-core entries fold the unrotated pairs' K into q, so they exist for head
    dim 512 at groups 8 and 16 and take rope rotating only the first 64 pairs (Gemma 4's full
    layers); the lowering asks keqv_mma_fits, the reference refuses other frequencies."""
    from rvcompile.model.config import RopeSpec
    from rvcompile.targets.h100.contract import Call
    from rvcompile.targets.h100.nvcc import KERNEL_DIR

    quarter, whole = RopeSpec(1e6, 0.25).inv_freq(512), RopeSpec(1e6, 1.0).inv_freq(512)
    assert ad.keqv_mma_fits(512, 8, "float8_e4m3fn", quarter)
    assert ad.keqv_mma_fits(512, 16, "bfloat16", quarter)
    assert not ad.keqv_mma_fits(512, 8, "bfloat16", whole)
    assert not ad.keqv_mma_fits(512, 4, "bfloat16", quarter)
    assert not ad.keqv_mma_fits(512, 8, "float32", quarter)
    assert not ad.keqv_mma_fits(256, 8, "bfloat16", RopeSpec(1e6, 0.25).inv_freq(256))
    assert ad.entry_keqv_mma(512, 16, "float8_e4m3fn") == "attn_decode_keqv_mma_d512_g16_fp8"
    with pytest.raises(ValueError, match="head_dim 256"):
        ad.entry_keqv_mma(256, 8)
    src = (KERNEL_DIR / ad.SOURCE).read_text()
    made = set(re.findall(r"^KEQV_MMA_ENTRY\((\d+), (_fp8)?, (true|false)\)$", src, re.M))
    assert made == {(str(g), s, t) for g in ad.KEQV_MMA_GROUPS
                    for s, t in (("", "false"), ("_fp8", "true"))}
    (entry,) = [e for e in ad.ENTRIES if e.name == "attn_decode_keqv_mma_d512_g8"]
    rng = np.random.default_rng(0)
    arrays = {"q": rng.normal(0, 0.15, (1, 8, 512)).astype(ml_dtypes.bfloat16),
              "base": rng.normal(0, 1, (2, 16, 1, 512)).astype(ml_dtypes.bfloat16),
              "table": np.array([[1, 0]], np.int32), "seq_len": np.array([20], np.int32),
              "wk": np.ones(512, np.float32), "inv_freq": np.asarray(whole, np.float32),
              "out": np.zeros((1, 8, 512), np.float32)}

    def launch(arrays):
        """The entry's reference over an arena holding `arrays`; out as it wrote it."""
        offsets, at = {}, 0
        for name, x in arrays.items():
            offsets[name], at = at, at + -(-x.nbytes // 256) * 256
        arena = np.zeros(at, np.uint8)
        for name, x in arrays.items():
            arena[offsets[name]:offsets[name] + x.nbytes] = np.frombuffer(x.tobytes(), np.uint8)
        args = dict(offsets, max_blocks=2, ring=2, window=0, kv_heads=1, part_acc=None,
                    part_ml=None, out_bf16=None)
        entry.reference(Call(entry, (1, 1, 1), args, arena))
        return arena[offsets["out"]:offsets["out"] + 8 * 512 * 4].view(np.float32)

    with pytest.raises(ValueError, match="inv_freq is nonzero beyond pair 64"):
        launch(arrays)
    got = launch(dict(arrays, inv_freq=np.asarray(quarter, np.float32)))
    want = ad.reference_keqv(arrays["q"], arrays["base"], arrays["table"], 2, arrays["seq_len"],
                             0, arrays["wk"], np.asarray(quarter, np.float32))
    assert np.array_equal(got, want.ravel())
