"""IR ops as JAX: each function computes what the op's numpy reference in rvcompile.ir.ops does.

The programs keep KV caches paged (see program.py): inside layer scans a cache arrives as a
`PagedSlice` (the stacked block pool, the layer's index in it, the step's block table). KV_WRITE
scatters straight into the pool through the table (so XLA updates it in place); ATTENTION of a
paged program reads a lane's needed blocks only (`BLOCKWISE_LOWERINGS`), and any other reader
gets the sequence's blocks gathered into a contiguous [B, S, K, D] view. A plain array is a
contiguous cache, exactly as the IR reference has it. `run_graph` interprets one IR graph with
these functions at trace time.

An int8 cache (IR dtype "int8") is a paged int8 pool plus a float32 scale pool of the same
blocks (split by KV head like its pool; `scale_block_shape`: with 2 or more heads a device a
block's scales are one row [1, S], else [BLOCK_SIZE, K]): KV_WRITE quantises rows as
ir.ops.quantize_kv_rows does, reads dequantise (blockwise attention keeps a span int8 in its dots,
the scales on its scores and probabilities). Paged programs attend blockwise
(`BLOCKWISE_LOWERINGS`): the cache read and the K=V layers' k_norm and RoPE stay lazy
(`CacheView`) and ATTENTION walks each lane's live keys (a sliding layer's: its window's) in
spans of blocks with an online softmax, so a step reads the KV a sequence has, not its table
at the built context, and neither a [T, S] score matrix nor a dequantised [S, K, D] cache is
ever materialised.

Decode steps of programs for TPU alone hand Pallas kernels whole chains of a layer's nodes
(run_graph's `mlp` and `proj`; patterns.py finds the chains): the gated MLP with its residual
add (`gated_mlps`, mlp_kernel.py), the input norm with the projections that read it and k's and
v's norms and RoPE into their cache rows (`normed_projections`, proj_kernel.py); the same values
op by op wherever a kernel declines.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rvcompile.ir.graph import Graph, reads
from rvcompile.ir.ops import KV_INT8_MAX, Op
from rvcompile.targets.xla import paged_kernel
from rvcompile.targets.xla.hlo_traffic import BRANCHES, SPAN_LOOP
from rvcompile.targets.xla.paged_kernel import BLOCK_TOKENS
from rvcompile.targets.xla.patterns import (
    Projection,
    gated_mlps,
    layer_end,
    lazy_queries,
    normed_projections,
    read_as_bf16,
)

JNP_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "int8": jnp.int8,
              "float8_e4m3fn": jnp.float8_e4m3fn,
              "int32": jnp.int32}


BLOCK_SIZE = BLOCK_TOKENS  # tokens per KV block, for every kind and layer (16)


@dataclass(frozen=True)
class PagedSlice:
    """One layer's KV cache as seen by one step: its blocks in a stacked pool."""

    pool: jax.Array  # [n, blocks, BLOCK_SIZE, K * D]: n stacked layers (program.cache_pools)
    index: Any  # traced int: which of the n layers
    table: jax.Array  # int32 [B, W]: each lane's block ids, in slot order
    ring: bool  # slot of position p is p % (W * BLOCK_SIZE) (sliding) or p (full)
    heads: int  # K: a slot's row holds K heads' values, head k at columns k * D .. (under TP
    # a head's copies count: program.kv_copies)
    # an int8 pool's float32 scales: [n, blocks, BLOCK_SIZE, K] or rows [n, blocks, 1, S]
    # (`scale_block_shape`)
    scale: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        b, w = self.table.shape
        return (b, w * BLOCK_SIZE, self.heads, self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.pool.shape[3] // self.heads

    def read(self) -> jax.Array:
        """The lanes' caches as contiguous slots [B, W * BLOCK_SIZE, K, D]."""
        return self.read_blocks(self.table)

    def read_blocks(self, table: jax.Array, scales: jax.Array | None = None) -> jax.Array:
        """The blocks of `table` [B, w] as slots [B, w * BLOCK_SIZE, K, D] (int8: dequantised,
        by `scales` [B, w, BLOCK_SIZE, K] when the caller gathered them already)."""
        if self.scale is None:
            b, w = table.shape
            return self.pool[self.index, table].reshape(b, w * BLOCK_SIZE, self.heads,
                                                        self.head_dim)
        x, scales = self.read_stored(table, scales)
        return x.astype(jnp.float32) * scales[..., None]

    def read_stored(self, table: jax.Array,
                    scales: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
        """An int8 pool's blocks of `table` [B, w] as stored, [B, w * BLOCK_SIZE, K, D] int8,
        and their scales [B, w * BLOCK_SIZE, K] (`scales` [B, w, BLOCK_SIZE, K] if the caller
        gathered them already): `read_blocks` without the dequantising product."""
        b, w = table.shape
        x = self.pool[self.index, table].reshape(b, w * BLOCK_SIZE, self.heads, self.head_dim)
        if scales is None:
            scales = self._slots(self.scale[self.index, table])
        return x, scales.reshape(b, w * BLOCK_SIZE, self.heads)

    def table_scales(self) -> jax.Array | None:
        """float32 [B, W, BLOCK_SIZE, K]: the scales of every block of the lanes' tables (None
        for a float pool). The layer's slice is taken first: a gather from the stacked pool
        made TPU copy the whole stacked scale pool (tile-padded: K pads to 128) into VMEM in
        every layer iteration, 2.5 GiB a step for the 31B's sliding layers at 128K, B = 4."""
        if self.scale is None:
            return None
        return self._slots(jnp.take(lax.dynamic_index_in_dim(self.scale, self.index, 0, False),
                                    self.table, axis=0))

    def _slots(self, scales):
        """Gathered blocks of the scale pool as [..., BLOCK_SIZE, K]."""
        return (scales if self.scale.shape[2] == BLOCK_SIZE
                else scales_as_slots(scales[..., 0, :], self.heads))


@dataclass(frozen=True)
class CacheView:
    """A cache read kept lazy for blockwise attention: the cache, then elementwise steps (a K=V
    layer's times-k_norm and RoPE at the slots' positions) applied to whichever slots are
    read."""

    cache: PagedSlice
    steps: tuple[Callable, ...] = ()  # (x [B, n, K, D], slots [B, n] read) -> x
    # what each step is, for attention to fold: ("mul", w [D]) or ("rope", attrs, pos [B, S])
    kinds: tuple[tuple, ...] = ()

    def then(self, step: Callable, kind: tuple = ("other",)) -> CacheView:
        return dataclasses.replace(self, steps=(*self.steps, step), kinds=(*self.kinds, kind))

    def read(self) -> jax.Array:
        b, w = self.cache.table.shape
        slots = jnp.broadcast_to(jnp.arange(w * BLOCK_SIZE, dtype=jnp.int32), (b, w * BLOCK_SIZE))
        return self._apply(self.cache.read(), slots)

    def read_entries(self, entries: jax.Array, table_scales: jax.Array | None = None) -> jax.Array:
        """The slots of table entries `entries` [B, w] (each lane its own) as [B, w * 16, K, D];
        an int8 pool's scales taken from `table_scales` (PagedSlice.table_scales) if given."""
        scales = None
        if table_scales is not None:
            scales = jnp.take_along_axis(table_scales, entries[:, :, None, None], axis=1)
        x = self.cache.read_blocks(jnp.take_along_axis(self.cache.table, entries, axis=1),
                                   scales)
        return self._apply(x, entry_slots(entries))

    def read_span(self, start, blocks: int) -> jax.Array:
        """The slots of table entries start .. start + blocks - 1 of every lane as [B, blocks *
        16, K, D], through a slice of the table."""
        b = self.cache.table.shape[0]
        x = self.cache.read_blocks(
            lax.dynamic_slice_in_dim(self.cache.table, start, blocks, axis=1))
        slots = start * BLOCK_SIZE + jnp.arange(blocks * BLOCK_SIZE, dtype=jnp.int32)
        return self._apply(x, jnp.broadcast_to(slots, (b, blocks * BLOCK_SIZE)))

    def stored_entries(self, entries: jax.Array, table_scales: jax.Array):
        """`read_entries` of an int8 pool without steps, as stored: (int8 [B, w * 16, K, D],
        scales [B, w * 16, K])."""
        scales = jnp.take_along_axis(table_scales, entries[:, :, None, None], axis=1)
        return self.cache.read_stored(jnp.take_along_axis(self.cache.table, entries, axis=1),
                                      scales)

    def stored_span(self, start, blocks: int):
        """`read_span` of an int8 pool without steps, as stored (see `stored_entries`)."""
        return self.cache.read_stored(
            lax.dynamic_slice_in_dim(self.cache.table, start, blocks, axis=1))

    def _apply(self, x, slots):
        for step in self.steps:
            x = step(x, slots)
        return x


def entry_slots(entries: jax.Array) -> jax.Array:
    """The slots [B, w * BLOCK_SIZE] of table entries [B, w]."""
    b, w = entries.shape
    return (entries[:, :, None] * BLOCK_SIZE
            + jnp.arange(BLOCK_SIZE, dtype=jnp.int32)).reshape(b, w * BLOCK_SIZE)


@dataclass(frozen=True)
class NormedQuery:
    """An attention query RMSNORM(x, w) then ROPE(., pos), kept lazy by run_graph (the norm's
    and the rope's one reader each, the rope's the query of an ATTENTION): the Pallas decode
    kernel applies both itself to the projection's rows (paged_kernel.QueryNorm), sparing their
    passes over the query on chip; anything else reads it as the two lowerings make it."""

    x: jax.Array  # [B, T, H, D]
    w: jax.Array
    norm: Any  # RMSNORM's attrs
    rope: Any = None  # ROPE's attrs, and its positions [B, T]
    pos: Any = None

    @property
    def shape(self):
        return self.x.shape

    def read(self) -> jax.Array:
        y = rmsnorm(self.norm, self.x, self.w)
        return y if self.rope is None else rope(self.rope, y, self.pos)

    def kernel_norm(self):
        """paged_kernel.QueryNorm of a decode query (T = 1), its cos and sin as `rope`'s."""
        ang = self.pos.astype(jnp.float32)[:, 0, None] * jnp.asarray(self.rope.inv_freq,
                                                                      jnp.float32)
        return paged_kernel.QueryNorm(f32(self.w), float(self.norm.eps), jnp.cos(ang),
                                      jnp.sin(ang))


@dataclass(frozen=True)
class ScaledRows:
    """A down projection's value as the MLP kernel leaves it (decode_mlp_kernel): its dot x
    (all-reduced) and per-row scale s, read as x * s; kept lazy so that the next layer's
    projections kernel may apply the scale itself (`LayerEnd`)."""

    x: jax.Array
    s: jax.Array

    @property
    def shape(self):
        return self.x.shape

    def read(self) -> jax.Array:
        return self.x * self.s


@dataclass(eq=False)
class LayerEnd:
    """A layer's output h = (h0 + RMSNORM(y, w)) * scalar kept lazy by run_graph (`lazy_end`,
    `layer_end`): the next layer's projections kernel makes it with its input norm
    (decode_projections_kernel), sparing XLA's two passes over the rows (the post-FFW norm's
    sum of squares, the add and scale: 5.3 MiB a layer for the 31B at B = 64, TP = 4, est.);
    anything else reads it as the op by op lowering makes it (`make`, once)."""

    h: jax.Array  # h0, the stream
    y: jax.Array  # the down projection's dot, before its scale
    s: jax.Array | None  # its per-row scale
    w: jax.Array  # the RMSNORM's weight
    norm: Any  # its attrs
    scalar: jax.Array
    make: Callable[[], jax.Array]
    _made: Any = None

    @property
    def shape(self):
        return self.h.shape

    def read(self) -> jax.Array:
        if self._made is None:
            self._made = self.make()
        return self._made


def _val(v):
    return v.read() if isinstance(v, PagedSlice | CacheView | NormedQuery | ScaledRows
                                  | LayerEnd) else v


def _view(v) -> CacheView | None:
    """`v` as a lazy cache read, or None if it is a plain array."""
    if isinstance(v, PagedSlice):
        return CacheView(v)
    return v if isinstance(v, CacheView) else None


@dataclass(frozen=True)
class TakesPaged:
    """A lowering that gets cache inputs as they are (PagedSlice, CacheView), not read.
    `takes_read_as_bf16`: run_graph passes it `read_as_bf16=` too: whether every reader of the
    node's value rounds it to bf16 first (patterns.read_as_bf16), so that it may write bf16."""

    fn: Callable
    takes_read_as_bf16: bool = False

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


def mesh_devices(mesh) -> int:
    """The devices along a program's one mesh axis (its tensor parallelism); 1 without a mesh."""
    return 1 if mesh is None else mesh.shape[mesh.axis_names[0]]


def f32(x):
    return _val(x).astype(jnp.float32)


def gelu_tanh(x):
    c = jnp.float32(0.7978845608028654)
    return 0.5 * x * (1.0 + jnp.tanh(c * (x + jnp.float32(0.044715) * x**3)))


ROW_TILE = 32  # rows of a narrow (int8, bf16) table that one TPU memory tile holds
ROW_TILE_ALIGN = 8 * ROW_TILE  # rows split into whole tiles on 1, 2, 4 or 8 devices


def take_rows(table, ids):
    """table[ids] for a [V, D] table, reading only the rows' tiles. TPU stores an int8 table
    in tiles of 32 rows (T(32,128)) and gathers single rows only from 8-row tiles, so a plain
    `jnp.take` makes XLA relayout the WHOLE table every call (measured on v6e: 336 MiB read and
    written a decode step for the 31B's tied table). Viewed as [V / 32, 32, D] (a bitcast of
    that layout) the lookup gathers each id's 32-row block and keeps its row by a masked sum
    over the block (a second gather fused with the first would be a row gather again), on the
    rows' bits, so the values are the table's exactly (out-of-range ids included). Tables of
    4-byte elements, or whose rows do not split into whole tiles on 1, 2, 4 or 8 devices (TP
    splits tables by row), keep the plain gather."""
    v, d = table.shape
    if table.dtype.itemsize >= 4 or v % ROW_TILE_ALIGN:
        return jnp.take(table, ids, axis=0)
    blocks = jnp.take(table.reshape(v // ROW_TILE, ROW_TILE, d), ids // ROW_TILE, axis=0)
    bits = jnp.dtype(f"int{8 * table.dtype.itemsize}")
    if table.dtype != bits:
        blocks = lax.bitcast_convert_type(blocks, bits)
    pick = jnp.arange(ROW_TILE, dtype=ids.dtype) == (ids % ROW_TILE)[..., None]
    rows = jnp.sum(jnp.where(pick[..., None], blocks, 0), axis=-2, dtype=bits)
    return rows if table.dtype == bits else lax.bitcast_convert_type(rows, table.dtype)


def embed(a, table, ids, row_scale=None, *, mesh=None):
    """The rows of `ids`, times their per-row scales and the multiplier. `mesh`: the table and
    its scales split by vocabulary row over the mesh's one axis (sharding.py): in shard_map each
    device takes the ids it holds (the others' rows zero) and one all-reduce adds the finished
    float32 rows, [B, T, D]. Left to XLA's partitioner, the split gather all-reduced what it
    gathered, take_rows' whole 32-row blocks as int bits (8 times the float32 rows' bytes:
    10.5 MiB a 31B step at B = 64), and the scales in a second all-reduce (docs/TPU_COST.md,
    "Issue 19 item 5: the collectives, what XLA allows"). The values are the same: a row plus
    zeros. A table whose rows do not divide over the mesh is left to the partitioner."""
    if mesh is None or table.shape[0] % mesh_devices(mesh):
        return _embed_rows(a, table, ids, row_scale)
    from jax.sharding import PartitionSpec

    axis = mesh.axis_names[0]

    def local(table, ids, *scale):
        mine = ids - lax.axis_index(axis) * table.shape[0]
        held = (mine >= 0) & (mine < table.shape[0])
        rows = _embed_rows(a, table, jnp.where(held, mine, 0), *scale)
        return lax.psum(jnp.where(held[..., None], rows, jnp.float32(0)), axis)

    split = (PartitionSpec(axis, None),) + (PartitionSpec(axis),) * (row_scale is not None)
    return jax.shard_map(local, mesh=mesh, in_specs=(split[0], PartitionSpec(), *split[1:]),
                         out_specs=PartitionSpec(), check_vma=False)(
        table, ids, *(() if row_scale is None else (row_scale,)))


def _embed_rows(a, table, ids, row_scale=None):
    rows = take_rows(table, ids).astype(jnp.float32)
    if row_scale is not None:
        rows = rows * jnp.take(row_scale, ids, axis=0)[..., None]
    return rows * jnp.float32(a.multiplier)


GEMV_MAX_ROWS = 1  # at most this many activation rows: multiply-reduce instead of a dot


def linear(a, x, w, scale=None):
    x = f32(x)
    rows = math.prod(x.shape[:-1])
    if w.dtype != jnp.float32:
        x = x.astype(jnp.bfloat16).astype(jnp.float32)
    if rows <= GEMV_MAX_ROWS:
        # Decode reads every weight once per step: as an elementwise product + row reduction XLA
        # fuses the (scan) slice, the int8/bf16 -> f32 convert and the sum into one pass over
        # the stored bytes, where a dot would first materialise converted weights.
        y = jnp.sum(x[..., None, :] * w.astype(jnp.float32), axis=-1)
    elif w.dtype == jnp.float32:
        y = jnp.einsum("...k,nk->...n", x, w, precision=lax.Precision.HIGHEST,
                       preferred_element_type=jnp.float32)
    else:
        y = jnp.einsum("...k,nk->...n", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                       preferred_element_type=jnp.float32)
    return y * scale if scale is not None else y


def rmsnorm(a, x, w=None):
    x = f32(x)
    y = x * lax.pow(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(a.eps),
                    jnp.float32(-0.5))
    return y * w.astype(jnp.float32) if w is not None else y


def residual_rmsnorm(a, h, x, w, s=None):
    y = f32(h) + rmsnorm(a, x, w)
    return y * f32(s) if s is not None else y


def gated_linear(a, x, wg, wu, sg=None, su=None):
    return gelu_tanh(linear(a, x, wg, sg)) * linear(a, x, wu, su)


def multi_linear(a, x, *ws):
    weights, scales = ws[:a.count], ws[a.count:] or (None,) * a.count
    return jnp.concatenate(
        [linear(a, x, w, s) for w, s in zip(weights, scales, strict=True)], axis=-1)


def rope(a, x, pos):
    """ROPE. A proportional layer's frequencies are zero past the first n (Gemma 4's full layers:
    64 of 256), and a zero leaves its dim pair as it is: only pairs 0 .. n - 1 are rotated, the
    rest pass through (bit for bit the reference's x * 1 + rot * 0, up to the sign of a zero).
    Rotating all D dims made a K=V layer's RoPE of each span of cached keys produce and read
    4x the f32 bytes it needs, which at B = 64 spill from on-chip memory to HBM."""
    x = f32(x)
    freqs = np.asarray(a.inv_freq, np.float32)
    n = int(np.count_nonzero(freqs))
    if 0 < n < freqs.size and not freqs[n:].any():
        half = x.shape[-1] // 2
        ang = pos.astype(jnp.float32)[..., None] * jnp.asarray(freqs[:n])
        cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
        x1, x2 = x[..., :n], x[..., half:half + n]
        return jnp.concatenate([x1 * cos - x2 * sin, x[..., n:half], x2 * cos + x1 * sin,
                                x[..., half + n:]], -1)
    # by halves: x * [c, c] + [-x2, x1] * [s, s] as [x1 c + (-x2) s, x2 c + x1 s], the same
    # products and sums (op by op bit for bit; jitted, XLA's CPU backend may fuse another product
    # into a multiply-add: 1 ulp apart at head dims 32 and 64, none at 256), without cos and sin
    # broadcast to every head D wide: on TPU at B = 64 those and the rotated copy were written
    # to on-chip memory and relaid (the 31B at TP = 4: 0.23 GiB a decode step, est.)
    inv = jnp.asarray(a.inv_freq, jnp.float32)
    ang = pos.astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], -1)


def scale_lanes(heads: int) -> int:
    """Lanes of one block's scales stored as a row: `heads` heads' 16 scales, head-major,
    zeros to whole 128-lane tiles."""
    return -(-BLOCK_SIZE * heads // LANE_TILE) * LANE_TILE


def scale_block_shape(heads: int, shards: int) -> tuple[int, ...]:
    """One block of the scale pool of an int8 pool of `heads` heads (K, copies counted) split
    over `shards` devices (1: whole on each): with at least 2 heads a device a row [1, shards x
    scale_lanes(K / shards)], each device's heads in its own lanes (so that the pool splits by
    head along its last axis, as its int8 pool does); else [BLOCK_SIZE, K]. Why rows: TPU lays
    [.., 16, K] out with the blocks along lanes (16 and K are too narrow), and a decode step's
    gather of whole blocks' scales made XLA stage every such pool whole once a step, relaid
    with the blocks major and K padded to 128 lanes (the 31B at 128K, TP = 4: 0.13 GiB a step,
    est.); a row pool [n, blocks, 1, S] is laid out a (layer, block) row a (1, 128) tile, and
    the decode kernel pages its rows as it pages the int8 pool (paged_kernel.py). (Without the
    unit dim TPU tiled [n, blocks, S] over (n, S) where n pads less than the blocks, the 12B's
    8 layers a group against 81 blocks, and XLA relaid every such pool whole once a step.) One
    head's row would be 8 times its 16 scales (the 31B's full layers at 128K: 40 MiB a step,
    against about 15 MiB of staging; est., docs/TPU_COST.md)."""
    local = heads // shards
    return (BLOCK_SIZE, heads) if local < 2 else (1, shards * scale_lanes(local))


def row_shards(lanes: int, heads: int) -> int:
    """The shards of a scale row of `lanes` holding `heads` heads (`scale_block_shape`)."""
    return next(s for s in range(1, heads + 1)
                if heads % s == 0 and s * scale_lanes(heads // s) == lanes)


def scales_as_slots(x, heads: int):
    """Scales of blocks as rows [..., S] (`scale_block_shape`) -> [..., BLOCK_SIZE, K]."""
    shards = row_shards(x.shape[-1], heads)
    local = heads // shards
    lead = x.shape[:-1]
    y = x.reshape(*lead, shards, scale_lanes(local))[..., :BLOCK_SIZE * local]
    y = y.reshape(*lead, shards, local, BLOCK_SIZE)
    y = jnp.moveaxis(y, -1, -3)  # [..., 16, shards, local]
    return y.reshape(*lead, BLOCK_SIZE, heads)


def _slots(a, cache_size, pos):
    """Scatter targets of new rows; padding (pos < 0) goes out of bounds and is dropped."""
    slot = jnp.where(pos >= 0, pos % cache_size if a.ring else pos, cache_size)
    return slot


def kv_write(a, cache, new, pos, *, mesh=None):
    if isinstance(cache, PagedSlice):
        return _paged_kv_write(cache, new, pos, mesh)
    b, t = pos.shape
    slot = _slots(a, cache.shape[1], pos)
    bi = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
    return cache.at[bi, slot].set(new.astype(cache.dtype), mode="drop")


def quantize_kv_rows(x):
    """ir.ops.quantize_kv_rows in JAX: rows [..., D] -> (int8 [..., D], float32 scale [...])."""
    x = f32(x)
    scale = jnp.max(jnp.abs(x), axis=-1) * jnp.float32(1 / KV_INT8_MAX)
    safe = jnp.where(scale > 0, scale, jnp.float32(1))[..., None]
    q = jnp.clip(jnp.round(x / safe), -KV_INT8_MAX, KV_INT8_MAX)
    return q.astype(jnp.int8), scale


def _paged_kv_write(cache: PagedSlice, new, pos, mesh=None):
    """Store each row `new` [B, T, K, D] in block table[slot // BLOCK_SIZE] at offset slot %
    BLOCK_SIZE, its heads side by side (each repeated to the pool's copies of it); padding rows
    (pos < 0) get an out-of-range block and are dropped. An int8 pool gets the rows' int8
    values and its scale pool their scales."""
    if new.shape[-2] != cache.heads:  # each head stored heads / K times (program.kv_copies)
        if mesh is not None:
            # The rows whole on every device (as the projections are), so that each device
            # keeps its copy: left to the partitioner, the pool's split reached back into the
            # projection, which on TPU then copied each device's rows of the stacked weight
            # (the 26B-A4B's full layers at TP = 8: 0.05 GiB more a step than it saved).
            from jax.sharding import NamedSharding, PartitionSpec

            new = lax.with_sharding_constraint(new, NamedSharding(mesh, PartitionSpec()))
        new = jnp.repeat(new, cache.heads // new.shape[-2], axis=-2)
    size = cache.table.shape[1] * BLOCK_SIZE
    slot = jnp.where(pos >= 0, pos % size if cache.ring else pos, 0)
    block = jnp.take_along_axis(cache.table, slot // BLOCK_SIZE, axis=1)
    block = jnp.where(pos >= 0, block, cache.pool.shape[1])
    layer = jnp.broadcast_to(cache.index, pos.shape)
    at = (layer, block, slot % BLOCK_SIZE)
    if cache.scale is None:
        rows = new.reshape(*pos.shape, -1).astype(cache.pool.dtype)
        return dataclasses.replace(cache, pool=cache.pool.at[at].set(rows, mode="drop"))
    q, scale = quantize_kv_rows(new)
    pool = cache.pool.at[at].set(q.reshape(*pos.shape, -1), mode="drop")
    if cache.scale.shape[2] == BLOCK_SIZE:
        return dataclasses.replace(cache, pool=pool, scale=cache.scale.at[at].set(scale,
                                                                                 mode="drop"))
    n, blocks, _, lanes = cache.scale.shape
    shards = row_shards(lanes, cache.heads)
    local = cache.heads // shards
    # each shard's lanes a window of the scatter, so that under a mesh (the rows split by shard)
    # every device writes its own heads' lanes
    rows = cache.scale.reshape(n, blocks, shards, lanes // shards)
    lane = (slot % BLOCK_SIZE)[..., None] + jnp.arange(local) * BLOCK_SIZE  # [B, T, local]
    put = jnp.swapaxes(scale.reshape(*pos.shape, shards, local), -1, -2)
    # Decode: each lane's row read, set and written back (dynamic slices, in place). As a
    # scatter of its K lanes XLA copied the whole pool (small: 0.4 MiB a sliding group of the
    # 31B at TP = 4) into on-chip memory and back in every layer iteration (68 MiB a step).
    if pos.shape[1] == 1:
        at_lane = jnp.arange(lanes // shards)
        for b in range(pos.shape[0]):
            start = (layer[b, 0], jnp.minimum(block[b, 0], blocks - 1), 0, 0)
            row = lax.dynamic_slice(rows, start, (1, 1, shards, lanes // shards))
            new = row
            for k in range(local):
                new = jnp.where(at_lane == lane[b, 0, k], put[b, 0, k][:, None], new)
            new = jnp.where(pos[b, 0] >= 0, new, row)
            rows = lax.dynamic_update_slice(rows, new, start)
        return dataclasses.replace(cache, pool=pool, scale=rows.reshape(n, blocks, 1, lanes))
    rows = rows.at[layer[..., None], block[..., None], :, lane].set(put, mode="drop")
    return dataclasses.replace(cache, pool=pool, scale=rows.reshape(n, blocks, 1, lanes))


def cache_positions(a, cache_len):
    s = jnp.arange(a.size, dtype=jnp.int32)[None, :]
    length = cache_len[:, None]
    if not a.ring:
        return jnp.where(s < length, s, -1)
    last = length - 1 - s
    return jnp.where(last >= 0, s + a.size * (jnp.maximum(last, 0) // a.size), -1)


def attention(a, q, k, v, q_pos, k_pos):
    q, k, v = f32(q), f32(k), f32(v)
    b, t, nh, d = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, t, kh, nh // kh, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, precision=lax.Precision.HIGHEST,
                        preferred_element_type=jnp.float32) * jnp.float32(a.scale)
    qp = q_pos[:, None, None, :, None]
    kp = k_pos[:, None, None, None, :]
    mask = (kp >= 0) & (kp <= qp) & (qp >= 0)
    if a.window is not None:
        mask &= kp > qp - a.window
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    e = jnp.where(mask, jnp.exp(scores - jnp.where(jnp.isfinite(m), m, 0)), 0)
    denom = jnp.sum(e, axis=-1, keepdims=True)
    p = e / jnp.where(denom > 0, denom, 1)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, precision=lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, nh, d)


SPAN_BLOCKS = 32  # blockwise attention reads up to this many blocks (512 keys) per step


def span_blocks(width: int, window: int | None) -> int:
    """Blocks a span loop step reads: the blocks a decode row needs (the table's width, or a
    window's blocks) cut into the fewest spans of at most SPAN_BLOCKS, evened out so that the
    last span reads few blocks past them."""
    need = width if window is None else min(width, -(-(window - 1) // BLOCK_SIZE) + 1)
    return -(-need // -(-need // SPAN_BLOCKS))


def span_plan(q_pos, window: int | None, width: int, blocks: int):
    """(lo [B], needed [B], trips) of a span loop over tables `width` blocks wide, `blocks` a
    span, for query positions q_pos [B, T] (-1: padding): lane b needs logical blocks lo_b ..
    lo_b + needed_b - 1 (from its first key, 0 or a window behind its first query, to its last
    query's; at most the table), and the loop runs `trips` spans, the most any lane needs.
    hlo_traffic.span_loop_trips is the same count for lanes decoding at one position."""
    valid = q_pos >= 0
    last = jnp.max(jnp.where(valid, q_pos, -1), axis=1)
    lo = jnp.zeros_like(last)
    if window is not None:
        first = jnp.min(jnp.where(valid, q_pos, jnp.iinfo(jnp.int32).max), axis=1)
        lo = jnp.where(last >= 0, jnp.maximum(first - window + 1, 0) // BLOCK_SIZE, 0)
    needed = jnp.where(last >= 0, jnp.minimum(last // BLOCK_SIZE + 1 - lo, width), 0)
    return lo, needed, (jnp.max(needed) + blocks - 1) // blocks


def rotated_pairs(a) -> int | None:
    """n when ROPE `a` rotates only its first n of D/2 frequency pairs (0 < n < D/2: Gemma 4's
    proportional full layers, 64 of 256), else None."""
    freqs = np.asarray(a.inv_freq, np.float32)
    n = int(np.count_nonzero(freqs))
    return n if 0 < n < freqs.size and not freqs[n:].any() else None


@dataclass(frozen=True)
class FoldedKeys:
    """A K=V layer's keys rope(cache * w) kept as the cache, for scores that never materialise
    a float32 copy of a span: q . rope(c * w) = (q * w)[pass-through dims] . c + q[rotated dims]
    . rope(c * w)[rotated dims], where only n of D/2 pairs rotate. The first dot reads the span
    as it is stored; only the 2n rotated dims are widened, scaled and rotated (for the 31B at
    B = 64 those float32 copies of every span went through HBM: 12.5 GiB a step), inside the
    dots' operands (`rotated_scores`)."""

    w: jax.Array  # float32 [D]: k_norm's weight
    rope: Any  # RopeAttrs
    pos: jax.Array  # int32 [B, S]: every slot's position
    n: int  # rotated pairs

    @staticmethod
    def of(k: CacheView, v: CacheView) -> FoldedKeys | None:
        """K = rope(V * w) over the same cache with V read as stored, and a rope that rotates
        part of the pairs; else None."""
        if k.cache is not v.cache or v.steps or [c[0] for c in k.kinds] != ["mul", "rope"]:
            return None
        n = rotated_pairs(k.kinds[1][1])
        if n is None:
            return None
        return FoldedKeys(k.kinds[0][1], k.kinds[1][1], k.kinds[1][2], n)

    def query(self, qg):
        """(qg [.., D] times w with the rotated dims zeroed, (qg's first and second rotated
        dims [.., n] each))."""
        d = qg.shape[-1]
        half, n = d // 2, self.n
        rotated = np.zeros(d, bool)
        rotated[:n] = rotated[half:half + n] = True
        qw = jnp.where(jnp.asarray(rotated), jnp.float32(0), qg * self.w)
        return qw, (qg[..., :n], qg[..., half:half + n])

    def rotated_scores(self, q_rot, c, slots, scales=None):
        """q_rot, two [B, T, K, G, n] (`query`), against the rotated dims of rope(c * w) for
        cache slots c [B, S, K, D] at `slots` [B, S] (int8 slots as stored: dequantised by
        `scales` [B, S, K] first): [B, K, G, T, S]. The rotated keys are the reference's own
        products (their bits are the unfolded keys'), each half the operand of its own dot,
        which XLA on TPU computes inside the dot (one dot over both halves concatenated wrote
        those float32 keys to on-chip memory and read them back: 41 MiB a span of 32 MiB for
        the 31B at B = 64; estimates, docs/TPU_COST.md). With more than one lane each half is
        read as whole 128-column tiles of the stored rows (n rounded up to 128 columns, at
        most D/2, from dim 0 and from D/2), the columns past n with a zero query (and RoPE's
        identity), so they add exact zeros: over the n columns alone TPU copied the halves out
        of each span and relaid them first (0.6 GiB a step more than the tiles at B = 64, 1.2
        GiB at 128K and B = 4, TP = 4). One lane reads the n columns in place (0.3 GiB a step
        less than the tiles at 128K). Within float32 rounding of one dot over the 2n dims."""
        half, n = c.shape[-1] // 2, self.n
        m = n if c.shape[0] == 1 else min(half, -(-n // 128) * 128)  # columns a half

        def dims(x):
            x = f32(x)
            return x if scales is None else x * scales[..., None]

        x1 = dims(c[..., :m]) * self.w[:m]
        x2 = dims(c[..., half:half + m]) * self.w[half:half + m]
        freqs = np.zeros(m, np.float32)
        freqs[:n] = np.asarray(self.rope.inv_freq, np.float32)[:n]
        ang = (jnp.take_along_axis(self.pos, slots, axis=1).astype(jnp.float32)[..., None]
               * jnp.asarray(freqs))
        cos, sin = jnp.cos(ang)[..., None, :], jnp.sin(ang)[..., None, :]
        pad = [(0, 0)] * (q_rot[0].ndim - 1) + [(0, m - n)]
        q1, q2 = (jnp.pad(q, pad) for q in q_rot)

        def dot(q, keys):
            return jnp.einsum("btkgd,bskd->bkgts", q, keys, precision=lax.Precision.HIGHEST,
                              preferred_element_type=jnp.float32)

        return dot(q1, x1 * cos - x2 * sin) + dot(q2, x2 * cos + x1 * sin)


def span_dots(kind: str, x, span, mesh=None):
    """A span's dots, per KV head: kind "scores": queries x [B, T, K, G, D] against keys span
    [B, S, K, D] -> [B, K, G, T, S]; kind "values": probabilities x [B, K, G, T, S] over values
    span [B, S, K, D] -> [B, K, G, T, D]. With more than one KV head on a device each head's
    dot reads its columns of the stored rows [B, S, K * D] as static slices: a dot batched over
    the heads of the [.., K, D] view made TPU copy each gathered span into that view's layout
    first (its rows tile as (8, 128) of K * D columns, the view as (K, D)): 0.10 GiB a decode
    step of the 26B-A4B's sliding layers at TP = 4 (2 heads a device), 25 GiB (on chip) of
    the 31B's at B = 64 (4 heads; estimates, docs/TPU_COST.md). Under tensor parallelism
    (`mesh`, pools split by whole KV heads) the per-head dots run in shard_map over each
    device's heads, as split up globally they would be resharded across the devices; pools
    with fewer heads than devices (whole on every device) keep the batched dot."""
    b, s, kh, d = span.shape
    group, rows = (3, 1) if kind == "scores" else (2, 3)  # x's axes of G and T
    if x.shape[group] * x.shape[rows] == 1:
        # One query row a KV head (a decode step with as many KV heads, or copies of them, as
        # query heads on a device: the E4B's at TP = 8): with a zero row beside it TPU runs a
        # dot that reads the stored bf16 span; as a matrix-vector product XLA widened every
        # span to float32 in on-chip memory first and read that (40 against 24 MiB a step for
        # 2 full layers of one 512-dim head at 2048 tokens on v6e).
        padded = jnp.concatenate([x, jnp.zeros_like(x)], axis=group)
        return lax.slice_in_dim(span_dots(kind, padded, span, mesh), 0, 1, axis=2)
    tp = mesh_devices(mesh)
    eq = {"scores": "btkgd,bskd->bkgts", "values": "bkgts,bskd->bkgtd"}[kind]
    if kh % tp or kh // tp == 1:
        return jnp.einsum(eq, x, f32(span), precision=lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
    one = {"scores": "btgd,bsd->bgts", "values": "bgts,bsd->bgtd"}[kind]
    head = 2 if kind == "scores" else 1  # x's KV-head axis

    def local(x, rows):
        n = rows.shape[-1] // d
        return jnp.stack([jnp.einsum(one, jnp.take(x, j, axis=head),
                                     f32(rows[..., j * d:(j + 1) * d]),
                                     precision=lax.Precision.HIGHEST,
                                     preferred_element_type=jnp.float32)
                          for j in range(n)], axis=1)

    rows = _val(span).reshape(b, s, kh * d)  # widened in the dot: across shard_map's
    if mesh is None:  # boundary a widened span would be materialised
        return local(x, rows)
    from jax.sharding import PartitionSpec

    axis = mesh.axis_names[0]
    x_spec = [None] * x.ndim
    x_spec[head] = axis
    return jax.shard_map(local, mesh=mesh,
                         in_specs=(PartitionSpec(*x_spec), PartitionSpec(None, None, axis)),
                         out_specs=PartitionSpec(None, axis), check_vma=False)(x, rows)


LANE_TILE = 128  # columns of a TPU memory tile's row


def decode_kernel_fits(a, q, k: CacheView, v: CacheView, mesh=None) -> bool:
    """Whether `attention_blockwise` of these operands is what targets/xla/paged_kernel.py
    computes: a decode step (one query row a lane) over float pools, or int8 ones with their
    scale pools (one block table, the same heads), of a sliding layer (keys stored with their
    RoPE: read as stored) or a full layer (keys as stored, or a K=V layer's rope(cache *
    k_norm), `FoldedKeys`, rotating at most 128 pairs of halves of whole 128-lane tiles),
    split by whole KV heads under a mesh, head dims of whole 128-lane tiles (the kernel slices
    each head's columns out of a page; Gemma 4's heads are 256 and 512 wide, the test models'
    32 and 64 keep the XLA lowering). An int8 pool's row scale pools (`scale_block_shape`) are
    the kernel's operands, paged like the pools (a row a page); scales of blocks [.., 16, K]
    reach it as rows gathered for the step (`paged_kernel.scale_rows`), never as those pools
    themselves: as the kernel's operands in the default tiled layout, where K (1 to 4) pads to
    128 lanes, XLA relaid each whole scale pool into it and back every call (the 31B's
    full-layer scales at 128K: 5 MiB, 640 MiB as tiled; docs/TPU_COST.md). Under a mesh the
    pools' block counts must be static: the kernel runs in shard_map, and a shard_map operand
    with a symbolic dimension (an artifact's pools: their block counts are chosen at load)
    makes XLA's shape refinement crash when the program is compiled (SIGSEGV in
    RefinePolymorphicShapes, jax 0.10.2 / libtpu 0.0.42.1; docs/TPU_COST.md), so the build
    exports tensor-parallel programs for TPU alone with their pools fixed
    (export.fixed_pools); others with a mesh keep the XLA lowering."""
    tp = mesh_devices(mesh)
    static = mesh is None or not any(map(jax.export.is_symbolic_dim, k.cache.pool.shape))
    plain = not k.steps and not v.steps
    if k.cache.ring:
        keys = a.window is not None and plain
    else:
        folded = FoldedKeys.of(k, v)
        half = k.cache.head_dim // 2
        keys = a.window is None and (plain or folded is not None and folded.n <= LANE_TILE
                                     and half % LANE_TILE == 0)
    return (keys and q.shape[1] == 1 and k.cache.table is v.cache.table
            and k.cache.heads == v.cache.heads
            and (k.cache.scale is None) == (v.cache.scale is None)
            and k.cache.heads % tp == 0 and static
            and k.cache.head_dim % LANE_TILE == 0 and v.cache.head_dim % LANE_TILE == 0)


def decode_attention_kernel(a, q, k: CacheView, v: CacheView, q_pos, mesh=None,
                            read_as_bf16: bool = False):
    """`attention_blockwise` of a decode step (`decode_kernel_fits`) by the Pallas TPU kernel,
    under a mesh in shard_map over each device's KV heads (the pools split by head,
    sharding.py; a K=V layer's k_norm weight whole): [B, 1, nh, Dv]."""
    b, _, nh, d = q.shape
    kh = k.cache.heads
    folded = FoldedKeys.of(k, v)
    freqs = None if folded is None else np.asarray(folded.rope.inv_freq, np.float32)[:folded.n]
    same = k.cache is v.cache  # K=V: one pool, its pages read once for keys and values

    quantized = k.cache.scale is not None
    # read only by linears that round it to bf16 (`read_as_bf16`): the kernel writes bf16, the
    # same bits (round to nearest even) at half the bytes, and XLA drops the convert that wrote
    # them after it (the 31B at B = 64, TP = 4: 0.068 GiB a step on chip, est.)
    out_dtype = jnp.bfloat16 if read_as_bf16 else jnp.float32
    # a NormedQuery: its projection's rows, normed and rotated in the kernel (its norm weight,
    # cos and sin the last operands)
    qnorm = q.kernel_norm() if isinstance(q, NormedQuery) else None
    q_rows = q.x if qnorm is not None else q

    def local(qg, layers, table, pos, k_pool, *rest):
        rest = list(rest)
        norm = None
        if qnorm is not None:
            norm = paged_kernel.QueryNorm(rest[-3], qnorm.eps, rest[-2], rest[-1])
            rest = rest[:-3]
        v_pool = k_pool if same else rest.pop(0)
        scales = None
        if quantized:  # rows paged, or blocks gathered (paged_kernel.scale_rows), by device
            scales = (rest[0], rest[0]) if same else (rest[0], rest[1])
        fold = None if folded is None else paged_kernel.KeyFold(rest[-1], freqs)
        return paged_kernel.paged_decode(qg, k_pool, v_pool, layers, table, pos,
                                         window=a.window, scale=a.scale, fold=fold,
                                         scales=scales, out_dtype=out_dtype, qnorm=norm,
                                         kv_heads=kh // tp)

    layers = jnp.stack([jnp.asarray(x.cache.index, jnp.int32) for x in (k, v)])
    pools = [k.cache.pool] + [v.cache.pool] * (not same)
    if quantized:  # their scale pools, split by head like them
        pools += [k.cache.scale] + [v.cache.scale] * (not same)
    # the query and the output as rows [B, heads x D], as the projections write and read them
    # (as [B, K, G, D] blocks XLA relaid both around the call: paged_kernel.paged_decode)
    tp = mesh_devices(mesh)
    args = [f32(q_rows).reshape(b, nh * d), layers, k.cache.table, q_pos[:, 0], *pools]
    if folded is not None:
        args.append(folded.w)
    if qnorm is not None:
        args += [qnorm.w, qnorm.cos, qnorm.sin]
    if mesh is None:
        out = local(*args)
    else:
        from jax.sharding import PartitionSpec

        axis, whole = mesh.axis_names[0], PartitionSpec()
        specs = [PartitionSpec(None, axis), whole, whole, whole]
        specs += [PartitionSpec(*[None] * (x.ndim - 1), axis) for x in pools]  # by head
        specs += [whole] * (folded is not None)
        specs += [whole] * (3 * (qnorm is not None))
        out = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                            out_specs=PartitionSpec(None, axis), check_vma=False)(*args)
    return out.reshape(b, 1, nh, -1)


def attention_blockwise(a, q, k, v, q_pos, k_pos, *, mesh=None, tpu_kernel: bool = False,
                        read_as_bf16: bool = False):
    """ATTENTION over paged caches reading each lane's needed blocks only: a loop over spans of
    blocks with an online softmax (running max, sum and weighted values per query row). Lane b
    needs the logical blocks from its first key (0, or a sliding window's first key behind its
    first query) to its last query's; span i reads entries lo_b + i * n .. of each lane's table
    (a sliding ring's modulo its width), and the loop stops after the span holding the last
    needed block of any lane, so a step reads a lane's live keys (its window's, for a ring) and
    never its whole table at the built context (lanes of one call run as many spans as the
    longest needs). Equal to `attention` up to float32 rounding (summation order). The loop is
    named SPAN_LOOP in the HLO metadata: its trip count depends on the data, and the traffic
    table (hlo_traffic.py) scales it at a stated context from the span, window and width.
    Plain arrays (no paged cache) go to `attention`. `tpu_kernel` (programs exported for TPU
    alone): a decode step runs the Pallas kernel instead where it fits (`decode_kernel_fits`),
    the same attention; XLA stages each gathered span in on-chip memory (docs/TPU_COST.md)."""
    kv = _view(k), _view(v)
    if None in kv:
        return attention(a, _val(q), _val(k), _val(v), q_pos, k_pos)
    k, v = kv
    if tpu_kernel and decode_kernel_fits(a, q, k, v, mesh):
        return decode_attention_kernel(a, q, k, v, q_pos, mesh, read_as_bf16)
    q = f32(_val(q))
    b, t, nh, d = q.shape
    kh, dv = k.cache.heads, v.cache.head_dim
    width = k.cache.table.shape[1]
    blocks = span_blocks(width, a.window)
    qg = q.reshape(b, t, kh, nh // kh, d)
    qp = q_pos[:, None, None, :, None]
    lo, needed, trips = span_plan(q_pos, a.window, width, blocks)
    within = jnp.arange(blocks, dtype=jnp.int32)
    # A ring's int8 scales (a 1/D share of its bytes) are gathered once, ahead of the loop: read
    # span by span, XLA on TPU prefetched the whole stacked scale pool into VMEM in every layer
    # iteration (0.37 GiB a step for the 31B at 128K, B = 1). A full layer's tables are read as
    # slices (`read_span`): gathered from, TPU copied the whole table into VMEM every span.
    ring = k.cache.ring
    ring_scales = tuple(x.cache.table_scales() if ring else None for x in (k, v))
    # A K=V layer's keys rope(V * k_norm) stay the stored cache (FoldedKeys): k_norm goes into
    # the query, and only the rotated dims of each span are widened and rotated.
    folded = FoldedKeys.of(k, v)
    if folded is not None:
        qw, q_rot = folded.query(qg)
    # int8 pools read without steps (V; K too, or folded into the query) stay int8 in the
    # dots: a key's scale multiplies its scores, a value's its probabilities. Dequantised
    # first, each span's float32 copy and its product with the scales went through on-chip
    # memory and were read by both dots (the 31B at 128K, B = 1: about 5 MiB a span of 512
    # keys, 16 GiB a step; docs/TPU_COST.md).
    stored = (v.cache.scale is not None and not v.steps
              and (folded is not None or (k.cache.scale is not None and not k.steps)))

    def read(x, entries=None, start=None, scales=None):
        """A span of view x: (slots [B, S, K, D], scales [B, S, K] or None if dequantised)."""
        if stored:
            return (x.stored_entries(entries, scales) if entries is not None
                    else x.stored_span(start, blocks))
        return (x.read_entries(entries, scales) if entries is not None
                else x.read_span(start, blocks)), None

    def by_slot(scale):  # [B, S, K] -> [B, K, 1, 1, S], beside scores [B, K, G, T, S]
        return jnp.transpose(scale, (0, 2, 1))[:, :, None, None, :]

    def step(i, carry):
        m, total, acc = carry
        if ring:  # each lane from its window's first block, modulo the ring
            rel = i * blocks + within
            entries = (lo[:, None] + rel) % width  # [B, blocks]
            slots = entry_slots(entries)
            vb, vs = read(v, entries=entries, scales=ring_scales[1])
            kb, ks = (vb, vs) if folded is not None else read(k, entries=entries,
                                                                scales=ring_scales[0])
            kp = jnp.take_along_axis(k_pos, slots, axis=1)
            fresh = rel[None, :] < needed[:, None]
        else:  # every lane from block 0: one slice of the tables; the last span may start
            # early to stay inside them, and skips the entries the span before read
            start = jnp.minimum(i * blocks, width - blocks)
            rel = start + within
            slots = jnp.broadcast_to(
                start * BLOCK_SIZE + jnp.arange(blocks * BLOCK_SIZE, dtype=jnp.int32),
                (b, blocks * BLOCK_SIZE))
            vb, vs = read(v, start=start)
            kb, ks = (vb, vs) if folded is not None else read(k, start=start)
            kp = lax.dynamic_slice_in_dim(k_pos, start * BLOCK_SIZE, blocks * BLOCK_SIZE, axis=1)
            fresh = (rel[None, :] < needed[:, None]) & (rel >= i * blocks)[None, :]
        live = jnp.repeat(fresh, BLOCK_SIZE, axis=1) & (kp >= 0)
        kp = kp[:, None, None, None, :]
        s = span_dots("scores", qw if folded is not None else qg, kb, mesh)
        if ks is not None:
            s = s * by_slot(ks)
        if folded is not None:
            s = s + folded.rotated_scores(q_rot, kb, slots, ks)
        s = s * jnp.float32(a.scale)
        mask = live[:, None, None, None, :] & (kp <= qp) & (qp >= 0)
        if a.window is not None:
            mask &= kp > qp - a.window
        m_new = jnp.maximum(m, jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1))
        base = jnp.where(jnp.isfinite(m_new), m_new, 0)
        p = jnp.where(mask, jnp.exp(s - base[..., None]), 0)
        rescale = jnp.exp(m - base)  # 0 while nothing was seen (m = -inf)
        pv = p if vs is None else p * by_slot(vs)
        acc = acc * rescale[..., None] + span_dots("values", pv, vb, mesh)
        return m_new, total * rescale + jnp.sum(p, axis=-1), acc

    rows = (b, kh, nh // kh, t)
    init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32),
            jnp.zeros((*rows, dv), jnp.float32))
    scope = SPAN_LOOP.format(span=blocks, window=a.window or 0, width=width)
    with jax.named_scope(scope):
        _, total, acc = lax.fori_loop(0, trips, step, init)
    out = acc / jnp.where(total > 0, total, 1)[..., None]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, nh, dv)


def mul_lazy(a, x, y):
    """MUL; a cache read times a weight stays lazy (K=V layers: cache_kv * k_norm)."""
    view = _view(x)
    if view is None or _view(y) is not None:
        return f32(x) * f32(y)
    w = f32(y)
    return view.then(lambda c, slots: f32(c) * w, ("mul", w))


def rope_lazy(a, x, pos):
    """ROPE; of a lazy cache read, at the positions of the slots read."""
    view = _view(x)
    if view is None:
        return rope(a, x, pos)
    return view.then(lambda c, slots: rope(a, c, jnp.take_along_axis(pos, slots, axis=1)),
                     ("rope", a, pos))


def moe(a, x, router_logits, per_expert_scale, gate_up, down, gate_up_scale=None,
        down_scale=None, *, mesh=None):
    """Each token's top-k experts. `gate_up` in the XLA layout's view of the IR's [E, 2I, H],
    [E, 2, I, H] (the same bytes: gate rows, then up rows; program.layout_shape), with per-row
    scales [E, 2, I]; `down` [E, H, I], per-row scales [E, H]. (The view comes from the
    program's arguments: reshaped here from [E, 2I, H], TPU copies a layer's whole expert
    array, as its tiled layout makes the reshape no bitcast.) With no more
    (token, expert) pairs than experts (decode) each pair's expert is sliced out of the weights
    (`_pairs`), so a step reads only the picked experts; with more (prefill) the pairs are
    sorted by expert and run as grouped matmuls (lax.ragged_dot), every expert read once.
    `mesh`: the weights come in the layout's view, each expert's intermediate dimension I split
    over the mesh's one axis (targets/xla/sharding.py): every device runs the same routing and
    pairs over its I / tp share of every expert (its gate and up rows, the matching columns of
    down) and one psum adds the devices' partial outputs, as the dense MLP's row-parallel down
    projection does. So a device reads 1 / tp of each picked expert, and no weight moves."""
    lead = x.shape[:-1]
    xf = f32(x).reshape(-1, x.shape[-1])
    k = a.top_k
    probs = jax.nn.softmax(router_logits.reshape(xf.shape[0], -1).astype(jnp.float32), axis=-1)
    w, idx = lax.top_k(probs, k)
    w = w / jnp.sum(w, -1, keepdims=True) * per_expert_scale.astype(jnp.float32)[idx]
    if gate_up.ndim != 4 or gate_up.shape[1] != 2:
        raise ValueError(f"moe: gate_up {gate_up.shape}, expected the layout's [E, 2, I, H]")
    experts = (gate_up, down, gate_up_scale, down_scale)
    if mesh is None:
        return _experts(xf, w, idx, experts).reshape(*lead, -1)
    from jax.sharding import PartitionSpec

    axis = mesh.axis_names[0]
    specs = (PartitionSpec(None, None, axis, None), PartitionSpec(None, None, axis),
             PartitionSpec(None, None, axis), PartitionSpec())
    held = tuple(arr for arr in experts if arr is not None)
    held_specs = tuple(s for arr, s in zip(experts, specs, strict=True) if arr is not None)

    def local(xf, w, idx, held):
        it = iter(held)
        mine = tuple(None if arr is None else next(it) for arr in experts)
        return lax.psum(_experts(xf, w, idx, mine), axis)

    whole = PartitionSpec()
    return jax.shard_map(local, mesh=mesh, in_specs=(whole, whole, whole, held_specs),
                         out_specs=whole, check_vma=False)(xf, w, idx, held).reshape(*lead, -1)


def _experts(xf, w, idx, experts):
    """xf [n, H]; w, idx [n, k]: sum over k of w * expert_idx(xf), over the intermediate rows
    that `experts` hold: gate_up [E, 2, I, H], down [E, H, I] and their per-row scales (or None;
    gate_up's [E, 2, I], down's [E, H]). Gate and up stay apart on their own axis, never merged
    into one [E, 2I, H] array: under TP, I is a device's share (the 26B-A4B's 704 / 4 = 176),
    and merging it with the gate/up axis would not be a bitcast of TPU's tiled layout."""
    gate_up, down, gate_up_scale, down_scale = experts
    n, k = idx.shape
    e_count = gate_up.shape[0]
    compute = jnp.float32 if gate_up.dtype == jnp.float32 else jnp.bfloat16
    if n * k <= e_count:
        return _pairs(xf, w, idx, experts, compute)
    precision = lax.Precision.HIGHEST if compute == jnp.float32 else None
    flat_e = idx.reshape(-1)
    order = jnp.argsort(flat_e, stable=True)
    tokens = (jnp.arange(n * k) // k)[order]
    group_sizes = jnp.bincount(flat_e, length=e_count).astype(jnp.int32)
    xs = xf[tokens].astype(compute)
    e_sorted = flat_e[order]

    def grouped(rows, v, scale):  # rows [E, N, K]: v [pairs, K] @ rows[e]^T, pair by pair
        y = lax.ragged_dot(v, jnp.swapaxes(rows.astype(compute), 1, 2), group_sizes,
                           precision=precision, preferred_element_type=jnp.float32)
        return y if scale is None else y * scale[e_sorted]

    gate, up = (grouped(gate_up[:, i], xs, None if gate_up_scale is None
                        else gate_up_scale[:, i]) for i in (0, 1))
    hidden = (gelu_tanh(gate) * up).astype(compute)
    y = grouped(down, hidden, down_scale) * w.reshape(-1)[order][:, None]
    return jnp.zeros_like(xf).at[tokens].add(y)


def _pairs(xf, w, idx, experts, compute):
    """`_experts` for decode: each (token, expert) pair slices its expert's rows with a dynamic
    index, which XLA folds into the layer scan's own slice of the stacked weights, so a step
    reads the picked experts' bytes only (a gather of experts made TPU copy the layer's whole
    expert array first), and multiplies them as linear() does a decode row: product and row sum
    in float32, fused with the slice and the widening."""
    gate_up, down, gate_up_scale, down_scale = experts
    n, k = idx.shape
    x = xf.astype(compute).astype(jnp.float32)

    def rows(weights, scale, e, v):
        y = jnp.sum(v * lax.dynamic_index_in_dim(weights, e, 0, False).astype(jnp.float32),
                    axis=-1)
        return y if scale is None else y * lax.dynamic_index_in_dim(scale, e, 0, False)

    out = []
    for t in range(n):
        acc = jnp.zeros(xf.shape[-1], jnp.float32)
        for j in range(k):
            e = idx[t, j]
            gate, up = rows(gate_up, gate_up_scale, e, x[t])  # [2, I]
            hidden = (gelu_tanh(gate) * up).astype(compute).astype(jnp.float32)
            acc = acc + w[t, j] * rows(down, down_scale, e, hidden)
        out.append(acc)
    return jnp.stack(out)


def centroid_head(a, h, centroid_logits, ordering, table):
    """CENTROID_HEAD: gather the top clusters' table rows, score them, scatter into [..., V]."""
    h = f32(h)
    if table.dtype != jnp.float32:
        h = h.astype(jnp.bfloat16).astype(jnp.float32)
    lead, vocab = h.shape[:-1], table.shape[0]
    _, top = lax.top_k(f32(centroid_logits), a.top_k)  # ties: the lower cluster first
    ids = ordering.reshape(a.clusters, -1)[top].reshape(*lead, -1)  # [..., N]
    rows = jnp.take(table, ids, axis=0).astype(jnp.float32)  # [..., N, D]
    sel = jnp.einsum("...d,...nd->...n", h, rows, precision=lax.Precision.HIGHEST,
                     preferred_element_type=jnp.float32)
    n = math.prod(lead)
    flat_ids, flat_sel = ids.reshape(n, -1), sel.reshape(n, -1)
    out = jnp.broadcast_to(jnp.min(flat_sel, axis=-1, keepdims=True) - 1, (n, vocab))
    out = out.at[jnp.arange(n)[:, None], flat_ids].set(flat_sel)
    return out.reshape(*lead, vocab)


def mix32(x):
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def uniform(seed, step, stream: int = 0):
    """float32 [B] in [0, 1), 24 bits, from (seed, step) [B]: stream 0 is the sampler's
    (ir/ops.py sampling_uniform); other streams hash it again with the stream id, so the
    speculative rejection rule's draws (targets/xla/rejection.py) are independent of it."""
    bits = mix32(mix32(lax.bitcast_convert_type(seed, jnp.uint32))
                 ^ lax.bitcast_convert_type(step, jnp.uint32))
    if stream:
        bits = mix32(bits ^ jnp.uint32(stream))
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


def sorted_probs(logits, temperature, top_k, top_p, order=None, values=None):
    """The sampling distribution of rows [B, V] at temperature > 0, in descending-logit order:
    (order [B, V], probs [B, V] (zero outside top_k and top_p; not renormalised after the
    top_p cut), keep [B, V]). Given `order` and `values` [B, n] (the n largest logits and their
    ids, as lax.top_k gives them), the same over those n only, which holds the whole
    distribution of rows with 0 < top_k <= n."""
    if order is None:  # jnp.argsort's stable sort, its keys carried out: no gather of values
        ids = lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        neg, order = lax.sort((-logits, ids), num_keys=1, is_stable=True)
        values = -neg  # exactly the logits (a sign flip each way)
    v = order.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    sv = values / t
    ranks = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, ranks < top_k[:, None], True)
    sv = jnp.where(keep, sv, -jnp.inf)
    probs = jnp.exp(sv - sv[:, :1])
    probs = probs / jnp.sum(probs, -1, keepdims=True)
    keep &= (jnp.cumsum(probs, -1) - probs) < top_p[:, None]
    return order, jnp.where(keep, probs, 0), keep


SAMPLE_TOP_K = 64  # rows sampled with 0 < top_k <= this draw from lax.top_k's candidates
TOP_K_BIN = 128  # top_k_binned's bins: one lane row of a TPU tile


def top_k_binned(x, k: int, width: int | None = None):
    """lax.top_k(x, k) of rows x [B, V]: the same values and ids (descending in lax.top_k's
    order, -0.0 below 0.0, ties by the lower id), reading x once. The k largest lie in the k bins
    of `width` consecutive ids whose maxima rank highest (ties by the lower bin): a bin left out
    has k maxima ranking above all its elements. So a reduce over the row, then lax.top_k over
    the bins' maxima and over those k bins' elements (in id order). For one row: on TPU
    lax.top_k sorts a single row whole (V = 262144 on v6e: 15.4 MiB on chip, this 4.0), while
    2 or more rows it reads once (B MiB) and this relays them out (12 to 210 MiB at B = 2 to
    64). Rows of fewer than 2 * k bins: lax.top_k itself."""
    b, v = x.shape
    width = width or TOP_K_BIN
    bins = -(-v // width)
    if bins < 2 * k:
        return lax.top_k(x, k)
    if v % width:  # padded with -inf at ids above v: below or tied with (after) every logit
        x = jnp.concatenate([x, jnp.full((b, bins * width - v), -jnp.inf, x.dtype)], -1)
    rows = x.reshape(b, bins, width)
    bits = lax.bitcast_convert_type(rows, jnp.int32)
    order = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # lax.top_k's total order on floats, as ints
    _, top = lax.top_k(jnp.max(order, -1), k)
    top = jnp.sort(top, -1)  # candidates in id order: lax.top_k's ties go to the lower id
    cands = jnp.take_along_axis(rows, top[:, :, None], axis=1).reshape(b, k * width)
    values, pos = lax.top_k(cands, k)
    ids = jnp.take_along_axis(top, pos // width, -1) * width + pos % width
    return values, ids.astype(jnp.int32)


def sample_without_sort(temperature, top_k):
    """Whether every row is served by SAMPLE's greedy or top-k branch (no sort): bool []."""
    return jnp.all((temperature <= 0) | ((top_k > 0) & (top_k <= SAMPLE_TOP_K)))


def sample_branch(temperature, top_k, sort=True):
    """SAMPLE's branch for rows with these parameters (int32 []): 0 every row greedy, 1 every
    sampled row served by the top-k candidates (`sample_without_sort`) or sort=False, 2 the
    sort."""
    return jnp.where(jnp.all(temperature <= 0), 0,
                     jnp.where(sample_without_sort(temperature, top_k) | (not sort), 1, 2))


def sample(a, logits, temperature, top_k, top_p, seed, step, greedy=None, sort=True,
           branch=None):
    """SAMPLE: three branches, of which a step runs one. Every row greedy: the argmax only. Every
    sampled row with 0 < top_k <= SAMPLE_TOP_K: the rule over the SAMPLE_TOP_K largest logits
    (lax.top_k: descending, ties by the lower id, as the stable sort orders them), the same
    draw, since the rest have probability zero. Otherwise the full-vocabulary sort (the 31B at
    B = 64: 2.6 GiB of a step's HBM traffic, est. on v6e). `greedy`: the argmax of these
    logits if the caller has it already (jnp.argmax's int32; the decode program's, which its
    log-probabilities read too), so that no pass over the vocabulary repeats it. sort=False:
    the first two branches only, for a caller that runs this only where
    `sample_without_sort` holds (the same tokens there). `branch`: the branch (`sample_branch`)
    chosen by a caller over a whole batch of which these rows are one device's share
    (sampler.split_by_rows), so that every share takes the branch the whole batch would: the
    top-k branch and the sort draw the same tokens only in exact arithmetic (their sums run over
    64 values and over the whole row), so neither is taken where TP = 1 would take the other."""
    logits = logits.astype(jnp.float32)
    if greedy is None:
        greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def sampled(candidates):
        u = uniform(seed, step)
        order = values = None
        if candidates:
            k = min(candidates, logits.shape[-1])
            # TPU's lax.top_k sorts a single row whole, and reads 2 or more rows once (v6e)
            values, order = (top_k_binned if logits.shape[0] == 1 else lax.top_k)(logits, k)
        order, probs, keep = sorted_probs(logits, temperature, top_k, top_p, order, values)
        cum = jnp.cumsum(probs, -1)
        i = jnp.sum(cum <= u[:, None] * cum[:, -1:], axis=-1)
        i = jnp.minimum(i, jnp.sum(keep, -1) - 1)
        tok = jnp.take_along_axis(order, i[:, None], axis=-1)[:, 0].astype(jnp.int32)
        return jnp.where(temperature > 0, tok, greedy)

    branches = [lambda: greedy, lambda: sampled(SAMPLE_TOP_K), lambda: sampled(0)]
    if branch is None:
        branch = sample_branch(temperature, top_k, sort)
    with jax.named_scope(BRANCHES.format(name="sample")):  # the traffic table's step cases
        return lax.switch(branch, branches if sort else branches[:2])


def filtered_probs(logits, temperature, top_k, top_p):
    """float32 [B, V]: the distribution SAMPLE draws each row of logits [B, V] from, in vocabulary
    order: the temperature softmax cut to top_k and top_p and renormalised; at temperature 0 the
    point mass on the argmax."""
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    greedy = jax.nn.one_hot(jnp.argmax(logits, axis=-1), v, dtype=jnp.float32)

    def sampled(_):
        order, probs, _ = sorted_probs(logits, temperature, top_k, top_p)
        probs = probs / jnp.sum(probs, -1, keepdims=True)
        out = jnp.zeros_like(probs).at[jnp.arange(b)[:, None], order].set(probs)
        return jnp.where(temperature[:, None] > 0, out, greedy)

    return lax.cond(jnp.all(temperature <= 0), lambda _: greedy, sampled, None)


LOWERINGS: dict[Op, Callable] = {
    Op.EMBED: embed,
    Op.LINEAR: linear,
    Op.RMSNORM: rmsnorm,
    Op.ADD: lambda a, x, y: f32(x) + f32(y),
    Op.MUL: lambda a, x, y: f32(x) * f32(y),
    Op.SCALE: lambda a, x: f32(x) * jnp.float32(a.value),
    Op.GELU_TANH: lambda a, x: gelu_tanh(f32(x)),
    Op.SOFTCAP: lambda a, x: jnp.float32(a.cap) * jnp.tanh(f32(x) / jnp.float32(a.cap)),
    Op.ROPE: rope,
    Op.KV_WRITE: TakesPaged(kv_write),
    Op.CACHE_POSITIONS: cache_positions,
    Op.ATTENTION: attention,
    Op.MOE: moe,
    Op.SAMPLE: sample,
    Op.RESIDUAL_RMSNORM: residual_rmsnorm,
    Op.GATED_LINEAR: gated_linear,
    Op.MULTI_LINEAR: multi_linear,
    Op.SLICE_LAST: lambda a, x: x[..., a.start:a.stop],
    Op.CONCAT: lambda a, x, y: jnp.concatenate([f32(x), f32(y)], axis=-1),
    Op.CENTROID_HEAD: centroid_head,
}
# Paged programs attend blockwise, reading their caches (and K=V layers' k_norm and RoPE) span by
# span, each lane's needed blocks only.
BLOCKWISE_LOWERINGS: dict[Op, Callable] = {
    **LOWERINGS,
    Op.MUL: TakesPaged(mul_lazy),
    Op.ROPE: TakesPaged(rope_lazy),
    Op.ATTENTION: TakesPaged(attention_blockwise, takes_read_as_bf16=True),
}


def decode_mlp_kernel(norm, x, w, names, scales, residual=None, *, stacked, mesh=None,
                      interpret=False):
    """A decode step's gated MLP (`gated_mlps`) by the Pallas TPU kernel
    (targets/xla/mlp_kernel.py), or None where it does not apply: x [B, 1, H] with B > 1
    (one row: `linear`'s multiply-reduce reads every weight byte once already), the gate, up
    and down weights (PARAM `names`; `stacked(name)`: the layer scan's (stacked array [n,
    ...], the layer's index in it)) int8 with their per-row scales or bf16 without, [n, I, H]
    / [n, H, I] with I / tp a multiple of the kernel's tile and H of 128 lanes. `norm`: the
    RMSNORM's attrs, `w` its weight, `scales` the layer's (sg, su, sd), None each without.
    `residual` (h, the post-norm's attrs, its weight, the output projection's per-row scale or
    None): x is the attention's output y (without that scale, which the kernel applies) and
    the norm's input the stream h + rmsnorm(y), returned first. Returns the down LINEAR's value
    (with `residual`: (the stream, it)). Under a mesh the kernel runs in shard_map over the
    column- and row-parallel splits of sharding.py (gate and up by rows, down by columns),
    its partial sums added by an all-reduce, then scaled, as XLA's partitioner computes the
    op-by-op form."""
    from rvcompile.targets.xla import mlp_kernel

    (wg, index), (wu, _), (wd, _) = map(stacked, names)
    sg, su, sd = scales
    tp = mesh_devices(mesh)
    b, t, h = x.shape
    n, width = wg.shape[:2]
    quantized = wg.dtype == jnp.int8 and all(s is not None for s in scales)
    plain = wg.dtype == jnp.bfloat16 and all(s is None for s in scales)
    if not (t == 1 and b > GEMV_MAX_ROWS and (quantized or plain)
            and wu.dtype == wg.dtype == wd.dtype and wu.shape == wg.shape
            and wd.shape == (n, h, width) and wg.shape == (n, width, h)
            and width % tp == 0 and mlp_kernel.tile_rows(width // tp) is not None
            and h % LANE_TILE == 0 and not any(map(jax.export.is_symbolic_dim, x.shape))):
        return None
    layer = jnp.asarray(index, jnp.int32).reshape(1)
    stream = []
    if residual is not None:
        stream = [f32(residual[0]).reshape(b, h), f32(residual[2]).reshape(1, h)]
        if residual[3] is not None:
            stream.append(f32(residual[3]).reshape(1, h))

    def local(rows, w, layer, wg, wu, wd, *rest):
        rest = list(rest)
        s = (rest.pop(0), rest.pop(0)) if quantized else ()
        res = None if residual is None else (*rest[:2], residual[1].eps, (rest[2:] or [None])[0])
        *hs, y = mlp_kernel.gated_mlp(rows, w, norm.eps, layer, wg, wu, wd, *s, residual=res,
                                      interpret=interpret)
        return (*hs, y if mesh is None else lax.psum(y, mesh.axis_names[0]))

    args = [f32(x).reshape(b, h), f32(w).reshape(1, h), layer, wg, wu, wd]
    if quantized:
        args += [f32(sg).reshape(1, width), f32(su).reshape(1, width)]
    args += stream
    if mesh is None:
        outs = local(*args)
    else:
        from jax.sharding import PartitionSpec

        axis, whole = mesh.axis_names[0], PartitionSpec()
        specs = [whole] * 3 + [PartitionSpec(None, axis, None)] * 2
        specs += [PartitionSpec(None, None, axis)] + [PartitionSpec(None, axis)] * 2 * quantized
        specs += [whole] * len(stream)
        outs = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                             out_specs=(whole,) * (1 + (residual is not None)),
                             check_vma=False)(*args)
    *hs, y = (o.reshape(b, t, h) for o in outs)
    y = ScaledRows(y, sd) if quantized else y  # read as y * sd: lazy for LayerEnd
    return (hs[0], y) if hs else y


def decode_projections_kernel(norm, x, w, names, scales, heads, tails=None, *, stacked,
                              mesh=None, interpret=False):
    """A decode step's RMSNORM and the projections that read it (`normed_projections`) by the
    Pallas TPU kernel (targets/xla/proj_kernel.py): each projection's value [B, 1, N] (a
    tail's: its last node's, [B, 1, heads, D]), or None where it does not apply: x [B, 1, H]
    with B > 1 (one row: `linear`'s multiply-reduce), the weights (PARAM `names`,
    `stacked(name)` as for decode_mlp_kernel) all int8 with per-row `scales` or all bf16
    without, [n, N, H] with N / tp whole 128-lane tiles, each split by whole heads under a mesh
    (`heads` each; sharding.py splits q, k and v by rows where their heads divide by tp, and
    keeps a k or v projection of fewer heads whole: declined). `tails`: per projection None or
    (the RMSNORM's attrs, its weight or None, the ROPE's attrs and positions or None, the
    cache's dtype); a tail's rows come out in the cache's dtype where that is bf16 (its write
    rounds them to it: the same bits), else float32."""
    from rvcompile.targets.xla import proj_kernel

    end = x if isinstance(x, LayerEnd) else None  # the previous layer's end, made in the kernel
    if end is not None:
        x = end.h
    ws = [stacked(name) for name in names]
    index = ws[0][1]
    ws = [a for a, _ in ws]
    tp = mesh_devices(mesh)
    b, t, h = x.shape
    n = ws[0].shape[0]
    quantized = all(a.dtype == jnp.int8 for a in ws) and all(s is not None for s in scales)
    plain = all(a.dtype == jnp.bfloat16 for a in ws) and all(s is None for s in scales)
    rows = [a.shape[1] for a in ws]
    tails = tails or [None] * len(ws)
    tail_heads = [None if tl is None else k // tp for tl, k in zip(tails, heads, strict=True)]
    if not (t == 1 and b > GEMV_MAX_ROWS and (quantized or plain)
            and all(a.shape == (n, m, h) for a, m in zip(ws, rows, strict=True))
            and all(k % tp == 0 and m % tp == 0 for k, m in zip(heads, rows, strict=True))
            and proj_kernel.grid_steps([m // tp for m in rows], tail_heads) is not None
            and all(tl is None or (m // k) % LANE_TILE == 0
                    for tl, m, k in zip(tails, rows, heads, strict=True))
            and h % LANE_TILE == 0 and not any(map(jax.export.is_symbolic_dim, x.shape))):
        return None
    count = len(ws)
    kernel_tails, tail_args = [], []
    for tl, m, k in zip(tails, rows, heads, strict=True):
        if tl is None:
            kernel_tails.append(None)
            continue
        attrs, tw, rope_at, dtype = tl
        cos = sin = None
        if rope_at is not None:  # lower.rope's angles at each lane's position
            ang = (_val(rope_at[1]).astype(jnp.float32)[:, 0, None]
                   * jnp.asarray(rope_at[0].inv_freq, jnp.float32))
            cos, sin = jnp.cos(ang), jnp.sin(ang)
        kernel_tails.append(proj_kernel.Tail(
            m // k, float(attrs.eps), jnp.bfloat16 if dtype == "bfloat16" else jnp.float32,
            None if tw is None else f32(tw), cos, sin))
        tail_args += [a for a in (kernel_tails[-1].w, cos, sin) if a is not None]

    end_args = []
    if end is not None:  # y, its scale (if any), the post-norm's weight, the layer scalar
        end_args = [f32(end.y).reshape(b, h)] + ([f32(end.s)] if end.s is not None else [])
        end_args += [f32(end.w), f32(end.scalar)]

    def local(rows_, w_, layer, *rest):
        rest = list(rest)
        ws_ = [rest.pop(0) for _ in range(count)]
        s = [rest.pop(0) for _ in range(count)] if quantized else None
        local_tails = [None if tl is None else dataclasses.replace(
            tl, **{f: rest.pop(0) for f in ("w", "cos", "sin") if getattr(tl, f) is not None})
            for tl in kernel_tails]
        res = None
        if end is not None:
            y_ = rest.pop(0)
            s_ = rest.pop(0) if end.s is not None else None
            res = proj_kernel.Residual(y_, s_, rest[0], float(end.norm.eps), rest[1])
        return proj_kernel.normed_projections(rows_, w_, norm.eps, layer, ws_, s, local_tails,
                                              interpret=interpret, residual=res)

    args = [f32(x).reshape(b, h), f32(w).reshape(1, h), jnp.asarray(index, jnp.int32).reshape(1),
            *ws]
    if quantized:
        args += [f32(sc) for sc in scales]
    args += tail_args + end_args
    if mesh is None:
        outs = local(*args)
    else:
        from jax.sharding import PartitionSpec

        axis, whole = mesh.axis_names[0], PartitionSpec()
        specs = [whole] * 3 + [PartitionSpec(None, axis, None)] * count
        specs += [PartitionSpec(axis)] * count * quantized + [whole] * len(tail_args)
        specs += [whole] * len(end_args)
        outs = jax.shard_map(local, mesh=mesh, in_specs=tuple(specs),
                             out_specs=(PartitionSpec(None, axis),) * count
                             + (whole,) * (end is not None), check_vma=False)(*args)
    made = tuple(o.reshape(b, t, -1) if tl is None else o.reshape(b, t, k, -1)
                 for o, tl, k in zip(outs[:count], tails, heads, strict=True))
    # with the previous layer's end: its stream [B, 1, H] last
    return made if end is None else (*made, outs[count].reshape(b, t, h))


def _projection_operands(g: Graph, projs: tuple[Projection, ...], args: dict, param):
    """decode_projections_kernel's names, scales, heads and tails of `projs`, at their norm,
    before their own nodes: their PARAMs through `param`, a ROPE's positions from `args` (a
    tail whose positions are no ARG is left to XLA: None)."""
    nodes = g.nodes

    def leaf(i: int):
        return param(nodes[i].attrs.name) if nodes[i].op is Op.PARAM else args[nodes[i].attrs.name]

    names = [nodes[nodes[p.linear].inputs[1]].attrs.name for p in projs]
    scales = [leaf(nodes[p.linear].inputs[2]) if len(nodes[p.linear].inputs) > 2 else None
              for p in projs]
    tails = []
    for p in projs:
        if p.norm is None:
            tails.append(None)
            continue
        norm = nodes[p.norm]
        if p.rope is not None and nodes[nodes[p.rope].inputs[1]].op is not Op.ARG:
            tails.append(None)
            continue
        rope = None if p.rope is None else (nodes[p.rope].attrs,
                                            leaf(nodes[p.rope].inputs[1]))
        tails.append((norm.attrs, leaf(norm.inputs[1]) if len(norm.inputs) == 2 else None,
                      rope, p.cache_dtype))
    return names, scales, [p.heads for p in projs], tails


def run_graph(g: Graph, args: dict[str, Any], param: Callable[[str], Any],
              lowerings: dict[Op, Callable] = LOWERINGS,
              mlp: Callable | None = None, proj: Callable | None = None,
              lazy_end: bool = False) -> dict[str, Any]:
    """Trace graph `g`: ARGs from `args`, PARAMs from `param(name)`; returns its named outputs.
    `lowerings` may replace ops' lowerings (the paged program sizes CACHE_POSITIONS). `mlp`:
    the gated MLPs (`gated_mlps`) go to it whole at their down LINEAR, as mlp(the RMSNORM's
    attrs, x, its weight, the gate, up and down weights' PARAM names, their scales' values or
    None each[, (h, the post-norm's attrs, its weight, the output projection's scale or None)
    of a residual add]); where it answers None (decode_mlp_kernel declines), op by op.
    `proj`: likewise the RMSNORMs whose readers are all projections (`normed_projections`,
    outside those MLPs), at the norm, as proj(its attrs, x, its weight, the projections'
    names, scales, heads and tails: `_projection_operands`) -> each projection's last value
    (decode_projections_kernel), the nodes it replaces skipped. `lazy_end` (with `proj`): the
    output h, where it is a layer's end (`layer_end`) of the MLP kernel's down projection
    (`ScaledRows`), is returned as a `LayerEnd` for the next layer's projections kernel; an ARG
    given a LayerEnd whose first reader is such a kernel's norm hands it to the kernel, which
    returns the rows too (for the ARG's other readers), else it is read once op by op."""
    vals: list[Any] = []
    sym: dict[str, int] = {}
    g_reads = reads(g)
    bf16 = read_as_bf16(g, g_reads)
    # the query lazy only for an ATTENTION lowering that takes lazy values (attention_blockwise)
    norms, ropes = (lazy_queries(g, g_reads) if isinstance(lowerings.get(Op.ATTENTION), TakesPaged)
                    else (set(), set()))
    mlps = gated_mlps(g, g_reads) if mlp is not None else {}
    deferred = {j for c in mlps.values() for j in c.inner}  # computed at their down LINEAR
    projs = {k: v for k, v in normed_projections(g, g_reads).items()
             if k not in deferred} if proj is not None else {}
    ready: dict[int, Any] = {}  # projections made with their norm
    end = layer_end(g, g_reads) if lazy_end and proj is not None else None
    end_nodes = set(end[:3]) if end is not None else set()  # made last, or left lazy
    # ARGs a LayerEnd may reach a projections kernel through: their first reader its norm
    lazy_args = {i for i, n in enumerate(g.nodes)
                 if n.op is Op.ARG and g_reads[i] and proj is not None
                 and min(r for r, _ in g_reads[i]) in projs
                 and g.nodes[min(r for r, _ in g_reads[i])].inputs[0] == i}

    def lower_node(i: int, n) -> Any:
        ins = [vals[j] for j in n.inputs]
        fn = lowerings[n.op]
        if not isinstance(fn, TakesPaged):
            return fn(n.attrs, *(_val(x) for x in ins))
        if fn.takes_read_as_bf16:
            return fn(n.attrs, *ins, read_as_bf16=i in bf16)
        return fn(n.attrs, *ins)

    def projections(i: int, n):
        """The projections kernel's values at norm i, or None (declined; a LayerEnd input
        then read op by op, once)."""
        x = vals[n.inputs[0]]
        operands = _projection_operands(g, projs[i], args, param)
        made = proj(n.attrs, x if isinstance(x, LayerEnd) else _val(x), _val(vals[n.inputs[1]]),
                    *operands)
        if isinstance(x, LayerEnd):
            if made is None:
                vals[n.inputs[0]] = x.read()
            else:
                *made, vals[n.inputs[0]] = made
        return None if made is None else (made, operands[3])

    for i, n in enumerate(g.nodes):
        if i in deferred or i in end_nodes:
            v = None
        elif i in ready:
            v = ready.pop(i)
        elif i in projs and (made := projections(i, n)) is not None:
            for pr, value, tail in zip(projs[i], *made, strict=True):
                if tail is None:  # made up to its LINEAR: the rest op by op
                    pr = Projection(pr.linear, pr.heads, pr.reshape)
                ready[pr.last] = value
                ready.update(dict.fromkeys(pr.skipped))
            v = None  # read by those projections only
        elif i in mlps:
            c, nodes = mlps[i], g.nodes
            linears = [nodes[j] for j in (c.gate, c.up, c.down)]
            names = [nodes[lin.inputs[1]].attrs.name for lin in linears]
            scales = [vals[lin.inputs[2]] if len(lin.inputs) > 2 else None for lin in linears]
            w = _val(vals[nodes[c.norm].inputs[1]])
            if c.add is None:
                v = mlp(nodes[c.norm].attrs, _val(vals[nodes[c.norm].inputs[0]]), w, names,
                        scales)
            else:  # the residual add's stream comes back too, for its other readers
                y, w_r = (_val(vals[j]) for j in nodes[c.post].inputs)
                s_o = None
                if c.proj is not None:  # the output projection's dot; its scale in the kernel
                    o = nodes[c.proj]
                    y = lower_node(c.proj, dataclasses.replace(o, inputs=o.inputs[:2]))
                    s_o = _val(vals[o.inputs[2]])
                v = mlp(nodes[c.norm].attrs, y, w, names, scales,
                        (_val(vals[nodes[c.add].inputs[0]]), nodes[c.post].attrs, w_r, s_o))
                if v is not None:
                    vals[c.add], v = v
            if v is None:
                for j in c.inner:
                    vals[j] = lower_node(j, nodes[j])
                v = lower_node(i, n)
        elif i in norms:
            v = NormedQuery(_val(vals[n.inputs[0]]), _val(vals[n.inputs[1]]), n.attrs)
        elif i in ropes:
            v = dataclasses.replace(vals[n.inputs[0]], rope=n.attrs, pos=_val(vals[n.inputs[1]]))
        elif n.op is Op.ARG:
            v = args[n.attrs.name]
            if isinstance(v, LayerEnd) and i not in lazy_args:
                v = v.read()
            shape = v.shape
            for d, actual in zip(n.shape, shape, strict=True):
                if isinstance(d, str):
                    sym.setdefault(d, actual)
        elif n.op is Op.PARAM:
            v = param(n.attrs.name)
        elif n.op is Op.RESHAPE:
            v = _val(vals[n.inputs[0]]).reshape(
                [sym[d] if isinstance(d, str) else d for d in n.attrs.shape])
        else:
            v = lower_node(i, n)
        vals.append(v)
    if end is not None:  # the layer's end: lazy for the next layer's kernel, else op by op
        r, a, m, h0 = end
        y, w = vals[g.nodes[r].inputs[0]], g.nodes[r].inputs[1]

        def make():
            for j in (r, a, m):
                vals[j] = lower_node(j, g.nodes[j])
            return vals[m]

        if isinstance(y, ScaledRows) and not isinstance(vals[h0], LayerEnd):
            vals[m] = LayerEnd(_val(vals[h0]), y.x, y.s, _val(vals[w]), g.nodes[r].attrs,
                               _val(vals[g.nodes[m].inputs[1]]), make)
        else:
            make()
    return {name: vals[i] if isinstance(vals[i], LayerEnd) else
            vals[i].read() if isinstance(vals[i], ScaledRows) else vals[i]
            for name, i in g.outputs}
