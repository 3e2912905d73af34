"""Paged split-KV decode attention: the numpy reference of kernels/attn_decode.cu and its launch
geometry. Layout: q [B, KH*G, D] bf16; K and V pools [blocks, BLOCK, KH, D] bf16; block table
[B, max_blocks] int32, token t in block table[b, (t // BLOCK) % ring]; query at seq_len[b] - 1,
keys in its window (0 = all); scale 1.0. K=V layers (`entry_keqv`) keep one pool holding each
token's normalised base: V = base and K = rope(base * k_norm weight, t), derived while reading.

Entries for head dims 32, 64, 128 (tiny test models), 256 and 512 (Gemma 4) and GQA groups 1, 2,
4, 8, 16, each for bf16 pools and (suffix `_fp8`, an FP8-KV build) e4m3 pools, which the kernel
widens exactly to f32; the references read either dtype. At head dim 256 the _fp8 entries with
groups 1, 2 and 4 and the bf16 entries with group 4 (every sliding layer but the E2B's, and the
31B's bf16 ones) compute their scores on tensor cores (bf16, or f16 for e4m3 keys, whose q is
exact in f16's normal range; f32 sums) and P.V in f32: the same contract and references, the
f32 loop's bound. The K=V entries at head dim 512, groups 8 and 16 (`entry_keqv_mma`: the full
layers of the 31B, 26B-A4B and 12B) run on tensor cores with every operand in registers but
the rotated pairs' K, for rope rotating only the first 64 pairs (`keqv_mma_fits`; their
reference refuses other frequencies). The float32 plan's entries (suffix `_f32`)
take q and the pools as float32; it also runs prefill chunks through them, a row per sequence
(the tensor-core attn_prefill is bf16/e4m3 only). A launch is the split kernel
(`split_geometry`: a CTA of 128 threads per (split, KV head, sequence), writing part_acc f32
[B, nh, splits, D] and part_ml f32 [B, nh, splits, 2]) then `attn_decode_combine`
(`combine_geometry`: a CTA of D threads per (sequence, head), splits f32 weights of dynamic
shared memory) into out f32 [B, nh, D] and optionally its bf16 copy. With one split (grid x = 1)
the lowering passes out (and out_bf16) to the split kernel instead, which then writes the
combine's result itself, bit for bit, and no combine runs.
"""

from __future__ import annotations

from functools import partial

import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "attn_decode.cu"
COMBINE_ENTRY = "attn_decode_combine"
BLOCK = 16
GROUPS = (1, 2, 4, 8, 16)
HEAD_DIMS = (32, 64, 128, 256, 512)
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")
_SUFFIX = {"bfloat16": "", "float8_e4m3fn": "_fp8", "float32": "_f32"}
SPLIT_THREADS = 128  # must match the kernel (WARPS * 32)


def entry(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    if head_dim not in HEAD_DIMS or group not in GROUPS:
        raise ValueError(f"no decode attention kernel for head_dim {head_dim}, group {group}")
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"no decode attention kernel for KV dtype {kv_dtype}")
    return f"attn_decode_d{head_dim}_g{group}{_SUFFIX[kv_dtype]}"


def entry_keqv(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    return entry(head_dim, group, kv_dtype).replace("attn_decode_", "attn_decode_keqv_")


KEQV_MMA_GROUPS = (8, 16)


def entry_keqv_mma(head_dim: int, group: int, kv_dtype: str = "bfloat16") -> str:
    """The K=V tensor-core entry (head dim 512, groups 8 and 16, bf16 or e4m3 pools): the K=V
    split contract for rope that rotates only the first head_dim / 8 pairs (`keqv_mma_fits`)."""
    if head_dim != 512 or group not in KEQV_MMA_GROUPS or kv_dtype == "float32":
        raise ValueError(f"no K=V tensor-core decode attention for head_dim {head_dim}, group "
                         f"{group}, KV dtype {kv_dtype}")
    return entry_keqv(head_dim, group, kv_dtype).replace("_keqv_", "_keqv_mma_")


def keqv_mma_fits(head_dim: int, group: int, kv_dtype: str, inv_freq) -> bool:
    """Whether a K=V layer can take `entry_keqv_mma`: its shape, and rope frequencies that are
    zero from pair head_dim / 8 on (Gemma 4's partial rotary factor 0.25), since the kernel
    folds the unrotated pairs' K into q."""
    return (head_dim == 512 and group in KEQV_MMA_GROUPS and kv_dtype != "float32"
            and not np.any(np.asarray(inv_freq, np.float32)[head_dim // 8:]))


def num_splits(batch: int, kv_heads: int, max_keys: int, sm_count: int) -> int:
    """Enough (sequence, KV head, split) CTAs for two waves, but at least 32 keys a split."""
    want = -(-2 * sm_count // (batch * kv_heads))
    return max(1, min(want, -(-max_keys // 32)))


def split_geometry(batch: int, kv_heads: int, splits: int) -> Launch:
    return Launch((splits, kv_heads, batch), (SPLIT_THREADS, 1, 1), 0)


def combine_geometry(batch: int, heads: int, head_dim: int, splits: int) -> Launch:
    """One CTA of head_dim threads per (sequence, head); warp 0 weighs the splits, so the kernel
    needs head_dim >= 32, which every entry's head dim is."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"no decode attention combine for head_dim {head_dim}")
    return Launch((batch * heads, 1, 1), (head_dim, 1, 1), splits * 4)


def visible_tokens(seq_len: int, window: int) -> np.ndarray:
    pos = seq_len - 1
    lo = max(0, pos - window + 1) if window else 0
    return np.arange(lo, pos + 1)


def reference(q, k_pool, v_pool, table, ring: int, seq_len, window: int) -> np.ndarray:
    return _attend(q, k_pool, table, ring, seq_len, window,
                   lambda blocks, ts: (k_pool[blocks, ts % BLOCK].astype(np.float32),
                                       v_pool[blocks, ts % BLOCK].astype(np.float32)))


def reference_keqv(q, base_pool, table, ring: int, seq_len, window: int, wk,
                   inv_freq) -> np.ndarray:
    rope = ops.RopeAttrs(tuple(float(f) for f in np.asarray(inv_freq, np.float32)))

    def rows(blocks, ts):
        base = base_pool[blocks, ts % BLOCK].astype(np.float32)  # [n, KH, D]
        k = ops.ref_rope(rope, (base * np.asarray(wk, np.float32))[None], ts[None])[0]
        return k, base

    return _attend(q, base_pool, table, ring, seq_len, window, rows)


def _attend(q, pool, table, ring: int, seq_len, window: int, rows) -> np.ndarray:
    q = np.asarray(q).astype(np.float32)
    b_count, nh, d = q.shape
    kh = pool.shape[2]
    g = nh // kh
    out = np.zeros((b_count, nh, d), np.float32)
    for b in range(b_count):
        ts = visible_tokens(int(seq_len[b]), window)
        k, v = rows(table[b, (ts // BLOCK) % ring], ts)
        for h in range(nh):
            s = k[:, h // g] @ q[b, h]
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v[:, h // g]
    return out


# ---------------------------------------------------------------- entries

def pool(c: Call, name: str, table: np.ndarray, kv_heads: int, d: int) -> np.ndarray | None:
    """Pool `name` of a launch as the kernel reads it: the blocks up to the highest id in the
    table (the pool's size is no argument)."""
    return c.array(name, (int(np.max(table)) + 1, BLOCK, kv_heads, d))


def write_partials(c: Call, out: np.ndarray, splits: int) -> None:
    """`out` [B, nh, D] as split 0 (m = 0, l = 1), the other splits empty: the combine (exactly
    the kernel's merge) turns that into `out` again."""
    m, nh, d = out.shape
    acc = c.array("part_acc", (m, nh, splits, d))
    ml = c.array("part_ml", (m, nh, splits, 2))
    acc[:] = 0
    acc[:, :, 0] = out
    ml[:, :, :, 0] = -np.inf
    ml[:, :, :, 1] = 0
    ml[:, :, 0] = (0.0, 1.0)


def split_reference(d: int, g: int, c: Call) -> None:
    """A split launch (this file's kernel or attn_prefill.cu's tensor-core decode entries): the
    sequences' attention as split 0 of part_acc / part_ml, or (one split, out given) into out and
    its bf16 copy, as the combine would write it."""
    splits, _, m = c.grid
    kh = c["kv_heads"]
    table = np.asarray(c.array("table", (m, c["max_blocks"])))
    q = c.array("q", (m, kh * g, d))
    seq_len, window = c.array("seq_len", (m,)), c["window"]
    if "base" in c:  # K=V
        out = reference_keqv(q, pool(c, "base", table, kh, d), table, c["ring"], seq_len, window,
                             c.array("wk", (d,)), c.array("inv_freq", (d // 2,)))
    else:
        out = reference(q, pool(c, "kc", table, kh, d), pool(c, "vc", table, kh, d), table,
                        c["ring"], seq_len, window)
    final = c.array("out", out.shape)
    if final is None:
        write_partials(c, out, splits)
        return
    final[:] = out
    out_bf16 = c.array("out_bf16", out.shape)
    if out_bf16 is not None:
        out_bf16[:] = out.astype(out_bf16.dtype)


def keqv_mma_reference(g: int, c: Call) -> None:
    """`entry_keqv_mma`'s launch: the K=V split reference, for frequencies the kernel takes."""
    inv_freq = c.array("inv_freq", (256,))
    if np.any(inv_freq[512 // 8:]):
        raise ValueError("attn_decode_keqv_mma: inv_freq is nonzero beyond pair 64 (the kernel "
                         "rotates only the first head_dim / 8 pairs)")
    split_reference(512, g, c)


def _combine_call(c: Call) -> None:
    bh, splits, d = c.grid[0], c["splits"], c["d"]
    acc = c.array("part_acc", (bh, splits, d))
    ml = c.array("part_ml", (bh, splits, 2))
    top = ml[:, :, 0].max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        wgt = np.where(ml[:, :, 0] == -np.inf, 0, np.exp(ml[:, :, 0] - top)).astype(np.float32)
    res = (acc * wgt[:, :, None]).sum(axis=1) / (ml[:, :, 1] * wgt).sum(axis=1)[:, None]
    c.array("out", (bh, d))[:] = res
    out_bf16 = c.array("out_bf16", (bh, d))
    if out_bf16 is not None:
        out_bf16[:] = res.astype(out_bf16.dtype)


def split_params(kv_dtype: str, keqv: bool) -> tuple:
    """The split kernel's parameters, which attn_prefill.cu's tensor-core decode entries share."""
    q = ptr("q", "float32" if kv_dtype == "float32" else "bfloat16")
    table = (ptr("table", "int32"), i32("max_blocks"), i32("ring"), ptr("seq_len", "int32"),
             i32("window"), i32("kv_heads"))
    parts = (ptr("part_acc", "float32", "out", nullable=True),
             ptr("part_ml", "float32", "out", nullable=True),
             ptr("out", "float32", "out", nullable=True),
             ptr("out_bf16", "bfloat16", "out", nullable=True))
    if keqv:
        return (q, ptr("base", kv_dtype), *table, ptr("wk", "float32"),
                ptr("inv_freq", "float32"), *parts)
    return (q, ptr("kc", kv_dtype), ptr("vc", kv_dtype), *table, *parts)


def _entries():
    for d in HEAD_DIMS:
        for g in GROUPS:
            for kv in KV_DTYPES:
                yield Entry(entry(d, g, kv), SOURCE, split_params(kv, False),
                            partial(split_reference, d, g))
                yield Entry(entry_keqv(d, g, kv), SOURCE, split_params(kv, True),
                            partial(split_reference, d, g))
    for g in KEQV_MMA_GROUPS:
        for kv in KV_DTYPES[:2]:
            yield Entry(entry_keqv_mma(512, g, kv), SOURCE, split_params(kv, True),
                        partial(keqv_mma_reference, g))
    yield Entry(COMBINE_ENTRY, SOURCE,
                (ptr("part_acc", "float32"), ptr("part_ml", "float32"), i32("splits"), i32("d"),
                 ptr("out", "float32", "out"), ptr("out_bf16", "bfloat16", "out", nullable=True)),
                _combine_call)


ENTRIES = tuple(_entries())
