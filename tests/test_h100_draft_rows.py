"""The drafter's row kernels (targets/h100/draft_rows.py, kernels/draft_rows.cu): draft_concat
(the pre_projection input, the target's embedding of the token beside the state in one row per
lane) and the centroid-masked head (centroid_select, centroid_score, centroid_fill).

CPU: draft_concat's reference is the IR's CONCAT (ops reference) then, for the bf16 entry, the
bf16 rounding the quantized plan's GEMVs read; the centroid references composed are the IR's
CENTROID_HEAD (with ties among the centroid logits: the lower cluster first); the module
compiles. GPU (marked gpu): draft_concat against the reference bit for bit at the 31B's width
(H = 5376) and the tiny model's (256); the centroid kernels at E2B's shape (C = 2048, top 32,
V = 262144, D = 256) and a tiny one, M in {1, 3}: the same token ids, logits within float32
summation order; outputs NaN-poisoned first.
"""

from __future__ import annotations

import ctypes
import shutil
import zlib

import ml_dtypes
import numpy as np
import pytest
from h100_helpers import h100_context

from rvcompile.ir import ops
from rvcompile.targets.h100 import draft_rows

WIDTHS = {"31B": 5376, "default": 256}
# name -> (clusters C, top_k, vocab V, width D)
CENTROIDS = {"E2B": (2048, 32, 262144, 256), "tiny": (16, 4, 1024, 64)}


def _inputs(m: int, h: int, seed: str) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(zlib.crc32(seed.encode()))
    return (rng.normal(0, 30, (m, h)).astype(np.float32),
            rng.normal(0, 2, (m, h)).astype(np.float32))


@pytest.mark.parametrize("f32", [True, False], ids=["f32", "bf16"])
def test_reference_is_the_ir_concat(f32: bool) -> None:
    a, b = _inputs(3, 64, "ref")
    want = ops.OPS[ops.Op.CONCAT].reference(None, a, b)
    got = draft_rows.concat(a, b, f32)
    if f32:
        assert got.dtype == np.float32 and np.array_equal(got, want)
    else:
        assert got.dtype == ml_dtypes.bfloat16
        assert np.array_equal(got.astype(np.float32), ops.to_bf16(want))


@pytest.mark.parametrize("f32", [True, False], ids=["f32", "bf16"])
def test_centroid_references_are_the_ir_centroid_head(f32: bool) -> None:
    c, k, v, d = CENTROIDS["tiny"]
    rng = np.random.default_rng(3)
    h = rng.normal(0, 1, (3, d)).astype(np.float32)
    table = rng.normal(0, 1, (v, d)).astype(np.float32 if f32 else ml_dtypes.bfloat16)
    cl = rng.normal(0, 1, (3, c)).astype(np.float32)
    cl[1, 5] = cl[1, 9] = cl[1].max() + 1  # a tie: the lower cluster first
    ordering = rng.permutation(v).astype(np.int32)
    want = ops.OPS[ops.Op.CENTROID_HEAD].reference(ops.CentroidHeadAttrs(k, c), h, cl, ordering,
                                                   table)
    ids = draft_rows.select(cl, ordering, k)
    assert ids.shape == (3, k * v // c)
    assert list(ids[1, :v // c]) == list(ordering[5 * (v // c):6 * (v // c)])
    x = h if f32 else h.astype(ml_dtypes.bfloat16)  # the plan's GEMV copy of the normed row
    got = draft_rows.fill(draft_rows.score(x, table, ids), ids, v)
    assert np.array_equal(got, want)


def test_geometry() -> None:
    g = draft_rows.concat_geometry(3, 2 * 5376)
    assert g.grid == (42, 3, 1) and g.block == (256, 1, 1)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_compiles(tmp_path) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    cubin = compile_cubin(draft_rows.SOURCE, cache_dir=tmp_path)
    assert cubin[:4] == b"\x7fELF"
    for entry in (draft_rows.CONCAT_ENTRY, draft_rows.CONCAT_F32_ENTRY):
        assert entry.encode() + b"\x00" in cubin


@pytest.mark.gpu
@pytest.mark.parametrize("f32", [True, False], ids=["f32", "bf16"])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("model", sorted(WIDTHS))
def test_concat_kernel(model: str, m: int, f32: bool) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    entry = draft_rows.CONCAT_F32_ENTRY if f32 else draft_rows.CONCAT_ENTRY
    fn = ctx.load_function(compile_cubin(draft_rows.SOURCE), entry)
    h = WIDTHS[model]
    a, b = _inputs(m, h, f"concat{model}{m}")
    size = 4 if f32 else 2
    da, db, out = ctx.upload(a), ctx.upload(b), ctx.alloc(m * 2 * h * size)
    ctx.memset(out, 0xFF)  # NaN in f32 and bf16
    g = draft_rows.concat_geometry(m, 2 * h)
    ctx.launch(fn, g.grid, g.block, g.smem,
               [ctypes.c_uint64(x.ptr) for x in (da, db, out)]
               + [ctypes.c_int(m), ctypes.c_int(h), ctypes.c_int(h)])
    ctx.synchronize()
    dtype = np.float32 if f32 else ml_dtypes.bfloat16
    got = ctx.download(out, dtype, (m, 2 * h))
    for x in (da, db, out):
        ctx.free(x)
    want = draft_rows.concat(a, b, f32)
    assert np.array_equal(got.view(np.uint32 if f32 else np.uint16),
                          want.view(np.uint32 if f32 else np.uint16))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("shape", sorted(CENTROIDS))
def test_centroid_kernels(shape: str, m: int) -> None:
    from rvcompile.targets.h100.nvcc import compile_cubin

    ctx = h100_context()
    cubin = compile_cubin(draft_rows.SOURCE)
    fn = {e: ctx.load_function(cubin, e) for e in (draft_rows.SELECT_ENTRY, draft_rows.SCORE_ENTRY,
                                                    draft_rows.FILL_ENTRY)}
    c, k, v, d = CENTROIDS[shape]
    t, n = v // c, k * v // c
    rng = np.random.default_rng(zlib.crc32(f"centroids{shape}{m}".encode()))
    cl = rng.normal(0, 1, (m, c)).astype(np.float32)
    ordering = rng.permutation(v).astype(np.int32)
    h = rng.normal(0, 1, (m, d)).astype(ml_dtypes.bfloat16)
    table = rng.normal(0, 1, (v, d)).astype(ml_dtypes.bfloat16)
    bufs = {name: ctx.upload(a) for name, a in (("cl", cl), ("ordering", ordering), ("h", h),
                                                 ("table", table))}
    for name, nbytes in (("ids", m * n * 4), ("sel", m * n * 4), ("logits", m * v * 4)):
        bufs[name] = ctx.alloc(nbytes)
        ctx.memset(bufs[name], 0xFF)
    p = {name: ctypes.c_uint64(b.ptr) for name, b in bufs.items()}
    g = draft_rows.select_geometry(m, c)
    ctx.launch(fn[draft_rows.SELECT_ENTRY], g.grid, g.block, g.smem,
               [p["cl"], p["ordering"], p["ids"], ctypes.c_int(c), ctypes.c_int(t),
                ctypes.c_int(k)])
    g = draft_rows.score_geometry(m, n)
    ctx.launch(fn[draft_rows.SCORE_ENTRY], g.grid, g.block, g.smem,
               [p["h"], p["table"], p["ids"], p["sel"], ctypes.c_int(n), ctypes.c_int(d)])
    g = draft_rows.fill_geometry(m)
    ctx.launch(fn[draft_rows.FILL_ENTRY], g.grid, g.block, g.smem,
               [p["sel"], p["ids"], p["logits"], ctypes.c_int(n), ctypes.c_int(v)])
    ctx.synchronize()
    ids = ctx.download(bufs["ids"], np.int32, (m, n))
    logits = ctx.download(bufs["logits"], np.float32, (m, v))
    for b in bufs.values():
        ctx.free(b)
    want_ids = draft_rows.select(cl, ordering, k)
    assert np.array_equal(ids, want_ids)
    want = draft_rows.fill(draft_rows.score(h, table, want_ids), want_ids, v)
    assert np.isfinite(logits).all()
    np.testing.assert_allclose(logits, want, rtol=1e-5, atol=1e-5)
