"""The schedule's own small kernels (targets/h100): the bf16 head GEMV at the 31B head shape and
the tiny vocab, select_rows and softcap_rows, each on a GPU against its numpy reference on fresh
random inputs."""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.targets.h100 import gemv_bf16, rows
from rvcompile.targets.h100.nvcc import compile_cubin

P, I32, F32 = ctypes.c_uint64, ctypes.c_int, ctypes.c_float


@pytest.mark.gpu
@pytest.mark.parametrize("m,n,k", [(1, 262144, 5376), (4, 262144, 5376), (3, 1024, 64),
                                   (2, 1024, 128)])
def test_gemv_bf16_matches_reference(m, n, k):
    ctx = h100_context()
    rng = np.random.default_rng(n + k + m)
    w = rng.normal(0, 0.05, (n, k)).astype(ml_dtypes.bfloat16)
    x = rng.normal(0, 1, (m, k)).astype(ml_dtypes.bfloat16)
    fn = ctx.load_function(compile_cubin(gemv_bf16.SOURCE), gemv_bf16.ENTRY)
    g = gemv_bf16.launch_geometry(m, n, k, ctx.sm_count)
    dw, dx, dy = ctx.upload(w), ctx.upload(x), ctx.alloc(m * n * 4)
    ctx.launch(fn, g.grid, g.block, g.smem, [P(dw.ptr), P(dx.ptr), P(dy.ptr), I32(m), I32(n),
                                             I32(k)])
    got = ctx.download(dy, np.float32, (m, n))
    want = gemv_bf16.reference(w, x)
    # float32 sums in another order: bounded by a few ulps of the sum of |terms|
    magnitude = gemv_bf16.reference(np.abs(w.astype(np.float32)), np.abs(x.astype(np.float32)))
    assert (np.abs(got - want) <= 2e-5 * magnitude + 1e-6).all()


@pytest.mark.gpu
def test_select_rows_and_softcap():
    """select_rows_bf16 over S = 4 rows (one unused, -1: zeros) into a NaN-poisoned output."""
    ctx = h100_context()
    rng = np.random.default_rng(0)
    cubin = compile_cubin(rows.SOURCE)
    src = rng.normal(size=(7, 96)).astype(ml_dtypes.bfloat16)
    pick = np.array([5, 0, -1, 6], np.int32)
    dst = np.full((4, 96), np.nan, ml_dtypes.bfloat16)
    dsrc, drow, ddst = ctx.upload(src), ctx.upload(pick), ctx.upload(dst)
    g = rows.select_geometry(4, 96)
    ctx.launch(ctx.load_function(cubin, rows.SELECT_ENTRY), g.grid, g.block, 0,
               [P(dsrc.ptr), P(drow.ptr), P(ddst.ptr), I32(4), I32(96)])
    got = ctx.download(ddst, ml_dtypes.bfloat16, (4, 96))
    want = np.stack([src[5], src[0], np.zeros(96, ml_dtypes.bfloat16), src[6]])
    assert np.array_equal(got.astype(np.float32), want.astype(np.float32))
    x = rng.normal(0, 40, 5000).astype(np.float32)
    dx = ctx.upload(x)
    g = rows.softcap_geometry(x.size)
    ctx.launch(ctx.load_function(cubin, rows.SOFTCAP_ENTRY), g.grid, g.block, 0,
               [P(dx.ptr), ctypes.c_int64(x.size), F32(30.0)])
    assert np.abs(ctx.download(dx, np.float32, x.shape) - rows.softcap(x, 30.0)).max() < 1e-5
