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
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "norms.cu"
RMSNORM_ENTRY = "rmsnorm_bf16"
RESIDUAL_ENTRY = "residual_rmsnorm"
RMSNORM_F32_ENTRY = "rmsnorm_f32"
RESIDUAL_F32_ENTRY = "residual_rmsnorm_f32"
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


ENTRIES = tuple(_entries())


def launch_geometry(m: int, h: int) -> Launch:
    """Both entries: one CTA per row."""
    if not 1 <= m or h % 4 or h > MAX_H:
        raise ValueError(f"norms need M >= 1, H % 4 == 0 and H <= {MAX_H} (M={m}, H={h})")
    return Launch((m, 1, 1), (THREADS, 1, 1), 0)
