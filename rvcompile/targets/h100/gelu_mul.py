"""GELU-gated product after the fused gate||up GEMV (kernels/gelu_mul.cu): numpy reference and
launch geometry.

Entry `gelu_mul(gu f32 [M, 2I], out bf16 [M, I], I)`:
    out = bf16(gelu_tanh(gu[:, :I]) * gu[:, I:])     (ops.gelu_tanh, f32; the gate comes first)
the MUL(GELU_TANH(gate), up) of the IR's GATED_LINEAR, rounded to bf16 for the down GEMV.
Entry `gelu_mul_f32(gu, out f32 [M, I], I)` (the float32 plan): the same product, unrounded.
Limits: I % 4 == 0, any M >= 1 (grid (ceil(I/4 / 256), M); the tiny models' I = 32 uses one
CTA of 8 live threads per row).
Entry `gelu_mul_q(gu, out bf16 [M, I], q e4m3 [M, I], q_scale f32 [M], I)`: `gelu_mul`'s out and
its per-row FP8 quantization (gemm_tc.quantize_rows_reference of out) for the FP8 tensor-core
GEMM, so that GEMM needs no quant_fp8_rows launch; one CTA of 1024 threads per row
(`q_geometry`), I <= 32768.
"""

from __future__ import annotations

from functools import partial

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch
from rvcompile.targets.h100.norms import write_quantized

SOURCE = "gelu_mul.cu"
ENTRY = "gelu_mul"
F32_ENTRY = "gelu_mul_f32"
Q_ENTRY = "gelu_mul_q"
THREADS = 256  # must match the kernel
Q_THREADS, Q_MAX_I = 1024, 1024 * 4 * 8  # gelu_mul_q's CTA and row limit (the kernel's)


def reference(gu: np.ndarray) -> np.ndarray:
    return reference_f32(gu).astype(ml_dtypes.bfloat16)


def reference_f32(gu: np.ndarray) -> np.ndarray:
    gu = np.asarray(gu, np.float32)
    i = gu.shape[-1] // 2
    return ops.ref_mul(None, ops.gelu_tanh(gu[..., :i]), gu[..., i:])


def _call(ref, c: Call) -> None:
    m, i = c.grid[1], c["I"]
    c.array("out", (m, i))[:] = ref(c.array("gu", (m, 2 * i)))


def _q_call(c: Call) -> None:
    m, i = c.grid[0], c["I"]
    out = reference(c.array("gu", (m, 2 * i)))
    c.array("out", (m, i))[:] = out
    write_quantized(c, out)


ENTRIES = tuple(
    Entry(name, SOURCE, (ptr("gu", "float32"), ptr("out", dtype, "out"), i32("I")),
          partial(_call, ref))
    for name, dtype, ref in ((ENTRY, "bfloat16", reference), (F32_ENTRY, "float32", reference_f32))
) + (Entry(Q_ENTRY, SOURCE, (ptr("gu", "float32"), ptr("out", "bfloat16", "out"),
                             ptr("q", "float8_e4m3fn", "out"), ptr("q_scale", "float32", "out"),
                             i32("I")), _q_call),)


def launch_geometry(m: int, i: int) -> Launch:
    if m < 1 or i % 4:
        raise ValueError(f"gelu_mul needs M >= 1 and I % 4 == 0 (M={m}, I={i})")
    return Launch((-(-(i // 4) // THREADS), m, 1), (THREADS, 1, 1), 0)


def q_geometry(m: int, i: int) -> Launch:
    """gelu_mul_q: one CTA per row."""
    if m < 1 or i % 4 or i > Q_MAX_I:
        raise ValueError(f"gelu_mul_q needs M >= 1, I % 4 == 0 and I <= {Q_MAX_I} (M={m}, I={i})")
    return Launch((m, 1, 1), (Q_THREADS, 1, 1), 0)
