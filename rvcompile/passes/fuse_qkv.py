"""Q/K/V projection fusion: the attention projections of one input as one GEMM. Expects any
ModelIR, whatever its weight dtypes; run it after the dtype passes (quantize_int8 looks for
LINEARs, and after this pass q/k/v weights are no longer LINEAR inputs).

Finds, per graph, the dense LINEARs that read the same input x, have PARAM weights (and PARAM
scales, all of them or none), and are read only by RESHAPEs (the split into heads: that is what
tells the attention projections from an MLP's gate and up, which read one input too). Two or
three of them become one `MULTI_LINEAR(x, W1, W2[, W3][, s1, s2[, s3]])` producing their outputs
concatenated on the last axis, in graph order, and each original LINEAR becomes
`SLICE_LAST(multi)` of its own columns, feeding its readers as before. A Gemma 4 layer with its
own KV has q, k, v (q, k for K=V); a KV-shared layer has q alone and is left as it is.

Guarantees: the graph computes the same bits (the op's reference is ref_linear per weight);
weights, ParamSpecs and caches are untouched. Returns `ir` itself when nothing matched.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.ir.graph import Graph, ModelIR, Node, rewrite_nodes
from rvcompile.ir.ops import MultiLinearAttrs, Op, SliceLastAttrs
from rvcompile.passes import rewrite_graphs

NAME = "fuse_qkv"


@dataclass(frozen=True)
class _Group:
    x: int  # the shared input (old graph index)
    members: tuple[int, ...]  # the LINEARs, in graph order (old graph indices)


def _groups(g: Graph) -> list[_Group]:
    readers: dict[int, list[Node]] = {i: [] for i in range(len(g.nodes))}
    for n in g.nodes:
        for j in n.inputs:
            readers[j].append(n)
    outputs = {i for _, i in g.outputs}
    by_input: dict[int, list[int]] = {}
    for i, n in enumerate(g.nodes):
        if (n.op is Op.LINEAR and n.attrs.role == "dense" and i not in outputs
                and all(g.nodes[j].op is Op.PARAM for j in n.inputs[1:])
                and readers[i] and all(r.op is Op.RESHAPE for r in readers[i])):
            by_input.setdefault(n.inputs[0], []).append(i)
    return [
        _Group(x, tuple(members)) for x, members in by_input.items()
        if 2 <= len(members) <= 3 and len({len(g.nodes[i].inputs) for i in members}) == 1
    ]


def fuse_graph(g: Graph) -> Graph:
    groups = _groups(g)
    if not groups:
        return g
    # A member is found by (input, weight name): PARAM names are unique within a graph.
    slot: dict[tuple[int, str], tuple[_Group, int, int]] = {}
    for grp in groups:
        start = 0
        for i in grp.members:
            n = g.nodes[i]
            slot[(n.inputs[0], g.nodes[n.inputs[1]].attrs.name)] = (grp, start, start + n.shape[-1])
            start += n.shape[-1]
    multi: dict[int, int] = {}  # group input -> its MULTI_LINEAR in the new graph

    def leaf(b, i: int) -> int:
        p = g.nodes[i]
        return b.leaf(Op.PARAM, p.attrs.name, p.shape, p.dtype)

    def rule(b, n, ins):
        if n.op is not Op.LINEAR or g.nodes[n.inputs[1]].op is not Op.PARAM:
            return None
        found = slot.get((n.inputs[0], g.nodes[n.inputs[1]].attrs.name))
        if found is None:
            return None
        grp, start, stop = found
        if grp.x not in multi:  # the first member: every weight is a PARAM, placeable here
            members = [g.nodes[i] for i in grp.members]
            weights = [leaf(b, m.inputs[1]) for m in members]
            scales = [leaf(b, m.inputs[2]) for m in members if len(m.inputs) == 3]
            multi[grp.x] = b.add(Op.MULTI_LINEAR, (ins[0], *weights, *scales),
                                 MultiLinearAttrs(len(members)))
        return b.add(Op.SLICE_LAST, (multi[grp.x],), SliceLastAttrs(start, stop))

    return rewrite_nodes(g, rule)


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
