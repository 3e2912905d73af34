"""IR-to-IR passes. Each module exposes `run(ir: ModelIR) -> ModelIR` and states what it expects
and guarantees; `weight_math` holds the per-tensor functions the build applies while streaming."""

from dataclasses import replace

from rvcompile.ir.graph import readers


def rewrite_graphs(ir, rewrite_graph, name: str):
    """`rewrite_graph` applied to every graph of `ir`: `ir` itself when no graph changed, else
    the new IR with `name` appended to its notes (for passes that only rewrite graphs)."""
    out = ir.with_graphs(rewrite_graph)
    if all(a is b for a, b in zip(out.graphs(), ir.graphs(), strict=True)):
        return ir
    return replace(out, notes=(*ir.notes, name))


def read_only_inside(g, inner, cluster) -> bool:
    """Whether the nodes `inner` are read only by nodes of `cluster` (a fusion that replaces
    `cluster` must leave nothing reading what it swallows) and are no graph outputs."""
    users = readers(g)
    outputs = {i for _, i in g.outputs}
    return all(i not in outputs and set(users[i]) <= set(cluster) for i in inner)
