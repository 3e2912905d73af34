"""Paged prefill attention (flash-attention style): the numpy reference of kernels/attn_prefill.cu
and its launch geometry.

Rows are token rows of one or more sequences (a prefill or logits chunk, or a packed prefill's
chunks, after qkv_post wrote their K/V): q [M, KH*G, D] bf16; K and V pools [blocks, BLOCK, KH, D]
(bf16, or e4m3 in an FP8-KV build); block table [M, ring] int32, a row per token row: token t of row
m's sequence in block table[m, (t // BLOCK) % ring]. The kernel reads a CTA's first token row's
table for all its tile_tokens rows, so the rows of one tile must share their table row (one
sequence's chunk; a packed prefill starts each chunk at a multiple of the tile). Row m's query sits
at positions[m] and sees keys max(0, p - window + 1) .. p (window 0: all), scale 1.0; positions[m] <
0 (padding) gives a zero output row. K=V layers (`entry_keqv`) keep one pool of normalised bases: V
= base, K = rope(base * k_norm weight, t), as in attn_decode. Output: out f32 [M, KH*G, D] and its
bf16 copy, the layout attn_decode's combine writes, so the o projection reads either.

Geometry: a CTA owns one KV head and BM = 16 * WR query rows, a query row being one (token,
head of the group) pair, token-major, so each 16-key K/V tile is read once for all G heads.
Its warps are WR = 4 row groups x WC dim slices (WC = D / 128 from D = 256 up): each warp holds
the output accumulator for 16 rows x D / WC dims in registers, q sits in a shared tile of the
CTA's BM rows, and the WC slices' partial scores are summed through shared memory. Tiles are
double-buffered in dynamic shared memory after which the q tile sits (`geometry().smem`; above
48 KiB the runtime raises the kernel's limit). The decode entries keep q in registers and have
one row group (`decode_geometry`).
"""

from __future__ import annotations

from functools import partial

import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.attn_decode import (
    BLOCK,
    GROUPS,
    HEAD_DIMS,
    KV_DTYPES,
    pool,
    split_params,
    split_reference,
)
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "attn_prefill.cu"


def _suffix(kv_dtype: str) -> str:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"no prefill attention kernel for KV dtype {kv_dtype}")
    return "_fp8" if kv_dtype == "float8_e4m3fn" else ""


def entry(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    if head_dim not in HEAD_DIMS or group not in GROUPS:
        raise ValueError(f"no prefill attention kernel for head_dim {head_dim}, group {group}")
    return f"attn_prefill_d{head_dim}_g{group}{_suffix(kv_dtype)}"


def entry_keqv(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    return entry(head_dim, group, kv_dtype).replace("attn_prefill_", "attn_prefill_keqv_")


def decode_entry(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    """The tensor-core decode entry: attn_decode's split kernel contract (its parameters, its
    reference, its combine) on this file's tile loop."""
    if kv_dtype == "float32":
        raise ValueError("no tensor-core decode attention for float32 pools")
    return entry(head_dim, group, kv_dtype).replace("attn_prefill_", "attn_decode_tc_")


def decode_entry_keqv(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    return decode_entry(head_dim, group, kv_dtype).replace("_tc_", "_tc_keqv_")


def decode_geometry(batch: int, kv_heads: int, splits: int, head_dim: int, keqv: bool) -> Launch:
    """A CTA per (split, KV head, sequence), as attn_decode.split_geometry: one row group (the
    group's heads of one token) of WC dim-slice warps."""
    return Launch((splits, kv_heads, batch), (32 * warp_shape(head_dim)[1], 1, 1),
                  smem_bytes(head_dim, keqv, q_rows=0))


def warp_shape(head_dim: int) -> tuple[int, int]:
    """(WR row groups, WC dim slices) of a prefill CTA; must match the kernel's Shape<D>."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"no prefill attention kernel for head_dim {head_dim}")
    return 4, max(1, head_dim // 128)


def tile_tokens(head_dim: int, group: int) -> int:
    return 16 * warp_shape(head_dim)[0] // group


def smem_bytes(head_dim: int, keqv: bool, q_rows: int) -> int:
    """Two stages of K (K=V: K rounded and its bf16 remainder) and V tiles, then a q tile of
    `q_rows` rows (0 for the decode entries), rows padded by 8 bf16."""
    tiles = 3 if keqv else 2
    return (2 * tiles * BLOCK + q_rows) * (head_dim + 8) * 2


def geometry(rows: int, kv_heads: int, head_dim: int, group: int, keqv: bool) -> Launch:
    if rows < 1:
        raise ValueError(f"attn_prefill needs rows >= 1 (rows={rows})")
    wr, wc = warp_shape(head_dim)
    tiles = -(-rows // tile_tokens(head_dim, group))
    return Launch((tiles, kv_heads, 1), (32 * wr * wc, 1, 1),
                  smem_bytes(head_dim, keqv, q_rows=16 * wr))


def visible(positions, window: int, keys: np.ndarray) -> np.ndarray:
    """mask [M, S]: key t visible to row m (its query at positions[m], < 0 sees nothing)."""
    p = np.asarray(positions, np.int64)[:, None]
    lo = np.maximum(0, p - window + 1) if window else np.zeros_like(p)
    return (keys[None, :] >= lo) & (keys[None, :] <= p)


def reference(q, k_pool, v_pool, table, ring: int, positions, window: int) -> np.ndarray:
    def rows(blocks, ts):
        return (k_pool[blocks, ts % BLOCK].astype(np.float32),
                v_pool[blocks, ts % BLOCK].astype(np.float32))

    return _attend(q, k_pool.shape[2], table, ring, positions, window, rows)


def reference_keqv(q, base_pool, table, ring: int, positions, window: int, wk,
                   inv_freq) -> np.ndarray:
    rope = ops.RopeAttrs(tuple(float(f) for f in np.asarray(inv_freq, np.float32)))

    def rows(blocks, ts):
        base = base_pool[blocks, ts % BLOCK].astype(np.float32)  # [S, KH, D]
        k = ops.ref_rope(rope, (base * np.asarray(wk, np.float32))[None], ts[None])[0]
        return k, base

    return _attend(q, base_pool.shape[2], table, ring, positions, window, rows)


def _attend(q, kv_heads: int, table, ring: int, positions, window: int, rows) -> np.ndarray:
    """Each sequence's rows (those sharing a table row) attended by _attend_one."""
    q, table = np.asarray(q), np.asarray(table)
    pos = np.asarray(positions, np.int64)
    out = np.zeros(q.shape, np.float32)
    real = np.flatnonzero(pos >= 0)
    if not real.size:
        return out
    _, seq = np.unique(table[real], axis=0, return_inverse=True)
    for i in range(int(seq.max()) + 1):
        r = real[seq.reshape(-1) == i]
        out[r] = _attend_one(q[r], kv_heads, table[r[0]], ring, pos[r], window, rows)
    return out


def _attend_one(q, kv_heads: int, table_row, ring: int, pos, window: int, rows) -> np.ndarray:
    """Masked softmax over the keys one sequence's rows (all real) see, all heads at once, in
    float64 and rounded once to float32: the key range and the einsum shapes depend on how a
    prompt is cut into chunks (a prefix-cache hit cuts it elsewhere), and float32 sums in another
    order would make a row's result, and a seeded sample drawn from it, depend on that cut."""
    q = q.astype(np.float64)
    m, nh, d = q.shape
    hi = int(pos.max())
    lo = int(pos.min()) - window + 1 if window else 0
    ts = np.arange(max(0, lo), hi + 1)
    k, v = rows(table_row[(ts // BLOCK) % ring], ts)  # [S, KH, D]
    g = nh // kv_heads
    qg = q.reshape(m, kv_heads, g, d)
    s = np.einsum("mkgd,skd->kgms", qg, k.astype(np.float64))
    mask = visible(pos, window, ts)  # [M, S]
    s = np.where(mask[None, None], s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.where(mask[None, None], np.exp(s - np.where(np.isfinite(top), top, 0)), 0)
    p = p / np.maximum(p.sum(-1, keepdims=True), 1e-300)
    return np.einsum("kgms,skd->mkgd", p, v.astype(np.float64)).reshape(m, nh, d)


# ---------------------------------------------------------------- entries

def _call(d: int, g: int, c: Call) -> None:
    m, kh, ring = c["rows"], c["kv_heads"], c["ring"]
    table = np.asarray(c.array("table", (m, ring)))
    q = c.array("q", (m, kh * g, d))
    positions, window = c.array("positions", (m,)), c["window"]
    if "base" in c:  # K=V
        res = reference_keqv(q, pool(c, "base", table, kh, d), table, ring, positions, window,
                             c.array("wk", (d,)), c.array("inv_freq", (d // 2,)))
    else:
        res = reference(q, pool(c, "kc", table, kh, d), pool(c, "vc", table, kh, d), table, ring,
                        positions, window)
    c.array("out", res.shape)[:] = res
    out_bf16 = c.array("out_bf16", res.shape)
    if out_bf16 is not None:
        out_bf16[:] = res.astype(out_bf16.dtype)


def _entries():
    """Prefill and tensor-core decode entries for bf16 and e4m3 pools (no float32 entries: the
    float32 plan attends through attn_decode)."""
    for d in HEAD_DIMS:
        for g in GROUPS:
            for kv in ("bfloat16", "float8_e4m3fn"):
                rows = (ptr("positions", "int32"), i32("window"), i32("kv_heads"), i32("rows"))
                outs = (ptr("out", "float32", "out"),
                        ptr("out_bf16", "bfloat16", "out", nullable=True))
                yield Entry(entry(d, g, kv), SOURCE,
                            (ptr("q", "bfloat16"), ptr("kc", kv), ptr("vc", kv),
                             ptr("table", "int32"), i32("ring"), *rows, *outs),
                            partial(_call, d, g))
                yield Entry(entry_keqv(d, g, kv), SOURCE,
                            (ptr("q", "bfloat16"), ptr("base", kv), ptr("table", "int32"),
                             i32("ring"), *rows, ptr("wk", "float32"),
                             ptr("inv_freq", "float32"), *outs),
                            partial(_call, d, g))
                yield Entry(decode_entry(d, g, kv), SOURCE, split_params(kv, False),
                            partial(split_reference, d, g))
                yield Entry(decode_entry_keqv(d, g, kv), SOURCE, split_params(kv, True),
                            partial(split_reference, d, g))


ENTRIES = tuple(_entries())
