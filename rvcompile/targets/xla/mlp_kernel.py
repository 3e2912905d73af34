"""A Pallas TPU kernel for a decode step's gated MLP: the pre-norm's scaling, the gate and up
projections, gelu_tanh(gate) x up and the down projection in one call, the activations kept in
VMEM.

Contract. `gated_mlp(x, w, eps, layer, wg, wu, wd, sg, su, residual)` is what lower.py
computes, op by op, for `linear(down, gelu_tanh(linear(gate, n)) * linear(up, n))` of the rows
n = rmsnorm(x, w, eps), before the down projection's per-row scale: x float32 [R, H] (R rows, a
decode step's lanes), `w` [H] the norm's weight; the weights stacked by layer as the layer scan
holds them, `layer` int32 [1] which one: wg, wu [n, I, H] and wd [n, H, I], int8 or bf16,
their per-row scales sg, su float32 [I] (the layer's; None for bf16 weights). `residual` (h,
w_r, eps_r, s_o): x is the attention's output (before its projection's per-row scale s_o [H],
None: none) and the MLP's input is the residual stream h + rmsnorm(x * s_o, w_r, eps_r), which
the call also returns. Returns (the stream, if `residual`, and)
float32 [R, H] the down projection's dot, the caller multiplying by its scale (after the
all-reduce under tensor parallelism, as XLA's partitioner places it). The arithmetic is
lower.py's: lower.rmsnorm's (a row's mean of squares in the kernel), n rounded to bf16, bf16 x
bf16 dots with float32 results, times the scales, gelu_tanh, the product rounded to bf16 for
the down dot; the down dot's sum over I runs in chunks of `tile` columns (float32 rounding
apart from one dot over all of I).

Why a kernel (docs/TPU_COST.md, branch h/tpu19): XLA passes over the rows once for each
norm's mean of squares and once for the residual add, writes the gate's float32 output to
on-chip memory and reads it back in the up dot's epilogue, reads the normed rows in both, and
writes the bf16 product for the down dot: the 31B at B = 64, TP = 4, 13 MiB a layer moved
between fusions. Here a grid step reads a tile of `tile` rows of the gate and up weights and
the same columns of the down weight (DMA'd from HBM by Pallas' pipeline, double-buffered) and
adds its share of the down dot into a VMEM accumulator; the rows are read once and the
outputs written once.

The weights are operands whole (every layer's), their index maps picking the layer from the
scalar-prefetched `layer`: a layer's slice taken by XLA before the call would be a copy of it.
The traffic table (hlo_traffic.py) finds the call by its named scope PALLAS_STACKED and counts
each stacked weight operand (from STACKED_FIRST on) as one layer's bytes, read once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

# the named scope of a kernel over stacked layer weights (this module's, proj_kernel.py's), by
# which the traffic table finds it: the kernel, the stacks' layers, its stacked weight operands
# (from STACKED_FIRST on, one after another)
PALLAS_STACKED = "rvstacked_{kernel}_n{layers}_w{weights}"
STACKED_FIRST = 3  # after `layer`, x and the norm's weight
TILES = (512, 384, 256, 128)  # weight rows a grid step reads, the widest that divides I
VMEM_LIMIT = 64 << 20  # the tiles' buffers (double-buffered) and their bf16 copies, at I / tp
# = 5376, H = 5376, 384-row tiles: about 30 MiB


def tile_rows(width: int) -> int | None:
    """Weight rows (of I) a grid step reads: the widest of TILES dividing `width`, None if
    none does (the caller keeps the XLA lowering)."""
    return next((t for t in TILES if width % t == 0), None)


def hbm(stacks, interpret) -> list:
    """The stacked weights held in HBM: as a custom call's operands XLA took a stack small
    enough for VMEM (the 31B's k and v projections at TP = 4, 55 MB each) as read whole and
    copied it there every layer (10 GiB a step more on chip, est.). Pallas' interpreter runs
    without memory spaces (a dot of an HBM-typed value is refused there)."""
    if interpret:
        return list(stacks)
    return [pltpu.with_memory_space_constraint(a, pltpu.HBM) for a in stacks]


def dot_nt(a, b):
    """a [R, K] . b [N, K]^T in float32, both bf16 (the MXU's product of lower.linear)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def norm_rows(x, w, eps):
    """lower.rmsnorm's arithmetic on rows x [R, H]: x * pow(mean(x^2) + eps, -0.5) * w."""
    return x * lax.pow(jnp.mean(x * x, axis=-1, keepdims=True) + jnp.float32(eps),
                       jnp.float32(-0.5)) * w


def _kernel(layer_ref, x_ref, w_ref, wg_ref, wu_ref, wd_ref, *rest, steps, scaled, act, eps,
            residual):
    rest = list(rest)
    sg_ref, su_ref = (rest.pop(0), rest.pop(0)) if scaled else (None, None)
    h_ref, wr_ref = (rest.pop(0), rest.pop(0)) if residual is not None else (None, None)
    so_ref = rest.pop(0) if residual is not None and residual[1] else None
    *outs, xn_ref, acc_ref = rest
    i = pl.program_id(0)

    @pl.when(i == 0)
    def _():
        x = x_ref[...]
        if so_ref is not None:
            x = x * so_ref[...]
        if residual is not None:  # x is the attention's output: the stream h + norm(x)
            x = h_ref[...] + norm_rows(x, wr_ref[...], residual[0])
            outs[0][...] = x
        xn_ref[...] = norm_rows(x, w_ref[...], eps).astype(jnp.bfloat16)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    xn = xn_ref[...]
    gate = dot_nt(xn, wg_ref[...].astype(jnp.bfloat16))
    up = dot_nt(xn, wu_ref[...].astype(jnp.bfloat16))
    if scaled:
        gate, up = gate * sg_ref[...], up * su_ref[...]
    product = (act(gate) * up).astype(jnp.bfloat16)
    acc_ref[...] += dot_nt(product, wd_ref[...].astype(jnp.bfloat16))

    @pl.when(i == steps - 1)
    def _():
        outs[-1][...] = acc_ref[...]


def gated_mlp(x, w, eps, layer, wg, wu, wd, sg=None, su=None, residual=None, *,
              interpret=False):
    """See the module docstring. `interpret`: run in a Pallas interpreter (True, or
    pltpu.InterpretParams; any device: the tests' check of its values)."""
    r, h = x.shape
    n, width, _ = wg.shape
    tile = tile_rows(width)
    if tile is None or wd.shape != (n, h, width) or wu.shape != wg.shape:
        raise ValueError(f"gate/up {wg.shape}, down {wd.shape}: need [n, I, H] and [n, H, I] "
                         f"with I a multiple of {TILES[-1]}")
    scaled = sg is not None
    steps = width // tile
    whole = lambda i, layer: (0, 0)  # noqa: E731 -- rows, norm weights, outputs: one block
    rows, vec = pl.BlockSpec((r, h), whole), pl.BlockSpec((1, h), whole)
    in_specs = [rows, vec,
                pl.BlockSpec((None, tile, h), lambda i, layer: (layer[0], i, 0)),
                pl.BlockSpec((None, tile, h), lambda i, layer: (layer[0], i, 0)),
                pl.BlockSpec((None, h, tile), lambda i, layer: (layer[0], 0, i))]
    operands = [x.astype(jnp.float32), w.astype(jnp.float32).reshape(1, h),
                *hbm((wg, wu, wd), interpret)]
    if scaled:
        in_specs += [pl.BlockSpec((1, tile), lambda i, layer: (0, i))] * 2
        operands += [s.astype(jnp.float32).reshape(1, width) for s in (sg, su)]
    out = jax.ShapeDtypeStruct((r, h), jnp.float32)
    out_shape, out_specs = [out], [rows]
    if residual is not None:
        stream, w_res, eps_res, s_o = residual
        in_specs += [rows, vec] + [vec] * (s_o is not None)
        # the stream read from HBM: left to XLA, it was moved out of VMEM across the attention
        # and back in for this call (2.6 MiB a layer more, the 31B at B = 64, TP = 4, est.)
        operands += [*hbm((stream.astype(jnp.float32),), interpret),
                     w_res.astype(jnp.float32).reshape(1, h)]
        if s_o is not None:
            operands.append(s_o.astype(jnp.float32).reshape(1, h))
        out_shape, out_specs = [out, out], [rows, rows]
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=1, grid=(steps,), in_specs=in_specs, out_specs=out_specs,
        scratch_shapes=[pltpu.VMEM((r, h), jnp.bfloat16), pltpu.VMEM((r, h), jnp.float32)])
    # lower.py's gelu_tanh, imported here: lower imports this module (and hlo_traffic, which
    # reads this module's constants) when it runs the kernel
    from rvcompile.targets.xla.lower import gelu_tanh

    kernel = functools.partial(_kernel, steps=steps, scaled=scaled, act=gelu_tanh,
                               eps=float(eps),
                               residual=None if residual is None else (float(eps_res),
                                                                       s_o is not None))
    with jax.named_scope(PALLAS_STACKED.format(kernel="mlp", layers=n, weights=3)):
        return tuple(pl.pallas_call(
            kernel, grid_spec=grid, out_shape=out_shape,
            compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                                 vmem_limit_bytes=VMEM_LIMIT),
            interpret=interpret, name="rv_gated_mlp",
        )(jnp.asarray(layer, jnp.int32).reshape(1), *operands))
