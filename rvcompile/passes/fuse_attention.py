"""Attention block fusion: what feeds an ATTENTION from the q/k/v projection, as two ops. Expects
a ModelIR after fuse_qkv (q, k and v are SLICE_LASTs of one MULTI_LINEAR; a KV-shared layer's q
is a LINEAR of its own), whatever its weight and cache dtypes.

Finds, per ATTENTION(q, k, v, positions, k_pos) with k_pos = CACHE_POSITIONS(cache_len):
- q = ROPE(RMSNORM(RESHAPE(cols), w_q), positions), cols the projection's first heads x D
  columns (a SLICE_LAST from 0, or the whole of a q-only projection);
- K and V, as the front end makes them:
  - own cache: KV_WRITE(cache_k, ROPE(RMSNORM(RESHAPE(SLICE_LAST(qkv)), w_k), positions),
    positions) and KV_WRITE(cache_v, RMSNORM(RESHAPE(SLICE_LAST(qkv))), positions);
  - K=V: V = KV_WRITE(cache_kv, RMSNORM(RESHAPE(SLICE_LAST(qkv))), positions) (the shared base)
    and K = ROPE(MUL(V, k_norm), k_pos);
  - KV-shared: the producer's cache ARGs in place of the KV_WRITEs.
Each KV_WRITE becomes `KV_STORE(cache, qkv, positions[, w])` (the slice, norm, RoPE and write
as one op, still the layer's cache output), and the ATTENTION becomes `ATTENTION_BLOCK(qkv,
positions, cache_len, w_q, cache_k, cache_v)` or, K=V, `(..., cache_kv, k_norm)`, reading the
KV_STOREs (or the shared ARGs). A cluster fuses only when none of its inner nodes is read from
outside it (the KV_WRITEs' values stay: the KV_STOREs compute them).

Guarantees: the graph computes the same bits (the new ops' references are the replaced ops'
references in the same order); weights, ParamSpecs and caches are untouched; the nodes fused
away are dropped. Returns `ir` itself when nothing matched.

The H100 target lowers an ATTENTION_BLOCK with the KV_STOREs it reads as qkv_post (q, and the
writes) plus the attention kernels (targets/h100/launches.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.ir.graph import Graph, ModelIR, drop_unread, rewrite_indexed
from rvcompile.ir.ops import AttentionBlockAttrs, KVStoreAttrs, Op, RopeAttrs
from rvcompile.passes import read_only_inside, rewrite_graphs

NAME = "fuse_attention"


@dataclass(frozen=True)
class _Heads:
    """[ROPE](RMSNORM(RESHAPE(columns of a projection)[, weight])), by node index."""

    qkv: int  # the projection
    start: int  # the first column
    heads: int
    head_dim: int
    eps: float
    weight: int | None  # the norm's weight PARAM
    rope: RopeAttrs | None
    pos: int | None  # ROPE's positions
    chain: tuple[int, ...]  # the nodes from the ROPE (or norm) back to the SLICE_LAST


def _heads(g: Graph, i: int, rope: bool) -> _Heads | None:
    nodes, chain = g.nodes, []
    rope_attrs = pos = None
    if rope:
        if nodes[i].op is not Op.ROPE:
            return None
        chain.append(i)
        rope_attrs, (i, pos) = nodes[i].attrs, nodes[i].inputs
    norm = nodes[i]
    if norm.op is not Op.RMSNORM:
        return None
    reshape_i = norm.inputs[0]
    reshape = nodes[reshape_i]
    if reshape.op is not Op.RESHAPE or len(reshape.shape) != 4:
        return None
    chain += [i, reshape_i]
    src_i = reshape.inputs[0]
    src = nodes[src_i]
    heads, head_dim = reshape.shape[2:]
    if src.shape != (*reshape.shape[:2], heads * head_dim):
        return None
    qkv, start = src_i, 0
    if src.op is Op.SLICE_LAST:
        chain.append(src_i)
        qkv, start = src.inputs[0], src.attrs.start
    weight = norm.inputs[1] if len(norm.inputs) == 2 else None
    if weight is not None and nodes[weight].op is not Op.PARAM:
        return None
    return _Heads(qkv, start, heads, head_dim, norm.attrs.eps, weight, rope_attrs, pos,
                  tuple(chain))


@dataclass(frozen=True)
class _Block:
    """One matched attention cluster, by old node index."""

    attrs: AttentionBlockAttrs
    qkv: int
    positions: int
    cache_len: int
    q_norm: int
    caches: tuple[int, ...]  # cache_k, cache_v or cache_kv: KV_WRITEs (own) or ARGs (shared)
    k_norm: int | None  # K=V: the read-time k_norm PARAM
    stores: dict[int, tuple[int, _Heads]]  # KV_WRITE -> (its cache ARG, its rows)
    inner: frozenset[int]  # the nodes the block swallows


def _match(g: Graph, idx: int) -> _Block | None:
    nodes = g.nodes
    att = nodes[idx]
    q_in, k_in, v_in, pos, k_pos = att.inputs
    q = _heads(g, q_in, rope=True)
    if q is None or q.start != 0 or q.weight is None or q.pos != pos:
        return None
    cp = nodes[k_pos]
    if cp.op is not Op.CACHE_POSITIONS:
        return None
    inner = {*q.chain, k_pos}
    k_eq_v = nodes[k_in].op is Op.ROPE
    k_norm = None
    if k_eq_v:
        mul_i, rope_pos = nodes[k_in].inputs
        mul = nodes[mul_i]
        if (mul.op is not Op.MUL or mul.inputs[0] != v_in or rope_pos != k_pos
                or nodes[k_in].attrs != q.rope or nodes[mul.inputs[1]].op is not Op.PARAM):
            return None
        caches, k_norm = (v_in,), mul.inputs[1]
        inner |= {k_in, mul_i}
    else:
        caches = (k_in, v_in)
    stores = {}
    for c in caches:
        if nodes[c].op is Op.ARG:
            continue
        if nodes[c].op is not Op.KV_WRITE:
            return None
        cache, new, write_pos = nodes[c].inputs
        rows = _heads(g, new, rope=not k_eq_v and c == k_in)
        if rows is None or rows.qkv != q.qkv or write_pos != pos or rows.pos not in (None, pos):
            return None
        stores[c] = (cache, rows)
        inner |= set(rows.chain)
    if len(stores) not in (0, len(caches)):
        return None
    if not read_only_inside(g, inner, inner | {idx, *stores}):
        return None
    attrs = AttentionBlockAttrs(q.heads, q.head_dim, q.eps, q.rope, att.attrs.window,
                                att.attrs.scale, cp.attrs.ring, k_eq_v)
    return _Block(attrs, q.qkv, pos, cp.inputs[0], q.weight, caches, k_norm, stores,
                  frozenset(inner))


def fuse_graph(g: Graph) -> Graph:
    blocks = {i: blk for i, n in enumerate(g.nodes)
              if n.op is Op.ATTENTION and (blk := _match(g, i)) is not None}
    if not blocks:
        return g
    stores = {c: v for blk in blocks.values() for c, v in blk.stores.items()}

    def rule(b, i, remap):
        n = g.nodes[i]
        if i in stores:
            cache, rows = stores[i]
            attrs = KVStoreAttrs(rows.start, rows.heads, rows.head_dim, rows.eps, rows.rope,
                                 n.attrs.ring)
            weight = () if rows.weight is None else (remap[rows.weight],)
            return b.add(Op.KV_STORE, (remap[cache], remap[rows.qkv], remap[n.inputs[2]],
                                       *weight), attrs)
        blk = blocks.get(i)
        if blk is None:
            return None
        last = (remap[blk.k_norm],) if blk.attrs.k_eq_v else ()
        ins = (blk.qkv, blk.positions, blk.cache_len, blk.q_norm)
        return b.add(Op.ATTENTION_BLOCK, (*(remap[j] for j in ins),
                                          *(remap[c] for c in blk.caches), *last), blk.attrs)

    return drop_unread(rewrite_indexed(g, rule))


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
