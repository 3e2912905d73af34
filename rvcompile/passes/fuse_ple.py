"""Per-layer-input (PLE) fusion: how the embed graph makes the per-layer inputs and how each layer
uses its own, each as one op. Expects any ModelIR whose per-layer table is not quantized (an
EMBED of two inputs), whatever its other weight dtypes; run it after the dtype passes (they look
for LINEARs) and after fuse_gated_mlp (whose pattern this one's would otherwise overlap).

Rewrites, as the front end emits them:
- `SCALE(ADD(RMSNORM(RESHAPE(SCALE(ctx)), w), RESHAPE(EMBED(table, ids))))`, the embed graph's
  "ple" [B,T,L,P] from ctx = the model projection of h [B,T,L*P], into
  `PLE_EMBED(ctx, table, ids, w)`; the projection's LINEAR stays;
- `LINEAR(MUL(GELU_TANH(gate), ple), W[, s])`, ple a layer's ARG "ple", into
  `PLE_PROJECTION(gate, ple, W[, s])`; the gate's LINEAR stays.
Either fuses only when none of the swallowed nodes is read from outside it.

Guarantees: the graph computes the same bits (the new ops' references are the replaced ops'
references in the same order); weights, ParamSpecs and caches are untouched; the nodes fused
away are dropped. Returns `ir` itself when nothing matched.
"""

from __future__ import annotations

from rvcompile.ir.graph import Graph, ModelIR, Node, drop_unread, rewrite_indexed
from rvcompile.ir.ops import Op, PleEmbedAttrs
from rvcompile.passes import read_only_inside, rewrite_graphs

NAME = "fuse_ple"


def _chain(g: Graph, i: int, ops: tuple[Op, ...]) -> list[int] | None:
    """Node i and its first inputs, if they are of `ops` in turn."""
    out = []
    for op in ops:
        if g.nodes[i].op is not op:
            return None
        out.append(i)
        i = g.nodes[i].inputs[0] if g.nodes[i].inputs else i
    return out


def _ple_embed(g: Graph, idx: int) -> tuple[tuple[int, ...], PleEmbedAttrs] | None:
    """(PLE_EMBED inputs, attrs) for the SCALE at idx, or None."""
    nodes = g.nodes
    add = _chain(g, idx, (Op.SCALE, Op.ADD))
    if add is None:
        return None
    left, right = nodes[add[1]].inputs
    ctx = _chain(g, left, (Op.RMSNORM, Op.RESHAPE, Op.SCALE))
    tok = _chain(g, right, (Op.RESHAPE, Op.EMBED))
    if ctx is None or tok is None:
        return None
    norm, reshape_c, scale_c = (nodes[i] for i in ctx)
    embed = nodes[tok[1]]
    shape = nodes[ctx[1]].shape
    if (len(norm.inputs) != 2 or len(embed.inputs) != 2 or len(shape) != 4
            or nodes[tok[0]].shape != shape or nodes[norm.inputs[1]].op is not Op.PARAM
            or nodes[embed.inputs[0]].op is not Op.PARAM):
        return None
    inner = {*add, *ctx, *tok}
    if not read_only_inside(g, inner - {idx}, inner):
        return None
    attrs = PleEmbedAttrs(shape[2], shape[3], scale_c.attrs.value, embed.attrs.multiplier,
                          nodes[idx].attrs.value, norm.attrs.eps)
    return (scale_c.inputs[0], *embed.inputs, norm.inputs[1]), attrs


def _ple_projection(g: Graph, idx: int) -> tuple[int, ...] | None:
    """PLE_PROJECTION's inputs for the LINEAR at idx, or None."""
    nodes = g.nodes
    lin: Node = nodes[idx]
    mul_i = lin.inputs[0]
    if lin.attrs.role != "dense" or nodes[mul_i].op is not Op.MUL:
        return None
    gelu_i, ple = nodes[mul_i].inputs
    if (nodes[gelu_i].op is not Op.GELU_TANH or nodes[ple].op is not Op.ARG
            or nodes[ple].attrs.name != "ple"
            or any(nodes[i].op is not Op.PARAM for i in lin.inputs[1:])):
        return None
    if not read_only_inside(g, {mul_i, gelu_i}, {idx, mul_i}):
        return None
    return (nodes[gelu_i].inputs[0], ple, *lin.inputs[1:])


def fuse_graph(g: Graph) -> Graph:
    found: dict[int, tuple[Op, tuple[int, ...], PleEmbedAttrs | None]] = {}
    for i, n in enumerate(g.nodes):
        if n.op is Op.SCALE and (m := _ple_embed(g, i)) is not None:
            found[i] = (Op.PLE_EMBED, *m)
        elif n.op is Op.LINEAR and (ins := _ple_projection(g, i)) is not None:
            found[i] = (Op.PLE_PROJECTION, ins, None)
    if not found:
        return g

    def rule(b, i, remap):
        if i not in found:
            return None
        op, ins, attrs = found[i]
        return b.add(op, tuple(remap[j] for j in ins), attrs)

    return drop_unread(rewrite_indexed(g, rule))


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
