"""GELU-gated product after the fused gate||up GEMV (kernels/gelu_mul.cu): numpy reference and
launch geometry.

Entry `gelu_mul(gu f32 [M, 2I], out bf16 [M, I], I)`:
    out = bf16(gelu_tanh(gu[:, :I]) * gu[:, I:])     (ops.gelu_tanh, f32; the gate comes first)
the MUL(GELU_TANH(gate), up) of the IR's GATED_LINEAR, rounded to bf16 for the down GEMV.
Entry `gelu_mul_f32(gu, out f32 [M, I], I)` (the float32 plan): the same product, unrounded.
Limits: I % 4 == 0, any M >= 1 (grid (ceil(I/4 / 256), M); the tiny models' I = 32 uses one
CTA of 8 live threads per row).
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "gelu_mul.cu"
ENTRY = "gelu_mul"
F32_ENTRY = "gelu_mul_f32"
THREADS = 256  # must match the kernel


def reference(gu: np.ndarray) -> np.ndarray:
    return reference_f32(gu).astype(ml_dtypes.bfloat16)


def reference_f32(gu: np.ndarray) -> np.ndarray:
    gu = np.asarray(gu, np.float32)
    i = gu.shape[-1] // 2
    return ops.ref_mul(None, ops.gelu_tanh(gu[..., :i]), gu[..., i:])


def _call(ref, c: Call) -> None:
    m, i = c.grid[1], c["I"]
    c.array("out", (m, i))[:] = ref(c.array("gu", (m, 2 * i)))


ENTRIES = tuple(
    Entry(name, SOURCE, (ptr("gu", "float32"), ptr("out", dtype, "out"), i32("I")),
          partial(_call, ref))
    for name, dtype, ref in ((ENTRY, "bfloat16", reference), (F32_ENTRY, "float32", reference_f32)))


def launch_geometry(m: int, i: int) -> Launch:
    if m < 1 or i % 4:
        raise ValueError(f"gelu_mul needs M >= 1 and I % 4 == 0 (M={m}, I={i})")
    return Launch((-(-(i // 4) // THREADS), m, 1), (THREADS, 1, 1), 0)
