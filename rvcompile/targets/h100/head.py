"""The ends of the decode step (kernels/head.cu): numpy references and launch geometry.

`softcap_argmax(logits f32 [M, V], V, cap, out int32 [M])`:
    out[m] = argmax(cap * tanh(logits[m] / cap)), f32, ties to the lowest index (numpy.argmax);
    greedy decoding of the IR's SOFTCAP then SAMPLE at temperature 0. Finite logits; V % 4 == 0.
`embed_rows_bf16(table bf16 [V, H], ids int32 [M], mult, h f32 [M, H], H)`: h = table[ids] * mult.
`embed_rows_fp8(table e4m3 uint8 [V, H], row_scale f32 [V], ids int32 [M], mult, h, H)`:
    h = (e4m3(table[ids]) * row_scale[ids]) * mult.
`embed_rows_f32(table f32 [V, H], ids, mult, h, H)` (the float32 plan): h = table[ids] * mult.
Both are ops.ref_embed with mult = the bf16-rounded sqrt(H) of Gemma 4 (passed by the caller).
Limits: any M >= 1; argmax V % 4 == 0 (one CTA of 1024 threads per row, from the tiny models'
vocab 1024 to 262144); embed H % 8 (bf16), H % 16 (e4m3) or H % 4 (f32), the tiny models'
H = 64, 128 too.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "head.cu"
ARGMAX_ENTRY = "softcap_argmax"
EMBED_BF16_ENTRY = "embed_rows_bf16"
EMBED_FP8_ENTRY = "embed_rows_fp8"
EMBED_F32_ENTRY = "embed_rows_f32"
ARGMAX_THREADS = 1024  # must match the kernel
EMBED_THREADS = 128  # must match the kernel


def softcap(logits: np.ndarray, cap: float) -> np.ndarray:
    return ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(cap), np.asarray(logits, np.float32))


def softcap_argmax(logits: np.ndarray, cap: float) -> np.ndarray:
    return np.argmax(softcap(logits, cap), axis=-1).astype(np.int32)


def embed_rows(table: np.ndarray, ids: np.ndarray, mult: float,
               row_scale: np.ndarray | None = None) -> np.ndarray:
    """table bf16 or f32, or uint8 e4m3 codes with row_scale."""
    if row_scale is not None:
        table = np.asarray(table).view(ml_dtypes.float8_e4m3fn)
    return ops.ref_embed(ops.EmbedAttrs(mult), table, np.asarray(ids), row_scale)


def _argmax_call(c: Call) -> None:
    m, v = c.grid[0], c["V"]
    c.array("out", (m,))[:] = softcap_argmax(c.array("logits", (m, v)), c["cap"])


def _embed_call(c: Call) -> None:
    """The table rows up to the largest id (the table's height is no argument)."""
    m, h = c.grid[1], c["H"]
    ids = np.asarray(c.array("ids", (m,)))
    height = int(ids.max()) + 1
    scale = c.array("row_scale", (height,)) if "row_scale" in c else None
    rows = c.array("table", (height, h))[ids]
    c.array("h", (m, h))[:] = embed_rows(rows, np.arange(m), c["mult"],
                                         None if scale is None else scale[ids])


def _entries():
    yield Entry(ARGMAX_ENTRY, SOURCE, (ptr("logits", "float32"), i32("V"), f32("cap"),
                                       ptr("out", "int32", "out")), _argmax_call)
    for name, dtype in ((EMBED_BF16_ENTRY, "bfloat16"), (EMBED_FP8_ENTRY, "float8_e4m3fn"),
                        (EMBED_F32_ENTRY, "float32")):
        scale = (ptr("row_scale", "float32"),) if dtype == "float8_e4m3fn" else ()
        yield Entry(name, SOURCE, (ptr("table", dtype), *scale, ptr("ids", "int32"),
                                   f32("mult"), ptr("h", "float32", "out"), i32("H")),
                    _embed_call)


ENTRIES = tuple(_entries())


def argmax_geometry(m: int, v: int) -> Launch:
    if m < 1 or v % 4:
        raise ValueError(f"softcap_argmax needs M >= 1 and V % 4 == 0 (M={m}, V={v})")
    return Launch((m, 1, 1), (ARGMAX_THREADS, 1, 1), 0)


def embed_geometry(m: int, h: int, fp8: bool, f32: bool = False) -> Launch:
    per = 4 if f32 else 16 if fp8 else 8  # elements per 16-byte table load
    if m < 1 or h % per:
        raise ValueError(f"embed_rows needs M >= 1 and H % {per} == 0 (M={m}, H={h})")
    return Launch((-(-(h // per) // EMBED_THREADS), m, 1), (EMBED_THREADS, 1, 1), 0)
