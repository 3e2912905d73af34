"""RMSNorm kernels of the decode step (kernels/norms.cu): numpy references and launch geometry.

`rmsnorm_bf16(x f32 [M, H], w f32 [H], y bf16 [M, H], H, eps)`:
    y = bf16(rmsnorm(x) * w), the input of the next FP8 GEMV.
`residual_rmsnorm(h f32 [M, H], x f32 [M, H], w_post f32 [H], scalar f32 [1], w_next f32 [H],
y bf16 [M, H], H, eps)`, one launch for "residual add + post-norm + layer scalar + next pre-norm":
    h <- (h + rmsnorm(x) * w_post) * scalar[0]        (in place, f32; scalar may be 1.0)
    y  = bf16(rmsnorm(h) * w_next)                    (of the NEW h)
where rmsnorm(v) = v * (mean(v^2) + eps)^-1/2, f32, the IR's ops.ref_rmsnorm and
ops.ref_residual_rmsnorm step for step. One CTA of 512 threads per row; H % 4 == 0, H <= 8192,
any M >= 1. The `_f32` entries (`rmsnorm_f32`, `residual_rmsnorm_f32`: the float32 plan) take
the same arguments with y float32, unrounded. Small rows leave threads idle but stay correct
(the tiny models' H = 64 and 128 and their per-layer-input dim 16 are tested).
The `_q` entries (`rmsnorm_bf16_q`, `residual_rmsnorm_q`) take q e4m3 [M, H] and q_scale f32 [M]
after y and also write y's per-row FP8 quantization (gemm_tc.quantize_rows_reference of the bf16
y): the FP8 tensor-core GEMM reading y then needs no quant_fp8_rows launch.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemm_tc import quantize_rows_reference
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "norms.cu"
RMSNORM_ENTRY = "rmsnorm_bf16"
RESIDUAL_ENTRY = "residual_rmsnorm"
RMSNORM_F32_ENTRY = "rmsnorm_f32"
RESIDUAL_F32_ENTRY = "residual_rmsnorm_f32"
RMSNORM_Q_ENTRY = "rmsnorm_bf16_q"
RESIDUAL_Q_ENTRY = "residual_rmsnorm_q"
THREADS = 512  # must match the kernel
MAX_H = THREADS * 4 * 4


def rmsnorm_bf16(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """bf16 [M, H]."""
    return ops.ref_rmsnorm(ops.RMSNormAttrs(eps), x, w).astype(ml_dtypes.bfloat16)


def rmsnorm_f32(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """float32 [M, H]."""
    return ops.ref_rmsnorm(ops.RMSNormAttrs(eps), x, w)


def residual_rmsnorm(h: np.ndarray, x: np.ndarray, w_post: np.ndarray, scalar: np.ndarray,
                     w_next: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(new h f32 [M, H], y bf16 [M, H])."""
    h_new, y = residual_rmsnorm_f32(h, x, w_post, scalar, w_next, eps)
    return h_new, y.astype(ml_dtypes.bfloat16)


def residual_rmsnorm_f32(h: np.ndarray, x: np.ndarray, w_post: np.ndarray, scalar: np.ndarray,
                         w_next: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(new h f32 [M, H], y f32 [M, H])."""
    a = ops.RMSNormAttrs(eps)
    h_new = ops.ref_residual_rmsnorm(a, h, x, w_post, np.asarray(scalar, np.float32))
    return h_new, ops.ref_rmsnorm(a, h_new, w_next)


def _rmsnorm_call(ref, c: Call) -> None:
    m, h = c.grid[0], c["H"]
    c.array("y", (m, h))[:] = ref(c.array("x", (m, h)), c.array("w", (h,)), c["eps"])


def _residual_call(ref, c: Call) -> None:
    m, h = c.grid[0], c["H"]
    hv = c.array("h", (m, h))
    new_h, y = ref(hv, c.array("x", (m, h)), c.array("w_post", (h,)), c.array("scalar", (1,)),
                   c.array("w_next", (h,)), c["eps"])
    hv[:] = new_h
    c.array("y", (m, h))[:] = y


def write_quantized(c: Call, y: np.ndarray) -> None:
    """A _q entry's q and q_scale: y's per-row e4m3 quantization."""
    bits, scale = quantize_rows_reference(y)
    c.array("q", y.shape).view(np.uint8)[:] = bits
    c.array("q_scale", (y.shape[0],))[:] = scale


def _rmsnorm_q_call(c: Call) -> None:
    _rmsnorm_call(rmsnorm_bf16, c)
    write_quantized(c, c.array("y", (c.grid[0], c["H"])))


def _residual_q_call(c: Call) -> None:
    _residual_call(residual_rmsnorm, c)
    write_quantized(c, c.array("y", (c.grid[0], c["H"])))


def _entries():
    for name, dtype, ref in ((RMSNORM_ENTRY, "bfloat16", rmsnorm_bf16),
                             (RMSNORM_F32_ENTRY, "float32", rmsnorm_f32)):
        yield Entry(name, SOURCE, (ptr("x", "float32"), ptr("w", "float32"),
                                   ptr("y", dtype, "out"), i32("H"), f32("eps")),
                    partial(_rmsnorm_call, ref))
    for name, dtype, ref in ((RESIDUAL_ENTRY, "bfloat16", residual_rmsnorm),
                             (RESIDUAL_F32_ENTRY, "float32", residual_rmsnorm_f32)):
        yield Entry(name, SOURCE, (ptr("h", "float32", "inout"), ptr("x", "float32"),
                                   ptr("w_post", "float32"), ptr("scalar", "float32"),
                                   ptr("w_next", "float32"), ptr("y", dtype, "out"), i32("H"),
                                   f32("eps")),
                    partial(_residual_call, ref))


    q_out = (ptr("q", "float8_e4m3fn", "out"), ptr("q_scale", "float32", "out"))
    yield Entry(RMSNORM_Q_ENTRY, SOURCE, (ptr("x", "float32"), ptr("w", "float32"),
                                         ptr("y", "bfloat16", "out"), *q_out, i32("H"),
                                         f32("eps")),
                _rmsnorm_q_call)
    yield Entry(RESIDUAL_Q_ENTRY, SOURCE, (ptr("h", "float32", "inout"), ptr("x", "float32"),
                                           ptr("w_post", "float32"), ptr("scalar", "float32"),
                                           ptr("w_next", "float32"), ptr("y", "bfloat16", "out"),
                                           *q_out, i32("H"), f32("eps")),
                _residual_q_call)


ENTRIES = tuple(_entries())


def launch_geometry(m: int, h: int) -> Launch:
    """Both entries: one CTA per row."""
    if not 1 <= m or h % 4 or h > MAX_H:
        raise ValueError(f"norms need M >= 1, H % 4 == 0 and H <= {MAX_H} (M={m}, H={h})")
    return Launch((m, 1, 1), (THREADS, 1, 1), 0)
