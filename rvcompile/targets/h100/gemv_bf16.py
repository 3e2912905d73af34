"""The bf16 head GEMV (kernels/gemv_bf16.cu): y[m, n] = sum_k x[m, k] * W[n, k], W bf16 [N, K]
(the tied embedding table), x bf16 [M <= 4, K], y float32. Its numpy reference and launch
geometry (the same persistent grid as gemv_fp8)."""

from __future__ import annotations

import numpy as np

from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import MAX_ROWS, WARPS, Launch

SOURCE = "gemv_bf16.cu"
ENTRY = "gemv_bf16"


def reference(w_bf16: np.ndarray, x_bf16: np.ndarray) -> np.ndarray:
    return np.asarray(x_bf16).astype(np.float32) @ np.asarray(w_bf16).astype(np.float32).T


def _reference_call(c: Call) -> None:
    m, n, k = c["M"], c["N"], c["K"]
    c.array("y", (m, n))[:] = reference(c.array("W", (n, k)), c.array("x", (m, k)))


ENTRIES = (Entry(ENTRY, SOURCE, (ptr("W", "bfloat16"), ptr("x", "bfloat16"),
                                 ptr("y", "float32", "out"), i32("M"), i32("N"), i32("K")),
                 _reference_call),)


def launch_geometry(m: int, n: int, k: int, sm_count: int, blocks_per_sm: int = 4) -> Launch:
    if not 1 <= m <= MAX_ROWS or k % 8:
        raise ValueError(f"gemv_bf16 needs 1 <= M <= {MAX_ROWS} and K % 8 == 0 (M={m}, K={k})")
    blocks = min(-(-n // WARPS), sm_count * blocks_per_sm)
    return Launch((blocks, 1, 1), (WARPS * 32, 1, 1), m * k * 2)
