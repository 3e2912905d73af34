"""draft_concat (targets/h100/draft_rows.py, kernels/draft_rows.cu): the drafter's pre_projection
input, the target's embedding of the token beside the state in one row per lane.

CPU: the reference is the IR's CONCAT (ops reference) then, for the bf16 entry, the bf16 rounding
the quantized plan's GEMVs read; the module compiles. GPU (marked gpu): each entry against the
reference, bit for bit, at the 31B's width (H = 5376) and the tiny model's (256), M in {1, 3},
the output NaN-poisoned first.
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
