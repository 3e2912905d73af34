"""Row utilities (kernels/rows.cu): numpy references and launch geometry.

`select_rows_bf16(src bf16 [M, H], rows int32 [S], dst bf16 [S, H], S, H)`: dst[i] = src[rows[i]],
zeros where rows[i] < 0 (a prefill's last real row of each sequence it packs; unused slots -1).
`select_rows_f32(src f32 [M, H], rows, dst f32 [S, H], S, H)`: the same over float32 rows.
`softcap_rows(x f32 [n], n, cap)`: x = cap * tanh(x / cap) in place (the IR's SOFTCAP).
`decode_advance(sampled, tokens, positions, seq_len, step, budget, loop_step, history, B, L)`:
the last launch of a decode entry, which moves its B lanes on to their next step in the io
fields, so the entry's graph can replay again with no host between (the decode loop,
runtime/executors/scheduled.py). With it = loop_step[0], for each lane i: it is live when
positions[i] >= 0 and budget[i] > 0; history [L, B] row `it` (when it < L) gets its sampled
token, or -1 when not live; a live lane spends one of its budget and, with some left, takes its
token as its next input at the next position (seq_len and the RNG step one on), else becomes a
padding row (position -1, seq_len 1). Then loop_step[0] = it + 1. A plain decode call (budget 0
everywhere) changes only io fields the host writes again before the next call.
"""

from __future__ import annotations

import numpy as np

from rvcompile.artifacts.kernel_schedule import ADVANCE_KERNEL
from rvcompile.ir import ops
from rvcompile.targets.h100.contract import Call, Entry, f32, i32, i64, ptr
from rvcompile.targets.h100.gemv_fp8 import Launch

SOURCE = "rows.cu"
SELECT_ENTRY = "select_rows_bf16"
SELECT_F32_ENTRY = "select_rows_f32"
SOFTCAP_ENTRY = "softcap_rows"
ADVANCE_ENTRY = ADVANCE_KERNEL
THREADS = 256
ADVANCE_MAX_LANES = 1024  # one CTA's threads


def softcap(x: np.ndarray, cap: float) -> np.ndarray:
    return ops.OPS[ops.Op.SOFTCAP].reference(ops.SoftcapAttrs(cap), np.asarray(x, np.float32))


def _select_call(c: Call) -> None:
    s, h = c["S"], c["H"]
    rows = c.array("rows", (s,)).astype(np.int64)
    src = c.array("src", (max(int(rows.max()), 0) + 1, h))
    c.array("dst", (s, h))[:] = np.where((rows >= 0)[:, None], src[np.maximum(rows, 0)], 0)


def _softcap_call(c: Call) -> None:
    x = c.array("x", (c["n"],))
    x[:] = softcap(x, c["cap"])


def advance(sampled, tokens, positions, seq_len, step, budget, loop_step,
            history) -> None:
    """decode_advance in place over int32 arrays ([B] each, loop_step [1], history [L, B])."""
    it = int(loop_step[0])
    live = (positions >= 0) & (budget > 0)
    if it < history.shape[0]:
        history[it] = np.where(live, sampled, -1)
    budget[live] -= 1
    going = live & (budget > 0)
    ending = live & ~going
    tokens[going] = sampled[going]
    positions[going] += 1
    seq_len[going] += 1
    step[going] += 1
    positions[ending], seq_len[ending] = -1, 1
    loop_step[0] = it + 1


def _advance_call(c: Call) -> None:
    b, steps = c["B"], c["L"]
    advance(*(c.array(n, (b,)) for n in ("sampled", "tokens", "positions", "seq_len", "step",
                                         "budget")),
            c.array("loop_step", (1,)), c.array("history", (steps, b)))


ENTRIES = (
    *(Entry(name, SOURCE, (ptr("src", dtype), ptr("rows", "int32"), ptr("dst", dtype, "out"),
                           i32("S"), i32("H")), _select_call)
      for name, dtype in ((SELECT_ENTRY, "bfloat16"), (SELECT_F32_ENTRY, "float32"))),
    Entry(SOFTCAP_ENTRY, SOURCE, (ptr("x", "float32", "inout"), i64("n"), f32("cap")),
          _softcap_call),
    Entry(ADVANCE_ENTRY, SOURCE, (
        ptr("sampled", "int32"), *(ptr(n, "int32", "inout") for n in (
            "tokens", "positions", "seq_len", "step", "budget", "loop_step")),
        ptr("history", "int32", "out"), i32("B"), i32("L")), _advance_call),
)


def select_geometry(s: int, h: int) -> Launch:
    """One CTA row per THREADS columns of a selected row, a grid row per selected row."""
    if s < 1:
        raise ValueError(f"select_rows needs at least one row (S={s})")
    return Launch((-(-h // THREADS), s, 1), (THREADS, 1, 1), 0)


def softcap_geometry(n: int) -> Launch:
    return Launch((-(-n // THREADS), 1, 1), (THREADS, 1, 1), 0)


def advance_geometry(b: int) -> Launch:
    """One CTA: loop_step is read by every lane before one thread moves it on."""
    if not 0 < b <= ADVANCE_MAX_LANES:
        raise ValueError(f"decode_advance takes 1..{ADVANCE_MAX_LANES} lanes, not {b}")
    return Launch((1, 1, 1), (ADVANCE_MAX_LANES, 1, 1), 0)
