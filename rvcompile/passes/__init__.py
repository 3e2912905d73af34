"""IR-to-IR passes. Each module exposes `run(ir: ModelIR) -> ModelIR` and states what it expects
and guarantees; `weight_math` holds the per-tensor functions the build applies while streaming."""

from dataclasses import replace


def rewrite_graphs(ir, rewrite_graph, name: str):
    """`rewrite_graph` applied to every graph of `ir`: `ir` itself when no graph changed, else
    the new IR with `name` appended to its notes (for passes that only rewrite graphs)."""
    out = ir.with_graphs(rewrite_graph)
    if all(a is b for a, b in zip(out.graphs(), ir.graphs(), strict=True)):
        return ir
    return replace(out, notes=(*ir.notes, name))
