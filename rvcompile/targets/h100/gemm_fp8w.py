"""The FP8-weight prefill GEMM: the decode GEMV's product for any M >= 1 token rows,
y[m, n] = scale[n] * sum_k x[m, k] * W[n, k], W e4m3 [N, K] with one float32 scale per row,
x bf16 [M, K], y float32 [M, N], same kernel arguments as gemv_fp8. Its numpy reference (the
GEMV's) and launch geometry: which entry (rows per CTA, split-K cluster size), grid and shared
memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.targets.h100 import gemv_fp8
from rvcompile.targets.h100.contract import Entry

SOURCE = "gemm_fp8w.cu"
# Must match the kernel.
THREADS = 256
BLOCK_N = 128
BLOCK_K = 64
STAGES = 6
RED_STRIDE = BLOCK_N + 8
BLOCK_MS = (16, 32, 64, 128)  # rows of y per CTA; the kernel has one entry per (BM, split)
RESIDENT_CTAS = {16: 2, 32: 2, 64: 2, 128: 1}  # per SM: each entry's __launch_bounds__ minimum
SPLITS = (1, 2, 4)  # split-K cluster sizes
MAX_GRID_Y = 65535
MIN_SLICES_PER_SPLIT = 8  # 64-wide k slices each split must keep
SPLIT_GAIN = 0.85  # a larger split must cut the estimated time below this fraction

reference = gemv_fp8.reference


@dataclass(frozen=True)
class Launch:
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def entry_name(block_m: int, split: int) -> str:
    return f"gemm_fp8w_m{block_m}_s{split}"


# One entry per (rows per CTA, split), each with gemv_fp8's parameters and product.
ENTRIES = tuple(Entry(entry_name(b, s), SOURCE, gemv_fp8.PARAMS, gemv_fp8.reference_call)
                for b in BLOCK_MS for s in SPLITS)


def smem_bytes(block_m: int, split: int) -> int:
    """The pipeline's stages; a split-K CTA reuses them for its float32 partial tile."""
    pipeline = STAGES * (BLOCK_N * BLOCK_K + block_m * BLOCK_K * 2)
    return pipeline if split == 1 else max(pipeline, block_m * RED_STRIDE * 4)


def default_block_m(m: int) -> int:
    """The smallest tile that holds all M rows, else 128-row tiles. (The H100 sweep found 64-row
    tiles 0-10% faster than 128 at some M = 256 shapes; that tiling has not yet been checked
    against the reference on a GPU with more than one row tile, so it is not the default.)"""
    return next((b for b in BLOCK_MS if m <= b), BLOCK_MS[-1])


def default_split(tiles: int, k: int, block_m: int, sm_count: int) -> int:
    """Estimated time = waves of resident CTAs x 1/split of K per CTA; take a larger split only
    when that estimate drops below SPLIT_GAIN of the best so far (fit to benchmarks/h100_gemm.py
    --sweep on an H100: within 5% of the fastest measured split at every 31B shape for M = 16,
    64 and 256)."""
    slots = RESIDENT_CTAS[block_m] * sm_count
    slices = -(-k // BLOCK_K)
    best, best_waves = 1, float(-(-tiles // slots))
    for s in SPLITS[1:]:
        if slices < s * MIN_SLICES_PER_SPLIT:
            break
        waves = -(-tiles * s // slots) / s
        if waves < SPLIT_GAIN * best_waves:
            best, best_waves = s, waves
    return best


def launch_geometry(m: int, n: int, k: int, sm_count: int, block_m: int | None = None,
                    split: int | None = None) -> Launch:
    """The launch for an [m, k] x [n, k]^T product; block_m and split override the defaults."""
    if m < 1 or n < 1 or k < 16 or k % 16:
        raise ValueError(f"gemm_fp8w needs M >= 1, N >= 1 and K a positive multiple of 16 "
                         f"(M={m}, N={n}, K={k})")
    block_m = default_block_m(m) if block_m is None else block_m
    if block_m not in BLOCK_MS:
        raise ValueError(f"gemm_fp8w: block_m {block_m} not one of {BLOCK_MS}")
    n_tiles = -(-n // BLOCK_N)
    if n_tiles > MAX_GRID_Y:
        raise ValueError(f"gemm_fp8w: N={n} exceeds {MAX_GRID_Y * BLOCK_N}")
    m_tiles = -(-m // block_m)
    split = default_split(m_tiles * n_tiles, k, block_m, sm_count) if split is None else split
    if split not in SPLITS:
        raise ValueError(f"gemm_fp8w: split {split} not one of {SPLITS}")
    return Launch(entry_name(block_m, split), (m_tiles, n_tiles, split), (THREADS, 1, 1),
                  smem_bytes(block_m, split))
