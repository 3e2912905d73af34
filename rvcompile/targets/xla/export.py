"""XLA target: a ModelIR becomes serialized `jax.export` programs plus a weight layout.

`lower_to_xla` returns the serialized entry points (StableHLO for every requested platform) and
the manifest fragment the runtime needs to call them: the weight layout (offset of each array in
the "weights" section), the paged KV layout (kinds, block tables, pools), buckets and the
exporting jax version. The pools' block counts stay symbolic in the programs (the runtime chooses
them at load), and the manifest's "default_blocks" give every slot a whole sequence; except with
`static_pools` (`fixed_pools`: what the build asks for tensor-parallel programs for TPU alone),
where the programs take exactly "default_blocks" and the manifest says so ("kv": {"fixed_blocks":
true}; absent otherwise, so other artifacts are unchanged). `decode_loop_steps` > 0 adds
decode_loop_{max_seqs} (Program.decode_loop) of min(decode_loop_steps, max_chunk) steps per call.
`draft_tokens` K > 0 adds verify_{max_seqs}x{K+1} (Program.verify: K + 1 rows per lane) and,
with an assistant in the IR, draft_{max_seqs} (Program.draft: up to K assistant steps; it reads
the pools without donating them), whose draft_probs verify then takes for the ratio rule
(format v6); the manifest's "speculative" names them.

Tensor parallelism (`tp` > 1): every entry point is exported over an abstract 1-D mesh of `tp`
devices with the weights' and pools' shardings from `sharding.plan_tp` (jax.export records them
as HloShardings; the build needs no devices), and the manifest's "mesh" records the axis, its
size and every array's PartitionSpec. verify and draft too: verify like the others; draft reads
the pools in their shardings and returns its tokens, logits, draft_probs and states whole on
every device (the states verify returns are whole as well), so the runtime passes them from one
call to the next without moving them. The weight bytes stay whole, in the same layout as at
tp = 1: the runtime hands each device its slice of the memory-mapped array, so one artifact
format serves every degree, a row-split shard is a contiguous run of the mapped file, and the
build streams and checks weights exactly as before.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import jaxlib
from jax import export
from jax._src import config as jax_config
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from rvcompile.ir.graph import ModelIR
from rvcompile.targets.xla.lower import BLOCK_SIZE
from rvcompile.targets.xla.program import (
    DECODE_LOOP_STOPS,
    LayoutPlan,
    Program,
    cache_pools,
    cache_shapes,
    draft_shapes,
    loop_shapes,
    loop_steps,
    plan_layout,
    sampling_shapes,
    table_shapes,
    verify_shapes,
    weight_shapes,
)
from rvcompile.targets.xla.sampler import TOP_LOGPROBS, extras_shapes, mask_words
from rvcompile.targets.xla.sharding import TP_AXIS, TpLayout, partition_spec, plan_tp

ALIGN = 4096
PLATFORMS = ("tpu", "cuda", "cpu")


@dataclass(frozen=True)
class WeightSlot:
    key: str
    index: int | None  # position in a stacked array, None for an unstacked one
    offset: int  # byte offset of this slice in the weights section
    nbytes: int


@dataclass(frozen=True)
class XlaLowering:
    programs: dict[str, bytes]  # entry name -> serialized jax.export.Exported
    manifest: dict  # layout, entry points, versions
    weights_nbytes: int
    slots_by_param: dict[str, list[WeightSlot]]  # full param name -> where its bytes go


def _dtype_name(d) -> str:
    return jnp.dtype(d).name


def weight_layout(ir: ModelIR, plan: LayoutPlan):
    shapes = weight_shapes(ir, plan)
    arrays, offset = [], 0
    for key, s in shapes.items():
        nbytes = math.prod(s.shape) * jnp.dtype(s.dtype).itemsize
        arrays.append({"key": key, "shape": list(s.shape), "dtype": _dtype_name(s.dtype),
                       "offset": offset, "nbytes": nbytes})
        offset += -(-nbytes // ALIGN) * ALIGN
    by_key = {a["key"]: a for a in arrays}
    slots: dict[str, list[WeightSlot]] = {}
    for key, idx, full in plan.weight_slices(ir):
        a = by_key[key]
        per = a["nbytes"] // (a["shape"][0] if idx is not None else 1)
        off = a["offset"] + (idx or 0) * per
        slots.setdefault(full, []).append(WeightSlot(key, idx, off, per))
    return arrays, offset, slots


def _named(layout: TpLayout, specs: dict) -> dict[str, NamedSharding]:
    mesh = AbstractMesh((layout.size,), (TP_AXIS,))
    return {k: NamedSharding(mesh, partition_spec(v)) for k, v in specs.items()}


def _sharded_jit(fn, args: tuple, layout: TpLayout, *, reads_only: bool = False):
    """`fn` jitted with the weights and pools placed by `layout` over an abstract mesh,
    everything else (tokens, tables, sampling parameters, states, the returned tokens, logits
    or states) replicated; the pools are donated and come back with their own shardings, or,
    `reads_only` (draft), are only read: neither donated nor returned."""
    weights, pools = _named(layout, layout.weights), _named(layout, layout.pools)
    whole = NamedSharding(AbstractMesh((layout.size,), (TP_AXIS,)), PartitionSpec())
    rest = jax.tree.map(lambda _: whole, args[2:])
    outs = jax.tree.map(lambda _: whole, jax.eval_shape(fn, *args))
    if reads_only:
        return jax.jit(fn, in_shardings=(weights, pools, *rest), out_shardings=outs)
    return jax.jit(fn, in_shardings=(weights, pools, *rest),
                   out_shardings=(pools, *outs[1:]), donate_argnums=(1,))


def fixed_pools(platforms: tuple[str, ...], tp: int) -> bool:
    """Whether a build exports the pools at fixed block counts: tensor-parallel programs for
    TPU alone. Only there does it matter: their decode steps run the Pallas kernel
    (lower.decode_kernel_fits) inside shard_map, and a shard_map operand with a symbolic
    dimension crashes XLA's shape refinement when the program is compiled (SIGSEGV in
    RefinePolymorphicShapes, jax 0.10.2 / libtpu 0.0.42.1; docs/TPU_COST.md), so with symbolic
    pools they would keep the slower XLA lowering. The price: such an artifact's pools cannot
    be sized at load."""
    return tp > 1 and tuple(platforms) == ("tpu",)


def lower_to_xla(ir: ModelIR, *, max_seqs: int, prefill_buckets: tuple[int, ...],
                 platforms: tuple[str, ...] = PLATFORMS, tp: int = 1,
                 decode_loop_steps: int = 0, draft_tokens: int = 0,
                 static_pools: bool = False) -> XlaLowering:
    """`static_pools`: export the pools with their default block counts instead of symbolic
    ones, recorded in the manifest as fixed ("kv": {"fixed_blocks": true}: the runtime then
    loads the pools at exactly those counts). The build asks for it where `fixed_pools` says
    (under tensor parallelism only then do decode steps run the Pallas kernel:
    lower.decode_kernel_fits); benchmarks/tpu_cost_report.py --static-pools also at TP = 1."""
    if max(prefill_buckets) != ir.max_chunk:
        raise ValueError("the largest prefill bucket must equal the IR's max_chunk")
    if draft_tokens + 1 > ir.max_chunk or (ir.assistant and not draft_tokens):
        raise ValueError(f"{draft_tokens} draft tokens: verify rows must fit a prefill chunk "
                         f"({ir.max_chunk}), and an assistant needs at least one")
    plan = plan_layout(ir)
    layout = plan_tp(ir, plan, tp) if tp > 1 else None
    # Programs for TPU alone may call Pallas TPU kernels (a Mosaic custom call, which no other
    # platform runs); exported for several platforms they keep XLA's lowering everywhere.
    prog = Program(ir, plan, _named(layout, layout.pools) if layout else None, tp,
                   tpu_kernels=tuple(platforms) == ("tpu",))
    kinds = prog.kinds
    symbols = (tuple(max_seqs * k.table_width for k in kinds.values()) if static_pools
               else export.symbolic_shape(", ".join(f"blocks_{k}" for k in kinds)))
    ws = weight_shapes(ir, plan)
    cs = cache_shapes(ir, plan, dict(zip(kinds, symbols, strict=True)), tp)
    i32 = jnp.int32

    def sds(shape, dtype=i32):
        return jax.ShapeDtypeStruct(shape, dtype)

    def lane_args(batch: int, t: int) -> tuple:
        return (ws, cs, sds((batch, t)), sds((batch,)), sds((batch,)),
                table_shapes(kinds, batch))

    vocab, pen = ir.config.vocab_size, ir.max_context

    def sampled(batch: int) -> tuple:
        return (*sampling_shapes(batch), *extras_shapes(batch, vocab, pen))

    entries: dict[str, tuple] = {}
    for t in prefill_buckets:
        entries[f"prefill_{t}"] = (prog.step_sampled, (*lane_args(1, t), *sampled(1)))
    entries[f"decode_{max_seqs}"] = (prog.step_sampled,
                                     (*lane_args(max_seqs, 1), *sampled(max_seqs)))
    entries[f"logits_{ir.max_chunk}"] = (prog.logits, lane_args(1, ir.max_chunk))
    n_loop = loop_steps(ir, decode_loop_steps)
    if n_loop > 0:
        entries[f"decode_loop_{max_seqs}"] = (
            functools.partial(prog.decode_loop, n_steps=n_loop),
            (*lane_args(max_seqs, 1), *sampling_shapes(max_seqs), *loop_shapes(max_seqs)))
    reads_only = set()  # entry points that only read the pools: no donation
    b = max_seqs
    if draft_tokens:
        rows = draft_tokens + 1
        entries[f"verify_{b}x{rows}"] = (prog.verify, (*lane_args(b, rows), *sampling_shapes(b),
                                                       *verify_shapes(ir, b, draft_tokens)))
    if ir.assistant:
        entries[f"draft_{b}"] = (
            functools.partial(prog.draft, max_steps=draft_tokens),
            (*lane_args(b, 1), *draft_shapes(ir, b), *sampling_shapes(b), sds(())))
        reads_only.add(f"draft_{b}")
    programs = {}
    for name, (fn, args) in entries.items():
        if layout is not None:
            jitted = _sharded_jit(fn, args, layout, reads_only=name in reads_only)
        else:
            jitted = jax.jit(fn) if name in reads_only else jax.jit(fn, donate_argnums=(1,))
        # No source locations in the program: by default jax records the Python call stack of
        # every op (file paths, line numbers, function names of the caller, rvcompile's install
        # directory and the CLI's frames included), so the bytes would depend on where and how
        # the build ran; the op names ("jit(decode)/...") are kept. A private jax config (no
        # public context manager); tests/test_rebuild.py checks that no path is left.
        with jax_config.traceback_in_locations_limit(0):
            exp = export.export(jitted, platforms=platforms)(*args)
        programs[name] = bytes(exp.serialize())
    arrays, nbytes, slot_map = weight_layout(ir, plan)
    manifest = {
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "platforms": list(platforms),
        "max_seqs": max_seqs,
        "max_context": ir.max_context,
        "max_chunk": ir.max_chunk,
        "prefill_buckets": list(prefill_buckets),
        "decode_loop": {"steps": n_loop, "stop_ids": DECODE_LOOP_STOPS},
        "sampler": {"top_logprobs": TOP_LOGPROBS, "penalty_ids": pen,
                    "mask_words": mask_words(vocab)},
        "entry_points": sorted(programs),
        "weights": arrays,
        "kv": {
            "block_size": BLOCK_SIZE,
            "kinds": {k.name: {"table_width": k.table_width, "ring": k.ring, "window": k.window,
                               "default_blocks": max_seqs * k.table_width}
                      for k in kinds.values()},
            "pools": [{"key": key, "kind": kind, "layers": count, "block_shape": list(block),
                       "dtype": _dtype_name(dtype)}
                      for key, (kind, count, block, dtype) in cache_pools(ir, plan, tp).items()],
            **({"fixed_blocks": True} if static_pools else {}),
        },
        "layer_groups": [{"start": g.start, "period": g.period, "count": g.count}
                         for g in plan.groups],
    }
    if draft_tokens:
        manifest["speculative"] = {
            "draft_tokens": draft_tokens, "verify": f"verify_{max_seqs}x{draft_tokens + 1}",
            "draft": f"draft_{max_seqs}" if ir.assistant else None,
            "hidden_size": ir.config.hidden_size,
            "reads": list(ir.assistant.reads) if ir.assistant else [],
        }
    if layout:
        manifest["mesh"] = layout.to_json()
    return XlaLowering(programs, manifest, nbytes, slot_map)
