"""The kernel launches of one H100 entry point: a table from each IR op to the launches that
compute it (LOWER), applied to every node of embed, each layer, head and sampler in order.

Input: the IR after the h100 pipelines' fusions (target.py), where each op is a unit the
kernels run: ATTENTION_BLOCK, MOE_BLOCK, PLE_EMBED, PLE_PROJECTION, RESIDUAL_RMSNORM with its
NEXT_NORM, the fused GEMVs. An op's function reads its inputs' values (the buffers holding them),
emits launches over symbolic pointers (layout.Ref), each argument named after the kernel's
parameter and checked against its entry (contract.py), and returns its own value. Two ops write what
their readers read, in their own launch:
- RESIDUAL_RMSNORM also writes its NEXT_NORM reader's value (`residual_rmsnorm`); with none,
  in a bf16 plan where a LINEAR reads it, the bf16 copy of h the GEMV reads
  (`residual_rmsnorm_copy`); else a normed copy through ones into scratch;
- KV_STORE emits nothing: the ATTENTION_BLOCK reading it writes the cache (qkv_post).
Whatever has no kernel stops the build with a LoweringError naming the op and graph.

Kernels follow the IR's dtypes: with every matrix float32 (h100-f32) activations, the values
linears read and the KV pools stay float32 (the `_f32` entries: each linear a float32 GEMV per
4 rows; prefill attention through the decode kernel, a row per query); else linears read bf16
copies and FP8 weights (EntryLowering.gemv: the tensor-core GEMV up to gemv_max_rows, 8 rows of
a decode-kind entry and 32 of a prompt chunk, per-token e4m3 activations and the tensor-core
GEMM beyond; the bf16 GEMV for the tied head), and prefill
attention is the flash-style attn_prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from rvcompile.dtypes import numpy_dtype
from rvcompile.ir.graph import Graph, ModelIR, Node, readers, resolve_param
from rvcompile.ir.ops import Op
from rvcompile.model.config import LayerSpec
from rvcompile.targets.h100 import (
    attn_decode,
    attn_prefill,
    gelu_mul,
    gemm_fp8w,
    gemm_tc,
    gemv_bf16,
    gemv_f32,
    gemv_fp8,
    gemv_mma_fp8,
    head,
    moe,
    norms,
    ple,
    qkv_post,
    ratio,
    registry,
    rows,
    sample,
)
from rvcompile.targets.h100.contract import ContractError, ParamsValue
from rvcompile.targets.h100.layout import (
    Constants,
    EntryPlan,
    LoweringError,
    PlannedCollective,
    PlannedLaunch,
    Pool,
    Ref,
)
from rvcompile.targets.h100.tensor_parallel import RankPlan

# the sampled entries' inputs the kernels read (layout.py's sample_io region)
SAMPLE_IO_ARGS = ("presence", "frequency", "repetition", "n_top", "mask_at", "pen_at", "pen_n",
                  "pool")
SM_COUNT = 132  # H100 SXM; split counts and persistent grids are sized for it
# The tied head from this many rows on the bf16 tensor-core GEMM (one read of the table) rather
# than the bf16 GEMV (one read per 4 rows). 31B head, H100 (benchmarks/h100_head.py, 2026-11-24):
# the GEMV 0.92 / 0.93 / 0.93 / 1.25 ms at 1 / 2 / 3 / 4 rows, the GEMM 0.99-1.00 ms at any of
# them (10.2 against 1.0 ms at 32 rows).
BF16_GEMM_ROWS = 4
# ... and only as wide as the tiny models' vocabularies (1024 and up): an output narrower than
# 4 tiles of 256 columns gains nothing from the tensor cores
BF16_GEMM_MIN_N = 1024
# FP8 linears of up to DECODE_GEMV_MAX_ROWS rows (decode, verify, draft entries) or
# PROMPT_GEMV_MAX_ROWS rows (prefill and logits entries) stream W on a GEMV, more rows run the
# tensor-core GEMM (fp8_gemm: x quantized per row to e4m3). The GEMM's 64-row tile streams W once as
# well, and in a step's graph it is ahead from 9 rows: on an H200 (31B, 2026-11-29,
# docs/BENCHMARKS.md) decode_32 on the GEMM took 13.87 ms a step and decode_16 on the f16-row GEMV
# 14.30; the assistant's verify steps at 8 lanes took 14.93 ms at 16 rows (GEMV) and 14.67 at 24
# (the GEMM of decode_32), 20.5 / 20.7 ms at 24 / 32 rows on the GEMV's bf16 rows before.
# (Standalone, one step's linears, benchmarks/h100_gemv_mma.py and h100_gemm_tc.py: at 16 rows the
# f16-row GEMV 10.52 ms, the GEMM's default tiles 11.41; at 32 rows 15.46 against 10.56; in the
# step's graph the GEMM fares better.) A prompt's chunk of 9 to 32 rows keeps the GEMV: it runs once
# a prompt, and e4m3 rows there cost the tiny oracle models top-1 agreement
# (tests/test_h100_schedule.py's dense case, buckets 8 / 32: 0.66 against the bf16 rows' >= 0.70).
# Of the GEMV rows, those a launch with a _q twin wrote (the norms before q/k/v and the MLP,
# gelu_mul before down: EntryLowering.row_quant) run gemv_mma_fp8's f16-row entries from 2 rows: x
# as it is, times a power of two per row from the twin's q_scale, in f16, so that each weight pair
# takes one conversion where bf16 takes five (the bf16 rows' product, term for term); so do the
# attention output's rows before o, with a bound on them in place of the q_scale
# (ATTENTION_OUT_BOUND); the other rows (the per-layer inputs) its bf16-row entries; one row
# gemv_fp8. The same step's linears, ms at 1 / 2 / 4 / 8 / 16 rows: f16 rows 8.50 / 8.82 / 9.22 /
# 9.10 / 10.49, bf16 rows 9.44 / 9.55 / 9.96 / 9.77 / 11.16, gemv_fp8 8.74 (one row). In the
# decode_1 graph gemv_fp8 stays ahead of the MMA GEMV (H100, 2026-11-24: 12.80 ms against 13.65;
# H200, 2026-11-29, with the weights fed unconverted to an e4m3 mma: 9.66 against 10.65).
DECODE_GEMV_MAX_ROWS = 8
PROMPT_GEMV_MAX_ROWS = gemv_mma_fp8.MAX_ROWS
# Every value of an attention output row is at most this times sqrt(head dim): Gemma 4's V is
# RMSNorm_noscale of its projection (qkv_post writes every V and K=V base so), whose elements
# are at most sqrt(d) in magnitude, and a row is a convex combination of V rows; the margin
# covers rounding (the V pool's bf16 or e4m3-with-amax-scale, the softmax's sum, the output's
# bf16: under 0.6% together). The f16-row GEMV takes bound / 448 as each row's q_scale: its
# power of two then keeps every row below f16's largest binade, and values down to 2^-24
# exact (of rows whose largest values are far below the bound, the tiniest values lose low bits
# as f16 subnormals: at most 2^-35 each, against the bf16 rounding of the row itself).
ATTENTION_OUT_BOUND = 1.01
GEMV_READERS = (Op.LINEAR, Op.MULTI_LINEAR)  # ops that read their input as the GEMV's copy


def gemv_max_rows(kind: str) -> int:
    """The most rows an entry of `kind` runs an FP8 linear on a GEMV (above)."""
    return PROMPT_GEMV_MAX_ROWS if kind in ("prefill", "logits") else DECODE_GEMV_MAX_ROWS


def float32_activations(ir: ModelIR) -> bool:
    """Whether the plan keeps activations float32: every matrix of the IR (linears, tables) is
    float32, as in a build without cast_bf16 and quantize_fp8. Else linears read bf16 copies."""
    return all(p.dtype == "float32" for p in ir.params if len(p.shape) >= 2)


@dataclass
class _Val:
    """An activation [rows, cols]: its float32 value and/or the copy linears read (`lin`: bf16 in
    a quantized plan; in a float32 plan float32, usually the same buffer)."""

    cols: int
    f32: Ref | None = None
    lin: Ref | None = None


def planned_launch(kernel: str, geometry: gemv_fp8.Launch, args: dict) -> PlannedLaunch:
    """A launch of `kernel` with its arguments by parameter name, checked against the entry's
    declaration (contract.py): pointers are Refs (None: null), scalars numbers."""
    entry = registry.entry(kernel)
    try:
        bound = entry.bind(args, Ref)
    except ContractError as e:
        raise LoweringError(str(e)) from None
    return PlannedLaunch(entry.source, kernel, geometry, bound)


@dataclass(frozen=True)
class _QuantTwin:
    """A launch writing bf16 rows that has a _q twin entry, which also writes their per-row FP8
    quantization: launches[index] becomes the twin (with q and q_scale added to its arguments)
    once an FP8 tensor-core GEMM reads those rows (EntryLowering.fp8_gemm)."""

    index: int
    kernel: str
    geometry: gemv_fp8.Launch
    args: dict


@dataclass(frozen=True)
class _Rows:
    """An attention's per-row buffers, addressed from a row on: q (`q_size` bytes an element),
    the block tables (`width` int32 a row), the float32 output and its bf16 copy (None in a
    float32 plan), `cols` = heads x head_dim elements a row."""

    q_buf: Ref
    table_buf: Ref
    width: int
    out_buf: Ref
    out_bf16_buf: Ref | None
    cols: int
    q_size: int

    def q(self, row: int) -> Ref:
        return self.q_buf.at(row * self.cols * self.q_size)

    def table(self, row: int) -> Ref:
        return self.table_buf.at(row * self.width * 4)

    def out(self, row: int) -> Ref:
        return self.out_buf.at(row * self.cols * 4)

    def out_bf16(self, row: int) -> Ref | None:
        return None if self.out_bf16_buf is None else self.out_bf16_buf.at(row * self.cols * 2)


@dataclass(frozen=True)
class _At:
    """The node being lowered, in its graph and layer, with the values of the nodes before it."""

    g: Graph
    idx: int
    spec: LayerSpec | None  # the layer, inside a layer template
    env: dict[int, object]
    users: list[int]  # the nodes reading this one
    resolve: Callable[[str], str] | None = None  # a PARAM's full name, when not by `spec`

    @property
    def node(self) -> Node:
        return self.g.nodes[self.idx]

    def input(self, k: int):
        return self.env[self.node.inputs[k]]

    def input_node(self, k: int) -> Node:
        return self.g.nodes[self.node.inputs[k]]

    def weight(self, k: int, of: int | None = None) -> str:
        """The full name of the weight that is input k (of node `of`, by default this one)."""
        n = self.g.nodes[self.g.nodes[self.idx if of is None else of].inputs[k]]
        if n.op != Op.PARAM:
            raise LoweringError("expected a weight")
        if self.resolve is not None:
            return self.resolve(n.attrs.name)
        return resolve_param(n.attrs.name, self.spec) if self.spec else n.attrs.name

    def is_arg(self, k: int, name: str) -> bool:
        n = self.input_node(k)
        return n.op == Op.ARG and n.attrs.name == name


class EntryLowering:
    """Lowers embed, every layer, head and sampler for one entry point of `rows` token rows."""

    # Keys an attention row sees end this many positions before its query (draft.py: a drafter's
    # query at p reads the target's keys up to p - 1); the target's own rows see their own key.
    key_lag = 0

    def __init__(self, ir: ModelIR, kind: str, rows: int, consts: Constants,
                 pools: dict[int, Pool], tp: RankPlan | None = None, *,
                 sampled: bool = False, decode_loop_steps: int = 0, states: bool = False,
                 ratio_lanes: int = 0, prefill_seqs: int = 1, prefill_rows: int = 0):
        """`sampled`: the sampler's extras around the sampling (sample.py); `prefill_seqs` S
        (prefill entries): the head and sampler run S rows, the io "last_row" [S] of each
        sequence the call packs (-1: none), sampled by the io sampling fields' rows 0..S-1;
        `decode_loop_steps`
        L > 0 (decode entries): end with decode_advance, which logs up to L steps' tokens in io
        "loop_tokens" as [L, rows] (rows.py); `states` (decode and verify entries of a schedule
        with an assistant drafter): also output "states", every row's final-normed hidden state
        (float32 [rows, H], the drafter's first state: DraftIR.hidden); `ratio_lanes` > 0 (the
        same entries, schedule version 10): the pick also writes its records and spec_ratio
        applies the ratio rule to the first that many lanes of io "ratio_lanes" (ratio.py);
        `prefill_rows` P (kind "mixed", with prefill_seqs S): rows 0..P-1 run as a prefill entry
        of P rows (packed chunks, its attention and its S sampled rows), rows P..rows-1 as the
        lanes of a decode entry of rows - P rows (theirs, each sampled); io "last_row" [S + B]
        names the head's rows, the S sequences' last rows then P, P + 1, ... (the lanes)."""
        self.ir, self.kind, self.m = ir, kind, rows
        self.prefill_seqs = prefill_seqs
        self.prefill_rows = prefill_rows
        if (kind == "mixed") != (0 < prefill_rows < rows):
            raise LoweringError(f"a {kind} entry of {rows} rows with {prefill_rows} prefill rows")
        # rows of a prefill attention tile (its rows share a block-table row): where a packed
        # sequence's rows must start (kernel_schedule.PrefillPacking.align)
        self.prefill_align = 1
        self.sampled = sampled
        self.states = states
        self.ratio_lanes = ratio_lanes
        self.tokens_out: Ref | None = None  # where the sampler writes, when not its own buffer
        self.decode_loop_steps = decode_loop_steps
        self.tp = tp  # a tensor-parallel rank's plan (ir: the rank's IR); None: one GPU
        self.consts, self.pools = consts, pools
        self.cfg = ir.config
        self.specs = ir.param_map()
        self.f32 = float32_activations(ir)
        self.lin_size = 4 if self.f32 else 2  # bytes per element of the copies linears read
        self.ple: Ref | None = None  # [rows, L, P] f32, the embed graph's per-layer inputs
        self.launches: list[PlannedLaunch] = []
        self.sizes: dict[int, int] = {}
        self.softcap: float | None = None
        self.h = self.buffer(rows * self.cfg.hidden_size * 4)  # the residual stream, f32
        self.next_norms: dict[int, _Val] = {}  # NEXT_NORM node -> what its residual wrote
        # a bf16 row buffer -> the _q twin of the launch writing it, or, once an FP8 GEMM asked
        # for it, the (q, scale) of the rows' per-row FP8 quantization that twin writes
        self.row_quant: dict[Ref, _QuantTwin | tuple[Ref, Ref]] = {}
        # a bf16 row buffer -> a bound on every value in it (an attention output's)
        self.row_bound: dict[Ref, float] = {}
        self.outputs: dict[str, tuple[Ref, str, tuple[int, ...]]] = {}

    def buffer(self, nbytes: int) -> Ref:
        key = len(self.sizes)
        self.sizes[key] = nbytes
        return Ref("act", key)

    def emit(self, kernel: str, geometry, **args) -> None:
        """planned_launch's launch, appended."""
        self.launches.append(planned_launch(kernel, geometry, args))

    def emit_quantizable(self, kernel: str, twin: str | None, geometry, twin_geometry,
                         rows: Ref, **args) -> None:
        """emit(), for a launch writing the bf16 rows `rows` whose `twin` entry also writes their
        per-row FP8 quantization (None: no twin): fp8_gemm turns it into the twin if an FP8
        tensor-core GEMM reads them, and so needs no quant_fp8_rows launch."""
        if twin is not None and not self.f32:
            self.row_quant[rows] = _QuantTwin(len(self.launches), twin, twin_geometry, args)
        self.emit(kernel, geometry, **args)

    def residual_stream(self) -> _Val:
        return _Val(self.cfg.hidden_size, f32=self.h, lin=self.h if self.f32 else None)

    # -- the walk

    def run(self, name: str) -> EntryPlan:
        out = self.walk(self.ir.embed, None, {})
        self.ple = out.get("ple")
        for li, spec in enumerate(self.cfg.layers):
            out = self.walk(self.ir.layers[self.ir.layer_template[li]], spec, _handed(out))
        if self.states:
            self.final_states()
        logits = self.walk(self.ir.head, None, _handed(out))["logits"]
        self.walk(self.ir.sampler, None, {"logits": logits})
        # Decode and prefill replay as CUDA graphs (hundreds of launches each, every step or
        # prompt chunk); the logits entry (perplexity, rare) launches its kernels one by one.
        return EntryPlan(name, self.m, self.kind in ("decode", "prefill", "mixed"),
                         tuple(self.launches),
                         self.sizes, self.outputs)

    def final_states(self) -> None:
        """Output "states": the drafter's hidden graph (the target's final norm) over the
        residual stream after the last layer, float32 in every plan (DraftIR.hidden)."""
        g = self.ir.assistant.hidden
        norm = [n for n in g.nodes if n.op == Op.RMSNORM]
        if len(norm) != 1 or g.nodes[norm[0].inputs[1]].op != Op.PARAM:
            raise LoweringError(f"graph {g.name}: expected one RMSNORM of h by a weight")
        hdim = self.cfg.hidden_size
        # the sampled tokens right after the states: the host reads both at once
        y = self.buffer(self.m * hdim * 4 + self.m * 4)
        self.tokens_out = y.at(self.m * hdim * 4)
        self.emit(norms.RMSNORM_F32_ENTRY, norms.launch_geometry(self.m, hdim), x=self.h,
                  w=Ref("weights", g.nodes[norm[0].inputs[1]].attrs.name), y=y, H=hdim,
                  eps=norm[0].attrs.eps)
        self.outputs["states"] = (y, "float32", (self.m, hdim))

    def walk(self, g: Graph, spec: LayerSpec | None, inputs: dict,
             resolve: Callable[[str], str] | None = None) -> dict:
        """Lower g, its ARGs named in `inputs` bound to those values; its outputs' values.
        `resolve`: the full name of a PARAM (default: by `spec`, or the name itself)."""
        env: dict[int, object] = {}
        users = readers(g)
        for idx, n in enumerate(g.nodes):
            if n.op == Op.ARG and n.attrs.name in inputs:
                env[idx] = inputs[n.attrs.name]
                continue
            try:
                env[idx] = LOWER.get(n.op, EntryLowering.no_kernel)(
                    self, _At(g, idx, spec, env, users[idx], resolve))
            except LoweringError as e:
                raise LoweringError(f"graph {g.name}, node %{idx} ({n.op.value}): {e}") from None
        return {name: env.get(i) for name, i in g.outputs}

    def no_kernel(self, at: _At):
        raise LoweringError(f"no H100 kernel implements {at.node.op.value!r} (the h100 "
                            "pipelines' fusion passes make the ops the kernels run)")

    def arg(self, at: _At):
        return self.residual_stream() if at.node.attrs.name == "h" else ("arg", at.node.attrs.name)

    def param(self, at: _At):
        n = at.node
        return ("param", resolve_param(n.attrs.name, at.spec) if at.spec else n.attrs.name)

    def reshape(self, at: _At):
        src, n = at.input(0), at.node
        if not isinstance(src, _Val):
            raise LoweringError("reshape of a non-activation")
        return _Val(int(n.shape[-1]) if n.shape[-1] != "T" else src.cols, src.f32, src.lin)

    # -- embedding, norms, residual adds

    def embed(self, at: _At):
        table = at.weight(0)
        if not at.is_arg(1, "tokens"):
            raise LoweringError("embedding ids other than the step's tokens")
        self.embed_rows(table, Ref("io", "tokens"), at.node.attrs.multiplier, self.h,
                        self.cfg.hidden_size)
        return self.residual_stream()

    def embed_rows(self, table: str, ids: Ref, mult: float, out: Ref, hdim: int) -> None:
        """out f32 [rows, hdim] = table[ids] * mult, by the table's dtype."""
        dtype = self.specs[table].dtype
        if dtype == "bfloat16":
            self.emit(head.EMBED_BF16_ENTRY, head.embed_geometry(self.m, hdim, False),
                      table=Ref("weights", table), ids=ids, mult=mult, h=out, H=hdim)
        elif dtype == "float32":
            self.emit(head.EMBED_F32_ENTRY, head.embed_geometry(self.m, hdim, False, f32=True),
                      table=Ref("weights", table), ids=ids, mult=mult, h=out, H=hdim)
        elif dtype == "float8_e4m3fn":
            self.emit(head.EMBED_FP8_ENTRY, head.embed_geometry(self.m, hdim, True),
                      table=Ref("weights", table), row_scale=Ref("weights", f"{table}.scale"),
                      ids=ids, mult=mult, h=out, H=hdim)
        else:
            raise LoweringError(f"embedding table dtype {dtype}")

    def rmsnorm(self, at: _At):
        x, n = at.input(0), at.node
        if not isinstance(x, _Val) or x.f32 is None or len(n.shape) != 3:
            raise LoweringError("rmsnorm over something other than a float32 [B, T, H] value")
        if len(n.inputs) < 2:
            raise LoweringError("rmsnorm without a weight outside a fused block")
        w = Ref("weights", at.weight(1))
        y = self.buffer(self.m * x.cols * self.lin_size)
        geometry = norms.launch_geometry(self.m, x.cols)
        self.emit_quantizable(norms.RMSNORM_F32_ENTRY if self.f32 else norms.RMSNORM_ENTRY,
                              norms.RMSNORM_Q_ENTRY, geometry, geometry, y, x=x.f32, w=w, y=y,
                              H=x.cols, eps=n.attrs.eps)
        return _Val(x.cols, f32=y if self.f32 else None, lin=y)

    def next_norm(self, at: _At):
        if at.idx not in self.next_norms:
            raise LoweringError("next_norm of a residual that wrote no normed copy")
        return self.next_norms.pop(at.idx)

    def residual(self, at: _At):
        """h += rmsnorm(x) * w (times the layer scalar) in place; the same launch writes the
        NEXT_NORM reader's value, or the bf16 copy a LINEAR reader takes, or a normed copy into
        scratch (module docstring)."""
        h, x, n, g = at.input(0), at.input(1), at.node, at.g
        if not (isinstance(h, _Val) and h.f32 == self.h):
            raise LoweringError("residual add into something other than the residual stream")
        if not (isinstance(x, _Val) and x.f32 is not None):
            raise LoweringError("residual add of a value with no float32 copy")
        hdim, eps = self.cfg.hidden_size, n.attrs.eps
        w_post = Ref("weights", at.weight(2))
        scalar = (Ref("weights", at.weight(3)) if len(n.inputs) > 3
                  else self.consts.add(np.ones(1)))
        entry = norms.RESIDUAL_F32_ENTRY if self.f32 else norms.RESIDUAL_ENTRY
        geometry = norms.launch_geometry(self.m, hdim)
        out = self.residual_stream()
        nxt = [u for u in at.users if g.nodes[u].op == Op.NEXT_NORM]
        if nxt:
            norm = g.nodes[nxt[0]]
            if norm.attrs.eps != n.attrs.eps:
                raise LoweringError("next_norm with another eps than its residual's")
            w_next = Ref("weights", at.weight(1, of=nxt[0]))
            y = self.buffer(self.m * hdim * self.lin_size)
            self.next_norms[nxt[0]] = _Val(hdim, f32=y if self.f32 else None, lin=y)
            self.emit_quantizable(entry, norms.RESIDUAL_Q_ENTRY, geometry, geometry, y,
                                  h=self.h, x=x.f32, w_post=w_post, scalar=scalar,
                                  w_next=w_next, y=y, H=hdim, eps=eps)
        elif not self.f32 and any(g.nodes[u].op in GEMV_READERS for u in at.users):
            out.lin = self.buffer(self.m * hdim * 2)
            self.emit(ple.RESIDUAL_COPY_ENTRY, ple.residual_copy_geometry(self.m, hdim),
                      h=self.h, x=x.f32, w_post=w_post, scalar=scalar, y=out.lin, H=hdim, eps=eps)
        else:
            ones = self.consts.add(np.ones(hdim))
            self.emit(entry, geometry, h=self.h, x=x.f32, w_post=w_post, scalar=scalar,
                      w_next=ones, y=self.buffer(self.m * hdim * self.lin_size), H=hdim, eps=eps)
        return out

    # -- linears

    def gemv(self, x: Ref, w: Ref, scale: Ref | None, y: Ref, rows: int, n: int, k: int) -> None:
        """y[rows, n] (float32) = x[rows, k] @ W^T, by W's dtype and the row count:
        - float32 W (x float32 too): the float32 GEMV in groups of its MAX_ROWS;
        - bf16 W (the tied head, the MoE router; x bf16): the bf16 GEMV in groups of its MAX_ROWS
          (linear() sends the tied head over many rows to bf16_gemm instead);
        - FP8 W with per-row scales (x bf16): up to gemv_max_rows the tensor-core
          GEMV, which reads W once for all of them (fp8_gemv); more rows (prefill chunks, logits
          entries, wide decode) x quantized per row to e4m3 (row_codes), then the tensor-core GEMM
          (fp8_gemm)."""
        if self.specs[w.key].dtype == "float32":
            for r0 in range(0, rows, gemv_f32.MAX_ROWS):
                r = min(gemv_f32.MAX_ROWS, rows - r0)
                self.emit(gemv_f32.ENTRY, gemv_f32.launch_geometry(r, n, k, SM_COUNT), W=w,
                          x=x.at(r0 * k * 4), y=y.at(r0 * n * 4), M=r, N=n, K=k)
        elif scale is None:
            for r0 in range(0, rows, gemv_bf16.MAX_ROWS):
                r = min(gemv_bf16.MAX_ROWS, rows - r0)
                self.emit(gemv_bf16.ENTRY, gemv_bf16.launch_geometry(r, n, k, SM_COUNT), W=w,
                          x=x.at(r0 * k * 2), y=y.at(r0 * n * 4), M=r, N=n, K=k)
        elif rows <= gemv_max_rows(self.kind):
            self.fp8_gemv(x, w, scale, y, rows, n, k)
        else:
            self.fp8_gemm(x, w, scale, y, rows, n, k)

    def fp8_gemv(self, x: Ref, w: Ref, scale: Ref, y: Ref, rows: int, n: int, k: int) -> None:
        """W streamed once for every row (see the measurements above): one row on gemv_fp8
        where its staged x fits; rows a _q twin writes on the f16-row entries, with the twin's
        q_scale (row_codes; its codes go unread), and an attention output's with its bound
        (row_bound); others on the bf16-row entries."""
        if rows == 1 and k * 2 <= gemv_fp8.MAX_SMEM and k % 16 == 0:
            self.emit(gemv_fp8.ENTRY, gemv_fp8.launch_geometry(1, n, k, SM_COUNT), W=w,
                      scale=scale, x=x, y=y, M=1, N=n, K=k)
        elif rows == self.m and (x in self.row_quant or x in self.row_bound):
            if x in self.row_quant:
                _, q_scale = self.row_codes(x, rows, k)
            else:
                q_scale = self.consts.add(np.full(rows, self.row_bound[x] / gemm_tc.E4M3_MAX))
            g = gemv_mma_fp8.launch_geometry(rows, n, k, SM_COUNT, kind="f16")
            self.emit(g.entry, g, W=w, scale=scale, x=x, q_scale=q_scale, y=y, M=rows, N=n,
                      K=k)
        else:
            g = gemv_mma_fp8.launch_geometry(rows, n, k, SM_COUNT)
            self.emit(g.entry, g, W=w, scale=scale, x=x, y=y, M=rows, N=n, K=k)

    def fp8_gemm(self, x: Ref, w: Ref, scale: Ref, y: Ref, rows: int, n: int, k: int) -> None:
        """x's e4m3 rows (row_codes), then gemm_tc at its default tile with its parameter block
        (probed at build: gemm_tc.params_template). An output width the GEMM's TMA strides cannot
        take (N % 8) goes to the mma.sync FP8-weight GEMM on the bf16 rows instead."""
        if not gemm_tc.fits(rows, n, k):
            g = gemm_fp8w.launch_geometry(rows, n, k, SM_COUNT)
            self.emit(g.entry, g, W=w, scale=scale, x=x, y=y, M=rows, N=n, K=k)
            return
        q, q_scale = self.row_codes(x, rows, k)
        entry = gemm_tc.default_entry(rows, n, SM_COUNT)
        t = gemm_tc.params_template(entry, rows, n, k, SM_COUNT)
        roles = (("a", q), ("b", w), ("d", y), ("a_scale", q_scale), ("b_scale", scale))
        self.emit(entry, t, params=ParamsValue(f"{entry}_m{rows}_n{n}_k{k}", t, roles))

    def row_codes(self, x: Ref, rows: int, k: int) -> tuple[Ref, Ref]:
        """(q, q_scale): the per-row e4m3 codes and float32 scales of the bf16 rows x [rows, k],
        from the launch that wrote x, turned into its _q twin (emit_quantizable), or written
        earlier for another reader; else a quant_fp8_rows_bf16 launch (the attention output, MoE
        and PLE rows, a prefill head's selected rows)."""
        made = self.row_quant.get(x)
        if isinstance(made, _QuantTwin) and rows == self.m:
            q, q_scale = self.buffer(rows * k), self.buffer(rows * 4)
            self.launches[made.index] = planned_launch(made.kernel, made.geometry,
                                                       dict(made.args, q=q, q_scale=q_scale))
            self.row_quant[x] = (q, q_scale)
            return q, q_scale
        if isinstance(made, tuple) and rows == self.m:
            return made
        q, q_scale = self.buffer(rows * k), self.buffer(rows * 4)
        quant = gemm_tc.quant_launch(rows, k, "bfloat16")
        self.emit(quant.entry, quant, x=x, q=q, scale=q_scale, M=rows, K=k)
        return q, q_scale

    def bf16_gemm(self, x: Ref, w: Ref, y: Ref, rows: int, n: int, k: int) -> None:
        """gemm_bf16_tc at its default tile: x bf16 [rows, k] as the GEMV takes it, W bf16
        [n, k], both scale vectors all ones (one constant serves both)."""
        entry = gemm_tc.default_entry(rows, n, SM_COUNT, "bfloat16")
        t = gemm_tc.params_template(entry, rows, n, k, SM_COUNT)
        ones = self.consts.add(np.ones(max(rows, n)))
        roles = (("a", x), ("b", w), ("d", y), ("a_scale", ones), ("b_scale", ones))
        self.emit(entry, t, params=ParamsValue(f"{entry}_m{rows}_n{n}_k{k}", t, roles))

    def linear_weights(self, at: _At, first: int, count: int) -> tuple[list[str], list[str]]:
        """(values, scales) of the `count` weights from input `first` on."""
        names = [at.weight(i) for i in range(first, len(at.node.inputs))]
        values, scales = names[:count], names[count:]
        dtypes = {self.specs[v].dtype for v in values}
        if dtypes == {"float8_e4m3fn"} and len(scales) == count:
            return values, scales
        if dtypes == {"bfloat16"} and not scales and count == 1:
            return values, []
        if dtypes == {"float32"} and not scales:
            return values, []
        raise LoweringError(f"linear weights of dtype {sorted(dtypes)}: the H100 GEMVs take "
                            "FP8 with per-row scales (or the bf16 tied head), or float32")

    def gemv_copy(self, x) -> None:
        """Give the residual stream read by a LINEAR (the per-layer model projection of the
        embedding) its bf16 copy for the GEMV when no launch wrote one."""
        if isinstance(x, _Val) and x.f32 == self.h and x.lin is None:
            hdim = self.cfg.hidden_size
            x.lin = self.buffer(self.m * hdim * 2)
            self.emit(ple.TO_BF16_ENTRY, ple.to_bf16_geometry(self.m * hdim), x=self.h, y=x.lin,
                      n=self.m * hdim)

    def linear(self, at: _At):
        """LINEAR and MULTI_LINEAR; in the head of a prefill, of each sequence's last real row
        only."""
        x, n = at.input(0), at.node
        self.gemv_copy(x)
        if not (isinstance(x, _Val) and x.lin is not None):
            raise LoweringError("linear input has no copy for the GEMV (bf16 or float32)")
        count = n.attrs.count if n.op == Op.MULTI_LINEAR else 1
        values, scales = self.linear_weights(at, 1, count)
        rows_out = sum(self.specs[v].shape[0] for v in values)
        k = self.specs[values[0]].shape[1]
        x_ref, m = x.lin, self.m
        if at.g is self.ir.head and self.kind in ("prefill", "mixed"):
            x_ref, m = self.select_last_rows(x.lin, k), self.sample_rows
        w = Ref("weights", values[0])
        scale = Ref("weights", scales[0]) if scales else None
        if self.tp is not None and at.g is self.ir.head:
            return self.vocab_parallel(x_ref, w, scale, m, rows_out, k)
        y = self.buffer(m * rows_out * 4)
        self.product(x_ref, w, scale, y, m, rows_out, k)
        if self.tp is not None and values[0] in self.tp.row_parallel:
            self.launches.append(PlannedCollective("all_reduce", y, y, m, rows_out))
        return _Val(rows_out, f32=y)

    def vocab_parallel(self, x: Ref, w: Ref, scale: Ref | None, m: int, vocab: int,
                       k: int) -> _Val:
        """A tensor-parallel rank's head: the logits of its vocabulary rows of the whole table
        (tensor_parallel.py), then all ranks' side by side."""
        start, stop = self.tp.vocab
        size = numpy_dtype(self.specs[w.key].dtype).itemsize
        part = self.buffer(m * (stop - start) * 4)
        self.product(x, w.at(start * k * size), None if scale is None else scale.at(start * 4),
                     part, m, stop - start, k)
        y = self.buffer(m * vocab * 4)
        self.launches.append(PlannedCollective("all_gather", part, y, m, stop - start))
        return _Val(vocab, f32=y)

    def product(self, x: Ref, w: Ref, scale: Ref | None, y: Ref, m: int, n: int, k: int) -> None:
        """y = x @ W^T for a LINEAR: the tied head (bf16, the vocabulary wide) from
        BF16_GEMM_ROWS rows on the bf16 tensor-core GEMM, one read of the table; everything else
        by gemv(). (A MoE router, bf16 but 128 experts wide, calls gemv() itself: one
        256-column tile of the GEMM would leave it on a single SM.)"""
        if (scale is None and self.specs[w.key].dtype == "bfloat16" and m >= BF16_GEMM_ROWS
                and n >= BF16_GEMM_MIN_N and gemm_tc.fits(m, n, k)):
            self.bf16_gemm(x, w, y, m, n, k)
        else:
            self.gemv(x, w, scale, y, m, n, k)

    @property
    def sample_rows(self) -> int:
        """Rows the head and sampler run: a prefill entry's S sequences, a mixed entry's S and
        its lanes, every row of the others."""
        if self.kind == "prefill":
            return self.prefill_seqs
        if self.kind == "mixed":
            return self.prefill_seqs + self.m - self.prefill_rows
        return self.m

    def select_last_rows(self, x: Ref, hdim: int) -> Ref:
        s = self.sample_rows
        out = self.buffer(s * hdim * self.lin_size)
        entry = rows.SELECT_F32_ENTRY if self.f32 else rows.SELECT_ENTRY
        self.emit(entry, rows.select_geometry(s, hdim), src=x, rows=Ref("io", "last_row"),
                  dst=out, S=s, H=hdim)
        return out

    def gated(self, at: _At):
        """GATED_LINEAR: gate || up in one GEMV, then gelu(gate) * up."""
        x = at.input(0)
        if not (isinstance(x, _Val) and x.lin is not None):
            raise LoweringError("gated linear input has no copy for the GEMV (bf16 or float32)")
        values, scales = self.linear_weights(at, 1, 2)
        f32 = self.specs[values[0]].dtype == "float32"
        if not (scales or f32):
            raise LoweringError("gated linear needs FP8 or float32 weights")
        inter, k = self.specs[values[0]].shape
        gu = self.buffer(self.m * 2 * inter * 4)
        self.gemv(x.lin, Ref("weights", values[0]), Ref("weights", scales[0]) if scales else None,
                  gu, self.m, 2 * inter, k)
        out = self.buffer(self.m * inter * (4 if f32 else 2))
        fits = inter <= gelu_mul.Q_MAX_I
        self.emit_quantizable(gelu_mul.F32_ENTRY if f32 else gelu_mul.ENTRY,
                              gelu_mul.Q_ENTRY if fits else None,
                              gelu_mul.launch_geometry(self.m, inter),
                              gelu_mul.q_geometry(self.m, inter) if fits else None, out,
                              gu=gu, out=out, I=inter)
        return _Val(inter, f32=out if f32 else None, lin=out)

    # -- attention

    def kv_store(self, at: _At):
        """No launch: the ATTENTION_BLOCK reading this store writes the rows (qkv_post)."""
        if not any(at.g.nodes[u].op == Op.ATTENTION_BLOCK and at.idx in at.g.nodes[u].inputs[4:6]
                   for u in at.users):
            raise LoweringError("kv_store read by no attention_block: nothing would write it")
        return ("stored", at.idx)

    def attention(self, at: _At):
        """qkv_post (q norm + RoPE; the KV_STOREs' norms, RoPE and writes), then split-KV
        attention + combine for decode, or for a chunk of more than one row the flash-style
        attn_prefill (bf16/e4m3 plans)."""
        a, n = at.node.attrs, at.node
        if a.scale != 1.0:
            raise LoweringError(f"attention scale {a.scale}: the kernels use 1.0 (Gemma 4)")
        if not (at.is_arg(1, "positions") and at.is_arg(2, "cache_len")):
            raise LoweringError("attention over other positions than the step's")
        owner = self.pools[at.spec.kv_source]
        qkv = at.input(0)
        nh, kh, d = a.heads, owner.kv_heads, a.head_dim
        stores = self.checked_stores(at, kh)
        inv_freq = self.consts.add(np.asarray(a.rope.inv_freq, np.float32))
        wq = Ref("weights", at.weight(3))
        if a.k_eq_v:  # the read-time k_norm (the producer's, KV-shared)
            wk = Ref("weights", at.weight(5))
        else:  # the K store's norm weight; a KV-shared layer writes nothing
            wk = Ref("weights", at.weight(3, of=n.inputs[4])) if stores else None
        table = Ref("io", "table_ring" if owner.ring else "table_full")
        width = owner.table_width
        k_pool, v_pool = Ref("kv", (owner.layer, 0)), (Ref("kv", (owner.layer, 1))
                                                       if len(owner.names) == 2 else None)
        write_kv = bool(stores)
        kv_dtype = owner.dtype
        f32 = kv_dtype == "float32"  # q and the attention output stay float32 too
        q_out = self.buffer(self.m * nh * d * (4 if f32 else 2))
        self.emit(qkv_post.entry(d, kv_dtype),
                  qkv_post.launch_geometry(self.m, nh, kh if write_kv else 0, d),
                  qkv=qkv.f32, ld=qkv.cols, nh=nh, kh=kh if write_kv else 0, d=d,
                  k_eq_v=int(a.k_eq_v), wq=wq, wk=wk, positions=Ref("io", "positions"),
                  inv_freq=inv_freq, eps=a.eps, q_out=q_out,
                  k_pool=k_pool if write_kv else None, v_pool=v_pool if write_kv else None,
                  table=table, max_blocks=width, ring=width)
        wkv = wk if a.k_eq_v else None
        # the kernels' window counts keys up to the last one a row sees (its seq_len - 1)
        window = a.window - self.key_lag if a.window else 0
        out = self.buffer(self.m * nh * d * 4)
        out_bf16 = None if f32 else self.buffer(self.m * nh * d * 2)
        at_rows = _Rows(q_out, table, width, out, out_bf16, nh * d, 4 if f32 else 2)
        args = dict(a=a, kh=kh, d=d, k_pool=k_pool, v_pool=v_pool, wkv=wkv,
                    inv_freq=inv_freq, window=window, kv_dtype=kv_dtype)
        # One sequence's chunk (or a packed prefill's): the flash-style kernel (bf16/e4m3
        # only); a float32 plan runs the decode kernel, each row its own query (seq_len =
        # position + 1, its own table row). A mixed entry: its prefill rows the first way, its
        # decode lanes the second, each launch exactly as in the entry of those rows alone.
        if self.kind == "mixed":
            self.prefill_attention(at_rows, 0, self.prefill_rows, **args)
            self.decode_attention(at_rows, self.prefill_rows, self.m - self.prefill_rows,
                                  **args)
        elif self.kind in ("prefill", "logits") and self.m > 1 and not f32:
            self.prefill_attention(at_rows, 0, self.m, **args)
        else:
            self.decode_attention(at_rows, 0, self.m, **args)
        if out_bf16 is not None:
            self.row_bound[out_bf16] = ATTENTION_OUT_BOUND * float(np.sqrt(d))
        return _Val(d, f32=out, lin=out if f32 else out_bf16)

    def prefill_attention(self, x: _Rows, row0: int, rows: int, *, a, kh: int, d: int,
                          k_pool: Ref, v_pool: Ref | None, wkv: Ref | None, inv_freq: Ref,
                          window: int, kv_dtype: str) -> None:
        """attn_prefill over rows row0..row0+rows-1 of the entry."""
        nh = a.heads
        geometry = attn_prefill.geometry(rows, kh, d, nh // kh, a.k_eq_v)
        self.prefill_align = max(self.prefill_align, attn_prefill.tile_tokens(d, nh // kh))
        common = dict(q=x.q(row0), table=x.table(row0), ring=x.width,
                      positions=Ref("io", "positions").at(row0 * 4), window=window,
                      kv_heads=kh, rows=rows, out=x.out(row0), out_bf16=x.out_bf16(row0))
        if a.k_eq_v:
            self.emit(attn_prefill.entry_keqv(d, nh // kh, kv_dtype), geometry, base=k_pool,
                      wk=wkv, inv_freq=inv_freq, **common)
        else:
            self.emit(attn_prefill.entry(d, nh // kh, kv_dtype), geometry, kc=k_pool,
                      vc=v_pool, **common)

    def decode_attention(self, x: _Rows, row0: int, rows: int, *, a, kh: int, d: int,
                         k_pool: Ref, v_pool: Ref | None, wkv: Ref | None, inv_freq: Ref,
                         window: int, kv_dtype: str) -> None:
        """Split-KV decode attention + combine over rows row0..row0+rows-1 of the entry, split
        as for an entry of `rows` rows. K=V layers of bf16/e4m3 plans run the split on tensor
        cores: at head dim 512 with quarter-rotary rope (the full layers of Gemma 4's K=V
        sizes) attn_decode.cu's K=V entries (1.3-3.2x attn_prefill.cu's at 31B shapes, B = 1..256,
        H200, benchmarks/h100_attn.py), else attn_prefill.cu's decode entries; the other
        layers, and the float32 plan, attn_decode.cu's split kernel."""
        nh = a.heads
        keys = min(self.ir.max_context, a.window or self.ir.max_context)
        splits = attn_decode.num_splits(rows, kh, keys, SM_COUNT)
        # one split: the split kernel writes the combine's result itself (no partials, no
        # combine launch: ~20 us a layer at 256 lanes)
        alone = splits == 1
        part_acc = None if alone else self.buffer(rows * nh * splits * d * 4)
        part_ml = None if alone else self.buffer(rows * nh * splits * 2 * 4)
        common = dict(q=x.q(row0), table=x.table(row0), max_blocks=x.width, ring=x.width,
                      seq_len=Ref("io", "seq_len").at(row0 * 4), window=window, kv_heads=kh,
                      part_acc=part_acc, part_ml=part_ml,
                      out=x.out(row0) if alone else None,
                      out_bf16=x.out_bf16(row0) if alone else None)
        if a.k_eq_v and attn_decode.keqv_mma_fits(d, nh // kh, kv_dtype, a.rope.inv_freq):
            self.emit(attn_decode.entry_keqv_mma(d, nh // kh, kv_dtype),
                      attn_decode.split_geometry(rows, kh, splits), base=k_pool, wk=wkv,
                      inv_freq=inv_freq, **common)
        elif a.k_eq_v and kv_dtype != "float32":
            self.emit(attn_prefill.decode_entry_keqv(d, nh // kh, kv_dtype),
                      attn_prefill.decode_geometry(rows, kh, splits, d, True), base=k_pool,
                      wk=wkv, inv_freq=inv_freq, **common)
        elif a.k_eq_v:
            self.emit(attn_decode.entry_keqv(d, nh // kh, kv_dtype),
                      attn_decode.split_geometry(rows, kh, splits), base=k_pool, wk=wkv,
                      inv_freq=inv_freq, **common)
        else:
            self.emit(attn_decode.entry(d, nh // kh, kv_dtype),
                      attn_decode.split_geometry(rows, kh, splits), kc=k_pool, vc=v_pool,
                      **common)
        if not alone:
            self.emit(attn_decode.COMBINE_ENTRY,
                      attn_decode.combine_geometry(rows, nh, d, splits), part_acc=part_acc,
                      part_ml=part_ml, splits=splits, d=d, out=x.out(row0),
                      out_bf16=x.out_bf16(row0))

    def checked_stores(self, at: _At, kv_heads: int) -> list[Node]:
        """The KV_STOREs an ATTENTION_BLOCK reads (none: KV-shared), checked to be what qkv_post
        writes: k (or the K=V base) right after q's columns, v after k, the step's positions,
        q's eps, RoPE on k only, a norm weight on k only."""
        a, g, n = at.node.attrs, at.g, at.node
        caches = n.inputs[4:5] if a.k_eq_v else n.inputs[4:6]
        stores = [g.nodes[c] for c in caches if g.nodes[c].op == Op.KV_STORE]
        if not stores:
            if any(g.nodes[c].op != Op.ARG for c in caches):
                raise LoweringError("attention over caches neither stored here nor shared")
            return []
        if len(stores) != len(caches):
            raise LoweringError("attention over one stored and one shared cache")
        start = a.heads * a.head_dim
        for i, s in enumerate(stores):
            k = i == 0 and not a.k_eq_v
            want = (start + i * kv_heads * a.head_dim, kv_heads, a.head_dim, a.eps)
            got = (s.attrs.start, s.attrs.heads, s.attrs.head_dim, s.attrs.eps)
            if (s.inputs[1:3] != n.inputs[0:2] or got != want
                    or s.attrs.rope != (a.rope if k else None) or (len(s.inputs) == 4) != k):
                raise LoweringError(f"kv_store %{caches[i]} is not what qkv_post writes beside "
                                    "this attention's q (columns q | k | v, RoPE and weight on "
                                    "k only, q's eps)")
        return stores

    # -- mixture of experts

    def moe(self, at: _At):
        """MOE_BLOCK: both norms of the residual in one launch, the router GEMV (bf16), the
        top-k route, then the experts: per row up to moe.MAX_ROWS rows, grouped by expert
        beyond; the expert ids stay on the device. Then the branch sum."""
        r, a = at.input(0), at.node.attrs
        if not (isinstance(r, _Val) and r.f32 is not None):
            raise LoweringError("MoE norms over a value with no float32 copy")
        y = self.moe_quantized(at, r) if a.quantized else self.moe_f32(at, r)
        f = at.input(1)
        if not (isinstance(f, _Val) and f.f32 is not None):
            raise LoweringError("MoE dense branch has no float32 copy")
        hdim = self.cfg.hidden_size
        out = self.buffer(self.m * hdim * 4)
        self.emit(moe.BRANCH_SUM_ENTRY, moe.norm_geometry(self.m, hdim), f=f.f32,
                  w1=Ref("weights", at.weight(8)), y=y.f32, w2=Ref("weights", at.weight(9)),
                  out=out, H=hdim, eps=a.eps)
        return _Val(hdim, f32=out)

    def moe_quantized(self, at: _At, r: _Val) -> _Val:
        a = at.node.attrs
        router = at.weight(3)
        if self.specs[router].dtype != "bfloat16":
            raise LoweringError(f"router weight dtype {self.specs[router].dtype}; the H100 "
                                "router GEMV takes bf16 (run cast_bf16)")
        gate_up, down = at.weight(6), at.weight(7)
        for name in (gate_up, down):
            if self.specs[name].dtype != "float8_e4m3fn":
                raise LoweringError(f"expert weight {name} is {self.specs[name].dtype}; the H100 "
                                    "expert kernels take FP8 with per-row scales")
        experts, two_inter, hdim = self.specs[gate_up].shape
        inter, k, m = two_inter // 2, a.top_k, self.m
        w = {i: Ref("weights", at.weight(i)) for i in (2, 4, 5, 10, 11)}
        z, x2 = self.buffer(m * hdim * 2), self.buffer(m * hdim * 2)
        self.emit(moe.NORMS_ENTRY, moe.norm_geometry(m, hdim), r=r.f32, router_scale=w[2],
                  router_mul=a.router_scale, w2=w[4], z=z, x2=x2, H=hdim, eps=a.eps)
        logits = self.buffer(m * experts * 4)
        if m <= moe.MAX_ROWS:
            self.gemv(z, Ref("weights", router), None, logits, m, experts, hdim)
        else:
            self.emit(moe.ROUTER_ROWS_ENTRY, moe.router_rows_geometry(m, experts, hdim), z=z,
                      Wr=Ref("weights", router), logits=logits, M=m, E=experts, H=hdim)
        ids, weights = self.buffer(m * k * 4), self.buffer(m * k * 4)
        self.emit(moe.ROUTE_ENTRY, moe.route_geometry(m, experts, k), logits=logits,
                  per_expert_scale=w[5], ids=ids, wts=weights, E=experts, K=k)
        y = self.buffer(m * hdim * 4)
        gate_up_w = {"W": Ref("weights", gate_up), "scale": w[10]}
        down_w = {"D": Ref("weights", down), "scale": w[11]}
        if m <= moe.MAX_ROWS:  # decode: one launch each, the chosen experts' rows only
            dims = {"M": m, "K": k, "I": inter, "H": hdim}
            hid = self.buffer(m * k * inter * 2)
            self.emit(moe.GATE_UP_ENTRY, moe.gate_up_geometry(m, k, inter, hdim, SM_COUNT),
                      **gate_up_w, x=x2, ids=ids, hid=hid, **dims)
            self.emit(moe.DOWN_ENTRY, moe.down_geometry(m, k, inter, hdim, SM_COUNT),
                      **down_w, hid=hid, ids=ids, wts=weights, y=y, **dims)
            return _Val(hdim, f32=y)
        pairs = m * k  # prefill: the (row, slot) pairs grouped by expert
        order, offsets = self.buffer(pairs * 4), self.buffer((experts + 1) * 4)
        hid, part = self.buffer(pairs * inter * 2), self.buffer(pairs * hdim * 4)
        self.emit(moe.SORT_ENTRY, moe.sort_geometry(pairs, experts), ids=ids, order=order,
                  offsets=offsets, P=pairs, E=experts)
        self.emit(moe.GATE_UP_GROUPED_ENTRY, moe.gate_up_grouped_geometry(experts, inter, hdim),
                  **gate_up_w, x=x2, order=order, offsets=offsets, hid=hid, K=k, I=inter, H=hdim)
        self.emit(moe.DOWN_GROUPED_ENTRY, moe.down_grouped_geometry(experts, inter, hdim),
                  **down_w, hid=hid, order=order, offsets=offsets, wts=weights, part=part,
                  I=inter, H=hdim)
        self.emit(moe.SUM_PAIRS_ENTRY, moe.sum_pairs_geometry(m, hdim), part=part, y=y, K=k,
                  H=hdim)
        return _Val(hdim, f32=y)

    def moe_f32(self, at: _At, r: _Val) -> _Val:
        """The float32 plan's experts (unquantized): moe_norms_f32, the float32 router GEMV,
        moe_route, then one launch each for the experts' gate/up and down at any row count."""
        a = at.node.attrs
        names = {i: at.weight(i) for i in (3, 2, 4, 5, 6, 7)}
        for i in (3, 6, 7):
            if self.specs[names[i]].dtype != "float32":
                raise LoweringError(f"MoE weight {names[i]} is {self.specs[names[i]].dtype} "
                                    "beside unquantized float32 experts")
        w = {i: Ref("weights", name) for i, name in names.items()}
        experts, two_inter, hdim = self.specs[names[6]].shape
        inter, k, m = two_inter // 2, a.top_k, self.m
        z, x2 = self.buffer(m * hdim * 4), self.buffer(m * hdim * 4)
        self.emit(moe.NORMS_F32_ENTRY, moe.norm_geometry(m, hdim), r=r.f32, router_scale=w[2],
                  router_mul=a.router_scale, w2=w[4], z=z, x2=x2, H=hdim, eps=a.eps)
        logits = self.buffer(m * experts * 4)
        self.gemv(z, w[3], None, logits, m, experts, hdim)
        ids, weights = self.buffer(m * k * 4), self.buffer(m * k * 4)
        self.emit(moe.ROUTE_ENTRY, moe.route_geometry(m, experts, k), logits=logits,
                  per_expert_scale=w[5], ids=ids, wts=weights, E=experts, K=k)
        hid, y = self.buffer(m * k * inter * 4), self.buffer(m * hdim * 4)
        dims = {"M": m, "K": k, "I": inter, "H": hdim}
        self.emit(moe.GATE_UP_F32_ENTRY,
                  moe.expert_f32_geometry(m, k, inter, hdim, SM_COUNT, gate_up=True),
                  W=w[6], x=x2, ids=ids, hid=hid, **dims)
        self.emit(moe.DOWN_F32_ENTRY,
                  moe.expert_f32_geometry(m, k, inter, hdim, SM_COUNT, gate_up=False),
                  D=w[7], hid=hid, ids=ids, wts=weights, y=y, **dims)
        return _Val(hdim, f32=y)

    # -- per-layer inputs (PLE)

    def ple_embed(self, at: _At) -> Ref:
        """PLE_EMBED, the embed graph's per-layer inputs [rows, L, P]: one launch from the
        model projection's output and the per-layer table."""
        a, ctx = at.node.attrs, at.input(0)
        table = at.weight(1)
        if not at.is_arg(2, "tokens"):
            raise LoweringError("per-layer embedding ids other than the step's tokens")
        entry = {"bfloat16": ple.COMBINE_ENTRY,
                 "float32": ple.COMBINE_F32_ENTRY}.get(self.specs[table].dtype)
        if entry is None:
            raise LoweringError(f"per-layer embedding table dtype {self.specs[table].dtype}; "
                                "ple_combine gathers bf16 or float32 rows")
        layers, p = self.cfg.num_layers, self.cfg.hidden_size_per_layer_input
        out = self.buffer(self.m * layers * p * 4)
        self.emit(entry, ple.combine_geometry(self.m, layers, p), ctx=ctx.f32,
                  table=Ref("weights", table), ids=Ref("io", "tokens"),
                  w=Ref("weights", at.weight(3)), ple=out, ctx_scale=a.ctx_scale,
                  tok_mult=a.table_scale, out_scale=a.out_scale, eps=a.eps, M=self.m, L=layers,
                  P=p)
        return out

    def ple_projection(self, at: _At):
        """PLE_PROJECTION: gelu(gate) * the layer's slice of the per-layer inputs, times the
        projection: ple_project (any P % 4), or for more than 4 rows with P % 16 == 0
        ple_gelu_mul and the FP8 GEMM; float32 weights the f32 entry."""
        gate = at.input(0)
        if not (isinstance(gate, _Val) and gate.f32 is not None):
            raise LoweringError("per-layer gate with no float32 copy")
        if not (at.is_arg(1, "ple") and self.ple is not None):
            raise LoweringError("ple_projection of other than the layer's per-layer input")
        values, scales = self.linear_weights(at, 2, 1)
        hdim, p = self.specs[values[0]].shape
        layer = {"layer": at.spec.index, "L": self.cfg.num_layers}
        y = self.buffer(self.m * hdim * 4)
        if self.specs[values[0]].dtype == "float32":
            self.emit(ple.PROJECT_F32_ENTRY,
                      ple.project_geometry(self.m, hdim, p, SM_COUNT, f32=True), gate=gate.f32,
                      ple=self.ple, **layer, W=Ref("weights", values[0]), y=y, M=self.m, N=hdim,
                      P=p)
            return _Val(hdim, f32=y)
        if not scales:
            raise LoweringError("the per-layer projection needs FP8 or float32 weights")
        if ple.use_gemm(self.m, p):
            gated = self.buffer(self.m * p * 2)
            self.emit(ple.GELU_MUL_ENTRY, ple.gelu_mul_geometry(self.m, p), gate=gate.f32,
                      ple=self.ple, **layer, out=gated, M=self.m, P=p)
            self.gemv(gated, Ref("weights", values[0]), Ref("weights", scales[0]), y, self.m,
                      hdim, p)
            return _Val(hdim, f32=y)
        self.emit(ple.PROJECT_ENTRY, ple.project_geometry(self.m, hdim, p, SM_COUNT),
                  gate=gate.f32, ple=self.ple, **layer, W=Ref("weights", values[0]),
                  scale=Ref("weights", scales[0]), y=y, M=self.m, N=hdim, P=p)
        return _Val(hdim, f32=y)

    # -- logits and sampling

    def softcapped(self, at: _At):
        x = at.input(0)
        self.softcap = at.node.attrs.cap
        if self.kind != "logits":
            return x  # the sampler applies the cap on the fly
        n = self.m * x.cols
        self.emit(rows.SOFTCAP_ENTRY, rows.softcap_geometry(n), x=x.f32, n=n, cap=self.softcap)
        self.outputs["logits"] = (x.f32, "float32", (self.m, x.cols))
        return x

    def sample(self, at: _At):
        """The IR's SAMPLE over softcap(logits), per row from the io sampling fields."""
        if self.kind == "logits":
            return None
        logits = at.input(0)
        m, v = self.sample_rows, logits.cols
        cap = self.softcap or 0.0
        if self.kind == "mixed":
            return self.sample_parts(logits.f32, m, v, cap)
        plan = sample.plan(m, v, SM_COUNT)
        k = sample.TOP_LOGPROBS
        # sampled: the token, its log-probability and the top ones, side by side (one read)
        ws = self.buffer(plan.workspace)
        out = self.tokens_out or self.buffer(m * 4 * (2 + 2 * k if self.sampled else 1))
        io = {name: Ref("io", name) for name in ("temperature", "top_k", "top_p", "seed", "step")}
        self.emit(sample.PREPARE_ENTRY, plan.prepare, logits=logits.f32, M=m, V=v, cap=cap,
                  workspace=ws)
        if self.sampled:
            extras = sample.extras_plan(m, v)
            x = {name: Ref("sample_io", name) for name in SAMPLE_IO_ARGS}
            lp_scratch = self.buffer(extras.scratch)
            self.emit(sample.LOGPROB_STATS_ENTRY, extras.stats, logits=logits.f32, M=m, V=v,
                      cap=cap, n_top=x["n_top"], scratch=lp_scratch)
            self.emit(sample.PENALIZE_ENTRY, extras.penalize, M=m, V=v, pool=x["pool"],
                      pen_at=x["pen_at"], pen_n=x["pen_n"], presence=x["presence"],
                      frequency=x["frequency"], repetition=x["repetition"], workspace=ws)
            self.emit(sample.MASK_ENTRY, extras.mask, M=m, V=v, pool=x["pool"],
                      mask_at=x["mask_at"], pen_n=x["pen_n"], workspace=ws)
        self.emit(sample.FILTER_ENTRY, plan.filter, M=m, V=v, chunk=plan.chunk,
                  temperature=io["temperature"], top_k=io["top_k"], workspace=ws)
        if self.ratio_lanes:
            self.ratio_rule(plan, ws, out, io)
        else:
            self.emit(sample.PICK_ENTRY, plan.pick, M=m, V=v, **io, workspace=ws, out=out)
        self.outputs["out_tokens"] = (out, "int32", (m,))
        if self.sampled:
            lp, ids, vals = out.at(4 * m), out.at(8 * m), out.at(8 * m + 4 * m * k)
            self.emit(sample.LOGPROBS_ENTRY, extras.logprobs, logits=logits.f32, M=m, V=v,
                      cap=cap, tokens=out, n_top=x["n_top"], K=k, scratch=lp_scratch,
                      logprob=lp, top_ids=ids, top_logprobs=vals)
            self.outputs.update(logprob=(lp, "float32", (m,)), top_ids=(ids, "int32", (m, k)),
                                top_logprobs=(vals, "float32", (m, k)))
        if self.decode_loop_steps:  # in io: the next replay's kernels must not reuse it
            self.emit(rows.ADVANCE_ENTRY, rows.advance_geometry(m), sampled=out,
                      tokens=Ref("io", "tokens"), positions=Ref("io", "positions"),
                      seq_len=Ref("io", "seq_len"), step=io["step"],
                      budget=Ref("io", "loop_budget"), loop_step=Ref("io", "loop_step"),
                      history=Ref("io", "loop_tokens"), B=m, L=self.decode_loop_steps)
        return None


    def sample_parts(self, logits: Ref, m: int, v: int, cap: float) -> None:
        """A mixed entry's sampling: its S prefill rows, then its lanes, each part launched as
        the entry of those rows alone launches it (the filter's chunks depend on the rows)."""
        out = self.buffer(m * 4)
        s = self.prefill_seqs
        for row0, n in ((0, s), (s, m - s)):
            plan = sample.plan(n, v, SM_COUNT)
            ws = self.buffer(plan.workspace)
            io = {name: Ref("io", name).at(row0 * 4)
                  for name in ("temperature", "top_k", "top_p", "seed", "step")}
            self.emit(sample.PREPARE_ENTRY, plan.prepare, logits=logits.at(row0 * v * 4),
                      M=n, V=v, cap=cap, workspace=ws)
            self.emit(sample.FILTER_ENTRY, plan.filter, M=n, V=v, chunk=plan.chunk,
                      temperature=io["temperature"], top_k=io["top_k"], workspace=ws)
            self.emit(sample.PICK_ENTRY, plan.pick, M=n, V=v, **io, workspace=ws,
                      out=out.at(row0 * 4))
        self.outputs["out_tokens"] = (out, "int32", (m,))

    def ratio_rule(self, plan: sample.Plan, ws: Ref, out: Ref, io: dict[str, Ref]) -> None:
        """The pick with its records, then spec_ratio over the rows (verify's lanes by the
        ratio rule against the last draft call's distributions, in the ratio region)."""
        m, v = self.m, self.ir.config.vocab_size
        dist = self.buffer(ratio.dist_bytes(m))
        self.emit(ratio.PICK_DIST_ENTRY, plan.pick, M=m, V=v, **io, workspace=ws, out=out,
                  dist=dist)
        self.emit(ratio.RATIO_ENTRY, ratio.ratio_geometry(self.ratio_lanes), M=m, V=v,
                  workspace=ws, dist=dist, q_logits=Ref("ratio", "draft_q"),
                  q_dist=Ref("ratio", "draft_dist"), tokens=Ref("io", "tokens"),
                  temperature=io["temperature"], seed=io["seed"], step=io["step"],
                  lanes=Ref("io", "ratio_lanes"), out=out)


def _handed(outputs: dict) -> dict:
    """What one graph hands the next besides the residual stream (one buffer for the whole
    entry): the next graph's normed input "x" (passes/fuse_next_norm)."""
    return {"x": outputs["x"]} if outputs.get("x") is not None else {}


# The table: each op's launches. An op that is not here has no kernel (LoweringError).
LOWER: dict[Op, Callable[[EntryLowering, _At], object]] = {
    Op.ARG: EntryLowering.arg,
    Op.PARAM: EntryLowering.param,
    Op.RESHAPE: EntryLowering.reshape,  # a view: no launch
    Op.EMBED: EntryLowering.embed,  # embed_{bf16,fp8,f32}
    Op.RMSNORM: EntryLowering.rmsnorm,  # rmsnorm (embed: layer 0's input norm)
    Op.RESIDUAL_RMSNORM: EntryLowering.residual,  # residual_rmsnorm[_copy]
    Op.NEXT_NORM: EntryLowering.next_norm,  # written by its residual's launch
    Op.LINEAR: EntryLowering.linear,  # GEMV / FP8 GEMM (+ to_bf16, + select_last_rows)
    Op.MULTI_LINEAR: EntryLowering.linear,  # one GEMV over the adjacent weights
    Op.GATED_LINEAR: EntryLowering.gated,  # GEMV + gelu_mul
    Op.KV_STORE: EntryLowering.kv_store,  # written by its ATTENTION_BLOCK's qkv_post
    Op.ATTENTION_BLOCK: EntryLowering.attention,  # qkv_post + attn_decode/combine | attn_prefill
    Op.MOE_BLOCK: EntryLowering.moe,  # moe_norms, router, route, experts, branch sum
    Op.PLE_EMBED: EntryLowering.ple_embed,  # ple_combine
    Op.PLE_PROJECTION: EntryLowering.ple_projection,  # ple_project | ple_gelu_mul + GEMM
    Op.SOFTCAP: EntryLowering.softcapped,  # in place for logits entries, else in the sampler
    Op.SAMPLE: EntryLowering.sample,  # prepare, filter, pick
}
