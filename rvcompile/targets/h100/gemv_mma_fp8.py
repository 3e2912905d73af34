"""The small-batch FP8 decode GEMV on the tensor cores: y[m, n] = scale[n] * sum_k x[m, k] * W[n, k]
for M = 1..32 token rows, W e4m3 [N, K] with one float32 scale per row, x bf16 [M, K], y float32
[M, N], with gemv_fp8's kernel arguments (W, scale, x, y, M, N, K). W is read once whatever M
("swap AB": 16 W rows are an mma's M side, the token rows its N side). Its numpy reference
(gemv_fp8's: float32 products summed in float32) and launch geometry: which entry (token-row
bucket, warps per CTA, split-K cluster size), grid, block and shared memory.

Limits: 1 <= M <= 32; K % 16 == 0; N >= 1 (N < 16 leaves mma rows idle); x and W rows 16-byte
aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.targets.h100 import gemv_fp8

SOURCE = "gemv_mma_fp8.cu"
# Must match the kernel.
BLOCK_K = 64  # k per mma block (a lane's 16 W bytes)
WINDOW_BLOCKS = 4  # k blocks per x window in shared memory
STAGES = 3  # x windows staged
X_ROW_BYTES = WINDOW_BLOCKS * BLOCK_K * 2 + 16
ROW_BUCKETS = (8, 16, 32)  # token rows per entry: 8 per mma n tile
WARPS = (4, 8)  # warps per CTA, 16 W rows each
SPLITS = (1, 2, 3, 4, 6, 8)  # split-K cluster sizes
MIN_BLOCKS = {(8, 4): 8, (16, 4): 6, (32, 4): 4,  # CTAs per SM each entry's registers allow
              (8, 8): 4, (16, 8): 3, (32, 8): 2}  # (its __launch_bounds__ minimum)
MAX_ROWS = ROW_BUCKETS[-1]
DEFAULT_WARPS = 4
MAX_GRID_X = 2**31 - 1
# The split choice's cost model (see default_split), fit to benchmarks/h100_gemv_mma.py --sweep.
SATURATION = 0.5  # fraction of the resident CTAs that already streams W at full bandwidth
WAVE_OVERHEAD = 0.10  # a wave's fixed cost (ramp, x prologue, split-K sum), in full-wave units

reference = gemv_fp8.reference


@dataclass(frozen=True)
class Launch:
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


def entry_name(rows: int, warps: int, split: int) -> str:
    return f"gemv_mma_fp8_m{rows}_w{warps}_s{split}"


def entry_names() -> list[str]:
    """Every entry the module defines."""
    return [entry_name(r, w, s) for r in ROW_BUCKETS for w in WARPS for s in SPLITS]


def row_bucket(m: int) -> int:
    return next(b for b in ROW_BUCKETS if m <= b)


def smem_bytes(m: int) -> int:
    """The staged x windows; a split-K CTA reuses them for its float32 partial tile, which is
    smaller (M x (16 warps + 4) floats)."""
    return STAGES * m * X_ROW_BYTES


def estimated_cost(row_groups: int, split: int, resident: int) -> float:
    """Time in units of one full wave over all of K: resident CTAs run as a wave, each wave takes
    the time its CTAs' bytes need at full bandwidth, except that a wave of fewer than
    SATURATION x resident CTAs runs no faster than one of that many, plus a fixed overhead."""
    ctas = row_groups * split
    cost = 0.0
    while ctas > 0:
        wave = min(ctas, resident)
        cost += max(wave, SATURATION * resident) / (resident * split) + WAVE_OVERHEAD
        ctas -= wave
    return cost


def default_split(n: int, k: int, rows: int, warps: int, sm_count: int) -> int:
    """The split with the lowest estimated_cost among those that leave every CTA at least one
    whole x window of K; the smaller split on ties."""
    row_groups = -(-n // (16 * warps))
    resident = MIN_BLOCKS[rows, warps] * sm_count
    blocks = -(-k // BLOCK_K)
    fits = [s for s in SPLITS if s == 1 or blocks >= s * WINDOW_BLOCKS]
    return min(fits, key=lambda s: (estimated_cost(row_groups, s, resident), s))


def launch_geometry(m: int, n: int, k: int, sm_count: int, warps: int | None = None,
                    split: int | None = None) -> Launch:
    """The launch for an [m, k] x [n, k]^T product; warps and split override the defaults."""
    if not 1 <= m <= MAX_ROWS or n < 1 or k < 16 or k % 16:
        raise ValueError(f"gemv_mma_fp8 needs 1 <= M <= {MAX_ROWS}, N >= 1 and K a positive "
                         f"multiple of 16 (M={m}, N={n}, K={k})")
    warps = DEFAULT_WARPS if warps is None else warps
    if warps not in WARPS:
        raise ValueError(f"gemv_mma_fp8: warps {warps} not one of {WARPS}")
    rows = row_bucket(m)
    split = default_split(n, k, rows, warps, sm_count) if split is None else split
    if split not in SPLITS:
        raise ValueError(f"gemv_mma_fp8: split {split} not one of {SPLITS}")
    row_groups = -(-n // (16 * warps))
    if row_groups > MAX_GRID_X:
        raise ValueError(f"gemv_mma_fp8: N={n} needs more than {MAX_GRID_X} CTAs")
    return Launch(entry_name(rows, warps, split), (row_groups, 1, split), (32 * warps, 1, 1),
                  smem_bytes(m))
