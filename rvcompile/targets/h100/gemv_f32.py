"""The float32 GEMV (kernels/gemv_f32.cu) of the h100-f32 plan: y[m, n] = sum_k x[m, k] * W[n, k],
W float32 [N, K], x float32 [M <= 4, K], y float32; every linear of a float32 build (prefill
runs it per group of MAX_ROWS rows). Its numpy reference and launch geometry (the persistent
grid of gemv_fp8; x is not staged, so there is no shared-memory limit on K)."""

from __future__ import annotations

import numpy as np

from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import MAX_ROWS, WARPS, Launch

SOURCE = "gemv_f32.cu"
ENTRY = "gemv_f32"


def reference(w: np.ndarray, x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float32) @ np.asarray(w, np.float32).T


def _reference_call(c: Call) -> None:
    m, n, k = c["M"], c["N"], c["K"]
    c.array("y", (m, n))[:] = reference(c.array("W", (n, k)), c.array("x", (m, k)))


ENTRIES = (Entry(ENTRY, SOURCE, (ptr("W", "float32"), ptr("x", "float32"),
                                 ptr("y", "float32", "out"), i32("M"), i32("N"), i32("K")),
                 _reference_call),)


def launch_geometry(m: int, n: int, k: int, sm_count: int, blocks_per_sm: int = 4) -> Launch:
    if not 1 <= m <= MAX_ROWS or k % 4:
        raise ValueError(f"gemv_f32 needs 1 <= M <= {MAX_ROWS} and K % 4 == 0 (M={m}, K={k})")
    blocks = min(-(-n // WARPS), sm_count * blocks_per_sm)
    return Launch((blocks, 1, 1), (WARPS * 32, 1, 1), 0)
