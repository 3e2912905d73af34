"""Where everything of an H100 schedule lives: ONE arena whose fixed part holds, in order, the
packed weights (the artifact's weights section), constants, the io fields the host writes per
call, and the activations; the paged KV pools follow it, their block counts chosen at load (the
schedule records each pool's kind and bytes per block). Launches are planned over symbolic
pointers (`Ref`: a region, a key in it, a byte offset); `place` turns each into an arena offset,
or for a pool's base into the pool's index (argument kind "pool").

- weights: every stored weight 256-byte aligned in ParamSpec order, except that the members of a
  fused GEMV (a MULTI_LINEAR's or GATED_LINEAR's weights) come first and adjacent, values then
  scales, so one launch reads them as one matrix;
- constants: float32 arrays the launches need (RoPE frequencies, ones), each stored once;
- KV pools, per cache-owning layer (KV-shared layers read their producer's), after the fixed
  part: blocks of 16 tokens, a sequence's table `width` blocks: the whole context for full
  layers, a ring of window + chunk - 1 tokens plus a block for sliding ones; K=V layers one pool
  of normalised bases; bf16, e4m3 (an FP8-KV build) or float32 (h100-f32) as the IR's caches
  are;
- io: tokens, positions, seq_len, the prefill's last row, one block-table row per token row
  and KV kind, the sampling parameters;
- sample_io (with sampled entry points): right after io, the sampler's extras per decode lane
  and the pool of their masks and penalty pairs (kernel_schedule.SamplerIo);
- ratio (with an assistant drafter): the draft entries' logits and sampling records, which the
  decode and verify entries' ratio rule reads (kernel_schedule.RatioIo; ratio.py);
- activations: per entry point, each temporary buffer lives from its first launch to its last,
  and buffers whose lives overlap never share bytes (memory_plan).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rvcompile.artifacts.kernel_params import ParamsTemplate
from rvcompile.artifacts.kernel_schedule import (
    SAMPLE_IO_FIELDS,
    Arg,
    Collective,
    EntryPoint,
    Field,
    KernelSchedule,
    KvKindLayout,
    KvLayout,
    KvPool,
    Launch,
    ParamsBlock,
    RatioIo,
    SamplerIo,
)
from rvcompile.dtypes import numpy_dtype
from rvcompile.ir.graph import ModelIR, resolve_draft_param, resolve_param
from rvcompile.ir.ops import Op
from rvcompile.targets.h100 import attn_decode, gemv_fp8, memory_plan
from rvcompile.targets.h100.contract import Bound, ParamsValue

BLOCK = attn_decode.BLOCK
KV_DTYPES = ("bfloat16", "float8_e4m3fn", "float32")


class LoweringError(ValueError):
    """The IR holds something the H100 kernels do not implement; the message names it."""


@dataclass(frozen=True)
class Ref:
    """A pointer before layout: a region, a key inside it, a byte offset from there."""

    region: str  # "weights", "const", "kv", "io", "sample_io", "ratio", "act"
    key: object
    offset: int = 0

    def at(self, nbytes: int) -> Ref:
        return Ref(self.region, self.key, self.offset + nbytes)


@dataclass(frozen=True)
class PlannedLaunch:
    """A kernel launch over symbolic pointers."""

    module: str
    kernel: str
    geometry: gemv_fp8.Launch
    args: tuple[Bound, ...]  # checked against the entry, in its order; pointers are Refs

    def refs(self) -> list[Ref]:
        """Every buffer the launch names, a parameter block's roles included."""
        out = []
        for a in self.args:
            if isinstance(a.value, ParamsValue):
                out += [ref for _, ref in a.value.roles]
            elif isinstance(a.value, Ref):
                out.append(a.value)
        return out


@dataclass(frozen=True)
class PlannedCollective:
    """A collective step of a tensor-parallel rank (kernel_schedule.Collective) over symbolic
    pointers."""

    op: str
    src: Ref
    dst: Ref
    rows: int
    cols: int

    def refs(self) -> list[Ref]:
        return [self.src, self.dst]


@dataclass(frozen=True)
class EntryPlan:
    """One entry point's launches before layout."""

    name: str
    rows: int
    graph: bool  # captured into a CUDA graph at load (decode and prefill)
    launches: tuple[PlannedLaunch | PlannedCollective, ...]
    sizes: dict[int, int]  # activation buffer -> bytes
    outputs: dict[str, tuple[Ref, str, tuple[int, ...]]]  # host-read results: ref, dtype, shape


# ---------------------------------------------------------------- weights and constants

@dataclass
class WeightSlot:
    offset: int
    nbytes: int


def _fused_groups(ir: ModelIR) -> list[list[str]]:
    """Per layer (the drafter's too), the weight names each MULTI_LINEAR / GATED_LINEAR reads
    in one launch: [values..., scales...] in the order the kernel expects them."""
    layers = [(ir.layers[ir.layer_template[li]], lambda rel, spec=spec: resolve_param(rel, spec))
              for li, spec in enumerate(ir.config.layers)]
    if ir.assistant is not None:  # the drafter's layers (draft.py)
        d = ir.assistant
        layers += [(d.layers[t], lambda rel, i=i, read=read: resolve_draft_param(rel, i, read))
                   for i, (t, read) in enumerate(zip(d.layer_template, d.reads, strict=True))]
    groups = []
    for g, resolve in layers:
        for n in g.nodes:
            if n.op in (Op.MULTI_LINEAR, Op.GATED_LINEAR):
                groups.append([resolve(g.nodes[i].attrs.name) for i in n.inputs[1:]])
    return groups


def layout_weights(ir: ModelIR) -> tuple[dict[str, WeightSlot], int]:
    """Offsets of every stored weight; a fused group's values are adjacent, and so are its
    scales, each run 256-byte aligned."""
    specs = ir.param_map()

    def nbytes(name: str) -> int:
        s = specs[name]
        return int(np.prod(s.shape)) * numpy_dtype(s.dtype).itemsize

    slots: dict[str, WeightSlot] = {}
    offset = 0
    for group in _fused_groups(ir):
        half = len(group) // 2
        for run in (group[:half], group[half:]):
            offset = memory_plan.align(offset)
            for name in run:
                if name in slots:
                    raise LoweringError(f"weight {name} is in two fused groups")
                slots[name] = WeightSlot(offset, nbytes(name))
                offset += nbytes(name)
    for p in ir.params:
        if p.name not in slots:
            offset = memory_plan.align(offset)
            slots[p.name] = WeightSlot(offset, nbytes(p.name))
            offset += nbytes(p.name)
    return slots, memory_plan.align(offset)


class Constants:
    """The constants region: each distinct float32 array once, in the order first asked for."""

    def __init__(self):
        self.blobs: list[bytes] = []
        self.offsets: dict[bytes, int] = {}
        self.size = 0

    def add(self, values: np.ndarray) -> Ref:
        b = np.ascontiguousarray(values, np.float32).tobytes()
        if b not in self.offsets:
            self.offsets[b] = self.size
            self.blobs.append(b + bytes(memory_plan.align(len(b)) - len(b)))
            self.size += memory_plan.align(len(b))
        return Ref("const", 0, self.offsets[b])

    def data(self) -> bytes:
        return b"".join(self.blobs)


# ---------------------------------------------------------------- the KV pools and io

@dataclass(frozen=True)
class Pool:
    layer: int  # the owning layer
    names: tuple[str, ...]  # ("cache_k", "cache_v") or ("cache_kv",)
    ring: bool
    kv_heads: int
    head_dim: int
    table_width: int
    dtype: str  # "bfloat16", "float8_e4m3fn" (an FP8-KV build) or "float32" (h100-f32)


@dataclass(frozen=True)
class KvPools:
    pools: dict[int, Pool]  # by owning layer
    full: int  # a full layer's table width (blocks)
    ring: int  # a sliding layer's ring width (blocks)


def kv_pools(ir: ModelIR) -> KvPools:
    """The pool of every cache-owning layer. The ring holds every block a step can touch: the
    window behind a chunk's first query plus the chunk, and one more so a block can be swapped
    in while its predecessor is still read."""
    full = -(-ir.max_context // BLOCK)
    windows = [ir.config.layers[c.layer].window for c in ir.caches if c.ring]
    ring = min(full, -(-(max(windows) + ir.max_chunk - 1) // BLOCK) + 1) if windows else 1
    pools = {}
    for c in ir.caches:
        if c.dtype not in KV_DTYPES:
            raise LoweringError(f"layer {c.layer}: KV cache dtype {c.dtype}; the H100 kernels "
                                "keep bf16 (cast_bf16), e4m3 (kv_fp8) or float32 caches")
        pools[c.layer] = Pool(c.layer, c.names, c.ring, c.kv_heads, c.head_dim,
                              ring if c.ring else full, c.dtype)
    if len({p.dtype for p in pools.values()}) > 1:
        raise LoweringError("KV caches of different dtypes; one schedule keeps one")
    return KvPools(pools, full, ring)


# Steps one series of decode replays can log in io "loop_tokens" (rows.decode_advance; the
# runtime's decode loop runs at most this many, and at most max_chunk).
DECODE_LOOP_STEPS = 32


def _io_fields(max_rows: int, full: int, ring: int, max_seqs: int,
               last_rows: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    return {
        "tokens": ("int32", (max_rows,)),
        "positions": ("int32", (max_rows,)),
        "seq_len": ("int32", (max_rows,)),
        # the rows the head samples: each packed sequence's last row (-1: none), a mixed
        # call's lanes after them
        "last_row": ("int32", (last_rows,)),
        "table_full": ("int32", (max_rows, full)),
        "table_ring": ("int32", (max_rows, ring)),
        "temperature": ("float32", (max_rows,)),
        "top_k": ("int32", (max_rows,)),
        "top_p": ("float32", (max_rows,)),
        "seed": ("int32", (max_rows,)),
        "step": ("int32", (max_rows,)),
        # the decode loop's (rows.decode_advance): budgets, the step, the steps' tokens (a
        # decode entry of B rows uses the first DECODE_LOOP_STEPS * B)
        "loop_budget": ("int32", (max_rows,)),
        "loop_step": ("int32", (1,)),
        "loop_tokens": ("int32", (DECODE_LOOP_STEPS, max_seqs)),
    }


def _sample_io_fields(max_seqs: int, pool_words: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """The sample_io region's fields in their order (the pool last: the host writes a prefix)."""
    per_lane = {name: (dtype, (max_seqs,)) for name, dtype in SAMPLE_IO_FIELDS.items()
                if name != "pool"}
    return {**per_lane, "pool": ("int32", (pool_words,))}


def sampler_shape(ir: ModelIR, top_logprobs: int) -> tuple[int, int, int]:
    """(top_logprobs K, penalty pairs per lane P, mask words per lane W): P = min(max_context,
    vocab), the most distinct tokens a sequence holds."""
    v = ir.config.vocab_size
    return top_logprobs, min(ir.max_context, v), -(-v // 32)


def _kv_kinds(ir: ModelIR, kv: KvPools) -> tuple[KvKindLayout, ...]:
    pools = kv.pools.values()
    kinds = []
    if any(not p.ring for p in pools):
        kinds.append(KvKindLayout("full", "table_full", kv.full, False, 0))
    if any(p.ring for p in pools):
        window = max(ir.config.layers[p.layer].window for p in pools if p.ring)
        kinds.append(KvKindLayout("sliding", "table_ring", kv.ring, True, window))
    return tuple(kinds)


def _kv_layout(ir: ModelIR, kv: KvPools) -> tuple[KvLayout, dict[tuple[int, int], int]]:
    """The schedule's KV layout, and each (layer, tensor)'s index in its pools."""
    pools, index = [], {}
    for layer, pool in sorted(kv.pools.items()):
        nbytes = BLOCK * pool.kv_heads * pool.head_dim * numpy_dtype(pool.dtype).itemsize
        for t in range(len(pool.names)):
            index[(layer, t)] = len(pools)
            pools.append(KvPool("sliding" if pool.ring else "full", layer, nbytes))
    dtype = next(iter(kv.pools.values())).dtype if kv.pools else "bfloat16"
    return KvLayout(BLOCK, dtype, _kv_kinds(ir, kv), tuple(pools)), index


# ---------------------------------------------------------------- the arena

def place(ir: ModelIR, entries: list[EntryPlan], weights: dict[str, WeightSlot],
          weights_bytes: int, consts: Constants, kv: KvPools, max_seqs: int,
          max_rows: int, top_logprobs: int = 0,
          extra_io: dict[str, tuple[str, tuple[int, ...]]] | None = None,
          ratio_fields: dict[str, tuple[str, tuple[int, ...]]] | None = None,
          last_rows: int = 1) -> KernelSchedule:
    """The schedule: the fixed part's regions placed one after another, every pointer an arena
    offset but a pool's base, its index in the KV layout's pools (placed at load);
    top_logprobs > 0: with the sample_io region of the sampled entry points; `extra_io`: io
    fields after the others (the draft entries', draft.py), which only the calls that read them
    write; `ratio_fields`: the ratio region's (draft.py), after sample_io; `last_rows`: the
    rows a prefill or mixed call's head samples (io last_row's values)."""
    kv_layout, pool_index = _kv_layout(ir, kv)
    offset = weights_bytes
    const_offset = offset
    offset = memory_plan.align(offset + consts.size)
    io_offset = offset
    io: dict[str, Field] = {}
    fields = {**_io_fields(max_rows, kv.full, kv.ring, max_seqs, last_rows),
              **(extra_io or {})}
    for name, (dtype, shape) in fields.items():
        io[name] = Field(offset, dtype, shape)
        offset = memory_plan.align(offset + int(np.prod(shape)) * 4)
    io_bytes = offset - io_offset
    sampler = None
    sample_io: dict[str, Field] = {}
    if top_logprobs:
        k, p, w = sampler_shape(ir, top_logprobs)
        start = offset
        end = start
        for name, (dtype, shape) in _sample_io_fields(max_seqs, max_seqs * (w + 2 * p)).items():
            sample_io[name] = Field(offset, dtype, shape)
            end = offset + int(np.prod(shape)) * 4
            offset = memory_plan.align(end)
        sampler = SamplerIo(start, end - start, k, p, w, sample_io)  # ends with the pool
    ratio = None
    ratio_io: dict[str, Field] = {}
    if ratio_fields:
        start = offset
        for name, (dtype, shape) in ratio_fields.items():
            ratio_io[name] = Field(offset, dtype, shape)
            offset = memory_plan.align(offset + int(np.prod(shape)) * 4)
        ratio = RatioIo(start, offset - start, ratio_io)
    act_offset = offset
    act_bytes = 0
    resolved: dict[str, EntryPoint] = {}
    outputs: dict[str, Field] = {}
    templates: dict[str, ParamsTemplate] = {}
    for e in entries:
        uses = [tuple(r.key for r in launch.refs() if r.region == "act")
                for launch in e.launches]
        # the host reads the outputs after the entry: they live to its last launch
        uses[-1] += tuple(ref.key for ref, _, _ in e.outputs.values() if ref.region == "act")
        lives = memory_plan.lifetimes(uses, e.sizes)
        offsets, total = memory_plan.plan(lives)
        memory_plan.check(lives, offsets)
        act_bytes = max(act_bytes, total)

        def address(ref: Ref, act: dict[int, int] = offsets) -> int:
            if ref.region == "weights":
                return weights[ref.key].offset + ref.offset
            if ref.region == "kv":  # pools move at load: only "pool" arguments name them
                raise LoweringError(f"a KV pool ({ref}) where an arena offset is needed")
            return ref.offset + {"const": lambda: const_offset,
                                 "io": lambda: io[ref.key].offset,
                                 "sample_io": lambda: sample_io[ref.key].offset,
                                 "ratio": lambda: ratio_io[ref.key].offset,
                                 "act": lambda: act_offset + act[ref.key]}[ref.region]()

        def arg(a: Bound, address=address) -> Arg:
            if a.param.kind == "params":  # the template once per name, the roles' offsets
                p = a.value
                if templates.setdefault(p.name, p.template) != p.template:
                    raise LoweringError(f"two parameter templates named {p.name}")
                return Arg(a.param.name, "params",
                           ParamsBlock(p.name, {role: address(ref) for role, ref in p.roles}))
            if a.param.kind != "ptr":
                return Arg(a.param.name, a.param.kind, a.value)
            if a.value is None:
                return Arg(a.param.name, "null", 0)
            if a.value.region == "kv":
                if a.value.offset:
                    raise LoweringError(f"{a.param.name}: a pointer inside a KV pool; the "
                                        "kernels take pool bases")
                return Arg(a.param.name, "pool", pool_index[a.value.key])
            return Arg(a.param.name, "ptr", address(a.value))

        def step(x, address=address, arg=arg) -> Launch | Collective:
            if isinstance(x, PlannedCollective):
                return Collective(x.op, address(x.src), address(x.dst), x.rows, x.cols)
            return Launch(x.module, x.kernel, tuple(x.geometry.grid), tuple(x.geometry.block),
                          x.geometry.smem, tuple(arg(a) for a in x.args))

        resolved[e.name] = EntryPoint(e.name, e.rows, e.graph,
                                      tuple(step(x) for x in e.launches))
        for out_name, (ref, dtype, shape) in e.outputs.items():
            outputs[f"{e.name}.{out_name}"] = Field(address(ref), dtype, shape)
    return KernelSchedule(
        arena_bytes=memory_plan.align(act_offset + act_bytes), weights_bytes=weights_bytes,
        constants_offset=const_offset, constants_bytes=consts.size, io_offset=io_offset,
        io_bytes=io_bytes, max_seqs=max_seqs, max_context=ir.max_context,
        max_chunk=ir.max_chunk, vocab_size=ir.config.vocab_size, kv=kv_layout,
        io=io, outputs=outputs, entries=resolved, cubins={}, params_templates=templates,
        sampler=sampler, ratio=ratio)
