"""Row packing of the assistant drafter (kernels/draft_rows.cu): numpy references and launch
geometry.

`draft_concat_bf16(a f32 [M, Ha], b f32 [M, Hb], out bf16 [M, Ha + Hb], M, Ha, Hb)`: each row
of out is bf16 of a's row then b's row: the drafter's pre_projection input, the target's
embedding of the token beside the state (ir/draft_frontend.py's CONCAT), as the quantized
plan's GEMVs read it (bf16, round to nearest even). `draft_concat_f32`: the same into float32
rows (the float32 plan), exact.
"""

from __future__ import annotations

import numpy as np

from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch
from rvcompile.targets.h100.ple import to_bf16

SOURCE = "draft_rows.cu"
CONCAT_ENTRY = "draft_concat_bf16"
CONCAT_F32_ENTRY = "draft_concat_f32"
THREADS = 256  # must match the kernel


def concat(a: np.ndarray, b: np.ndarray, f32: bool) -> np.ndarray:
    """[M, Ha] and [M, Hb] float32 -> [M, Ha + Hb], float32 or bf16."""
    out = np.concatenate([np.asarray(a, np.float32), np.asarray(b, np.float32)], axis=1)
    return out if f32 else to_bf16(out)


def _concat_call(c: Call, f32: bool) -> None:
    m, ha, hb = c["M"], c["Ha"], c["Hb"]
    c.array("out", (m, ha + hb))[:] = concat(c.array("a", (m, ha)), c.array("b", (m, hb)), f32)


ENTRIES = tuple(
    Entry(name, SOURCE, (ptr("a", "float32"), ptr("b", "float32"), ptr("out", dtype, "out"),
                         i32("M"), i32("Ha"), i32("Hb")),
          lambda c, f32=dtype == "float32": _concat_call(c, f32))
    for name, dtype in ((CONCAT_ENTRY, "bfloat16"), (CONCAT_F32_ENTRY, "float32")))


def concat_geometry(m: int, width: int) -> Launch:
    """A thread per output element: (ceil(width / THREADS), M) CTAs."""
    return Launch((-(-width // THREADS), m, 1), (THREADS, 1, 1), 0)
