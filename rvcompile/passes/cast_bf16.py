"""bf16 cast. Expects a float32 ModelIR. Guarantees: every PARAM with 2+ dims (matrices, tables,
expert stacks) is stored as bfloat16; vectors (norm weights, layer_scalar, router scales) stay
float32; KV caches are bfloat16; embedding multipliers are rounded to bf16, as transformers does
for a bf16 checkpoint (sqrt(5376) becomes 73.5). Activations stay float32 between ops."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from rvcompile.ir.graph import CACHE_ARGS, Graph, ModelIR, rewrite_nodes
from rvcompile.ir.ops import EmbedAttrs, Op, to_bf16


def _is_matrix(shape) -> bool:
    return len(shape) >= 2


def _cast_graph(g: Graph) -> Graph:
    def rule(b, n, ins):
        if n.op is Op.PARAM and n.dtype == "float32" and _is_matrix(n.shape):
            return b.param(n.attrs.name, n.shape, "bfloat16")
        if n.op is Op.ARG and n.attrs.name in CACHE_ARGS and n.dtype == "float32":
            return b.arg(n.attrs.name, n.shape, "bfloat16")
        if n.op is Op.EMBED:
            m = float(to_bf16(np.float32(n.attrs.multiplier)))
            if m != n.attrs.multiplier:
                return b.add(Op.EMBED, ins, EmbedAttrs(m))
        return None

    return rewrite_nodes(g, rule)


def run(ir: ModelIR) -> ModelIR:
    params = tuple(
        replace(p, dtype="bfloat16", derive="bf16")
        if p.dtype == "float32" and _is_matrix(p.shape) else p
        for p in ir.params
    )
    caches = tuple(replace(c, dtype="bfloat16") for c in ir.caches)
    out = replace(ir.with_graphs(_cast_graph), params=params, caches=caches,
                  notes=(*ir.notes, "cast_bf16"))
    return out
