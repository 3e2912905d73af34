"""Per-output-channel weight quantization, shared by the int8 and FP8 passes. Expects a ModelIR
(float32 or bf16 weights). Guarantees: the weight of every LINEAR (except router projections)
and MoE expert stacks, and with `embeddings` every EMBED table (a tied table is then quantized
once and read by both EMBED and the head's LINEAR; without it the tied head keeps its dtype
too), is stored in `fmt.dtype` with a float32 per-output-row scale over the input axis, as
"<name>.scale". An assistant's graphs are quantized by the same rule (its tied head table like
the target's; its centroid scores, a router, not). Nothing else changes. Run it before the
fusion passes, which hide LINEARs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rvcompile.ir.graph import Graph, ModelIR, ParamSpec, resolve_param, rewrite_nodes
from rvcompile.ir.ops import QUANTIZED_DTYPES, MoEAttrs, Op


@dataclass(frozen=True)
class QuantFormat:
    name: str  # the pass name noted in the IR
    dtype: str  # stored dtype of the values
    derive: str  # ParamSpec.derive prefix: "<derive>_values" / "<derive>_scales"


def _embedding_tables(graphs) -> set[str]:
    return {g.nodes[n.inputs[0]].attrs.name for g in graphs for n in g.nodes
            if n.op is Op.EMBED and g.nodes[n.inputs[0]].op is Op.PARAM}


def _targets(g: Graph, skip: set[str]) -> set[str]:
    """Names of the PARAMs this graph quantizes."""
    names = set()
    for n in g.nodes:
        weights = []
        if n.op is Op.LINEAR and n.attrs.role != "router" and len(n.inputs) == 2:
            weights = [n.inputs[1]]
        elif n.op is Op.EMBED and len(n.inputs) == 2:
            weights = [n.inputs[0]]
        elif n.op is Op.MOE and not n.attrs.quantized:
            weights = [n.inputs[3], n.inputs[4]]
        for i in weights:
            node = g.nodes[i]
            if (node.op is Op.PARAM and node.dtype not in QUANTIZED_DTYPES
                    and node.attrs.name not in skip):
                names.add(node.attrs.name)
    return names


def _quantize_graph(g: Graph, targets: set[str], dtype: str) -> Graph:
    def qparam(b, name, shape):
        return b.param(name, shape, dtype), b.param(name + ".scale", shape[:-1], "float32")

    def rule(b, n, ins):
        if n.op is Op.PARAM and n.attrs.name in targets:
            return b.param(n.attrs.name, n.shape, dtype)
        if n.op is Op.LINEAR and len(ins) == 2 and g.nodes[n.inputs[1]].op is Op.PARAM:
            w = g.nodes[n.inputs[1]]
            if w.attrs.name in targets:
                q, s = qparam(b, w.attrs.name, w.shape)
                return b.add(Op.LINEAR, (ins[0], q, s), n.attrs)
        if n.op is Op.EMBED and len(ins) == 2 and g.nodes[n.inputs[0]].attrs.name in targets:
            t = g.nodes[n.inputs[0]]
            q, s = qparam(b, t.attrs.name, t.shape)
            return b.add(Op.EMBED, (q, ins[1], s), n.attrs)
        if n.op is Op.MOE and not n.attrs.quantized:
            gu, dn = g.nodes[n.inputs[3]], g.nodes[n.inputs[4]]
            gq, gs = qparam(b, gu.attrs.name, gu.shape)
            dq, ds = qparam(b, dn.attrs.name, dn.shape)
            return b.add(Op.MOE, (*ins[:3], gq, dq, gs, ds), MoEAttrs(n.attrs.top_k, True))
        return None

    return rewrite_nodes(g, rule)


def quantize(ir: ModelIR, fmt: QuantFormat, *, embeddings: bool) -> ModelIR:
    skip = set() if embeddings else _embedding_tables([ir.embed]) | _drafter_head(ir)
    outer = _targets(ir.embed, skip) | _targets(ir.head, skip)
    full: set[str] = set(outer)
    for spec, t in zip(ir.config.layers, ir.layer_template, strict=True):
        full |= {resolve_param(rel, spec) for rel in _targets(ir.layers[t], skip)}
    if ir.assistant:
        for g, resolve in ir.assistant.resolved_params():
            full |= {resolve(rel) for rel in _targets(g, skip)}
    params: list[ParamSpec] = []
    for p in ir.params:
        if p.name in full:
            params.append(replace(p, dtype=fmt.dtype, derive=f"{fmt.derive}_values"))
            params.append(ParamSpec(p.name + ".scale", p.shape[:-1], "float32", p.source,
                                    f"{fmt.derive}_scales"))
        else:
            params.append(p)
    layers = tuple(_quantize_graph(g, _targets(g, skip), fmt.dtype) for g in ir.layers)
    assistant = ir.assistant and ir.assistant.with_graphs(
        lambda g: _quantize_graph(g, _targets(g, skip), fmt.dtype))
    return replace(ir, embed=_quantize_graph(ir.embed, outer, fmt.dtype),
                   head=_quantize_graph(ir.head, outer, fmt.dtype),
                   layers=layers, params=tuple(params), notes=(*ir.notes, fmt.name),
                   assistant=assistant)


def _drafter_head(ir: ModelIR) -> set[str]:
    """The assistant's tied head table, which keeps its precision when the target's does."""
    if ir.assistant is None:
        return set()
    return {n.attrs.name for n in ir.assistant.draft_out.nodes
            if n.op is Op.PARAM and n.attrs.name.endswith("embed_tokens.weight")}
