"""The small-batch FP8 decode GEMV on the tensor cores, M = 1..32 token rows, W e4m3 [N, K] with
one float32 scale per row, y float32 [M, N]; W is read once whatever M ("swap AB": 16 W rows are
an mma's M side, the token rows its N side). Two kinds of token rows:
- bf16 x [M, K] (`gemv_mma_fp8_*`): y[m, n] = scale[n] * sum_k x[m, k] * W[n, k], gemv_fp8's
  kernel arguments (W, scale, x, y, M, N, K) and numpy reference;
- bf16 x [M, K] with a _q twin's q_scale [M] (each row's amax / 448) beside it (`gemv_mma_f16_*`):
  the bf16 rows' product and reference, computed in f16: each row times a power of two that puts
  its largest values just below f16's top binade (f16 holds every bf16 value of that range
  exactly), the weights e4m3 -> f16 by one conversion per pair, the sums divided by the power
  of two again (exact). Arguments (W, scale, x, q_scale, y, M, N, K).
Launch geometry: which entry (row kind, token-row bucket, warps per CTA, split-K cluster size),
grid, block and shared memory.

Limits: 1 <= M <= 32; K % 16 == 0; N >= 1 (N < 16 leaves mma rows idle); x and W rows 16-byte
aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.targets.h100 import gemv_fp8
from rvcompile.targets.h100.contract import Entry, ptr

SOURCE = "gemv_mma_fp8.cu"
# Must match the kernel.
BLOCK_K = 64  # k per mma block (a lane's 16 W bytes)
WINDOW_BLOCKS = 4  # k blocks per x window in shared memory
STAGES = 3  # x windows staged
X_ROW_BYTES = WINDOW_BLOCKS * BLOCK_K * 2 + 16
ROW_BUCKETS = (8, 16, 32)  # token rows per entry: 8 per mma n tile
WARPS = (4, 8)  # warps per CTA, 16 W rows each
SPLITS = (1, 2, 3, 4, 6, 8)  # split-K cluster sizes
MAX_ROWS = ROW_BUCKETS[-1]
MAX_GRID_X = 2**31 - 1
# The default launch, fit to benchmarks/h100_gemv_mma.py --sweep on an H100 (2026-11-24, see
# docs/BENCHMARKS.md): one wave of at most CTAS_PER_SM CTAs per SM streamed W fastest; grids
# between that and several waves streamed 10-25% slower (not profiled; SMs holding one CTA more
# than others making the tail would fit). Where even an unsplit grid is larger, many small CTAs
# (split-K, each keeping at least MANY_WAVES_WINDOWS x windows) balance over the SMs as they
# finish. Warps per CTA in order of preference per row bucket: 8 warps halve the x reads per W
# byte (best at M = 32), 4 keep CTAs small.
CTAS_PER_SM = 2.6
MANY_WAVES_WINDOWS = 3
PREFERRED_WARPS = {8: (4,), 16: (4, 8), 32: (8,)}
# Three later sweeps (the H100's of 2026-11-24 and two on an H200, 2026-11-29; docs/BENCHMARKS.md)
# agree on exceptions for more than FEW_ROWS token rows, up to 16: CTAs of 8 warps. On the wide
# matrices (N >= WIDE_N: the 31B's qkv, qk and gate||up) split WIDE_SPLIT[bucket] while the 8-warp
# grid is at most one CTA per SM and WIDER_SPLIT beyond (the grids between streamed slower on
# both machines); from 9 rows on the narrower ones too, with the light wave's split, where that
# grid still holds NARROW_CTAS_PER_SM CTAs per SM (the E4B's smaller matrices streamed slower
# on fewer). The 31B step's linears, as measured per shape: M = 8 1.6% (H100) and 7-8% (H200)
# faster, M = 16 5.5% (H100) and 4-5.5% (H200). Up to FEW_ROWS rows the light wave stays: 8
# warps were 3% slower there on the H100.
FEW_ROWS = 4
WIDE_N = 16384
WIDE_SPLIT = {8: 2, 16: 1}
WIDER_SPLIT = 3
NARROW_CTAS_PER_SM = 2

reference = gemv_fp8.reference


@dataclass(frozen=True)
class Launch:
    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int


ROW_KINDS = ("bf16", "f16")  # token rows, as the module docstring lists them
_PREFIX = {"bf16": "gemv_mma_fp8", "f16": "gemv_mma_f16"}


def entry_name(rows: int, warps: int, split: int, kind: str = "bf16") -> str:
    return f"{_PREFIX[kind]}_m{rows}_w{warps}_s{split}"


def entry_names(kind: str = "bf16") -> list[str]:
    """Every entry the module defines for one kind of token rows."""
    return [entry_name(r, w, s, kind) for r in ROW_BUCKETS for w in WARPS for s in SPLITS]


# (W e4m3 [N, K], scale f32 [N], x bf16 [M, K], q_scale f32 [M], y f32 [M, N], M, N, K)
PARAMS_F16 = (*gemv_fp8.PARAMS[:3], ptr("q_scale", "float32"), *gemv_fp8.PARAMS[3:])
# The bf16 and f16 rows' entries take gemv_fp8's product (its reference reads W, scale, x, y).
ENTRIES = (*(Entry(name, SOURCE, gemv_fp8.PARAMS, gemv_fp8.reference_call)
             for name in entry_names()),
           *(Entry(name, SOURCE, PARAMS_F16, gemv_fp8.reference_call)
             for name in entry_names("f16")))


def row_bucket(m: int) -> int:
    return next(b for b in ROW_BUCKETS if m <= b)


def smem_bytes(m: int) -> int:
    """The staged x windows; a split-K CTA reuses them for its float32 partial tile, which is
    smaller (M x (16 warps + 4) floats)."""
    return STAGES * m * X_ROW_BYTES


def row_groups(n: int, warps: int) -> int:
    return -(-n // (16 * warps))


def eight_warps(m: int, n: int, k: int, sm_count: int) -> bool:
    """Whether the exceptions above put an [m, k] x [n, k]^T product on 8-warp CTAs."""
    bucket = row_bucket(m)
    if not (FEW_ROWS < m and bucket in WIDE_SPLIT):
        return False
    if n >= WIDE_N:
        return True
    return bucket > 8 and (row_groups(n, 8) * light_wave_split(n, k, 8, sm_count)
                           >= NARROW_CTAS_PER_SM * sm_count)


def default_warps(m: int, n: int, k: int, sm_count: int) -> int:
    """8 where the exceptions say so; else the first preferred warps count whose unsplit grid fits
    one wave of CTAS_PER_SM, else the last preferred."""
    if eight_warps(m, n, k, sm_count):
        return 8
    prefs = PREFERRED_WARPS[row_bucket(m)]
    return next((w for w in prefs if row_groups(n, w) <= CTAS_PER_SM * sm_count), prefs[-1])


def splits_for(k: int) -> list[int]:
    """The splits that leave every CTA at least one x window of K."""
    blocks = -(-k // BLOCK_K)
    return [s for s in SPLITS if s == 1 or blocks >= s * WINDOW_BLOCKS]


def light_wave_split(n: int, k: int, warps: int, sm_count: int) -> int:
    """The largest split whose grid is still one wave of at most CTAS_PER_SM CTAs per SM, or,
    when the unsplit grid is already larger, the largest that leaves every CTA at least
    MANY_WAVES_WINDOWS x windows of K; never one that leaves a CTA less than one window."""
    cap = CTAS_PER_SM * sm_count
    groups, blocks = row_groups(n, warps), -(-k // BLOCK_K)
    splits = splits_for(k)
    if groups <= cap:
        return max(s for s in splits if groups * s <= cap)
    return max(s for s in splits if s == 1 or blocks >= s * WINDOW_BLOCKS * MANY_WAVES_WINDOWS)


def default_split(m: int, n: int, k: int, warps: int, sm_count: int) -> int:
    """On the wide matrices' 8-warp exception WIDE_SPLIT or WIDER_SPLIT (as K allows), else the
    light wave's."""
    if warps == 8 and n >= WIDE_N and eight_warps(m, n, k, sm_count):
        want = WIDE_SPLIT[row_bucket(m)] if row_groups(n, 8) <= sm_count else WIDER_SPLIT
        return max(s for s in splits_for(k) if s <= want)
    return light_wave_split(n, k, warps, sm_count)


def launch_geometry(m: int, n: int, k: int, sm_count: int, warps: int | None = None,
                    split: int | None = None, kind: str = "bf16") -> Launch:
    """The launch for an [m, k] x [n, k]^T product of `kind` token rows; warps and split override
    the defaults."""
    if not 1 <= m <= MAX_ROWS or n < 1 or k < 16 or k % 16:
        raise ValueError(f"gemv_mma_fp8 needs 1 <= M <= {MAX_ROWS}, N >= 1 and K a positive "
                         f"multiple of 16 (M={m}, N={n}, K={k})")
    warps = default_warps(m, n, k, sm_count) if warps is None else warps
    if warps not in WARPS:
        raise ValueError(f"gemv_mma_fp8: warps {warps} not one of {WARPS}")
    split = default_split(m, n, k, warps, sm_count) if split is None else split
    if split not in SPLITS:
        raise ValueError(f"gemv_mma_fp8: split {split} not one of {SPLITS}")
    groups = row_groups(n, warps)
    if groups > MAX_GRID_X:
        raise ValueError(f"gemv_mma_fp8: N={n} needs more than {MAX_GRID_X} CTAs")
    return Launch(entry_name(row_bucket(m), warps, split, kind), (groups, 1, split),
                  (32 * warps, 1, 1), smem_bytes(m))
