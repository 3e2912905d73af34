"""Lower a fused ModelIR to the H100 kernel schedule (artifacts.kernel_schedule): the launches of
every entry point (launches.py: one table from IR op to launches) placed in one arena
(layout.py).

Input: the IR after an h100 pipeline (target.py): quantized (cast_bf16 + quantize_fp8:
h100-fp8) or all float32 (h100-f32), then the fusion passes, which leave only ops the kernels run
as units. Entry points: `decode_{B}` for B = 1, 2, 4, ... max_seqs and `prefill_{T}` per bucket
(both CUDA graphs at load), `logits_{max_chunk}` (launched kernel by kernel); with `draft_tokens`
K > 0 (speculative decoding) `verify_{R}` for R = 2, 4, ... times max_seqs below
max_seqs * (K + 1), and that (CUDA graphs too); on one GPU also `sampled_decode_{B}` and
`sampled_prefill_{T}`: the same launches with the sampler's extras around the sampling
(penalties, a token mask, log-probabilities: sample.py), so the plain entries keep their launch
lists (the fast path) and a request with extras runs through these. Every `decode_{B}` and
`sampled_decode_{B}` ends with decode_advance (rows.py), the device side of the runtime's decode
loop (a sampled one's, in its sampler part: the masked decode loop, scheduled.py). With an
assistant in the IR (one GPU, K > 0): `draft_{B}` beside every decode_{B} (draft.py), and the
decode and verify entries also output every row's state and apply the speculative ratio rule to
the lanes that ask for it (ratio.py; schedule version 10).

With prefill packing, `mixed_{P}_{B}` for every packed prefill_{P} and every decode_{B} past
the FP8 GEMV's rows (mixed_shapes): P prefill rows and B decode lanes in one call, each part's
attention and sampling launched as its own entry launches them (launches.py, kind "mixed").

Verify needs no kernels of its own: a decode entry already runs each row at its own position
with its own block-table row, seq_len and sampling step, and every launch covers all rows
before the next starts, so rows p..p+k of one sequence work as k + 1 lanes of it: qkv_post
writes every row's K and V before the attention launch reads the cache, where row i sees keys
[0, p + i] (its window's part of them; attn_decode.visible_tokens). A verify call as wide as a
decode entry runs that entry; `verify_{R}` are the same launches over more rows than the widest.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rvcompile.artifacts.kernel_schedule import (
    RATIO_SCHEDULE_VERSION,
    TP_SCHEDULE_VERSION,
    KernelSchedule,
    Launch,
    PrefillPacking,
)
from rvcompile.ir.graph import ModelIR
from rvcompile.ir.ops import Op
from rvcompile.targets.h100 import layout, sample
from rvcompile.targets.h100.draft import DraftLowering, draft_io_fields, ratio_fields
from rvcompile.targets.h100.launches import (
    DECODE_GEMV_MAX_ROWS,
    PROMPT_GEMV_MAX_ROWS,
    EntryLowering,
    float32_activations,
)
from rvcompile.targets.h100.layout import LoweringError, WeightSlot, layout_weights
from rvcompile.targets.h100.tensor_parallel import RankPlan, Shard, shard_ir

PREFILL_SEQS = 8  # sequences one prefill call packs at most (packing_rows)

__all__ = ["H100Lowering", "LoweringError", "RankLowering", "decode_buckets", "layout_weights",
           "lower_to_h100", "lower_to_h100_tp", "verify_buckets"]


@dataclass(frozen=True)
class H100Lowering:
    schedule: KernelSchedule
    constants: bytes
    slots_by_param: dict[str, list[WeightSlot]]
    modules: tuple[str, ...]  # kernel sources the schedule launches


def decode_buckets(max_seqs: int) -> tuple[int, ...]:
    """Decode graphs for 1, 2, 4, ... sequences, and max_seqs."""
    out, b = [], 1
    while b < max_seqs:
        out.append(b)
        b *= 2
    return (*out, max_seqs)


def packing_rows(ir: ModelIR, max_seqs: int, prefill_buckets: tuple[int, ...],
                 tp: RankPlan | None) -> tuple[int, int] | None:
    """(sequences, min_rows) of the schedule's PrefillPacking, or None where packing would
    change a row's bits. From min_rows (the smallest prefill entry past the FP8 GEMV's rows) on,
    every launch of a prefill entry computes a row from that row alone, the same way at any
    row count: per-token e4m3 quantization and the tensor-core GEMM (a row's products summed in
    the same k order by every tile shape), per-row norms and elementwise kernels, and the
    prefill attention over a sequence's own rows (aligned to its tiles). Not so: the float32
    plan (its GEMV's split depends on the rows), a MoE layer (rows are grouped by expert across
    sequences), a tensor-parallel rank (no sampler), one sequence at a time."""
    if tp is not None or max_seqs < 2 or float32_activations(ir) or any(
            n.op in (Op.MOE, Op.MOE_BLOCK) for g in ir.layers for n in g.nodes):
        return None
    rows = sorted(t for t in set(prefill_buckets) if t > PROMPT_GEMV_MAX_ROWS)
    return (min(PREFILL_SEQS, max_seqs), rows[0]) if rows else None


def mixed_shapes(packing: tuple[int, int] | None, prefill_buckets: tuple[int, ...],
                 max_seqs: int) -> tuple[tuple[int, int], ...]:
    """(P, B) of the mixed entries: every packed prefill entry's P rows with every decode
    width B past the FP8 GEMV's rows (launches.DECODE_GEMV_MAX_ROWS). There, each of the entry's
    launches computes a row as the prefill_{P} or decode_{B} entry does (the tensor-core GEMM's
    rows are independent of the row count; attention and sampling run as two launches, one per
    part), so a step's prompt chunks ride along its decode lanes' read of the weights without
    changing a bit of either; narrower decode entries run the GEMVs, whose bits differ from the
    GEMM's."""
    if packing is None:
        return ()
    return tuple((p, b) for p in sorted(set(prefill_buckets)) if p >= packing[1]
                 for b in decode_buckets(max_seqs) if b > DECODE_GEMV_MAX_ROWS)


def verify_buckets(max_seqs: int, draft_tokens: int) -> tuple[int, ...]:
    """Rows of the verify entries beyond the decode entries: max_seqs times 2, 4, ... below
    K + 1, and max_seqs * (K + 1); () without drafts."""
    if not draft_tokens:
        return ()
    out, r = [], 2 * max_seqs
    while r < max_seqs * (draft_tokens + 1):
        out.append(r)
        r *= 2
    return (*out, max_seqs * (draft_tokens + 1))


def lower_to_h100(ir: ModelIR, *, max_seqs: int, prefill_buckets: tuple[int, ...],
                  tp: RankPlan | None = None, draft_tokens: int = 0) -> H100Lowering:
    """The schedule of `ir`; with `tp`, of one tensor-parallel rank (ir: the rank's IR,
    tensor_parallel.shard_ir), its collectives in place; `draft_tokens` K > 0 adds the verify
    entries (module docstring)."""
    if not 0 <= draft_tokens < ir.max_chunk:
        raise LoweringError(f"{draft_tokens} draft tokens: a token and its drafts must fit a "
                            f"prefill chunk of {ir.max_chunk}")
    weights, weights_bytes = layout_weights(ir)
    consts = layout.Constants()
    kv = layout.kv_pools(ir)
    entries = [("decode", f"decode_{b}", b) for b in decode_buckets(max_seqs)]
    entries += [("prefill", f"prefill_{t}", t) for t in sorted(set(prefill_buckets))]
    entries += [("logits", f"logits_{ir.max_chunk}", ir.max_chunk)]
    # launched as decode entries (EntryLowering kind "decode": a graph, every row sampled)
    verify = verify_buckets(max_seqs, draft_tokens)
    entries += [("decode", f"verify_{r}", r) for r in verify]
    drafter = ir.assistant is not None
    if drafter and (tp is not None or not draft_tokens):
        raise LoweringError("an assistant drafter needs --num-draft-tokens K >= 1 and one GPU "
                            "(--tp 1)")
    packing = packing_rows(ir, max_seqs, prefill_buckets, tp)
    seqs = packing[0] if packing else 1
    # a drafter's decode entries return states and apply the ratio rule: none mixed with them
    mixed = () if drafter else mixed_shapes(packing, prefill_buckets, max_seqs)
    # with a drafter, decode and verify entries also output every row's state and apply the
    # ratio rule to their lanes that ask (a lane takes two rows or more)
    lowerings = [(name, EntryLowering(ir, kind, rows, consts, kv.pools, tp,
                                      decode_loop_steps=layout.DECODE_LOOP_STEPS
                                      if name.startswith("decode_") else 0,
                                      states=drafter and kind == "decode",
                                      ratio_lanes=min(max_seqs, rows // 2)
                                      if drafter and kind == "decode" else 0,
                                      prefill_seqs=seqs if kind == "prefill" else 1))
                 for kind, name, rows in entries]
    lowerings += [(f"mixed_{p}_{b}", EntryLowering(ir, "mixed", p + b, consts, kv.pools,
                                                   prefill_seqs=seqs, prefill_rows=p))
                  for p, b in mixed]
    plans = [lowering.run(name) for name, lowering in lowerings]
    extra_io = ratio_io = None
    if drafter:
        plans += [DraftLowering(ir, b, consts, kv.pools, steps=draft_tokens,
                                max_seqs=max_seqs).run(f"draft_{b}")
                  for b in decode_buckets(max_seqs)]
        extra_io = draft_io_fields(ir, max_seqs, draft_tokens)
        ratio_io = ratio_fields(ir, max_seqs, draft_tokens)
    # a tensor-parallel rank's schedule (TP_SCHEDULE_VERSION) has no sampled entries
    top = 0 if tp is not None else sample.TOP_LOGPROBS
    if top:
        plans += [EntryLowering(ir, kind, rows, consts, kv.pools, sampled=True,
                                decode_loop_steps=layout.DECODE_LOOP_STEPS
                                if name.startswith("decode_") else 0,
                                prefill_seqs=seqs if kind == "prefill" else 1).run(
            f"sampled_{name}") for kind, name, rows in entries
            if name.startswith(("decode_", "prefill_"))]
    max_rows = max(max(prefill_buckets), ir.max_chunk, max_seqs, *verify,
                   *(p + b for p, b in mixed))
    # io last_row: a prefill call's S sequences, and a mixed call's lanes after them
    last_rows = seqs + max((b for _, b in mixed), default=0)
    schedule = layout.place(ir, plans, weights, weights_bytes, consts, kv, max_seqs, max_rows,
                            top, extra_io, ratio_io, last_rows)
    if packing:
        align = max(lowering.prefill_align for _, lowering in lowerings)
        schedule = replace(schedule, prefill_packing=PrefillPacking(seqs, align, packing[1]))
    if draft_tokens:
        schedule = replace(schedule, draft_tokens=draft_tokens)
    if drafter:  # draft entries, the draft io fields, verify's states and ratio rule
        schedule = replace(schedule, version=RATIO_SCHEDULE_VERSION)
    if tp is not None:  # a rank's schedule has collective steps
        schedule = replace(schedule, version=TP_SCHEDULE_VERSION)
    modules = tuple(sorted({x.module for e in schedule.entries.values() for x in e.launches
                            if isinstance(x, Launch)}))
    return H100Lowering(schedule, consts.data(), {k: [v] for k, v in weights.items()}, modules)


@dataclass(frozen=True)
class RankLowering:
    lowering: H100Lowering  # slots_by_param: where the rank's part of each weight goes
    shards: dict[str, Shard]  # which part of the full weight a split weight's slot holds


def lower_to_h100_tp(ir: ModelIR, ranks: int, *, max_seqs: int,
                     prefill_buckets: tuple[int, ...],
                     draft_tokens: int = 0) -> tuple[RankLowering, ...]:
    """One schedule per rank of `ranks` (tensor_parallel.py: the split and its collectives)."""
    out = []
    for rank in range(ranks):
        r = shard_ir(ir, ranks, rank)
        out.append(RankLowering(lower_to_h100(r.ir, max_seqs=max_seqs,
                                              prefill_buckets=prefill_buckets, tp=r.plan,
                                              draft_tokens=draft_tokens),
                                r.shards))
    return tuple(out)
