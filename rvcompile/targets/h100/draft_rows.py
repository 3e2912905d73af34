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

from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, i32, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch
from rvcompile.targets.h100.ple import to_bf16

SOURCE = "draft_rows.cu"
CONCAT_ENTRY = "draft_concat_bf16"
CONCAT_F32_ENTRY = "draft_concat_f32"
SELECT_ENTRY = "centroid_select"
SCORE_ENTRY = "centroid_score_bf16"
SCORE_F32_ENTRY = "centroid_score_f32"
FILL_ENTRY = "centroid_fill"
THREADS = 256  # must match the kernels (draft_concat, centroid_select, centroid_score)
SCORE_WARPS = 8  # tokens per centroid_score CTA; must match the kernel
FILL_THREADS = 1024  # must match the kernel


def concat(a: np.ndarray, b: np.ndarray, f32: bool) -> np.ndarray:
    """[M, Ha] and [M, Hb] float32 -> [M, Ha + Hb], float32 or bf16."""
    out = np.concatenate([np.asarray(a, np.float32), np.asarray(b, np.float32)], axis=1)
    return out if f32 else to_bf16(out)


def _concat_call(c: Call, f32: bool) -> None:
    m, ha, hb = c["M"], c["Ha"], c["Hb"]
    c.array("out", (m, ha + hb))[:] = concat(c.array("a", (m, ha)), c.array("b", (m, hb)), f32)


def select(cl: np.ndarray, ordering: np.ndarray, top_k: int) -> np.ndarray:
    """ids int32 [M, top_k * V / C] of cl [M, C]: ops.centroid_tokens."""
    a = ops.CentroidHeadAttrs(top_k, cl.shape[-1])
    return ops.centroid_tokens(a, cl, ordering).astype(np.int32)


def score(h: np.ndarray, table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """sel f32 [M, N]: h[m] . table[ids[m, n]] (h as given: bf16 beside a bf16 table)."""
    rows = ops.as_compute(table)[ids]  # [M, N, D]
    return np.einsum("md,mnd->mn", ops.as_compute(h), rows, dtype=np.float32)


def fill(sel: np.ndarray, ids: np.ndarray, vocab: int) -> np.ndarray:
    """logits f32 [M, V]: min(sel) - 1 everywhere, sel at ids."""
    out = np.repeat(sel.min(-1, keepdims=True) - np.float32(1), vocab, axis=-1)
    np.put_along_axis(out, ids, sel, axis=-1)
    return out.astype(np.float32)


def _select_call(c: Call) -> None:
    m, clusters, t, k = c.grid[0], c["C"], c["T"], c["top_k"]
    c.array("ids", (m, k * t))[:] = select(c.array("cl", (m, clusters)),
                                           c.array("ordering", (clusters * t,)), k)


def _score_call(c: Call) -> None:
    m, n, d = c.grid[1], c["N"], c["D"]
    ids = c.array("ids", (m, n))
    table = c.array("table", (int(ids.max()) + 1, d))
    c.array("sel", (m, n))[:] = score(c.array("h", (m, d)), table, ids)


def _fill_call(c: Call) -> None:
    m, n, v = c.grid[0], c["N"], c["V"]
    c.array("logits", (m, v))[:] = fill(c.array("sel", (m, n)), c.array("ids", (m, n)), v)


ENTRIES = (
    *(Entry(name, SOURCE, (ptr("a", "float32"), ptr("b", "float32"), ptr("out", dtype, "out"),
                           i32("M"), i32("Ha"), i32("Hb")),
            lambda c, f32=dtype == "float32": _concat_call(c, f32))
      for name, dtype in ((CONCAT_ENTRY, "bfloat16"), (CONCAT_F32_ENTRY, "float32"))),
    Entry(SELECT_ENTRY, SOURCE, (ptr("cl", "float32"), ptr("ordering", "int32"),
                                 ptr("ids", "int32", "out"), i32("C"), i32("T"), i32("top_k")),
          _select_call),
    *(Entry(name, SOURCE, (ptr("h", dtype), ptr("table", dtype), ptr("ids", "int32"),
                           ptr("sel", "float32", "out"), i32("N"), i32("D")), _score_call)
      for name, dtype in ((SCORE_ENTRY, "bfloat16"), (SCORE_F32_ENTRY, "float32"))),
    Entry(FILL_ENTRY, SOURCE, (ptr("sel", "float32"), ptr("ids", "int32"),
                               ptr("logits", "float32", "out"), i32("N"), i32("V")), _fill_call),
)


def concat_geometry(m: int, width: int) -> Launch:
    """A thread per output element: (ceil(width / THREADS), M) CTAs."""
    return Launch((-(-width // THREADS), m, 1), (THREADS, 1, 1), 0)


def select_geometry(m: int, clusters: int) -> Launch:
    """A CTA per row, the row's C logits and C taken-flags in dynamic shared memory."""
    return Launch((m, 1, 1), (THREADS, 1, 1), clusters * 5)


def score_geometry(m: int, n: int) -> Launch:
    return Launch((-(-n // SCORE_WARPS), m, 1), (SCORE_WARPS * 32, 1, 1), 0)


def fill_geometry(m: int) -> Launch:
    return Launch((m, 1, 1), (FILL_THREADS, 1, 1), 0)
