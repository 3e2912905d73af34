"""Row utilities (kernels/rows.cu): numpy references and launch geometry.

`select_row_bf16(src bf16 [M, H], row int32 [1], dst bf16 [1, H], H)`: dst = src[row[0]].
`select_row_f32(src f32 [M, H], row, dst f32 [1, H], H)`: the same over float32 rows.
`softcap_rows(x f32 [n], n, cap)`: x = cap * tanh(x / cap) in place (the IR's SOFTCAP).
"""

from __future__ import annotations

import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, i64, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "rows.cu"
SELECT_ENTRY = "select_row_bf16"
SELECT_F32_ENTRY = "select_row_f32"
SOFTCAP_ENTRY = "softcap_rows"
THREADS = 256


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(cap), np.asarray(x, np.float32))


def _select_call(c: Call) -> None:
    r, h = int(c.array("row", (1,))[0]), c["H"]
    c.array("dst", (h,))[:] = c.array("src", (r + 1, h))[r]


def _softcap_call(c: Call) -> None:
    x = c.array("x", (c["n"],))
    x[:] = softcap(x, c["cap"])


ENTRIES = (
    *(Entry(name, SOURCE, (ptr("src", dtype), ptr("row", "int32"), ptr("dst", dtype, "out"),
                           i32("H")), _select_call)
      for name, dtype in ((SELECT_ENTRY, "bfloat16"), (SELECT_F32_ENTRY, "float32"))),
    Entry(SOFTCAP_ENTRY, SOURCE, (ptr("x", "float32", "inout"), i64("n"), f32("cap")),
          _softcap_call),
)


def select_geometry(h: int) -> Launch:
    return Launch((-(-h // THREADS), 1, 1), (THREADS, 1, 1), 0)


def softcap_geometry(n: int) -> Launch:
    return Launch((-(-n // THREADS), 1, 1), (THREADS, 1, 1), 0)
