"""The IR's operations: one enum, one frozen attrs dataclass per op that needs attrs, a shape/dtype
rule and exactly ONE numpy reference per op. Every target must compute what these compute.

Shapes may hold symbolic dims ("B" slots, "T" tokens per step); all other dims are ints.
Values are float32 unless a dtype says otherwise; weights may be float32, bfloat16 or int8.
A `bfloat16` LINEAR weight means: round the activation to bf16, multiply, accumulate in float32.
A KV cache is float32, bfloat16, float8_e4m3fn or int8. An "int8" cache holds each row (one token,
one KV head) as int8 values times a float32 scale (`Int8Cache`): KV_WRITE rounds every row it
stores (`quantize_kv_rows`) and every reader sees the dequantised values. A float8_e4m3fn cache
(passes/kv_fp8) has no scale: KV_WRITE rounds each value to the nearest e4m3, saturating at
+-FP8_MAX, as the H100 kernels store them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

Dim = int | str
Shape = tuple[Dim, ...]

FLOAT_DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPES = ("float32", "bfloat16", "int8", "float8_e4m3fn")
QUANTIZED_DTYPES = ("int8", "float8_e4m3fn")  # stored with a float32 scale per output row


class Op(enum.Enum):
    ARG = "arg"  # a graph input, bound by name at call time
    PARAM = "param"  # a weight, by name (relative to the layer inside layer graphs)
    EMBED = "embed"  # table rows gathered by integer ids, times a constant (int8: times row scale)
    LINEAR = "linear"  # x @ W^T over the last axis (int8 W: times per-output-row scale)
    RMSNORM = "rmsnorm"  # x * (mean(x^2) + eps)^-1/2, times a weight when given one
    ADD = "add"  # elementwise, numpy broadcasting over a shape suffix
    MUL = "mul"  # elementwise, numpy broadcasting over a shape suffix
    SCALE = "scale"  # x * constant
    GELU_TANH = "gelu_tanh"  # GELU, tanh approximation
    SOFTCAP = "softcap"  # cap * tanh(x / cap)
    RESHAPE = "reshape"  # same elements, new shape (symbolic dims kept in place)
    ROPE = "rope"  # rotary embedding, half-split layout, at given absolute positions
    KV_WRITE = "kv_write"  # cache with new rows stored at their positions' slots (int8: rounded)
    CACHE_POSITIONS = "cache_positions"  # absolute position held by each cache slot, -1 if empty
    ATTENTION = "attention"  # softmax(q.k * scale) v, GQA, causal + window; int8 k/v dequantised
    MOE = "moe"  # router softmax -> top-k -> renormalise -> per-expert scale -> expert MLPs
    SAMPLE = "sample"  # next token per slot: greedy, temperature, top-k, top-p, seeded
    RESIDUAL_RMSNORM = "residual_rmsnorm"  # h + rmsnorm(x) * w, times a [1] scalar when given one
    GATED_LINEAR = "gated_linear"  # gelu_tanh(x @ Wg^T) * (x @ Wu^T), each a LINEAR (int8: scaled)
    MULTI_LINEAR = "multi_linear"  # LINEARs of one input, outputs concatenated on the last axis
    SLICE_LAST = "slice_last"  # x[..., start:stop]
    CONCAT = "concat"  # x and y joined on the last axis (the assistant's [embedding, hidden])
    CENTROID_HEAD = "centroid_head"  # logits of the top-k token clusters' tokens, others min - 1
    # Blocks the fusion passes make of what the H100 target runs as one unit (passes/fuse_*):
    KV_STORE = "kv_store"  # K or V columns of a projection as heads, RMSNORM (x w) [ROPE], KV_WRITE
    ATTENTION_BLOCK = "attention_block"  # q from a projection (norm, RoPE), ATTENTION over caches
    MOE_BLOCK = "moe_block"  # router chain, MOE, both MLP branches post-normed and summed
    PLE_EMBED = "ple_embed"  # per-layer inputs [B,T,L,P]: model projection + per-layer table
    PLE_PROJECTION = "ple_projection"  # LINEAR(GELU_TANH(gate) * ple, W): a layer's PLE branch
    NEXT_NORM = "next_norm"  # RMSNORM(h, w) of a RESIDUAL_RMSNORM's h, by the residual's kernel


@dataclass(frozen=True)
class ArgAttrs:
    name: str


@dataclass(frozen=True)
class ParamAttrs:
    name: str


@dataclass(frozen=True)
class EmbedAttrs:
    multiplier: float


@dataclass(frozen=True)
class LinearAttrs:
    role: str = "dense"  # "router" weights stay unquantized: top-k picks are sensitive to them


@dataclass(frozen=True)
class RMSNormAttrs:
    eps: float


@dataclass(frozen=True)
class ScaleAttrs:
    value: float


@dataclass(frozen=True)
class SoftcapAttrs:
    cap: float


@dataclass(frozen=True)
class ReshapeAttrs:
    shape: Shape


@dataclass(frozen=True)
class RopeAttrs:
    inv_freq: tuple[float, ...]  # head_dim // 2 frequencies; zeros leave their dim pair unrotated


@dataclass(frozen=True)
class KVWriteAttrs:
    ring: bool  # slot = position % size (sliding window ring buffer), else slot = position


@dataclass(frozen=True)
class CachePositionsAttrs:
    size: int
    ring: bool


@dataclass(frozen=True)
class AttentionAttrs:
    window: int | None  # keys visible: q - window < k <= q; None: k <= q
    scale: float = 1.0


@dataclass(frozen=True)
class MoEAttrs:
    top_k: int
    quantized: bool = False  # expert weights int8 with per-row scales as two extra inputs


@dataclass(frozen=True)
class MultiLinearAttrs:
    count: int  # weights (2 or 3); inputs are x, the weights, then one scale each if int8


@dataclass(frozen=True)
class SliceLastAttrs:
    start: int
    stop: int


@dataclass(frozen=True)
class CentroidHeadAttrs:
    top_k: int  # clusters whose tokens are scored, by the centroid logits
    clusters: int  # C: token_ordering is read as [C, V / C], cluster c's tokens in row c


@dataclass(frozen=True)
class KVStoreAttrs:
    start: int  # the rows' first column in the projection's last axis
    heads: int  # KV heads
    head_dim: int
    eps: float
    rope: RopeAttrs | None  # K of a layer without K=V; None: V, or a K=V layer's shared base
    ring: bool  # as KVWriteAttrs


@dataclass(frozen=True)
class AttentionBlockAttrs:
    heads: int  # query heads: q is the projection's first heads * head_dim columns
    head_dim: int
    eps: float  # q's RMSNORM
    rope: RopeAttrs  # q's, and a K=V layer's K derived from the cache
    window: int | None  # as AttentionAttrs
    scale: float
    ring: bool  # the caches' slots hold positions as CachePositionsAttrs(ring) says
    k_eq_v: bool  # inputs end (cache_kv, k_norm) instead of (cache_k, cache_v)


@dataclass(frozen=True)
class MoEBlockAttrs:
    top_k: int
    eps: float  # every norm of the block
    router_scale: float  # the SCALE between the router input's norm and its projection
    quantized: bool = False  # expert weights with per-row scales as two extra inputs


@dataclass(frozen=True)
class PleEmbedAttrs:
    layers: int  # L
    dim: int  # P
    ctx_scale: float  # the SCALE after the model projection
    table_scale: float  # the per-layer table's EMBED multiplier
    out_scale: float  # the SCALE of the sum
    eps: float


Attrs = (ArgAttrs | ParamAttrs | EmbedAttrs | LinearAttrs | RMSNormAttrs | ScaleAttrs
         | SoftcapAttrs | ReshapeAttrs | RopeAttrs | KVWriteAttrs | CachePositionsAttrs
         | AttentionAttrs | MoEAttrs | MultiLinearAttrs | SliceLastAttrs | CentroidHeadAttrs
         | KVStoreAttrs
         | AttentionBlockAttrs | MoEBlockAttrs | PleEmbedAttrs | None)


class SpecError(ValueError):
    """An IR node whose inputs, shapes, dtypes or attrs break its op's rules."""


# ---------------------------------------------------------------- numerics shared by references

def to_bf16(x: np.ndarray) -> np.ndarray:
    """Round to bfloat16 and back to float32 (round-to-nearest-even, like XLA's convert)."""
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def as_compute(w: np.ndarray) -> np.ndarray:
    return np.asarray(w).astype(np.float32)


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    c = np.float32(np.sqrt(2.0 / np.pi))
    return np.float32(0.5) * x * (np.float32(1.0) + np.tanh(c * (x + np.float32(0.044715) * x**3)))


def mix32(x: np.ndarray) -> np.ndarray:
    """A 32-bit integer hash (lowbias32); identical in every target so seeded sampling agrees."""
    x = np.asarray(x, np.uint32)
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def sampling_uniform(seed: np.ndarray, step: np.ndarray, stream: int = 0) -> np.ndarray:
    """Uniform in [0, 1) from (seed, step), 24 bits. Stream 0 is the sampler's; another stream
    hashes it again with its id (the speculative rejection rule's draws,
    targets/xla/rejection.py)."""
    with np.errstate(over="ignore"):
        h = mix32(mix32(np.asarray(seed).astype(np.uint32)) ^ np.asarray(step).astype(np.uint32))
        if stream:
            h = mix32(h ^ np.uint32(stream))
    return (h >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)


FP8_MAX = 448.0  # e4m3's largest finite value
KV_INT8_MAX = 127  # symmetric int8: values in [-127, 127], scale = amax / 127


def quantize_kv_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows [..., D] as (int8 [..., D], float32 scale [...]): scale = amax * float32(1/127)
    (a product: compilers turn a division by a constant into one), values rint(x / scale)
    (half to even), an all-zero row scale 0. The XLA lowering does the same."""
    x = np.asarray(x, np.float32)
    scale = (np.max(np.abs(x), axis=-1) * np.float32(1 / KV_INT8_MAX)).astype(np.float32)
    safe = np.where(scale > 0, scale, np.float32(1))[..., None]
    q = np.clip(np.rint(x / safe), -KV_INT8_MAX, KV_INT8_MAX)
    return q.astype(np.int8), scale


@dataclass(frozen=True, eq=False)
class Int8Cache:
    """The value of an "int8" KV cache: values [B, S, K, D] and a scale per slot and KV head
    [B, S, K]. `np.asarray` gives the dequantised float32 cache, which is what readers see."""

    values: np.ndarray  # int8 [B, S, K, D]
    scales: np.ndarray  # float32 [B, S, K]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def dtype(self) -> np.dtype:
        return self.values.dtype

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self.values.astype(np.float32) * self.scales[..., None]
        return out if dtype is None else out.astype(dtype)


def empty_cache(dtype: str, shape: tuple[int, ...]) -> np.ndarray | Int8Cache:
    """A zeroed cache value of IR cache dtype `dtype` and shape [B, S, K, D]."""
    if dtype == "int8":
        return Int8Cache(np.zeros(shape, np.int8), np.zeros(shape[:-1], np.float32))
    if dtype == "float8_e4m3fn":
        return np.zeros(shape, ml_dtypes.float8_e4m3fn)
    return np.zeros(shape, ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32)


def cache_slot_positions(cache_len: np.ndarray, size: int, ring: bool) -> np.ndarray:
    s = np.arange(size, dtype=np.int64)[None, :]
    length = np.asarray(cache_len, np.int64)[:, None]
    if not ring:
        return np.where(s < length, s, -1).astype(np.int32)
    last = length - 1 - s
    pos = s + size * np.floor_divide(np.maximum(last, 0), size)
    return np.where(last >= 0, pos, -1).astype(np.int32)


# ---------------------------------------------------------------- references

def ref_embed(a: EmbedAttrs, table, ids, row_scale=None):
    rows = as_compute(table[np.asarray(ids)])
    if row_scale is not None:
        rows = rows * as_compute(row_scale)[np.asarray(ids)][..., None]
    return (rows * np.float32(a.multiplier)).astype(np.float32)


def ref_linear(a: LinearAttrs, x, w, scale=None):
    x = np.asarray(x, np.float32)
    if w.dtype != np.float32:
        x = to_bf16(x)
    y = np.matmul(x, as_compute(w).T, dtype=np.float32)
    if scale is not None:
        y = y * as_compute(scale)
    return y.astype(np.float32)


def ref_rmsnorm(a: RMSNormAttrs, x, w=None):
    x = np.asarray(x, np.float32)
    y = x * np.power(np.mean(x * x, axis=-1, keepdims=True) + np.float32(a.eps), np.float32(-0.5))
    if w is not None:
        y = y * as_compute(w)
    return y.astype(np.float32)


def ref_scale(a: ScaleAttrs, x):
    return (x * np.float32(a.value)).astype(np.float32)


def ref_add(a, x, y):
    return (x + as_compute(y)).astype(np.float32)


def ref_mul(a, x, y):
    return (as_compute(x) * as_compute(y)).astype(np.float32)  # x may be a KV cache


def ref_residual_rmsnorm(a: RMSNormAttrs, h, x, w, s=None):
    """ADD(h, RMSNORM(x, w)), then MUL(., s): the same float32 steps, so the same bits."""
    y = ref_add(None, h, ref_rmsnorm(a, x, w))
    return y if s is None else ref_mul(None, y, s)


def ref_gated_linear(a, x, wg, wu, sg=None, su=None):
    """MUL(GELU_TANH(LINEAR(x, wg[, sg])), LINEAR(x, wu[, su])), step for step."""
    gate = gelu_tanh(ref_linear(LinearAttrs(), x, wg, sg))
    return ref_mul(None, gate, ref_linear(LinearAttrs(), x, wu, su))


def _split_weights(a: MultiLinearAttrs, ws: tuple) -> list[tuple]:
    """(weight, scale or None) pairs of a MULTI_LINEAR's inputs after x."""
    weights, scales = ws[:a.count], ws[a.count:] or (None,) * a.count
    return list(zip(weights, scales, strict=True))


def ref_multi_linear(a: MultiLinearAttrs, x, *ws):
    """Each LINEAR(x, w[, scale]) on its own, concatenated: the same bits as separate LINEARs."""
    ys = [ref_linear(LinearAttrs(), x, w, s) for w, s in _split_weights(a, ws)]
    return np.concatenate(ys, axis=-1)


def ref_slice_last(a: SliceLastAttrs, x):
    return np.ascontiguousarray(x[..., a.start:a.stop])


def ref_rope(a: RopeAttrs, x, pos):
    inv = np.asarray(a.inv_freq, np.float32)
    ang = np.asarray(pos, np.float32)[..., None] * inv  # [B, T, d/2]
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[..., None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[..., None, :]
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return (x * cos + rot * sin).astype(np.float32)


def ref_kv_write(a: KVWriteAttrs, cache, new, pos):
    if isinstance(cache, Int8Cache):
        q, scale = quantize_kv_rows(new)
        scales = ref_kv_write(a, cache.scales[..., None], scale[..., None], pos)[..., 0]
        return Int8Cache(ref_kv_write(a, cache.values, q, pos), scales)
    out = np.array(cache, copy=True)
    if out.dtype == ml_dtypes.float8_e4m3fn:  # saturate: a plain cast makes NaN beyond 448
        new = np.clip(np.asarray(new, np.float32), -FP8_MAX, FP8_MAX)
    size = cache.shape[1]
    for b in range(new.shape[0]):
        for t in range(new.shape[1]):
            p = int(pos[b, t])
            if p >= 0:
                out[b, p % size if a.ring else p] = new[b, t]
    return out


def ref_cache_positions(a: CachePositionsAttrs, cache_len):
    return cache_slot_positions(cache_len, a.size, a.ring)


def ref_attention(a: AttentionAttrs, q, k, v, q_pos, k_pos):
    q = np.asarray(q, np.float32)
    k, v = as_compute(k), as_compute(v)
    b, t, nh, d = q.shape
    kh = k.shape[2]
    group = nh // kh
    qg = q.reshape(b, t, kh, group, d)
    scores = np.einsum("btkgd,bskd->bkgts", qg, k, dtype=np.float32) * np.float32(a.scale)
    qp = np.asarray(q_pos)[:, None, None, :, None]
    kp = np.asarray(k_pos)[:, None, None, None, :]
    mask = (kp >= 0) & (kp <= qp) & (qp >= 0)
    if a.window is not None:
        mask &= kp > qp - a.window
    scores = np.where(mask, scores, -np.inf)
    m = np.max(scores, axis=-1, keepdims=True)
    e = np.where(mask, np.exp(scores - np.where(np.isfinite(m), m, 0)), 0).astype(np.float32)
    denom = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(denom > 0, denom, 1)
    out = np.einsum("bkgts,bskd->btkgd", p, v, dtype=np.float32)
    return out.reshape(b, t, nh, d).astype(np.float32)


def ref_moe(a: MoEAttrs, x, router_logits, per_expert_scale, gate_up, down,
            gate_up_scale=None, down_scale=None):
    lead = x.shape[:-1]
    xf = np.asarray(x, np.float32).reshape(-1, x.shape[-1])
    logits = np.asarray(router_logits, np.float32).reshape(xf.shape[0], -1)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    idx = np.argsort(-probs, axis=-1, kind="stable")[:, : a.top_k]
    w = np.take_along_axis(probs, idx, -1)
    w = w / w.sum(-1, keepdims=True) * as_compute(per_expert_scale)[idx]
    im = down.shape[-1]
    out = np.zeros_like(xf)
    xin = to_bf16(xf) if gate_up.dtype != np.float32 else xf
    for n in range(xf.shape[0]):
        for j in range(a.top_k):
            e = idx[n, j]
            gu = as_compute(gate_up[e]) @ xin[n]
            if gate_up_scale is not None:
                gu = gu * as_compute(gate_up_scale[e])
            hidden = gelu_tanh(gu[:im]) * gu[im:]
            if down.dtype != np.float32:
                hidden = to_bf16(hidden)
            y = as_compute(down[e]) @ hidden
            if down_scale is not None:
                y = y * as_compute(down_scale[e])
            out[n] += w[n, j] * y
    return out.reshape(*lead, -1).astype(np.float32)

def ref_concat(a, x, y):
    return np.concatenate([np.asarray(x, np.float32), np.asarray(y, np.float32)], axis=-1)


def centroid_tokens(a: CentroidHeadAttrs, centroid_logits, token_ordering):
    """Token ids [..., top_k * V/C] that CENTROID_HEAD scores: the rows of token_ordering [C, V/C]
    of the top_k clusters by centroid logit (ties: the lower cluster first), best first."""
    cl = np.asarray(centroid_logits, np.float32)
    top = np.argsort(-cl, axis=-1, kind="stable")[..., :a.top_k]
    rows = np.asarray(token_ordering).reshape(a.clusters, -1)[top]  # [..., top_k, V/C]
    return rows.reshape(*cl.shape[:-1], -1)


def ref_centroid_head(a: CentroidHeadAttrs, h, centroid_logits, token_ordering, table):
    """h [..., D] . table rows of the centroid tokens (a bf16 table: h rounded to bf16 first, as
    LINEAR), scattered into [..., V]; every other token gets the row's smallest scored logit
    minus 1 (transformers' Gemma4AssistantMaskedEmbedder takes that minimum over the whole batch;
    per row keeps rows independent and is the same at one row)."""
    h = np.asarray(h, np.float32)
    if table.dtype != np.float32:
        h = to_bf16(h)
    ids = centroid_tokens(a, centroid_logits, token_ordering)
    rows = as_compute(table)[ids]  # [..., N, D]
    sel = np.einsum("...d,...nd->...n", h, rows, dtype=np.float32)
    out = np.repeat((sel.min(-1, keepdims=True) - np.float32(1)), table.shape[0], axis=-1)
    np.put_along_axis(out, ids, sel, axis=-1)
    return out.astype(np.float32)

# The fused blocks: each reference is the unfused ops' references called in the same order on the
# same arrays, so a fused graph computes the same bits as the graph it replaced.

def _heads(x, start: int, heads: int, head_dim: int):
    """SLICE_LAST of a projection's columns [start, start + heads * head_dim), then RESHAPE to
    [..., heads, head_dim]."""
    cols = ref_slice_last(SliceLastAttrs(start, start + heads * head_dim), x)
    return cols.reshape(*cols.shape[:-1], heads, head_dim)


def ref_kv_store(a: KVStoreAttrs, cache, qkv, pos, w=None):
    """KV_WRITE(cache, [ROPE](RMSNORM(heads of qkv[, w])), pos)."""
    x = ref_rmsnorm(RMSNormAttrs(a.eps), _heads(qkv, a.start, a.heads, a.head_dim), w)
    if a.rope is not None:
        x = ref_rope(a.rope, x, pos)
    return ref_kv_write(KVWriteAttrs(a.ring), cache, x, pos)


def ref_attention_block(a: AttentionBlockAttrs, qkv, pos, cache_len, q_norm, cache, last):
    """ATTENTION(ROPE(RMSNORM(q heads, q_norm)), K, V, pos, CACHE_POSITIONS(cache_len)): K, V
    the caches (cache_k, cache_v = cache, last), or for K=V K = ROPE(MUL(cache_kv, k_norm),
    slot positions) and V = cache_kv (cache_kv, k_norm = cache, last)."""
    q = _heads(qkv, 0, a.heads, a.head_dim)
    q = ref_rope(a.rope, ref_rmsnorm(RMSNormAttrs(a.eps), q, q_norm), pos)
    k_pos = ref_cache_positions(CachePositionsAttrs(cache.shape[1], a.ring), cache_len)
    if a.k_eq_v:
        k, v = ref_rope(a.rope, ref_mul(None, cache, last), k_pos), cache
    else:
        k, v = cache, last
    return ref_attention(AttentionAttrs(a.window, a.scale), q, k, v, pos, k_pos)


def ref_moe_block(a: MoEBlockAttrs, r, f, router_scale, router, expert_norm, per_expert_scale,
                  gate_up, down, post_norm_1, post_norm_2, gate_up_scale=None, down_scale=None):
    """RESIDUAL_RMSNORM(RMSNORM(f, post_norm_1), MOE(RMSNORM(r, expert_norm), router logits,
    ...), post_norm_2), the router logits LINEAR(SCALE(MUL(RMSNORM(r), router_scale)), router):
    the dense branch f and the expert branch, each post-normed, summed."""
    eps = RMSNormAttrs(a.eps)
    z = ref_mul(None, ref_rmsnorm(eps, r), router_scale)
    logits = ref_linear(LinearAttrs("router"), ref_scale(ScaleAttrs(a.router_scale), z), router)
    y = ref_moe(MoEAttrs(a.top_k, a.quantized), ref_rmsnorm(eps, r, expert_norm), logits,
                per_expert_scale, gate_up, down, gate_up_scale, down_scale)
    return ref_residual_rmsnorm(eps, ref_rmsnorm(eps, f, post_norm_1), y, post_norm_2)


def ref_ple_embed(a: PleEmbedAttrs, ctx, table, ids, norm):
    """SCALE(ADD(RMSNORM(RESHAPE(SCALE(ctx)), norm), RESHAPE(EMBED(table, ids)))): ctx is the
    model projection of h [..., L * P], the result [..., L, P]."""
    lead = ctx.shape[:-1]
    c = ref_scale(ScaleAttrs(a.ctx_scale), ctx).reshape(*lead, a.layers, a.dim)
    c = ref_rmsnorm(RMSNormAttrs(a.eps), c, norm)
    t = ref_embed(EmbedAttrs(a.table_scale), table, ids).reshape(*lead, a.layers, a.dim)
    return ref_scale(ScaleAttrs(a.out_scale), ref_add(None, c, t))


def ref_ple_projection(a, gate, ple, w, scale=None):
    """LINEAR(MUL(GELU_TANH(gate), ple), w[, scale])."""
    return ref_linear(LinearAttrs(), ref_mul(None, gelu_tanh(gate), ple), w, scale)


def sample_sorted(logits, temperature, top_k, top_p, uniform):
    """One row: the shared sampling rule every target implements."""
    order = np.argsort(-logits, kind="stable")
    sv = logits[order] / np.float32(temperature)
    ranks = np.arange(sv.shape[0])
    keep = ranks < top_k if top_k > 0 else np.ones_like(ranks, bool)
    sv = np.where(keep, sv, -np.inf)
    probs = np.exp(sv - sv[0])
    probs = probs / probs.sum()
    before = np.cumsum(probs) - probs
    keep &= before < np.float32(top_p)
    probs = np.where(keep, probs, 0).astype(np.float32)
    cum = np.cumsum(probs)
    i = int(np.sum(cum <= uniform * cum[-1]))
    return int(order[min(i, int(keep.sum()) - 1)])


def ref_penalize(logits, pen_ids, pen_counts, presence, frequency, repetition):
    """Rows [B, V] with each row's penalties (the sampler's extras, targets/xla/sampler.py):
    for each listed id (-1: none), HF's repetition penalty (divide a positive logit, multiply a
    negative one), then OpenAI's frequency * count + presence * (count > 0) subtracted."""
    out = np.array(logits, np.float32)
    for b in range(out.shape[0]):
        for t, c in zip(pen_ids[b], pen_counts[b], strict=True):
            if t < 0:
                continue
            x = out[b, t]
            x = x / np.float32(repetition[b]) if x > 0 else x * np.float32(repetition[b])
            out[b, t] = x - np.float32(frequency[b]) * np.float32(c) - np.float32(
                presence[b]) * np.float32(c > 0)
    return out


def ref_token_mask(logits, mask):
    """Rows [B, V] with tokens whose bit in mask [B, ceil(V / 32)] int32 is 0 set to -inf."""
    bits = np.unpackbits(np.asarray(mask, "<i4").view(np.uint8), axis=-1, bitorder="little")
    return np.where(bits[:, :logits.shape[-1]] != 0, logits, -np.inf).astype(np.float32)


def ref_sample(a, logits, temperature, top_k, top_p, seed, step):
    u = sampling_uniform(seed, step)
    out = np.zeros(logits.shape[0], np.int32)
    for b in range(logits.shape[0]):
        row = np.asarray(logits[b], np.float32)
        if temperature[b] <= 0:
            out[b] = int(np.argmax(row))
        else:
            out[b] = sample_sorted(row, temperature[b], int(top_k[b]), float(top_p[b]), u[b])
    return out


# ---------------------------------------------------------------- shape and dtype rules

def broadcast(a: Shape, b: Shape) -> Shape:
    long, short = (a, b) if len(a) >= len(b) else (b, a)
    for x, y in zip(long[len(long) - len(short):], short, strict=True):
        if x != y and y != 1:
            raise SpecError(f"shapes {a} and {b} do not broadcast")
    return long


def _float(dtype: str, what: str) -> None:
    if dtype not in FLOAT_DTYPES:
        raise SpecError(f"{what} must be a float, got {dtype}")


def infer_embed(a: EmbedAttrs, table, ids, row_scale=None):
    if ids[1] != "int32":
        raise SpecError("embed ids must be int32")
    if (table[1] in QUANTIZED_DTYPES) != (row_scale is not None):
        raise SpecError("a quantized embed table needs a row scale, and only it has one")
    return (*ids[0], table[0][1]), "float32"


def infer_linear(a: LinearAttrs, x, w, scale=None):
    _float(x[1], "linear input")
    if w[1] not in WEIGHT_DTYPES:
        raise SpecError(f"linear: weight dtype {w[1]} is not one of {WEIGHT_DTYPES}")
    if len(w[0]) != 2 or x[0][-1] != w[0][1]:
        raise SpecError(f"linear: input {x[0]} does not match weight {w[0]}")
    if (w[1] in QUANTIZED_DTYPES) != (scale is not None):
        raise SpecError("linear: a quantized weight needs a scale, and only it has one")
    if scale is not None and scale[0] != (w[0][0],):
        raise SpecError(f"linear: scale {scale[0]} for weight {w[0]}")
    return (*x[0][:-1], w[0][0]), "float32"


def infer_rmsnorm(a: RMSNormAttrs, x, w=None):
    _float(x[1], "rmsnorm input")
    if w is not None and w[0] != (x[0][-1],):
        raise SpecError(f"rmsnorm weight {w[0]} for input {x[0]}")
    return x[0], "float32"


def infer_residual_rmsnorm(a: RMSNormAttrs, h, x, w, s=None):
    _float(h[1], "residual")
    infer_rmsnorm(a, x, w)
    if h[0] != x[0]:
        raise SpecError(f"residual_rmsnorm: residual {h[0]} for input {x[0]}")
    if s is not None and (s[0] != (1,) or s[1] not in FLOAT_DTYPES):
        raise SpecError(f"residual_rmsnorm: scalar {s[0]} {s[1]}")
    return x[0], "float32"


def infer_gated_linear(a, x, wg, wu, *scales):
    if len(scales) not in (0, 2):
        raise SpecError("gated_linear: either no scales or one for each weight")
    sg, su = scales or (None, None)
    gate, _ = infer_linear(LinearAttrs(), x, wg, sg)
    up, _ = infer_linear(LinearAttrs(), x, wu, su)
    if gate != up:
        raise SpecError(f"gated_linear: gate {wg[0]} and up {wu[0]} differ")
    return gate, "float32"


def infer_multi_linear(a: MultiLinearAttrs, x, *ws):
    if a.count not in (2, 3) or len(ws) not in (a.count, 2 * a.count):
        raise SpecError(f"multi_linear: {a.count} weights and {len(ws)} weight/scale inputs")
    width = 0
    for w, s in _split_weights(a, ws):
        width += infer_linear(LinearAttrs(), x, w, s)[0][-1]
    return (*x[0][:-1], width), "float32"


def infer_slice_last(a: SliceLastAttrs, x):
    last = x[0][-1] if x[0] else None
    if not isinstance(last, int) or not 0 <= a.start < a.stop <= last:
        raise SpecError(f"slice_last [{a.start}:{a.stop}] of {x[0]}")
    return (*x[0][:-1], a.stop - a.start), x[1]


def infer_concat(a, x, y):
    _float(x[1], "concat input")
    _float(y[1], "concat input")
    if x[0][:-1] != y[0][:-1] or not all(isinstance(s[0][-1], int) for s in (x, y)):
        raise SpecError(f"concat: {x[0]} and {y[0]} differ before the last axis")
    return (*x[0][:-1], x[0][-1] + y[0][-1]), "float32"


def infer_centroid_head(a: CentroidHeadAttrs, h, centroid_logits, token_ordering, table):
    _float(h[1], "centroid_head input")
    if table[1] not in FLOAT_DTYPES or len(table[0]) != 2 or table[0][1] != h[0][-1]:
        raise SpecError(f"centroid_head: table {table[0]} {table[1]} for input {h[0]}")
    vocab = table[0][0]
    if token_ordering[0] != (vocab,) or token_ordering[1] != "int32":
        raise SpecError(f"centroid_head: token_ordering {token_ordering[0]} "
                        f"{token_ordering[1]} for a {vocab}-row table")
    if centroid_logits[0] != (*h[0][:-1], a.clusters) or vocab % a.clusters:
        raise SpecError(f"centroid_head: centroid logits {centroid_logits[0]} for {a.clusters} "
                        f"clusters of {vocab} tokens, input {h[0]}")
    if not 1 <= a.top_k <= a.clusters:
        raise SpecError(f"centroid_head: top_k {a.top_k} of {a.clusters} clusters")
    return (*h[0][:-1], vocab), "float32"


def infer_elementwise(a, x, y):
    return broadcast(x[0], y[0]), "float32"


def infer_unary(a, x):
    _float(x[1], "input")
    return x[0], "float32"


def _numel(shape: Shape) -> tuple[int, tuple[str, ...]]:
    n, syms = 1, []
    for d in shape:
        if isinstance(d, str):
            syms.append(d)
        else:
            n *= d
    return n, tuple(syms)


def infer_reshape(a: ReshapeAttrs, x):
    if _numel(a.shape) != _numel(x[0]):
        raise SpecError(f"reshape {x[0]} -> {a.shape} changes the element count")
    return a.shape, x[1]


def infer_rope(a: RopeAttrs, x, pos):
    if len(x[0]) != 4 or x[0][-1] != 2 * len(a.inv_freq) or pos[0] != x[0][:2]:
        raise SpecError(f"rope: x {x[0]}, positions {pos[0]}, {len(a.inv_freq)} frequencies")
    return x[0], "float32"


def infer_kv_write(a: KVWriteAttrs, cache, new, pos):
    if len(cache[0]) != 4 or cache[0][2:] != new[0][2:] or pos[0] != new[0][:2]:
        raise SpecError(f"kv_write: cache {cache[0]}, new {new[0]}, positions {pos[0]}")
    return cache[0], cache[1]


def infer_cache_positions(a: CachePositionsAttrs, cache_len):
    return (cache_len[0][0], a.size), "int32"


def infer_attention(a: AttentionAttrs, q, k, v, q_pos, k_pos):
    (b, t, nh, d), (_, s, kh, dk) = q[0], k[0]
    if d != dk or k[0] != v[0] or nh % kh or q_pos[0] != (b, t) or k_pos[0] != (b, s):
        raise SpecError(f"attention: q {q[0]} k {k[0]} v {v[0]} q_pos {q_pos[0]} k_pos {k_pos[0]}")
    return q[0], "float32"


def infer_moe(a: MoEAttrs, x, logits, pes, gate_up, down, gus=None, ds=None):
    e, two_im, h = gate_up[0]
    if down[0] != (e, h, two_im // 2) or logits[0][-1] != e or pes[0] != (e,) or x[0][-1] != h:
        raise SpecError(f"moe: x {x[0]} gate_up {gate_up[0]} down {down[0]} logits {logits[0]}")
    if a.quantized != (gus is not None and ds is not None):
        raise SpecError("moe: quantized experts need both scales")
    return x[0], "float32"


def infer_sample(a, logits, temperature, top_k, top_p, seed, step):
    return (logits[0][0],), "int32"


def infer_kv_store(a: KVStoreAttrs, cache, qkv, pos, w=None):
    _float(qkv[1], "kv_store projection")
    width = qkv[0][-1] if qkv[0] else None
    if not isinstance(width, int) or not 0 <= a.start <= width - a.heads * a.head_dim:
        raise SpecError(f"kv_store: heads [{a.start}, +{a.heads}x{a.head_dim}) of {qkv[0]}")
    new = ((*qkv[0][:-1], a.heads, a.head_dim), "float32")
    if a.rope is not None:
        infer_rope(a.rope, new, pos)
    if w is not None and w[0] != (a.head_dim,):
        raise SpecError(f"kv_store: norm weight {w[0]} for head dim {a.head_dim}")
    return infer_kv_write(KVWriteAttrs(a.ring), cache, new, pos)


def infer_attention_block(a: AttentionBlockAttrs, qkv, pos, cache_len, q_norm, cache, last):
    _float(qkv[1], "attention_block projection")
    width = qkv[0][-1] if qkv[0] else None
    if not isinstance(width, int) or width < a.heads * a.head_dim:
        raise SpecError(f"attention_block: {a.heads}x{a.head_dim} query columns of {qkv[0]}")
    if q_norm[0] != (a.head_dim,) or pos[1] != "int32" or cache_len[1] != "int32":
        raise SpecError(f"attention_block: q norm {q_norm[0]}, positions {pos[1]}, cache_len "
                        f"{cache_len[1]}")
    q = ((*qkv[0][:-1], a.heads, a.head_dim), "float32")
    infer_rope(a.rope, q, pos)
    k_pos = infer_cache_positions(CachePositionsAttrs(cache[0][1], a.ring), cache_len)
    if a.k_eq_v and last[0] != (a.head_dim,):
        raise SpecError(f"attention_block: k norm {last[0]} for head dim {a.head_dim}")
    return infer_attention(AttentionAttrs(a.window, a.scale), q, cache,
                           cache if a.k_eq_v else last, pos, k_pos)


def infer_moe_block(a: MoEBlockAttrs, r, f, router_scale, router, expert_norm, per_expert_scale,
                    gate_up, down, post_norm_1, post_norm_2, *scales):
    if r[0] != f[0]:
        raise SpecError(f"moe_block: residual {r[0]} and dense branch {f[0]}")
    for w in (router_scale, post_norm_1, post_norm_2):
        infer_rmsnorm(RMSNormAttrs(a.eps), r, w)
    infer_linear(LinearAttrs("router"), r, router)
    infer_moe(MoEAttrs(a.top_k, a.quantized), infer_rmsnorm(RMSNormAttrs(a.eps), r, expert_norm),
              ((*r[0][:-1], router[0][0]), "float32"), per_expert_scale, gate_up, down, *scales)
    return r[0], "float32"


def infer_ple_embed(a: PleEmbedAttrs, ctx, table, ids, norm):
    _float(ctx[1], "ple_embed projection")
    rows, _ = infer_embed(EmbedAttrs(a.table_scale), table, ids)
    lead = ids[0]
    if ctx[0] != (*lead, a.layers * a.dim) or rows[-1] != a.layers * a.dim:
        raise SpecError(f"ple_embed: projection {ctx[0]}, table {table[0]} for {a.layers}x{a.dim}")
    if norm[0] != (a.dim,):
        raise SpecError(f"ple_embed: norm weight {norm[0]} for P = {a.dim}")
    return (*lead, a.layers, a.dim), "float32"


def infer_ple_projection(a, gate, ple, w, scale=None):
    _float(gate[1], "ple_projection gate")
    if gate[0] != ple[0]:
        raise SpecError(f"ple_projection: gate {gate[0]} and per-layer input {ple[0]}")
    return infer_linear(LinearAttrs(), gate, w, scale)


def infer_next_norm(a: RMSNormAttrs, h, w):
    return infer_rmsnorm(a, h, w)


@dataclass(frozen=True)
class OpDef:
    infer: Callable  # (attrs, *(shape, dtype)) -> (shape, dtype); raises SpecError
    reference: Callable | None  # (attrs, *np.ndarray) -> np.ndarray; None for ARG/PARAM
    arity: tuple[int, int]  # (min, max) input count


OPS: dict[Op, OpDef] = {
    Op.ARG: OpDef(lambda a: None, None, (0, 0)),
    Op.PARAM: OpDef(lambda a: None, None, (0, 0)),
    Op.EMBED: OpDef(infer_embed, ref_embed, (2, 3)),
    Op.LINEAR: OpDef(infer_linear, ref_linear, (2, 3)),
    Op.RMSNORM: OpDef(infer_rmsnorm, ref_rmsnorm, (1, 2)),
    Op.ADD: OpDef(infer_elementwise, ref_add, (2, 2)),
    Op.MUL: OpDef(infer_elementwise, ref_mul, (2, 2)),
    Op.SCALE: OpDef(infer_unary, ref_scale, (1, 1)),
    Op.GELU_TANH: OpDef(infer_unary, lambda a, x: gelu_tanh(x), (1, 1)),
    Op.SOFTCAP: OpDef(
        infer_unary,
        lambda a, x: (np.float32(a.cap) * np.tanh(x / np.float32(a.cap))).astype(np.float32),
        (1, 1)),
    Op.RESHAPE: OpDef(infer_reshape, None, (1, 1)),  # reference needs concrete dims: interpreter
    Op.ROPE: OpDef(infer_rope, ref_rope, (2, 2)),
    Op.KV_WRITE: OpDef(infer_kv_write, ref_kv_write, (3, 3)),
    Op.CACHE_POSITIONS: OpDef(infer_cache_positions, ref_cache_positions, (1, 1)),
    Op.ATTENTION: OpDef(infer_attention, ref_attention, (5, 5)),
    Op.MOE: OpDef(infer_moe, ref_moe, (5, 7)),
    Op.SAMPLE: OpDef(infer_sample, ref_sample, (6, 6)),
    Op.RESIDUAL_RMSNORM: OpDef(infer_residual_rmsnorm, ref_residual_rmsnorm, (3, 4)),
    Op.GATED_LINEAR: OpDef(infer_gated_linear, ref_gated_linear, (3, 5)),
    Op.MULTI_LINEAR: OpDef(infer_multi_linear, ref_multi_linear, (3, 7)),
    Op.SLICE_LAST: OpDef(infer_slice_last, ref_slice_last, (1, 1)),
    Op.CONCAT: OpDef(infer_concat, ref_concat, (2, 2)),
    Op.CENTROID_HEAD: OpDef(infer_centroid_head, ref_centroid_head, (4, 4)),
    Op.KV_STORE: OpDef(infer_kv_store, ref_kv_store, (3, 4)),
    Op.ATTENTION_BLOCK: OpDef(infer_attention_block, ref_attention_block, (6, 6)),
    Op.MOE_BLOCK: OpDef(infer_moe_block, ref_moe_block, (10, 12)),
    Op.PLE_EMBED: OpDef(infer_ple_embed, ref_ple_embed, (4, 4)),
    Op.PLE_PROJECTION: OpDef(infer_ple_projection, ref_ple_projection, (3, 4)),
    Op.NEXT_NORM: OpDef(infer_next_norm, ref_rmsnorm, (2, 2)),
}
