"""Residual add + post-norm fusion (+ layer_scalar). Expects any ModelIR, whatever its weight
dtypes; run it after the dtype passes (they rewrite LINEAR/EMBED weights, not this op's).

Rewrites `ADD(h, RMSNORM(x, w))`, where the RMSNORM has a weight, is read by that ADD alone and
h has x's shape, into `RESIDUAL_RMSNORM(h, x, w)` = h + rmsnorm(x) * w. When that result is read
only by `MUL(result, s)` with s a PARAM of shape [1] (a layer's layer_scalar), the MUL is folded
in: `RESIDUAL_RMSNORM(h, x, w, s)` = (h + rmsnorm(x) * w) * s.

In a Gemma 4 layer it fires on the post-attention, post-feedforward and PLE post-norm adds (the
last add of a layer takes the layer_scalar), and in an MoE layer also on the add of its two
branches, ADD(post_ffw_norm_1(f), post_ffw_norm_2(moe)).

Guarantees: the graph computes the same bits (the op's reference runs the same float32 steps);
weights, ParamSpecs and caches are untouched; the nodes fused away are dropped. Returns `ir`
itself when nothing matched (so a second run returns its input).
"""

from __future__ import annotations

from rvcompile.ir.graph import Graph, ModelIR, drop_unread, rewrite_nodes, use_counts
from rvcompile.ir.ops import Op
from rvcompile.passes import rewrite_graphs

NAME = "fuse_residual_norm"


def fuse_graph(g: Graph) -> Graph:
    uses = use_counts(g)

    def rule(b, n, ins):
        # Old-graph nodes (g, n.inputs) decide whether it matches; the rebuilt nodes (b.nodes,
        # ins) give the fused op its inputs. The bypassed nodes become unread and are dropped.
        if n.op is Op.ADD:
            h, norm = (g.nodes[i] for i in n.inputs)
            if (norm.op is Op.RMSNORM and len(norm.inputs) == 2 and uses[n.inputs[1]] == 1
                    and h.shape == norm.shape):
                x, w = b.nodes[ins[1]].inputs
                return b.add(Op.RESIDUAL_RMSNORM, (ins[0], x, w), norm.attrs)
        if n.op is Op.MUL:
            res, s = b.nodes[ins[0]], g.nodes[n.inputs[1]]
            if (res.op is Op.RESIDUAL_RMSNORM and len(res.inputs) == 3
                    and uses[n.inputs[0]] == 1 and s.op is Op.PARAM and s.shape == (1,)):
                return b.add(Op.RESIDUAL_RMSNORM, (*res.inputs, ins[1]), res.attrs)
        return None

    return drop_unread(rewrite_nodes(g, rule))


def run(ir: ModelIR) -> ModelIR:
    return rewrite_graphs(ir, fuse_graph, NAME)
