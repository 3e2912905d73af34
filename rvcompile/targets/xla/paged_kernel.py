"""A Pallas TPU kernel for a decode step's attention over the paged KV pools: sliding rings and
full tables, a K=V layer's keys made from its cache in VMEM.

Contract. `paged_decode(q, k_pool, v_pool, layers, table, q_pos, window=, scale=, fold=)` is
what `lower.attention_blockwise` computes in a decode step (one query row a lane), within
float32 rounding (summation order): q float32 [B, K, G, D] (the G query heads of each of K KV
heads), pools [n, blocks, BLOCK_SIZE, K * D] of stacked layers (program.cache_pools, a slot's
heads side by side; bf16 or float32, read as stored, or int8 with float32 scale pools (rows [n,
blocks, 1, S], or [n, blocks, BLOCK_SIZE, K]: lower.scale_block_shape), whose products follow
the XLA lowering's: int8 values in the dots, a
key's scale on its scores, a value's on its probabilities (a folded key's too, where the XLA
lowering dequantises its rotated dims first: equal within float32 rounding); K=V layers pass
one pool as both),
`layers` int32 [2] which of their n layers K and V are, `table` int32 [B, W] each lane's
blocks, `q_pos` int32 [B] each lane's query position (-1: an idle lane, whose output is zeros,
as the XLA lowering's). `window` tokens: a sliding layer's ring (logical block j in entry j %
W; keys max(0, q_pos - window + 1) .. q_pos); None: a full layer's table (entry j holds block
j; keys 0 .. q_pos). `fold` (a K=V layer, `KeyFold`): keys are rope(cache * w), RoPE turning
the first n pairs (n <= 128: Gemma 4's full layers, 64 of 256), values the cache; else keys
and values are the pools as stored. Returns [B, K, G, Dv] in `out_dtype` (float32; bf16 where
every reader rounds it to bf16 anyway: patterns.read_as_bf16, the same bits). `qnorm`
(`QueryNorm`): q is the query's projection rows, which the kernel norms (RMSNORM with a weight)
and rotates (RoPE by halves at each lane's cos and sin) itself at a lane's first grid step,
into VMEM, as lower.rmsnorm and lower.rope would (lower.NormedQuery). A key's position is its
slot's logical position (a ring is at least window + one block wide, program.kv_kinds, so every
key a decode row sees is in its slot), so the kernel never reads CACHE_POSITIONS' array.

Why a kernel: XLA gathers each span of a lane's blocks into on-chip memory and reads it back
by per-head dots, and can fuse neither (docs/TPU_COST.md, h/tpu9): for the 31B at B = 64 that
staging is 26 GiB on chip a step in the sliding layers, 5.6 in the full ones. Here each grid
step DMAs a lane's pages from HBM into VMEM buffers (Pallas' pipeline, double-buffered) and
the dots read them there.

Grid (lane b, step i): step i reads pages i * PAGES_PER_STEP + p, p < PAGES_PER_STEP, of the
lane's keys (block table entries (lo_b + page) % W, lo_b = the window's first block, 0 for a
full layer) for every KV head of the device at once (a page is one block's rows [16, K * D],
so the K heads cost one DMA; a grid axis per head would cut each page into K DMAs of 16 x D).
Each page slot p is an operand of its own (the pool passed PAGES_PER_STEP times, for K and,
unless K=V, for V) with an index map from the scalar-prefetched table, so Pallas' pipeline
fetches 8 pages a step, 128 keys: a whole lane tile of scores, and 1/8 of the grid steps a
page a step would take. A slot whose page lies past the lane's needed blocks keeps its
previous page (the index map repeats it), so the pipeline issues no DMA for it: a lane DMAs
max(needed, PAGES_PER_STEP) pages of each pool (`kernel_slot_pages`; the traffic table,
hlo_traffic.py, counts the kernel's custom call by it, found by its named scope PALLAS_DECODE,
as XLA cannot see into it). Steps past a lane's needed pages compute nothing. The scores,
online softmax and weighted values per KV head are the XLA lowering's own operations in
float32 (dots at HIGHEST precision over the widened keys and values), the running max, sum
and values in VMEM scratch;
a folded key is the reference's rope(c * w) (lower.rope), its rotated pairs computed on the
page's first 128 columns of each half (RoPE's identity past n: cos 1, sin 0, exact).

int8 scales, where each page's are a row of a scale pool [n, blocks, 1, S] (a device's K >= 2
heads' 16 scales head-major, zeros to whole 128-lane tiles: lower.scale_block_shape): the
scale pool is paged like its int8 pool, page slots of its own with the same index maps, so
the pipeline DMAs a row (512 bytes at up to 8 heads) beside each page; a grid step lines each
head's 16 lanes of its 8 rows up into its [K, 128] block of the scores' lanes (a slot past a
lane's needed pages keeps its last row, whose keys are masked). The traffic table counts
those rows as it counts pages (the scale pools are among the scope's `pools`). A scale pool of
blocks [16, K] (one head a device, where a row would be 8 times its scales) is never the
custom call's operand: as one, tiled (8, 128) over [16, K], XLA relaid it whole into that
layout at each call and back (reverted 63e92a2, docs/TPU_COST.md); XLA gathers the scales of
the pages each lane's grid steps read, once a call, as rows [B, K, pages * 16] (`scale_rows`:
keys along lanes), and a grid step reads its [K, 128] block. That gather of whole blocks
makes XLA stage such a pool, relaid with blocks major, once a step (docs/TPU_COST.md); the
row pools need no gather.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

BLOCK_TOKENS = 16  # tokens per KV block, a page (lower.BLOCK_SIZE)
# the kernel's named scope, by which the traffic table (hlo_traffic.py) finds it: lanes, pages a
# grid step reads per pool, window tokens (0: a full layer), table width in blocks, pools read
# with page slots (K and V, or K=V: 2 or 1; and as many scale row pools, if it reads them)
PALLAS_DECODE = "rvkv_pallas_b{lanes}_p{pages}_w{window}_n{width}_k{pools}"
PALLAS_DECODE_POOLS = 6  # its first pool operand: after 5 scalar-prefetch operands and the query
PAGES_PER_STEP = 8  # pages of each pool a grid step reads: 128 keys, one lane tile of scores
LANE = 128  # a TPU tile row's lanes: the running max and sum are replicated over one, and a
# folded key's rotated pairs are computed over one tile of each half


@dataclass(frozen=True)
class KeyFold:
    """A K=V layer's keys: rope(cache * w), RoPE turning the first len(freqs) pairs."""

    w: jax.Array  # float32 [D]: k_norm's weight
    freqs: np.ndarray  # float32 [n], n <= LANE: the rotated pairs' inverse frequencies


def window_pages(window: int | None, width: int) -> int:
    """The most pages (blocks) a decode row reads from a table of `width` blocks: all of them
    for a full layer (window None or 0); a `window`-token sliding layer's first key may sit
    inside a block, so one past window / 16."""
    return min(width, -(-(window - 1) // BLOCK_TOKENS) + 1) if window else width


def needed_pages(context: int | None, window: int | None, width: int) -> int:
    """Pages a lane decoding at position `context` - 1 needs (a sliding layer: its window's
    blocks; window None or 0: a full layer's, from block 0); None: the most any lane can need
    (`window_pages`)."""
    if context is None:
        return window_pages(window, width)
    last = context - 1
    lo = max(last - window + 1, 0) // BLOCK_TOKENS if window else 0
    return min(last // BLOCK_TOKENS + 1 - lo, width)


def kernel_slot_pages(needed: int, slot: int, pages: int) -> int:
    """Pages that page slot `slot` of the decode kernel (paged_kernel.py: `pages` slots a
    grid step, slot p holding pages p, p + pages, ..) DMAs for a lane needing `needed` pages:
    each of its pages below `needed`, or its first page once if none is (the pipeline fetches
    a slot's block whenever its index changes, and the index map repeats a slot's last needed
    page past it)."""
    return max(-(-(needed - slot) // pages), 1)


def _page_map(p: int, width: int, pool: int):
    """Index map of page slot p of pool `pool` (0: K, 1: V): (layer, block, 0, 0) of the lane's
    page at step i."""

    def index(b, i, layer, table, lo, needed, qpos):
        page = i * PAGES_PER_STEP + p
        # the slot's last needed page (page p if it has none): past it the slot stays put
        last = lax.div(jnp.maximum(needed[b] - 1 - p, 0), PAGES_PER_STEP) * PAGES_PER_STEP + p
        entry = lax.rem(lo[b] + jnp.minimum(page, last), width)
        return layer[pool], table[b * width + entry], 0, 0

    return index


def _load(refs):
    """A step's pages [PAGES_PER_STEP * 16, columns], one after another; int8 ones as float32
    (an int8 tile holds 32 rows: 16-row pages would join inside tiles)."""
    pages = [r[...] for r in refs]
    if pages[0].dtype == jnp.int8:
        pages = [x.astype(jnp.float32) for x in pages]
    return jnp.concatenate(pages, axis=0)


def _kernel(layer_ref, table_ref, lo_ref, needed_ref, qpos_ref, q_ref, *refs, heads: int,
            window: int | None, scale: float, kv_same: bool, quantized: bool, fold: bool,
            qnorm: float | None, rows: tuple[int, int, int] | None = None,
            row_scales: bool = False):
    pools = 1 if kv_same else 2
    pages = pools * PAGES_PER_STEP
    k_refs = refs[:PAGES_PER_STEP]
    v_refs = k_refs if kv_same else refs[PAGES_PER_STEP:pages]
    rest = refs[pages:]
    ks_ref = vs_ref = None
    if row_scales:  # each page's scale row [1, S], page slot by page slot, K's (and V's)
        ks_ref = rest[:PAGES_PER_STEP]
        vs_ref = ks_ref if kv_same else rest[PAGES_PER_STEP:pages]
        rest = rest[pages:]
    elif quantized:  # the step's scales, a row of 128 keys a head: [K, 128]
        ks_ref, vs_ref = (rest[0], rest[0]) if kv_same else rest[:2]
        rest = rest[pools:]
    w_ref, f_ref = rest[:2] if fold else (None, None)
    rest = rest[2:] if fold else rest
    qw_ref, qc_ref, qs_ref = rest[:3] if qnorm is not None else (None, None, None)
    rest = rest[3:] if qnorm is not None else rest
    o_ref, m_ref, l_ref, acc_ref = rest[:4]
    # the query as the kernel reads it, [K, G, D] (normed and rotated, or a lane's row's heads)
    qn_ref = rest[4] if qnorm is not None or rows is not None else q_ref
    orow_ref = rest[5] if rows is not None else None  # every lane's output row, float32
    b, i = pl.program_id(0), pl.program_id(1)
    dv = acc_ref.shape[-1]
    d = q_ref.shape[-1] if rows is None else rows[1]

    def query(h):  # head h's G query rows [G, D] as given: a block's, or the lane's row's
        if rows is None:
            return q_ref[h]
        g = rows[0]
        return jnp.concatenate([q_ref[pl.ds(b, 1), pl.ds((h * g + k) * d, d)]
                                for k in range(g)], axis=0)

    @pl.when(i == 0)
    def _():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)
        if qnorm is None and rows is not None:
            for h in range(heads):
                qn_ref[h] = query(h)
        if qnorm is not None:  # lower.rmsnorm, then lower.rope by halves, each head's rows
            half = d // 2
            cos, sin = qc_ref[...], qs_ref[...]  # [1, half]
            for h in range(heads):
                x = query(h)  # [G, D]
                y = x * lax.pow(jnp.mean(x * x, axis=1, keepdims=True) + jnp.float32(qnorm),
                                jnp.float32(-0.5)) * qw_ref[...]
                y1, y2 = y[:, :half], y[:, half:]
                qn_ref[h] = jnp.concatenate([y1 * cos + (-y2) * sin, y2 * cos + y1 * sin],
                                            axis=1)

    needed, qp = needed_ref[b], qpos_ref[b]

    def scale_block(refs):
        """[K, 128]: each head's scales of the step's 128 keys, from its pages' rows (head h's
        16 scales at lanes h * 16 of a row)."""
        got = [r[...] for r in refs]  # [1, S] each
        return jnp.concatenate([
            jnp.concatenate([x[:, h * BLOCK_TOKENS:(h + 1) * BLOCK_TOKENS] for x in got], axis=1)
            for h in range(heads)], axis=0)

    @pl.when(i * PAGES_PER_STEP < needed)
    def _():
        n = PAGES_PER_STEP * BLOCK_TOKENS
        j = lax.broadcasted_iota(jnp.int32, (1, n), 1)
        first = i * PAGES_PER_STEP
        start = (lo_ref[b] + first) * BLOCK_TOKENS
        pos = start + j
        # attention_blockwise's mask: a needed block, a key at or before the query and inside
        # its window (needed > 0: the lane is not idle)
        live = (first + lax.div(j, BLOCK_TOKENS) < needed) & (pos <= qp)
        if window is not None:
            live &= pos > qp - window
        keys = _load(k_refs)  # [n, K * D]
        values = keys if kv_same else _load(v_refs)
        if row_scales:
            k_rows = scale_block(ks_ref)
            v_rows = k_rows if kv_same else scale_block(vs_ref)
        elif quantized:  # [K, n]: each head's scales as a row beside its scores [G, n]
            k_rows = ks_ref[...]
            v_rows = k_rows if kv_same else vs_ref[...]
        if fold:  # the keys' angles at their positions (a column: keys are rows)
            key_pos = start + lax.broadcasted_iota(jnp.int32, (n, 1), 0)
            ang = key_pos.astype(jnp.float32) * f_ref[...]  # [n, LANE]
            cos, sin = jnp.cos(ang), jnp.sin(ang)
        for h in range(heads):
            q = qn_ref[h]  # [G, D]
            kh = keys[:, h * d:(h + 1) * d].astype(jnp.float32)
            if fold:  # rope(c * w): lower.rope's products on the rotated pairs' tiles
                c = kh * w_ref[...]
                half = d // 2
                x1, x2 = c[:, :LANE], c[:, half:half + LANE]
                kh = jnp.concatenate([x1 * cos - x2 * sin, c[:, LANE:half],
                                      x2 * cos + x1 * sin, c[:, half + LANE:]], axis=1)
            s = lax.dot_general(q, kh, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                                preferred_element_type=jnp.float32)
            if quantized:  # int8 keys in the dot, their scales on the scores
                s = s * k_rows[h:h + 1]
            s = s * jnp.float32(scale)
            m = jnp.max(m_ref[h], axis=1, keepdims=True)  # [G, 1]
            m_new = jnp.maximum(m, jnp.max(jnp.where(live, s, -jnp.inf), axis=1, keepdims=True))
            base = jnp.where(m_new == -jnp.inf, jnp.float32(0), m_new)
            p = jnp.where(live, jnp.exp(s - base), jnp.float32(0))
            rescale = jnp.exp(m - base)  # 0 while nothing was seen (m = -inf)
            vh = values[:, h * dv:(h + 1) * dv].astype(jnp.float32)
            pv = p * v_rows[h:h + 1] if quantized else p  # int8 values: scales on p
            acc_ref[h] = acc_ref[h] * rescale + jnp.dot(pv, vh, precision=lax.Precision.HIGHEST,
                                                        preferred_element_type=jnp.float32)
            l_ref[h] = l_ref[h] * rescale + jnp.sum(p, axis=1, keepdims=True)
            m_ref[h] = jnp.broadcast_to(m_new, m_ref.shape[1:])

    @pl.when(i == pl.num_programs(1) - 1)
    def _():
        outs = []
        for h in range(heads):
            total = jnp.max(l_ref[h], axis=1, keepdims=True)
            y = acc_ref[h] / jnp.where(total > 0, total, jnp.float32(1))
            if rows is None:
                o_ref[h] = y.astype(o_ref.dtype)
            else:
                outs += [y[k:k + 1] for k in range(rows[0])]
        if rows is not None:  # the lane's row [1, K * G * Dv] of the float32 rows in VMEM
            orow_ref[pl.ds(b, 1), :] = jnp.concatenate(outs, axis=1)

    if rows is not None:  # every lane's row made: the output block, written back once
        @pl.when((b == pl.num_programs(0) - 1) & (i == pl.num_programs(1) - 1))
        def _():
            o_ref[...] = orow_ref[...].astype(o_ref.dtype)


@dataclass(frozen=True)
class QueryNorm:
    """The query handed to the kernel as its projection's rows: the kernel applies its RMSNORM
    (weight `w` [D], `eps`) and its RoPE by halves (`cos`, `sin` [B, D / 2]: each lane's at its
    position; a zero frequency's 1 and 0 leave its pair as it is) itself, once a lane, into
    VMEM (lower.rmsnorm's and lower.rope's arithmetic)."""

    w: jax.Array
    eps: float
    cos: jax.Array
    sin: jax.Array


def scale_rows(pool, layer, blocks):
    """The scales of `blocks` [B, P] (each lane's pages in the order its grid steps read them)
    from layer `layer` of a scale pool [n, blocks, 16, K], as rows [B, K, P * 16]: each head's
    scales along lanes, so that a grid step's block [K, 128] is a whole tile row of the
    operand's default layout (the pool itself, as a custom call's operand, was relaid whole
    into that layout, K padded to 128 lanes, at every call: docs/TPU_COST.md). `blocks` must
    lie inside the pool (paged_decode clips the table): the gather clamps, as XLA's gather
    does, where jnp.take's default mode ("fill") adds a select of NaN for ids outside it, which
    XLA kept as a pass over the gathered scales and a relayout after it (the 31B at 128K, int8,
    TP = 8: 2 MiB a full layer on chip, est.; docs/TPU_COST.md)."""
    b, p = blocks.shape
    one = lax.dynamic_index_in_dim(pool, layer, 0, False)  # the layer's slice, then a gather
    taken = jnp.take(one, blocks, axis=0, mode="clip")  # [B, P, 16, K]
    return jnp.transpose(taken, (0, 3, 1, 2)).reshape(b, pool.shape[-1], p * BLOCK_TOKENS)


def paged_decode(q, k_pool, v_pool, layers, table, q_pos, *, window: int | None, scale: float,
                 fold: KeyFold | None = None, scales: tuple | None = None, interpret=False,
                 out_dtype=jnp.float32, qnorm: QueryNorm | None = None,
                 kv_heads: int | None = None):
    """See the module docstring. K=V (`k_pool is v_pool`): one set of page slots serves both.
    `scales`: an int8 pool's scale pools (K's, V's; K=V: the same one twice), rows [n,
    blocks, 1, S] (paged like the pools) or blocks [n, blocks, 16, K] (`scale_rows`).
    `interpret`: run
    the kernel in a Pallas interpreter (True, or pltpu.InterpretParams; any device: the tests'
    check of its values). `kv_heads` K: q is given as rows [B, K * G * D] (each lane's heads
    side by side, as the q projection writes them) and the output is returned as rows [B, K *
    G * Dv] (as the output projection reads them); both are one block of the whole array,
    read once and written back once, a lane's row sliced in VMEM. As [B, K, G, D] blocks, a
    custom call's operand tiled (8, 128) over (G, D), XLA relaid the query's rows into that
    layout before the call and the output back after it (G = 2 at TP = 4 padded to 8 rows:
    1.0 and 0.5 MiB a sliding layer of the 31B at B = 64, est.; docs/TPU_COST.md)."""
    row_dims = None  # (G, D, Dv) of a query and output given as rows
    if kv_heads is not None:  # a query head's D is its key's
        kh, d = kv_heads, k_pool.shape[-1] // kv_heads
        b, g = q.shape[0], q.shape[1] // (kv_heads * d)
        row_dims = (g, d, v_pool.shape[-1] // kv_heads)
    else:
        b, kh, g, d = q.shape
    dv = v_pool.shape[-1] // kh
    width = table.shape[1]
    kv_same = k_pool is v_pool
    if fold is not None and not (kv_same and len(fold.freqs) <= LANE <= d // 2
                                 and d // 2 % LANE == 0):
        raise ValueError(f"a folded key needs K=V and head dims of whole {LANE}-lane halves "
                         f"with at most {LANE} rotated pairs (D = {d}, "
                         f"{len(fold.freqs)} pairs)")
    steps = -(-window_pages(window, width) // PAGES_PER_STEP)
    valid = q_pos >= 0
    lo = jnp.zeros_like(q_pos)
    if window is not None:
        lo = jnp.where(valid, jnp.maximum(q_pos - window + 1, 0) // BLOCK_TOKENS, 0)
    needed = jnp.where(valid, jnp.minimum(q_pos // BLOCK_TOKENS + 1 - lo, width), 0)
    # block ids kept inside the pool, as XLA's gather keeps them (an idle lane's table may
    # hold anything; its pages are fetched, never used)
    table = jnp.clip(table, 0, k_pool.shape[1] - 1)
    if (scales is not None) != (k_pool.dtype == jnp.int8):
        raise ValueError(f"{k_pool.dtype} pools with{'out' if scales is None else ''} scales")
    rows = []
    row_scales = scales is not None and scales[0].shape[2] == 1  # row pools, paged as pages
    if scales is not None and not row_scales:
        entries = lax.rem(lo[:, None] + jnp.arange(steps * PAGES_PER_STEP, dtype=jnp.int32),
                          width)
        blocks = jnp.take_along_axis(table, entries.astype(jnp.int32), axis=1)
        rows = [scale_rows(x, jnp.asarray(layers, jnp.int32).reshape(2)[n], blocks)
                for n, x in enumerate(scales[:1] if kv_same else scales)]
    table = table.reshape(-1)
    layer = jnp.asarray(layers, jnp.int32).reshape(2)
    # The pools stay in HBM: as a custom call's operands XLA takes them as read whole, and
    # placed a layer group's small pools (the 31B's at B = 1, 25 MiB each) in VMEM, copied in
    # and out every layer (10 GiB a step more on chip, estimated on v6e).
    pools = [pltpu.with_memory_space_constraint(k_pool, pltpu.HBM)]
    if not kv_same:
        pools.append(pltpu.with_memory_space_constraint(v_pool, pltpu.HBM))
    if row_scales:  # page slots of their own: a row [1, S] a page
        pools += [pltpu.with_memory_space_constraint(x, pltpu.HBM)
                  for x in (scales[:1] if kv_same else scales)]
    prefetch = (layer, table, lo.astype(jnp.int32), needed.astype(jnp.int32),
                q_pos.astype(jnp.int32))
    # the traffic table finds the pools by their position among the custom call's operands
    assert len(prefetch) + 1 == PALLAS_DECODE_POOLS
    if row_dims is None:
        in_specs = [pl.BlockSpec((None, kh, g, d), lambda b, i, *_: (b, 0, 0, 0))]
    else:  # the whole rows, once
        in_specs = [pl.BlockSpec((b, kh * g * d), lambda b, i, *_: (0, 0))]
    operands = [q.astype(jnp.float32)]
    for n, pool in enumerate(pools):  # K, V (K=V: one), then their scale rows' pools
        page = (None, None, pool.shape[2], pool.shape[-1])
        in_specs += [pl.BlockSpec(page, _page_map(p, width, n % (1 if kv_same else 2)))
                     for p in range(PAGES_PER_STEP)]
        operands += [pool] * PAGES_PER_STEP
    for x in rows:  # a step's 128 keys' scales, every head: [K, 128]
        in_specs.append(pl.BlockSpec((None, kh, LANE), lambda b, i, *_: (b, 0, i)))
        operands.append(x)
    if fold is not None:
        freqs = np.zeros((1, LANE), np.float32)  # past the rotated pairs: angle 0, identity
        freqs[0, :len(fold.freqs)] = fold.freqs
        in_specs += [pl.BlockSpec((1, d), lambda b, i, *_: (0, 0)),
                     pl.BlockSpec((1, LANE), lambda b, i, *_: (0, 0))]
        operands += [jnp.asarray(fold.w, jnp.float32).reshape(1, d), jnp.asarray(freqs)]
    if qnorm is not None:  # the query's norm weight, and each lane's cos and sin rows
        in_specs += [pl.BlockSpec((1, d), lambda b, i, *_: (0, 0))]
        in_specs += [pl.BlockSpec((None, 1, d // 2), lambda b, i, *_: (b, 0, 0))] * 2
        operands += [jnp.asarray(qnorm.w, jnp.float32).reshape(1, d),
                     *(jnp.asarray(x, jnp.float32).reshape(b, 1, d // 2)
                       for x in (qnorm.cos, qnorm.sin))]
    out_shape = (b, kh, g, dv) if row_dims is None else (b, kh * g * dv)
    if row_dims is None:
        out_spec = pl.BlockSpec((None, kh, g, dv), lambda b, i, *_: (b, 0, 0, 0))
    else:  # the whole rows, written back after the last lane
        out_spec = pl.BlockSpec(out_shape, lambda b, i, *_: (0, 0))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch),
        grid=(b, steps),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=[pltpu.VMEM((kh, g, LANE), jnp.float32),
                        pltpu.VMEM((kh, g, LANE), jnp.float32),
                        pltpu.VMEM((kh, g, dv), jnp.float32)]
        + [pltpu.VMEM((kh, g, d), jnp.float32)] * (qnorm is not None or row_dims is not None)
        + [pltpu.VMEM(out_shape, jnp.float32)] * (row_dims is not None))
    scope = PALLAS_DECODE.format(lanes=b, pages=PAGES_PER_STEP, window=window or 0,
                                 width=width, pools=len(pools))
    kernel = functools.partial(_kernel, heads=kh, window=window, scale=scale, kv_same=kv_same,
                               quantized=scales is not None, fold=fold is not None,
                               qnorm=None if qnorm is None else qnorm.eps, rows=row_dims,
                               row_scales=row_scales)
    # rows: one output block over every lane, so the lanes' axis is not parallel
    lanes_axis = "parallel" if row_dims is None else "arbitrary"
    with jax.named_scope(scope):
        return pl.pallas_call(
            kernel, grid_spec=grid, out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=(lanes_axis, "arbitrary")),
            interpret=interpret, name="rv_paged_decode",
        )(*prefetch, *operands)
