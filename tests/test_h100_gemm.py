"""FP8-weight prefill GEMM (targets/h100): launch geometry and the kernel's build on the CPU; on a
GPU, every entry (rows per CTA x split-K) against the numpy reference on fresh random inputs at
tiny shapes with odd M, N and K tails, and the default launch at real 31B shapes."""

from __future__ import annotations

import ctypes
import shutil

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.targets.h100 import gemm_fp8w


def test_launch_geometry_covers_rows_columns_and_splits() -> None:
    launch = gemm_fp8w.launch_geometry(200, 1000, 64, sm_count=132)
    assert launch.entry == "gemm_fp8w_m128_s1"  # one k slice: nothing to split
    assert launch.grid == (2, 8, 1) and launch.block == (256, 1, 1)
    assert gemm_fp8w.launch_geometry(5, 64, 16, 132).entry == "gemm_fp8w_m16_s1"
    assert gemm_fp8w.launch_geometry(33, 64, 16, 132).entry == "gemm_fp8w_m64_s1"
    assert gemm_fp8w.launch_geometry(100, 64, 64, 132, block_m=64).grid == (2, 1, 1)
    # 42 column tiles fill a sixth of the 264 resident slots: a quarter of K each
    down = gemm_fp8w.launch_geometry(64, 5376, 21504, 132)
    assert down.entry == "gemm_fp8w_m64_s4" and down.grid == (1, 42, 4)
    # 144 tiles: 2 CTAs of half K on a few SMs are no better than 1 whole one; 4 quarters are
    assert gemm_fp8w.launch_geometry(64, 18432, 5376, 132).grid == (1, 144, 4)
    # 672 tiles of 128 rows, one per SM: about 5 waves already
    assert gemm_fp8w.launch_geometry(256, 43008, 5376, 132).grid == (2, 336, 1)
    for block_m in gemm_fp8w.BLOCK_MS:
        for split in gemm_fp8w.SPLITS:
            assert gemm_fp8w.smem_bytes(block_m, split) <= 227 * 1024


@pytest.mark.parametrize("m,n,k", [(0, 64, 64), (4, 0, 64), (4, 64, 0), (4, 64, 40)])
def test_launch_geometry_rejects_bad_shapes(m: int, n: int, k: int) -> None:
    with pytest.raises(ValueError, match="gemm_fp8w"):
        gemm_fp8w.launch_geometry(m, n, k, 132)


def test_launch_geometry_rejects_unknown_variants() -> None:
    with pytest.raises(ValueError, match="block_m 48"):
        gemm_fp8w.launch_geometry(8, 64, 64, 132, block_m=48)
    with pytest.raises(ValueError, match="split 3"):
        gemm_fp8w.launch_geometry(8, 64, 64, 132, split=3)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_kernel_builds_every_entry(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(gemm_fp8w.SOURCE, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    for block_m in gemm_fp8w.BLOCK_MS:
        for split in gemm_fp8w.SPLITS:
            assert gemm_fp8w.entry_name(block_m, split).encode() + b"\0" in cubin


def random_fp8(rng, shape) -> np.ndarray:
    """Random e4m3 bit patterns (subnormals included) with NaN codes (0x7f, 0xff) removed."""
    b = rng.integers(0, 256, size=shape, dtype=np.uint8)
    b[(b & 0x7F) == 0x7F] ^= 0x01
    return b


GUARD = 256  # floats after y that must stay untouched


def run_gemm(ctx, launch, w: np.ndarray, scale: np.ndarray, x: np.ndarray) -> np.ndarray:
    from rvcompile.targets.h100.nvcc import compile_cubin

    (m, k), n = x.shape, w.shape[0]
    fn = ctx.load_function(compile_cubin(gemm_fp8w.SOURCE), launch.entry)
    ctx.set_max_dynamic_smem(fn, launch.smem)
    dw, ds, dx = ctx.upload(w), ctx.upload(scale), ctx.upload(x)
    dy = ctx.alloc((m * n + GUARD) * 4)
    ctx.memset(dy, 0xFF)  # NaN poison: every output must be written, nothing past it
    ctx.launch(fn, launch.grid, launch.block, launch.smem,
               [ctypes.c_uint64(b.ptr) for b in (dw, ds, dx, dy)]
               + [ctypes.c_int(v) for v in (m, n, k)])
    ctx.synchronize()
    out = ctx.download(dy, np.float32, (m * n + GUARD,))
    for b in (dw, ds, dx, dy):
        ctx.free(b)
    assert np.isnan(out[m * n:]).all(), "wrote past the end of y"
    return out[:m * n].reshape(m, n)


def check_against_reference(got: np.ndarray, w, scale, x) -> None:
    want = gemm_fp8w.reference(w, scale, x)
    assert np.isfinite(got).all()
    # both accumulate in float32; only the order differs
    row_rel = np.linalg.norm(got - want, axis=1) / np.linalg.norm(want, axis=1)
    assert row_rel.max() < 1e-5, row_rel.max()


def random_case(m: int, n: int, k: int):
    rng = np.random.default_rng(m * 1_000_003 + n * 7 + k)
    w = random_fp8(rng, (n, k))
    scale = rng.uniform(1e-4, 1e-3, n).astype(np.float32)
    x = rng.normal(size=(m, k)).astype(ml_dtypes.bfloat16)
    return w, scale, x


TINY = [  # (M, N, K): every rows-per-CTA entry, odd M and N tails, K tails inside a 64-wide slice
    (5, 64, 16), (7, 1000, 64), (16, 129, 128), (1, 96, 128), (17, 255, 64), (31, 1024, 16),
    (33, 777, 128), (9, 200, 80), (64, 513, 64), (40, 64, 208), (100, 300, 128), (200, 130, 64),
]


@pytest.mark.gpu
@pytest.mark.parametrize("split", gemm_fp8w.SPLITS)
@pytest.mark.parametrize("m,n,k", TINY)
def test_gemm_tiny_matches_reference(m: int, n: int, k: int, split: int) -> None:
    ctx = h100_context()
    w, scale, x = random_case(m, n, k)
    got = run_gemm(ctx, gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count, split=split),
                   w, scale, x)
    check_against_reference(got, w, scale, x)


FORCED_TILES = [  # (M, N, K, rows per CTA): smaller tiles than the default, several row tiles
    (100, 300, 128, 64), (64, 513, 64, 32), (40, 200, 80, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k,block_m", FORCED_TILES)
def test_gemm_several_row_tiles_match_reference(m: int, n: int, k: int, block_m: int) -> None:
    ctx = h100_context()
    w, scale, x = random_case(m, n, k)
    got = run_gemm(ctx, gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count, block_m=block_m),
                   w, scale, x)
    check_against_reference(got, w, scale, x)


SHAPES_31B = [  # (M, N, K)
    (16, 5376, 21504),  # down, a 16-token chunk
    (64, 16384, 5376),  # q/k/v sliding
    (100, 18432, 5376),  # q/k full, a ragged chunk
    (256, 43008, 5376),  # gate||up
    (256, 5376, 21504),  # down
]


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", SHAPES_31B)
def test_gemm_31b_shapes_match_reference(m: int, n: int, k: int) -> None:
    ctx = h100_context()
    w, scale, x = random_case(m, n, k)
    got = run_gemm(ctx, gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count), w, scale, x)
    check_against_reference(got, w, scale, x)


@pytest.mark.gpu
def test_gemm_split_k_is_deterministic_and_agrees() -> None:
    ctx = h100_context()
    m, n, k = 64, 5376, 21504
    w, scale, x = random_case(m, n, k)
    outs = {s: run_gemm(ctx, gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count, split=s),
                        w, scale, x) for s in gemm_fp8w.SPLITS}
    again = run_gemm(ctx, gemm_fp8w.launch_geometry(m, n, k, ctx.sm_count, split=4), w, scale, x)
    assert np.array_equal(outs[4], again)
    for got in outs.values():
        check_against_reference(got, w, scale, x)
