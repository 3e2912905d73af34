"""A Pallas TPU kernel for a decode step's input norm and the projections that read it (a layer's
q, k and v): the normed rows made once in VMEM, every projection's dot from them.

Contract. `normed_projections(x, w, eps, layer, weights, scales)` is what lower.py computes, op
by op, for `[linear(p, rmsnorm(x, w, eps)) for p in weights]`: x float32 [R, H] (R rows, a
decode step's lanes), `w` [H] the norm's weight; the weights stacked by layer as the layer scan
holds them, [n, N_p, H] each, int8 or bf16, `layer` int32 [1] which one; `scales` the layer's
per-row scales [N_p] (int8) or None (bf16). Returns float32 [R, N_p] each. The arithmetic is
lower.py's: lower.rmsnorm's (a row's mean of squares in the kernel), the normed rows rounded to
bf16, bf16 x bf16 dots with float32 results over all of H, times the scales. `tails` (one per
projection, None: none): a projection whose heads of D columns go on, each, through an RMSNORM
(`Tail.w` its weight or None, `eps`) and a RoPE by halves (`cos`, `sin` [R, D / 2] each row's,
or None: none) before a cache write, as lower.rmsnorm and lower.rope compute them: its output is
those rows, in `dtype` (the cache's bf16 where the write would round them to it: the same
bits).

Why a kernel (docs/TPU_COST.md, branch h/tpu19): XLA writes the normed rows to on-chip memory
(bf16) and reads them in each projection's dot (2 MiB a layer for the 31B at B = 64, TP = 4),
and moves k's and v's heads into sublanes for their norms and back for the cache rows (about 5
MiB a sliding layer). Here a grid step reads a tile of each weight's rows (DMA'd from HBM by
Pallas' pipeline, double-buffered; tile_p = N_p / steps, the same steps for all, whole heads of
a projection with a tail) and writes those columns of each output; x is read once.

`residual` (`Residual`, branch h/b64last): x is the previous layer's stream h0 and the kernel
first makes that layer's end, (h0 + rmsnorm(y * s, w_r)) * scalar (its post-FFW norm of the down
projection's all-reduced dot y, residual add and layer scalar: lower.LayerEnd), returned last,
and norms it; XLA's two passes over those rows (5.3 MiB a layer for the 31B at B = 64, TP = 4,
est.) are spared.

The weights are operands whole (every layer's), their index maps picking the layer from the
scalar-prefetched `layer`, and the traffic table counts them as one layer's bytes (named scope
mlp_kernel.PALLAS_STACKED, as for the gated MLP kernel).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from rvcompile.targets.xla.mlp_kernel import (
    PALLAS_STACKED,
    VMEM_LIMIT,
    dot_nt,
    hbm,
    norm_rows,
)

LANES = 128  # an output tile's columns are whole 128-lane tiles


@dataclass(frozen=True)
class Tail:
    """A projection's heads' RMSNORM and RoPE before their cache write (see the module
    docstring)."""

    d: int  # head dim
    eps: float
    dtype: jnp.dtype  # the output's
    w: jax.Array | None = None  # [D]
    cos: jax.Array | None = None  # [R, D / 2]
    sin: jax.Array | None = None


def grid_steps(rows: list[int], heads: list[int | None]) -> int | None:
    """Grid steps over projections of `rows` output rows each: the most that leave every one
    whole 128-lane tiles a step, and whole heads (`heads` each, None: any columns) (None if
    some projection has no whole tiles)."""
    if any(r % LANES for r in rows):
        return None
    return math.gcd(*(r // LANES for r in rows), *(k for k in heads if k is not None))


class _TailShape(NamedTuple):
    """What the kernel body knows of a Tail: its arrays are operands."""

    d: int
    eps: float
    weighted: bool
    roped: bool


def _tail(y, tail: _TailShape, w, cos, sin):
    """Each head of y [R, heads * D] normed (lower.rmsnorm) and rotated by halves (lower.rope)."""
    d, out = tail.d, []
    for j in range(y.shape[1] // d):
        x = y[:, j * d:(j + 1) * d]
        x = x * lax.pow(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(tail.eps),
                        jnp.float32(-0.5))
        if w is not None:
            x = x * w
        if cos is not None:
            x1, x2 = x[:, :d // 2], x[:, d // 2:]
            x = jnp.concatenate([x1 * cos + (-x2) * sin, x2 * cos + x1 * sin], axis=-1)
        out.append(x)
    return jnp.concatenate(out, axis=-1) if len(out) > 1 else out[0]


def _kernel(layer_ref, x_ref, w_ref, *rest, count, scaled, eps, tails, residual=None):
    weights, rest = rest[:count], list(rest[count:])
    scales = [rest.pop(0) for _ in range(count)] if scaled else [None] * count
    extra = []  # each tail's weight, cos and sin refs (None where it has none)
    for t in tails:
        extra.append(None if t is None else tuple(
            rest.pop(0) if has else None
            for has in (t.weighted, t.roped, t.roped)))
    res = None
    if residual is not None:  # y, its scale (or None), the post-norm's weight, the scalar
        res = (rest.pop(0), rest.pop(0) if residual[1] else None, rest.pop(0), rest.pop(0))
    *outs, xn_ref = rest
    stream_ref = outs.pop() if residual is not None else None

    @pl.when(pl.program_id(0) == 0)
    def _():
        x = x_ref[...]
        if res is not None:  # the previous layer's end: (h + rmsnorm(y * s, w_post)) * scalar
            y_ref, s_ref, wp_ref, c_ref = res
            y = y_ref[...] if s_ref is None else y_ref[...] * s_ref[...]
            x = (x + norm_rows(y, wp_ref[...], residual[0])) * c_ref[...]
            stream_ref[...] = x
        xn_ref[...] = norm_rows(x, w_ref[...], eps).astype(jnp.bfloat16)

    xn = xn_ref[...]
    for w, s, o, t, e in zip(weights, scales, outs, tails, extra, strict=True):
        y = dot_nt(xn, w[...].astype(jnp.bfloat16))
        if scaled:
            y = y * s[...]
        if t is not None:
            y = _tail(y, t, *(None if r is None else r[...] for r in e))
        o[...] = y.astype(o.dtype)


@dataclass(frozen=True)
class Residual:
    """The previous layer's end made in the kernel: x is its stream h, and the kernel's input
    rows are (h + rmsnorm(y * s, w, eps)) * scalar (lower.rmsnorm's, lower.py's ADD's and
    MUL's arithmetic; `s` the down projection's per-row scale or None), returned too."""

    y: jax.Array  # [R, H]
    s: jax.Array | None  # [H]
    w: jax.Array  # [H]
    eps: float
    scalar: jax.Array  # [1]


def normed_projections(x, w, eps, layer, weights, scales=None, tails=None, *, interpret=False,
                       residual: Residual | None = None):
    """See the module docstring. `interpret`: run in a Pallas interpreter (True, or
    pltpu.InterpretParams; any device: the tests' check of its values). `residual`: the
    projections of (x + rmsnorm(y * s, w_r)) * scalar (`Residual`), those rows returned last
    (float32 [R, H], read from HBM and written there, as x is: its other reader is the MLP
    kernel's residual add)."""
    r, h = x.shape
    n = weights[0].shape[0]
    rows = [wp.shape[1] for wp in weights]
    tails = tails or [None] * len(weights)
    steps = grid_steps(rows, [None if t is None else m // t.d
                              for t, m in zip(tails, rows, strict=True)])
    if steps is None or any(wp.shape != (n, m, h) for wp, m in zip(weights, rows, strict=True)):
        raise ValueError(f"weights {[wp.shape for wp in weights]}: need [n, N, H] each, N whole "
                         f"{LANES}-lane tiles")
    tiles = [m // steps for m in rows]
    whole = lambda i, layer: (0, 0)  # noqa: E731 -- x and the norm weight: one block
    in_specs = [pl.BlockSpec((r, h), whole), pl.BlockSpec((1, h), whole)]
    in_specs += [pl.BlockSpec((None, t, h), lambda i, layer: (layer[0], i, 0)) for t in tiles]
    # x read from HBM too: left to XLA, the residual stream was made in VMEM for this call and
    # then copied to HBM for the MLP kernel's residual add (2.6 MiB a layer, the 31B at B =
    # 64, TP = 4, est.)
    operands = [*hbm((x.astype(jnp.float32),), interpret), w.astype(jnp.float32).reshape(1, h),
                *hbm(weights, interpret)]
    scaled = scales is not None
    if scaled:
        in_specs += [pl.BlockSpec((1, t), lambda i, layer: (0, i)) for t in tiles]
        operands += [s.astype(jnp.float32).reshape(1, m) for s, m in zip(scales, rows,
                                                                            strict=True)]
    for t in tails:  # whole blocks: a head's norm weight, every row's cos and sin
        if t is not None and t.w is not None:
            in_specs.append(pl.BlockSpec((1, t.d), whole))
            operands.append(t.w.astype(jnp.float32).reshape(1, t.d))
        if t is not None and t.cos is not None:
            in_specs += [pl.BlockSpec((r, t.d // 2), whole)] * 2
            operands += [a.astype(jnp.float32).reshape(r, t.d // 2) for a in (t.cos, t.sin)]
    out_specs = [pl.BlockSpec((r, t), lambda i, layer: (0, i)) for t in tiles]
    out_shape = [jax.ShapeDtypeStruct((r, m), jnp.float32 if t is None else t.dtype)
                 for m, t in zip(rows, tails, strict=True)]
    if residual is not None:  # y from HBM (the all-reduce's output), the stream out to HBM
        in_specs.append(pl.BlockSpec((r, h), whole))
        operands += hbm((residual.y.astype(jnp.float32),), interpret)
        if residual.s is not None:
            in_specs.append(pl.BlockSpec((1, h), whole))
            operands.append(residual.s.astype(jnp.float32).reshape(1, h))
        in_specs += [pl.BlockSpec((1, h), whole)] * 2
        operands += [residual.w.astype(jnp.float32).reshape(1, h),
                     jnp.broadcast_to(residual.scalar.astype(jnp.float32).reshape(1, 1), (1, h))]
        out_specs.append(pl.BlockSpec((r, h), whole))
        out_shape.append(jax.ShapeDtypeStruct((r, h), jnp.float32))
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(steps,), in_specs=in_specs,
        out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((r, h), jnp.bfloat16)])
    static = [None if t is None else _TailShape(t.d, float(t.eps), t.w is not None,
                                                t.cos is not None) for t in tails]
    kernel = functools.partial(_kernel, count=len(weights), scaled=scaled, eps=float(eps),
                               tails=static, residual=None if residual is None else (
                                   float(residual.eps), residual.s is not None))
    with jax.named_scope(PALLAS_STACKED.format(kernel="proj", layers=n,
                                               weights=len(weights))):
        return tuple(pl.pallas_call(
            kernel, grid_spec=grid,
            out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                                 vmem_limit_bytes=VMEM_LIMIT),
            interpret=interpret, name="rv_normed_projections",
        )(jnp.asarray(layer, jnp.int32).reshape(1), *operands))
