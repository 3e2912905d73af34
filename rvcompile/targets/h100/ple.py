"""Per-layer-input (PLE) kernels (kernels/ple.cu): numpy references and launch geometry.

Embedding side, once per step (the embed graph's `ple` output):
`to_bf16(x f32 [n], y bf16 [n], n)`: the bf16 copy of the embedding h that the model
    projection GEMV reads (the IR's LINEAR rounds its input to bf16). n % 4 == 0.
`ple_combine(ctx f32 [M, L*P], table bf16 [V, L*P], ids int32 [M], w f32 [P], ple f32 [M, L, P],
ctx_scale, tok_mult, out_scale, eps, M, L, P)`:
    ple = (rmsnorm(ctx * ctx_scale per P-group) * w + table[ids] * tok_mult) * out_scale
    the embed graph's SCALE, RESHAPE, RMSNORM, second EMBED, ADD and SCALE in one launch.
Layer side, per layer (h += rmsnorm(W_proj (gelu(W_gate h) * ple[:, layer])) * w, then * scalar):
`residual_rmsnorm_copy(h, x, w_post, scalar, y bf16 [M, H], H, eps)`: norms.residual_rmsnorm
    whose second output is bf16(new h) itself, not a normed copy: the gate GEMV's input.
`ple_project(gate f32 [M, P], ple f32 [M, L, P], layer, L, W e4m3 [N, P], scale f32 [N],
y f32 [M, N], M, N, P)`:
    y = (bf16(gelu_tanh(gate) * ple[:, layer]) @ W^T) * scale, the MUL and the output LINEAR
    in one launch for any P % 4 == 0 (the GEMVs need K % 16; the default model has P = 8).
    It reads W once per ROWS token rows; chunks of more rows with P % 16 == 0 take ple_gelu_mul
    and the FP8 prefill GEMM (gemm_fp8w) instead:
`ple_gelu_mul(gate, ple, layer, L, out bf16 [M, P], M, P)`:
    out = bf16(gelu_tanh(gate) * ple[:, layer]).
The float32 plan (h100-f32) takes `ple_combine_f32` (table f32 [V, L*P]) and, for every chunk,
`ple_project_f32(gate, ple, layer, L, W f32 [N, P], y, M, N, P)`: y = (gelu_tanh(gate) *
ple[:, layer]) @ W^T, nothing rounded, no scale.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100 import gemv_fp8, norms
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, i64, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "ple.cu"
TO_BF16_ENTRY = "to_bf16"
COMBINE_ENTRY = "ple_combine"
PROJECT_ENTRY = "ple_project"
RESIDUAL_COPY_ENTRY = "residual_rmsnorm_copy"
GELU_MUL_ENTRY = "ple_gelu_mul"
COMBINE_F32_ENTRY = "ple_combine_f32"
PROJECT_F32_ENTRY = "ple_project_f32"
WARPS = 8  # must match the kernel
ROWS = 4  # token rows per ple_project CTA; must match the kernel
CAST_THREADS = 256  # must match the kernel
NORM_THREADS = norms.THREADS  # must match the kernel
MAX_P = gemv_fp8.MAX_SMEM // (ROWS * 2)


def to_bf16(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16)


def combine(ctx: np.ndarray, tok_rows: np.ndarray, w: np.ndarray, ctx_scale: float,
            tok_mult: float, out_scale: float, eps: float, layers: int) -> np.ndarray:
    """ctx f32 [M, L*P], tok_rows bf16 or f32 [M, L*P] (the gathered table rows) -> f32
    [M, L, P]."""
    m = ctx.shape[0]
    scale = ops.OPS[ops.Op.SCALE].reference
    c = scale(ops.ScaleAttrs(ctx_scale), np.asarray(ctx, np.float32)).reshape(m, layers, -1)
    c = ops.ref_rmsnorm(ops.RMSNormAttrs(eps), c, np.asarray(w, np.float32))
    tok = ops.ref_embed(ops.EmbedAttrs(tok_mult), tok_rows, np.arange(m)).reshape(c.shape)
    return scale(ops.ScaleAttrs(out_scale), ops.ref_add(None, c, tok))


def gelu_mul(gate: np.ndarray, ple_layer: np.ndarray) -> np.ndarray:
    """gate f32 [M, P], ple_layer f32 [M, P] -> bf16 [M, P]."""
    return to_bf16(ops.ref_mul(None, ops.gelu_tanh(np.asarray(gate, np.float32)), ple_layer))


def project(gate: np.ndarray, ple_layer: np.ndarray, w_fp8: np.ndarray,
            scale: np.ndarray) -> np.ndarray:
    """gate f32 [M, P], ple_layer f32 [M, P], W e4m3 codes uint8 [N, P] -> f32 [M, N]."""
    return gemv_fp8.reference(w_fp8, scale, gelu_mul(gate, ple_layer))


def project_f32(gate: np.ndarray, ple_layer: np.ndarray, w: np.ndarray) -> np.ndarray:
    """gate f32 [M, P], ple_layer f32 [M, P], W f32 [N, P] -> f32 [M, N]."""
    gated = ops.ref_mul(None, ops.gelu_tanh(np.asarray(gate, np.float32)), ple_layer)
    return gated @ np.asarray(w, np.float32).T


def residual_copy(h: np.ndarray, x: np.ndarray, w_post: np.ndarray, scalar: np.ndarray,
                  eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(new h f32 [M, H], bf16 copy of it)."""
    h_new = ops.ref_residual_rmsnorm(ops.RMSNormAttrs(eps), h, x, w_post,
                                     np.asarray(scalar, np.float32))
    return h_new, to_bf16(h_new)


def to_bf16_geometry(n: int) -> Launch:
    if n < 4 or n % 4:
        raise ValueError(f"to_bf16 needs n % 4 == 0 (n={n})")
    return Launch((-(-(n // 4) // CAST_THREADS), 1, 1), (CAST_THREADS, 1, 1), 0)


def combine_geometry(m: int, layers: int, p: int) -> Launch:
    if m < 1 or layers < 1 or p < 1:
        raise ValueError(f"ple_combine needs M, L, P >= 1 (M={m}, L={layers}, P={p})")
    return Launch((-(-(m * layers) // WARPS), 1, 1), (WARPS * 32, 1, 1), 0)


def project_geometry(m: int, n: int, p: int, sm_count: int, f32: bool = False) -> Launch:
    """Grid (output-row blocks, row tiles of ROWS); each CTA stages its rows' gated vectors
    (bf16, or float32 for ple_project_f32: half the largest P)."""
    size = 4 if f32 else 2
    max_p = MAX_P * 2 // size
    if m < 1 or n < 1 or p % 4 or not 4 <= p <= max_p:
        raise ValueError(f"ple_project needs M, N >= 1 and P % 4 == 0, 4 <= P <= {max_p} "
                         f"(M={m}, N={n}, P={p})")
    tiles = -(-m // ROWS)
    blocks = min(-(-n // WARPS), max(1, 4 * sm_count // tiles))
    return Launch((blocks, tiles, 1), (WARPS * 32, 1, 1), min(m, ROWS) * p * size)


def use_gemm(m: int, p: int) -> bool:
    """Whether rows of per-layer input go through ple_gelu_mul and the FP8 GEMM."""
    return m > ROWS and p % 16 == 0


def gelu_mul_geometry(m: int, p: int) -> Launch:
    if m < 1 or p < 1:
        raise ValueError(f"ple_gelu_mul needs M, P >= 1 (M={m}, P={p})")
    return Launch((-(-(m * p) // CAST_THREADS), 1, 1), (CAST_THREADS, 1, 1), 0)


def residual_copy_geometry(m: int, h: int) -> Launch:
    return norms.launch_geometry(m, h)


# ---------------------------------------------------------------- entries

def _to_bf16_call(c: Call) -> None:
    n = c["n"]
    c.array("y", (n,))[:] = to_bf16(c.array("x", (n,)))


def _combine_call(c: Call) -> None:
    """The table rows up to the largest id (the table's height is no argument)."""
    m, layers, p = c["M"], c["L"], c["P"]
    ids = np.asarray(c.array("ids", (m,)))
    rows = c.array("table", (int(ids.max()) + 1, layers * p))[ids]
    c.array("ple", (m, layers, p))[:] = combine(
        c.array("ctx", (m, layers * p)), rows, c.array("w", (p,)), c["ctx_scale"],
        c["tok_mult"], c["out_scale"], c["eps"], layers)


def _layer_slice(c: Call) -> tuple[np.ndarray, np.ndarray]:
    """(gate [M, P], the layer's slice of the per-layer inputs [M, P])."""
    m, p = c["M"], c["P"]
    return c.array("gate", (m, p)), c.array("ple", (m, c["L"], p))[:, c["layer"]]


def _project_call(c: Call) -> None:
    m, n, p = c["M"], c["N"], c["P"]
    gate, ple_layer = _layer_slice(c)
    y = c.array("y", (m, n))
    if "scale" in c:
        y[:] = project(gate, ple_layer, c.array("W", (n, p)), c.array("scale", (n,)))
    else:
        y[:] = project_f32(gate, ple_layer, c.array("W", (n, p)))


def _gelu_mul_call(c: Call) -> None:
    c.array("out", (c["M"], c["P"]))[:] = gelu_mul(*_layer_slice(c))


def _residual_copy_call(c: Call) -> None:
    m, h = c.grid[0], c["H"]
    hv = c.array("h", (m, h))
    new_h, copy = residual_copy(hv, c.array("x", (m, h)), c.array("w_post", (h,)),
                                c.array("scalar", (1,)), c["eps"])
    hv[:] = new_h
    c.array("y", (m, h))[:] = copy


def _entries():
    yield Entry(TO_BF16_ENTRY, SOURCE, (ptr("x", "float32"), ptr("y", "bfloat16", "out"),
                                        i64("n")), _to_bf16_call)
    for name, dtype in ((COMBINE_ENTRY, "bfloat16"), (COMBINE_F32_ENTRY, "float32")):
        yield Entry(name, SOURCE, (ptr("ctx", "float32"), ptr("table", dtype),
                                   ptr("ids", "int32"), ptr("w", "float32"),
                                   ptr("ple", "float32", "out"), f32("ctx_scale"),
                                   f32("tok_mult"), f32("out_scale"), f32("eps"), i32("M"),
                                   i32("L"), i32("P")), _combine_call)
    layer = (ptr("gate", "float32"), ptr("ple", "float32"), i32("layer"), i32("L"))
    yield Entry(PROJECT_ENTRY, SOURCE, (*layer, ptr("W", "float8_e4m3fn"),
                                        ptr("scale", "float32"), ptr("y", "float32", "out"),
                                        i32("M"), i32("N"), i32("P")), _project_call)
    yield Entry(PROJECT_F32_ENTRY, SOURCE, (*layer, ptr("W", "float32"),
                                            ptr("y", "float32", "out"), i32("M"), i32("N"),
                                            i32("P")), _project_call)
    yield Entry(GELU_MUL_ENTRY, SOURCE, (*layer, ptr("out", "bfloat16", "out"), i32("M"),
                                         i32("P")), _gelu_mul_call)
    yield Entry(RESIDUAL_COPY_ENTRY, SOURCE, (ptr("h", "float32", "inout"), ptr("x", "float32"),
                                              ptr("w_post", "float32"), ptr("scalar", "float32"),
                                              ptr("y", "bfloat16", "out"), i32("H"), f32("eps")),
                _residual_copy_call)


ENTRIES = tuple(_entries())
