"""Tensor parallelism for the H100 plan: the IR of rank r of N (Megatron's split), the plan the
lowering follows for it, and where each of the rank's weights comes from in the full weight.

- column-parallel, split by output rows with their per-row scales: q, k and v (whole heads;
  the fused q|k|v GEMV of a rank reads its heads' rows), gate and up (whole columns of the
  intermediate width). A layer with fewer KV heads than ranks keeps each KV head on the N/kv
  ranks whose query heads form its group (K=V layers alike): rank r holds KV heads
  [r * kv // N, ... + max(1, kv // N));
- row-parallel, split by input columns (per-row scales whole): o and down. Their outputs are
  partial sums; the lowering puts an all-reduce (kernel_schedule.Collective) right after each,
  before the block's post-norm, which needs the whole sum;
- the head: each rank computes the logits of its vocabulary rows [r * V / N, (r + 1) * V / N)
  of the (tied) table, then an all-gather before softcap and sampling. The embedding lookup
  reads the same table whole, so the table is stored whole on every rank (the head reads
  1/N of it per step);
- everything else (norms, per-layer inputs, the MoE branch, the sampler) is replicated: every
  rank computes it on the same replicated residual stream.

The ranks' schedules run in lockstep: every rank reaches the same collectives in one order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from rvcompile.dtypes import numpy_dtype
from rvcompile.ir.graph import Graph, ModelIR, ParamSpec, readers, resolve_param
from rvcompile.ir.ops import Op

K_STEP = 16  # the FP8 GEMVs' and GEMMs' K granularity: a row-parallel weight's columns a rank


class TensorParallelError(ValueError):
    """The model cannot be split over that many ranks; the message names what does not divide."""


@dataclass(frozen=True)
class Shard:
    """A rank's part of a full weight: [start, stop) along `axis` (0 rows, 1 columns)."""

    axis: int
    start: int
    stop: int


@dataclass(frozen=True)
class RankSlot:
    """Where a rank's copy of a weight goes in a --tp artifact's weights section, and which
    part of the full weight it is (None: all of it)."""

    offset: int
    nbytes: int
    shard: Shard | None


@dataclass(frozen=True)
class RankPlan:
    """What the lowering of one rank needs beyond its IR."""

    ranks: int
    rank: int
    row_parallel: frozenset[str]  # weights whose GEMV output is a partial sum: all-reduce after
    vocab: tuple[int, int]  # the head's rows this rank computes

    def __post_init__(self):
        if not 0 <= self.rank < self.ranks:
            raise TensorParallelError(f"rank {self.rank} of {self.ranks}")


@dataclass(frozen=True)
class RankIR:
    ir: ModelIR  # the rank's: split weights' shapes, its heads, its KV heads
    plan: RankPlan
    shards: dict[str, Shard]  # split weights; every other weight is whole


def kv_split(kv_heads: int, ranks: int, rank: int) -> tuple[int, int]:
    """(first KV head, count) of `rank`."""
    if kv_heads % ranks and ranks % kv_heads:
        raise TensorParallelError(f"{kv_heads} KV heads over {ranks} ranks: one must divide "
                                  "the other")
    return rank * kv_heads // ranks, max(1, kv_heads // ranks)


def _even(n: int, ranks: int, rank: int, what: str) -> tuple[int, int]:
    if n % ranks:
        raise TensorParallelError(f"{what} {n} does not divide over {ranks} ranks")
    return rank * n // ranks, (rank + 1) * n // ranks


def shard_ir(ir: ModelIR, ranks: int, rank: int) -> RankIR:
    """Rank `rank`'s IR of `ir` (after an h100 pipeline's fusions) split over `ranks`."""
    if not 0 <= rank < ranks:
        raise TensorParallelError(f"rank {rank} of {ranks}")
    if ir.assistant is not None:
        raise TensorParallelError("an assistant's drafter is not split over ranks")
    specs = ir.param_map()
    kv_heads = {c.layer: c.kv_heads for c in ir.caches}
    shards: dict[str, Shard] = {}
    row_parallel: set[str] = set()
    templates: dict[int, Graph] = {}
    for li, spec in enumerate(ir.config.layers):
        t = ir.layer_template[li]
        g = ir.layers[t]

        def name(i: int, g=g, spec=spec) -> str:
            return resolve_param(g.nodes[i].attrs.name, spec)

        nodes = list(g.nodes)
        for idx, n in enumerate(g.nodes):
            if n.op == Op.ATTENTION_BLOCK:
                a = n.attrs
                d = a.head_dim
                q0, q1 = _even(a.heads, ranks, rank, f"layer {li}: query heads")
                kv0, kvn = kv_split(kv_heads[spec.kv_source], ranks, rank)
                proj = g.nodes[n.inputs[0]]
                count = proj.attrs.count if proj.op == Op.MULTI_LINEAR else 1
                values, scales = proj.inputs[1:1 + count], proj.inputs[1 + count:]
                rows = [(q0 * d, q1 * d)] + [(kv0 * d, (kv0 + kvn) * d)] * (count - 1)
                for group in (values, scales) if scales else (values,):
                    for w, (r0, r1) in zip(group, rows, strict=True):
                        shards[name(w)] = Shard(0, r0, r1)
                width = sum(r1 - r0 for r0, r1 in rows)
                nodes[n.inputs[0]] = replace(proj, shape=(*proj.shape[:-1], width))
                nodes[idx] = replace(n, attrs=replace(a, heads=q1 - q0),
                                     shape=(*n.shape[:-2], q1 - q0, d))
                for i, c in enumerate(n.inputs[4:6]):
                    store = g.nodes[c]
                    if store.op == Op.KV_STORE:
                        nodes[c] = replace(store, attrs=replace(
                            store.attrs, start=(q1 - q0) * d + i * kvn * d, heads=kvn))
                views = _readers_of(g, idx, Op.RESHAPE)
                outs = [o for u in views for o in _readers_of(g, u, Op.LINEAR)]
                if len(views) != 1 or len(outs) != 1 or len(readers(g)[idx]) != 1:
                    raise TensorParallelError(f"layer {li}: the attention output is read "
                                              "other than by one reshape and o projection")
                r, cols = g.nodes[views[0]], (q1 - q0) * d
                nodes[views[0]] = replace(r, shape=(*r.shape[:-1], cols),
                                          attrs=replace(r.attrs, shape=(*r.shape[:-1], cols)))
                w = name(g.nodes[outs[0]].inputs[1])
                shards[w] = Shard(1, q0 * d, q1 * d)
                row_parallel.add(w)
            elif n.op == Op.GATED_LINEAR:
                gate = name(n.inputs[1])
                inter = specs[gate].shape[0]
                c0, c1 = _even(inter, ranks, rank, f"layer {li}: MLP width")
                if (c1 - c0) % K_STEP:
                    raise TensorParallelError(
                        f"layer {li}: MLP width {inter} over {ranks} ranks is {c1 - c0} columns "
                        f"a rank, not a multiple of {K_STEP} (the down projection's K step)")
                for w in n.inputs[1:]:
                    shards[name(w)] = Shard(0, c0, c1)
                nodes[idx] = replace(n, shape=(*n.shape[:-1], c1 - c0))
                downs = _readers_of(g, idx, Op.LINEAR)
                if len(downs) != 1 or len(readers(g)[idx]) != 1:
                    raise TensorParallelError(f"layer {li}: the gated MLP's product is read "
                                              "other than by one down projection")
                w = name(g.nodes[downs[0]].inputs[1])
                shards[w] = Shard(1, c0, c1)
                row_parallel.add(w)
        templates[t] = replace(g, nodes=tuple(nodes))
    vocab = _even(ir.config.vocab_size, ranks, rank, "vocabulary")
    params = tuple(_split_spec(p, shards.get(p.name)) for p in ir.params)
    caches = tuple(replace(c, kv_heads=kv_split(c.kv_heads, ranks, rank)[1]) for c in ir.caches)
    layers = tuple(templates.get(i, g) for i, g in enumerate(ir.layers))
    rank_ir = replace(ir, layers=layers, params=params, caches=caches)
    return RankIR(rank_ir, RankPlan(ranks, rank, frozenset(row_parallel), vocab), shards)


def _readers_of(g: Graph, idx: int, op: Op) -> list[int]:
    return [u for u, n in enumerate(g.nodes) if n.op == op and n.inputs and n.inputs[0] == idx]


def _split_spec(p: ParamSpec, shard: Shard | None) -> ParamSpec:
    if shard is None:
        return p
    shape = list(p.shape)
    shape[shard.axis] = shard.stop - shard.start
    return replace(p, shape=tuple(shape))


def shard_bytes(full: bytes, spec: ParamSpec, shard: Shard | None) -> bytes:
    """A rank's stored bytes of a weight from the full weight's stored bytes (`spec`: the full
    weight's), in the rank's row-major order."""
    if shard is None:
        return bytes(full)
    size = numpy_dtype(spec.dtype).itemsize
    a = np.frombuffer(full, np.uint8).reshape(*spec.shape, size)
    return np.take(a, np.arange(shard.start, shard.stop), axis=shard.axis).tobytes()


def rank_weights(full: memoryview | bytes, full_slots: dict, specs: dict[str, ParamSpec],
                 rank_slots: dict, shards: dict[str, Shard], nbytes: int) -> bytes:
    """A rank's weights region from the whole model's: `full_slots` and `rank_slots` map each
    weight to its slot (.offset, .nbytes) in the full and the rank's layout, `specs` are the
    full weights'."""
    out = bytearray(nbytes)
    for name, slot in rank_slots.items():
        f = full_slots[name]
        data = shard_bytes(bytes(full[f.offset:f.offset + f.nbytes]), specs[name],
                           shards.get(name))
        if len(data) != slot.nbytes:
            raise TensorParallelError(f"weight {name}: {len(data)} bytes for a "
                                      f"{slot.nbytes}-byte slot")
        out[slot.offset:slot.offset + slot.nbytes] = data
    return bytes(out)
