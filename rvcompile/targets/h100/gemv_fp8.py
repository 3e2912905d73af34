"""The FP8 decode GEMV: y[m, n] = scale[n] * sum_k x[m, k] * W[n, k], W e4m3 [N, K] with one
float32 scale per row, x bf16 [M <= 4, K], y float32. Its numpy reference and launch geometry.

Limits: 1 <= M <= 4; K % 16 == 0 (one 16-byte load is 16 weights; K = 16, the tiny models'
per-layer-input dim, is one load per row); any N >= 1 (N < 16 leaves warps idle); x and W rows
16-byte aligned; x is staged in shared memory, M * K * 2 <= MAX_SMEM bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from rvcompile.targets.h100.contract import Call, Entry, i32, ptr

SOURCE = "gemv_fp8.cu"
ENTRY = "gemv_fp8_rowscale"
WARPS = 16  # must match the kernel
MAX_ROWS = 4
MAX_SMEM = 227 * 1024  # H100: dynamic shared memory one block may opt into
# float32 of each e4m3 bit pattern (ml_dtypes' own conversion, NaNs included): a table lookup
# gives the same values as converting through ml_dtypes, ~6x faster, and this conversion was
# most of the CPU reference executor's time on h100-fp8 artifacts.
E4M3_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


def e4m3_to_f32(bits: np.ndarray) -> np.ndarray:
    """float32 of e4m3 values (a uint8 or float8_e4m3fn array of their bit patterns)."""
    return np.take(E4M3_F32, np.asarray(bits).view(np.uint8))


def reference(w_fp8: np.ndarray, scale: np.ndarray, x_bf16: np.ndarray) -> np.ndarray:
    w = e4m3_to_f32(w_fp8)
    x = np.asarray(x_bf16).astype(np.float32)
    return (x @ w.T) * scale[None, :].astype(np.float32)


def reference_call(c: Call) -> None:
    """y = x @ W^T * scale of a launch of this GEMV's arguments (also gemv_mma_fp8's and
    gemm_fp8w's)."""
    m, n, k = c["M"], c["N"], c["K"]
    c.array("y", (m, n))[:] = reference(c.array("W", (n, k)), c.array("scale", (n,)),
                                        c.array("x", (m, k)))


# (W e4m3 [N, K], scale f32 [N], x bf16 [M, K], y f32 [M, N], M, N, K): gemv_mma_fp8's and
# gemm_fp8w's parameters too.
PARAMS = (ptr("W", "float8_e4m3fn"), ptr("scale", "float32"), ptr("x", "bfloat16"),
          ptr("y", "float32", "out"), i32("M"), i32("N"), i32("K"))
ENTRIES = (Entry(ENTRY, SOURCE, PARAMS, reference_call),)


@dataclass(frozen=True)
class Launch:
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def launch_geometry(m: int, n: int, k: int, sm_count: int, blocks_per_sm: int = 4) -> Launch:
    """A persistent grid: at most `blocks_per_sm` 512-thread blocks per SM, each staging x."""
    if not 1 <= m <= MAX_ROWS or k % 16 or m * k * 2 > MAX_SMEM:
        raise ValueError(f"gemv_fp8 needs 1 <= M <= {MAX_ROWS}, K % 16 == 0 and M * K * 2 <= "
                         f"{MAX_SMEM} (M={m}, K={k})")
    blocks = min(-(-n // WARPS), sm_count * blocks_per_sm)
    return Launch((blocks, 1, 1), (WARPS * 32, 1, 1), m * k * 2)
