"""MoE block fusion: an MoE layer's router chain, experts and branch sum as one op. Expects a
ModelIR after fuse_residual_norm (the branch sum is its RESIDUAL_RMSNORM), whatever its weight
dtypes (float, or the experts quantized with per-row scales).

Rewrites, as the front end emits an MoE layer's feed-forward (r the residual, f the dense MLP's
output), `RESIDUAL_RMSNORM(RMSNORM(f, w1), MOE(RMSNORM(r, w_e), LINEAR_router(SCALE(MUL(
RMSNORM(r), router.scale)), W_r), per_expert_scale, gate_up, down[, scales]), w2)` into
`MOE_BLOCK(r, f, router.scale, W_r, w_e, per_expert_scale, gate_up, down, w1, w2[, gate_up
scale, down scale])`, when every norm has the same eps, every weight is a PARAM and none of the
swallowed nodes is read from outside. It fires once per MoE layer.

Guarantees: the graph computes the same bits (MOE_BLOCK's reference is the replaced ops'
references in the same order); weights, ParamSpecs and caches are untouched; the nodes fused
away are dropped. Returns `ir` itself when nothing matched.
"""

from __future__ import annotations

from dataclasses import dataclass

from rvcompile.ir.graph import Graph, ModelIR, Node, drop_unread, rewrite_indexed
from rvcompile.ir.ops import MoEBlockAttrs, Op
from rvcompile.passes import read_only_inside, rewrite_graphs

NAME = "fuse_moe"


@dataclass(frozen=True)
class _Block:
    attrs: MoEBlockAttrs
    inputs: tuple[int, ...]  # MOE_BLOCK's inputs, old node indices


def _is(n: Node, op: Op, arity: int) -> bool:
    return n.op is op and len(n.inputs) == arity


def _match(g: Graph, idx: int) -> _Block | None:
    """The block whose branch sum is node idx, or None."""
    nodes = g.nodes
    if not _is(nodes[idx], Op.RESIDUAL_RMSNORM, 3):
        return None
    f1_i, moe_i, w2 = nodes[idx].inputs
    f1, moe = nodes[f1_i], nodes[moe_i]
    if not (_is(f1, Op.RMSNORM, 2) and moe.op is Op.MOE):
        return None
    x2_i, logits_i, pes, gate_up, down, *scales = moe.inputs
    x2, logits = nodes[x2_i], nodes[logits_i]
    if not (_is(x2, Op.RMSNORM, 2) and _is(logits, Op.LINEAR, 2)
            and logits.attrs.role == "router"):
        return None
    chain = [logits.inputs[0]]  # SCALE <- MUL <- RMSNORM(r)
    for op, arity in ((Op.SCALE, 1), (Op.MUL, 2), (Op.RMSNORM, 1)):
        if not _is(nodes[chain[-1]], op, arity):
            return None
        chain.append(nodes[chain[-1]].inputs[0])
    scale_i, mul_i, norm_i, r = chain
    if r != x2.inputs[0]:
        return None
    norms = (f1, x2, nodes[norm_i], nodes[idx])
    if len({n.attrs.eps for n in norms}) != 1:
        return None
    inputs = (r, f1.inputs[0], nodes[mul_i].inputs[1], logits.inputs[1], x2.inputs[1], pes,
              gate_up, down, f1.inputs[1], w2, *scales)
    if any(nodes[i].op is not Op.PARAM for i in inputs[2:]):
        return None
    inner = {f1_i, moe_i, x2_i, logits_i, scale_i, mul_i, norm_i}
    if not read_only_inside(g, inner, inner | {idx}):
        return None
    attrs = MoEBlockAttrs(moe.attrs.top_k, f1.attrs.eps, nodes[scale_i].attrs.value,
                          moe.attrs.quantized)
    return _Block(attrs, inputs)


def fuse_graph(g: Graph) -> Graph:
    blocks = {i: blk for i, n in enumerate(g.nodes)
              if n.op is Op.RESIDUAL_RMSNORM and (blk := _match(g, i)) is not None}
    if not blocks:
        return g

    def rule(b, i, remap):
        blk = blocks.get(i)
        if blk is None:
            return None
        return b.add(Op.MOE_BLOCK, tuple(remap[j] for j in blk.inputs), blk.attrs)

    return drop_unread(rewrite_indexed(g, rule))


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
