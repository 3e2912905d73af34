"""Post-QKV kernel (kernels/qkv_post.cu): q/k norms, RoPE and the paged KV-cache write after the
fused QKV GEMV. Its numpy reference and launch geometry.

Entry `qkv_post(qkv f32 [M, ld], ld, nh, kh, d, k_eq_v, wq f32 [d], wk f32 [d],
positions int32 [M], inv_freq f32 [d/2], eps, q_out bf16 [M, nh, d], k_pool, v_pool,
block_table int32 [M, max_blocks], max_blocks, ring)`:
    row m of qkv = nh q heads | kh k heads | kh v heads (no v heads when k_eq_v), each d wide;
    q_out[m, h]           = bf16(rope(rmsnorm(q_h) * wq, pos))
    k_pool[blk, p % 16, j] = bf16(rope(rmsnorm(k_j) * wk, pos))
    v_pool[blk, p % 16, j] = bf16(rmsnorm(v_j))       (no weight; v_j = k_j raw when k_eq_v)
with pos = positions[m], blk = block_table[m, (pos // 16) % ring], pools [blocks, 16, kh, d]
bf16 (attn_decode.py's layout), rmsnorm(v) = v * (mean(v^2) + eps)^-1/2 in f32 (ops.ref_rmsnorm)
and rope the IR's half-split ops.ref_rope (inv_freq zeros leave a pair unrotated). pos < 0: no
cache write. KV-shared layers launch only the nh q CTAs (geometry kv_heads=0).

Head dims: `ENTRY` takes d % 256 == 0 (256, 512), `SMALL_ENTRY` d in (32, 64, 128), the tiny test
models; both have this argument list, `entry(d)` picks one. Any M >= 1.
FP8 KV (`entry(d, "float8_e4m3fn")`, the `_fp8` entries): the pools hold e4m3 and each K/V value
is rounded once from its f32 value (nearest even, saturating at +-448: `to_pool`, as the IR's
KV_WRITE does for a float8_e4m3fn cache).
float32 (`entry(d, "float32")`, the `_f32` entries of the float32 plan): q_out and the pools are
float32 and nothing is rounded.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "qkv_post.cu"
ENTRY = "qkv_post"
SMALL_ENTRY = "qkv_post_small"
SMALL_HEAD_DIMS = (32, 64, 128)
BLOCK = 16  # tokens per cache block, as in attn_decode


KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")
_SUFFIX = {"bfloat16": "", "float8_e4m3fn": "_fp8", "float32": "_f32"}


def entry(d: int, kv_dtype: str = "bfloat16") -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"qkv_post has no entry for KV dtype {kv_dtype}")
    suffix = _SUFFIX[kv_dtype]
    if d in SMALL_HEAD_DIMS:
        return SMALL_ENTRY + suffix
    if d in (256, 512):
        return ENTRY + suffix
    raise ValueError(f"qkv_post has no entry for head dim {d} (32, 64, 128, 256 or 512)")


def to_pool(x: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded to a pool's dtype as the kernel stores them."""
    x = np.asarray(x, np.float32)
    if np.dtype(dtype) == np.dtype(ml_dtypes.float8_e4m3fn):
        x = np.clip(x, -ops.FP8_MAX, ops.FP8_MAX)
    return x.astype(dtype)


def row_width(nh: int, kh: int, d: int, k_eq_v: bool) -> int:
    return (nh + (1 if k_eq_v else 2) * kh) * d


def reference(qkv, nh: int, kh: int, d: int, k_eq_v: bool, wq, wk, positions, inv_freq,
              eps: float, k_pool, v_pool, table, ring: int, store_once: bool = False):
    """(q [M, nh, d], new k_pool, new v_pool); the pools are copied, not modified. q is bf16,
    or float32 when the pools are (the `_f32` entries).
    store_once (K=V layers; the kernel gets a null v_pool): k_pool receives the normalised base
    rmsnorm(k_raw) (= V) and nothing else is written; attention derives K from it."""
    qkv = np.asarray(qkv, np.float32)
    m = qkv.shape[0]
    a = ops.RMSNormAttrs(eps)
    rope = ops.RopeAttrs(tuple(float(f) for f in np.asarray(inv_freq, np.float32)))
    pos = np.asarray(positions, np.int32)
    q = qkv[:, : nh * d].reshape(m, 1, nh, d)  # [B, T=1, heads, d] as the IR's ROPE takes it
    q_out = ops.ref_rope(rope, ops.ref_rmsnorm(a, q, wq), pos[:, None])[:, 0]
    k_pool, v_pool = np.array(k_pool, copy=True), np.array(v_pool, copy=True)
    if kh:
        k_raw = qkv[:, nh * d:(nh + kh) * d].reshape(m, 1, kh, d)
        v_raw = k_raw if k_eq_v else qkv[:, (nh + kh) * d:(nh + 2 * kh) * d].reshape(m, 1, kh, d)
        k = ops.ref_rope(rope, ops.ref_rmsnorm(a, k_raw, wk), pos[:, None])[:, 0]
        v = ops.ref_rmsnorm(a, v_raw)[:, 0]
        for b in range(m):
            p = int(pos[b])
            if p >= 0:
                blk = table[b, (p // BLOCK) % ring]
                if store_once:
                    k_pool[blk, p % BLOCK] = to_pool(v[b], k_pool.dtype)
                    continue
                k_pool[blk, p % BLOCK] = to_pool(k[b], k_pool.dtype)
                v_pool[blk, p % BLOCK] = to_pool(v[b], v_pool.dtype)
    f32 = k_pool.dtype == np.float32
    return (q_out if f32 else q_out.astype(ml_dtypes.bfloat16)), k_pool, v_pool


def launch_geometry(m: int, nh: int, kv_heads: int, d: int) -> Launch:
    """CTA (head, row): nh q heads then kv_heads KV heads (0 for KV-shared layers); d/8 threads,
    or one warp for `SMALL_ENTRY`'s head dims."""
    if m < 1:
        raise ValueError(f"qkv_post needs M >= 1 (M={m})")
    threads = 32 if entry(d) == SMALL_ENTRY else d // 8
    return Launch((nh + kv_heads, m, 1), (threads, 1, 1), 0)


# ---------------------------------------------------------------- entries

def _call(c: Call) -> None:
    """A KV-shared layer (kh = 0) gets null pools; a K=V layer a null v_pool (store_once)."""
    m, nh, kh, d = c.grid[1], c["nh"], c["kh"], c["d"]
    table = np.asarray(c.array("table", (m, c["max_blocks"])))
    blocks = int(np.max(table)) + 1
    dummy = np.zeros((1, BLOCK, max(kh, 1), d), c.dtype("k_pool"))
    kp = c.array("k_pool", (blocks, BLOCK, kh, d)) if kh else dummy
    has_v = not c.null("v_pool")
    vp = c.array("v_pool", (blocks, BLOCK, kh, d)) if kh and has_v else dummy
    wk = c.array("wk", (d,))
    q, k_new, v_new = reference(
        c.array("qkv", (m, c["ld"])), nh, kh, d, bool(c["k_eq_v"]), c.array("wq", (d,)), wk,
        c.array("positions", (m,)), c.array("inv_freq", (d // 2,)), c["eps"], kp, vp, table,
        c["ring"], store_once=bool(kh) and not has_v)
    c.array("q_out", (m, nh, d))[:] = q
    if kh:
        kp[:] = k_new
        if has_v:
            vp[:] = v_new


def _entries():
    for kv in KV_DTYPES:
        q = "float32" if kv == "float32" else "bfloat16"
        params = (ptr("qkv", "float32"), i32("ld"), i32("nh"), i32("kh"), i32("d"),
                  i32("k_eq_v"), ptr("wq", "float32"), ptr("wk", "float32", nullable=True),
                  ptr("positions", "int32"), ptr("inv_freq", "float32"), f32("eps"),
                  ptr("q_out", q, "out"), ptr("k_pool", kv, "inout", nullable=True),
                  ptr("v_pool", kv, "inout", nullable=True), ptr("table", "int32"),
                  i32("max_blocks"), i32("ring"))
        for d in (SMALL_HEAD_DIMS[0], 256):
            yield Entry(entry(d, kv), SOURCE, params, _call)


ENTRIES = tuple(_entries())
