"""Small-batch FP8 decode GEMV on the tensor cores (targets/h100/gemv_mma_fp8): the launch
geometry and the kernel's build on the CPU; on a GPU, every entry of both row kinds (bf16 rows;
bf16 rows with a _q twin's q_scale, run in f16) against the numpy reference on fresh random
inputs at real 31B and E4B shapes, ragged and tiny shapes, M = 1..16 and 32 token rows, with
NaN-poisoned outputs.

Tolerance: the products bf16 x e4m3 are exact in float32 (8 + 4 significant bits), so kernel and
reference differ only in the order (and the tensor cores' truncation, contained to 64-wide k
blocks) of float32 sums. Measured on the H100 (docs/results/2026-11-24-h100-gemv-mma-errors.txt,
31B shapes K = 5376..21504 and a ragged one, M = 1..32, every split): kernel vs a float64 product
1.3e-7 .. 3.5e-7, the float32 reference vs float64 2.4e-7 .. 2.7e-7, kernel vs reference at most
4.4e-7. The bound below, 1e-5 (test_h100_gemv's for the CUDA-core GEMV), leaves ~20x for other
shapes and draws; a wrong index, k order or missing block gives errors near 1e-2 .. 1.

f16 rows: the bf16 rows' product, TOLERANCE (each row times a power of two is exact in f16,
the terms are the same). Cases with rows of very different magnitudes (1e-20 .. 1e20) check
the per-row power of two.

"""

from __future__ import annotations

import ctypes
import shutil

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context
from test_h100_gemv import random_fp8

from rvcompile.targets.h100 import gemm_tc, launches
from rvcompile.targets.h100 import gemv_mma_fp8 as gm

TOLERANCE = 1e-5
SM_COUNT = 132  # the H100 SXM's; the geometry tests fix it so they run anywhere

# (N, K) of each 31B and E4B decode linear (the heads are bf16 and not this kernel's)
SHAPES_31B = {"qkv_sliding": (16384, 5376), "qk_full": (18432, 5376),
              "o_sliding": (5376, 8192), "o_full": (5376, 16384),
              "gate_up": (43008, 5376), "down": (5376, 21504)}
SHAPES_E4B = {"e4b_qkv_sliding": (3072, 2560), "e4b_qkv_full": (6144, 2560),
              "e4b_o_sliding": (2560, 2048), "e4b_o_full": (2560, 4096),
              "e4b_gate_up": (20480, 2560), "e4b_down": (2560, 10240),
              "e4b_ple_gate": (256, 2560), "e4b_ple_proj": (2560, 256)}
# Tiny and ragged shapes: N < 16 and N not a multiple of 16 or 64 (idle mma rows, partial CTAs);
# K = 16..48 (one partial k block), K % 64 != 0 and K not a whole number of x windows.
SHAPES_SMALL = {"n1_k16": (1, 16), "n5_k32": (5, 32), "n16_k48": (16, 48),
                "n17_k64": (17, 64), "tiny_qkv": (256, 128), "tiny_ple_gate": (16, 128),
                "tiny_ple_proj": (128, 16), "tiny_head": (1024, 128),
                "ragged": (1000, 4176)}
ROWS = (*range(1, 17), 32)


def test_geometry_buckets_and_shared_memory() -> None:
    for m, bucket in ((1, 8), (8, 8), (9, 16), (16, 16), (17, 32), (32, 32)):
        launch = gm.launch_geometry(m, 5376, 8192, SM_COUNT, warps=4, split=1)
        assert launch.entry == f"gemv_mma_fp8_m{bucket}_w4_s1"
        assert launch.grid == (84, 1, 1) and launch.block == (128, 1, 1)
        assert launch.smem == 3 * m * (4 * 64 * 2 + 16)
    wide = gm.launch_geometry(3, 100, 64, SM_COUNT, warps=8, split=2)
    assert wide.entry == "gemv_mma_fp8_m8_w8_s2"
    assert wide.grid == (1, 1, 2) and wide.block == (256, 1, 1)
    f16 = gm.launch_geometry(9, 5376, 8192, SM_COUNT, warps=4, split=1, kind="f16")
    assert f16.entry == "gemv_mma_f16_m16_w4_s1" and f16.smem == 3 * 9 * (4 * 64 * 2 + 16)


def test_geometry_split_partial_tile_fits_in_the_x_stages() -> None:
    """A split-K CTA sums its partial tile in the x stages' shared memory (the kernel's
    RED_STRIDE = 16 warps + 4 floats per token row)."""
    for warps in gm.WARPS:
        for m in (1, 8, 32):
            assert m * (16 * warps + 4) * 4 <= gm.smem_bytes(m)


@pytest.mark.parametrize("kind", gm.ROW_KINDS)
def test_geometry_every_choice_is_an_entry(kind: str) -> None:
    names = set(gm.entry_names(kind))
    assert len(names) == len(gm.ROW_BUCKETS) * len(gm.WARPS) * len(gm.SPLITS)
    for m in ROWS:
        for n, k in (*SHAPES_31B.values(), *SHAPES_E4B.values(), *SHAPES_SMALL.values()):
            assert gm.launch_geometry(m, n, k, SM_COUNT, kind=kind).entry in names


# (warps, split) the sweeps found within a few % of the fastest at each 31B shape (the H100's of
# 2026-11-24; from 5 rows on, the 8-warp exceptions all three sweeps agreed on: docs/BENCHMARKS.md)
# and, at the E4B's, where the narrow 8-warp exception stops
DEFAULTS_31B = {
    4: {"qkv_sliding": (4, 1), "qk_full": (4, 1), "o_sliding": (4, 4), "o_full": (4, 4),
        "gate_up": (4, 6), "down": (4, 4)},
    8: {"qkv_sliding": (8, 2), "qk_full": (8, 3), "o_sliding": (4, 4), "o_full": (4, 4),
        "gate_up": (8, 3), "down": (4, 4)},
    16: {"qkv_sliding": (8, 1), "qk_full": (8, 3), "o_sliding": (8, 8), "o_full": (8, 8),
         "gate_up": (8, 3), "down": (8, 8)},
    32: {"qkv_sliding": (8, 2), "qk_full": (8, 2), "o_sliding": (8, 8), "o_full": (8, 8),
         "gate_up": (8, 1), "down": (8, 8)},
}


# E4B, 16 rows: o (2560 x 2048) and down (2560 x 10240) keep 4 warps, the PLE's 256 rows too;
# gate||up (20480 x 2560) is wide
DEFAULTS_E4B_16 = {(2560, 2048): (4, 8), (2560, 10240): (4, 8), (256, 2560): (4, 8),
                   (20480, 2560): (8, 3), (6144, 2560): (8, 6)}


def test_geometry_defaults_at_e4b_shapes() -> None:
    for (n, k), (warps, split) in DEFAULTS_E4B_16.items():
        assert gm.launch_geometry(16, n, k, SM_COUNT).entry == gm.entry_name(16, warps, split)


@pytest.mark.parametrize("rows", sorted(DEFAULTS_31B))
def test_geometry_defaults_at_31b_shapes(rows: int) -> None:
    for name, (warps, split) in DEFAULTS_31B[rows].items():
        n, k = SHAPES_31B[name]
        launch = gm.launch_geometry(rows, n, k, SM_COUNT)
        assert launch.entry == gm.entry_name(gm.row_bucket(rows), warps, split), name


def test_geometry_default_is_one_light_wave_or_many() -> None:
    """Every default grid is one wave of at most CTAS_PER_SM CTAs per SM, or an unsplittable one
    (K below two windows), or split so that every CTA keeps MANY_WAVES_WINDOWS windows, or (5 to
    16 rows, N >= WIDE_N) 8 warps split WIDE_SPLIT / WIDER_SPLIT; 8 warps exactly where the
    exceptions or the preferences say; no split leaves a CTA less than one window of K."""
    cap = gm.CTAS_PER_SM * SM_COUNT
    for m in ROWS:
        for n, k in (*SHAPES_31B.values(), *SHAPES_E4B.values(), *SHAPES_SMALL.values()):
            launch = gm.launch_geometry(m, n, k, SM_COUNT)
            groups, split = launch.grid[0], launch.grid[2]
            blocks = -(-k // 64)
            assert split == 1 or blocks >= split * 4
            assert (launch.block[0] == 256) == (gm.eight_warps(m, n, k, SM_COUNT)
                                                 or gm.row_bucket(m) == 32
                                                 or (gm.row_bucket(m) == 16
                                                     and gm.row_groups(n, 4) > cap))
            if 4 < m <= 16 and n >= gm.WIDE_N:
                wide = gm.WIDE_SPLIT[gm.row_bucket(m)] if groups <= SM_COUNT else gm.WIDER_SPLIT
                assert split == min(wide, max(s for s in gm.SPLITS if blocks >= s * 4)), (m, n, k)
            elif groups <= cap:
                assert groups * split <= cap
            else:
                assert split == 1 or blocks >= split * 4 * gm.MANY_WAVES_WINDOWS
    assert gm.launch_geometry(1, 128, 16, SM_COUNT).grid == (2, 1, 1)
    assert gm.launch_geometry(1, 16, 4096, SM_COUNT).grid == (1, 1, 8)  # one row group: split


def test_geometry_refuses_bad_shapes() -> None:
    for m, n, k in ((0, 16, 64), (33, 16, 64), (1, 0, 64), (1, 16, 8), (1, 16, 24)):
        with pytest.raises(ValueError, match="gemv_mma_fp8 needs"):
            gm.launch_geometry(m, n, k, SM_COUNT)
    with pytest.raises(ValueError, match="warps 2 not one of"):
        gm.launch_geometry(1, 16, 64, SM_COUNT, warps=2)
    with pytest.raises(ValueError, match="split 5 not one of"):
        gm.launch_geometry(1, 16, 64, SM_COUNT, split=5)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_compiles_with_every_entry(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(gm.SOURCE, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    for name in (name for kind in gm.ROW_KINDS for name in gm.entry_names(kind)):
        assert name.encode() in cubin


# ------------------------------------------------------------------------------------ GPU


@pytest.fixture(scope="module")
def kernel():
    """(context, {entry name: function}) with the module's cubin loaded once."""
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    cubin = compile_cubin(gm.SOURCE)
    fns = {}
    for name in (name for kind in gm.ROW_KINDS for name in gm.entry_names(kind)):
        fns[name] = ctx.load_function(cubin, name)
        ctx.set_max_dynamic_smem(fns[name], gm.smem_bytes(gm.MAX_ROWS))
    return ctx, fns


def run(kernel, launch: gm.Launch, dw, ds, x: np.ndarray, n: int,
        x_scale: np.ndarray | None = None) -> np.ndarray:
    """y of one launch on x (and, for f16 rows, their q_scale; uploaded here), the output
    NaN-poisoned first."""
    ctx, fns = kernel
    m, k = x.shape
    rows = [ctx.upload(np.ascontiguousarray(x))]
    if x_scale is not None:
        rows.append(ctx.upload(np.ascontiguousarray(x_scale)))
    dy = ctx.alloc(m * n * 4)
    ctx.memset(dy, 0xFF)  # NaN poison: every output must be written
    ctx.launch(fns[launch.entry], launch.grid, launch.block, launch.smem,
               [ctypes.c_uint64(b.ptr) for b in (dw, ds, *rows, dy)]
               + [ctypes.c_int(v) for v in (m, n, k)])
    ctx.synchronize()
    got = ctx.download(dy, np.float32, (m, n))
    for b in (*rows, dy):
        ctx.free(b)
    return got


def assert_matches_reference(got: np.ndarray, w, scale, x, where) -> None:
    """Every output written and each row within TOLERANCE (relative) of the reference."""
    assert np.isfinite(got).all(), where
    want = gm.reference(w, scale, x)
    err, ref = (got - want).astype(np.float64), want.astype(np.float64)
    rel = np.linalg.norm(err, axis=1) / np.linalg.norm(ref, axis=1)
    assert rel.max() < TOLERANCE, (*where, rel.max())


def check_rows(kernel, n: int, k: int, seed: int, kind: str, rows=ROWS, warps=None,
               split=None) -> None:
    """Fresh W, scale and x (f16: rows scaled by 1e-20 .. 1e20 from one to the next, their
    q_scale from the quantization reference); for each M in rows, the launch on x[:M] against
    the reference."""
    ctx, _ = kernel
    rng = np.random.default_rng(seed)
    w = random_fp8(rng, (n, k))
    scale = rng.uniform(1e-4, 1e-3, n).astype(np.float32)
    x = rng.normal(size=(max(rows), k)).astype(np.float32)
    if kind == "f16":
        x *= (10.0 ** rng.uniform(-20, 20, (max(rows), 1))).astype(np.float32)
    x = x.astype(ml_dtypes.bfloat16)
    dw, ds = ctx.upload(w), ctx.upload(scale)
    try:
        for m in rows:
            launch = gm.launch_geometry(m, n, k, ctx.sm_count, warps=warps, split=split,
                                        kind=kind)
            if kind == "f16":
                got = run(kernel, launch, dw, ds, x[:m], n,
                          gemm_tc.quantize_rows_reference(x[:m])[1])
            else:
                got = run(kernel, launch, dw, ds, x[:m], n)
            assert_matches_reference(got, w, scale, x[:m], (m, launch))
    finally:
        ctx.free(dw)
        ctx.free(ds)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", gm.ROW_KINDS)
@pytest.mark.parametrize("name", sorted({**SHAPES_31B, **SHAPES_E4B, **SHAPES_SMALL}))
def test_default_launch_matches_reference(kernel, name: str, kind: str) -> None:
    n, k = {**SHAPES_31B, **SHAPES_E4B, **SHAPES_SMALL}[name]
    check_rows(kernel, n, k, seed=n * 7 + k, kind=kind)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", gm.ROW_KINDS)
@pytest.mark.parametrize("warps", gm.WARPS)
@pytest.mark.parametrize("split", gm.SPLITS)
def test_every_entry_matches_reference(kernel, warps: int, split: int, kind: str) -> None:
    """Each (warps, split) entry of each row bucket on a ragged shape: N = 1000 (a partial CTA of
    rows), K = 4176 (65 whole k blocks and a quarter: partial windows in every split)."""
    check_rows(kernel, 1000, 4176, seed=warps * 10 + split, kind=kind,
               rows=(1, 7, 8, 9, 16, 17, 32), warps=warps, split=split)



@pytest.mark.gpu
@pytest.mark.parametrize("d", [256, 512])
def test_f16_rows_take_a_bound_above_their_amax(kernel, d: int) -> None:
    """The attention output's rows before o (launches.ATTENTION_OUT_BOUND): convex combinations
    of RMS-normed V rows, |x| <= sqrt(d), with that bound as every row's q_scale rather than the
    row's own amax: some rows near the bound (one-hot V), others far below it (V rows that
    cancel), against the same reference and tolerance, at the 31B's o shapes."""
    ctx, _ = kernel
    rng = np.random.default_rng(d)
    n, k = 5376, 32 * d
    w = random_fp8(rng, (n, k))
    scale = rng.uniform(1e-4, 1e-3, n).astype(np.float32)
    v = rng.normal(size=(64, k)).astype(np.float32)
    v[:4] = 0
    v[np.arange(4), rng.integers(0, k, 4)] = 1.0  # one-hot: the normed row's largest value
    v = v.reshape(64, -1, d)
    v /= np.sqrt((v * v).mean(-1, keepdims=True) + 1e-6)  # RMSNorm_noscale per head
    v = v.reshape(64, k)
    p = rng.dirichlet(np.full(64, 0.05), size=16).astype(np.float32)  # rows: convex combinations
    p[:2] = np.eye(64, dtype=np.float32)[:2]  # two rows that are one-hot V rows: at the bound
    x = (p @ v).astype(ml_dtypes.bfloat16)
    x[8:] = (x[8:].astype(np.float32) * 1e-6).astype(ml_dtypes.bfloat16)  # far below the bound
    bound = launches.ATTENTION_OUT_BOUND * np.sqrt(d)
    assert np.sqrt(d) * 0.99 < np.abs(x.astype(np.float32)).max() <= bound
    dw, ds = ctx.upload(w), ctx.upload(scale)
    try:
        for m in (2, 8, 16):
            launch = gm.launch_geometry(m, n, k, ctx.sm_count, kind="f16")
            got = run(kernel, launch, dw, ds, x[:m], n,
                      np.full(m, bound / gemm_tc.E4M3_MAX, np.float32))
            assert_matches_reference(got, w, scale, x[:m], (m, launch))
    finally:
        ctx.free(dw)
        ctx.free(ds)
