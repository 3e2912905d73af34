"""Gated MLP fusion: gate and up projections with GELU-tanh(gate) * up as one op. Expects any
ModelIR, whatever its weight dtypes; run it after the dtype passes (quantize_int8 looks for
LINEARs, and after this pass the MLP's gate and up weights are no longer LINEAR inputs).

Rewrites `MUL(GELU_TANH(LINEAR(m, Wg[, sg])), LINEAR(m, Wu[, su]))`, where both LINEARs read the
same m, are dense (not routers), both have a scale or neither (an int8 weight comes with its
scale) and each of the LINEARs and the GELU_TANH is read only by the next step of the pattern,
into `GATED_LINEAR(m, Wg, Wu[, sg, su])`. The weights stay two separate PARAMs. It fires once
per Gemma 4 layer (the dense MLP; an MoE layer's experts are already one MOE op).

Guarantees: the graph computes the same bits (the op's reference is ref_linear twice, gelu_tanh
and the MUL's float32 product); weights, ParamSpecs and caches are untouched; the nodes fused
away are dropped. Returns `ir` itself when nothing matched.
"""

from __future__ import annotations

from rvcompile.ir.graph import Graph, ModelIR, Node, drop_unread, rewrite_nodes, use_counts
from rvcompile.ir.ops import Op
from rvcompile.passes import rewrite_graphs

NAME = "fuse_gated_mlp"


def _dense_linear(n: Node) -> bool:
    return n.op is Op.LINEAR and n.attrs.role == "dense"


def fuse_graph(g: Graph) -> Graph:
    uses = use_counts(g)

    def matches(n: Node) -> bool:
        gelu_i, up_i = n.inputs
        gelu, up = g.nodes[gelu_i], g.nodes[up_i]
        if gelu.op is not Op.GELU_TANH or not _dense_linear(up):
            return False
        gate_i = gelu.inputs[0]
        gate = g.nodes[gate_i]
        return (_dense_linear(gate) and gate.inputs[0] == up.inputs[0]
                and len(gate.inputs) == len(up.inputs) and gate.shape == up.shape
                and uses[gate_i] == uses[gelu_i] == uses[up_i] == 1)

    def rule(b, n, ins):
        # Matched on the old graph; the rebuilt LINEARs (b.nodes) give the fused op its inputs.
        if n.op is not Op.MUL or not matches(n):
            return None
        m, wg, *sg = b.nodes[b.nodes[ins[0]].inputs[0]].inputs
        _, wu, *su = b.nodes[ins[1]].inputs
        return b.add(Op.GATED_LINEAR, (m, wg, wu, *sg, *su))

    return drop_unread(rewrite_nodes(g, rule))


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
